//! What `/status` shows of a group, and whether it is idle.

use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::super::budget;
use super::super::tokens::TokenStatus;
use super::Group;

/// A snapshot of a group for the admin `/status` page.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GroupStatus {
    /// The group's name.
    pub name: String,
    /// Requests waiting or at the head of the queue.
    pub queued: usize,
    /// Requests holding a concurrency permit.
    pub in_flight: usize,
    /// Seconds until the upstream's pause ends, if paused.
    pub paused_for_seconds: Option<f64>,
    /// The configured rates, in requests per second; empty when the group has none.
    pub effective_rates_per_second: Vec<f64>,
    /// What the group learned of its upstream's budget (docs/budget.md).
    #[serde(flatten)]
    pub budget: budget::Status,
    /// Its tokens, in a group that counts them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenStatus>,
}

impl Group {
    /// A snapshot for `/status`.
    pub fn status(&self) -> GroupStatus {
        let state = self.lock();
        let now = Instant::now();
        GroupStatus {
            name: self.name.to_string(),
            queued: state.queue.len(),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            paused_for_seconds: state.pause.until(now).map(|p| (p - now).as_secs_f64()),
            effective_rates_per_second: state.rates.per_second(),
            budget: state.budget.status(now),
            tokens: state.tokens.as_ref().map(|t| t.status(now)),
        }
    }

    /// Whether the group holds no state worth keeping: nothing queued, in flight or
    /// paused, and its rates back to idle. An idle group can be dropped and rebuilt
    /// later without any request noticing.
    pub fn is_idle(&self) -> bool {
        let state = self.lock();
        let now = Instant::now();
        state.queue.is_empty()
            && self.in_flight.load(Ordering::Relaxed) == 0
            && state.pause.until(now).is_none()
            && state.rates.is_idle(now)
            && state.tokens.as_ref().is_none_or(|t| t.is_idle(now))
    }
}
