//! One budget: a FIFO queue in front of a rate (GCRA) and a concurrency limit.
//!
//! Requests of a group leave in arrival order. Only the request at the head of the queue
//! looks at the clock: it holds the group's *turn*, waits for a pause to end, for the rate
//! to allow it, and for a concurrency permit, then records its departure and hands the turn
//! to the next request. Everyone else waits on a one-shot channel, so a group with 10 000
//! waiting requests has one timer, not 10 000, and a waiter that goes away (client gone,
//! `max_wait` reached) just leaves the queue.
//!
//! The rate state (one TAT per rate) is only changed at a departure, by the turn holder,
//! so a request that is cancelled while waiting never uses up a slot.
//!
//! When the head leaves and the requests right behind it are due too (a backlog at a
//! high rate, where tokio's 1 ms timer wakes the head once for several slots), the head
//! releases them in the same step: it counts their departures and sends each its
//! concurrency permit, instead of passing the turn down the line one wake-up at a time.
//! A released request has left the queue: if its client goes before its task runs, its
//! permit comes back but its slot is spent, as for any request that goes after
//! admission.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::gcra::{self, Gcra};
use super::shared::{Lease, Shared};
use crate::config::{GroupSettings, OnBackendError, Rate};
use crate::metrics::GroupMetrics;

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `queue` requests were already waiting.
    QueueFull {
        /// An estimate of when the queue will have room.
        retry_after: Duration,
    },
    /// The shared store is unreachable and `on_backend_error = "deny"`.
    BackendDown,
    /// The request waited `max_wait` without reaching the head and leaving.
    MaxWait {
        /// How long it waited.
        waited: Duration,
        /// An estimate of when a new request could leave.
        retry_after: Duration,
    },
}

/// A budget shared by all requests to the hosts of one group.
pub struct Group {
    /// The group's name: a `[[limit]]` name, or the host for an unlisted host.
    pub name: Arc<str>,
    /// The settings it was built from.
    pub settings: GroupSettings,
    /// The configured rates in GCRA form (empty: no rate limit).
    configured: Vec<Gcra>,
    /// The adaptive rate never goes below this fraction of the configured one.
    min_factor: f64,
    /// Push-backs since the upstream last answered normally (for the fallback backoff).
    pushbacks_in_row: AtomicU32,
    /// The Redis store, when limits are shared by replicas.
    shared: Option<Arc<Shared>>,
    /// Concurrency permits; tokio's semaphore is FIFO, and only the turn holder asks.
    permits: Arc<Semaphore>,
    /// Origin of the `Duration` times in the rate state.
    epoch: Instant,
    state: Mutex<State>,
    /// This group's metric handles.
    pub metrics: GroupMetrics,
    /// The serving thread that serves its clients' connections, as a number the server
    /// takes modulo its thread count; `None` when any thread may (see [`Group::home`]).
    home: Option<usize>,
}

/// A group whose rates let at most this many requests a second leave is served by one
/// thread ([`Group::home`]): half of what one serving thread forwards on the 2-core
/// machines measured (≈ 40 000/s pinned, docs/performance-log.md), so that the thread has
/// room for it and for the other work it serves.
pub const ONE_THREAD_RATE: f64 = 20_000.0;

/// What changes as requests come and go.
struct State {
    /// The rates in force: the configured ones, or slower in adaptive mode.
    rates: Vec<Gcra>,
    /// One TAT per rate, as an offset from `epoch`.
    tats: Vec<Duration>,
    /// Adaptive mode: the effective rate as a fraction of the configured one.
    factor: f64,
    /// Adaptive mode: when the factor last changed.
    factor_changed: Instant,
    /// Adaptive mode: when the factor was last halved.
    halved_at: Option<Instant>,
    /// Requests waiting for the turn, in order; a smaller key goes first.
    waiting: BTreeMap<Key, Waiter>,
    /// Sequence number of the next request to join the queue.
    next_seq: u64,
    /// Whether some request holds the turn.
    turn_taken: bool,
    /// Requests admitted to the queue and not yet departed (waiting + the turn holder).
    queued: usize,
    /// Their total cost, for the `Retry-After` estimate.
    queued_cost: u64,
    /// Nothing leaves before this (upstream push-back).
    paused_until: Option<Instant>,
}

/// A request waiting in the queue, as the turn holder sees it.
struct Waiter {
    /// Where its turn, or its release, is sent.
    tx: oneshot::Sender<Turn>,
    /// Its cost, for releasing it without asking it.
    cost: u32,
    /// When it joined the queue, from the group's epoch: it is not counted as leaving
    /// before that.
    joined: Duration,
}

/// What a waiting request receives when the requests ahead of it have gone.
enum Turn {
    /// The group's turn: it is the head now, and waits for its own slot.
    Take,
    /// Its slot had come when the head before it left: that head counted its departure
    /// and sends the concurrency permit it holds while in flight.
    Leave(Held),
}

/// A place in the queue: `(rank, arrival order)`. Retried requests have rank −1 and
/// go before every normal request (rank 0); within a rank, first come first served.
type Key = (i8, u64);

/// The rank of requests retried after push-back: ahead of everyone else.
const RETRY: i8 = -1;
/// The rank of requests on their first attempt.
const FIRST: i8 = 0;

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
    /// The rates in force, in requests per second (slower than configured while an
    /// adaptive group is backing off); empty when the group has no rate.
    pub effective_rates_per_second: Vec<f64>,
}

/// Waiting for a shared concurrency lease: the first and the longest pause between
/// looks (they double in between).
const LEASE_POLL_MIN: Duration = Duration::from_millis(5);
const LEASE_POLL_MAX: Duration = Duration::from_millis(100);

/// How far before the actual departure a queued request's departure may be counted
/// (at its slot) when the timer woke its head late; see `Group::wait_to_leave`.
const SLOT_CREDIT: Duration = Duration::from_millis(10);

/// A head whose slot is at least this far off sleeps on a kernel timer
/// ([`crate::precise_sleep`]) and usually leaves within tens of microseconds of its slot;
/// a nearer slot (rates above ~2 000/s) is left to tokio's millisecond timer. Why: at
/// one request per millisecond tokio's 0–2 ms lateness was the whole spread of the
/// queue's latency, while at higher rates a late wake-up releases several due requests
/// in one step (`Group::release_due`, memory store), where a precise one would wake the
/// head once per slot: a wake-up and a system call to arm the timer for every request.
const PRECISE_WAKE: Duration = Duration::from_micros(500);

/// Adaptive mode: after each calm interval of this length the rate climbs by
/// [`ADAPTIVE_STEP`] of the configured rate (additive increase, multiplicative decrease).
const ADAPTIVE_CALM: Duration = Duration::from_secs(1);
/// Adaptive mode: the climb per calm interval, as a fraction of the configured rate.
const ADAPTIVE_STEP: f64 = 0.05;
/// Adaptive mode without `min_rate`: the floor as a fraction of the configured rate.
const ADAPTIVE_FLOOR: f64 = 0.05;

impl Group {
    /// A new, idle group.
    pub fn new(
        name: Arc<str>,
        settings: GroupSettings,
        metrics: GroupMetrics,
        shared: Option<Arc<Shared>>,
    ) -> Group {
        let rates: Vec<Gcra> = settings
            .rates
            .iter()
            .map(|r| Gcra::new(r.limit, r.period, settings.burst))
            .collect();
        let min_factor = match (settings.min_rate, settings.rates.first()) {
            (Some(min), Some(rate)) => (min.per_second() / rate.per_second()).clamp(1e-6, 1.0),
            _ => ADAPTIVE_FLOOR,
        };
        let now = Instant::now();
        Group {
            name,
            permits: Arc::new(Semaphore::new(settings.concurrency)),
            epoch: now,
            min_factor,
            pushbacks_in_row: AtomicU32::new(0),
            shared,
            state: Mutex::new(State {
                rates: rates.clone(),
                factor: 1.0,
                factor_changed: now,
                halved_at: None,
                tats: vec![Duration::ZERO; rates.len()],
                waiting: BTreeMap::new(),
                next_seq: 0,
                turn_taken: false,
                queued: 0,
                queued_cost: 0,
                paused_until: None,
            }),
            configured: rates,
            settings,
            metrics,
            home: None,
        }
    }

    /// Whether its rates keep it within one serving thread's work: the slowest of them
    /// lets at most [`ONE_THREAD_RATE`] requests a second leave. No rate, no bound.
    pub fn paced_for_one_thread(&self) -> bool {
        let slowest = self
            .settings
            .rates
            .iter()
            .map(Rate::per_second)
            .reduce(f64::min);
        slowest.is_some_and(|rate| rate <= ONE_THREAD_RATE)
    }

    /// This group with home `ordinal` (see [`Group::home`]).
    pub fn with_home(self, ordinal: usize) -> Group {
        Group {
            home: Some(ordinal),
            ..self
        }
    }

    /// The serving thread whose connections it wants, as a number to take modulo the
    /// thread count; `None` when any thread will do.
    ///
    /// Why: the head of a paced queue releases the requests behind it, and a request
    /// waiting on another serving thread is woken across threads, an idle thread woken
    /// for each release. At 10 000 requests/s on two threads that cost 3.4 µs of CPU per
    /// request more than one thread serving them all (docs/performance-log.md, "Seventeenth
    /// session"). A group paced within one thread's work ([`Group::paced_for_one_thread`])
    /// is given a home by [`crate::limit::Limits`], and the server moves a connection
    /// whose first request is for it to that thread before the request waits
    /// (`server::home`).
    pub fn home(&self) -> Option<usize> {
        self.home
    }

    /// Waits until a request of `cost` may leave, in FIFO order, and returns the
    /// concurrency permit it holds while in flight. `front` puts it at the head of the
    /// queue (a request the upstream refused, retried). Refused when the queue is full or
    /// when `deadline` passes first. Dropping the future leaves the queue.
    pub async fn admit(
        self: &Arc<Self>,
        cost: u32,
        arrived: Instant,
        deadline: Instant,
        front: bool,
    ) -> Result<Permit, Refusal> {
        if let Some(permit) = self.admit_now(cost, arrived) {
            return Ok(permit);
        }
        self.join_queue(cost, arrived, deadline, front).await
    }

    /// The second half of [`Group::admit`]: joins the queue and waits there, without
    /// trying [`Group::admit_now`] first. For a caller that has just tried it (the
    /// throttle): trying again would cost a lock and a clock read per queued request.
    pub async fn join_queue(
        self: &Arc<Self>,
        cost: u32,
        arrived: Instant,
        deadline: Instant,
        front: bool,
    ) -> Result<Permit, Refusal> {
        // Boxed: the wait (a place in line, a timer, the shared store's round trip) is
        // most of this future, and inline it would take its callers' futures past the
        // allocator's small sizes (`proxy.rs` tests that the throttle's stays within).
        Box::pin(self.wait_in_line_to_leave(cost, arrived, deadline, front)).await
    }

    /// The permit of a request of `cost` that arrived at `arrived`, when it may leave at
    /// once (nobody ahead, no pause, the rate open, a permit free), counted as admitted;
    /// `None` when it would have to wait, and then nothing has changed; always `None` for
    /// a group on the shared store, whose budget lives there. The synchronous
    /// half of [`Group::admit`], for a caller that would rather not build the waiting
    /// future for the many requests that never wait (the throttle).
    pub fn admit_now(self: &Arc<Self>, cost: u32, arrived: Instant) -> Option<Permit> {
        let now = Instant::now();
        let permit = self.admit_at_once(cost, now)?;
        self.metrics
            .queue_wait
            .observe(now.saturating_duration_since(arrived).as_secs_f64());
        self.metrics.admitted.inc();
        Some(permit)
    }

    /// [`Group::join_queue`]'s wait: joins the queue (taking the turn at once when
    /// nobody is ahead) and waits there.
    async fn wait_in_line_to_leave(
        self: &Arc<Self>,
        cost: u32,
        arrived: Instant,
        deadline: Instant,
        front: bool,
    ) -> Result<Permit, Refusal> {
        let mut place = self.enqueue(cost, front)?;
        let waited = async {
            loop {
                if let Some(held) = place.wait_for_turn().await {
                    return Ok(Permit::new(held, self.clone()));
                }
                // Boxed: only the head of the queue gets here, and its wait (the
                // precise sleep, a pause, a permit) is most of this future. Inline,
                // every queued request's box was sized by it: 864 bytes written per
                // queued request instead of ≈ 300. With the memory store that is one
                // allocation per turn, as the head releases the requests due behind
                // it (`release_due`), which never get here; with the shared store each
                // request takes the turn, and its round trip to Redis dwarfs the box.
                match Box::pin(self.wait_to_leave(&place)).await? {
                    Some(permit) => return Ok(permit),
                    None => place.step_aside(),
                }
            }
        };
        match tokio::time::timeout_at(deadline, waited).await {
            Ok(Err(refusal)) => {
                place.departed();
                Err(refusal)
            }
            Ok(Ok(permit)) => {
                place.departed();
                self.metrics
                    .queue_wait
                    .observe(arrived.elapsed().as_secs_f64());
                self.metrics.admitted.inc();
                Ok(permit)
            }
            Err(_) => {
                place.departed();
                self.metrics.max_wait.inc();
                Err(Refusal::MaxWait {
                    waited: arrived.elapsed(),
                    retry_after: self.estimate_wait(),
                })
            }
        }
    }

    /// Holds every request of the group for `pause`, on every replica when the store is
    /// shared.
    pub fn pause_for(&self, pause: Duration) {
        self.pause_until(Instant::now() + pause);
        if let Some(shared) = &self.shared {
            let (shared, name) = (shared.clone(), self.name.clone());
            tokio::spawn(async move { shared.pause(&name, pause).await });
        }
    }

    /// Holds every request of the group (in this process) until `until`. A later pause
    /// extends an earlier one; an earlier one never shortens it.
    pub fn pause_until(&self, until: Instant) {
        let mut state = self.lock();
        state.paused_until = Some(state.paused_until.map_or(until, |p| p.max(until)));
    }

    /// The upstream pushed back: pause the group for `pause`, and in adaptive mode
    /// halve the effective rate (not below the floor).
    pub fn push_back(&self, pause: Duration) {
        self.pushbacks_in_row.fetch_add(1, Ordering::Relaxed);
        self.pause_for(pause);
        if self.settings.adaptive {
            let mut state = self.lock();
            // One overload episode answers several requests in flight with 429 at once:
            // halve once for it, not once per refused request.
            let recently = state
                .halved_at
                .is_some_and(|at| at.elapsed() < ADAPTIVE_CALM);
            if !recently {
                let factor = (state.factor / 2.0).max(self.min_factor);
                self.set_factor(&mut state, factor);
                state.halved_at = Some(Instant::now());
            }
        }
    }

    /// The upstream answered normally: the fallback backoff starts over.
    pub fn calm(&self) {
        if self.pushbacks_in_row.load(Ordering::Relaxed) != 0 {
            self.pushbacks_in_row.store(0, Ordering::Relaxed);
        }
    }

    /// Push-backs since the last normal answer (0 for the first).
    pub fn pushbacks_in_row(&self) -> u32 {
        self.pushbacks_in_row.load(Ordering::Relaxed)
    }

    fn set_factor(&self, state: &mut State, factor: f64) {
        state.factor = factor;
        state.factor_changed = Instant::now();
        state.rates = self.configured.iter().map(|r| r.scaled(factor)).collect();
    }

    /// When the current pause ends, if the group is paused.
    pub fn paused_until(&self) -> Option<Instant> {
        self.paused_at(Instant::now())
    }

    /// When the pause in force at `now` ends, if there is one: [`Group::paused_until`]
    /// for a caller that has just read the clock.
    fn paused_at(&self, now: Instant) -> Option<Instant> {
        self.lock().paused_until.filter(|p| *p > now)
    }

    /// A snapshot for `/status`.
    pub fn status(&self) -> GroupStatus {
        let state = self.lock();
        let now = Instant::now();
        GroupStatus {
            name: self.name.to_string(),
            queued: state.queued,
            in_flight: self.metrics.in_flight.get().max(0) as usize,
            paused_for_seconds: state
                .paused_until
                .filter(|p| *p > now)
                .map(|p| (p - now).as_secs_f64()),
            effective_rates_per_second: state
                .rates
                .iter()
                .map(|r| 1.0 / r.interval.as_secs_f64())
                .collect(),
        }
    }

    /// Whether the group holds no state worth keeping: nothing queued, in flight or
    /// paused, and its rates back to idle. An idle group can be dropped and rebuilt later
    /// without any request noticing.
    pub fn is_idle(&self) -> bool {
        let state = self.lock();
        let now = Instant::now();
        let since_epoch = now - self.epoch;
        state.queued == 0
            && self.metrics.in_flight.get() == 0
            && state.paused_until.is_none_or(|p| p <= now)
            && state.tats.iter().all(|tat| *tat <= since_epoch)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is plain counters and times, valid after any panic of a holder.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The uncontended case, decided under one lock: nobody queued, no pause, the local
    /// rate lets the request leave now and a permit is free. It departs as the slow path
    /// would (same rate advance, same order: nobody is ahead of it), without the four
    /// further locks, the timer and the queue bookkeeping of [`Group::admit`]'s loop,
    /// which the profile showed on every request of an unlimited group. `None`: take
    /// the queue. The shared store always takes the queue (its pace is a round trip).
    ///
    /// `now` is read by the caller before the lock is taken, so another thread may have
    /// stored a later time under it: tokio's `Instant` subtraction saturates, the pause
    /// and rate tests only get stricter with an earlier `now`, and a rate's TAT never
    /// goes back (`max(tat, depart)`), so at worst an idle group records this departure
    /// a lock wait early, far inside its slot credit.
    fn admit_at_once(self: &Arc<Self>, cost: u32, now: Instant) -> Option<Permit> {
        if self.shared.is_some() {
            return None;
        }
        let since_epoch = now - self.epoch;
        let mut state = self.lock();
        if !self.may_leave_at_once(&state, now, since_epoch) {
            return None;
        }
        // No waiter holds the turn, so none waits on the semaphore either: a free permit
        // is nobody else's.
        let held = self.permits.clone().try_acquire_owned().ok()?;
        if state.factor < 1.0 && now - state.factor_changed >= ADAPTIVE_CALM {
            let factor = (state.factor + ADAPTIVE_STEP).min(1.0);
            self.set_factor(&mut state, factor);
        }
        let State { rates, tats, .. } = &mut *state;
        gcra::advance_all(rates, tats, since_epoch, cost);
        drop(state);
        Some(Permit::new(Held::Local(held), self.clone()))
    }

    /// Whether a request arriving `now` (`since_epoch` after the group's epoch) would find
    /// nobody ahead, no pause, no queue bound reached and the local rate open (permits
    /// aside): [`Group::admit_at_once`]'s test. The offset is the caller's, worked out
    /// once: the admission of an unlimited group's request needs it twice.
    fn may_leave_at_once(&self, state: &State, now: Instant, since_epoch: Duration) -> bool {
        !state.turn_taken
            && state.waiting.is_empty()
            && state.queued < self.settings.queue
            && state.paused_until.is_none_or(|p| p <= now)
            && gcra::earliest_all(&state.rates, &state.tats, since_epoch) <= since_epoch
    }

    /// Whether a request arriving now would have to wait (a hint: it may change before
    /// the request asks). Used to decide whether a new connection's first request waits
    /// before hyper reads it (`server::early`).
    pub fn would_wait(&self) -> bool {
        if self.shared.is_some() || self.permits.available_permits() == 0 {
            return true;
        }
        let now = Instant::now();
        !self.may_leave_at_once(&self.lock(), now, now - self.epoch)
    }

    /// Whether at least `depth` requests are queued, as `/status` and
    /// `tollgate_queue_depth` count them (admitted to the queue and not yet gone from
    /// it): a request arriving now would wait behind them. A hint, as
    /// [`Group::would_wait`].
    ///
    /// Read from the `tollgate_queue_depth` gauge, which is set under the lock whenever
    /// the count changes, rather than under the lock: push-back asks for every request,
    /// and the lock was the second of two per forwarded request on a group every
    /// serving thread shares.
    pub fn queued_at_least(&self, depth: usize) -> bool {
        usize::try_from(self.metrics.queue_depth.get()).is_ok_and(|queued| queued >= depth)
    }

    /// Joins the queue (or takes the turn at once when nobody is ahead).
    fn enqueue(self: &Arc<Self>, cost: u32, front: bool) -> Result<Place, Refusal> {
        let now = Instant::now();
        let mut state = self.lock();
        // A retried request was admitted before; it does not count against the bound.
        if !front && state.queued >= self.settings.queue {
            drop(state);
            self.metrics.queue_full.inc();
            return Err(Refusal::QueueFull {
                retry_after: self.estimate_wait(),
            });
        }
        state.queued += 1;
        state.queued_cost += u64::from(cost);
        self.metrics.queue_depth.set(state.queued as i64);
        let key = (if front { RETRY } else { FIRST }, state.next_seq);
        state.next_seq += 1;
        let stage = if !state.turn_taken && state.waiting.is_empty() {
            state.turn_taken = true;
            Stage::HasTurn
        } else {
            Stage::Waiting(Group::wait_in_line(&mut state, key, cost, now - self.epoch))
        };
        Ok(Place {
            group: self.clone(),
            cost,
            joined: now,
            key,
            stage,
        })
    }

    fn wait_in_line(
        state: &mut State,
        key: Key,
        cost: u32,
        joined: Duration,
    ) -> oneshot::Receiver<Turn> {
        let (tx, rx) = oneshot::channel();
        state.waiting.insert(key, Waiter { tx, cost, joined });
        rx
    }

    /// Holding the turn: waits out a pause, the rate and a concurrency permit, then
    /// records the departure. Returns `Ok(None)` instead of leaving when a retried
    /// request joined the queue ahead of this one meanwhile (typically during the pause
    /// its push-back caused): it must go first.
    async fn wait_to_leave(self: &Arc<Self>, place: &Place) -> Result<Option<Permit>, Refusal> {
        let cost = place.cost;
        let mut permit = None;
        // With the shared store a slot is counted as soon as it is booked, so it is
        // booked once, not re-checked after sleeping like the local rate state.
        let mut booked = false;
        // Since when nothing but the rate held the request back (see the departure).
        let mut ready = place.joined;
        loop {
            // Read once per pass and used until something is awaited: the head reads the
            // clock for every queued request, and three reads a pass were two too many.
            let now = Instant::now();
            if let Some(pause) = self.paused_at(now) {
                booked = false; // a slot booked before the pause began has passed
                tokio::time::sleep_until(pause).await;
                ready = ready.max(pause);
                continue;
            }
            // Whether this pass awaited anything after looking at the pause: the shared
            // store's booking is a round trip, during which a pause may begin here.
            let mut awaited = false;
            if !booked {
                let (at, is_booking) = self.pace(cost, now).await?;
                booked = is_booking;
                awaited = self.shared.is_some();
                // After a booking, against the clock now, not `now`: a booking in the
                // shared store is a round trip, and its "leave at once" comes back as the
                // time the answer arrived, after `now`. Compared with `now`, every booking
                // slept on tokio's 1 ms timer first: 1.3 ms per request, per group, one
                // at a time. The local rate answers for `now` itself, without a wait.
                let now = if awaited { Instant::now() } else { now };
                if at > now {
                    if at - now >= PRECISE_WAKE {
                        crate::precise_sleep::sleep_until(at).await;
                    } else {
                        tokio::time::sleep_until(at).await;
                    }
                    continue;
                }
            }
            let held = match permit.take() {
                Some(held) => held,
                None => match self.try_acquire_local() {
                    // Free at once, and nothing awaited since the pause and the rate were
                    // looked at: leave now. (Looking at them once more cost two locks and
                    // a clock read per queued request.)
                    Some(held) if !awaited => held,
                    Some(held) => {
                        permit = Some(held);
                        continue;
                    }
                    None => {
                        // Waiting for a permit can take long (slow upstream); a pause may
                        // have begun meanwhile, so look again before leaving. Time spent
                        // waiting for one is not the rate's: the request is only ready
                        // once it has one.
                        permit = Some(self.acquire().await?);
                        ready = ready.max(Instant::now());
                        continue;
                    }
                },
            };
            let mut state = self.lock();
            if state
                .waiting
                .keys()
                .next()
                .is_some_and(|first| *first < place.key)
            {
                // `held` is dropped: the retry may need this very permit.
                return Ok(None);
            }
            // When nothing was awaited since `now` was read, it stands for the departure.
            // Read before the lock, it may be a hair earlier than a time another thread
            // stored under it, which is harmless, as in `admit_at_once`.
            let now = if awaited { Instant::now() } else { now };
            if state.factor < 1.0 && now - state.factor_changed >= ADAPTIVE_CALM {
                let factor = (state.factor + ADAPTIVE_STEP).min(1.0);
                self.set_factor(&mut state, factor);
            }
            if !booked {
                // The departure counts at its slot: the earliest the rates allow, or
                // when the request became ready if later. Not at `now`: tokio's timer
                // wakes the head up to a millisecond after the slot, and counting from
                // the wake-up lost that time on every request, so a backlog drained at
                // 1/(T + lateness) (850/s at a configured 10 000/s). The credit is
                // capped at `SLOT_CREDIT`, so a stalled process catches up in a burst of
                // at most that much time's worth of requests.
                // Owned: the departure below changes the state the rates live in.
                let rates = self.local_rates(&state).into_owned();
                let since_now = now - self.epoch;
                let since_ready = ready.saturating_duration_since(self.epoch);
                let slot = gcra::earliest_all(&rates, &state.tats, since_ready)
                    .clamp(since_now.saturating_sub(SLOT_CREDIT), since_now);
                gcra::advance_all(&rates, &mut state.tats, slot, cost);
                self.release_due(&mut state, &rates, slot, now);
            }
            return Ok(Some(Permit::new(held, self.clone())));
        }
    }

    /// Releases the waiters at the front of the queue whose slots have come by `now`,
    /// while a concurrency permit is free: each departure counted at its slot (never
    /// before `after`, the slot of the head that releases them, which is at most
    /// [`SLOT_CREDIT`] back, nor before the waiter joined), in queue order, and its
    /// permit sent to it. Called by the departing head with the state locked; the turn
    /// then goes to the first request still waiting.
    ///
    /// Why: at 10 000/s tokio's 1 ms timer wakes the head once per ~10 slots, and
    /// passing the turn down the line woke ~10 tasks one after the other, often across
    /// the serving threads (BENCHMARKS.md, "Performance against peers"); here they are
    /// all woken in one step. Memory store only: with the shared store a booking is a
    /// round trip per request, and while Redis is down a request may need several local
    /// permits (its replica's share of `concurrency`), which only [`Group::acquire`]
    /// knows how to take.
    fn release_due(&self, state: &mut State, rates: &[Gcra], after: Duration, now: Instant) {
        if self.shared.is_some() || state.paused_until.is_some_and(|p| p > now) {
            return;
        }
        let since_now = now - self.epoch;
        let mut after = after;
        while let Some(entry) = state.waiting.first_entry() {
            let (cost, joined) = (entry.get().cost, entry.get().joined);
            let slot = gcra::earliest_all(rates, &state.tats, after.max(joined));
            if slot > since_now {
                return;
            }
            let Ok(held) = self.permits.clone().try_acquire_owned() else {
                return;
            };
            let waiter = entry.remove();
            // Defensive: a waiter that goes removes itself from the map under this lock
            // before dropping its receiver, so the send fails only if that ever changes;
            // it would then count nothing, and the permit comes straight back.
            if waiter.tx.send(Turn::Leave(Held::Local(held))).is_ok() {
                gcra::advance_all(rates, &mut state.tats, slot, cost);
                after = slot;
            }
        }
    }

    /// When the rate lets a request of `cost` leave, and whether that slot is already
    /// booked (in the shared store) or still to be recorded at departure (locally).
    ///
    /// The local answer is computed for the caller's `now`, so that "leave now" comes
    /// back as exactly `now`, never a hair later (which would send the caller to sleep
    /// and ask again, forever).
    async fn pace(&self, cost: u32, now: Instant) -> Result<(Instant, bool), Refusal> {
        if let Some(shared) = &self.shared {
            let rates = self.lock().rates.clone();
            // Boxed: the round trip's future is most of this one, and inline it would
            // size every queued request's wait by it, with the memory store too.
            let reserved = Box::pin(shared.reserve(&self.name, &rates, cost)).await;
            if let Some(booking) = reserved {
                let now = Instant::now(); // after the round trip
                if let Some(pause) = booking.paused_for {
                    // Another replica's push-back: remember it, so requests that are
                    // already waiting here honour it too.
                    self.pause_until(now + pause);
                }
                return Ok((now + booking.wait, true));
            }
            if shared.on_error == OnBackendError::Deny {
                return Err(Refusal::BackendDown);
            }
        }
        let state = self.lock();
        let depart = gcra::earliest_all(&self.local_rates(&state), &state.tats, now - self.epoch);
        Ok((self.epoch + depart, false))
    }

    /// The rates enforced in this process: the group's own, or with the shared store
    /// down, this replica's share of them (rate / replicas). Borrowed unless scaled: the
    /// head of a queue asks for every request.
    fn local_rates<'s>(&self, state: &'s State) -> Cow<'s, [Gcra]> {
        match &self.shared {
            Some(shared) if !shared.is_up() => {
                let share = 1.0 / f64::from(shared.replicas());
                Cow::Owned(state.rates.iter().map(|r| r.scaled(share)).collect())
            }
            _ => Cow::Borrowed(&state.rates),
        }
    }

    /// A local concurrency permit if one is free right now (not with shared leases).
    fn try_acquire_local(&self) -> Option<Held> {
        if self.shared.is_some() && self.settings.shared_concurrency {
            return None;
        }
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        Some(Held::Local(permit))
    }

    /// A concurrency permit: a local one, or a lease in the shared store.
    async fn acquire(&self) -> Result<Held, Refusal> {
        let local = |count: u32| async move {
            let acquired = self.permits.clone().acquire_many_owned(count).await;
            Held::Local(acquired.expect("the semaphore is never closed"))
        };
        let Some(shared) = self
            .shared
            .as_ref()
            .filter(|_| self.settings.shared_concurrency)
        else {
            return Ok(local(1).await);
        };
        let mut poll = LEASE_POLL_MIN;
        loop {
            // Boxed, as the booking in `pace`.
            let leased = Box::pin(shared.try_lease(&self.name, self.settings.concurrency)).await;
            match leased {
                Some(Some(lease)) => return Ok(Held::Lease(Box::new(lease))),
                // Every lease is taken, on some replica: look again shortly.
                Some(None) => {
                    tokio::time::sleep(poll).await;
                    poll = (poll * 2).min(LEASE_POLL_MAX);
                }
                None if shared.on_error == OnBackendError::Deny => {
                    return Err(Refusal::BackendDown)
                }
                // Redis is down: this replica's share, by taking `replicas` local
                // permits per request out of `concurrency`.
                None => {
                    let share = shared.replicas().min(self.settings.concurrency as u32);
                    return Ok(local(share).await);
                }
            }
        }
    }

    /// Passes the turn to the first waiter still there, or frees it.
    fn pass_turn(state: &mut State) {
        while let Some((_, next)) = state.waiting.pop_first() {
            if next.tx.send(Turn::Take).is_ok() {
                return;
            }
        }
        state.turn_taken = false;
    }

    /// How long a request arriving now would wait: the rate's backlog for the queued
    /// cost, or the pause, whichever is longer.
    fn estimate_wait(&self) -> Duration {
        let state = self.lock();
        let now = Instant::now();
        let since_epoch = now - self.epoch;
        let ahead = u32::try_from(state.queued_cost).unwrap_or(u32::MAX);
        let paced = state
            .rates
            .iter()
            .zip(&state.tats)
            .map(|(rate, tat)| {
                (tat.saturating_sub(since_epoch) + rate.interval * ahead)
                    .saturating_sub(rate.tolerance)
            })
            .max()
            .unwrap_or_default();
        let paused = state
            .paused_until
            .map_or(Duration::ZERO, |p| p.saturating_duration_since(now));
        paced.max(paused)
    }
}

/// Where a request is in its group's queue; leaving (drop) keeps the queue consistent.
struct Place {
    group: Arc<Group>,
    cost: u32,
    /// When it joined the queue: from then on only the group held it back.
    joined: Instant,
    /// Its position: the key it waits (or waited) under.
    key: Key,
    stage: Stage,
}

enum Stage {
    /// In the queue under `key`, until the turn (or its release) arrives on the channel.
    Waiting(oneshot::Receiver<Turn>),
    /// Holding the group's turn.
    HasTurn,
    /// Released by the head before it: its departure is counted, the turn is not its.
    Released,
    /// Departed: no longer counted in the queue, turn passed on.
    Gone,
}

impl Place {
    /// Waits until the requests ahead have gone. Returns the permit when the head before
    /// it released it (it may leave now), `None` when it got the turn.
    async fn wait_for_turn(&mut self) -> Option<Held> {
        let Stage::Waiting(rx) = &mut self.stage else {
            return None;
        };
        // The sender is only dropped after `send`, or by `Place::drop` of this very
        // waiter, so an error cannot happen while we are still polling.
        match rx.await {
            Ok(Turn::Leave(held)) => {
                self.stage = Stage::Released;
                Some(held)
            }
            Ok(Turn::Take) | Err(_) => {
                self.stage = Stage::HasTurn;
                None
            }
        }
    }

    /// Hands the turn to the retried request ahead and waits right behind it: ahead of
    /// every request that has not been refused, as the head it was.
    fn step_aside(&mut self) {
        let mut state = self.group.lock();
        self.key = (RETRY, state.next_seq);
        state.next_seq += 1;
        let joined = self.joined - self.group.epoch;
        let rx = Group::wait_in_line(&mut state, self.key, self.cost, joined);
        Group::pass_turn(&mut state);
        self.stage = Stage::Waiting(rx);
    }

    /// The request is done with the queue (left for the upstream, or refused after
    /// `max_wait`): out of the queue, turn to the next.
    fn departed(&mut self) {
        self.leave();
        self.stage = Stage::Gone;
    }

    fn leave(&mut self) {
        let group = &self.group;
        let mut state = group.lock();
        match std::mem::replace(&mut self.stage, Stage::Gone) {
            Stage::Gone => return,
            Stage::Waiting(mut rx) => {
                // Still in the map: it never got the turn. Gone from the map: the turn
                // was sent to it just now, so it must be passed on; or it was released,
                // and the slot counted for it is lost with its permit, as for any
                // request that leaves after admission.
                if state.waiting.remove(&self.key).is_none() {
                    match rx.try_recv() {
                        Ok(Turn::Leave(_)) => {}
                        Ok(Turn::Take) | Err(_) => Group::pass_turn(&mut state),
                    }
                }
            }
            Stage::HasTurn => Group::pass_turn(&mut state),
            Stage::Released => {}
        }
        state.queued -= 1;
        state.queued_cost -= u64::from(self.cost);
        group.metrics.queue_depth.set(state.queued as i64);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if !matches!(self.stage, Stage::Gone) {
            self.group.metrics.cancelled.inc();
            self.leave();
        }
    }
}

/// A concurrency permit: the request is in flight until this is dropped (when the
/// response body ends, or the tunnel closes).
pub struct Permit {
    _held: Held,
    group: Arc<Group>,
}

/// What a permit holds: local semaphore permits, or a lease in the shared store.
enum Held {
    Local(#[allow(dead_code)] OwnedSemaphorePermit),
    /// Boxed: a lease is seven words (an `Arc` and two strings), and a permit rides
    /// inline in every request's [`super::layer::Exchange`], which is moved several
    /// times per layer; a lease is rare (shared concurrency) and allocates its strings
    /// anyway. A permit is three words so.
    Lease(#[allow(dead_code)] Box<Lease>),
}

impl Permit {
    fn new(held: Held, group: Arc<Group>) -> Permit {
        group.metrics.in_flight.inc();
        Permit { _held: held, group }
    }

    /// The group this permit belongs to.
    pub fn group(&self) -> &Arc<Group> {
        &self.group
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.group.metrics.in_flight.dec();
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Permit({})", self.group.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rates;
    use crate::metrics::Metrics;

    fn group(rate: &str, f: impl FnOnce(&mut GroupSettings)) -> Arc<Group> {
        let mut settings = GroupSettings {
            rates: if rate == "unlimited" {
                vec![]
            } else {
                vec![rate.parse::<Rate>().unwrap()]
            },
            ..GroupSettings::default()
        };
        f(&mut settings);
        let _ = Rates::default();
        Arc::new(Group::new(
            "g".into(),
            settings,
            Metrics::new().group("g"),
            None,
        ))
    }

    /// Starts `n` requests in order; returns their (index, departure ms) in departure
    /// order. Each holds its permit for `hold`.
    async fn run(g: &Arc<Group>, n: usize, hold: Duration) -> Vec<(usize, u128)> {
        let start = Instant::now();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..n {
            let g = g.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let now = Instant::now();
                let permit = g
                    .admit(1, now, now + g.settings.max_wait, false)
                    .await
                    .unwrap();
                tx.send((i, start.elapsed().as_millis())).unwrap();
                tokio::time::sleep(hold).await;
                drop(permit);
            });
            // Let it join the queue before the next one arrives.
            tokio::task::yield_now().await;
        }
        drop(tx);
        let mut out = vec![];
        while let Some(x) = rx.recv().await {
            out.push(x);
        }
        out
    }

    /// Starts named requests `(name, cost, retried)` in order; returns `(name, departure
    /// ms after start)` in departure order. Permits are dropped at once.
    async fn departures(
        g: &Arc<Group>,
        start: Instant,
        requests: &[(&'static str, u32, bool)],
    ) -> Vec<(&'static str, u128)> {
        let far = start + Duration::from_secs(60);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for &(name, cost, front) in requests {
            let (g, tx) = (g.clone(), tx.clone());
            tokio::spawn(async move {
                let _p = g.admit(cost, start, far, front).await.unwrap();
                tx.send((name, start.elapsed().as_millis())).unwrap();
            });
            // Let it join the queue before the next one arrives.
            tokio::task::yield_now().await;
        }
        drop(tx);
        let mut out = vec![];
        while let Some(x) = rx.recv().await {
            out.push(x);
        }
        out
    }

    /// The queued wait is boxed once per request that waits, and written whole into its box
    /// each time. mimalloc serves up to 1 KiB from its per-size free lists; a bigger box
    /// took its general aligned path, ≈ 145 instructions more per queued request
    /// (callgrind, docs/performance-log.md "Eighteenth session"). The shared store's round
    /// trips, boxed on their own, were what took it past that. The head's wait (its precise
    /// sleep above all) is boxed apart too: inline it made every queued request's box 864
    /// bytes, ≈ 10 more data-cache misses per queued request than the 304 bytes it is now
    /// ("Twenty-first session").
    #[tokio::test]
    async fn the_queued_wait_fits_a_small_allocation() {
        let g = group("10/s", |_| {});
        let now = Instant::now();
        let wait = g.wait_in_line_to_leave(1, now, now, false);
        let size = std::mem::size_of_val(&wait);
        assert!(size <= 512, "the queued wait is {size} bytes, over 512");
    }

    #[tokio::test(start_paused = true)]
    async fn requests_leave_in_order_at_the_pace() {
        let g = group("10/s", |_| {});
        let out = run(&g, 5, Duration::ZERO).await;
        assert_eq!(out, [(0, 0), (1, 100), (2, 200), (3, 300), (4, 400)]);
        assert_eq!(g.status().queued, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn queued_at_least_counts_the_requests_that_joined_and_have_not_gone() {
        let g = group("unlimited", |s| s.concurrency = 1);
        let now = Instant::now();
        let far = now + Duration::from_secs(60);
        let held = g.admit(1, now, far, false).await.unwrap();
        assert!(
            g.queued_at_least(0) && !g.queued_at_least(1),
            "left at once"
        );
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                let g = g.clone();
                tokio::spawn(async move { g.admit(1, now, far, false).await.map(drop) })
            })
            .collect();
        tokio::task::yield_now().await;
        assert!(g.queued_at_least(3) && !g.queued_at_least(4));
        drop(held);
        for w in waiting {
            w.await.unwrap().unwrap();
        }
        assert!(!g.queued_at_least(1), "all gone");
    }

    #[tokio::test(start_paused = true)]
    async fn concurrency_holds_the_next_until_a_permit_returns() {
        let g = group("unlimited", |s| s.concurrency = 2);
        let out = run(&g, 5, Duration::from_secs(1)).await;
        let times: Vec<u128> = out.iter().map(|(_, t)| *t).collect();
        assert_eq!(times, [0, 0, 1000, 1000, 2000]);
        let order: Vec<usize> = out.iter().map(|(i, _)| *i).collect();
        assert_eq!(order, [0, 1, 2, 3, 4]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_woken_late_releases_every_due_request_behind_it_in_order() {
        // 1 ms apart, and a concurrency of 4 to show that a release needs a permit.
        let g = group("1000/s", |s| s.concurrency = 4);
        let start = Instant::now();
        let far = start + Duration::from_secs(60);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for i in 0..8 {
            let (g, tx) = (g.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let permit = g.admit(1, start, far, false).await.unwrap();
                tx.send((i, start.elapsed().as_millis())).unwrap();
                // Held until the test lets go (the channel closes).
                std::future::pending::<()>().await;
                drop(permit);
            }));
            tokio::task::yield_now().await;
        }
        drop(tx);
        // 0 left at once; 1 holds the turn, asleep until its slot at 1 ms. 3 goes away.
        tasks[3].abort();
        tokio::task::yield_now().await;
        assert_eq!(rx.recv().await, Some((0, 0)));

        // The head wakes 5 ms late (the process was busy): the slots at 1 … 5 ms have
        // all come. It leaves, and the two behind it leave at 5 ms too (3 left the queue
        // when it was dropped, and takes no slot); then the 4 permits are all taken.
        tokio::time::advance(Duration::from_millis(5)).await;
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        let mut left = Vec::new();
        while let Ok(x) = rx.try_recv() {
            left.push(x);
        }
        assert_eq!(left, [(1, 5), (2, 5), (4, 5)]);
        assert_eq!(g.metrics.in_flight.get(), 4);
        assert_eq!(g.status().queued, 3, "5, 6 and 7 still wait");
        assert_eq!(g.metrics.cancelled.get(), 1);

        // A permit comes back: the head (5) takes it and leaves at once, counted from
        // then (5 ms: time spent waiting for a permit is not the rate's); 6's slot, 6 ms,
        // has not come, so it gets the turn and waits.
        tasks[0].abort();
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        while let Ok(x) = rx.try_recv() {
            left.push(x);
        }
        assert_eq!(left[3..], [(5, 5)]);
        assert_eq!(g.status().queued, 2);
        for t in &tasks {
            t.abort();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_released_request_holds_its_permit_at_once_and_gives_it_back_if_dropped() {
        use futures_util::FutureExt;
        let g = group("1000/s", |s| s.concurrency = 3);
        let start = Instant::now();
        let far = start + Duration::from_secs(60);
        let first = g.admit(1, start, far, false).await.unwrap();
        let mut waiting: Vec<_> = (0..4)
            .map(|_| Box::pin(g.admit(1, start, far, false)))
            .collect();
        for w in &mut waiting {
            assert!(w.now_or_never().is_none());
        }
        // The head wakes 5 ms late and leaves; the one behind it is released in the same
        // step: it holds the last permit before its task has even run.
        tokio::time::advance(Duration::from_millis(5)).await;
        let head = (&mut waiting[0]).now_or_never().unwrap().unwrap();
        assert_eq!(g.permits.available_permits(), 0);
        // Its client goes before it runs: the permit comes back, the slot is spent.
        drop(waiting.remove(1));
        assert_eq!(g.permits.available_permits(), 1);
        assert_eq!(g.metrics.cancelled.get(), 1);
        assert_eq!(g.metrics.in_flight.get(), 2);
        // The turn was not lost with it: the next leaves, and the last waits.
        let next = (&mut waiting[1]).now_or_never().expect("the turn").unwrap();
        assert_eq!(g.status().queued, 1);
        assert!((&mut waiting[2]).now_or_never().is_none());
        drop((first, head, next));
        (&mut waiting[2]).now_or_never().unwrap().unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn full_queue_is_refused_with_an_estimate() {
        let g = group("1/s", |s| s.queue = 2);
        let now = Instant::now();
        let far = now + Duration::from_secs(60);
        let first = g.admit(1, now, far, false).await.unwrap();
        let g2 = g.clone();
        let _second = tokio::spawn(async move { g2.admit(1, now, far, false).await });
        let g3 = g.clone();
        let _third = tokio::spawn(async move { g3.admit(1, now, far, false).await });
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        assert_eq!(g.status().queued, 2);
        match g.admit(1, now, far, false).await {
            Err(Refusal::QueueFull { retry_after }) => {
                // Two queued at 1/s behind a slot taken just now: about 3 s.
                assert!(retry_after >= Duration::from_secs(2), "{retry_after:?}");
                assert!(retry_after <= Duration::from_secs(3), "{retry_after:?}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(g.metrics.queue_full.get(), 1);
        drop(first);
    }

    #[tokio::test(start_paused = true)]
    async fn max_wait_refuses_and_frees_the_place() {
        let g = group("1/10s", |s| s.max_wait = Duration::from_secs(1));
        let now = Instant::now();
        let _first = g
            .admit(1, now, now + Duration::from_secs(1), false)
            .await
            .unwrap();
        let refused = g.admit(1, now, now + Duration::from_secs(1), false).await;
        assert!(
            matches!(refused, Err(Refusal::MaxWait { .. })),
            "{refused:?}"
        );
        assert_eq!(Instant::now() - now, Duration::from_secs(1));
        assert_eq!(g.status().queued, 0);
        assert_eq!(
            (g.metrics.max_wait.get(), g.metrics.cancelled.get()),
            (1, 0)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_waiter_leaves_and_wastes_no_slot() {
        let g = group("1/s", |_| {});
        let start = Instant::now();
        let far = start + Duration::from_secs(60);
        let _first = g.admit(1, start, far, false).await.unwrap();
        let g2 = g.clone();
        let second = tokio::spawn(async move { g2.admit(1, start, far, false).await });
        tokio::task::yield_now().await;
        let g3 = g.clone();
        let third = tokio::spawn(async move {
            g3.admit(1, start, far, false).await.unwrap();
            start.elapsed()
        });
        tokio::task::yield_now().await;
        assert_eq!(g.status().queued, 2);
        // The second (head, sleeping until its slot) goes away: the third takes its slot.
        second.abort();
        assert!(second.await.unwrap_err().is_cancelled());
        assert_eq!(third.await.unwrap(), Duration::from_secs(1));
        assert_eq!(g.metrics.cancelled.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn pause_holds_the_group_and_the_queue_keeps_its_order() {
        let g = group("unlimited", |_| {});
        g.pause_until(Instant::now() + Duration::from_secs(5));
        let out = run(&g, 3, Duration::ZERO).await;
        assert_eq!(out, [(0, 5000), (1, 5000), (2, 5000)]);
        assert!(g.paused_until().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_retried_request_goes_to_the_head() {
        let g = group("1/s", |_| {});
        let start = Instant::now();
        let far = start + Duration::from_secs(60);
        let _first = g.admit(1, start, far, false).await.unwrap();
        let out = departures(
            &g,
            start,
            &[("a", 1, false), ("b", 1, false), ("retry", 1, true)],
        )
        .await;
        // "a" holds the turn, asleep until its slot at 1 s; the retry arrives meanwhile
        // and leaves in that slot, "a" right after it, then "b".
        assert_eq!(out, [("retry", 1000), ("a", 2000), ("b", 3000)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_heavy_request_is_not_overtaken() {
        let g = group("10/s", |s| s.costs = vec![]);
        let start = Instant::now();
        let requests = [
            ("light1", 1, false),
            ("heavy", 5, false),
            ("light2", 1, false),
        ];
        let out = departures(&g, start, &requests).await;
        // The heavy one leaves at its turn and the next waits for its whole weight.
        assert_eq!(out, [("light1", 0), ("heavy", 100), ("light2", 600)]);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_after_the_rate_recovers() {
        let g = group("1/s", |_| {});
        let now = Instant::now();
        let p = g
            .admit(1, now, now + Duration::from_secs(5), false)
            .await
            .unwrap();
        assert!(!g.is_idle());
        drop(p);
        assert!(!g.is_idle(), "the TAT is still ahead");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(g.is_idle());
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_holding_the_only_permit_gives_it_to_a_retry() {
        let g = group("unlimited", |s| s.concurrency = 1);
        let start = Instant::now();
        let far = start + Duration::from_secs(60);
        let in_flight = g.admit(1, start, far, false).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for (name, front) in [("head", false), ("retry", true)] {
            let (g, tx) = (g.clone(), tx.clone());
            tokio::spawn(async move {
                let permit = g.admit(1, start, far, front).await.unwrap();
                tx.send(name).unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
                drop(permit);
            });
            tokio::task::yield_now().await;
        }
        drop(tx);
        // The head is waiting for the permit; when it comes back, the retry gets it.
        drop(in_flight);
        let mut order = vec![];
        while let Some(name) = rx.recv().await {
            order.push(name);
        }
        assert_eq!(order, ["retry", "head"]);
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_halves_once_per_episode_and_climbs_back_when_calm() {
        let g = group("100/s", |s| s.adaptive = true);
        let rate = |g: &Group| g.status().effective_rates_per_second[0].round();
        g.push_back(Duration::ZERO);
        g.push_back(Duration::ZERO); // same episode: no second halving
        assert_eq!(rate(&g), 50.0);
        tokio::time::sleep(Duration::from_secs(2)).await;
        g.push_back(Duration::ZERO);
        assert_eq!(rate(&g), 25.0);
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = Instant::now();
            drop(
                g.admit(1, now, now + Duration::from_secs(5), false)
                    .await
                    .unwrap(),
            );
        }
        // Five calm seconds with traffic: +5 % of 100/s each.
        assert_eq!(rate(&g), 50.0);
    }
}
