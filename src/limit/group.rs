//! One group: one budget that the requests to its hosts share.
//!
//! A request joins the group's FIFO queue ([`super::queue`]). When it reaches the head
//! it holds the turn and waits, in this order, for a pause to end ([`super::pause`]),
//! for its slot ([`super::store`], [`super::rate`], and the announced window of
//! [`super::budget`]) and for a concurrency permit ([`super::permits`]); a group told
//! no rate also waits for its probe. Then it departs (`Group::depart`, the one place a
//! departure is recorded) and the turn goes to the next request. What the upstream's
//! answers do to the group (a pause, the budget it learns) is in `group/answers.rs`.
//!
//! When the head departs and the requests right behind it are due too (a backlog at a
//! high rate, where tokio's millisecond timer wakes the head once for several slots), it
//! releases them in the same step, each counted at its own slot and sent its permit,
//! instead of passing the turn down the line one wake-up at a time: one timer per
//! group, and the rate holds at 10 000/s.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

mod answers;
mod refusal;
mod status;
mod tokens;

pub use refusal::Refusal;

use super::budget::{Budget, Params};
use super::fair::Flow;
use super::pause::Pause;
use super::permits::{Held, Permit, Permits};
use super::queue::{Place, Queue};
use super::rate::Rates;
use super::store::{Slot, Store, RECHECK_AHEAD, RECHECK_BEFORE};
use super::tokens::{token_budget, Cost, TokenBudget};
use crate::config::GroupSettings;
use crate::metrics::GroupMetrics;

/// A budget shared by all requests to the hosts of one group.
pub struct Group {
    /// The group's name: a `[[limit]]` name, or the host for an unlisted host.
    pub name: Arc<str>,
    /// The settings in force (a reload swaps them).
    settings: arc_swap::ArcSwap<GroupSettings>,
    /// This group's metric handles (written here, never read back for a decision).
    pub metrics: GroupMetrics,
    pub(super) store: Store,
    /// The budgets of its keys, in a `[[limit]]` with `key` (docs/keys.md).
    pub(super) keys: super::keys::Keys,
    permits: Permits,
    /// Requests holding a permit.
    in_flight: AtomicUsize,
    state: Mutex<State>,
    /// Wakes a head waiting for its slot when a reload changes the rate, or for the
    /// probe when an answer comes.
    wake: tokio::sync::Notify,
}

/// What changes as requests come and go, under one lock.
pub(super) struct State {
    pub(super) queue: Queue,
    pub(super) rates: Rates,
    pub(super) pause: Pause,
    pub(super) budget: Budget,
    /// The token buckets, in a group that counts tokens (docs/tokens.md).
    /// Boxed: most groups count no tokens, and a key's group is one of thousands.
    pub(super) tokens: Option<Box<TokenBudget>>,
    /// The pace changed here and the shared store has not been told yet: the next
    /// booking (or pause) publishes it.
    pub(super) publish: bool,
    /// The version of the shared controller this replica's pace is based on (the
    /// Redis clock at its last change; empty: none).
    pub(super) version: String,
    /// A request left on the local rates while the shared store was down, and none has
    /// been booked in it since: the next booking is no earlier than the local rates
    /// allow ([`super::redis::Booking::floor`]).
    pub(super) fell_back: bool,
}

impl Group {
    /// A new, idle group keeping its budget in `store`.
    pub fn new(
        name: Arc<str>,
        settings: GroupSettings,
        metrics: GroupMetrics,
        store: Store,
    ) -> Group {
        Group::with_settings(name, Arc::new(settings), metrics, store)
    }

    /// [`Group::new`], sharing `settings` (the keys of one limit share its settings).
    pub(super) fn with_settings(
        name: Arc<str>,
        settings: Arc<GroupSettings>,
        metrics: GroupMetrics,
        store: Store,
    ) -> Group {
        let now = Instant::now();
        (metrics.settings).show(settings.queue, settings.max_wait, settings.slowest_rate());
        let leases = match &store {
            Store::Redis(redis) if settings.shared_concurrency => Some(redis.clone()),
            _ => None,
        };
        Group {
            name,
            permits: Permits::new(settings.concurrency, leases),
            in_flight: AtomicUsize::new(0),
            wake: tokio::sync::Notify::new(),
            state: Mutex::new(State {
                queue: Queue::default(),
                rates: Rates::new(&settings, now),
                pause: Pause::default(),
                budget: Budget::new(
                    Params::default(),
                    !settings.rates.is_empty(),
                    floor(&settings),
                ),
                tokens: token_budget(&settings, &store, now),
                publish: false,
                version: String::new(),
                fell_back: false,
            }),
            store,
            keys: super::keys::Keys::new(now),
            settings: arc_swap::ArcSwap::new(settings),
            metrics,
        }
    }

    /// The group of the key whose value has `id` ([`super::keys::id_of`]), in a
    /// `[[limit]]` with `key`: made when first seen. Refused past `max_keys`.
    pub fn keyed(self: &Arc<Self>, id: u64) -> Result<Arc<Group>, Refusal> {
        self.keys.group(self, id)
    }

    /// The settings in force, to share.
    pub(super) fn settings_arc(&self) -> Arc<GroupSettings> {
        self.settings.load_full()
    }

    /// The settings in force.
    pub fn settings(&self) -> arc_swap::Guard<Arc<GroupSettings>> {
        self.settings.load()
    }

    /// Takes new settings (a reload), keeping the queue, its order, the rate's state,
    /// the pause and the permits held: the requests waiting leave at the new rate and
    /// concurrency.
    pub fn reconfigure(&self, settings: GroupSettings) {
        let settings = Arc::new(settings);
        // The limit first: a key made meanwhile copies the new settings, or is listed.
        self.reconfigure_shared(settings.clone());
        for key in self.keys.groups() {
            key.reconfigure_shared(settings.clone());
        }
    }

    fn reconfigure_shared(&self, settings: Arc<GroupSettings>) {
        let now = Instant::now();
        let mut state = self.lock();
        state.rates.reconfigure(&settings, now);
        let has_rate = !settings.rates.is_empty();
        state.budget.reconfigure(has_rate, floor(&settings));
        let pace = state.budget.pace();
        state.rates.set_learned(pace);
        match (&mut state.tokens, settings.tokens.counted()) {
            (Some(tokens), true) => tokens.reconfigure(&settings.tokens, now),
            (tokens, _) => *tokens = token_budget(&settings, &self.store, now),
        }
        self.permits.resize(settings.concurrency);
        (self.metrics.settings).show(settings.queue, settings.max_wait, settings.slowest_rate());
        self.settings.store(settings);
        drop(state);
        self.wake.notify_waiters();
    }

    /// Waits until a request of `cost` that arrived at `arrived` may leave, in FIFO
    /// order, and returns the permit it holds while in flight. `front` puts it at the
    /// head of the queue (a request the upstream refused, retried). Refused when the
    /// queue is full, or once it has waited `max_wait` since `arrived`. Dropping the
    /// future leaves the queue, and no slot is spent for it, unless the head before it
    /// had already released it (its slot counted) in the instant before.
    pub async fn admit(
        self: &Arc<Self>,
        cost: impl Into<Cost>,
        arrived: Instant,
        front: bool,
    ) -> Result<Permit, Refusal> {
        let cost = cost.into();
        if let Some(permit) = self.leave_at_once(cost) {
            self.count_departure(arrived, front);
            return Ok(permit);
        }
        // `max_wait` is a duration from the config: a value too large for the clock
        // means "no limit". A request keeps the one it arrived with through a reload.
        let deadline = arrived.checked_add(self.settings().max_wait);
        // A retry waits behind nobody; a first attempt behind the whole queue.
        let ahead = self.estimate_wait(!front, cost.flow);
        if deadline.is_some_and(|deadline| Instant::now() + ahead > deadline) {
            self.metrics.max_wait.inc();
            return Err(Refusal::WaitTooLong { ahead });
        }
        let mut place = Place::join(self, cost, front, deadline)?;
        let waiting = self.wait_in_line(&mut place);
        let waited = match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, waiting).await,
            None => Ok(waiting.await),
        };
        place.leave();
        match waited {
            Ok(Ok(permit)) => {
                self.count_departure(arrived, front);
                Ok(permit)
            }
            Ok(Err(refusal)) => {
                if matches!(refusal, Refusal::WaitTooLong { .. }) {
                    self.metrics.max_wait.inc();
                }
                Err(refusal)
            }
            Err(_) => {
                self.metrics.max_wait.inc();
                Err(Refusal::MaxWait {
                    waited: arrived.elapsed(),
                    retry_after: self.estimate_wait(true, cost.flow),
                })
            }
        }
    }

    /// The permit of a request that may leave now, under one lock: nobody in the queue,
    /// no pause, the rate open and a permit free (the common case of a group under its
    /// limits). It departs as the head of an empty queue would, without taking the
    /// turn. `None`: it joins the queue. The Redis store always books through the queue.
    fn leave_at_once(self: &Arc<Self>, cost: Cost) -> Option<Permit> {
        if !matches!(self.store, Store::Memory) {
            return None;
        }
        let mut state = self.lock();
        let now = Instant::now();
        let open = state.queue.is_empty()
            && state.pause.until(now).is_none()
            && state.budget.probe_holds(now).is_none()
            && state.budget.opens(now, false).is_none()
            && state.rates.earliest(1.0, now) <= now
            && state.tokens_hold(cost.tokens, now, false).is_none();
        if !open {
            return None;
        }
        let held = self.permits.try_now()?;
        self.depart(&mut state, (false, false), now, cost);
        drop(state);
        Some(Permit::new(held, self.clone()))
    }

    /// Waits for the turn, or for the head before it to release it.
    async fn wait_in_line(self: &Arc<Self>, place: &mut Place) -> Result<Permit, Refusal> {
        loop {
            match place.wait_for_turn().await {
                Ok(Some(held)) => return Ok(Permit::new(held, self.clone())),
                Ok(None) => {}
                Err(ahead) => return Err(Refusal::WaitTooLong { ahead }),
            }
            // Boxed: only the head gets here, and its wait (timers, the store's round
            // trip, a permit) is most of this future; inline, every waiting request
            // would carry room for it.
            let lead = Box::pin(self.lead(place));
            match lead.await? {
                Some(permit) => return Ok(permit),
                None => place.step_aside(),
            }
        }
    }

    /// Holding the turn: waits out a pause, the probe, the rate and a concurrency
    /// permit, then departs. `None` instead of departing when a retried request joined
    /// ahead of it meanwhile (typically during the pause its push-back caused): that
    /// goes first.
    async fn lead(self: &Arc<Self>, place: &Place) -> Result<Option<Permit>, Refusal> {
        // Since when nothing but the rate held the request back.
        let mut ready = place.joined;
        let mut booked = false;
        let mut permit: Option<Held> = None;
        // Its tokens, taken in the shared store (docs/tokens.md).
        let mut tokens_taken = false;
        loop {
            // Listening before the state is read: a reload or an answer after it wakes
            // the wait.
            let wake = self.wake.notified();
            tokio::pin!(wake);
            wake.as_mut().enable();
            let now = Instant::now();
            let (paused, probed) = {
                let state = self.lock();
                (state.pause.until(now), state.budget.probe_holds(now))
            };
            if let Some(until) = paused {
                if place.deadline.is_some_and(|deadline| until > deadline) {
                    return Err(Refusal::WaitTooLong { ahead: until - now });
                }
                // A slot booked before the pause began has passed.
                booked = false;
                tokio::time::sleep_until(until).await;
                ready = ready.max(until);
                continue;
            }
            if self
                .wait_for_tokens(place, wake.as_mut(), &mut tokens_taken)
                .await?
            {
                continue;
            }
            if let Some(until) = probed {
                // Whichever comes first: an answer, or the probe's end.
                let _answered = tokio::time::timeout_at(until, wake).await;
                ready = ready.max(Instant::now());
                continue;
            }
            if !booked {
                match self.book(place, now, wake.as_mut()).await? {
                    Booking::Yield => return Ok(None),
                    Booking::Again {
                        booked: b,
                        answered,
                    } => {
                        booked = b;
                        if answered {
                            ready = ready.max(Instant::now());
                        }
                        continue;
                    }
                    Booking::Leave => {}
                }
            }
            let held = match permit.take().or_else(|| self.permits.try_now()) {
                Some(held) => held,
                None => {
                    // Waiting for a permit can take long (a slow upstream): a pause may
                    // begin meanwhile, so look again before leaving. The time spent
                    // waiting for it is not the rate's.
                    permit = Some(self.permits.acquire(&self.name).await?);
                    ready = ready.max(Instant::now());
                    continue;
                }
            };
            let mut state = self.lock();
            if state.queue.retry_ahead_of(place.key) {
                // `held` goes back: the retry may need this very permit.
                return Ok(None);
            }
            let cost = Cost {
                requests: place.cost,
                tokens: place.tokens,
                flow: None,
            };
            self.depart(&mut state, (booked, tokens_taken), ready, cost);
            return Ok(Some(Permit::new(held, self.clone())));
        }
    }

    /// Books the head's slot in the store and waits for it (or for `wake`, when the
    /// local rate's slot may move with a reload, or an answer may end the probe).
    async fn book(
        self: &Arc<Self>,
        place: &Place,
        now: Instant,
        wake: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
    ) -> Result<Booking, Refusal> {
        // A retry that joined ahead of it meanwhile (during the pause its push-back
        // caused, typically) goes first: before a slot is booked for this one in the
        // shared store, where it would pass unused.
        if self.lock().queue.retry_ahead_of(place.key) {
            return Ok(Booking::Yield);
        }
        let again = |booked, answered| Booking::Again { booked, answered };
        Ok(match self.store.book(self, place.cost, now).await? {
            Slot::Paused => again(false, false),
            Slot::Probing(until) => {
                let _answered = tokio::time::timeout_at(until, wake).await;
                again(false, true)
            }
            Slot::Booked { at, stamp } => {
                // Checked a little before it comes: the round trip must not delay the
                // departure, or vary its spacing.
                let ahead = at.saturating_duration_since(Instant::now());
                let booked = ahead < RECHECK_AHEAD || {
                    crate::precise_sleep::sleep_until_slot(at - RECHECK_BEFORE).await;
                    self.store.slot_holds(self, stamp).await
                };
                if booked {
                    crate::precise_sleep::sleep_until_slot(at).await;
                }
                again(booked, false)
            }
            // A slot of the local rate is read again after a reload.
            Slot::Local(at) if at > now => {
                tokio::select! {
                    () = crate::precise_sleep::sleep_until_slot(at) => {}
                    () = wake => {}
                }
                again(false, false)
            }
            Slot::Local(_) => Booking::Leave,
        })
    }

    /// The head departs: counted in the budget and the local rates (unless the shared
    /// store booked it: `booked`, and its tokens: `tokens_taken`), and the requests
    /// behind it whose slots have come leave with it.
    fn depart(
        &self,
        state: &mut State,
        (booked, tokens_taken): (bool, bool),
        ready: Instant,
        cost: Cost,
    ) {
        let now = Instant::now();
        state.budget.departed(now);
        if let (Some(tokens), Some(estimate)) = (&mut state.tokens, cost.tokens) {
            tokens.take(estimate, now, tokens_taken);
        }
        if booked {
            let share = 1.0 / f64::from(self.store.replicas());
            state.rates.booked(share, now, cost.requests);
            return;
        }
        state.fell_back = !matches!(self.store, Store::Memory);
        let mut after = state
            .rates
            .depart(self.store.local_share(), ready, now, cost.requests);
        // The shared store books each request's slot itself (and while it is down a
        // request may need several local permits, which only `Permits::acquire`
        // takes); a pause in force holds the rest; and each request of a group that
        // counts tokens waits for its own estimate at the head.
        let held = state.pause.until(now).is_some() || state.tokens.is_some();
        if !matches!(self.store, Store::Memory) || held {
            return;
        }
        while let Some((cost, joined)) = state.queue.front() {
            let budget = &state.budget;
            if budget.probe_holds(now).is_some() || budget.opens(now, false).is_some() {
                return;
            }
            let Some(held) = self.permits.try_now() else {
                return;
            };
            let Some(slot) = state.rates.depart_if_due(joined, after, now, cost) else {
                return;
            };
            if state.queue.release_front(held).is_err() {
                return;
            }
            state.budget.departed(now);
            after = slot;
        }
    }

    /// How long a request arriving now would wait: the pause, then the rate's backlog
    /// for the cost queued ahead of it (`behind_queue`; in a fair queue, what leaves
    /// before it in its `flow`'s share) or for nobody ahead (a retry).
    pub(super) fn estimate_wait(&self, behind_queue: bool, flow: Option<Flow>) -> Duration {
        let state = self.lock();
        let now = Instant::now();
        let ahead = match behind_queue {
            true => state.queue.cost_ahead(flow, 1),
            false => 0,
        };
        let start = state.pause.until(now).unwrap_or(now);
        (start - now) + state.rates.backlog(start, ahead)
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // Plain counters and times: valid after any panic of a holder.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn took_permit(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.metrics.in_flight.inc();
    }

    pub(super) fn gave_permit_back(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.metrics.in_flight.dec();
    }
}

/// The least pace the controller may set, per second: `min_rate`, else none.
fn floor(settings: &GroupSettings) -> f64 {
    settings.min_rate.map_or(0.0, |r| r.per_second())
}

/// What the head's booking came to.
enum Booking {
    /// A retry is ahead of it: it goes first.
    Yield,
    /// Look again (a pause, a probe, a slot that passed or was checked): `booked`, the
    /// slot is counted and has come; `answered`, it waited for an answer.
    Again { booked: bool, answered: bool },
    /// The slot has come: leave.
    Leave,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rate;
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
        let g = probing_group(settings);
        // These tests drive admission without answers: the probe, which waits for
        // answers, has tests of its own.
        g.lock().budget.end_probe();
        g
    }

    fn probing_group(settings: GroupSettings) -> Arc<Group> {
        let metrics = Metrics::new().group("g");
        Arc::new(Group::new("g".into(), settings, metrics, Store::Memory))
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
                let permit = g.admit(1, now, false).await.unwrap();
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
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for &(name, cost, front) in requests {
            let (g, tx) = (g.clone(), tx.clone());
            tokio::spawn(async move {
                let _p = g.admit(cost, start, front).await.unwrap();
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

    #[tokio::test(start_paused = true)]
    async fn requests_leave_in_order_at_the_pace() {
        let g = group("10/s", |_| {});
        let out = run(&g, 5, Duration::ZERO).await;
        assert_eq!(out, [(0, 0), (1, 100), (2, 200), (3, 300), (4, 400)]);
        assert_eq!(g.status().queued, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reload_sends_the_waiting_requests_at_the_new_rate_in_order() {
        let g = group("1/h", |s| {
            s.concurrency = 1;
            s.max_wait = Duration::from_secs(10 * 3600);
        });
        let start = Instant::now();
        let waiting = tokio::spawn({
            let g = g.clone();
            async move { run(&g, 4, Duration::from_millis(10)).await }
        });
        for _ in 0..1000 {
            if g.status().queued == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(g.status().queued, 3);
        tokio::time::sleep(Duration::from_secs(60)).await;
        let mut faster = (**g.settings()).clone();
        faster.rates = vec!["10/s".parse::<Rate>().unwrap()];
        faster.concurrency = 2;
        g.reconfigure(faster);
        let out = waiting.await.unwrap();
        // The first left at once; the head, asleep for the rest of the hour, left as
        // soon as it woke to the new rate; the others followed at its pace.
        let order: Vec<usize> = out.iter().map(|(i, _)| *i).collect();
        assert_eq!(order, [0, 1, 2, 3]);
        let times: Vec<u128> = out.iter().map(|(_, t)| *t).collect();
        assert_eq!(times[0], 0);
        assert!(times[1] >= 60_000 && times[3] <= 60_000 + 300, "{times:?}");
        assert_eq!(start.elapsed().as_secs(), 60);
        assert_eq!(g.permits.available(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_group_told_no_rate_sends_a_round_of_answers_at_a_time() {
        let g = probing_group(GroupSettings::default());
        let start = Instant::now();
        let mut waiting = Vec::new();
        for _ in 0..8 {
            let g = g.clone();
            waiting.push(tokio::spawn(async move {
                let permit = g.admit(1, Instant::now(), false).await.unwrap();
                drop(permit);
            }));
            tokio::task::yield_now().await;
        }
        // (requests out after the round, answers accepted then): 1, 3, 4 out; the
        // rest wait for the probe's end.
        for (window, answers) in [(1, 1), (3, 1), (4, 0)] {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let sent = waiting.iter().filter(|w| w.is_finished()).count();
            assert_eq!(sent, window);
            assert_eq!(
                g.status().budget.phase,
                crate::limit::budget::Phase::Probing
            );
            for _ in 0..answers {
                g.accepted(start);
            }
        }
        waiting.pop().unwrap().await.unwrap();
        assert_eq!(start.elapsed(), Params::DEFAULT.probe_for);
        assert_eq!(g.status().budget.phase, crate::limit::budget::Phase::Open);
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
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for i in 0..8 {
            let (g, tx) = (g.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let permit = g.admit(1, start, false).await.unwrap();
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
        let first = g.admit(1, start, false).await.unwrap();
        let mut waiting: Vec<_> = (0..4).map(|_| Box::pin(g.admit(1, start, false))).collect();
        for w in &mut waiting {
            assert!(w.now_or_never().is_none());
        }
        // The head wakes 5 ms late and leaves; the one behind it is released in the same
        // step: it holds the last permit before its task has even run.
        tokio::time::advance(Duration::from_millis(5)).await;
        let head = (&mut waiting[0]).now_or_never().unwrap().unwrap();
        assert_eq!(g.permits.available(), 0);
        // Its client goes before it runs: the permit comes back, the slot is spent.
        drop(waiting.remove(1));
        assert_eq!(g.permits.available(), 1);
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
        let first = g.admit(1, now, false).await.unwrap();
        let g2 = g.clone();
        let _second = tokio::spawn(async move { g2.admit(1, now, false).await });
        let g3 = g.clone();
        let _third = tokio::spawn(async move { g3.admit(1, now, false).await });
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        assert_eq!(g.status().queued, 2);
        match g.admit(1, now, false).await {
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
        // Held by a concurrency permit, which no estimate foresees: refused at max_wait.
        let g = group("unlimited", |s| {
            s.max_wait = Duration::from_secs(1);
            s.concurrency = 1;
        });
        let now = Instant::now();
        let _first = g.admit(1, now, false).await.unwrap();
        let refused = g.admit(1, now, false).await;
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
    async fn a_wait_that_outlasts_max_wait_is_refused_at_once() {
        // (rate, pause, requests already queued behind the one in flight, refused)
        let cases = [
            ("1/10s", 0, 0, true),
            ("10/s", 0, 5, false),
            ("10/s", 0, 25, true),
            ("unlimited", 100, 0, true),
            ("unlimited", 1, 0, false),
        ];
        for (rate, pause, queued, refused) in cases {
            let g = group(rate, |s| s.max_wait = Duration::from_secs(2));
            let start = Instant::now();
            let _first = g.admit(1, start, false).await.unwrap();
            g.pause_for(Duration::from_secs(pause));
            let mut waiting = Vec::new();
            for _ in 0..queued {
                let g = g.clone();
                let now = Instant::now();
                waiting.push(tokio::spawn(async move { g.admit(1, now, false).await }));
                tokio::task::yield_now().await;
            }
            let answer = g.admit(1, Instant::now(), false);
            let answer = futures_util::FutureExt::now_or_never(Box::pin(answer));
            let case = format!("{rate} pause {pause} queued {queued}");
            match answer {
                Some(Err(Refusal::WaitTooLong { ahead })) => {
                    assert!(refused, "{case}: {ahead:?}");
                    assert!(ahead > Duration::from_secs(2), "{case}: {ahead:?}");
                }
                None => assert!(!refused, "{case}: waits"),
                other => panic!("{case}: {other:?}"),
            }
            assert_eq!(start.elapsed(), Duration::ZERO, "{case}");
            for w in waiting {
                w.abort();
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_refuses_at_once_the_waiting_requests_it_would_hold_too_long() {
        let g = group("10/s", |s| s.max_wait = Duration::from_secs(3));
        let start = Instant::now();
        let _first = g.admit(1, start, false).await.unwrap();
        let mut waiting = Vec::new();
        for _ in 0..4 {
            let g = g.clone();
            waiting.push(tokio::spawn(async move {
                let answer = g.admit(1, start, false).await.map(drop);
                (answer, start.elapsed())
            }));
            tokio::task::yield_now().await;
        }
        // Paused until 2.75 s: the first three leave at 2.75, 2.85 and 2.95 s, within
        // their 3 s; the last would leave after it, and is refused now.
        g.pause_for(Duration::from_millis(2750));
        let mut answers = Vec::new();
        for w in waiting {
            let (answer, at) = w.await.unwrap();
            answers.push((answer.is_ok(), at.as_millis()));
        }
        assert_eq!(
            answers,
            [(true, 2750), (true, 2850), (true, 2950), (false, 0)]
        );
        assert_eq!(g.metrics.max_wait.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_refusal_an_unlimited_group_replays_at_the_learned_pace() {
        let g = group("unlimited", |_| {});
        // The upstream accepted five and refused the rest with a 1 s pause.
        let sent = Instant::now();
        for _ in 0..5 {
            g.accepted(sent);
        }
        g.push_back(Duration::from_secs(1), true, sent);
        let status = g.status().budget;
        assert_eq!(status.phase, crate::limit::budget::Phase::Paced);
        // Five per second let through: a step under it, 4.5/s.
        let rate = status.pace_per_second.unwrap();
        assert!((rate - 4.5).abs() < 1e-9, "{rate}");
        let out = run(&g, 4, Duration::ZERO).await;
        let times: Vec<u128> = out.iter().map(|(_, t)| *t).collect();
        // Head first at the pause's end, then one every 1 / rate (≈ 222 ms), not all
        // at once.
        assert_eq!(times[0], 1000, "{times:?}");
        for gap in times.windows(2).map(|w| w[1] - w[0]) {
            assert!((220..=224).contains(&gap), "{times:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_waiter_leaves_and_wastes_no_slot() {
        let g = group("1/s", |_| {});
        let start = Instant::now();
        let _first = g.admit(1, start, false).await.unwrap();
        let g2 = g.clone();
        let second = tokio::spawn(async move { g2.admit(1, start, false).await });
        tokio::task::yield_now().await;
        let g3 = g.clone();
        let third = tokio::spawn(async move {
            g3.admit(1, start, false).await.unwrap();
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
        g.pause_for(Duration::from_secs(5));
        let out = run(&g, 3, Duration::ZERO).await;
        assert_eq!(out, [(0, 5000), (1, 5000), (2, 5000)]);
        assert!(g.lock().pause.until(Instant::now()).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_retried_request_goes_to_the_head() {
        let g = group("1/s", |_| {});
        let start = Instant::now();
        let _first = g.admit(1, start, false).await.unwrap();
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
        let p = g.admit(1, now, false).await.unwrap();
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
        let in_flight = g.admit(1, start, false).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for (name, front) in [("head", false), ("retry", true)] {
            let (g, tx) = (g.clone(), tx.clone());
            tokio::spawn(async move {
                let permit = g.admit(1, start, front).await.unwrap();
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
    async fn a_refusal_steps_the_pace_once_per_episode_and_a_calm_round_climbs_back() {
        let g = group("100/s", |_| {});
        let pace = |g: &Group| g.status().budget.pace_per_second.map(f64::round);
        let sent = Instant::now();
        tokio::time::sleep(Duration::from_millis(1)).await;
        g.push_back(Duration::ZERO, true, sent);
        // The same episode: its requests left before the step.
        g.push_back(Duration::ZERO, true, sent);
        assert_eq!(pace(&g), Some(90.0));
        // Answers to requests that left under the new pace make a calm round: halfway
        // back to the pace refused.
        let mut left = Vec::new();
        for _ in 0..Params::DEFAULT.calm {
            let permit = g.admit(1, Instant::now(), false).await.unwrap();
            left.push(Instant::now());
            drop(permit);
        }
        for at in left {
            g.accepted(at);
        }
        assert_eq!(pace(&g), Some(95.0));
    }
}
