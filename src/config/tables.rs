//! The tables of `config.toml` as the rest of the crate reads them, with their
//! defaults: `[proxy]`, `[log]`, `[[route]]`, `[access]`, `[intercept]` and `[admin]`
//! as written (`[backend]` is in `backend.rs`), and `[defaults]` and `[[limit]]` as [`GroupSettings`] and
//! [`LimitGroup`] once a limit has inherited what it does not set (`mod.rs` does that,
//! as it needs both tables).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::values::{
    AccessRule, ByteSize, ClientRange, ConnectPorts, CostRule, Dur, HostPattern, Rate, RoutePrefix,
    UpstreamUrl,
};

/// `[proxy]`: where tollgate listens and how it talks to upstreams.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Address of the proxy listener (`--listen` overrides it).
    pub listen: SocketAddr,
    /// Ports a CONNECT tunnel may reach.
    pub connect_ports: ConnectPorts,
    /// Longest time to resolve, connect and finish the TLS handshake with an upstream.
    #[serde(deserialize_with = "super::values::timeout")]
    pub connect_timeout: Dur,
    /// Longest time from sending a request upstream (its body's end) to receiving its
    /// response head; also the longest an upstream may leave the body unread.
    #[serde(deserialize_with = "super::values::timeout")]
    pub response_timeout: Dur,
    /// Longest time a client may take to send a request head; it is also how long a
    /// client connection with no request open is kept (HTTP/1.1 keep-alive, and HTTP/2,
    /// which gets a GOAWAY and is dropped after as long again if still idle). It never
    /// cuts a request or response body still under way, nor an open tunnel
    /// (`tests/it/timeouts.rs`).
    #[serde(deserialize_with = "super::values::timeout")]
    pub client_header_timeout: Dur,
    /// How long an idle pooled connection to an upstream is kept for reuse.
    #[serde(deserialize_with = "super::values::timeout")]
    pub upstream_idle_timeout: Dur,
    /// A request or response body that keeps its reader waiting this long without a
    /// byte is cut, in either direction; the upstream connection goes with it.
    #[serde(deserialize_with = "super::values::timeout")]
    pub body_idle_timeout: Dur,
    /// The memory all request bodies held for replay may take together; a body that
    /// does not fit streams once, without replay.
    pub replay_memory: ByteSize,
    /// Extra PEM root certificates trusted for upstream TLS, beside the public web roots.
    pub ca_file: Option<PathBuf>,
    /// After SIGTERM/SIGINT, how long in-flight requests and tunnels may take to finish.
    pub shutdown_grace: Dur,
    /// Whether responses carry `Server-Timing: tollgate;desc="queue";dur=<ms>`.
    pub server_timing: bool,
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
            body_idle_timeout: Dur::secs(60),
            replay_memory: ByteSize(256 << 20),
            ca_file: None,
            shutdown_grace: Dur::secs(30),
            server_timing: false,
        }
    }
}

/// `[log]`: what tollgate writes to its log besides events.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// One line per request (the `access` target, at `info`).
    pub access: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { access: true }
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
    /// Asks for the pace to follow the upstream's push-back (docs/budget.md); every
    /// group does, and the key stays for the configs that say so.
    pub adaptive: bool,
    /// The floor of the pace learned from push-back.
    pub min_rate: Option<Rate>,
    /// With the Redis backend: count in-flight requests across all replicas (leases in
    /// Redis) instead of per replica.
    pub shared_concurrency: bool,
    /// Token budgets, for a group that calls an LLM API.
    pub tokens: super::TokenSettings,
    /// Budgets per key, and fair queues within one.
    pub keys: super::KeySettings,
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
            tokens: super::TokenSettings::default(),
            keys: super::KeySettings::default(),
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

    /// Units of cost per second the slowest of the rates allows; `None` without a rate.
    pub fn slowest_rate(&self) -> Option<f64> {
        self.rates.iter().map(Rate::per_second).reduce(f64::min)
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

/// `[access]`: where requests may go, and who may send them.
///
/// Destinations that are not public unicast addresses (loopback, private ranges,
/// link-local and cloud metadata, ...) are refused unless `allow` names them; `deny`
/// refuses more on top, and wins over `allow`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccessConfig {
    /// Destinations opened on top of the public internet: ranges or host patterns.
    pub allow: Vec<AccessRule>,
    /// Destinations refused whatever else allows them: ranges or host patterns.
    pub deny: Vec<AccessRule>,
    /// An htpasswd file (bcrypt hashes): when set, every request and CONNECT must carry
    /// `Proxy-Authorization: Basic` with one of its users.
    pub users: Option<PathBuf>,
    /// Client addresses that may use the proxy; any when empty.
    pub clients: Vec<ClientRange>,
}

/// `[intercept]`: CONNECT tunnels to these hosts are decrypted, so that every request
/// inside them is limited on its own.
#[derive(Debug, Clone)]
pub struct InterceptConfig {
    /// The CA's certificate, which signs a certificate for each intercepted host.
    pub ca_cert: PathBuf,
    /// The CA's private key.
    pub ca_key: PathBuf,
    /// Hosts whose tunnels are decrypted (every `[[limit]]` host when not written).
    pub hosts: Vec<HostPattern>,
    /// Whether `hosts` came from the `[[limit]]`s: then a host without a port is
    /// decrypted on the web ports only, since a limit's host names no protocol.
    pub web_ports_only: bool,
    /// Hosts never decrypted, whatever `hosts` says (clients that pin certificates).
    pub bypass: Vec<HostPattern>,
}

/// `[admin]`: the listener for metrics and status, kept apart from proxied traffic.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address of the admin listener.
    pub listen: SocketAddr,
}
