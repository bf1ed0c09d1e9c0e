//! What the store does in the background: the heartbeat (this replica counted alive,
//! its leases renewed) while Redis answers, and the probe that brings the store back
//! when it does not.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::connect::arg;
use super::{Redis, LEASE_TTL};

/// How often held leases are renewed and this replica says it is alive.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// A replica not heard of for this long no longer counts.
const REPLICA_TTL: Duration = Duration::from_secs(10);
/// How often a store that is down is probed.
const PROBE: Duration = Duration::from_millis(500);

impl Redis {
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

    /// Asks the node that holds the key of the last failed call (in a cluster, the
    /// master of its slot, once a replica is promoted) for a write that changes
    /// nothing: `PEXPIRE` of a key that never exists. A write, so that a node that
    /// answers as a replica (a demoted master, until the sentinels are asked again)
    /// does not count as back.
    async fn probe(&self) {
        let key = self
            .failed_key
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let nothing = format!("{{{}}}:probe-nothing", hashed(&key));
        let mut conn = self.conn.clone();
        let mut probe = redis::cmd("PEXPIRE");
        probe.arg(&nothing).arg(1);
        let answer = tokio::time::timeout(self.timeout, probe.query_async::<i64>(&mut conn));
        if let Ok(Ok(_)) = answer.await {
            self.succeeded();
        }
    }

    /// Counts this replica alive and renews its leases: one call for the replica set,
    /// and one per group holding leases (each group's keys are in a slot of their own).
    async fn beat(&self) {
        let mut by_set: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
        for (id, set) in self.leases.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            by_set
                .entry(set.clone())
                .or_default()
                .push(arg(id.as_str()));
        }
        let replicas = [format!("{}replicas", self.prefix)];
        let ttl = arg(REPLICA_TTL.as_millis() as u64);
        let alive: Option<u32> = self
            .run(
                &self.scripts.replicas,
                &replicas,
                &[arg(self.id.as_str()), ttl],
            )
            .await;
        if let Some(alive) = alive {
            self.replicas_seen.store(alive.max(1), Ordering::Relaxed);
        }
        for (set, ids) in by_set {
            let args: Vec<Vec<u8>> = std::iter::once(arg(LEASE_TTL.as_millis() as u64))
                .chain(ids)
                .collect();
            let _: Option<String> = self.run(&self.scripts.renew, &[set], &args).await;
        }
    }
}

/// The part of `key` Redis Cluster hashes to find its slot: the hash tag (between the
/// first `{` and the next `}`, if not empty), else the whole key.
fn hashed(key: &str) -> &str {
    let tag = key
        .split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'));
    match tag {
        Some((tag, _)) if !tag.is_empty() => tag,
        _ => key,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_asks_the_slot_of_the_failed_key() {
        let cases = [
            ("tollgate:{api}:pause", "api"),
            ("tollgate:replicas", "tollgate:replicas"),
            ("t{x:{api}:pause", "x:{api"),
            ("a{b}{c}", "b"),
        ];
        for (key, part) in cases {
            assert_eq!(hashed(key), part, "{key}");
            let nothing = format!("{{{}}}:probe-nothing", hashed(key));
            assert_eq!(hashed(&nothing), part, "{nothing}");
        }
    }
}
