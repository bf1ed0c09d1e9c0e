//! Inner work polled only when its own wake-up came, not at every wake-up of its task.
//!
//! A task that waits for several things at once polls all of them whenever it wakes,
//! and most of those polls find nothing new. Two are worth skipping:
//!
//! * [`WhenWoken`]: a client connection's task waits for hyper's connection and for the
//!   shutdown signal. Polling a `CancellationToken`'s future that is not ready locks its
//!   `Notify` to refresh the stored waker, twice per request, for a signal that comes once
//!   in the process's life. Gated, a forwarded request costs 330 fewer instructions of
//!   32.8k (callgrind, docs/performance-log.md "Ninth session").
//! * [`ReadsWhenWoken`]: hyper's client connection tries a read from its upstream whenever
//!   its task is polled (a request to send, the response body asking for more), about six
//!   times per request, most of which find nothing. Over plain TCP such a try is a
//!   readiness check; over TLS each goes through tokio-rustls and rustls (a read into the
//!   record buffer, a `WouldBlock` error made and matched), ≈ 380 instructions. Gated,
//!   tokio-rustls's reads per request fell from 7 to 3 and a TLS-routed request cost 1.4k
//!   fewer instructions of 39k (callgrind, docs/performance-log.md "Tenth session").
//!
//! The inner work gets a waker of its own (`Gate`, crate-private): it records that the
//! inner work asked to be polled, then wakes the task. A poll that finds no such record
//! returns `Pending` without touching the inner work. The task's waker is registered on
//! every poll, before the record is looked at, so a wake-up from any thread reaches the
//! task whatever the order of the two (an `AtomicWaker` hand-over: two
//! compare-and-swaps, no lock).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection};

/// The record of whether the inner work asked to be polled, and the waker it is given.
pub(crate) struct Gate {
    // Shared with the waker below, which may fire on any thread.
    signal: Arc<Signal>,
    // The inner work's waker, made once.
    waker: Waker,
}

/// What the inner work's waker does: note the wake-up, then wake the task.
struct Signal {
    // Whether the inner work was woken since it was last let through.
    woken: AtomicBool,
    // The task that polled last, to wake in its turn.
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

impl Gate {
    /// A gate that lets the first poll through (the inner work has not asked for
    /// anything yet, so nothing else would).
    pub(crate) fn new() -> Gate {
        let signal = Arc::new(Signal {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        Gate {
            waker: Waker::from(signal.clone()),
            signal,
        }
    }

    /// The waker to poll the inner work with, if it has been woken since it was last
    /// let through; `None`: leave it be, this task will be woken when it is.
    pub(crate) fn open(&self, cx: &Context<'_>) -> Option<&Waker> {
        // First, so that a wake-up after the look below finds this task's waker.
        self.signal.task.register(cx.waker());
        // Taken: the wake-up it records is served now. One that lands between the
        // register above and here is served too; one after it wakes the task again.
        self.signal
            .woken
            .swap(false, Ordering::AcqRel)
            .then_some(&self.waker)
    }

    /// Lets the next poll through: the inner work answered without waiting, so it has
    /// registered no waker and nothing would wake it.
    pub(crate) fn leave_open(&self) {
        self.signal.woken.store(true, Ordering::Relaxed);
    }
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

pin_project_lite::pin_project! {
    /// `inner`, polled only when it has been woken (see the module documentation).
    pub struct WhenWoken<F> {
        #[pin]
        inner: F,
        // When `inner` may be polled.
        gate: Gate,
    }
}

impl<F: Future> WhenWoken<F> {
    /// Wraps `inner`.
    pub fn new(inner: F) -> Self {
        WhenWoken {
            inner,
            gate: Gate::new(),
        }
    }
}

impl<F: Future> Future for WhenWoken<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        match this.gate.open(cx) {
            Some(waker) => this.inner.poll(&mut Context::from_waker(waker)),
            None => Poll::Pending,
        }
    }
}

pin_project_lite::pin_project! {
    /// `inner`, where a read after one that found nothing is attempted only once the
    /// stream has woken it (see the module documentation); writes pass straight
    /// through. Ungated, it is `inner` as it is.
    pub struct ReadsWhenWoken<T> {
        #[pin]
        inner: T,
        // When a read may reach `inner`; `None`: always.
        gate: Option<Gate>,
    }
}

impl<T> ReadsWhenWoken<T> {
    /// Wraps `inner`, its reads gated when `gated`.
    pub fn new(inner: T, gated: bool) -> Self {
        ReadsWhenWoken {
            inner,
            gate: gated.then(Gate::new),
        }
    }
}

impl<T: Read> Read for ReadsWhenWoken<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let Some(gate) = this.gate else {
            return this.inner.poll_read(cx, buf);
        };
        let Some(waker) = gate.open(cx) else {
            return Poll::Pending;
        };
        let read = this.inner.poll_read(&mut Context::from_waker(waker), buf);
        // A read that waits has registered the gate's waker with whatever it waits on
        // (the socket), or has woken it already (tokio-rustls when rustls has nothing to
        // give, tokio's budget once the task yields); one that did not wait registered
        // nothing, and the next read must go through.
        if read.is_ready() {
            gate.leave_open();
        }
        read
    }
}

impl<T: Write> Write for ReadsWhenWoken<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().inner.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.project().inner.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

/// What the pool asks of an upstream connection's stream (whether it negotiated h2).
impl<T: Connection> Connection for ReadsWhenWoken<T> {
    fn connected(&self) -> Connected {
        self.inner.connected()
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

    /// A stream whose reads count themselves and find nothing until `data` is set; the
    /// waker of the last read that found nothing is kept so the test can wake it, as
    /// the socket would.
    #[derive(Default)]
    struct Socket {
        reads: usize,
        data: Option<&'static [u8]>,
        waker: Option<Waker>,
        /// Wakes its reader before answering `Pending`, as tokio-rustls does when rustls
        /// has nothing to give and the socket did not block.
        wakes_at_once: bool,
    }

    impl Read for Socket {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            mut buf: ReadBufCursor<'_>,
        ) -> Poll<io::Result<()>> {
            self.reads += 1;
            match self.data.take() {
                Some(data) => {
                    buf.put_slice(data);
                    Poll::Ready(Ok(()))
                }
                None if self.wakes_at_once => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                None => {
                    self.waker = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        }
    }

    /// Reads from `stream` with `waker`: `Some(bytes)` when it answered.
    fn read(stream: &mut ReadsWhenWoken<Socket>, waker: &Waker) -> Option<Vec<u8>> {
        let mut space = [0u8; 16];
        let mut buf = hyper::rt::ReadBuf::new(&mut space);
        match Pin::new(stream).poll_read(&mut Context::from_waker(waker), buf.unfilled()) {
            Poll::Ready(result) => {
                result.unwrap();
                Some(buf.filled().to_vec())
            }
            Poll::Pending => None,
        }
    }

    #[test]
    fn a_read_that_found_nothing_is_tried_again_only_after_the_stream_woke_it() {
        let mut stream = ReadsWhenWoken::new(Socket::default(), true);
        let (task, waker) = task();

        assert_eq!(read(&mut stream, &waker), None);
        assert_eq!(stream.inner.reads, 1, "the first read reaches the stream");
        // The task is polled for other reasons (a request to send): no read attempt.
        for _ in 0..3 {
            assert_eq!(read(&mut stream, &waker), None);
        }
        assert_eq!(stream.inner.reads, 1);

        // Bytes arrive: the stream wakes its reader, which wakes the task.
        stream.inner.data = Some(b"HTTP/1.1 200 OK");
        stream.inner.waker.take().unwrap().wake();
        assert_eq!(task.0.load(Ordering::SeqCst), 1, "the task was woken");
        assert_eq!(
            read(&mut stream, &waker).as_deref(),
            Some(&b"HTTP/1.1 200 OK"[..])
        );
        // A read that answered registered nothing: the next one goes through.
        assert_eq!(read(&mut stream, &waker), None);
        assert_eq!(stream.inner.reads, 3);
    }

    #[test]
    fn a_read_that_woke_itself_goes_through_next_time() {
        let socket = Socket {
            wakes_at_once: true,
            ..Socket::default()
        };
        let mut stream = ReadsWhenWoken::new(socket, true);
        let (task, waker) = task();
        for reads in 1..=3 {
            assert_eq!(read(&mut stream, &waker), None);
            assert_eq!(stream.inner.reads, reads);
            assert_eq!(task.0.load(Ordering::SeqCst), reads, "the task was woken");
        }
    }

    #[test]
    fn ungated_every_read_reaches_the_stream() {
        let mut stream = ReadsWhenWoken::new(Socket::default(), false);
        let (_, waker) = task();
        for _ in 0..3 {
            assert_eq!(read(&mut stream, &waker), None);
        }
        assert_eq!(stream.inner.reads, 3);
    }
}
