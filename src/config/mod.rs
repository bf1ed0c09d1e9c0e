//! `config.toml`: the user's contract.
//!
//! Everything is parsed and checked here, at start, so that the data path never has to
//! handle a malformed setting. Values with a grammar of their own (durations, rates,
//! ports, URLs) are newtypes whose `Deserialize` validates them, so a bad value is reported
//! by `toml` with the exact span it came from; [`Config::parse`] turns that span into
//! `file:line:column`. Checks that need several fields (a route naming an unknown limit
//! group, the same host in two groups) keep the span of the field with [`Spanned`].
//!
//! This file holds [`Config`], its errors, and the checks that span tables (a
//! `[[limit]]` inheriting `[defaults]`, a route naming a limit); the value types are in
//! `values.rs`, the tables in `tables.rs`, and the checks of settings that name
//! something outside the file in `external.rs`. All are re-exported here, so every type
//! is `crate::config::Name` whichever file defines it.

use std::collections::HashSet;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

mod backend;
mod external;
mod keys;
mod source;
mod tables;
mod tokens;
mod values;

pub use backend::{BackendConfig, BackendKind, OnBackendError, RedisAt, RedisTls, RedisUrl};
pub use external::{Place, Places};
pub use keys::{KeySettings, KeySource};
pub use source::Source;
pub use tokens::TokenSettings;

pub use tables::{
    AccessConfig, AdminConfig, GroupSettings, InterceptConfig, LimitGroup, LogConfig, ProxyConfig,
    RouteConfig,
};

pub use values::{
    AccessRule, ByteSize, ClientRange, ConnectPorts, CostRule, Dur, HostPattern, Rate, Rates,
    RoutePrefix, StatusCode, UpstreamUrl,
};

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
    /// Where requests may go, and who may send them.
    pub access: AccessConfig,
    /// Which CONNECT tunnels are decrypted; none when absent.
    pub intercept: Option<InterceptConfig>,
    /// The access log.
    pub log: LogConfig,
    /// Where the settings naming files and servers were written, for their errors.
    pub places: Places,
    /// The file it was loaded from, if any, for a reload.
    pub source: Option<Source>,
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

/// A value that is not what its setting takes, in words for the user; the parser places
/// it at the setting's line and column.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

impl Config {
    /// Reads and checks a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: file.clone(),
            source,
        })?;
        let mut config = Config::parse(&text, &file)?;
        config.source = Some(Source::of(path.into(), &text, &config));
        Ok(config)
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
        let mut config = raw
            .check()
            .map_err(|(span, message)| at(Some(span), message))?;
        config.places = Places::find(text, file);
        Ok(config)
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
    admin: Option<Spanned<AdminConfig>>,
    #[serde(default)]
    backend: Option<Spanned<backend::RawBackend>>,
    #[serde(default)]
    access: AccessConfig,
    #[serde(default)]
    intercept: Option<Spanned<RawIntercept>>,
    #[serde(default)]
    log: LogConfig,
}

/// `[intercept]` as written: the CA files are read and checked by [`RawConfig::check`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIntercept {
    ca_cert: Spanned<PathBuf>,
    ca_key: Spanned<PathBuf>,
    hosts: Option<Vec<HostPattern>>,
    #[serde(default)]
    bypass: Vec<HostPattern>,
}

impl RawIntercept {
    /// Resolves the hosts: every `[[limit]]` host unless `hosts` is written. The CA's
    /// files are read later, by `crate::external`.
    fn resolve(
        self,
        span: Range<usize>,
        limits: &[LimitGroup],
    ) -> Result<InterceptConfig, Located> {
        let web_ports_only = self.hosts.is_none();
        let hosts = self
            .hosts
            .unwrap_or_else(|| limits.iter().flat_map(|l| l.hosts.clone()).collect());
        if hosts.is_empty() {
            return Err((
                span,
                "[intercept] has no hosts to decrypt: list them in hosts, or add [[limit]] groups"
                    .into(),
            ));
        }
        Ok(InterceptConfig {
            ca_cert: self.ca_cert.into_inner(),
            ca_key: self.ca_key.into_inner(),
            hosts,
            web_ports_only,
            bypass: self.bypass,
        })
    }
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
    retry_statuses: Option<Vec<Spanned<StatusCode>>>,
    max_retries: Option<u32>,
    max_pause: Option<Dur>,
    adaptive: Option<Spanned<bool>>,
    min_rate: Option<Spanned<Rate>>,
    shared_concurrency: Option<bool>,
    tokens: Option<Rates>,
    input_tokens: Option<Rates>,
    output_tokens: Option<Rates>,
    llm: Option<crate::llm::Dialect>,
    max_output_tokens: Option<Spanned<u32>>,
    key: Option<Spanned<KeySource>>,
    key_idle: Option<Dur>,
    max_keys: Option<Spanned<usize>>,
    key_labels: Option<Spanned<std::collections::BTreeMap<String, String>>>,
    fair_by: Option<Spanned<KeySource>>,
    weights: Option<std::collections::BTreeMap<String, Spanned<u32>>>,
    flow_queue: Option<Spanned<usize>>,
}

type Located = (Range<usize>, String);

/// The most requests of one group that may be in flight: far beyond any upstream's
/// limit, and within what tokio's semaphore can count.
pub const MAX_CONCURRENCY: usize = 1 << 24;

/// The most requests one group may queue: each holds its client's connection, so a
/// million is already beyond what one process can hold open.
pub const MAX_QUEUE: usize = 1_000_000;

/// The largest `burst`: requests let out back to back after idle time.
pub const MAX_BURST: u32 = 1_000_000;

/// `key` within `1..=max`, or its fallback when not set.
fn within<T: Copy + PartialOrd + From<u8> + std::fmt::Display>(
    value: Option<Spanned<T>>,
    key: &str,
    max: T,
    fallback: T,
) -> Result<T, Located> {
    match value {
        Some(v) if *v.get_ref() < T::from(1) || *v.get_ref() > max => {
            Err((v.span(), format!("{key} must be between 1 and {max}")))
        }
        Some(v) => Ok(v.into_inner()),
        None => Ok(fallback),
    }
}

/// Upstream statuses that may mean "slow down, try again": errors only. A 2xx or 3xx in
/// `retry_statuses` would replay requests the upstream has carried out.
fn retry_statuses(statuses: Vec<Spanned<StatusCode>>) -> Result<Vec<u16>, Located> {
    statuses
        .into_iter()
        .map(|s| match s.get_ref().0 {
            code @ 400..=599 => Ok(code),
            code => Err((
                s.span(),
                format!("retry_statuses may only hold 4xx and 5xx statuses, not {code}"),
            )),
        })
        .collect()
}

impl RawSettings {
    /// These settings over `base`, checked.
    fn resolve(self, base: &GroupSettings, in_defaults: bool) -> Result<GroupSettings, Located> {
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
        let rates = self.rate.map_or_else(|| base.rates.clone(), |r| r.0);
        if let Some(min) = &self.min_rate {
            let slowest = rates.iter().map(Rate::per_second).reduce(f64::min);
            if slowest.is_some_and(|rate| min.get_ref().per_second() > rate) {
                return Err((
                    min.span(),
                    "min_rate is faster than the group's rate: the pace never drops below \
                     min_rate, and never exceeds rate"
                        .into(),
                ));
            }
        }
        let tokens = tokens::RawTokens {
            tokens: self.tokens,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            llm: self.llm,
            max_output_tokens: self.max_output_tokens,
        }
        .resolve(&base.tokens)?;
        Ok(GroupSettings {
            tokens,
            keys: keys::RawKeys {
                key: self.key,
                key_idle: self.key_idle,
                max_keys: self.max_keys,
                key_labels: self.key_labels,
                fair_by: self.fair_by,
                weights: self.weights,
                flow_queue: self.flow_queue,
            }
            .resolve(&base.keys, in_defaults)?,
            rates,
            burst: within(self.burst, "burst", MAX_BURST, base.burst)?,
            concurrency: within(
                self.concurrency,
                "concurrency",
                MAX_CONCURRENCY,
                base.concurrency,
            )?,
            queue: within(self.queue, "queue", MAX_QUEUE, base.queue)?,
            max_wait: self.max_wait.map_or(base.max_wait, |d| d.0),
            costs: if self.costs.is_empty() {
                base.costs.clone()
            } else {
                self.costs.into_iter().map(Spanned::into_inner).collect()
            },
            max_replay_body: self.max_replay_body.map_or(base.max_replay_body, |b| b.0),
            retry_statuses: match self.retry_statuses {
                Some(statuses) => retry_statuses(statuses)?,
                None => base.retry_statuses.clone(),
            },
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
        let defaults = self.defaults.resolve(&GroupSettings::default(), true)?;
        let listen = self.proxy.listen;
        if let Some(admin) = self.admin.as_ref().filter(|a| a.get_ref().listen == listen) {
            return Err((
                admin.span(),
                format!(
                    "[admin] listen and [proxy] listen are both {}: give the admin endpoints \
                     an address of their own",
                    listen
                ),
            ));
        }
        let backend = match self.backend {
            Some(raw) => {
                let span = raw.span();
                raw.into_inner().check(span)?
            }
            None => BackendConfig::default(),
        };

        let limits = check_limits(self.limit, &defaults)?;
        check_routes(&self.route, &limits)?;
        let intercept = match self.intercept {
            Some(raw) => {
                let span = raw.span();
                Some(raw.into_inner().resolve(span, &limits)?)
            }
            None => None,
        };
        Ok(Config {
            intercept,
            log: self.log,
            proxy: self.proxy,
            routes: self.route.into_iter().map(Spanned::into_inner).collect(),
            defaults,
            limits,
            admin: self.admin.map(Spanned::into_inner),
            backend,
            access: self.access,
            places: Places::default(),
            source: None,
        })
    }
}

/// The `[[limit]]` groups, each with a name of its own and hosts no other lists, their
/// settings resolved over `defaults`.
fn check_limits(
    raw: Vec<Spanned<RawSettings>>,
    defaults: &GroupSettings,
) -> Result<Vec<LimitGroup>, Located> {
    let mut limits: Vec<LimitGroup> = Vec::new();
    let mut hosts = HashSet::new();
    for limit in raw {
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
            settings: settings.resolve(defaults, false)?,
        });
    }
    Ok(limits)
}

/// The routes: each prefix once, each `limit` one of `limits`.
fn check_routes(routes: &[Spanned<RouteConfig>], limits: &[LimitGroup]) -> Result<(), Located> {
    let mut prefixes = HashSet::new();
    for route in routes {
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
                    format!(
                        "route {:?} names limit {name:?}, which is not defined (limits: {known:?})",
                        r.prefix.as_str()
                    ),
                ));
            }
        }
    }
    Ok(())
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
    use std::time::Duration;

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
    fn limit_errors_point_at_the_problem() {
        let e = err("[defaults]\nrate = \"10/fortnight\"\n");
        assert!(e.starts_with("t.toml:2:8: invalid rate"), "{e}");
        let e = err("[[limit]]\nname = \"a\"\nhosts = [\"x\"]\nburst = 0\n");
        assert!(
            e.starts_with("t.toml:4:9: burst must be between 1 and"),
            "{e}"
        );
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

    /// Values that parse but make no sense are refused where they are written.
    #[test]
    fn absurd_values_are_refused_with_their_line() {
        let cases = [
            (
                "[defaults]\nmax_wait = \"500000000000y\"\n",
                "2:12:",
                "longer than a year",
            ),
            (
                "[defaults]\nmax_pause = \"366days\"\n",
                "2:13:",
                "longer than a year",
            ),
            (
                "[proxy]\nshutdown_grace = \"2y\"\n",
                "2:18:",
                "longer than a year",
            ),
            (
                "[proxy]\nconnect_timeout = \"0s\"\n",
                "2:19:",
                "timeout of 0",
            ),
            (
                "[proxy]\nresponse_timeout = \"0ms\"\n",
                "2:20:",
                "timeout of 0",
            ),
            (
                "[proxy]\nclient_header_timeout = \"0s\"\n",
                "2:25:",
                "timeout of 0",
            ),
            (
                "[proxy]\nupstream_idle_timeout = \"0s\"\n",
                "2:25:",
                "timeout of 0",
            ),
            ("[backend]\ntimeout = \"0s\"\n", "2:11:", "timeout of 0"),
            (
                "[defaults]\nburst = 4294967295\n",
                "2:9:",
                "between 1 and 1000000",
            ),
            (
                "[defaults]\nqueue = 1000001\n",
                "2:9:",
                "between 1 and 1000000",
            ),
            ("[defaults]\nqueue = 0\n", "2:9:", "between 1 and 1000000"),
            (
                "[defaults]\nconcurrency = 16777217\n",
                "2:15:",
                "between 1 and 16777216",
            ),
            (
                "[defaults]\nretry_statuses = [429, 200]\n",
                "2:24:",
                "not 200",
            ),
            ("[defaults]\nretry_statuses = [304]\n", "2:19:", "not 304"),
            (
                "[defaults]\nrate = \"1/2y\"\n",
                "2:8:",
                "longer than a year",
            ),
            (
                "[defaults]\nrate = \"5/s\"\nmin_rate = \"10/s\"\n",
                "3:12:",
                "min_rate is faster than the group's rate",
            ),
            (
                "[proxy]\nlisten = \"127.0.0.1:9000\"\n\n[admin]\nlisten = \"127.0.0.1:9000\"\n",
                "4:1:",
                "both 127.0.0.1:9000",
            ),
        ];
        for (text, at, says) in cases {
            let e = err(text);
            assert!(e.starts_with(&format!("t.toml:{at}")), "{text}: {e}");
            assert!(e.contains(says), "{text}: {e}");
        }
        // The largest values are accepted.
        let c = Config::parse(
            "[defaults]\nmax_wait = \"365days\"\nburst = 1000000\nqueue = 1000000\n\
             retry_statuses = [400, 599]\n",
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.defaults.queue, MAX_QUEUE);
    }

    #[test]
    fn intercept_decrypts_the_limits_hosts_unless_told_its_own() {
        // The CA's files are read later (`crate::external`), not here.
        let (cert, key) = (Path::new("ca.pem"), Path::new("ca.key"));
        let table = |cert: &Path, key: &Path, rest: &str| {
            format!(
                "[[limit]]\nname = \"gh\"\nhosts = [\"api.github.com\"]\n\n[intercept]\nca_cert = {:?}\nca_key = {:?}\n{rest}",
                cert.display().to_string(),
                key.display().to_string()
            )
        };
        // Every [[limit]] host unless hosts is written.
        let c = Config::parse(&table(cert, key, ""), "t.toml").unwrap();
        let i = c.intercept.unwrap();
        assert_eq!(i.hosts, [HostPattern::Exact("api.github.com".into())]);
        let c = Config::parse(
            &table(
                cert,
                key,
                "hosts = [\"*.stripe.com\"]\nbypass = [\"x.stripe.com\"]",
            ),
            "t.toml",
        )
        .unwrap();
        let i = c.intercept.unwrap();
        assert_eq!(i.hosts, [HostPattern::Suffix(".stripe.com".into())]);
        assert_eq!(i.bypass, [HostPattern::Exact("x.stripe.com".into())]);

        let e = err(&format!(
            "[intercept]\nca_cert = {:?}\nca_key = {:?}\n",
            cert.display().to_string(),
            key.display().to_string()
        ));
        assert!(
            e.starts_with("t.toml:1:1:") && e.contains("no hosts to decrypt"),
            "{e}"
        );
    }
}
