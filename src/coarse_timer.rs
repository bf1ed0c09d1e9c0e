//! Timeouts set in seconds, checked by one sweeper per timer instead of tokio's timers:
//! `client_header_timeout` on HTTP/1 client connections (as hyper's [`Timer`]) and
//! `response_timeout` on requests sent upstream ([`CoarseTimer::timeout`]).
//!
//! Both start a deadline for every request and nearly always drop it unexpired. hyper
//! starts a new sleep each time an HTTP/1 connection waits for a request head, which on a
//! kept-alive connection is once per request, and drops it when the head arrives. With
//! tokio's timer each of these was an entry put into and taken out of the runtime's timer
//! wheel under its lock, and most also woke the runtime's driver through its eventfd (tokio
//! does so when a new deadline may be earlier than the one the driver sleeps until): 0.77
//! `write` calls per forwarded request. This timer took 1.4 µs off the 26 µs of CPU a
//! forwarded request cost (docs/performance-log.md, "Fifth session: what the profile showed
//! and what changed"). The response timeout on tokio's timer cost 660 of the 34.1k
//! instructions of a forwarded request, this one 340 (callgrind; docs/performance-log.md,
//! "Seventh session").
//!
//! These timeouts guard against peers that stall, and are set in seconds; they need no
//! millisecond precision. Here a sleep is a deadline in its [`CoarseTimer`]'s list, and
//! a sweeper task wakes those whose deadline has passed once per [`tick`]; a sleep ends
//! no earlier than its deadline and at most one tick after it, and only the sweeper
//! reads the clock. The first sleep that
//! waits starts the sweeper on the runtime that polls it: each serving thread has its
//! own timers, so that is the thread's runtime. The sweeper wakes once per tick while any
//! sleep is pending, not at all when none is, and ends once the timer and all its sleeps
//! are gone (at its next tick, or at once if it is idle).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper::rt::{Sleep, Timer};
use slab::Slab;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How often the sweeper looks for expired sleeps when the timeout is `timeout`: an
/// eighth of it, but at least 10 ms and at most 1 s; a sleep ends at most one tick late.
pub fn tick(timeout: Duration) -> Duration {
    (timeout / 8).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// A timer whose sleeps are deadlines checked by one sweeper task. Clones share one
/// list; each serving thread makes its own timers, so a list is only ever locked by the
/// thread that owns it.
#[derive(Clone)]
pub struct CoarseTimer {
    sleepers: Arc<Sleepers>,
}

/// The pending sleeps of one timer.
struct Sleepers {
    /// Each pending sleep's deadline and the waker of the task that polled it last;
    /// `None` once the sweeper has woken it.
    entries: Mutex<Slab<(Instant, Option<Waker>)>>,
    /// Wakes an idle sweeper: told when a sleep is added to an empty list, so that it
    /// starts ticking, and when the timer is gone, so that it ends. Its own `Arc`: the
    /// sweeper waits on it without keeping the timer alive.
    wake_sweeper: Arc<Notify>,
    /// Whether a sweeper runs (set by the sleep that starts it, cleared when it ends or
    /// its runtime drops it, so that a later sleep starts another).
    sweeping: AtomicBool,
    /// See [`tick`].
    tick: Duration,
}

impl CoarseTimer {
    /// A timer for sleeps that may end up to `tick` after their deadline.
    pub fn new(tick: Duration) -> Self {
        CoarseTimer {
            sleepers: Arc::new(Sleepers {
                entries: Mutex::new(Slab::new()),
                wake_sweeper: Arc::new(Notify::new()),
                sweeping: AtomicBool::new(false),
                tick,
            }),
        }
    }

    /// A sleep that ends at `deadline` or up to one tick after it.
    pub fn sleep_at(&self, deadline: Instant) -> CoarseSleep {
        CoarseSleep {
            sleepers: self.sleepers.clone(),
            deadline,
            key: None,
        }
    }

    /// `future`'s output, or [`Elapsed`] if it is not ready within `after` (up to one
    /// tick more); as `tokio::time::timeout`.
    pub fn timeout<F: Future>(&self, after: Duration, future: F) -> Timeout<F> {
        Timeout {
            inner: future,
            sleep: self.sleep_at(deadline_after(after)),
        }
    }

    /// How many sleeps are pending (for tests).
    #[cfg(test)]
    fn pending(&self) -> usize {
        self.sleepers.lock().len()
    }
}

/// `after` from now; a duration too long for the clock (a configured timeout of
/// centuries) means about 30 years, as in `tokio::time`.
fn deadline_after(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30))
}

/// Wakes every sleep whose deadline has passed, once per tick, while any is pending;
/// ends once the timer and its sleeps are gone.
async fn sweep(sleepers: Weak<Sleepers>, wake_sweeper: Arc<Notify>, tick: Duration) {
    // However this ends (the timer gone, or the runtime dropping the task), a later
    // sleep of a timer still in use starts a new sweeper.
    let _running = Running(sleepers.clone());
    loop {
        let Some(pending) = sleepers.upgrade().map(|s| !s.lock().is_empty()) else {
            return;
        };
        if !pending {
            // A sleep added after the check leaves a permit, so this cannot miss it;
            // nor the timer's drop, which notifies too.
            wake_sweeper.notified().await;
            continue;
        }
        tokio::time::sleep(tick).await;
        let Some(sleepers) = sleepers.upgrade() else {
            return;
        };
        let now = Instant::now();
        let due: Vec<Waker> = sleepers
            .lock()
            .iter_mut()
            .filter(|(_, (deadline, _))| *deadline <= now)
            .filter_map(|(_, (_, waker))| waker.take())
            .collect();
        // Outside the lock: a woken task on another thread could poll at once.
        due.into_iter().for_each(Waker::wake);
    }
}

/// Clears [`Sleepers::sweeping`] when the sweeper ends.
struct Running(Weak<Sleepers>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(sleepers) = self.0.upgrade() {
            sleepers.sweeping.store(false, Ordering::Relaxed);
        }
    }
}

impl Sleepers {
    fn lock(&self) -> MutexGuard<'_, Slab<(Instant, Option<Waker>)>> {
        // A panic while holding the lock leaves the list consistent (each step is one
        // slab call), so a poisoned lock is used as it is.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Sleepers {
    fn drop(&mut self) {
        // The sweeper, if waiting for a first sleep, wakes and finds the timer gone.
        self.wake_sweeper.notify_one();
    }
}

impl Timer for CoarseTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        Box::pin(self.sleep_at(deadline_after(duration)))
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn Sleep>> {
        Box::pin(self.sleep_at(Instant::from_std(deadline)))
    }

    /// tokio's clock, so tests with a paused clock see the same time as the sweeper.
    fn now(&self) -> std::time::Instant {
        Instant::now().into_std()
    }
}

/// One sleep of a [`CoarseTimer`]: in its list from the first poll that finds it
/// pending until it ends or is dropped.
pub struct CoarseSleep {
    sleepers: Arc<Sleepers>,
    deadline: Instant,
    /// Its entry in the list, once it has one.
    key: Option<usize>,
}

impl CoarseSleep {
    fn leave_list(&mut self) {
        if let Some(key) = self.key.take() {
            // Its waker is dropped after the lock is released (see `poll`).
            let _entry = self.sleepers.lock().remove(key);
        }
    }
}

impl Future for CoarseSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let sleepers = &this.sleepers;
        let mut entries = sleepers.lock();
        // No clock is read here: the sweeper takes the waker of a sleep whose deadline
        // has passed, and only then, so an entry without one is a sleep that is over.
        // (Reading the clock cost two reads per request for nothing: these sleeps are
        // nearly always dropped long before their deadline.)
        // A waker replaced here is dropped once the lock is released: dropping a waker
        // runs code that is not ours.
        let _replaced = match this.key {
            Some(key) => match &mut entries[key].1 {
                None => {
                    drop(entries);
                    this.leave_list();
                    return Poll::Ready(());
                }
                Some(waker) if waker.will_wake(cx.waker()) => None,
                Some(waker) => Some(std::mem::replace(waker, cx.waker().clone())),
            },
            None => {
                if entries.is_empty() {
                    sleepers.wake_sweeper.notify_one();
                }
                this.key = Some(entries.insert((this.deadline, Some(cx.waker().clone()))));
                None
            }
        };
        drop(entries);
        // A load first: the sweeper nearly always runs already, and a swap would write
        // the flag's cache line on every pending poll.
        if !sleepers.sweeping.load(Ordering::Relaxed)
            && !sleepers.sweeping.swap(true, Ordering::Relaxed)
        {
            tokio::spawn(sweep(
                Arc::downgrade(sleepers),
                sleepers.wake_sweeper.clone(),
                sleepers.tick,
            ));
        }
        Poll::Pending
    }
}

impl Drop for CoarseSleep {
    fn drop(&mut self) {
        self.leave_list();
    }
}

impl Sleep for CoarseSleep {}

/// The deadline of a [`CoarseTimer::timeout`] passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

pin_project_lite::pin_project! {
    /// A future bounded by a [`CoarseSleep`]; see [`CoarseTimer::timeout`].
    pub struct Timeout<F> {
        #[pin]
        inner: F,
        sleep: CoarseSleep,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.inner.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        Pin::new(this.sleep).poll(cx).map(|()| Err(Elapsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Awaits `sleep`, failing the test if nothing ends it within a minute of paused time.
    async fn ends(sleep: impl Future<Output = ()>) {
        tokio::time::timeout(Duration::from_secs(60), sleep)
            .await
            .expect("the sweeper ended the sleep");
    }

    /// Polls `future` once with the test task's waker.
    async fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *future).poll(cx))).await
    }

    /// How many tasks the test's runtime runs (the sweeper is the only one it spawns).
    fn tasks() -> usize {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    }

    #[test]
    fn the_tick_is_an_eighth_of_the_timeout_within_bounds() {
        assert_eq!(tick(Duration::from_secs(30)), Duration::from_secs(1));
        assert_eq!(tick(Duration::from_secs(4)), Duration::from_millis(500));
        assert_eq!(
            tick(Duration::from_millis(300)),
            Duration::from_micros(37_500)
        );
        assert_eq!(tick(Duration::from_millis(20)), Duration::from_millis(10));
    }

    /// Sleeps end no earlier than their deadline and no later than one tick after it,
    /// each at its own deadline's tick, and leave the list as they end.
    #[tokio::test(start_paused = true)]
    async fn sleeps_end_within_one_tick_after_their_deadline() {
        let tick = Duration::from_millis(100);
        let timer = CoarseTimer::new(tick);
        let start = Instant::now();
        let mut ended = Vec::new();
        let sleeps = [250, 40, 1_000].map(|ms| {
            let sleep = timer.sleep(Duration::from_millis(ms));
            tokio::spawn(async move {
                ends(sleep).await;
                (ms, start.elapsed())
            })
        });
        for sleep in sleeps {
            ended.push(sleep.await.unwrap());
        }
        for (ms, elapsed) in ended {
            let deadline = Duration::from_millis(ms);
            assert!(
                elapsed >= deadline && elapsed <= deadline + tick,
                "a {ms} ms sleep ended after {elapsed:?}"
            );
        }
        assert_eq!(timer.pending(), 0);
    }

    /// A sleep dropped before its deadline (hyper drops it when the head arrives) leaves
    /// the list at once; a sleep added long after, to the empty list, still ends in time.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_sleep_leaves_the_list_and_a_later_one_still_ends() {
        let timer = CoarseTimer::new(Duration::from_millis(100));
        let mut sleep = timer.sleep(Duration::from_secs(30));
        assert!(poll_once(&mut sleep).await.is_pending());
        assert_eq!(timer.pending(), 1);
        drop(sleep);
        assert_eq!(timer.pending(), 0);

        // Long after, with the list empty all along.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let start = Instant::now();
        ends(timer.sleep(Duration::from_millis(250))).await;
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_millis(250) && elapsed <= Duration::from_millis(350),
            "ended after {elapsed:?}"
        );
        assert_eq!(timer.pending(), 0);

        // The sweeper, idle again, waits for a first sleep; dropping the timer ends it.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(tasks(), 1);
        drop(timer);
        tokio::task::yield_now().await;
        assert_eq!(tasks(), 0, "the idle sweeper ended with its timer");
    }

    /// A timeout too long for the clock is taken as about 30 years, not a panic.
    #[tokio::test(start_paused = true)]
    async fn a_timeout_too_long_for_the_clock_waits() {
        let timer = CoarseTimer::new(Duration::from_secs(1));
        let mut forever = timer.timeout(Duration::MAX, std::future::pending::<()>());
        assert!(poll_once(&mut forever).await.is_pending());
        let mut sleep = timer.sleep(Duration::MAX);
        assert!(poll_once(&mut sleep).await.is_pending());
        assert_eq!(timer.pending(), 2);
    }

    /// A poll reads no clock: a sleep whose deadline has already passed waits for the
    /// sweeper's next tick, which takes its waker, and ends then.
    #[tokio::test(start_paused = true)]
    async fn a_past_deadline_ends_at_the_next_tick() {
        let tick = Duration::from_millis(100);
        let timer = CoarseTimer::new(tick);
        let start = Instant::now();
        let mut sleep = timer.sleep_at(start);
        assert!(poll_once(&mut sleep).await.is_pending());
        ends(sleep).await;
        let elapsed = start.elapsed();
        assert!(
            elapsed > Duration::ZERO && elapsed <= tick,
            "ended after {elapsed:?}"
        );
        assert_eq!(timer.pending(), 0);
    }

    /// A timeout gives the future's output when it is ready in time, and `Elapsed` one
    /// tick after the deadline at the latest when it never is; either way its sleep has
    /// left the list, and dropping the timer ends the sweeper.
    #[tokio::test(start_paused = true)]
    async fn a_timeout_ends_with_its_future_or_its_deadline() {
        let tick = Duration::from_millis(100);
        let timer = CoarseTimer::new(tick);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut answered = timer.timeout(Duration::from_secs(5), rx);
        assert!(poll_once(&mut answered).await.is_pending());
        assert_eq!(timer.pending(), 1);
        tx.send(7).unwrap();
        assert_eq!(answered.await, Ok(Ok(7)));
        assert_eq!(timer.pending(), 0);

        let start = Instant::now();
        let after = Duration::from_secs(2);
        let stalled = timer.timeout(after, std::future::pending::<()>());
        assert_eq!(stalled.await, Err(Elapsed));
        let elapsed = start.elapsed();
        assert!(
            elapsed >= after && elapsed <= after + tick,
            "timed out after {elapsed:?}"
        );
        assert_eq!(timer.pending(), 0);

        assert_eq!(tasks(), 1, "the sweeper runs");
        drop(timer);
        // It notices at its next tick, or at once if it was waiting for a first sleep.
        tokio::time::sleep(tick * 2).await;
        assert_eq!(tasks(), 0, "the sweeper ended with its timer");
    }
}
