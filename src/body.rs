//! The one body type that flows through the service stack.
//!
//! Request and response bodies stream: an `Incoming` body from hyper is boxed, not
//! collected, so a 200 MB upload or download passes with flat memory.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};

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
    /// The whole body, in memory.
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
        1 => chunks.pop().expect("one chunk"),
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
