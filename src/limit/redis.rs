//! The Redis store: limit state shared by every replica that points at one Redis.
//!
//! A third-party limit belongs to an API key, not to one proxy, so replicas must share
//! one budget. Each decision is one Lua script run atomically by Redis with Redis's own
//! clock (`TIME`), so the replicas' clocks never matter:
//!
//! * [`Redis::reserve`] books the next slot of a group's rates (the same GCRA as
//!   [`super::gcra`], in microseconds) and answers how long to wait for it — one round
//!   trip per request (two when the slot is [`RECHECK_AHEAD`] or more ahead:
//!   [`Redis::recheck`]), no polling (but while another replica probes a new group's
//!   upstream, [`Probing`]). The group's pause is part of the same decision.
//! * [`Redis::pause`] records an upstream's push-back for every replica.
//! * [`Redis::try_lease`] takes one of a group's concurrency leases (`shared_concurrency
//!   = true`). Leases expire unless renewed, so a replica that crashes returns its share
//!   within [`LEASE_TTL`].
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
use redis::{IntoConnectionInfo, Script, ScriptInvocation};

use super::gcra::Gcra;
use super::learn::{Precedence, Shared, Source, COUNTED, HORIZON};
use super::probe::PROBE_FOR;
use super::store::RECHECK_AHEAD;
use crate::config::{BackendConfig, OnBackendError};
use crate::metrics::Metrics;

mod lease;
pub use lease::Lease;

/// How long a concurrency lease lives without renewal.
pub const LEASE_TTL: Duration = Duration::from_secs(10);
/// How often held leases are renewed and this replica says it is alive.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// A replica not heard of for this long no longer counts.
const REPLICA_TTL: Duration = Duration::from_secs(10);
/// How often a store that is down is probed.
const PROBE: Duration = Duration::from_millis(500);
/// How long a group's learned rate stays in Redis after its last booking: the
/// replicas keep theirs in memory meanwhile, and publish it again when it is gone.
const LEARNED_TTL: Duration = Duration::from_secs(600);

/// Books the next slot, and publishes a learned state (`publication`).
///
/// KEYS: the pause key, the learned hash, the learned rate's TAT, the booked set, the
/// refused set ([`PAUSE`]), the probe ([`Probing`]: the prober's id, until when), then
/// one TAT key per rate.
/// ARGV: the publication; the cost; the window to count the group's bookings over, in
/// µs (0: none), and the most bookings kept for that; this replica's id, whether its
/// probe is on (`1`), and how long a probe lasts at most, in ms; then the interval and
/// tolerance of each rate, in µs. Returns the µs to wait, the µs of pause left (≤ 0
/// when not paused), the learned base, factor and source in force (nil when none), the
/// bookings within the window before this one's departure, this one included (0 when
/// not counted, or when there were too many to count), the refusals within the window
/// before now, now (in µs on Redis's clock), and the probe: 1 when this replica probes
/// for the group, 2 when the group's probe is over (this replica's is too), minus the
/// µs it lasts at least while another replica's is on (nothing booked).
pub const RESERVE: &str = concat!(
    include_str!("redis/publish.lua"),
    include_str!("redis/reserve.lua")
);

/// Whether a slot booked at a time (µs on Redis's clock) still holds when it comes.
/// KEYS: the pause key, the refused set ([`PAUSE`]). ARGV: the booking's time. Returns
/// the µs of pause left (≤ 0 when not paused) and the refusals recorded since the
/// booking.
const RECHECK: &str = include_str!("redis/recheck.lua");

/// Extends the group's pause and, for the upstream's refusal, records it: the group's
/// refusals, which a replica sees a share of, are counted here for every replica. The
/// step down a refusal taught is published at once (`publication`), before more
/// requests are booked at the pace refused.
/// A refusal also restarts the learned rate's chain of slots after those booked less
/// than [`RECHECK_AHEAD`] ahead: the others are checked again and left unused.
/// KEYS: the pause key, the refused set, the learned hash, the probe, the learned
/// rate's TAT. ARGV: the publication; the pause in µs; the refusal's id (empty: not a
/// refusal), how long refusals are kept, in µs, and the most kept; how long a probe
/// lasts at most, in ms (a refusal keeps the probe's replica the prober until its pause
/// has ended and it has published what it learned); [`RECHECK_AHEAD`] in µs.
pub const PAUSE: &str = concat!(
    include_str!("redis/publish.lua"),
    include_str!("redis/pause.lua")
);

/// Adds the first arguments of [`RESERVE`] and [`PAUSE`] to `call`, which publish a
/// learned state (`redis/publish.lua`): its interval in µs (empty when there is nothing
/// to publish), base, factor and source; how long the learned hash lives, in ms; and
/// its [`Precedence`]. A state published less than a second before holds against a
/// faster one that ranks [`Precedence::Slower`], and against a slower one that ranks
/// [`Precedence::Faster`].
fn publication(call: &mut ScriptInvocation, learned: &Publication) {
    match learned.publish {
        Some((shared, interval)) => call
            .arg(interval.as_micros().max(1) as u64)
            .arg(shared.base.to_string())
            .arg(shared.factor.to_string())
            .arg(shared.source.as_str()),
        None => call.arg("").arg("").arg("").arg(""),
    };
    call.arg(LEARNED_TTL.as_millis() as u64)
        .arg(learned.precedence.code());
}

/// Takes a lease if fewer than the limit are live. KEYS: the lease set. ARGV: lease id,
/// limit, lease ms. Returns 1 if taken.
const LEASE: &str = include_str!("redis/lease.lua");

/// Renews leases and counts live replicas. KEYS: the replica set, then one lease set per
/// lease. ARGV: this replica's id, the replica ms, the lease ms, then the lease ids.
/// Returns the number of live replicas.
const HEARTBEAT_SCRIPT: &str = include_str!("redis/heartbeat.lua");

/// The answer of [`RESERVE`].
pub type ReserveAnswer = (
    i64,
    i64,
    Option<String>,
    Option<String>,
    Option<String>,
    i64,
    i64,
    i64,
    i64,
);

/// The keys of [`RESERVE`] before the rates' TATs, in order, each under the group's
/// prefix (`Redis::key`).
pub const RESERVE_KEYS: [&str; 6] = [
    "pause",
    "learned",
    "rate:learned",
    "booked",
    "refused",
    "probe",
];
/// The keys of [`PAUSE`], in order, alike.
pub const PAUSE_KEYS: [&str; 5] = ["pause", "refused", "learned", "probe", "rate:learned"];

/// The learned state read back from Redis; `None` when absent or not understood (a
/// replica of another version, say).
fn shared(base: Option<String>, factor: Option<String>, source: Option<String>) -> Option<Shared> {
    let shared = Shared {
        base: base?.parse().ok()?,
        factor: factor?.parse().ok()?,
        source: Source::parse(&source?)?,
    };
    let valid = |x: f64| x.is_finite() && x > 0.0;
    (valid(shared.base) && valid(shared.factor)).then_some(shared)
}

/// A booked slot.
#[derive(Debug, Clone, Copy)]
pub struct Reservation {
    /// How long until the request may leave.
    pub wait: Duration,
    /// How long the group stays paused (by any replica's push-back), if it is: then
    /// nothing was booked.
    pub paused_for: Option<Duration>,
    /// The learned rate every replica books against, if one was published.
    pub learned: Option<Shared>,
    /// The group's bookings within the counted window before this one's departure,
    /// this one included (0 when not counted).
    pub booked_in_window: u64,
    /// The group's refusals within the counted window before the booking.
    pub refused_in_window: u64,
    /// When it was booked, in µs on Redis's clock ([`Redis::recheck`]).
    pub at: u64,
    /// Who probes the group's upstream.
    pub probing: Probing,
}

/// Who probes the upstream of a group that has no rate yet ([`super::probe`]). With
/// replicas, one probes for the group (the first to book while its probe is on) and the
/// others wait for what it learns: one request, not one per replica, meets the
/// upstream first, and the answers of the probe, which a first rate is read from, are
/// the group's, not a share of them.
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

/// What a booking tells the store about the group's learning.
#[derive(Debug, Clone, Copy)]
pub struct Learning {
    /// The learned state to publish.
    pub publication: Publication,
    /// The window to count the group's bookings over.
    pub window: Option<Duration>,
    /// Whether this replica's probe is on ([`Probing`]).
    pub probing: bool,
}

/// A learned state a replica publishes (`publication`).
#[derive(Debug, Clone, Copy)]
pub struct Publication {
    /// The state, with the interval to book it at; `None`: nothing new to publish.
    pub publish: Option<(Shared, Duration)>,
    /// How it ranks against one published just before.
    pub precedence: Precedence,
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

impl Redis {
    /// Connects lazily: tollgate starts even while Redis is down.
    pub fn new(config: &BackendConfig, metrics: &Metrics) -> Result<Arc<Redis>, String> {
        let url = config.url.as_ref().ok_or("the redis backend needs a url")?;
        // Errors name the URL without its password: they go to stderr and the logs.
        let shown = redacted(&url.0);
        // Nagle's algorithm is on by default in redis-rs; every call here is a small
        // request waiting on a small answer, which it can only delay (no gain measured
        // with one call at a time; it matters when calls overlap).
        let info = url
            .0
            .as_str()
            .into_connection_info()
            .map_err(|e| format!("backend.url {shown:?}: {e}"))?
            .set_tcp_settings(TcpSettings::default().set_nodelay(true));
        let client =
            redis::Client::open(info).map_err(|e| format!("backend.url {shown:?}: {e}"))?;
        let timeout = config.timeout.0;
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client, manager)
            .map_err(|e| format!("backend.url {shown:?}: {e}"))?;
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

    /// Books the next slot of `group` for a request of `cost` under `rates` and the
    /// learned rate shared in Redis (publishing `learning.publication` first). `None` when
    /// Redis is down (or just failed): the caller limits locally.
    pub async fn reserve(
        &self,
        group: &str,
        rates: &[Gcra],
        cost: u32,
        learning: Learning,
    ) -> Option<Reservation> {
        if !self.is_up() {
            return None;
        }
        let (script, mut conn) = (self.reserve.clone(), self.conn.clone());
        let fixed_keys = RESERVE_KEYS.map(|k| self.key(group, k));
        let id = self.id.clone();
        let rate_keys: Vec<(String, u64, u64)> = rates
            .iter()
            .enumerate()
            .map(|(i, rate)| {
                let key = self.key(group, &format!("rate:{i}"));
                let interval = rate.interval.as_micros() as u64;
                (key, interval, rate.tolerance.as_micros() as u64)
            })
            .collect();
        let booked = self.call(async move {
            let mut call = script.prepare_invoke();
            for key in fixed_keys {
                call.key(key);
            }
            publication(&mut call, &learning.publication);
            call.arg(cost)
                .arg(learning.window.map_or(0, |w| w.as_micros() as u64))
                .arg(COUNTED)
                .arg(id)
                .arg(u8::from(learning.probing))
                .arg(PROBE_FOR.as_millis() as u64);
            for (key, interval, tolerance) in rate_keys {
                call.key(key).arg(interval).arg(tolerance);
            }
            call.invoke_async::<ReserveAnswer>(&mut conn).await
        });
        let (wait, paused, base, factor, source, booked, refused, at, probe) = booked.await?;
        let micros = |us: i64| Duration::from_micros(us.max(0) as u64);
        let probing = match probe {
            1 => Probing::ForGroup,
            2 => Probing::Over,
            left if left < 0 => Probing::Elsewhere(micros(-left)),
            _ => Probing::No,
        };
        Some(Reservation {
            wait: micros(wait),
            paused_for: (paused > 0).then(|| micros(paused)),
            learned: shared(base, factor, source),
            booked_in_window: booked.max(0) as u64,
            refused_in_window: refused.max(0) as u64,
            at: at.max(0) as u64,
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
        let (paused, refused): (i64, i64) = self
            .call(async move {
                let mut call = script.prepare_invoke();
                call.key(&keys[0]).key(&keys[1]).arg(at);
                call.invoke_async(&mut conn).await
            })
            .await?;
        let paused = (paused > 0).then(|| Duration::from_micros(paused as u64));
        Some((paused, refused > 0))
    }

    /// Pauses `group` on every replica for `pause` (counted on Redis's clock);
    /// `refusal`: the upstream refused a request, which the group's count keeps.
    pub async fn pause(&self, group: &str, pause: Duration, refusal: bool, learned: Publication) {
        if !self.is_up() {
            return;
        }
        let (script, mut conn) = (self.pause.clone(), self.conn.clone());
        let keys = PAUSE_KEYS.map(|k| self.key(group, k));
        let id = match refusal {
            true => format!(
                "{}:{}",
                self.id,
                self.next_lease.fetch_add(1, Ordering::Relaxed)
            ),
            false => String::new(),
        };
        let _: Option<i64> = self
            .call(async move {
                let mut call = script.prepare_invoke();
                for key in keys {
                    call.key(key);
                }
                publication(&mut call, &learned);
                call.arg(pause.as_micros() as u64);
                call.arg(id).arg(HORIZON.as_micros() as u64).arg(COUNTED);
                call.arg(PROBE_FOR.as_millis() as u64);
                call.arg(RECHECK_AHEAD.as_micros() as u64);
                call.invoke_async(&mut conn).await
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
    fn a_learned_state_is_read_back_only_when_whole_and_sane() {
        let s = |x: &str| Some(x.to_string());
        let read = |b: &str, f: &str, src: &str| shared(s(b), s(f), s(src));
        assert_eq!(
            read("5", "0.95", "refusals"),
            Some(Shared {
                base: 5.0,
                factor: 0.95,
                source: Source::Refusals
            })
        );
        assert_eq!(read("5", "1", "tea-leaves"), None);
        assert_eq!(read("NaN", "1", "refusals"), None);
        assert_eq!(read("5", "0", "refusals"), None);
        assert_eq!(read("", "1", "refusals"), None);
        assert_eq!(shared(None, s("1"), s("refusals")), None);
    }

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
