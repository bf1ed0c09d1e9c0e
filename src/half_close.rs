//! Half-closed HTTP/1 clients: one rule, whatever the timing.
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

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The requests of one connection that are out upstream, and the reader waiting for
/// them to be answered.
#[derive(Default)]
pub struct Sending(Mutex<(usize, Option<Waker>)>);

/// One request out upstream; dropped once its response has been written (it travels
/// with the response body).
pub struct Sent(Arc<Sending>);

impl Sending {
    fn lock(&self) -> MutexGuard<'_, (usize, Option<Waker>)> {
        // A count and a waker: valid after any panic of a holder.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request of the connection goes upstream.
    pub fn start(self: &Arc<Self>) -> Sent {
        self.lock().0 += 1;
        Sent(self.clone())
    }
}

impl Drop for Sent {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.0 -= 1;
        if state.0 == 0 {
            if let Some(waker) = state.1.take() {
                waker.wake();
            }
        }
    }
}

/// A client connection's stream whose end is held back while [`Sending`] counts a
/// request out upstream.
pub struct HalfClose<I> {
    inner: I,
    sending: Arc<Sending>,
    ended: bool,
    /// `body_idle_timeout`, for writes the client does not take.
    write_idle: Duration,
    /// Since when a write has waited for the client, as a timer (made the first time
    /// one waits).
    write_stalled: Option<Pin<Box<Sleep>>>,
    stalled: bool,
}

impl<I> HalfClose<I> {
    /// `inner`, its end held back while `sending` counts a request, and a write that
    /// waits `write_idle` for the client failed.
    pub fn new(inner: I, sending: Arc<Sending>, write_idle: Duration) -> HalfClose<I> {
        HalfClose {
            inner,
            sending,
            ended: false,
            write_idle,
            write_stalled: None,
            stalled: false,
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
        if state.0 == 0 {
            return Poll::Ready(Ok(()));
        }
        state.1 = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for HalfClose<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.ended {
            return this.end(cx);
        }
        let (room, before) = (buf.remaining(), buf.filled().len());
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if room > 0 && buf.filled().len() == before => {
                this.ended = true;
                this.end(cx)
            }
            other => other,
        }
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for HalfClose<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.watch_write(cx, polled)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
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
