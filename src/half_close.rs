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

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

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
}

impl<I> HalfClose<I> {
    /// `inner`, its end held back while `sending` counts a request.
    pub fn new(inner: I, sending: Arc<Sending>) -> HalfClose<I> {
        HalfClose {
            inner,
            sending,
            ended: false,
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
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
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
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }
}
