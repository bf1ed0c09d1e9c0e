//! Where a group's budget is kept: in this process, or in Redis for every replica.
//!
//! The head of a queue asks the store for its slot ([`Store::book`]). The memory store
//! answers from the group's own [`super::rate::Rates`] and the departure is recorded
//! when the request actually leaves (so a head whose client goes spends no slot). The
//! Redis store books the slot atomically in Redis, one round trip, and has nothing to
//! record afterwards; while Redis does not answer it falls back to the local rates at
//! this replica's share (`on_backend_error = "local"`) or refuses (`"deny"`). A Redis
//! booking also carries the group's learning: it publishes what this replica learned
//! and answers the learned state every replica books against, which this one adopts.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::group::State;
use super::learn::{Counted, Precedence};
use super::redis::{Learning, Probing, Publication, Redis, Reservation};
use super::{Group, Refusal};
use crate::config::OnBackendError;

/// The share of a group's rates that replicas sharing a budget book.
pub const SHARED_MARGIN: f64 = 0.98;
/// What replicas add to each interval they book, at most 5 % of it: each replica wakes
/// and sends with a jitter of its own, in absolute time, which a share covers only at
/// low rates (at 50/s, 2 % is 0.4 ms, less than a loaded host's wake-up jitter).
pub const SHARED_JITTER: Duration = Duration::from_millis(1);

/// A slot booked in the shared store at least this far ahead is checked again before
/// it comes ([`Store::slot_holds`]): another request may have been refused meanwhile,
/// on any replica, and then the pace it was booked at is refused too. A refusal comes
/// back an upstream's round trip after its request left, often tens of milliseconds:
/// a nearer slot is rarely passed by one, and checking each would cost a round trip
/// and a wake-up per request at high rates, which delays departures unevenly.
pub const RECHECK_AHEAD: Duration = Duration::from_millis(100);
/// How long before its slot a booking is checked again: room for the round trip.
pub const RECHECK_BEFORE: Duration = Duration::from_millis(2);
/// How often a replica waiting for another's probe asks again ([`Probing`]): it learns
/// what the probe taught (or that it is over) this long after at most.
pub const PROBE_POLL: Duration = Duration::from_millis(25);

/// The factor a rate of one request per `interval` is slowed by when replicas book it.
pub fn shared_factor(interval: Duration) -> f64 {
    let padded = interval.div_f64(SHARED_MARGIN) + SHARED_JITTER.min(interval.mul_f64(0.05));
    interval.as_secs_f64() / padded.as_secs_f64().max(1e-9)
}

/// A group's store.
#[derive(Clone)]
pub enum Store {
    /// This process only.
    Memory,
    /// Shared by the replicas that use this Redis.
    Redis(Arc<Redis>),
}

/// The slot the store gave the head of a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The local rates let it leave at this time; its departure is still to be
    /// recorded, at that time or later.
    Local(Instant),
    /// Booked in the shared store: already counted.
    Booked {
        /// When it may leave.
        at: Instant,
        /// When it was booked, in µs on the store's clock ([`Store::slot_holds`]).
        stamp: u64,
    },
    /// The shared store holds the group paused (the group's pause now says until
    /// when): nothing booked, to be asked again when the pause ends.
    Paused,
    /// Another replica probes the group's upstream ([`Probing`]): nothing booked, to
    /// be asked again at this time, or when an answer comes here.
    Probing(Instant),
}

impl Store {
    /// The fraction of the group's rates this process enforces locally: all of them,
    /// or while Redis is down this replica's share (rate / replicas).
    pub fn local_share(&self) -> f64 {
        match self {
            Store::Redis(redis) if !redis.is_up() => 1.0 / f64::from(redis.replicas()),
            _ => 1.0,
        }
    }

    /// How many replicas share the budget (1 for the memory store).
    pub fn replicas(&self) -> u32 {
        match self {
            Store::Redis(redis) => redis.replicas(),
            Store::Memory => 1,
        }
    }

    /// The slot of a request of `cost` at the head of `group`'s queue, asked at `now`.
    pub async fn book(&self, group: &Group, cost: u32, now: Instant) -> Result<Slot, Refusal> {
        if let Store::Redis(redis) = self {
            // Booked a little under the rates: replicas wake up and send with a jitter
            // of their own, and a strict upstream refuses two requests closer than its
            // interval, whichever replica sent them. The learned rate is the group's,
            // kept in Redis: published by the replica that learned it.
            let (rates, learning) = {
                let mut state = group.lock();
                let rates: Vec<_> = state
                    .rates
                    .configured_in_force()
                    .iter()
                    .map(|r| r.scaled(shared_factor(r.interval)))
                    .collect();
                (rates, state.learning())
            };
            // Boxed: the round trip's state is large, and inline it would size every
            // waiting request's future, with the memory store too.
            let booked = Box::pin(redis.reserve(&group.name, &rates, cost, learning)).await;
            // Counted from when the answer came, not from `now`: the round trip is
            // part of the wait.
            let answered = Instant::now();
            let slot = answered + booked.as_ref().map_or(Duration::ZERO, |b| b.wait);
            group.shared_learning(booked.as_ref(), learning, slot);
            if let Some(booking) = booked {
                if let Some(pause) = booking.paused_for {
                    // Another replica's push-back: requests already waiting here
                    // honour it too, and this one books after it.
                    group.lock().pause.extend(answered + pause);
                    return Ok(Slot::Paused);
                }
                if let Probing::Elsewhere(left) = booking.probing {
                    return Ok(Slot::Probing(answered + left.min(PROBE_POLL)));
                }
                return Ok(Slot::Booked {
                    at: slot,
                    stamp: booking.at,
                });
            }
            if redis.on_error == OnBackendError::Deny {
                return Err(Refusal::BackendDown);
            }
        }
        let share = self.local_share();
        Ok(Slot::Local(group.lock().rates.earliest(share, now)))
    }

    /// Whether a slot booked at `stamp` in the shared store, about to come, still holds:
    /// not when the group is paused (the pause is taken here too) or the upstream
    /// refused one of the group's requests since, on any replica. The slot is then
    /// left unused, and the request books again, at the pace the refusal taught.
    pub async fn slot_holds(&self, group: &Group, stamp: u64) -> bool {
        let Store::Redis(redis) = self else {
            return true;
        };
        match redis.recheck(&group.name, stamp).await {
            Some((Some(pause), _)) => {
                group.lock().pause.extend(Instant::now() + pause);
                false
            }
            Some((None, refused)) => !refused,
            None => true,
        }
    }

    /// Tells the other replicas that the group is paused for `pause`, because the
    /// upstream refused a request (`refusal`) or its budget is spent, and the step down
    /// this replica `learned` from it.
    pub fn pause(&self, group: &Arc<str>, pause: Duration, refusal: bool, learned: Publication) {
        if let Store::Redis(redis) = self {
            let (redis, group) = (redis.clone(), group.clone());
            tokio::spawn(async move { redis.pause(&group, pause, refusal, learned).await });
        }
    }
}

impl State {
    /// What the next booking in the shared store publishes of the learning done here,
    /// and the window to count the group's bookings over.
    pub(super) fn learning(&mut self) -> Learning {
        Learning {
            publication: self.publication(),
            window: self.learner.count_window(self.rates.pace()),
            probing: self.probe.is_on(Instant::now()),
        }
    }

    /// The learning done here that the shared store has yet to hear of (taken: it is
    /// published once).
    pub(super) fn publication(&mut self) -> Publication {
        let publish = std::mem::take(&mut self.publish);
        self.publication_if(publish)
    }

    /// What a pause publishes: a step down, which every replica should pace by at
    /// once. A first reading of a burst from this replica's share of the answers waits
    /// for the next booking, by which time the other replicas' own readings are in
    /// (the fastest holds); taken early, it would have them discard those as stale.
    /// The next booking publishes a step again (the flag stays): nothing waits for the
    /// pause's answer, and while the store is down the pause does not reach it.
    pub(super) fn step_publication(&self) -> Publication {
        let step = self.learner.precedence() == Precedence::Slower;
        self.publication_if(self.publish && step)
    }

    /// The learned state with the interval to book it at, when `publish`.
    fn publication_if(&self, publish: bool) -> Publication {
        let publish = publish
            .then(|| self.learner.shared())
            .flatten()
            .map(|shared| {
                let rate = shared.rate().max(1e-6);
                let per_second = rate * shared_factor(Duration::from_secs_f64(1.0 / rate));
                (shared, Duration::from_secs_f64(1.0 / per_second))
            });
        Publication {
            publish,
            precedence: self.learner.precedence(),
        }
    }
}

impl Group {
    /// What the shared store answered a booking that published `learning` (`None`: it
    /// did not answer), for the slot at `slot`: the learned rate in force there is
    /// adopted, the count of bookings kept, and what did not reach it (or what it no
    /// longer has) is published again with the next booking.
    pub(super) fn shared_learning(
        &self,
        booked: Option<&Reservation>,
        learning: Learning,
        slot: Instant,
    ) {
        let mut state = self.lock();
        let Some(booking) = booked else {
            state.publish |= learning.publication.publish.is_some();
            state.learner.probes_for_group(false);
            return;
        };
        if booking.probing == Probing::Over {
            state.probe.end();
        }
        let now = Instant::now();
        let elsewhere = matches!(booking.probing, Probing::Elsewhere(_));
        if booking.paused_for.is_none() && !elsewhere {
            state
                .learner
                .probes_for_group(booking.probing == Probing::ForGroup);
            let counted = learning.window.map(|window| Counted {
                booked: booking.booked_in_window,
                refused: booking.refused_in_window,
                window,
            });
            state.learner.booked(slot, now, counted);
        }
        let published = learning.publication.publish.map(|(shared, _)| shared);
        match booking.learned {
            // Learned here since the booking left: that goes out with the next one.
            _ if state.publish => {}
            Some(shared) if published == Some(shared) => state.learner.published(now),
            Some(shared) => {
                if state.learner.adopt(shared, now) {
                    self.apply_learned(&mut state);
                }
            }
            None => state.publish = state.learner.shared().is_some(),
        }
    }
}
