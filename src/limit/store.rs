//! Where a group's budget is kept: in this process, or in Redis for every replica.
//!
//! The head of a queue asks the store for its slot ([`Store::book`]). The memory store
//! answers from the group's own [`super::rate::Rates`] and the departure is recorded
//! when the request actually leaves (so a head whose client goes spends no slot). The
//! Redis store books the slot atomically in Redis, one round trip, and has nothing to
//! record afterwards; while Redis does not answer it falls back to the local rates at
//! this replica's share (`on_backend_error = "local"`) or refuses (`"deny"`). A Redis
//! booking also carries the group's budget: the window's departures are counted for
//! every replica, a change of the pace made here is published, and the shared
//! controller's record in force comes back, which this replica adopts.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::group::State;
use super::redis::protocol::Publish;
use super::redis::{Booking, Probing, Redis, Reservation};
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
            // interval, whichever replica sent them.
            let (rates, booking) = {
                let mut state = group.lock();
                let rates: Vec<_> = state
                    .rates
                    .configured()
                    .iter()
                    .map(|r| r.scaled(shared_factor(r.interval)))
                    .collect();
                let mut booking = state.booking(now);
                if state.fell_back {
                    let share = 1.0 / f64::from(redis.replicas());
                    booking.floor = state
                        .rates
                        .earliest(share, now)
                        .saturating_duration_since(now);
                }
                (rates, booking)
            };
            // Boxed: the round trip's state is large, and inline it would size every
            // waiting request's future, with the memory store too.
            let published = booking.publish.clone();
            let booked = Box::pin(redis.reserve(&group.name, &rates, cost, booking)).await;
            // Counted from when the answer came, not from `now`: the round trip is
            // part of the wait.
            let answered = Instant::now();
            group.shared_budget(booked.as_ref(), published);
            if let Some(booking) = booked {
                group.lock().fell_back = false;
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
                    at: answered + booking.wait,
                    stamp: booking.at,
                });
            }
            if redis.on_error == OnBackendError::Deny {
                return Err(Refusal::BackendDown);
            }
        }
        let share = self.local_share();
        let state = group.lock();
        let shared = !matches!(self, Store::Memory);
        let at = state.rates.earliest(share, now);
        Ok(Slot::Local(
            state.budget.opens(now, shared).map_or(at, |w| w.max(at)),
        ))
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
    /// upstream refused a request (`refusal`) or its budget is spent, and the change of
    /// the pace this replica made (`publish`).
    pub fn pause(
        &self,
        group: &Arc<str>,
        pause: Duration,
        refusal: bool,
        publish: Option<Publish>,
    ) {
        if let Store::Redis(redis) = self {
            let (redis, group) = (redis.clone(), group.clone());
            tokio::spawn(async move { redis.pause(&group, pause, refusal, publish).await });
        }
    }
}

impl State {
    /// What a booking in the shared store adds to the rates: the pace, the window, and
    /// a change of the pace made here, taken (it is published once).
    pub(super) fn booking(&mut self, now: Instant) -> Booking {
        let pace = self.budget.pace().map(|rate| {
            let interval = Duration::from_secs_f64(1.0 / rate.max(1e-6));
            interval.div_f64(shared_factor(interval))
        });
        let margin = self.budget.params().margin;
        Booking {
            pace,
            window: (self.budget.window_budget()).map(|(q, w)| (q, w.div_f64(margin))),
            publish: self.publication(),
            probing: self.budget.probing(now),
            learned: self.budget.pace().is_some() || self.budget.window_budget().is_some(),
            floor: Duration::ZERO,
        }
    }

    /// The change of the pace made here that the shared store has yet to hear of
    /// (taken: it is published once).
    pub(super) fn publication(&mut self) -> Option<Publish> {
        std::mem::take(&mut self.publish).then(|| {
            let pace = self.budget.controller();
            Publish::new(&self.version, pace.rate, pace.ceiling)
        })
    }
}

impl Group {
    /// What the shared store answered a booking that published `published` (`None`:
    /// it did not answer): the record in force is adopted; a change that did not reach
    /// the store goes out with the next booking.
    pub(super) fn shared_budget(&self, booked: Option<&Reservation>, published: Option<Publish>) {
        let mut state = self.lock();
        let Some(booking) = booked else {
            state.publish |= published.is_some();
            return;
        };
        if booking.probing == Probing::Over {
            state.budget.end_probe();
        }
        if !matches!(booking.probing, Probing::Elsewhere(_)) {
            let sole = booking.probing == Probing::ForGroup;
            state.budget.probes_for_group(sole);
        }
        let Some(record) = &booking.shared else {
            // The record expired: publish this replica's again.
            state.publish |= state.budget.pace().is_some();
            state.version.clear();
            return;
        };
        let ours =
            published.is_some_and(|p| (&p.rate, &p.ceiling) == (&record.rate, &record.ceiling));
        if ours {
            state.version.clone_from(&record.v);
            return;
        }
        if record.v == state.version || state.publish {
            return;
        }
        state.version.clone_from(&record.v);
        let (rate, ceiling) = record.values();
        if state.budget.adopt(rate, ceiling, Instant::now()) {
            self.learned(&mut state, false);
        }
    }
}
