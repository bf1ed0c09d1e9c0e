//! The Redis store: limit state shared by every replica that points at one Redis.
//!
//! A third-party limit belongs to an API key, not to one proxy, so replicas must share
//! one budget. Each decision is one Lua script run atomically by Redis with Redis's own
//! clock (`TIME`), so the replicas' clocks never matter:
//!
//! * [`Redis::reserve`] books the next slot of a group's rates (the same GCRA as
//!   [`super::gcra`], in microseconds), its shared pace and its announced window, and
//!   answers how long to wait for it — one round trip per request (two when the slot
//!   is [`RECHECK_AHEAD`](super::store::RECHECK_AHEAD) or more ahead: [`Redis::recheck`]), no polling (but while
//!   another replica probes a new group's upstream, [`Probing`]). The group's pause
//!   and the shared controller's record ([`super::budget`]) are part of the same
//!   decision.
//! * [`Redis::pause`] records an upstream's push-back for every replica.
//! * [`Redis::try_lease`] takes one of a group's concurrency leases (`shared_concurrency
//!   = true`). Leases expire unless renewed, so a replica that crashes returns its share
//!   within [`LEASE_TTL`].
//!
//! Each script takes one JSON document and answers one ([`protocol`]).
//!
//! Keys are `<prefix>{<group>}:...` (the braces keep a group's keys in one Redis Cluster
//! slot) and expire when idle.
//!
//! Redis down, slow or unreachable: a call that fails or takes longer than `timeout`
//! marks the store down (logged once, `tollgate_backend_up 0`); while down, requests do
//! not wait for Redis at all and limits are enforced locally at rate / replicas (or
//! refused, with `on_backend_error = "deny"`), and a background probe marks it up again
//! as soon as Redis answers.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::TcpSettings;
use redis::{IntoConnectionInfo, Script};

use super::budget::Params;
use super::gcra::Gcra;
use crate::config::{BackendConfig, OnBackendError};
use crate::metrics::Metrics;

mod lease;
pub mod protocol;
pub use lease::Lease;
use protocol::{micros, Publish, Rechecked, Record, Reserve, Reserved};

/// How long a concurrency lease lives without renewal.
pub const LEASE_TTL: Duration = Duration::from_secs(10);
/// How often held leases are renewed and this replica says it is alive.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// A replica not heard of for this long no longer counts.
const REPLICA_TTL: Duration = Duration::from_secs(10);
/// How often a store that is down is probed.
const PROBE: Duration = Duration::from_millis(500);
/// How long a group's records (its shared pace, its probe) stay in Redis after its last
/// booking: the replicas keep theirs in memory meanwhile, and publish again when gone.
const RECORD_TTL: Duration = Duration::from_secs(600);
/// How long the group's refusals are kept for [`Redis::recheck`]: longer than any slot
/// is booked ahead of its time, at the rates slots are checked again at all.
const REFUSALS_KEPT: Duration = Duration::from_secs(60);

/// Books the next slot ([`protocol::Reserve`], [`protocol::Reserved`]). KEYS:
/// [`RESERVE_KEYS`], then one TAT per configured rate.
pub const RESERVE: &str = concat!(
    include_str!("redis/budget.lua"),
    include_str!("redis/reserve.lua")
);

/// Whether a slot booked at a time still holds when it comes ([`protocol::Rechecked`]).
/// KEYS: the pause key, the refused set.
const RECHECK: &str = include_str!("redis/recheck.lua");

/// Extends the group's pause and records a refusal ([`protocol::Pause`]). KEYS:
/// [`PAUSE_KEYS`].
pub const PAUSE: &str = concat!(
    include_str!("redis/budget.lua"),
    include_str!("redis/pause.lua")
);

/// Takes a lease if fewer than the limit are live. KEYS: the lease set. ARGV: lease id,
/// limit, lease ms. Returns 1 if taken.
const LEASE: &str = include_str!("redis/lease.lua");

/// Renews leases and counts live replicas. KEYS: the replica set, then one lease set per
/// lease. ARGV: this replica's id, the replica ms, the lease ms, then the lease ids.
/// Returns the number of live replicas.
const HEARTBEAT_SCRIPT: &str = include_str!("redis/heartbeat.lua");

/// The keys of [`RESERVE`] before the rates' TATs, in order, each under the group's
/// prefix (`Redis::key`).
pub const RESERVE_KEYS: [&str; 5] = ["pause", "budget", "rate:learned", "booked", "probe"];
/// The keys of [`PAUSE`], in order, alike.
pub const PAUSE_KEYS: [&str; 4] = ["pause", "refused", "budget", "probe"];

/// A booked slot.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// How long until the request may leave.
    pub wait: Duration,
    /// How long the group stays paused (by any replica's push-back), if it is: then
    /// nothing was booked.
    pub paused_for: Option<Duration>,
    /// The shared controller's record in force, if any replica published one.
    pub shared: Option<Record>,
    /// When it was booked, in µs on Redis's clock ([`Redis::recheck`]).
    pub at: u64,
    /// Who probes the group's upstream.
    pub probing: Probing,
}

/// Who probes the upstream of a group that has learned nothing yet ([`super::budget`]).
/// With replicas, one probes for the group (the first to book while its probe is on)
/// and the others wait for what it learns: one request, not one per replica, meets the
/// upstream first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probing {
    /// Nobody, as far as this booking goes.
    No,
    /// This replica probes for the group.
    ForGroup,
    /// The group's probe is over: this replica's is too.
    Over,
    /// Another replica's is on, for this long at least (a refusal extends it): nothing
    /// was booked.
    Elsewhere(Duration),
}

/// What a booking tells the store besides the rates.
#[derive(Debug, Clone, Default)]
pub struct Booking {
    /// The pace's interval, if the group keeps one.
    pub pace: Option<Duration>,
    /// The announced window: its quota and span, counted over every replica.
    pub window: Option<(u64, Duration)>,
    /// A change of the shared controller to publish.
    pub publish: Option<Publish>,
    /// Whether this replica's probe is on ([`Probing`]).
    pub probing: bool,
    /// Whether this replica learned anything of the upstream.
    pub learned: bool,
}

/// The connection to Redis and what this replica knows about it.
pub struct Redis {
    conn: ConnectionManager,
    prefix: String,
    timeout: Duration,
    /// What requests get while Redis is down.
    pub on_error: OnBackendError,
    replicas_configured: Option<u32>,
    replicas_seen: AtomicU32,
    /// Whether the last call succeeded; while false, requests skip Redis.
    up: AtomicBool,
    up_gauge: Gauge,
    /// This replica's name in the replica set and in lease ids.
    id: String,
    next_lease: AtomicU64,
    /// Held leases (id → lease set key), renewed by the heartbeat.
    leases: Mutex<HashMap<String, String>>,
    reserve: Arc<Script>,
    recheck: Arc<Script>,
    pause: Arc<Script>,
    lease: Arc<Script>,
    heartbeat: Arc<Script>,
}

/// Why `[backend]` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// `kind = "redis"` without a `url`.
    #[error("the redis backend needs a url")]
    NoUrl,
    /// The URL is not one the Redis client takes.
    #[error("backend.url {shown:?}: {source}")]
    Url {
        /// The URL without its password.
        shown: String,
        /// What the client said.
        source: redis::RedisError,
    },
}

impl Redis {
    /// Connects lazily: tollgate starts even while Redis is down.
    pub fn new(config: &BackendConfig, metrics: &Metrics) -> Result<Arc<Redis>, BackendError> {
        let url = config.url.as_ref().ok_or(BackendError::NoUrl)?;
        // Errors name the URL without its password: they go to stderr and the logs.
        let shown = redacted(&url.0);
        // Nagle's algorithm is on by default in redis-rs; every call here is a small
        // request waiting on a small answer, which it can only delay (no gain measured
        // with one call at a time; it matters when calls overlap).
        let info = url
            .0
            .as_str()
            .into_connection_info()
            .map_err(|source| BackendError::Url {
                shown: shown.clone(),
                source,
            })?
            .set_tcp_settings(TcpSettings::default().set_nodelay(true));
        let client = redis::Client::open(info).map_err(|source| BackendError::Url {
            shown: shown.clone(),
            source,
        })?;
        let timeout = config.timeout.0;
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client, manager).map_err(|source| {
            BackendError::Url {
                shown: shown.clone(),
                source,
            }
        })?;
        let up_gauge = Gauge::default();
        up_gauge.set(1);
        metrics.register(|registry| {
            registry.register(
                "tollgate_backend_up",
                "Whether the shared limit store (Redis) answers (1) or tollgate runs on local limits (0)",
                up_gauge.clone(),
            );
        });
        Ok(Arc::new(Redis {
            conn,
            prefix: config.key_prefix.clone(),
            timeout,
            on_error: config.on_backend_error,
            replicas_configured: config.replicas,
            replicas_seen: AtomicU32::new(1),
            up: AtomicBool::new(true),
            up_gauge,
            id: replica_id(),
            next_lease: AtomicU64::new(0),
            leases: Mutex::new(HashMap::new()),
            reserve: Arc::new(Script::new(RESERVE)),
            recheck: Arc::new(Script::new(RECHECK)),
            pause: Arc::new(Script::new(PAUSE)),
            lease: Arc::new(Script::new(LEASE)),
            heartbeat: Arc::new(Script::new(HEARTBEAT_SCRIPT)),
        }))
    }

    /// Whether Redis answered the last call.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// How many replicas share the budget: `replicas` from the config, else the number
    /// seen alive in Redis recently (at least 1).
    pub fn replicas(&self) -> u32 {
        self.replicas_configured
            .unwrap_or_else(|| self.replicas_seen.load(Ordering::Relaxed))
            .max(1)
    }

    /// Books the next slot of `group` for a request of `cost` under `rates` and what
    /// `booking` adds. `None` when Redis is down (or just failed): the caller limits
    /// locally.
    pub async fn reserve(
        &self,
        group: &str,
        rates: &[Gcra],
        cost: u32,
        booking: Booking,
    ) -> Option<Reservation> {
        if !self.is_up() {
            return None;
        }
        let (script, mut conn) = (self.reserve.clone(), self.conn.clone());
        let keys: Vec<String> = RESERVE_KEYS
            .iter()
            .map(|k| self.key(group, k))
            .chain((0..rates.len()).map(|i| self.key(group, &format!("rate:{i}"))))
            .collect();
        let us = |d: Duration| d.as_micros() as u64;
        let request = Reserve {
            cost,
            rates: rates
                .iter()
                .map(|r| [us(r.interval), us(r.tolerance)])
                .collect(),
            pace: booking.pace.map_or(0, |p| us(p).max(1)),
            window: booking.window.map(|(quota, span)| [quota.max(1), us(span)]),
            id: &self.id,
            probing: booking.probing,
            learned: booking.learned,
            probe_ms: Params::DEFAULT.probe_for.as_millis() as u64,
            ttl_ms: RECORD_TTL.as_millis() as u64,
            publish: booking.publish,
        };
        let request = serde_json::to_string(&request).ok()?;
        let answer: String = self
            .call(async move {
                let mut call = script.prepare_invoke();
                for key in keys {
                    call.key(key);
                }
                call.arg(request).invoke_async(&mut conn).await
            })
            .await?;
        let answer: Reserved = match serde_json::from_str(&answer) {
            Ok(answer) => answer,
            Err(e) => {
                self.failed(&format!("reserve.lua answered {answer:?}: {e}"));
                return None;
            }
        };
        let probing = match answer.probe.as_str() {
            "group" => Probing::ForGroup,
            "over" => Probing::Over,
            "elsewhere" => Probing::Elsewhere(micros(answer.probe_left)),
            _ => Probing::No,
        };
        Some(Reservation {
            wait: micros(answer.wait),
            paused_for: (answer.paused > 0.0).then(|| micros(answer.paused)),
            shared: answer.shared,
            at: answer.stamp.parse().unwrap_or(0),
            probing,
        })
    }

    /// Whether the slot that [`Redis::reserve`] booked `at` (µs on Redis's clock) for
    /// `group` still holds: `Some(pause)` when the group is paused now, else whether
    /// the upstream refused any replica's request since. `None` when Redis did not
    /// answer.
    pub async fn recheck(&self, group: &str, at: u64) -> Option<(Option<Duration>, bool)> {
        if !self.is_up() {
            return None;
        }
        let (script, mut conn) = (self.recheck.clone(), self.conn.clone());
        let keys = [self.key(group, "pause"), self.key(group, "refused")];
        let answer: String = self
            .call(async move {
                let mut call = script.prepare_invoke();
                call.key(&keys[0]).key(&keys[1]).arg(at);
                call.invoke_async(&mut conn).await
            })
            .await?;
        let answer: Rechecked = serde_json::from_str(&answer).ok()?;
        let paused = (answer.paused > 0.0).then(|| micros(answer.paused));
        Some((paused, answer.refused > 0))
    }

    /// Pauses `group` on every replica for `pause` (counted on Redis's clock);
    /// `refusal`: the upstream refused a request, which the group's record keeps.
    /// Publishes this replica's change of the shared pace, if any.
    pub async fn pause(
        &self,
        group: &str,
        pause: Duration,
        refusal: bool,
        publish: Option<Publish>,
    ) {
        if !self.is_up() {
            return;
        }
        let (script, mut conn) = (self.pause.clone(), self.conn.clone());
        let keys = PAUSE_KEYS.map(|k| self.key(group, k));
        let refusal = refusal.then(|| {
            let n = self.next_lease.fetch_add(1, Ordering::Relaxed);
            format!("{}:{n}", self.id)
        });
        let request = protocol::Pause {
            pause_us: pause.as_micros() as u64,
            refusal,
            keep_us: REFUSALS_KEPT.as_micros() as u64,
            probe_ms: Params::DEFAULT.probe_for.as_millis() as u64,
            ttl_ms: RECORD_TTL.as_millis() as u64,
            publish,
        };
        let Ok(request) = serde_json::to_string(&request) else {
            return;
        };
        let _: Option<String> = self
            .call(async move {
                let mut call = script.prepare_invoke();
                for key in keys {
                    call.key(key);
                }
                call.arg(request).invoke_async(&mut conn).await
            })
            .await;
    }

    /// Runs the heartbeat (replica count, lease renewal) and, while Redis is down, the
    /// probe that brings it back. Ends when the store is dropped.
    pub fn spawn_maintenance(self: &Arc<Self>) {
        let weak: Weak<Redis> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut last_beat = tokio::time::Instant::now() - HEARTBEAT;
            loop {
                let Some(redis) = weak.upgrade() else { return };
                if !redis.is_up() {
                    redis.probe().await;
                } else if last_beat.elapsed() >= HEARTBEAT {
                    redis.beat().await;
                    last_beat = tokio::time::Instant::now();
                }
                drop(redis);
                tokio::time::sleep(PROBE).await;
            }
        });
    }

    async fn probe(&self) {
        let mut conn = self.conn.clone();
        let ping = redis::cmd("PING");
        let answer = tokio::time::timeout(self.timeout, ping.query_async::<String>(&mut conn));
        if let Ok(Ok(_)) = answer.await {
            self.succeeded();
        }
    }

    async fn beat(&self) {
        let leases: Vec<(String, String)> = self
            .leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(id, set)| (id.clone(), set.clone()))
            .collect();
        let (script, mut conn) = (self.heartbeat.clone(), self.conn.clone());
        let (replicas, me) = (format!("{}replicas", self.prefix), self.id.clone());
        let beat = self.call(async move {
            let mut call = script.prepare_invoke();
            call.key(replicas)
                .arg(me)
                .arg(REPLICA_TTL.as_millis() as u64)
                .arg(LEASE_TTL.as_millis() as u64);
            for (id, set) in leases {
                call.key(set).arg(id);
            }
            call.invoke_async::<u32>(&mut conn).await
        });
        if let Some(alive) = beat.await {
            self.replicas_seen.store(alive.max(1), Ordering::Relaxed);
        }
    }

    /// Runs one Redis call within `timeout`; a failure marks the store down.
    async fn call<T>(&self, call: impl Future<Output = redis::RedisResult<T>>) -> Option<T> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(value)) => {
                self.succeeded();
                Some(value)
            }
            Ok(Err(e)) => {
                self.failed(&e.to_string());
                None
            }
            Err(_) => {
                self.failed(&format!("no answer within {:?}", self.timeout));
                None
            }
        }
    }

    fn succeeded(&self) {
        if !self.up.swap(true, Ordering::Relaxed) {
            self.up_gauge.set(1);
            tracing::info!("Redis answers again: shared limits resume");
        }
    }

    fn failed(&self, error: &str) {
        if self.up.swap(false, Ordering::Relaxed) {
            self.up_gauge.set(0);
            match self.on_error {
                OnBackendError::Local => tracing::warn!(
                    error,
                    replicas = self.replicas(),
                    "Redis unreachable: limiting locally at rate / replicas until it answers"
                ),
                OnBackendError::Deny => tracing::warn!(
                    error,
                    "Redis unreachable: refusing requests until it answers (on_backend_error = \"deny\")"
                ),
            }
        }
    }

    fn key(&self, group: &str, what: &str) -> String {
        format!("{}{{{group}}}:{what}", self.prefix)
    }
}

/// `url` with any password in its userinfo replaced by `***`.
fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
            None => format!("{scheme}://***@{host}"),
        },
        None => url.to_string(),
    }
}

/// A name for this replica that is unique across machines and restarts.
fn replica_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("{}-{}-{random:x}", host.trim(), std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_shown_without_its_password() {
        let cases = [
            ("redis://:secret@redis:6379/0", "redis://:***@redis:6379/0"),
            ("rediss://app:secret@redis/1", "rediss://app:***@redis/1"),
            ("redis://token@redis", "redis://***@redis"),
            ("redis://redis:6379", "redis://redis:6379"),
        ];
        for (url, shown) in cases {
            assert_eq!(redacted(url), shown);
        }
    }
}
