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
//! Keys are `<prefix>{<group>}:...` and expire when idle: the braces are a hash tag,
//! which keeps a group's keys in one Redis Cluster slot, so that every script touches
//! one slot. The replica set (`<prefix>replicas`) is a key of its own, written alone.
//! Where Redis is — one node, the master Sentinels name, a Cluster — is [`connect`]'s
//! business; the calls here are the same for the three.
//!
//! Redis down, slow or unreachable: a call that fails or takes longer than `timeout`
//! marks the store down (logged once, `tollgate_backend_up 0`); while down, requests do
//! not wait for Redis at all and limits are enforced locally at rate / replicas (or
//! refused, with `on_backend_error = "deny"`), and a background probe marks it up again
//! as soon as Redis answers.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use super::budget::Params;
use super::gcra::Gcra;
use crate::config::{BackendConfig, OnBackendError};
use crate::metrics::Metrics;

pub mod connect;
mod follow;
mod lease;
mod maintain;
pub mod protocol;
mod tls;
mod tokens;
pub use connect::BackendError;
use connect::{arg, Conn, Lua};
pub use lease::Lease;
use protocol::{micros, Publish, Rechecked, Record, Reserve, Reserved};

/// How long a concurrency lease lives without renewal.
pub const LEASE_TTL: Duration = Duration::from_secs(10);
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

/// Says this replica is alive and counts the live ones. KEYS: the replica set. ARGV:
/// this replica's id, the replica ms. Returns the number of live replicas.
const REPLICAS: &str = include_str!("redis/replicas.lua");

/// Renews held leases of one group. KEYS: its lease set. ARGV: the lease ms, then the
/// lease ids.
const RENEW: &str = include_str!("redis/renew.lua");
/// A group's configured token buckets: take an estimate, or settle a usage.
const TOKENS: &str = include_str!("redis/tokens.lua");

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
    /// How long from now the slot may be at the earliest: the local rates' wait, on
    /// the first booking after this replica sent on them while the store was down.
    /// Redis's record of the rates does not know those departures.
    pub floor: Duration,
}

/// The connection to Redis and what this replica knows about it.
pub struct Redis {
    conn: Conn,
    prefix: String,
    timeout: Duration,
    /// What requests get while Redis is down.
    pub on_error: OnBackendError,
    replicas_configured: Option<u32>,
    replicas_seen: AtomicU32,
    /// Whether the last call succeeded; while false, requests skip Redis.
    up: AtomicBool,
    up_gauge: Gauge,
    /// Seconds on the local fallback, counted when Redis answers again.
    fallback: Counter<f64, std::sync::atomic::AtomicU64>,
    /// Calls that failed or timed out, each one (the fallback begins at the first).
    errors: Counter,
    /// When the store went down, while it is.
    down_since: Mutex<Option<tokio::time::Instant>>,
    /// The first key of the last call that failed: the probe asks the node that holds
    /// it (in a cluster, the master of its slot).
    failed_key: Mutex<String>,
    /// This replica's name in the replica set and in lease ids.
    id: String,
    next_lease: AtomicU64,
    /// Held leases (id → lease set key), renewed by the heartbeat.
    leases: Mutex<HashMap<String, String>>,
    scripts: Arc<Scripts>,
}

/// The scripts, shared with the calls' futures.
struct Scripts {
    reserve: Lua,
    recheck: Lua,
    pause: Lua,
    lease: Lua,
    replicas: Lua,
    renew: Lua,
    tokens: Lua,
}

impl Redis {
    /// Connects lazily: tollgate starts even while Redis is down.
    pub fn new(config: &BackendConfig, metrics: &Metrics) -> Result<Arc<Redis>, BackendError> {
        let conn = connect::connect(config)?;
        let up_gauge = Gauge::default();
        up_gauge.set(1);
        let fallback = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        let errors = Counter::default();
        metrics.register(|registry| {
            registry.register(
                "tollgate_backend_up",
                "Whether the shared limit store (Redis) answers (1) or tollgate runs on local limits (0)",
                up_gauge.clone(),
            );
            registry.register(
                "tollgate_backend_fallback_seconds",
                "Time spent on local limits while the shared limit store (Redis) did not answer, counted when it answers again",
                fallback.clone(),
            );
            registry.register(
                "tollgate_backend_errors",
                "Calls to the shared limit store (Redis) that failed or got no answer in time",
                errors.clone(),
            );
        });
        Ok(Arc::new(Redis {
            conn,
            prefix: config.key_prefix.clone(),
            timeout: config.timeout.0,
            on_error: config.on_backend_error,
            replicas_configured: config.replicas,
            replicas_seen: AtomicU32::new(1),
            up: AtomicBool::new(true),
            up_gauge,
            fallback,
            errors,
            down_since: Mutex::new(None),
            failed_key: Mutex::new(format!("{}replicas", config.key_prefix)),
            id: replica_id(),
            next_lease: AtomicU64::new(0),
            leases: Mutex::new(HashMap::new()),
            scripts: Arc::new(Scripts {
                reserve: Lua::new(RESERVE),
                recheck: Lua::new(RECHECK),
                pause: Lua::new(PAUSE),
                lease: Lua::new(LEASE),
                replicas: Lua::new(REPLICAS),
                renew: Lua::new(RENEW),
                tokens: Lua::new(TOKENS),
            }),
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
            floor: us(booking.floor),
        };
        let request = serde_json::to_string(&request).ok()?;
        let answer: String = self
            .run(&self.scripts.reserve, &keys, &[arg(request)])
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
        let keys = [self.key(group, "pause"), self.key(group, "refused")];
        let answer: String = self.run(&self.scripts.recheck, &keys, &[arg(at)]).await?;
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
        let _: Option<String> = self.run(&self.scripts.pause, &keys, &[arg(request)]).await;
    }

    /// Runs `lua` with `keys` (of one slot) and `args` within `timeout`; a failure marks
    /// the store down.
    async fn run<T: redis::FromRedisValue>(
        &self,
        lua: &Lua,
        keys: &[String],
        args: &[Vec<u8>],
    ) -> Option<T> {
        let mut conn = self.conn.clone();
        self.call(&keys[0], lua.run(&mut conn, keys, args)).await
    }

    /// Runs one Redis call on `key` within `timeout`; a failure marks the store down.
    async fn call<T>(
        &self,
        key: &str,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Option<T> {
        let error = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(value)) => {
                self.succeeded();
                return Some(value);
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.timeout),
        };
        key.clone_into(&mut self.failed_key.lock().unwrap_or_else(|p| p.into_inner()));
        self.failed(&error);
        None
    }

    fn succeeded(&self) {
        if !self.up.swap(true, Ordering::Relaxed) {
            self.up_gauge.set(1);
            let since = self
                .down_since
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            let down = since.map_or(Duration::ZERO, |t| t.elapsed());
            self.fallback.inc_by(down.as_secs_f64());
            tracing::info!(
                after = ?down,
                "Redis answers again: shared limits resume"
            );
        }
    }

    fn failed(&self, error: &str) {
        self.errors.inc();
        if self.up.swap(false, Ordering::Relaxed) {
            self.up_gauge.set(0);
            *self.down_since.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(tokio::time::Instant::now());
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

/// A name for this replica that is unique across machines and restarts.
fn replica_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("{}-{}-{random:x}", host.trim(), std::process::id())
}
