//! The one body type that flows through the service stack.
//!
//! Request and response bodies stream: an `Incoming` body from hyper is boxed, not
//! collected, so a 200 MB upload or download passes with flat memory.

use bytes::Bytes;
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
    Full::new(bytes.into()).map_err(|never| match never {}).boxed()
}

/// A body with nothing in it.
pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed()
}
