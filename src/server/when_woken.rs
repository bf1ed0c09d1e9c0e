//! A future polled only when its own wake-up came, not at every wake-up of its task.
//!
//! A client connection's task waits for two things at once: hyper's connection, and the
//! shutdown signal that tells it to finish. `select!` polls both whenever the task wakes,
//! and the task wakes twice per request for the connection alone. Polling a
//! `CancellationToken`'s future that is not ready locks its `Notify` to refresh the
//! stored waker, for a signal that comes once in the process's life. Gated by this
//! wrapper, a forwarded request costs 330 fewer instructions of 32.8k (callgrind,
//! BENCHMARKS.md "Ninth session").
//!
//! [`WhenWoken`] gives the inner future a waker of its own: it records that the inner
//! future asked to be polled, then wakes the task. A poll that finds no such record
//! returns `Pending` without touching the inner future. The task's waker is registered
//! on every poll, before the record is looked at, so a wake-up from any thread reaches
//! the task whatever the order of the two (an `AtomicWaker` hand-over: two
//! compare-and-swaps, no lock).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

pin_project_lite::pin_project! {
    /// `inner`, polled only when it has been woken (see the module documentation).
    pub struct WhenWoken<F> {
        #[pin]
        inner: F,
        signal: Arc<Signal>,
        // The inner future's waker, made once.
        waker: Waker,
    }
}

/// What the inner future's waker does: note the wake-up, then wake the task.
struct Signal {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Stored before the wake: the poll it causes must see it.
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<F: Future> WhenWoken<F> {
    /// Wraps `inner`.
    pub fn new(inner: F) -> Self {
        let signal = Arc::new(Signal {
            // Set: the first poll polls the inner future, which registers its waker.
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        WhenWoken {
            inner,
            waker: Waker::from(signal.clone()),
            signal,
        }
    }
}

impl<F: Future> Future for WhenWoken<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        // First, so that a wake-up after the look below finds this task's waker.
        this.signal.task.register(cx.waker());
        // Taken: the wake-up it records is served now. One that lands between the
        // register above and here is served too; one after it wakes the task again.
        if !this.signal.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        this.inner.poll(&mut Context::from_waker(this.waker))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    /// A future that counts its polls and is ready once `ready` is set; its waker is
    /// kept so the test can wake it. Clones share their counters: the test keeps one
    /// and wraps another.
    #[derive(Clone, Default)]
    struct Probe {
        polls: Arc<AtomicUsize>,
        ready: Arc<AtomicBool>,
        waker: Arc<Mutex<Option<Waker>>>,
    }

    impl Probe {
        fn polls(&self) -> usize {
            self.polls.load(Ordering::SeqCst)
        }

        /// Wakes the wrapped future, as its event would; `ready` first if it is one.
        fn wake(&self, ready: bool) {
            self.ready.store(ready, Ordering::SeqCst);
            self.waker.lock().unwrap().take().unwrap().wake();
        }
    }

    impl Future for Probe {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            if self.ready.load(Ordering::SeqCst) {
                return Poll::Ready(());
            }
            *self.waker.lock().unwrap() = Some(cx.waker().clone());
            Poll::Pending
        }
    }

    /// A task waker that counts its wake-ups.
    #[derive(Default)]
    struct Task(AtomicUsize);
    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A task, and a waker for it.
    fn task() -> (Arc<Task>, Waker) {
        let task = Arc::new(Task::default());
        (task.clone(), Waker::from(task))
    }

    fn poll(future: &mut WhenWoken<Probe>, waker: &Waker) -> Poll<()> {
        Pin::new(future).poll(&mut Context::from_waker(waker))
    }

    #[test]
    fn the_inner_future_is_polled_first_and_then_only_after_its_own_wake() {
        let probe = Probe::default();
        let mut future = WhenWoken::new(probe.clone());
        let (task, waker) = task();

        assert!(poll(&mut future, &waker).is_pending());
        assert_eq!(probe.polls(), 1, "the first poll reaches it");
        // The task wakes for other reasons (its connection): the inner one is left be.
        for _ in 0..3 {
            assert!(poll(&mut future, &waker).is_pending());
        }
        assert_eq!(probe.polls(), 1);

        // Its own wake-up wakes the task and gets it polled once more.
        probe.wake(true);
        assert_eq!(task.0.load(Ordering::SeqCst), 1, "the task was woken");
        assert!(poll(&mut future, &waker).is_ready());
        assert_eq!(probe.polls(), 2);
    }

    #[test]
    fn a_wake_that_comes_after_a_served_one_still_reaches_the_task() {
        let probe = Probe::default();
        let mut future = WhenWoken::new(probe.clone());
        let (task, waker) = task();

        assert!(poll(&mut future, &waker).is_pending());
        // A spurious wake of the inner future: served, still pending.
        probe.wake(false);
        assert!(poll(&mut future, &waker).is_pending());
        assert_eq!(probe.polls(), 2);
        // The real one later must reach the task again (the `AtomicWaker` was emptied
        // by the first, and registered again by the poll that served it).
        probe.wake(true);
        assert_eq!(task.0.load(Ordering::SeqCst), 2);
        assert!(poll(&mut future, &waker).is_ready());
    }

    #[test]
    fn a_wake_reaches_the_task_that_polled_last() {
        let probe = Probe::default();
        let mut future = WhenWoken::new(probe.clone());
        let (first_task, first) = task();
        let (second_task, second) = task();

        assert!(poll(&mut future, &first).is_pending());
        // Moved to another task: not woken, so the inner future is left be...
        assert!(poll(&mut future, &second).is_pending());
        assert_eq!(probe.polls(), 1);
        // ...but its wake-up goes to the new task, not the old one.
        probe.wake(false);
        assert_eq!(second_task.0.load(Ordering::SeqCst), 1);
        assert_eq!(first_task.0.load(Ordering::SeqCst), 0);
    }
}
