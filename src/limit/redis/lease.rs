//! Concurrency leases shared in Redis (`shared_concurrency = true`): one of a group's
//! `concurrency` per request in flight, on any replica.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::connect::arg;
use super::{Redis, LEASE_TTL};

impl Redis {
    /// Tries to take one of `limit` concurrency leases of `group`: `Some(Some(lease))`
    /// if taken, `Some(None)` if all are taken, `None` if Redis is down.
    pub async fn try_lease(self: &Arc<Self>, group: &str, limit: usize) -> Option<Option<Lease>> {
        if !self.is_up() {
            return None;
        }
        let id = format!(
            "{}:{}",
            self.id,
            self.next_lease.fetch_add(1, Ordering::Relaxed)
        );
        let set = self.key(group, "leases");
        let args = [
            arg(id.as_str()),
            arg(limit),
            arg(LEASE_TTL.as_millis() as u64),
        ];
        let taken: i64 = self
            .run(&self.scripts.lease, std::slice::from_ref(&set), &args)
            .await?;
        if taken != 1 {
            return Some(None);
        }
        self.leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), set.clone());
        Some(Some(Lease {
            redis: self.clone(),
            id,
            set,
        }))
    }
}

/// One of a group's concurrency leases in Redis; given back when dropped.
pub struct Lease {
    redis: Arc<Redis>,
    id: String,
    set: String,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.redis
            .leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
        // Give the lease back now rather than let it expire; if Redis is unreachable
        // (or the runtime is gone, at exit) it expires within LEASE_TTL anyway.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (mut conn, timeout) = (self.redis.conn.clone(), self.redis.timeout);
        let mut zrem = redis::cmd("ZREM");
        zrem.arg(&self.set).arg(&self.id);
        runtime.spawn(async move {
            let _ = tokio::time::timeout(timeout, zrem.query_async::<i64>(&mut conn)).await;
        });
    }
}
