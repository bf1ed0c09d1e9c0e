//! What the upstream's answers do to a group: a push-back pauses it and teaches the
//! learner, a normal answer calms it, an announced budget sets the learned rate, and a
//! learned rate that moved reaches the group's rates, its metric and (with the next
//! booking) the shared store.

use std::time::Duration;

use tokio::time::Instant;

use super::{Group, State};
use crate::limit::learn::{self, Announced};

impl Group {
    /// Holds every request of the group for `pause`, on every replica when the store is
    /// shared. Waiting requests that the pause (and the queue ahead of them after it)
    /// would keep past their `max_wait` are refused now.
    pub fn pause_for(&self, pause: Duration) {
        self.hold(pause, false);
    }

    /// [`Group::pause_for`]; `refusal`: the upstream refused a request.
    fn hold(&self, pause: Duration, refusal: bool) {
        let mut state = self.lock();
        state.pause.extend(Instant::now() + pause);
        if let Some(until) = state.pause.until(Instant::now()) {
            let State { queue, rates, .. } = &mut *state;
            queue.refuse_hopeless(|ahead| until + rates.backlog(until, ahead));
        }
        let learned = state.step_publication();
        drop(state);
        self.store.pause(&self.name, pause, refusal, learned);
    }

    /// The upstream pushed back on a request sent at `sent`: pause the group for
    /// `pause` (`said`: the upstream said so, else it is a guess; shorter when the
    /// group's own answers show the window has room sooner,
    /// [`learn::Learner::window_frees`]), learn from the refusal, and in adaptive mode
    /// slow its rate down. Returns the pause.
    pub fn push_back(&self, pause: Duration, said: bool, sent: Instant) -> Duration {
        let pause = {
            let mut state = self.lock();
            let now = Instant::now();
            state.pause.pushed_back(now);
            if state.adaptive.pushed_back(now) {
                let factor = state.adaptive.factor();
                state.rates.set_factor(factor);
            }
            let pace = state.rates.pace().map(|p| 1.0 / p.as_secs_f64());
            state.learner.set_replicas(self.store.replicas());
            let frees = state.learner.window_frees(now).filter(|_| said);
            if state.learner.refused(now, sent, pause, said, pace) {
                self.relearn(&mut state);
            }
            if state.probe.end() {
                self.wake.notify_waiters();
            }
            frees.map_or(pause, |frees| frees.min(pause))
        };
        self.hold(pause, true);
        pause
    }

    /// The upstream answered normally: the fallback backoff starts over, and the
    /// answer counts for what the upstream lets through.
    pub fn calm(&self) {
        let mut state = self.lock();
        state.pause.calm();
        if state.learner.accepted(Instant::now()) {
            self.relearn(&mut state);
        }
        if state.probe.accepted() {
            self.wake.notify_waiters();
        }
    }

    /// An answer announced the upstream's budget.
    pub fn learn(&self, budget: Announced) {
        let mut state = self.lock();
        if state.learner.announced(budget, Instant::now()) {
            self.relearn(&mut state);
        }
    }

    /// The group's pace: the emission interval of its slowest rate in force.
    pub fn pace(&self) -> Option<Duration> {
        self.lock().rates.pace()
    }

    /// Whether a spent budget (`Remaining: 0`) should pause the group now
    /// ([`learn::spent_budget_pauses`]), answering a request sent at `sent`. The
    /// group's own share of the window is what the shared store counted when it booked
    /// that request; else this replica's estimate from the answers it saw.
    pub fn spent_budget_pauses(&self, sent: Instant) -> bool {
        let state = self.lock();
        let now = Instant::now();
        let announced = state.learner.announced_budget();
        let ours = announced.map_or(0, |(_, window)| {
            let learner = &state.learner;
            (learner.booked_within(sent, window))
                .unwrap_or_else(|| learner.accepted_within(now, window))
        });
        learn::spent_budget_pauses(state.rates.pace(), announced, ours)
    }

    /// The learned rate changed here: the rates and the metric follow, and the shared
    /// store is told with the next booking.
    pub(super) fn relearn(&self, state: &mut State) {
        state.publish = true;
        self.apply_learned(state);
    }

    /// The learned rate changed (here or in the shared store): the rates and the
    /// metric follow.
    pub(in crate::limit) fn apply_learned(&self, state: &mut State) {
        let learned = state.learner.rate();
        state.rates.set_learned(learned.map(|(rate, _)| rate));
        if learned.is_some() && state.probe.end() {
            self.wake.notify_waiters();
        }
        for (gauge, source) in self
            .metrics
            .learned_rate
            .iter()
            .zip(crate::metrics::SOURCES)
        {
            let rate = learned
                .filter(|(_, s)| s.as_str() == source)
                .map_or(0.0, |l| l.0);
            gauge.set(rate);
        }
        if let Some((rate, source)) = learned {
            tracing::debug!(group = %self.name, rate, source = source.as_str(), "learned rate");
        }
    }

    /// Push-back episodes since the last normal answer (0 for the first), not counting
    /// the one whose pause holds now ([`crate::limit::pause::Pause::in_row`]).
    pub fn pushbacks_in_row(&self) -> u32 {
        self.lock().pause.in_row(Instant::now())
    }
}
