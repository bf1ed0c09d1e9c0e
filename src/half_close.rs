//! Half-closed HTTP/1 clients, and request bodies left unread while they wait: one
//! rule, whatever the timing.
//!
//! A client may close its write side once its request is sent (RFC 9112 §9.6 allows
//! it), and tollgate cannot tell that from a client that left. hyper treats the end of
//! the client's stream as the client gone and drops the request. That is right while
//! the request waits (it leaves the queue, never sent, counted `cancelled`), and wrong
//! once it has gone upstream: it would be carried out and never answered.
//!
//! So the end of the client's stream is held back from hyper while a request of the
//! connection is out upstream ([`Sending`]), until its response has been written; then
//! hyper sees it and closes. A request is thus either never sent, or answered.
//!
//! A request body is not read before the proxy asks for it ([`Sending::hold`]): hyper
//! reads as much of a body as it can as soon as the head is in, and a request that
//! waits in its queue with its body unread (too big to keep for replay) would keep
//! those bytes in hyper's buffer, 8 KiB or more each, rather than in the kernel's.
//! While a body is held nothing is read from the connection, so hyper cannot see the
//! client leave; the stream watches for it instead (a reset, or the end of the
//! client's stream, which the kernel reports whatever is still unread before it) and
//! fails the connection then, which drops the waiting request.
//!
//! The same stream also bounds the other way a client can stall: one that reads
//! nothing while tollgate has bytes for it (a response it does not read) fails the
//! write after `body_idle_timeout`, so the connection closes and its request's permit
//! comes back. Nothing else would notice: hyper stops asking for the response body
//! while it cannot write.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http_body::Frame;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// The requests of one connection that are out upstream, the bodies not to be read
/// yet, and the reader waiting for either to be done with.
#[derive(Default)]
pub struct Sending(Mutex<State>);

#[derive(Default)]
struct State {
    /// Requests out upstream.
    out: usize,
    /// Request bodies nobody has asked for yet.
    held: usize,
    reader: Option<Waker>,
}

/// One request out upstream; dropped once its response has been written (it travels
/// with the response body).
pub struct Sent(Arc<Sending>);

/// One request body held unread; dropped when it is first read from, or dropped.
struct Hold(Arc<Sending>);

impl Sending {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Counts and a waker: valid after any panic of a holder.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request of the connection goes upstream.
    pub fn start(self: &Arc<Self>) -> Sent {
        self.lock().out += 1;
        Sent(self.clone())
    }

    /// `body`, whose bytes stay in the kernel until it is first read from (or dropped).
    /// Called as hyper hands the request over, before it would read the body.
    pub fn hold<B: http_body::Body>(self: &Arc<Self>, body: B) -> Unread<B> {
        let hold = (!body.is_end_stream()).then(|| {
            self.lock().held += 1;
            Hold(self.clone())
        });
        Unread { inner: body, hold }
    }

    /// Whether a body is held, the reader to be woken when none is.
    fn holding(&self, cx: &mut Context<'_>) -> bool {
        let mut state = self.lock();
        if state.held == 0 {
            return false;
        }
        state.reader = Some(cx.waker().clone());
        true
    }

    /// Whether a body is held while no request is out upstream: the request waits,
    /// and only a watch of the stream can tell that its client left.
    fn waiting_unread(&self) -> bool {
        let state = self.lock();
        state.held > 0 && state.out == 0
    }
}

/// Wakes the reader once neither count holds it back.
fn release(sending: &Sending, count: impl FnOnce(&mut State) -> &mut usize) {
    let mut state = sending.lock();
    let n = count(&mut state);
    *n -= 1;
    if *n == 0 {
        if let Some(waker) = state.reader.take() {
            waker.wake();
        }
    }
}

impl Drop for Sent {
    fn drop(&mut self) {
        release(&self.0, |state| &mut state.out);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        release(&self.0, |state| &mut state.held);
    }
}

pin_project_lite::pin_project! {
    /// A request body held unread ([`Sending::hold`]) until it is first read from.
    pub struct Unread<B> {
        #[pin]
        inner: B,
        hold: Option<Hold>,
    }
}

impl<B> Unread<B> {
    /// `body`, read as hyper reads it: a connection that holds nothing back.
    pub fn free(body: B) -> Unread<B> {
        Unread {
            inner: body,
            hold: None,
        }
    }
}

impl<B: http_body::Body<Data = Bytes>> http_body::Body for Unread<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        // Asked for: the connection may read it now.
        this.hold.take();
        this.inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A client connection's stream whose end is held back while [`Sending`] counts a
/// request out upstream, and which reads nothing while it holds a body.
pub struct HalfClose {
    inner: TcpStream,
    sending: Arc<Sending>,
    ended: bool,
    /// `body_idle_timeout`, for writes the client does not take.
    write_idle: Duration,
    /// Since when a write has waited for the client, as a timer (made the first time
    /// one waits).
    write_stalled: Option<Pin<Box<Sleep>>>,
    stalled: bool,
    /// How much the first read takes: the first head, when its length is known.
    first_read: Option<usize>,
    /// When to look again whether the client of a held body is gone (see
    /// [`HalfClose::poll_left`]); made only while one waits.
    look_again: Option<Pin<Box<Sleep>>>,
}

/// How often a request waiting with its body unread looks whether its client left.
const LOOK_AGAIN: Duration = Duration::from_secs(1);

impl HalfClose {
    /// `inner`, its end held back while `sending` counts a request, and a write that
    /// waits `write_idle` for the client failed.
    ///
    /// `first_head`, the length of the connection's first head when it is known, is
    /// all its first read takes: bytes of a body read with the head would stay in
    /// hyper's buffer, and keep the whole buffer allocated, for as long as the request
    /// waits with its body held.
    pub fn new(
        inner: TcpStream,
        sending: Arc<Sending>,
        write_idle: Duration,
        first_head: Option<usize>,
    ) -> HalfClose {
        HalfClose {
            inner,
            sending,
            ended: false,
            write_idle,
            write_stalled: None,
            stalled: false,
            first_read: first_head,
            look_again: None,
        }
    }

    /// After a write was polled: a wait for the client starts (or goes on) the timer;
    /// progress stops it; a wait of `write_idle` fails.
    fn watch_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = false;
            return polled;
        }
        if !self.stalled {
            self.stalled = true;
            let deadline = Instant::now() + self.write_idle;
            match &mut self.write_stalled {
                Some(sleep) => sleep.as_mut().reset(deadline),
                None => self.write_stalled = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        let sleep = self.write_stalled.as_mut().expect("armed above");
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing for body_idle_timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    /// The end, once no request is out upstream.
    fn end(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = self.sending.lock();
        if state.out == 0 {
            return Poll::Ready(Ok(()));
        }
        state.reader = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Whether the client left while its request waits with its body unread: a reset,
    /// or the end of its stream (the client gone, or half-closed, which is the same
    /// while the request waits), as the kernel reports them whatever is unread before
    /// them. Registers for a wake-up otherwise.
    fn poll_left(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        // Nothing to read: the next event wakes this task.
        if self.inner.poll_read_ready(cx).is_pending() {
            return Poll::Pending;
        }
        // Readable: the flags of the last event say whether the client is gone.
        match self.inner.ready(Interest::READABLE).now_or_never() {
            Some(Ok(ready)) if ready.is_read_closed() || ready.is_error() => {
                let reset = self.inner.take_error().ok().flatten();
                return Poll::Ready(reset.unwrap_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the client closed its connection while its request waited",
                    )
                }));
            }
            Some(Err(e)) => return Poll::Ready(e),
            _ => {}
        }
        // Bytes of the body wait unread, so the stream stays readable and no event
        // wakes anyone: look again later. (Only a read would let the next event wake
        // this task, and a read is what a held body must not have.)
        let sleep = self
            .look_again
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(LOOK_AGAIN)));
        while sleep.as_mut().poll(cx).is_ready() {
            let next = Instant::now() + LOOK_AGAIN;
            sleep.as_mut().reset(next);
        }
        Poll::Pending
    }
}

impl AsyncRead for HalfClose {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.ended {
            return this.end(cx);
        }
        if this.sending.holding(cx) {
            return Poll::Pending;
        }
        let (room, before) = (buf.remaining(), buf.filled().len());
        let polled = match this.first_read.filter(|&head| head < room) {
            Some(head) => {
                let mut first = ReadBuf::new(buf.initialize_unfilled_to(head));
                let polled = Pin::new(&mut this.inner).poll_read(cx, &mut first);
                let n = first.filled().len();
                buf.advance(n);
                polled
            }
            None => Pin::new(&mut this.inner).poll_read(cx, buf),
        };
        if polled.is_ready() {
            this.first_read = None;
        }
        match polled {
            Poll::Ready(Ok(())) if room > 0 && buf.filled().len() == before => {
                this.ended = true;
                this.end(cx)
            }
            other => other,
        }
    }
}

impl AsyncWrite for HalfClose {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.watch_write(cx, polled)
    }

    /// hyper flushes its connection each time its task wakes, whatever it waits for
    /// (also while a body it has read waits to be taken, when it reads nothing): the
    /// watch for a client that leaves while its body is held runs here, and a client
    /// gone fails the connection.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.sending.waiting_unread() {
            if let Poll::Ready(e) = this.poll_left(cx) {
                return Poll::Ready(Err(e));
            }
        } else {
            this.look_again = None;
        }
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.watch_write(cx, polled)
    }
}
