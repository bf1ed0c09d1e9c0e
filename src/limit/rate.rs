//! A group's rate state in this process: the rates in force and one TAT per rate.
//!
//! The arithmetic is [`super::gcra`]'s; this adds the clock (TATs are offsets from the
//! group's epoch, so tests can pause tokio's time), the pace the group learned
//! ([`super::budget`]) and the share of a replica whose shared store is down. It serves the memory store, and the Redis
//! store's fallback while Redis does not answer.

use std::borrow::Cow;
use std::time::Duration;

use tokio::time::Instant;

use super::gcra::{self, Gcra};
use crate::config::GroupSettings;

/// How far before its actual departure a request's departure may be counted, at its
/// slot. The head of a queue sleeps until its slot and tokio's timer wakes it up to a
/// millisecond late; counting the departure at the wake-up would lose that time on
/// every request, and a backlog at 10 000/s would drain at ≈ 850/s. The cap bounds the
/// catch-up after a stall to this much time's worth of requests.
pub const SLOT_CREDIT: Duration = Duration::from_millis(10);

/// The rates of one group and their TATs.
#[derive(Debug)]
pub struct Rates {
    /// The configured rates (empty: no rate limit).
    configured: Vec<Gcra>,
    /// The rates in force: the configured ones, then the learned pace if any.
    in_force: Vec<Gcra>,
    /// The pace learned from the upstream ([`super::budget`]), burst 1.
    learned: Option<Gcra>,
    /// One TAT per configured rate and one for the learned rate, as an offset from
    /// `epoch`.
    tats: Vec<Duration>,
    epoch: Instant,
}

impl Rates {
    /// The group's rates, idle as of `epoch`.
    pub fn new(settings: &GroupSettings, epoch: Instant) -> Rates {
        let configured: Vec<Gcra> = settings
            .rates
            .iter()
            .map(|r| Gcra::new(r.limit, r.period, settings.burst))
            .collect();
        Rates {
            tats: vec![Duration::ZERO; configured.len() + 1],
            in_force: configured.clone(),
            configured,
            learned: None,
            epoch,
        }
    }

    /// Takes the rates of `settings` at `now` (a reload), keeping what was spent: a
    /// rate's debt ahead of `now` is kept as the same number of requests, paid at the
    /// new pace (a backlog at 1/h reloaded to 10/s waits 100 ms per request, not the
    /// rest of the hour).
    pub fn reconfigure(&mut self, settings: &GroupSettings, now: Instant) {
        let since = self.since_epoch(now);
        let mut next = Rates::new(settings, self.epoch);
        for (i, new) in next.configured.iter().enumerate() {
            let (Some(old), Some(old_tat)) = (self.configured.get(i), self.tats.get(i)) else {
                continue;
            };
            let debt = old_tat.saturating_sub(since);
            let requests = match old.interval.is_zero() {
                true => 0.0,
                false => debt.as_secs_f64() / old.interval.as_secs_f64(),
            };
            // At most a year: config durations are bounded so, and `since` stays far
            // from overflowing.
            let owed = new.interval.as_secs_f64() * requests;
            next.tats[i] = since + Duration::from_secs_f64(owed.min(366.0 * 86_400.0));
        }
        // The learned pace and its TAT are the upstream's doing, not the file's: kept.
        let learned_tat = self.tats.last().copied().unwrap_or_default();
        if let Some(tat) = next.tats.last_mut() {
            *tat = learned_tat;
        }
        next.learned = self.learned;
        next.update();
        *self = next;
    }

    /// The group also keeps to `per_second`, learned from the upstream (`None`: nothing
    /// learned). It only matters where it is slower than the configured rates.
    pub fn set_learned(&mut self, per_second: Option<f64>) {
        self.learned = per_second
            .filter(|r| r.is_finite() && *r > 0.0)
            .map(|r| Gcra::new(1, Duration::from_secs_f64(1.0 / r.max(1e-6)), 1));
        self.update();
    }

    fn update(&mut self) {
        self.in_force.clone_from(&self.configured);
        self.in_force.extend(self.learned);
    }

    /// The emission interval of the slowest rate in force: the group's pace, if it has
    /// one.
    pub fn pace(&self) -> Option<Duration> {
        self.in_force.iter().map(|r| r.interval).max()
    }

    /// The configured rates, without the learned pace (which the Redis store books
    /// for every replica from the shared controller).
    pub fn configured(&self) -> &[Gcra] {
        &self.configured
    }

    /// The configured rates, in requests per second.
    pub fn per_second(&self) -> Vec<f64> {
        self.configured.iter().map(Gcra::per_second).collect()
    }

    /// The slowest configured rate, per second.
    pub fn configured_pace(&self) -> Option<f64> {
        self.per_second().into_iter().reduce(f64::min)
    }

    fn since_epoch(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.epoch)
    }

    /// The earliest time a request may leave that is ready at `ready`.
    pub fn earliest(&self, share: f64, ready: Instant) -> Instant {
        let since = self.since_epoch(ready);
        self.epoch + gcra::earliest_all(&enforced(&self.in_force, share), &self.tats, since)
    }

    /// Records the departure at `now` of a request of `cost` that was ready at `ready`,
    /// counted at its slot (see [`SLOT_CREDIT`]); returns that slot.
    pub fn depart(&mut self, share: f64, ready: Instant, now: Instant, cost: u32) -> Instant {
        let since_now = self.since_epoch(now);
        let rates = enforced(&self.in_force, share);
        let slot = gcra::earliest_all(&rates, &self.tats, self.since_epoch(ready))
            .clamp(since_now.saturating_sub(SLOT_CREDIT), since_now);
        gcra::advance_all(&rates, &mut self.tats, slot, cost);
        self.epoch + slot
    }

    /// Records a departure at `now` that the shared store booked, as the rates at this
    /// replica's `share` count it should the store stop answering: a TAT at least one
    /// interval of the share after it. Without it, a replica that fell back found its
    /// local rates idle and sent at once, next to the slots booked just before; and the
    /// TAT never runs further ahead than its own departures at the share took it.
    pub fn booked(&mut self, share: f64, now: Instant, cost: u32) {
        let since = self.since_epoch(now);
        let rates = enforced(&self.in_force, share);
        for (rate, tat) in rates.iter().zip(&mut self.tats) {
            *tat = (*tat).max(rate.advance(since, since, cost));
        }
    }

    /// The slot of a request of `cost` that was ready at `ready` and leaves right behind
    /// a departure counted at `after`, if that slot has come by `now`; recorded when it
    /// has. How the head of a queue releases the requests behind it that are due too.
    pub fn depart_if_due(
        &mut self,
        ready: Instant,
        after: Instant,
        now: Instant,
        cost: u32,
    ) -> Option<Instant> {
        let from = self.since_epoch(ready.max(after));
        let slot = gcra::earliest_all(&self.in_force, &self.tats, from);
        if slot > self.since_epoch(now) {
            return None;
        }
        gcra::advance_all(&self.in_force, &mut self.tats, slot, cost);
        Some(self.epoch + slot)
    }

    /// How long `ahead` cells already queued would take to leave from `now`.
    pub fn backlog(&self, now: Instant, ahead: u64) -> Duration {
        let since = self.since_epoch(now);
        let ahead = u32::try_from(ahead).unwrap_or(u32::MAX);
        self.in_force
            .iter()
            .zip(&self.tats)
            .map(|(rate, tat)| {
                (tat.saturating_sub(since) + rate.interval * ahead).saturating_sub(rate.tolerance)
            })
            .max()
            .unwrap_or_default()
    }

    /// Whether every TAT has come: the budget is as full as after a long idle time.
    pub fn is_idle(&self, now: Instant) -> bool {
        let since = self.since_epoch(now);
        self.tats.iter().all(|tat| *tat <= since)
    }
}

/// The rates this process enforces: all of `rates`, or `share` of them (a replica's
/// part while the shared store is down). Borrowed in the common case: every departure
/// asks.
fn enforced(rates: &[Gcra], share: f64) -> Cow<'_, [Gcra]> {
    if share >= 1.0 {
        Cow::Borrowed(rates)
    } else {
        Cow::Owned(rates.iter().map(|r| r.scaled(share)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rate;

    const MS: Duration = Duration::from_millis(1);

    fn rates(rate: &str) -> (Rates, Instant) {
        let settings = GroupSettings {
            rates: vec![rate.parse::<Rate>().unwrap()],
            ..GroupSettings::default()
        };
        let epoch = Instant::now();
        (Rates::new(&settings, epoch), epoch)
    }

    #[test]
    fn a_late_departure_is_counted_at_its_slot_within_the_credit() {
        // (woken this many ms after the slot, counted this many ms after it)
        for (late, counted) in [(0, 0), (1, 0), (10, 0), (25, 15)] {
            let (mut r, t0) = rates("10/s");
            r.depart(1.0, t0, t0, 1); // the slot at 0; the next is at 100 ms
            let slot = r.earliest(1.0, t0);
            assert_eq!(slot, t0 + MS * 100);
            let now = slot + MS * late;
            assert_eq!(
                r.depart(1.0, t0, now, 1),
                slot + MS * counted,
                "late {late}"
            );
        }
    }

    #[test]
    fn a_request_ready_late_is_counted_from_when_it_was_ready() {
        let (mut r, t0) = rates("10/s");
        r.depart(1.0, t0, t0, 1);
        // It waited for a permit until 300 ms: its slot is then, not at 100 ms.
        let ready = t0 + MS * 300;
        assert_eq!(r.depart(1.0, ready, ready + MS, 1), ready);
    }

    #[test]
    fn a_reload_keeps_the_debt_in_requests_at_the_new_pace() {
        let (mut r, t0) = rates("1/h");
        r.depart(1.0, t0, t0, 1);
        assert_eq!(r.earliest(1.0, t0), t0 + Duration::from_secs(3600));
        let faster = GroupSettings {
            rates: vec!["10/s".parse::<Rate>().unwrap()],
            ..GroupSettings::default()
        };
        r.reconfigure(&faster, t0);
        assert_eq!(r.earliest(1.0, t0), t0 + MS * 100);
        // Half the debt paid, then back to 1/h: the other half is half an hour.
        let at = t0 + MS * 50;
        let slower = GroupSettings {
            rates: vec!["1/h".parse::<Rate>().unwrap()],
            ..GroupSettings::default()
        };
        r.reconfigure(&slower, at);
        assert_eq!(r.earliest(1.0, at), at + Duration::from_secs(1800));
    }

    #[test]
    fn a_share_slows_the_pace() {
        for (share, next) in [(1.0, 100), (0.5, 200), (0.25, 400)] {
            let (mut r, t0) = rates("10/s");
            r.depart(share, t0, t0, 1);
            assert_eq!(r.earliest(share, t0), t0 + MS * next, "share {share}");
        }
    }

    #[test]
    fn due_requests_are_released_in_their_slots_only() {
        let (mut r, t0) = rates("1000/s");
        r.depart(1.0, t0, t0, 1);
        let now = t0 + MS * 3;
        let released: Vec<_> = std::iter::from_fn(|| r.depart_if_due(t0, t0, now, 1))
            .map(|slot| (slot - t0).as_millis())
            .collect();
        assert_eq!(released, [1, 2, 3]);
    }

    #[test]
    fn backlog_and_idle() {
        let (mut r, t0) = rates("10/s");
        assert!(r.is_idle(t0));
        r.depart(1.0, t0, t0, 1);
        assert!(!r.is_idle(t0));
        assert_eq!(r.backlog(t0, 2), MS * 300);
        assert!(r.is_idle(t0 + MS * 100));
    }
}
