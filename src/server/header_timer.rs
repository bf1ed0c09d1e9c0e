//! The timer behind `client_header_timeout` on HTTP/1 connections: deadlines checked by
//! one sweeper per serving thread instead of tokio timers.
//!
//! hyper starts a new sleep each time an HTTP/1 connection waits for a request head, which
//! on a kept-alive connection is once per request, and drops it when the head arrives.
//! With tokio's timer each of these was an entry put into and taken out of the runtime's
//! timer wheel under its lock, and most also woke the runtime's driver through its
//! eventfd (tokio does so when a new deadline may be earlier than the one the driver
//! sleeps until): 0.77 `write` calls per forwarded request. This timer took 1.4 µs off
//! the 26 µs of CPU a forwarded request cost (BENCHMARKS.md, "Fifth session: what the
//! profile showed and what changed").
//!
//! This timeout guards against clients that stall, and is set in seconds; it needs no
//! millisecond precision. Here a sleep is a deadline in its thread's [`HeaderTimer`] list,
//! and a sweeper task wakes those whose deadline has passed once per [`tick`]; a sleep
//! ends no earlier than its deadline and at most one tick after it. The sweeper wakes
//! once per tick while any sleep is pending, and not at all when none is.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper::rt::{Sleep, Timer};
use slab::Slab;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How often the sweeper looks for expired sleeps when the timeout is `timeout`: an
/// eighth of it, but at least 10 ms and at most 1 s; a sleep ends at most one tick late.
pub(super) fn tick(timeout: Duration) -> Duration {
    (timeout / 8).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// A [`hyper::rt::Timer`] whose sleeps are deadlines checked by [`HeaderTimer::sweep`].
/// Clones share one list; a serving thread makes one and runs its sweeper.
#[derive(Clone)]
pub(super) struct HeaderTimer {
    sleepers: Arc<Sleepers>,
}

/// The pending sleeps of one thread.
struct Sleepers {
    /// Each pending sleep's deadline and the waker of the task that polled it last;
    /// `None` once the sweeper has woken it.
    entries: Mutex<Slab<(Instant, Option<Waker>)>>,
    /// Told when a sleep is added to an empty list, so an idle sweeper starts ticking.
    first_added: Notify,
    /// See [`tick`].
    tick: Duration,
}

impl HeaderTimer {
    /// A timer for sleeps that may end up to `tick` after their deadline.
    pub(super) fn new(tick: Duration) -> Self {
        HeaderTimer {
            sleepers: Arc::new(Sleepers {
                entries: Mutex::new(Slab::new()),
                first_added: Notify::new(),
                tick,
            }),
        }
    }

    /// Wakes every sleep whose deadline has passed, once per tick, for as long as it is
    /// polled. Runs on the serving thread's runtime beside its connections.
    pub(super) async fn sweep(self) {
        let sleepers = self.sleepers;
        loop {
            if sleepers.lock().is_empty() {
                // A sleep added after the check leaves a permit, so this cannot miss it.
                sleepers.first_added.notified().await;
                continue;
            }
            tokio::time::sleep(sleepers.tick).await;
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

    /// How many sleeps are pending (for tests).
    #[cfg(test)]
    fn pending(&self) -> usize {
        self.sleepers.lock().len()
    }
}

impl Sleepers {
    fn lock(&self) -> MutexGuard<'_, Slab<(Instant, Option<Waker>)>> {
        // A panic while holding the lock leaves the list consistent (each step is one
        // slab call), so a poisoned lock is used as it is.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Timer for HeaderTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        self.sleep_until((Instant::now() + duration).into_std())
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn Sleep>> {
        Box::pin(HeaderSleep {
            sleepers: self.sleepers.clone(),
            deadline: Instant::from_std(deadline),
            key: None,
        })
    }

    /// tokio's clock, so tests with a paused clock see the same time as the sweeper.
    fn now(&self) -> std::time::Instant {
        Instant::now().into_std()
    }
}

/// One sleep of a [`HeaderTimer`]: in its list from the first poll that finds it pending
/// until it ends or is dropped.
struct HeaderSleep {
    sleepers: Arc<Sleepers>,
    deadline: Instant,
    /// Its entry in the list, once it has one.
    key: Option<usize>,
}

impl HeaderSleep {
    fn leave_list(&mut self) {
        if let Some(key) = self.key.take() {
            // Its waker is dropped after the lock is released (see `poll`).
            let _entry = self.sleepers.lock().remove(key);
        }
    }
}

impl Future for HeaderSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if Instant::now() >= this.deadline {
            this.leave_list();
            return Poll::Ready(());
        }
        let mut entries = this.sleepers.lock();
        // A waker replaced here is dropped once the lock is released: dropping a waker
        // runs code that is not ours.
        let _replaced = match this.key {
            Some(key) => {
                let waker = &mut entries[key].1;
                if waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    None
                } else {
                    waker.replace(cx.waker().clone())
                }
            }
            None => {
                if entries.is_empty() {
                    this.sleepers.first_added.notify_one();
                }
                this.key = Some(entries.insert((this.deadline, Some(cx.waker().clone()))));
                None
            }
        };
        drop(entries);
        Poll::Pending
    }
}

impl Drop for HeaderSleep {
    fn drop(&mut self) {
        self.leave_list();
    }
}

impl Sleep for HeaderSleep {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Awaits `sleep`, failing the test if nothing ends it within a minute of paused time.
    async fn ends(sleep: Pin<Box<dyn Sleep>>) {
        tokio::time::timeout(Duration::from_secs(60), sleep)
            .await
            .expect("the sweeper ended the sleep");
    }

    /// Polls `sleep` once with the test task's waker.
    async fn poll_once(sleep: &mut Pin<Box<dyn Sleep>>) -> Poll<()> {
        std::future::poll_fn(|cx| Poll::Ready(sleep.as_mut().poll(cx))).await
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
        let timer = HeaderTimer::new(tick);
        tokio::spawn(timer.clone().sweep());
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
        let timer = HeaderTimer::new(Duration::from_millis(100));
        tokio::spawn(timer.clone().sweep());
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
    }

    /// A sleep whose deadline has passed ends at its first poll, without the sweeper.
    #[tokio::test(start_paused = true)]
    async fn a_past_deadline_ends_at_once_without_the_sweeper() {
        let timer = HeaderTimer::new(Duration::from_secs(1));
        let mut sleep = timer.sleep_until(timer.now());
        assert!(poll_once(&mut sleep).await.is_ready());
        assert_eq!(timer.pending(), 0);
    }
}
