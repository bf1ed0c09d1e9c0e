//! `config.toml`: the user's contract.
//!
//! Everything is parsed and checked here, at start, so that the data path never has to
//! handle a malformed setting. Values with a grammar of their own (durations, rates,
//! ports, URLs) are newtypes whose `Deserialize` validates them, so a bad value is reported
//! by `toml` with the exact span it came from; [`Config::parse`] turns that span into
//! `file:line:column`. Checks that need several fields (a route naming an unknown limit
//! group, the same host in two groups) keep the span of the field with [`Spanned`].

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::uri::{Scheme, Uri};
use serde::de::{self, Deserializer};
use serde::Deserialize;
use toml::Spanned;

/// The whole configuration file.
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// The proxy listener and its connections.
    pub proxy: ProxyConfig,
    /// Gateway routes: `/prefix/...` on the proxy → an upstream base URL.
    pub routes: Vec<RouteConfig>,
    /// Settings for hosts that match no `[[limit]]`, and defaults for those that do.
    pub defaults: GroupSettings,
    /// Named groups of hosts sharing one budget, with their settings resolved.
    pub limits: Vec<LimitGroup>,
    /// The admin listener (`/metrics`, `/healthz`, `/status`); off when absent.
    pub admin: Option<AdminConfig>,
    /// Where limit state lives: in this process, or in Redis shared by replicas.
    pub backend: BackendConfig,
}

/// `[backend]`: where limit state lives.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackendConfig {
    /// `memory` (this process only) or `redis` (shared by every replica using it).
    pub kind: BackendKind,
    /// `redis://[:password@]host:port/db` or `rediss://` for TLS.
    pub url: Option<RedisUrl>,
    /// Prefix of every key tollgate writes.
    pub key_prefix: String,
    /// The longest a request waits for Redis before tollgate treats it as down.
    pub timeout: Dur,
    /// What to do while Redis is unreachable.
    pub on_backend_error: OnBackendError,
    /// How many replicas share the budget, for the local fallback (rate / replicas);
    /// by default, the replicas seen alive in Redis recently.
    pub replicas: Option<u32>,
}

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig {
            kind: BackendKind::Memory,
            url: None,
            key_prefix: "tollgate:".into(),
            timeout: Dur(Duration::from_millis(50)),
            on_backend_error: OnBackendError::Local,
            replicas: None,
        }
    }
}

/// Where limit state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// In this process.
    Memory,
    /// In Redis, shared by replicas.
    Redis,
}

/// What requests get while the shared store is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBackendError {
    /// Keep serving with local limits at rate / replicas.
    Local,
    /// Refuse with 503.
    Deny,
}

/// A Redis URL, checked for its scheme.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl(pub String);

impl<'de> Deserialize<'de> for RedisUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if !(text.starts_with("redis://") || text.starts_with("rediss://")) {
            return Err(de::Error::custom(format!(
                "invalid Redis URL {text:?}: expected redis://[:password@]host:port/db or rediss://..."
            )));
        }
        Ok(RedisUrl(text))
    }
}

/// `[proxy]`: where tollgate listens and how it talks to upstreams.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Address of the proxy listener (`--listen` overrides it).
    pub listen: SocketAddr,
    /// Ports a CONNECT tunnel may reach.
    pub connect_ports: ConnectPorts,
    /// Longest time to resolve, connect and finish the TLS handshake with an upstream.
    pub connect_timeout: Dur,
    /// Longest time from sending a request upstream to receiving its response head. It
    /// is checked every eighth of its value, at most every second, so it fires up to that
    /// much late (`coarse_timer` says why).
    pub response_timeout: Dur,
    /// Longest time a client may take to send a request head; it is also how long a
    /// client connection with no request open is kept (HTTP/1.1 keep-alive, and HTTP/2,
    /// which gets a GOAWAY and is dropped after as long again if still idle). On HTTP/1
    /// it is checked every eighth of its value, at most every second, so it fires up to
    /// that much late (`coarse_timer` says why). It never cuts a request or response
    /// body still under way, nor an open tunnel (`tests/timeouts.rs`).
    pub client_header_timeout: Dur,
    /// How long an idle pooled connection to an upstream is kept for reuse.
    pub upstream_idle_timeout: Dur,
    /// Extra PEM root certificates trusted for upstream TLS, beside the public web roots.
    pub ca_file: Option<PathBuf>,
    /// After SIGTERM/SIGINT, how long in-flight requests and tunnels may take to finish.
    pub shutdown_grace: Dur,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            connect_ports: ConnectPorts::Only(vec![443]),
            connect_timeout: Dur::secs(10),
            response_timeout: Dur::secs(60),
            client_header_timeout: Dur::secs(30),
            upstream_idle_timeout: Dur::secs(90),
            ca_file: None,
            shutdown_grace: Dur::secs(30),
        }
    }
}

/// `[[route]]`: a gateway route.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Path prefix on the proxy, always starting and ending with `/`.
    pub prefix: RoutePrefix,
    /// Base URL the rest of the path is appended to.
    pub upstream: UpstreamUrl,
    /// The `[[limit]]` group this route's requests count against; by default the
    /// group of the upstream's host.
    #[serde(default)]
    pub limit: Option<String>,
}

/// `[admin]`: the listener for metrics and status, kept apart from proxied traffic.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address of the admin listener.
    pub listen: SocketAddr,
}

/// A group's settings, resolved: a `[[limit]]`'s own values over `[defaults]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSettings {
    /// Rates that must all allow a request; empty means no rate limit.
    pub rates: Vec<Rate>,
    /// Requests that may leave back to back after idle time.
    pub burst: u32,
    /// Requests in flight at once (a permit is held until the response body ends).
    pub concurrency: usize,
    /// Requests that may wait in the queue; past that, new ones get 503.
    pub queue: usize,
    /// The longest one request may wait in the queue.
    pub max_wait: Duration,
    /// Request weights by method and path prefix; the first matching rule wins.
    pub costs: Vec<CostRule>,
    /// Request bodies up to this size are read before queueing, so a client that
    /// leaves while queued is noticed (and the request can be replayed).
    pub max_replay_body: u64,
    /// Upstream statuses that mean "slow down": they pause the group, and the request
    /// is retried. A 503 without `Retry-After` is passed through (a real outage).
    pub retry_statuses: Vec<u16>,
    /// How many times one request is retried after push-back before the client gets
    /// the upstream's answer.
    pub max_retries: u32,
    /// The longest pause an upstream can impose (and the cap of the fallback backoff).
    pub max_pause: Duration,
    /// Halve the effective rate on each push-back and climb back when calm.
    pub adaptive: bool,
    /// The floor of the adaptive rate.
    pub min_rate: Option<Rate>,
    /// With the Redis backend: count in-flight requests across all replicas (leases in
    /// Redis) instead of per replica.
    pub shared_concurrency: bool,
}

impl Default for GroupSettings {
    fn default() -> Self {
        GroupSettings {
            rates: Vec::new(),
            burst: 1,
            concurrency: 256,
            queue: 10_000,
            max_wait: Duration::from_secs(60),
            costs: Vec::new(),
            max_replay_body: 1 << 20,
            retry_statuses: vec![429, 503],
            max_retries: 3,
            max_pause: Duration::from_secs(600),
            adaptive: false,
            min_rate: None,
            shared_concurrency: false,
        }
    }
}

impl GroupSettings {
    /// The cost of a request: the first matching rule's, else 1.
    pub fn cost_of(&self, method: &http::Method, path: &str) -> u32 {
        self.costs
            .iter()
            .find(|rule| rule.matches(method, path))
            .map_or(1, |rule| rule.cost)
    }
}

/// A named group: hosts that share one budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitGroup {
    /// The group's name, shown in metrics, errors and `/status`.
    pub name: String,
    /// Host names or `*.domain` patterns that belong to the group.
    pub hosts: Vec<HostPattern>,
    /// The resolved settings.
    pub settings: GroupSettings,
}

/// A rate: `limit` requests (cost units) per `period`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// How many per period.
    pub limit: u64,
    /// The period.
    pub period: Duration,
}

impl Rate {
    /// Requests (cost units) a second, on average over the period.
    pub fn per_second(&self) -> f64 {
        self.limit as f64 / self.period.as_secs_f64()
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            self.limit,
            humantime::format_duration(self.period)
        )
    }
}

impl std::str::FromStr for Rate {
    type Err = String;

    /// `N/s`, `N/m`, `N/h`, `N/d` or `N/<duration>` such as `100/10s`.
    fn from_str(text: &str) -> Result<Rate, String> {
        let bad = || {
            format!(
                "invalid rate {text:?}: expected \"N/s\", \"N/m\", \"N/h\", \"N/d\", \"N/<duration>\" (e.g. \"100/10s\") or \"unlimited\""
            )
        };
        let (count, per) = text.trim().split_once('/').ok_or_else(bad)?;
        let limit: u64 = count.trim().parse().map_err(|_| bad())?;
        let per = per.trim();
        let period = if per.starts_with(|c: char| c.is_ascii_digit()) {
            humantime::parse_duration(per)
        } else {
            humantime::parse_duration(&format!("1{per}"))
        }
        .map_err(|_| bad())?;
        if limit == 0 || period.is_zero() {
            return Err(format!(
                "invalid rate {text:?}: the count and the period must be above zero"
            ));
        }
        if period / u32::try_from(limit).map_err(|_| bad())? < Duration::from_micros(1) {
            return Err(format!(
                "invalid rate {text:?}: faster than one per microsecond"
            ));
        }
        Ok(Rate { limit, period })
    }
}

/// One rate or several (all must allow), or `"unlimited"`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rates(pub Vec<Rate>);

impl<'de> Deserialize<'de> for Rates {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        let texts = match OneOrMany::deserialize(d).map_err(|_| {
            de::Error::custom("expected a rate like \"10/s\", a list of rates, or \"unlimited\"")
        })? {
            OneOrMany::One(text) if text.trim() == "unlimited" => return Ok(Rates(Vec::new())),
            OneOrMany::One(text) => vec![text],
            OneOrMany::Many(texts) => texts,
        };
        texts
            .iter()
            .map(|t| t.parse().map_err(de::Error::custom))
            .collect::<Result<_, _>>()
            .map(Rates)
    }
}

/// A host name, or `*.domain` for every name under `domain` (not `domain` itself).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// Exactly this host (lower case).
    Exact(String),
    /// Any host ending in `.domain`; holds `.domain`.
    Suffix(String),
}

impl<'de> Deserialize<'de> for HostPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?.trim().to_ascii_lowercase();
        let (pattern, name) = match text.strip_prefix("*.") {
            Some(domain) => (HostPattern::Suffix(format!(".{domain}")), domain),
            None => (HostPattern::Exact(text.clone()), text.as_str()),
        };
        let valid = !name.is_empty()
            && name.chars().all(|c| {
                c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '[' | ']')
            });
        if !valid {
            return Err(de::Error::custom(format!(
                "invalid host {text:?}: expected a host name like \"api.github.com\" or a pattern like \"*.github.com\""
            )));
        }
        Ok(pattern)
    }
}

/// A request weight rule: requests matching `method` and `path_prefix` cost `cost`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostRule {
    /// Only requests with this method (any when absent).
    #[serde(default, deserialize_with = "method")]
    pub method: Option<http::Method>,
    /// Only requests whose upstream path starts with this (any when absent).
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// The cost, in rate units (≥ 1).
    pub cost: u32,
}

impl CostRule {
    fn matches(&self, method: &http::Method, path: &str) -> bool {
        self.method.as_ref().is_none_or(|m| m == method)
            && self
                .path_prefix
                .as_ref()
                .is_none_or(|p| path.starts_with(p.as_str()))
    }
}

fn method<'de, D: Deserializer<'de>>(d: D) -> Result<Option<http::Method>, D::Error> {
    let text = String::deserialize(d)?;
    http::Method::from_bytes(text.to_ascii_uppercase().as_bytes())
        .map(Some)
        .map_err(|_| de::Error::custom(format!("invalid method {text:?}")))
}

/// An HTTP status code (100-599).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusCode(pub u16);

impl<'de> Deserialize<'de> for StatusCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let code = u16::deserialize(d)?;
        if (100..=599).contains(&code) {
            Ok(StatusCode(code))
        } else {
            Err(de::Error::custom(format!(
                "invalid status {code}: expected 100-599"
            )))
        }
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(de::Error::custom)
    }
}

/// A byte size: a number of bytes, or a string like `"512KiB"`, `"1MiB"`, `"10MB"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        let bad = |t: &str| {
            de::Error::custom(format!(
                "invalid size {t:?}: expected bytes as a number or e.g. \"64KiB\", \"1MiB\", \"10MB\""
            ))
        };
        let text = match Raw::deserialize(d).map_err(|_| bad("?"))? {
            Raw::Number(n) => return Ok(ByteSize(n)),
            Raw::Text(text) => text,
        };
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (digits, unit) = t.split_at(split);
        let n: u64 = digits.parse().map_err(|_| bad(&text))?;
        let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kb" => 1000,
            "kib" => 1 << 10,
            "mb" => 1_000_000,
            "mib" => 1 << 20,
            "gb" => 1_000_000_000,
            "gib" => 1 << 30,
            _ => return Err(bad(&text)),
        };
        n.checked_mul(scale).map(ByteSize).ok_or_else(|| bad(&text))
    }
}

/// A duration written the humane way: `"250ms"`, `"10s"`, `"5m"`, `"1h 30m"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl Dur {
    const fn secs(s: u64) -> Self {
        Dur(Duration::from_secs(s))
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(text.trim()).map(Dur).map_err(|e| {
            de::Error::custom(format!(
                "invalid duration {text:?} ({e}): expected a number and a unit, e.g. \"250ms\", \"10s\", \"5m\""
            ))
        })
    }
}

/// Which ports CONNECT may open tunnels to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectPorts {
    /// `["*"]`: any port.
    Any,
    /// Only these ports.
    Only(Vec<u16>),
}

impl ConnectPorts {
    /// Whether a tunnel to `port` is allowed.
    pub fn allows(&self, port: u16) -> bool {
        match self {
            ConnectPorts::Any => true,
            ConnectPorts::Only(ports) => ports.contains(&port),
        }
    }
}

impl<'de> Deserialize<'de> for ConnectPorts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const EXPECTED: &str = "expected a list of port numbers (1-65535) or [\"*\"] for any port";
        let items = Vec::<toml::Value>::deserialize(d)
            .map_err(|e| de::Error::custom(format!("{e}; {EXPECTED}")))?;
        let mut ports = Vec::new();
        for item in &items {
            match item {
                toml::Value::String(s) if s == "*" => return Ok(ConnectPorts::Any),
                toml::Value::Integer(n) if (1..=65535).contains(n) => ports.push(*n as u16),
                other => {
                    return Err(de::Error::custom(format!(
                        "invalid port {other}: {EXPECTED}"
                    )))
                }
            }
        }
        Ok(ConnectPorts::Only(ports))
    }
}

/// A route prefix: starts with `/`; a missing trailing `/` is added so that `/github`
/// never matches `/githubusercontent/...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePrefix(String);

impl RoutePrefix {
    /// The prefix, with its leading and trailing `/`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for RoutePrefix {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut text = String::deserialize(d)?;
        if !text.starts_with('/') || text.contains(['?', '#', ' ']) {
            return Err(de::Error::custom(format!(
                "invalid route prefix {text:?}: expected a path starting with '/', e.g. \"/github/\""
            )));
        }
        if !text.ends_with('/') {
            text.push('/');
        }
        Ok(RoutePrefix(text))
    }
}

/// An upstream base URL: `http://` or `https://`, a host, an optional base path, no query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamUrl {
    /// `http` or `https`.
    pub scheme: Scheme,
    /// `host[:port]` as written (the port is omitted when it is the scheme's default).
    pub authority: http::uri::Authority,
    /// Base path without a trailing `/` (empty for the root).
    pub base_path: String,
}

impl fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.base_path)
    }
}

impl<'de> Deserialize<'de> for UpstreamUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let bad = |why: &str| {
            de::Error::custom(format!(
                "invalid upstream {text:?}: {why}; expected e.g. \"https://api.github.com\""
            ))
        };
        let uri: Uri = text.parse().map_err(|_| bad("not a URL"))?;
        let scheme = uri.scheme().cloned().ok_or_else(|| bad("no scheme"))?;
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(bad("the scheme must be http or https"));
        }
        let authority = uri.authority().cloned().ok_or_else(|| bad("no host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("credentials in the URL are not supported"));
        }
        if uri.query().is_some() {
            return Err(bad("a query string is not allowed"));
        }
        let base_path = uri.path().trim_end_matches('/').to_string();
        Ok(UpstreamUrl {
            scheme,
            authority,
            base_path,
        })
    }
}

/// A configuration that could not be loaded, with where and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read: {source}")]
    Read {
        /// The file name as given.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A value or the TOML syntax is wrong at a known place.
    #[error("{file}:{line}:{column}: {message}")]
    Invalid {
        /// The file name as given.
        file: String,
        /// 1-based line.
        line: usize,
        /// 1-based column (in characters).
        column: usize,
        /// What was wrong and what was expected.
        message: String,
    },
    /// A file that is not tied to one place (e.g. `ca_file`) is unusable.
    #[error("{file}: {message}")]
    Other {
        /// The file name as given.
        file: String,
        /// What was wrong.
        message: String,
    },
}

impl Config {
    /// Reads and checks a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: file.clone(),
            source,
        })?;
        Config::parse(&text, &file)
    }

    /// Parses and checks configuration text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        let at = |span: Option<Range<usize>>, message: String| {
            let (line, column) = line_column(text, span.map_or(0, |s| s.start));
            ConfigError::Invalid {
                file: file.to_string(),
                line,
                column,
                message,
            }
        };
        let raw: RawConfig =
            toml::from_str(text).map_err(|e| at(e.span(), e.message().trim().to_string()))?;
        raw.check()
            .map_err(|(span, message)| at(Some(span), message))
    }
}

/// The file as deserialized, before the checks that span several fields.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    proxy: ProxyConfig,
    #[serde(default)]
    route: Vec<Spanned<RouteConfig>>,
    #[serde(default)]
    defaults: RawSettings,
    #[serde(default)]
    limit: Vec<Spanned<RawSettings>>,
    #[serde(default)]
    admin: Option<AdminConfig>,
    #[serde(default)]
    backend: Option<Spanned<BackendConfig>>,
}

/// A `[defaults]` or `[[limit]]` table as written: every key optional, so a `[[limit]]`
/// inherits what it does not set. `name` and `hosts` only belong in a `[[limit]]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSettings {
    name: Option<Spanned<String>>,
    hosts: Option<Spanned<Vec<HostPattern>>>,
    rate: Option<Rates>,
    burst: Option<Spanned<u32>>,
    concurrency: Option<Spanned<usize>>,
    queue: Option<Spanned<usize>>,
    max_wait: Option<Dur>,
    #[serde(default)]
    costs: Vec<Spanned<CostRule>>,
    max_replay_body: Option<ByteSize>,
    retry_statuses: Option<Vec<StatusCode>>,
    max_retries: Option<u32>,
    max_pause: Option<Dur>,
    adaptive: Option<Spanned<bool>>,
    min_rate: Option<Spanned<Rate>>,
    shared_concurrency: Option<bool>,
}

type Located = (Range<usize>, String);

impl RawSettings {
    /// These settings over `base`, checked.
    fn resolve(self, base: &GroupSettings) -> Result<GroupSettings, Located> {
        fn at_least_one<T: Copy + PartialOrd + From<u8>>(
            value: Option<Spanned<T>>,
            key: &str,
            fallback: T,
        ) -> Result<T, Located> {
            match value {
                Some(v) if *v.get_ref() < T::from(1) => {
                    Err((v.span(), format!("{key} must be at least 1")))
                }
                Some(v) => Ok(v.into_inner()),
                None => Ok(fallback),
            }
        }
        for rule in &self.costs {
            if rule.get_ref().cost == 0 {
                return Err((rule.span(), "cost must be at least 1".into()));
            }
        }
        let rates_set = self
            .rate
            .as_ref()
            .map_or(!base.rates.is_empty(), |r| !r.0.is_empty());
        let adaptive = match &self.adaptive {
            Some(a) if *a.get_ref() && !rates_set => {
                return Err((
                    a.span(),
                    "adaptive = true needs a rate to start from".into(),
                ));
            }
            Some(a) => *a.get_ref(),
            None => base.adaptive,
        };
        Ok(GroupSettings {
            rates: self.rate.map_or_else(|| base.rates.clone(), |r| r.0),
            burst: at_least_one(self.burst, "burst", base.burst)?,
            concurrency: at_least_one(self.concurrency, "concurrency", base.concurrency)?,
            queue: at_least_one(self.queue, "queue", base.queue)?,
            max_wait: self.max_wait.map_or(base.max_wait, |d| d.0),
            costs: if self.costs.is_empty() {
                base.costs.clone()
            } else {
                self.costs.into_iter().map(Spanned::into_inner).collect()
            },
            max_replay_body: self.max_replay_body.map_or(base.max_replay_body, |b| b.0),
            retry_statuses: self.retry_statuses.map_or_else(
                || base.retry_statuses.clone(),
                |s| s.into_iter().map(|c| c.0).collect(),
            ),
            max_retries: self.max_retries.unwrap_or(base.max_retries),
            max_pause: self.max_pause.map_or(base.max_pause, |d| d.0),
            adaptive,
            min_rate: self.min_rate.map(Spanned::into_inner).or(base.min_rate),
            shared_concurrency: self.shared_concurrency.unwrap_or(base.shared_concurrency),
        })
    }
}

impl RawConfig {
    fn check(self) -> Result<Config, Located> {
        if let Some(span) = self
            .defaults
            .name
            .as_ref()
            .map(Spanned::span)
            .or_else(|| self.defaults.hosts.as_ref().map(Spanned::span))
        {
            return Err((
                span,
                "name and hosts belong in a [[limit]], not in [defaults]".into(),
            ));
        }
        let defaults = self.defaults.resolve(&GroupSettings::default())?;
        if let Some(backend) = &self.backend {
            let (span, b) = (backend.span(), backend.get_ref());
            if b.kind == BackendKind::Redis && b.url.is_none() {
                return Err((span, "kind = \"redis\" needs a url".into()));
            }
            if b.replicas == Some(0) {
                return Err((span, "replicas must be at least 1".into()));
            }
        }

        let mut limits: Vec<LimitGroup> = Vec::new();
        let mut hosts = HashSet::new();
        for limit in self.limit {
            let span = limit.span();
            let mut settings = limit.into_inner();
            let name = settings
                .name
                .take()
                .map(Spanned::into_inner)
                .unwrap_or_default();
            let group_hosts = settings
                .hosts
                .take()
                .map(Spanned::into_inner)
                .unwrap_or_default();
            if name.trim().is_empty() {
                return Err((span, "a [[limit]] needs a name".into()));
            }
            if limits.iter().any(|l| l.name == name) {
                return Err((span, format!("limit {name:?} is defined twice")));
            }
            if group_hosts.is_empty() {
                return Err((span, format!("limit {name:?} lists no hosts")));
            }
            for host in &group_hosts {
                if !hosts.insert(host.clone()) {
                    return Err((span, format!("host {host:?} is in two [[limit]] groups")));
                }
            }
            limits.push(LimitGroup {
                name,
                hosts: group_hosts,
                settings: settings.resolve(&defaults)?,
            });
        }

        let mut prefixes = HashSet::new();
        for route in &self.route {
            let r = route.get_ref();
            if !prefixes.insert(r.prefix.as_str().to_string()) {
                return Err((
                    route.span(),
                    format!("route prefix {:?} is defined twice", r.prefix.as_str()),
                ));
            }
            if let Some(name) = &r.limit {
                if !limits.iter().any(|l| &l.name == name) {
                    let known: Vec<&str> = limits.iter().map(|l| l.name.as_str()).collect();
                    return Err((
                        route.span(),
                        format!("route {:?} names limit {name:?}, which is not defined (limits: {known:?})", r.prefix.as_str()),
                    ));
                }
            }
        }
        Ok(Config {
            proxy: self.proxy,
            routes: self.route.into_iter().map(Spanned::into_inner).collect(),
            defaults,
            limits,
            admin: self.admin,
            backend: self.backend.map(Spanned::into_inner).unwrap_or_default(),
        })
    }
}

/// 1-based line and column (in characters) of a byte offset.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        Config::parse(text, "t.toml").unwrap_err().to_string()
    }

    #[test]
    fn empty_file_gives_defaults() {
        let c = Config::parse("", "t.toml").unwrap();
        assert_eq!(c.proxy.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(c.proxy.connect_ports, ConnectPorts::Only(vec![443]));
        assert_eq!(c.proxy.connect_timeout.0, Duration::from_secs(10));
        assert!(c.routes.is_empty());
    }

    #[test]
    fn durations_ports_and_routes_parse() {
        let c = Config::parse(
            r#"
            [proxy]
            connect_timeout = "250ms"
            shutdown_grace = "5m"
            connect_ports = ["*"]
            [[route]]
            prefix = "/gh"
            upstream = "https://api.github.com/v3/"
            "#,
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.proxy.connect_timeout.0, Duration::from_millis(250));
        assert_eq!(c.proxy.shutdown_grace.0, Duration::from_secs(300));
        assert!(c.proxy.connect_ports.allows(22));
        assert_eq!(c.routes[0].prefix.as_str(), "/gh/");
        assert_eq!(c.routes[0].upstream.base_path, "/v3");
        assert_eq!(
            c.routes[0].upstream.to_string(),
            "https://api.github.com/v3"
        );
    }

    #[test]
    fn unknown_key_names_line_and_column() {
        let e = err("[proxy]\nlisten = \"127.0.0.1:1\"\n  conect_timeout = \"1s\"\n");
        assert!(
            e.starts_with("t.toml:3:3: unknown field `conect_timeout`"),
            "{e}"
        );
        assert!(e.contains("expected one of"), "{e}");
    }

    #[test]
    fn bad_values_say_what_was_expected() {
        let e = err("[proxy]\nconnect_timeout = \"10 parsecs\"\n");
        assert!(e.starts_with("t.toml:2:19: invalid duration"), "{e}");
        let e = err("[proxy]\nconnect_ports = [443, 0]\n");
        assert!(e.contains("invalid port 0"), "{e}");
        let e = err("[[route]]\nprefix = \"/a/\"\nupstream = \"ftp://x\"\n");
        assert!(
            e.starts_with("t.toml:3:12:") && e.contains("http or https"),
            "{e}"
        );
        let e = err("[[route]]\nprefix = \"a\"\nupstream = \"http://x\"\n");
        assert!(e.contains("starting with '/'"), "{e}");
    }

    #[test]
    fn duplicate_prefix_is_refused_where_it_is() {
        let e = err("[[route]]\nprefix = \"/a\"\nupstream = \"http://x\"\n\n[[route]]\nprefix = \"/a/\"\nupstream = \"http://y\"\n");
        assert!(e.starts_with("t.toml:5:1:"), "{e}"); // the second [[route]]
        assert!(e.contains("defined twice"), "{e}");
    }

    #[test]
    fn limits_inherit_defaults_and_parse_rates() {
        let c = Config::parse(
            r#"
            [defaults]
            rate = "50/s"
            concurrency = 16
            max_wait = "5s"
            [[limit]]
            name = "github"
            hosts = ["api.github.com", "*.githubusercontent.com"]
            rate = ["10/s", "5000/h", "100/10s"]
            burst = 5
            costs = [{ method = "post", path_prefix = "/search", cost = 5 }]
            [[route]]
            prefix = "/gh/"
            upstream = "https://api.github.com"
            limit = "github"
            "#,
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.defaults.rates[0].limit, 50);
        let gh = &c.limits[0].settings;
        assert_eq!(gh.rates.len(), 3);
        assert_eq!(gh.rates[2].period, Duration::from_secs(10));
        assert_eq!((gh.burst, gh.concurrency, gh.queue), (5, 16, 10_000));
        assert_eq!(gh.max_wait, Duration::from_secs(5));
        assert_eq!(gh.cost_of(&http::Method::POST, "/search/code"), 5);
        assert_eq!(gh.cost_of(&http::Method::GET, "/search/code"), 1);
        assert_eq!(
            c.limits[0].hosts[1],
            HostPattern::Suffix(".githubusercontent.com".into())
        );
        assert_eq!(c.routes[0].limit.as_deref(), Some("github"));
    }

    #[test]
    fn rate_grammar() {
        let r: Rate = "100/10s".parse().unwrap();
        assert_eq!((r.limit, r.period), (100, Duration::from_secs(10)));
        assert_eq!(
            "5/m".parse::<Rate>().unwrap().period,
            Duration::from_secs(60)
        );
        assert_eq!(
            "1/d".parse::<Rate>().unwrap().period,
            Duration::from_secs(86_400)
        );
        for bad in ["10", "0/s", "10/parsec", "x/s", "10/0s"] {
            assert!(bad.parse::<Rate>().is_err(), "{bad}");
        }
    }

    #[test]
    fn limit_errors_point_at_the_problem() {
        let e = err("[defaults]\nrate = \"10/fortnight\"\n");
        assert!(e.starts_with("t.toml:2:8: invalid rate"), "{e}");
        let e = err("[[limit]]\nname = \"a\"\nhosts = [\"x\"]\nburst = 0\n");
        assert!(e.starts_with("t.toml:4:9: burst must be at least 1"), "{e}");
        let e = err("[[limit]]\nname = \"a\"\nhosts = [\"x\"]\nrates = \"1/s\"\n");
        assert!(e.contains("unknown field `rates`"), "{e}");
        let e = err(
            "[[limit]]\nname = \"a\"\nhosts = [\"x\"]\n[[limit]]\nname = \"b\"\nhosts = [\"x\"]\n",
        );
        assert!(
            e.starts_with("t.toml:4:1:") && e.contains("two [[limit]] groups"),
            "{e}"
        );
        let e = err("[[route]]\nprefix = \"/a/\"\nupstream = \"http://x\"\nlimit = \"nope\"\n");
        assert!(
            e.contains("names limit \"nope\", which is not defined"),
            "{e}"
        );
        let e = err("[defaults]\nmax_replay_body = \"1 parsec\"\n");
        assert!(e.contains("invalid size"), "{e}");
    }
}
