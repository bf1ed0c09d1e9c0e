//! The first requests of a group that was told no rate: sent the way TCP starts a
//! connection, one, then half as many again with each round of answers.
//!
//! A group without a rate knows nothing of its upstream's budget until answers come
//! back: an announced budget, or a refusal that shows what the
//! upstream let through. A burst sent all at once before then meets the upstream's
//! wall whole (30 requests to an upstream allowing 5 a second: 25 refused). So the
//! group probes: a request may leave while fewer than `1 + growth × accepted answers`
//! have left (`growth` of [`super::Params`], 1.5), and the window grows by half each
//! round trip. The refusals of the round
//! that meets the limit come back after its accepted answers have let more out: the
//! overshoot is about half the quota (with a doubling window, the whole quota). The
//! probe ends at the first budget the group learns, at the first refusal (the
//! controller and the pause take over), or `probe_for` after its first request, whatever the
//! answers: an upstream that answers slowly holds a new group's first burst for at
//! most that long, once.
//!
//! Replicas sharing a store probe as one: one of them probes for the group, and the
//! store holds the others until it is done ([`crate::limit::redis::Probing`]).

use tokio::time::Instant;

use super::Params;

/// Where a group's probe stands.
#[derive(Debug)]
pub struct Probe {
    /// `None` once the probe is over (or for a group with a rate).
    counts: Option<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    /// When the first request left.
    started: Option<Instant>,
    /// Requests that left.
    sent: u32,
    /// Answers the upstream accepted.
    accepted: u32,
}

impl Probe {
    /// A probe for a group with no rate; none for a group with one.
    pub fn new(has_rate: bool) -> Probe {
        Probe {
            counts: (!has_rate).then(Counts::default),
        }
    }

    /// Whether the probe still runs at `now`.
    pub fn is_on(&self, now: Instant, p: &Params) -> bool {
        match &self.counts {
            None => false,
            Some(counts) => counts.started.is_none_or(|s| now < s + p.probe_for),
        }
    }

    /// `None`: a request may leave now. `Some(until)`: it waits for an answer, or
    /// until `until`, when the probe ends anyway.
    pub fn holds(&self, now: Instant, p: &Params) -> Option<Instant> {
        let counts = self.counts.as_ref().filter(|_| self.is_on(now, p))?;
        let open = f64::from(counts.sent) < 1.0 + p.growth * f64::from(counts.accepted);
        let started = counts.started?;
        (!open).then_some(started + p.probe_for)
    }

    /// A request left at `now`.
    pub fn departed(&mut self, now: Instant) {
        if let Some(counts) = &mut self.counts {
            counts.started.get_or_insert(now);
            counts.sent = counts.sent.saturating_add(1);
        }
    }

    /// A request that left got no answer from the upstream: it does not count. Returns
    /// whether the probe runs.
    pub fn unanswered(&mut self) -> bool {
        match &mut self.counts {
            Some(counts) => {
                counts.sent = counts.sent.saturating_sub(1);
                true
            }
            None => false,
        }
    }

    /// The upstream accepted a request. Returns whether that may let another leave.
    pub fn accepted(&mut self) -> bool {
        match &mut self.counts {
            Some(counts) => {
                counts.accepted = counts.accepted.saturating_add(1);
                true
            }
            None => false,
        }
    }

    /// The group learned a rate or met a refusal: the probe ends. Returns whether it
    /// was running.
    pub fn end(&mut self) -> bool {
        self.counts.take().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const P: Params = Params::DEFAULT;
    const PROBE_FOR: Duration = P.probe_for;

    #[test]
    fn the_window_grows_by_half_with_each_round_of_answers() {
        let t0 = Instant::now();
        let mut probe = Probe::new(false);
        let (mut sent, mut accepted) = (0, 0);
        // Requests out after each round, every answer of the round accepted.
        for window in [1, 3, 6, 10, 16, 25] {
            while probe.holds(t0, &P).is_none() {
                probe.departed(t0);
                sent += 1;
            }
            assert_eq!(sent, window, "after {accepted} accepted");
            assert_eq!(probe.holds(t0, &P), Some(t0 + PROBE_FOR));
            while accepted < sent {
                assert!(probe.accepted());
                accepted += 1;
            }
        }
    }

    #[test]
    fn a_group_with_a_rate_has_no_probe() {
        let t0 = Instant::now();
        let mut probe = Probe::new(true);
        for _ in 0..100 {
            assert_eq!(probe.holds(t0, &P), None);
            probe.departed(t0);
        }
        assert!(!probe.is_on(t0, &P));
        assert!(!probe.accepted());
    }

    #[test]
    fn the_probe_ends_at_a_learned_rate_or_a_refusal() {
        let t0 = Instant::now();
        let mut probe = Probe::new(false);
        probe.departed(t0);
        assert!(probe.holds(t0, &P).is_some());
        assert!(probe.end());
        assert_eq!(probe.holds(t0, &P), None);
        assert!(!probe.end(), "ends once");
    }

    #[test]
    fn the_probe_ends_its_time_after_the_first_request_whatever_the_answers() {
        let t0 = Instant::now();
        let mut probe = Probe::new(false);
        // Before the first request leaves, nothing counts the time.
        assert!(probe.is_on(t0 + 10 * PROBE_FOR, &P));
        probe.departed(t0);
        let just_before = t0 + PROBE_FOR - Duration::from_millis(1);
        assert_eq!(probe.holds(just_before, &P), Some(t0 + PROBE_FOR));
        assert_eq!(probe.holds(t0 + PROBE_FOR, &P), None);
        assert!(!probe.is_on(t0 + PROBE_FOR, &P));
    }
}
