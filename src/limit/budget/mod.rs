//! The budget model of `docs/budget.md`: what a group knows of its upstream's limit,
//! its states, and the one controller that moves its pace. Pure: the caller passes the
//! time in, and gets back when a request may leave and what pace to keep.
//!
//! * this module — [`Params`], [`Budget`] (the group's whole learned state) and the
//!   answers it learns from;
//! * `window` — an announced window spent as a budget;
//! * `pace` — the controller;
//! * `probe` — the first requests of a group told no rate;
//! * `status` — what `/status` shows of it.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

mod pace;
mod probe;
#[cfg(test)]
mod sim;
mod status;
mod window;

use crate::ratelimit_headers::Announcement;
pub use pace::{Held, Pace};
use probe::Probe;
pub use status::{Phase, Status};
use window::{Log, Window};

/// Every parameter of the model, with its default: docs/budget.md says why each is so.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Params {
    /// The share of a learned rate or window spent, and the refusal budget: at most
    /// `1 − margin` of the answers are refused at the ceiling.
    pub margin: f64,
    /// The pace after a paced refusal, as a share of the pace refused.
    pub decrease: f64,
    /// The growth of the pace per calm round while no ceiling is known, and of the
    /// probe's window per round of answers.
    pub growth: f64,
    /// Accepted answers to requests sent under the current pace that make a calm round.
    pub calm: u32,
    /// How far back accepted answers count for what the upstream delivered.
    #[serde(serialize_with = "status::seconds")]
    pub horizon: Duration,
    /// The longest a group told no rate probes, from its first request.
    #[serde(serialize_with = "status::seconds")]
    pub probe_for: Duration,
}

impl Params {
    /// The defaults, as a constant.
    pub const DEFAULT: Params = Params {
        margin: 0.98,
        decrease: 0.9,
        growth: 1.5,
        calm: 4,
        horizon: Duration::from_secs(5),
        probe_for: Duration::from_secs(1),
    };
}

impl Default for Params {
    fn default() -> Params {
        Params::DEFAULT
    }
}

/// How many accepted answers are kept for what the upstream delivered.
const SAMPLE: usize = 256;

/// Everything a group has learned of its upstream's budget.
#[derive(Debug)]
pub struct Budget {
    params: Params,
    probe: Probe,
    window: Option<Window>,
    pace: Pace,
    departures: Log,
    /// When the upstream accepted the last requests since the last refusal that
    /// counted, within `horizon`.
    accepted: VecDeque<Instant>,
    /// Departures since the last refusal that counted, and the first of them.
    offered: (u32, Option<Instant>),
    /// How many replicas share the budget: each sees that share of the answers.
    replicas: u32,
    /// This replica probes for the group: the answers it sees are all the group's.
    sole: bool,
    /// Accepted answers (for all replicas) since the window last let through a request
    /// the upstream refused while no pace held the group; `None`: never. Such a refusal
    /// is a window's edge met a little early when it is the first, or comes after
    /// `1 / (1 − margin)` accepted answers: the margin's share of refusals. More often,
    /// the upstream refuses what its window allows, and the group needs a pace.
    since_edge: Option<f64>,
}

impl Budget {
    /// Nothing learned; a group told no rate (`has_rate` false) probes first, and the
    /// pace never drops below `floor` (per second, `min_rate`).
    pub fn new(params: Params, has_rate: bool, floor: f64) -> Budget {
        Budget {
            params,
            probe: Probe::new(has_rate),
            window: None,
            pace: Pace::new(floor),
            departures: Log::default(),
            accepted: VecDeque::new(),
            offered: (0, None),
            replicas: 1,
            sole: false,
            since_edge: None,
        }
    }

    /// A reload: a rate configured ends the probe; the floor is the new one.
    pub fn reconfigure(&mut self, has_rate: bool, floor: f64) {
        if has_rate {
            self.probe.end();
        }
        self.pace.set_floor(floor);
    }

    /// The model's parameters.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// `replicas` share the upstream's budget (1 unless the store is shared).
    pub fn set_replicas(&mut self, replicas: u32) {
        self.replicas = replicas.max(1);
    }

    /// Whether this replica probes for the group (the shared store says so): then the
    /// answers it sees are all of the group's, not its share.
    pub fn probes_for_group(&mut self, sole: bool) {
        self.sole = sole;
    }

    /// What one answer seen here stands for among the group's.
    fn weight(&self) -> f64 {
        if self.sole {
            1.0
        } else {
            f64::from(self.replicas)
        }
    }

    /// A request left at `now`.
    pub fn departed(&mut self, now: Instant) {
        self.probe.departed(now);
        self.departures.push(now);
        self.offered.0 = self.offered.0.saturating_add(1);
        self.offered.1.get_or_insert(now);
    }

    /// When the probe lets the next request leave, if it holds it now.
    pub fn probe_holds(&self, now: Instant) -> Option<Instant> {
        self.probe.holds(now, &self.params)
    }

    /// Whether the group still probes at `now`.
    pub fn probing(&self, now: Instant) -> bool {
        self.probe.is_on(now, &self.params)
    }

    /// The request that left last got no answer from the upstream (DNS, a refused
    /// connection, a timeout): it teaches nothing, and the probe does not count it.
    /// Returns whether that lets another request leave.
    pub fn unanswered(&mut self) -> bool {
        self.probe.unanswered()
    }

    /// Ends the probe (another replica learned for the group). Returns whether it ran.
    pub fn end_probe(&mut self) -> bool {
        self.probe.end()
    }

    /// When the window lets a request leave, if not now. `shared`: a shared store
    /// counts the group's departures against the window itself, and this replica keeps
    /// to its share of what the upstream says remains.
    pub fn opens(&self, now: Instant, shared: bool) -> Option<Instant> {
        let window = self.window.as_ref()?;
        let share = 1.0 / f64::from(self.replicas);
        let trusted = self.pace.rate.is_none();
        window.opens(&self.departures, now, &self.params, !shared, share, trusted)
    }

    /// The window's budget, quota per length, when known (a shared store counts it).
    pub fn window_budget(&self) -> Option<(u64, Duration)> {
        self.window.as_ref()?.budget()
    }

    /// The learned pace, per second.
    pub fn pace(&self) -> Option<f64> {
        self.pace.rate
    }

    /// The controller's state (for a shared store).
    pub fn controller(&self) -> &Pace {
        &self.pace
    }

    /// Takes the pace another replica set, learned of at `now`. Returns whether it
    /// moved.
    pub fn adopt(&mut self, rate: Option<f64>, ceiling: Option<f64>, now: Instant) -> bool {
        let moved = (rate, ceiling) != (self.pace.rate, self.pace.ceiling);
        if moved {
            self.pace.adopt(rate, ceiling, now);
            if rate.is_some() {
                self.probe.end();
            }
        }
        moved
    }

    /// An answer to a request that left at `sent` announced `a` at `now`. Returns
    /// whether a waiting request should look again.
    pub fn announced(&mut self, a: &Announcement, sent: Instant, now: Instant) -> bool {
        let window = self.window.get_or_insert_with(Window::new);
        let changed = window.announced(a, sent, now, &self.departures);
        window.size(&mut self.departures);
        self.probe.end() | changed
    }

    /// The upstream accepted the request that left at `sent`, at `now`. Returns
    /// whether a waiting request should look again.
    pub fn accepted(&mut self, sent: Instant, now: Instant) -> bool {
        if self.accepted.len() >= SAMPLE {
            self.accepted.pop_front();
        }
        self.accepted.push_back(now);
        let weight = self.weight();
        if let Some(n) = &mut self.since_edge {
            *n += weight;
        }
        self.probe.accepted() | self.pace.accepted(&self.params, sent, now, weight)
    }

    /// The upstream refused the request that left at `sent`, at `now`, and asked for
    /// `pause` (`said`: it said so, else `pause` is a guess). `configured` is the
    /// slowest configured rate in force, per second. Returns whether a waiting request
    /// should look again.
    pub fn refused(
        &mut self,
        sent: Instant,
        now: Instant,
        pause: Duration,
        said: bool,
        configured: Option<f64>,
    ) -> bool {
        let probed = self.probe.end();
        let params = self.params;
        if let Some(window) = &mut self.window {
            if window.refused(sent, &params) {
                return true;
            }
        }
        if !self.pace.counts(sent) {
            return probed;
        }
        if self.window_budget().is_some() && self.pace.rate.is_none() {
            let edge = self
                .since_edge
                .is_none_or(|n| n >= 1.0 / (1.0 - params.margin));
            self.since_edge = Some(0.0);
            if edge {
                return probed;
            }
        }
        let delivered = self.delivered(now, pause);
        let window_rate = self.window.as_ref().and_then(Window::rate);
        let held = [configured, self.pace.rate, window_rate]
            .into_iter()
            .flatten()
            .reduce(f64::min);
        let held = match held {
            // What the upstream let through per pause it asked for is a reading of its
            // limit when the group offered it at least `decrease` of its pace for an
            // interval or more: else it shows the group's demand.
            Some(pace) => {
                let (offered, first) = self.offered;
                let span = first.map_or(0.0, |f| (now - f).as_secs_f64());
                let offered = f64::from(offered) * self.weight();
                let busy = span * pace >= 1.0 && offered >= params.decrease * pace * span;
                Held::Paced {
                    pace,
                    delivered: (said && busy).then_some(delivered),
                }
            }
            None => Held::Unpaced { delivered, said },
        };
        self.accepted.clear();
        self.offered = (0, None);
        let moved = self.pace.refused(&params, sent, now, held);
        self.pace.paused(pause);
        moved | probed
    }

    /// What the upstream delivered, per second, for all replicas: its accepted answers
    /// since the last refusal that counted (within `horizon`), over the time since the
    /// first of them or over `pause`, whichever is longer; one per pause when none was
    /// accepted.
    fn delivered(&mut self, now: Instant, pause: Duration) -> f64 {
        let horizon = self.params.horizon;
        while self.accepted.front().is_some_and(|at| now - *at > horizon) {
            self.accepted.pop_front();
        }
        let span = self
            .accepted
            .front()
            .map_or(Duration::ZERO, |first| now - *first)
            .max(pause)
            .max(Duration::from_millis(1));
        let n = self.accepted.len().max(1) as f64 * self.weight();
        n / span.as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_burst_refused_with_retry_after_reads_the_quota_it_let_through() {
        let t0 = Instant::now();
        let mut b = Budget::new(Params::default(), false, 0.0);
        for _ in 0..10 {
            b.departed(t0);
        }
        for _ in 0..5 {
            b.accepted(t0, t0 + MS);
        }
        assert!(b.refused(t0, t0 + MS * 2, S, true, None));
        let status = b.status(t0 + MS * 2);
        assert_eq!(status.phase, Phase::Paced);
        assert_eq!(status.pace_per_second, Some(5.0 * 0.9));
        assert_eq!(status.ceiling_per_second, Some(5.0));
        // The rest of the burst's refusals are the same episode.
        assert!(!b.refused(t0, t0 + MS * 3, S, true, None));
    }

    #[test]
    fn an_announcement_ends_the_probe_and_the_window_holds_the_burst() {
        let t0 = Instant::now();
        let mut b = Budget::new(Params::default(), false, 0.0);
        b.departed(t0);
        assert!(b.probe_holds(t0).is_some());
        let a = Announcement {
            quota: Some(3),
            window: Some(S),
            remaining: Some(2),
            reset: None,
        };
        assert!(b.announced(&a, t0, t0 + MS));
        assert_eq!(b.probe_holds(t0 + MS), None);
        assert_eq!(b.status(t0).phase, Phase::Windowed);
        b.departed(t0 + MS);
        b.departed(t0 + MS);
        assert_eq!(b.opens(t0 + MS, false), Some(t0 + S.div_f64(0.98)));
    }

    #[test]
    fn refusals_in_a_window_that_let_them_through_pace_at_the_windows_rate() {
        let t0 = Instant::now();
        let mut b = Budget::new(Params::default(), true, 0.0);
        let a = Announcement {
            quota: Some(10),
            window: Some(S),
            remaining: Some(9),
            reset: None,
        };
        b.departed(t0);
        b.announced(&a, t0, t0 + MS);
        // One refusal is the window's edge met early: the pause, and nothing more.
        assert!(!b.refused(t0 + MS * 5, t0 + MS * 6, MS * 100, true, Some(20.0)));
        assert_eq!(b.pace(), None);
        // A second within the window: the upstream refuses its bursts. Told 20/s, the
        // window's 10/s is the slower, and the pace it was held to.
        assert!(b.refused(t0 + MS * 200, t0 + MS * 201, MS * 100, true, Some(20.0)));
        assert_eq!(b.pace(), Some(9.0));
        assert_eq!(b.status(t0).phase, Phase::WindowedPaced);
    }
}
