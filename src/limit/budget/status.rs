//! What `/status` shows of a group's budget: its state in the model, what it learned
//! and the parameters.

use std::time::Duration;

use tokio::time::Instant;

use super::window::Window;
use super::{Budget, Params};

/// A group's state in the model, as `/status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Told no rate, nothing learned yet: the first requests probe.
    Probing,
    /// Only the configured rates (if any) hold it.
    Open,
    /// An announced window is spent as a budget.
    Windowed,
    /// A pace learned from refusals holds it.
    Paced,
    /// Both.
    WindowedPaced,
}

impl Phase {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Probing => "probing",
            Phase::Open => "open",
            Phase::Windowed => "windowed",
            Phase::Paced => "paced",
            Phase::WindowedPaced => "windowed-paced",
        }
    }
}

/// What `/status` shows of a group's budget.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Status {
    /// The state.
    pub phase: Phase,
    /// The learned pace, per second.
    pub pace_per_second: Option<f64>,
    /// The pace last refused, per second.
    pub ceiling_per_second: Option<f64>,
    /// The announced quota per window.
    pub window_quota: Option<u64>,
    /// The window's length, in seconds.
    pub window_seconds: Option<f64>,
    /// What the upstream last said remains.
    pub remaining: Option<u64>,
    /// The model's parameters.
    pub params: Params,
}

impl Budget {
    /// The state, for `/status`.
    pub fn status(&self, now: Instant) -> Status {
        let window = self.window.as_ref();
        let budget = window.and_then(Window::budget);
        let phase = match (
            self.probing(now),
            window.is_some(),
            self.pace.rate.is_some(),
        ) {
            (_, true, true) => Phase::WindowedPaced,
            (_, true, false) => Phase::Windowed,
            (_, false, true) => Phase::Paced,
            (true, false, false) => Phase::Probing,
            (false, false, false) => Phase::Open,
        };
        Status {
            phase,
            pace_per_second: self.pace.rate,
            ceiling_per_second: self.pace.ceiling,
            window_quota: budget.map(|(q, _)| q),
            window_seconds: budget.map(|(_, w)| w.as_secs_f64()),
            remaining: window.and_then(Window::remaining),
            params: self.params,
        }
    }
}

pub(super) fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}
