//! Whether `Remaining: 0` pauses a group: a decision of its own, pure.

use std::time::Duration;

/// A spent budget is the group's own when it sent at least this share of the quota in
/// the window: the rest may be late answers, or rounding of one replica's share.
pub const OURS_SHARE: f64 = 0.8;

/// Whether a spent budget (`Remaining: 0`) should pause a group whose slowest rate
/// paces it one request per `pace`, under an `announced` budget of `quota` requests per
/// `window`, when the group itself sent `ours` of them within the last `window` (its
/// replicas counted; at least [`OURS_SHARE`] of the quota makes it the group's own).
///
/// The group's own last request of a window sees `Remaining: 0`. When the group's pace
/// keeps it inside the announced budget, its next request falls in the next window
/// anyway, and a pause until a reset read a little late (a reset in whole seconds is
/// rounded up) would only stall it past the window it is entitled to: it does not
/// pause. A budget spent by others (fewer than `quota` of ours in the window), or one
/// that nothing says the pace fits, pauses.
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
