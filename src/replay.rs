//! Which requests may be sent again after the upstream pushed back, and the memory
//! their bodies may take.
//!
//! A replay is safe when the upstream did not carry the request out. Any refusal
//! status may be replayed for an idempotent method (sending it twice does what
//! sending it once does); for the others (POST, PATCH, ...) only the statuses that
//! say the request was not processed: `429`, and `503` with `Retry-After` (a `503`
//! without it is never a push-back, see [`crate::pushback::judge`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use http::{Method, StatusCode};
use prometheus_client::metrics::gauge::Gauge;

use crate::metrics::Metrics;

/// Whether a request with `method` that got `status` (a push-back) may be sent again.
pub fn may_replay(method: &Method, status: StatusCode) -> bool {
    method.is_idempotent()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::SERVICE_UNAVAILABLE
}

/// The memory all bodies held for replay may take together (`[proxy] replay_memory`).
/// A request whose body does not fit is not read ahead: it streams to the upstream once
/// its turn comes, and cannot be replayed.
#[derive(Debug)]
pub struct ReplayMemory {
    limit: u64,
    used: AtomicU64,
    /// `used`, as `tollgate_replay_memory_bytes`.
    gauge: Gauge,
}

/// Bytes of [`ReplayMemory`] held by one body; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    memory: Arc<ReplayMemory>,
    bytes: u64,
}

impl ReplayMemory {
    /// A budget of `limit` bytes, its use shown in `metrics` when given.
    pub fn new(limit: u64, metrics: Option<&Metrics>) -> Arc<ReplayMemory> {
        let gauge = Gauge::default();
        if let Some(metrics) = metrics {
            metrics.register(|registry| {
                registry.register(
                    "tollgate_replay_memory_bytes",
                    "Request bodies held in memory for replay, in bytes ([proxy] replay_memory)",
                    gauge.clone(),
                );
            });
        }
        Arc::new(ReplayMemory {
            limit,
            used: AtomicU64::new(0),
            gauge,
        })
    }

    fn show(&self, used: u64) {
        self.gauge.set(i64::try_from(used).unwrap_or(i64::MAX));
    }

    /// `bytes` of the budget, if that much is free.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Option<Reservation> {
        let before = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .ok()?;
        self.show(before + bytes);
        Some(Reservation {
            memory: self.clone(),
            bytes,
        })
    }

    /// The bytes reserved now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

impl Reservation {
    /// Keeps `bytes` of it (at most what it holds), giving the rest back: a body
    /// reserved for at its largest, once read.
    pub fn shrink_to(&mut self, bytes: u64) {
        let spare = self.bytes.saturating_sub(bytes);
        let before = self.memory.used.fetch_sub(spare, Ordering::AcqRel);
        self.memory.show(before - spare);
        self.bytes -= spare;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let before = self.memory.used.fetch_sub(self.bytes, Ordering::AcqRel);
        self.memory.show(before - self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_fit_the_budget_and_give_back() {
        let memory = ReplayMemory::new(100, None);
        let mut a = memory.reserve(60).expect("fits");
        assert!(memory.reserve(41).is_none());
        let b = memory.reserve(40).expect("fits exactly");
        assert_eq!((memory.used(), memory.gauge.get()), (100, 100));
        a.shrink_to(10);
        assert_eq!(memory.used(), 50);
        a.shrink_to(20); // never grows
        assert_eq!(memory.used(), 50);
        drop(b);
        drop(a);
        assert_eq!((memory.used(), memory.gauge.get()), (0, 0));
        assert!(memory.reserve(u64::MAX).is_none());
    }

    #[test]
    fn non_idempotent_requests_replay_only_when_not_processed() {
        let cases = [
            (Method::GET, 429, true),
            (Method::GET, 502, true),
            (Method::PUT, 500, true),
            (Method::DELETE, 408, true),
            (Method::POST, 429, true),
            (Method::POST, 503, true),
            (Method::POST, 500, false),
            (Method::POST, 502, false),
            (Method::PATCH, 408, false),
            (Method::PATCH, 429, true),
        ];
        for (method, status, replay) in cases {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(may_replay(&method, status), replay, "{method} {status}");
        }
    }
}
