//! The one body type that flows from a client through the proxy to an upstream and
//! back.
//!
//! Request and response bodies stream: an `Incoming` body from hyper is boxed, not
//! collected, so a 200 MB upload or download passes with flat memory.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};
use tokio::time::Instant;

/// Any error a body can fail with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A streamed body of either direction.
pub type Body = BoxBody<Bytes, BoxError>;

/// Boxes any body whose error converts to [`BoxError`].
pub fn boxed<B>(body: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed()
}

/// A body holding these bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A body with nothing in it.
pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed()
}

/// A request body after [`read_up_to`].
pub enum Buffered {
    /// The whole body, in memory of its own (never a slice of hyper's read buffer,
    /// which a waiting request would otherwise keep allocated).
    Complete(Bytes),
    /// Too big: what was read, then the rest, still streaming.
    Streaming(Body),
}

/// Reads `body` into memory if it is at most `limit` bytes; otherwise gives back a body
/// that streams the part already read followed by the rest. Trailers of a buffered body
/// are dropped (hop-by-hop in practice: nothing tollgate forwards relies on them).
pub async fn read_up_to(mut body: Body, limit: u64) -> Result<Buffered, BoxError> {
    use futures_util::StreamExt;
    use http_body::Body as _;

    // Nearly every request has no body: no reading, no buffer.
    if body.is_end_stream() {
        return Ok(Buffered::Complete(Bytes::new()));
    }
    if body.size_hint().lower() > limit {
        return Ok(Buffered::Streaming(body));
    }
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        total += data.len() as u64;
        chunks.push(data);
        if total > limit {
            let read = futures_util::stream::iter(chunks.into_iter().map(|c| Ok(Frame::data(c))));
            let rest = http_body_util::BodyStream::new(body);
            return Ok(Buffered::Streaming(BodyExt::boxed(
                http_body_util::StreamBody::new(read.chain(rest)),
            )));
        }
    }
    Ok(Buffered::Complete(match chunks.len() {
        0 => Bytes::new(),
        1 => Bytes::copy_from_slice(&chunks[0]),
        _ => chunks.concat().into(),
    }))
}

pin_project_lite::pin_project! {
    /// A body that holds a value (a concurrency permit, a stream's place) until the body
    /// ends or fails, or is dropped, whichever comes first. Generic over the body it
    /// wraps, so that a body can be wrapped before it is boxed, and boxed once.
    pub struct Holding<T, B = Body> {
        #[pin]
        inner: B,
        held: Option<T>,
    }
}

impl<T, B: http_body::Body> Holding<T, B> {
    /// `inner`, holding `held` until it ends (an empty body lets go at once).
    pub fn new(inner: B, held: T) -> Self {
        let held = (!inner.is_end_stream()).then_some(held);
        Holding { inner, held }
    }
}

impl<T, B> http_body::Body for Holding<T, B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            this.held.take();
        }
        polled.map(|frame| frame.map(|result| result.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// When a body's reader last took a frame from it (or found its end), and whether it
/// waits for the body's writer now, shared between the body and whoever watches it:
/// `response_timeout` counts from there while the reader is not waiting.
#[derive(Debug, Clone)]
pub struct Progress(Arc<Mutex<(Instant, bool)>>);

impl Progress {
    /// Progress that starts now.
    pub fn now() -> Progress {
        Progress(Arc::new(Mutex::new((Instant::now(), false))))
    }

    /// The last time the body was read from, unless its reader waits for its writer
    /// now (`None`: a stalled client is `body_idle_timeout`'s business).
    pub fn last(&self) -> Option<Instant> {
        let (last, waiting) = *self.0.lock().unwrap_or_else(|p| p.into_inner());
        (!waiting).then_some(last)
    }

    /// `body`, noting here each time it is read from.
    pub fn track<B>(&self, body: B) -> Tracked<B> {
        Tracked {
            inner: body,
            progress: self.clone(),
        }
    }
}

pin_project_lite::pin_project! {
    /// A body whose reads are noted in a [`Progress`].
    pub struct Tracked<B> {
        #[pin]
        inner: B,
        progress: Progress,
    }
}

impl<B> http_body::Body for Tracked<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        *this.progress.0.lock().unwrap_or_else(|p| p.into_inner()) =
            (Instant::now(), polled.is_pending());
        polled.map(|frame| frame.map(|result| result.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A body that made no progress for its idle limit (`[proxy] body_idle_timeout`).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the body made no progress for {} (body_idle_timeout)", humantime::format_duration(*.0))]
pub struct BodyIdle(pub std::time::Duration);

pin_project_lite::pin_project! {
    /// A body that fails with [`BodyIdle`] once it has kept its reader waiting for
    /// `limit` without a frame. Only a wait counts: the time nobody asks for the next
    /// frame (the request queued, a reader that is slow itself) is not the body's.
    pub struct IdleLimit<B> {
        #[pin]
        inner: B,
        limit: std::time::Duration,
        // Since when the reader has waited, as a timer; boxed, and made only for a
        // body that ever keeps its reader waiting.
        waiting: Option<Pin<Box<tokio::time::Sleep>>>,
        stalled: bool,
    }
}

impl<B> IdleLimit<B> {
    /// `inner`, failing after `limit` without progress.
    pub fn new(inner: B, limit: std::time::Duration) -> Self {
        IdleLimit {
            inner,
            limit,
            waiting: None,
            stalled: false,
        }
    }
}

impl<B> http_body::Body for IdleLimit<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(frame) => {
                *this.stalled = false;
                Poll::Ready(frame.map(|result| result.map_err(Into::into)))
            }
            Poll::Pending => {
                if !*this.stalled {
                    *this.stalled = true;
                    let deadline = tokio::time::Instant::now() + *this.limit;
                    match this.waiting {
                        Some(sleep) => sleep.as_mut().reset(deadline),
                        None => *this.waiting = Some(Box::pin(tokio::time::sleep_until(deadline))),
                    }
                }
                let sleep = this.waiting.as_mut().expect("armed above");
                match std::future::Future::poll(sleep.as_mut(), cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(BodyIdle(*this.limit).into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// `body`, boxed, failing after `limit` without progress unless it is already empty.
pub fn idle_limited<B>(body: B, limit: std::time::Duration) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    if body.is_end_stream() {
        boxed(body)
    } else {
        IdleLimit::new(body, limit).boxed()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A body that sends one frame, then nothing until the channel closes.
    fn stalling() -> (tokio::sync::mpsc::Sender<Bytes>, Body) {
        let (send, recv) = tokio::sync::mpsc::channel::<Bytes>(1);
        let stream = futures_util::stream::unfold(recv, |mut recv| async move {
            recv.recv()
                .await
                .map(|b| (Ok::<_, BoxError>(Frame::data(b)), recv))
        });
        (send, boxed(http_body_util::StreamBody::new(stream)))
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_keeps_its_reader_waiting_fails_after_the_limit() {
        let (send, body) = stalling();
        let mut body = IdleLimit::new(body, Duration::from_secs(60));
        send.send(Bytes::from_static(b"a")).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        // Not read for an hour: not the body's fault.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        send.send(Bytes::from_static(b"b")).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        // Then it makes no progress while read: cut at 60 s, not before.
        let started = tokio::time::Instant::now();
        let err = body.frame().await.unwrap().unwrap_err();
        assert!(err.downcast_ref::<BodyIdle>().is_some(), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(60));
        drop(send);
    }

    #[tokio::test(start_paused = true)]
    async fn progress_restarts_the_clock() {
        let (send, body) = stalling();
        let mut body = IdleLimit::new(body, Duration::from_secs(60));
        let feeder = tokio::spawn(async move {
            for _ in 0..5 {
                tokio::time::sleep(Duration::from_secs(50)).await;
                send.send(Bytes::from_static(b"x")).await.unwrap();
            }
        });
        for _ in 0..5 {
            assert!(body.frame().await.unwrap().is_ok());
        }
        feeder.await.unwrap();
        assert!(body.frame().await.is_none());
    }
}
