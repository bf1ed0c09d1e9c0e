//! Budgets per key (docs/keys.md): a `[[limit]]` with `key` gives each value of its
//! key a group of its own, with the limit's settings — its own queue, rate, learned
//! pace, pause and permits — so that a 429 for one API key pauses that key only.
//!
//! Values are kept as the first 8 bytes of their SHA-256 only: a key is often a
//! credential, and neither memory, Redis, the logs nor `/status` should hold it. A
//! key's group is named `<limit>/<16 hex digits>`, and with Redis that name is part
//! of its keys there, so replicas share each key's budget.
//!
//! A key's group is made when its value is first seen and dropped once it has had no
//! request for `key_idle` and holds nothing (no request waiting or in flight, its rate
//! and pause run out): a sweeper task runs while the limit has keys, and ends with
//! the last. `max_keys` bounds how many exist at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::{Group, Refusal};

/// How often a full map is swept for a new key, at most.
const SWEEP_WHEN_FULL: Duration = Duration::from_secs(1);

/// The keys of one `[[limit]]`.
pub struct Keys {
    /// When the group was made: last-seen times are kept as milliseconds since.
    base: Instant,
    /// Read by every request of the limit; written only for a new key, or a sweep.
    map: RwLock<Map>,
}

#[derive(Default)]
struct Map {
    groups: HashMap<u64, Entry>,
    /// Whether a sweeper task is running.
    sweeping: bool,
    /// When a new key last found the map full and swept it: at most once a second,
    /// so that values rotated past `max_keys` do not each scan every key under the
    /// write lock.
    swept_when_full: Option<Instant>,
}

struct Entry {
    group: Arc<Group>,
    /// When it was last looked up, in milliseconds since `base`.
    seen: AtomicU64,
}

/// The id of a key's value: the first 8 bytes of its SHA-256.
pub fn id_of(value: &[u8]) -> u64 {
    let digest = ring::digest::digest(&ring::digest::SHA256, value);
    let mut first = [0; 8];
    first.copy_from_slice(&digest.as_ref()[..8]);
    u64::from_be_bytes(first)
}

/// An id as `/status` and the names of groups show it.
pub fn hex(id: u64) -> String {
    format!("{id:016x}")
}

impl Keys {
    pub(super) fn new(now: Instant) -> Keys {
        Keys {
            base: now,
            map: RwLock::new(Map::default()),
        }
    }

    fn millis(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX)
    }

    /// The group of key `id` in `limit`, made when first seen. Refused when `max_keys`
    /// exist and none of them can go.
    pub fn group(&self, limit: &Arc<Group>, id: u64) -> Result<Arc<Group>, Refusal> {
        let now = Instant::now();
        let seen = self.millis(now);
        {
            let map = self.map.read().unwrap_or_else(|p| p.into_inner());
            if let Some(entry) = map.groups.get(&id) {
                entry.seen.store(seen, Ordering::Relaxed);
                return Ok(entry.group.clone());
            }
        }
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        // Another request may have made it between the two locks.
        if let Some(entry) = map.groups.get(&id) {
            entry.seen.store(seen, Ordering::Relaxed);
            return Ok(entry.group.clone());
        }
        let settings = limit.settings_arc();
        if map.groups.len() >= settings.keys.max_keys {
            let recently = map
                .swept_when_full
                .is_some_and(|at| now < at + SWEEP_WHEN_FULL);
            if !recently {
                map.swept_when_full = Some(now);
                self.sweep(&mut map, now, settings.keys.key_idle);
            }
            if map.groups.len() >= settings.keys.max_keys {
                return Err(Refusal::TooManyKeys);
            }
        }
        let name = format!("{}/{}", limit.name, hex(id));
        let metrics = limit.metrics.for_key();
        let group = Arc::new(Group::with_settings(
            name.into(),
            settings,
            metrics,
            limit.store.clone(),
        ));
        let seen = AtomicU64::new(seen);
        map.groups.insert(
            id,
            Entry {
                group: group.clone(),
                seen,
            },
        );
        if !map.sweeping {
            map.sweeping = true;
            tokio::spawn(sweeper(Arc::downgrade(limit)));
        }
        Ok(group)
    }

    /// Drops the keys idle for `idle` that nothing holds; returns how many are left.
    fn sweep(&self, map: &mut Map, now: Instant, idle: Duration) -> usize {
        let since = self
            .millis(now)
            .saturating_sub(u64::try_from(idle.as_millis()).unwrap_or(u64::MAX));
        // References are only handed out under the read lock, and this holds the write
        // lock: a count of one is the map's own.
        map.groups.retain(|_, entry| {
            entry.seen.load(Ordering::Relaxed) > since
                || Arc::strong_count(&entry.group) > 1
                || !entry.group.is_idle()
        });
        map.groups.len()
    }

    /// Every key's group, for a reload and `/status`.
    pub fn groups(&self) -> Vec<Arc<Group>> {
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        map.groups.values().map(|e| e.group.clone()).collect()
    }
}

/// Sweeps `limit`'s idle keys every quarter of `key_idle` (within 100 ms and a
/// minute) until none is left, or the limit itself is gone (a reload dropped it).
async fn sweeper(limit: Weak<Group>) {
    loop {
        let every = match limit.upgrade() {
            Some(limit) => limit.settings().keys.key_idle / 4,
            None => return,
        };
        tokio::time::sleep(every.clamp(Duration::from_millis(100), Duration::from_secs(60))).await;
        let Some(limit) = limit.upgrade() else { return };
        let idle = limit.settings().keys.key_idle;
        let keys = &limit.keys;
        let mut map = keys.map.write().unwrap_or_else(|p| p.into_inner());
        if keys.sweep(&mut map, Instant::now(), idle) == 0 {
            map.sweeping = false;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{GroupSettings, KeySource};
    use crate::limit::fair::Flow;
    use crate::limit::{Cost, Store};
    use crate::metrics::Metrics;

    fn limit(f: impl FnOnce(&mut GroupSettings)) -> Arc<Group> {
        let mut settings = GroupSettings {
            rates: vec!["10/s".parse().unwrap()],
            ..GroupSettings::default()
        };
        settings.keys.key = Some(KeySource::Header(http::header::AUTHORIZATION));
        f(&mut settings);
        let metrics = Metrics::new().group("gh");
        let g = Arc::new(Group::new("gh".into(), settings, metrics, Store::Memory));
        g.lock().budget.end_probe();
        g
    }

    fn keyed(limit: &Arc<Group>, value: &str) -> Arc<Group> {
        let key = limit.keyed(id_of(value.as_bytes())).unwrap();
        key.lock().budget.end_probe();
        key
    }

    #[tokio::test(start_paused = true)]
    async fn each_key_keeps_its_own_pace() {
        let limit = limit(|_| {});
        let (a, b) = (keyed(&limit, "Bearer a"), keyed(&limit, "Bearer b"));
        assert!(
            Arc::ptr_eq(&a, &keyed(&limit, "Bearer a")),
            "one group per key"
        );
        assert_eq!(&a.name[..3], "gh/");
        let start = Instant::now();
        // Ten requests each, at 10/s each: both keys done within a second, together.
        let mut departed = Vec::new();
        for _ in 0..10 {
            for key in [&a, &b] {
                let _permit = key.admit(1, Instant::now(), false).await.unwrap();
                departed.push(start.elapsed());
            }
        }
        assert!(
            departed.last().unwrap() < &Duration::from_secs(1),
            "{departed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn past_max_keys_a_new_key_is_refused_until_one_is_swept() {
        let limit = limit(|s| {
            s.keys.max_keys = 2;
            s.keys.key_idle = Duration::from_secs(60);
        });
        let (_a, _b) = (keyed(&limit, "a"), keyed(&limit, "b"));
        let refused = limit.keyed(id_of(b"c"));
        assert_eq!(refused.err(), Some(Refusal::TooManyKeys));
        drop((_a, _b));
        // Idle for key_idle: the sweeper drops both, and ends.
        tokio::time::sleep(Duration::from_secs(61 + 15)).await;
        assert_eq!(limit.keys.groups().len(), 0);
        assert!(!limit.keys.map.read().unwrap().sweeping);
        assert!(limit.keyed(id_of(b"c")).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_in_use_is_not_swept() {
        let limit = limit(|s| s.keys.key_idle = Duration::from_secs(1));
        let held = keyed(&limit, "a");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(limit.keys.groups().len(), 1, "a request holds it");
        drop(held);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(limit.keys.groups().len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reload_reaches_every_key() {
        let limit = limit(|_| {});
        let a = keyed(&limit, "a");
        let mut settings = (*limit.settings_arc()).clone();
        settings.rates = vec!["2/s".parse().unwrap()];
        limit.reconfigure(settings);
        assert_eq!(a.settings().rates, limit.settings().rates);
    }

    /// A reload removes `fair_by` while requests of flows wait: the new ones, without
    /// a flow, queue behind them, not ahead.
    #[tokio::test(start_paused = true)]
    async fn a_reload_that_ends_fairness_keeps_the_waiting_ahead() {
        let g = limit(|s| s.keys.key = None);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for (i, flow) in [Some(1), Some(2), Some(1), None, None]
            .into_iter()
            .enumerate()
        {
            if i == 3 {
                let mut settings = (*g.settings_arc()).clone();
                settings.keys.fair_by = None;
                g.reconfigure(settings);
            }
            let (g, tx) = (g.clone(), tx.clone());
            let flow = flow.map(|id| Flow { id, weight: 1 });
            tokio::spawn(async move {
                let cost = Cost {
                    requests: 1,
                    flow,
                    ..Cost::default()
                };
                let _p = g.admit(cost, Instant::now(), false).await.unwrap();
                tx.send(i).unwrap();
            });
            tokio::task::yield_now().await;
        }
        drop(tx);
        let mut order = Vec::new();
        while let Some(i) = rx.recv().await {
            order.push(i);
        }
        assert_eq!(order, [0, 1, 2, 3, 4]);
    }

    /// Tenant A queues 30 at 10/s; tenant B sends 5 behind them: B's leave within
    /// the next 10 departures, and A keeps its order and loses nothing.
    #[tokio::test(start_paused = true)]
    async fn a_fair_queue_serves_a_late_flow_within_its_share() {
        let g = limit(|s| s.keys.key = None);
        let flow = |name: &str, weight| Flow {
            id: id_of(name.as_bytes()),
            weight,
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let spawn = |name: &'static str, i: usize, weight| {
            let (g, tx) = (g.clone(), tx.clone());
            tokio::spawn(async move {
                let cost = Cost {
                    requests: 1,
                    flow: Some(flow(name, weight)),
                    ..Cost::default()
                };
                let _p = g.admit(cost, Instant::now(), false).await.unwrap();
                tx.send((name, i)).unwrap();
            });
        };
        for i in 0..30 {
            spawn("A", i, 1);
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        for i in 0..5 {
            spawn("B", i, 1);
            tokio::task::yield_now().await;
        }
        drop(tx);
        let mut order = Vec::new();
        while let Some(x) = rx.recv().await {
            order.push(x);
        }
        let last_b = order.iter().rposition(|(n, _)| *n == "B").unwrap();
        assert!(last_b <= 3 + 10, "{order:?}");
        let a: Vec<usize> = order
            .iter()
            .filter(|(n, _)| *n == "A")
            .map(|(_, i)| *i)
            .collect();
        assert_eq!(a, (0..30).collect::<Vec<_>>());
    }

    #[test]
    fn ids_are_the_first_bytes_of_sha256() {
        // SHA-256("abc") = ba7816bf8f01cfea...
        assert_eq!(hex(id_of(b"abc")), "ba7816bf8f01cfea");
        assert_ne!(id_of(b"Bearer a"), id_of(b"Bearer b"));
    }
}
