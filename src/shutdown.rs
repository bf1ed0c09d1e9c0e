//! What shutdown tells the requests still in the proxy, and what it counts.
//!
//! When shutdown begins, requests already admitted finish and queued ones keep their
//! place; once `shutdown_grace` is over, every request still waiting in a group is
//! answered `503` at once (it gave up its place, nothing was sent upstream), so no
//! client of a queue that could not drain in time is left with a reset. The counts
//! end up in the last log line. From the moment shutdown begins the admin `/readyz`
//! answers `503`, so a load balancer stops sending while the queues drain.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio_util::sync::CancellationToken;

/// Shared by every serving thread.
#[derive(Default)]
pub struct Shutdown {
    draining: AtomicBool,
    give_up: CancellationToken,
    sent: AtomicU64,
    answered: AtomicU64,
    cut: AtomicU64,
}

/// The counts of one shutdown, for its log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Requests that left their queue for the upstream while draining.
    pub sent: u64,
    /// Queued requests answered `503` when the grace ran out.
    pub answered_503: u64,
    /// Connections and tunnels closed while still busy, after the grace.
    pub cut: u64,
}

impl Shutdown {
    /// Shutdown has begun: from now on departures are counted.
    pub fn begin(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether shutdown has begun (the admin `/readyz` turns `503`).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// The grace is over: every queued request gives up its place.
    pub fn give_up_queued(&self) {
        self.give_up.cancel();
    }

    /// Completes once queued requests are to give up their place.
    pub async fn given_up(&self) {
        self.give_up.cancelled().await;
    }

    /// A request left its queue for the upstream.
    pub fn sent(&self) {
        if self.draining.load(Ordering::Relaxed) {
            self.sent.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A queued request was answered `503` instead.
    pub fn answered(&self) {
        self.answered.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` busy connections or tunnels were closed.
    pub fn cut(&self, n: usize) {
        self.cut.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The counts so far.
    pub fn tally(&self) -> Tally {
        Tally {
            sent: self.sent.load(Ordering::Relaxed),
            answered_503: self.answered.load(Ordering::Relaxed),
            cut: self.cut.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn departures_count_only_while_draining() {
        let s = Shutdown::default();
        s.sent();
        assert!(!s.draining());
        s.begin();
        assert!(s.draining());
        s.sent();
        s.answered();
        s.cut(2);
        assert_eq!(
            s.tally(),
            Tally {
                sent: 1,
                answered_503: 1,
                cut: 2
            }
        );
    }

    #[tokio::test]
    async fn given_up_completes_after_give_up_queued() {
        let s = Shutdown::default();
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(10), s.given_up());
        assert!(waiting.await.is_err());
        s.give_up_queued();
        s.given_up().await;
    }
}
