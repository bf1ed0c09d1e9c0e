//! What replicas sharing a store share of a group's learning: the learned state, how
//! a publication ranks against another replica's, and the store's count of the
//! group's bookings that a replica reads a window from.

use std::time::Duration;

use tokio::time::Instant;

use super::{Learner, Source, BOOKINGS, CALM, COUNTED, MARGIN, MIN_PACED_REFUSALS, REFUSED_SHARE};

/// What replicas sharing a store share of their learning ([`Learner::shared`]): the
/// learned rate before margin, the step it is at, and its source. The replica that
/// learns publishes it with its next booking; every replica books against it and
/// adopts it ([`Learner::adopt`]), so that they pace as one group and step down once
/// per refusal episode, not once per replica.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shared {
    /// The learned rate before margin and steps, per second.
    pub base: f64,
    /// The fraction of `base` in force.
    pub factor: f64,
    /// Where it comes from.
    pub source: Source,
}

impl Shared {
    /// The rate in force, per second (margin included).
    pub fn rate(&self) -> f64 {
        self.base * self.factor * MARGIN
    }
}

impl Source {
    /// The source named by [`Source::as_str`].
    pub fn parse(text: &str) -> Option<Source> {
        [
            Source::RatelimitPolicy,
            Source::LimitAndReset,
            Source::Refusals,
        ]
        .into_iter()
        .find(|s| s.as_str() == text)
    }
}

/// How a learned state published to a shared store ranks against one that another
/// replica published less than a second before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precedence {
    /// It replaces it: an announcement.
    Replaces,
    /// The slower holds: a step or a climb. The replicas' refusals of one overload
    /// are one episode, and its slowest reading holds (a replica's booking counted
    /// before another's refusal came back counts that refused request as let
    /// through); a replica that climbs from a state it has not yet seen stepped down
    /// elsewhere would undo the step (a climb comes a calm second later anyway).
    Slower,
    /// The faster holds: one replica's reading of an unpaced burst from its share of
    /// the answers. A reading too fast is corrected by the refusal it meets; one too
    /// slow only by climbing, a calm interval at a time.
    Faster,
}

impl Precedence {
    /// Its code in the shared store's booking script.
    pub fn code(self) -> u8 {
        match self {
            Precedence::Replaces => 0,
            Precedence::Slower => 1,
            Precedence::Faster => 2,
        }
    }
}

/// A group booked at least this share of its pace over a window was busy for all of
/// it: its refusals show the upstream's limit.
const BUSY: f64 = 0.9;

/// One of this replica's bookings in a shared store: its slot, when it was booked, and
/// what the store counted of the group within a window before it.
pub(super) type Booking = (Instant, Instant, Option<Counted>);

/// What a shared store counted of a group's requests, from every replica, when it
/// booked one: each replica sees only its share of the answers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counted {
    /// The bookings within `window` before this one's departure, this one included.
    pub booked: u64,
    /// The refusals within `window` before the booking.
    pub refused: u64,
    /// The window counted over.
    pub window: Duration,
}

impl Learner {
    /// The window over which a shared store should count the group's bookings, paced
    /// one every `pace`: the announced one, else the pause the last refusal said, else
    /// [`CALM`] (what a first refusal's `Retry-After: 1` will be read against); only a
    /// window that holds at most [`COUNTED`] requests at that pace (one entry each).
    pub fn count_window(&self, pace: Option<Duration>) -> Option<Duration> {
        let pace = pace.filter(|p| !p.is_zero())?;
        let window = (self.budget.map(|(_, window)| window))
            .or(self.said_window)
            .unwrap_or(CALM);
        let holds = window.as_secs_f64() / pace.as_secs_f64();
        (!window.is_zero() && holds <= COUNTED as f64).then_some(window)
    }

    /// The shared store gave this replica the slot `slot` at `now`, and counted
    /// `counted` of the group.
    pub fn booked(&mut self, slot: Instant, now: Instant, counted: Option<Counted>) {
        if self.booked.len() >= BOOKINGS {
            self.booked.pop_front();
        }
        let counted = counted.filter(|c| c.booked > 0);
        self.booked.push_back((slot, now, counted));
    }

    /// The booking of the request that left at `sent`: the last slot at or before it
    /// (the head leaves at its slot, a little late; the next head books as soon as it
    /// has left, often before its answer comes).
    pub(super) fn booking(&self, sent: Instant) -> Option<&Booking> {
        self.booked.iter().rev().find(|(slot, ..)| *slot <= sent)
    }

    /// The group's bookings within `window` before the request that left at `sent`,
    /// that one included, as the shared store counted them when booking it.
    pub fn booked_within(&self, sent: Instant, window: Duration) -> Option<u64> {
        let (slot, _, counted) = self.booking(sent)?;
        let counted = (*counted)?;
        (counted.window == window && sent - *slot < window).then_some(counted.booked)
    }

    /// What a bare limiter let through the group, per second, read from the shared
    /// store's counts at the booking of the request that left at `sent` and was
    /// refused: its bookings less its refusals (this one included) within the window.
    /// `None` unless the refusals are a fair share of the bookings and the group was
    /// booked at its `pace` (per second) for the whole window: else they show the
    /// group's demand rather than the upstream's limit.
    pub(super) fn group_let_through(&self, sent: Instant, pace: f64) -> Option<f64> {
        let (_, _, counted) = self.booking(sent)?;
        let Counted {
            booked,
            refused,
            window,
        } = (*counted)?;
        let refused = refused + 1;
        let busy = booked as f64 >= BUSY * pace * window.as_secs_f64();
        let fair =
            refused >= MIN_PACED_REFUSALS as u64 && refused as f64 >= REFUSED_SHARE * booked as f64;
        (busy && fair && !window.is_zero())
            .then(|| booked.saturating_sub(refused) as f64 / window.as_secs_f64())
    }

    /// How the last change of the learned state ranks against a state another
    /// replica published less than a second before.
    pub fn precedence(&self) -> Precedence {
        self.precedence
    }

    /// The learned state to share with other replicas; `None` until something is
    /// learned.
    pub fn shared(&self) -> Option<Shared> {
        self.base.map(|(base, source)| Shared {
            base,
            factor: self.factor,
            source,
        })
    }

    /// The state learned here reached the shared store at `now`. The next climb counts
    /// from there: the store keeps a slower state published less than [`CALM`]
    /// before a faster one ([`Precedence::Slower`]), and a climb it did not keep would
    /// read back as another replica's step down.
    pub fn published(&mut self, now: Instant) {
        self.changed = now;
    }

    /// Takes the learned state another replica published (or this one, read back).
    /// Returns whether the rate in force moved. A lower rate adopted is the step of
    /// this episode (a refusal of a request sent before it says nothing more), and the
    /// next calm interval counts from now (one climb per calm interval for the whole
    /// group, not one per replica).
    pub fn adopt(&mut self, shared: Shared, now: Instant) -> bool {
        let valid = shared.base.is_finite() && shared.base > 0.0 && shared.factor > 0.0;
        if !valid || self.shared() == Some(shared) {
            return false;
        }
        // A lower rate is another replica's answer to a refusal: this episode's step,
        // and the requests sent before it were sent too fast to say anything about it.
        // The same or a higher one (a climb, an announcement) paced them alike.
        let lower = self.rate().is_none_or(|(rate, _)| shared.rate() < rate);
        if !lower {
            // Another replica climbed: the rate before held calm.
            self.held_calm();
        }
        if lower {
            self.stepped_at = Some(now);
            self.since = Some(now);
        }
        self.base = Some((shared.base, shared.source));
        self.factor = shared.factor;
        self.slow_start = false;
        self.changed = now;
        true
    }
}
