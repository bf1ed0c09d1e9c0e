//! Whether `Remaining: 0` pauses a group, and what the group's own answers say of an
//! announced window: decisions of their own.

use std::time::Duration;

use tokio::time::Instant;

use super::{Learner, HORIZON};

/// A spent budget is the group's own when it sent at least this share of the quota in
/// the window: the rest may be late answers, or rounding of one replica's share.
pub const OURS_SHARE: f64 = 0.8;

impl Learner {
    /// How many requests the upstream accepted from the group within the last
    /// `window`; 0 when the window is longer than the answers kept reach back. One of
    /// several replicas sees its share of each window, unevenly: it counts its answers
    /// over all it keeps ([`HORIZON`]) and scales them to one window of all replicas.
    pub fn accepted_within(&self, now: Instant, window: Duration) -> u64 {
        if window > HORIZON {
            return 0;
        }
        let over = if self.scale() > 1.0 { HORIZON } else { window };
        let ours = self.accepted.iter().filter(|at| now - **at < over).count() as f64;
        let scale = self.scale() * window.as_secs_f64() / over.as_secs_f64();
        (ours * scale).round() as u64
    }

    /// How soon a window limiter that refused a request at `now` has room again, when
    /// the group's own answers show it: the upstream accepted the announced quota of
    /// the group's requests within the last window, so the oldest of those leaves the
    /// window (a sliding one frees a place then; a fixed one has reset by then). A
    /// reset given in whole seconds, rounded up, can be most of a second later. `None`
    /// when fewer of the group's were accepted within the window (others spend the
    /// budget too, or this is one of several replicas): the upstream's pause holds.
    pub fn window_frees(&self, now: Instant) -> Option<Duration> {
        let (quota, window) = self.budget?;
        let quota = usize::try_from(quota).ok()?;
        if self.scale() > 1.0 || quota == 0 || self.accepted.len() < quota {
            return None;
        }
        let oldest = self.accepted[self.accepted.len() - quota];
        let frees = oldest + window;
        (now - oldest < window).then(|| frees - now)
    }
}

/// Whether a spent budget (`Remaining: 0`) should pause a group whose slowest rate
/// paces it one request per `pace`, under an `announced` budget of `quota` requests per
/// `window`, when the group itself sent `ours` of them within the last `window` (its
/// replicas counted; at least [`OURS_SHARE`] of the quota makes it the group's own).
///
/// The group's own last request of a window sees `Remaining: 0`. When the group's pace
/// keeps it inside the announced budget, its next request falls in the next window
/// anyway, and a pause until a reset read a little late (a reset in whole seconds is
/// rounded up) would only stall it past the window it is entitled to: it does not
/// pause. A budget spent by others (less than [`OURS_SHARE`] of the quota ours in the
/// window), or one that nothing says the pace fits, pauses.
pub fn spent_budget_pauses(
    pace: Option<Duration>,
    announced: Option<(u64, Duration)>,
    ours: u64,
) -> bool {
    match (pace, announced) {
        (Some(pace), Some((quota, window))) => {
            let fits = pace.as_secs_f64() * quota as f64 >= window.as_secs_f64() * (1.0 - 1e-9);
            !(fits && ours as f64 >= OURS_SHARE * quota as f64)
        }
        _ => true,
    }
}
