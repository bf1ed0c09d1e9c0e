//! Which requests may be sent again after the upstream pushed back, the memory their
//! bodies may take, and the request kept for sending again ([`Replayable`]).
//!
//! A replay is safe when the upstream did not carry the request out. Any refusal
//! status may be replayed for an idempotent method (sending it twice does what
//! sending it once does); for the others (POST, PATCH, ...) only the statuses that
//! say the request was not processed: `429`, and `503` with `Retry-After` (a `503`
//! without it is never a push-back, see [`crate::pushback::judge`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode, Uri};
use prometheus_client::metrics::gauge::Gauge;

use crate::body::{self, Body, Buffered};
use crate::error::ProxyError;
use crate::metrics::Metrics;

/// Whether a request with `method` that got `status` (a push-back) may be sent again.
pub fn may_replay(method: &Method, status: StatusCode) -> bool {
    method.is_idempotent()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::SERVICE_UNAVAILABLE
}

/// The memory all bodies held for replay may take together (`[proxy] replay_memory`).
/// A request whose body does not fit is not read ahead: it streams to the upstream once
/// its turn comes, and cannot be replayed.
#[derive(Debug)]
pub struct ReplayMemory {
    limit: u64,
    used: AtomicU64,
    /// `used`, as `tollgate_replay_memory_bytes`.
    gauge: Gauge,
}

/// Bytes of [`ReplayMemory`] held by one body; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    memory: Arc<ReplayMemory>,
    bytes: u64,
}

impl ReplayMemory {
    /// A budget of `limit` bytes, its use shown in `metrics` when given.
    pub fn new(limit: u64, metrics: Option<&Metrics>) -> Arc<ReplayMemory> {
        let gauge = Gauge::default();
        if let Some(metrics) = metrics {
            metrics.register(|registry| {
                registry.register(
                    "tollgate_replay_memory_bytes",
                    "Request bodies held in memory for replay, in bytes ([proxy] replay_memory)",
                    gauge.clone(),
                );
            });
        }
        Arc::new(ReplayMemory {
            limit,
            used: AtomicU64::new(0),
            gauge,
        })
    }

    fn show(&self, used: u64) {
        self.gauge.set(i64::try_from(used).unwrap_or(i64::MAX));
    }

    /// `bytes` of the budget, if that much is free.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Option<Reservation> {
        let before = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .ok()?;
        self.show(before + bytes);
        Some(Reservation {
            memory: self.clone(),
            bytes,
        })
    }

    /// The bytes reserved now.
    #[cfg(test)]
    fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

impl Reservation {
    /// Keeps `bytes` of it (at most what it holds), giving the rest back: a body
    /// reserved for at its largest, once read.
    pub fn shrink_to(&mut self, bytes: u64) {
        let spare = self.bytes.saturating_sub(bytes);
        let before = self.memory.used.fetch_sub(spare, Ordering::AcqRel);
        self.memory.show(before - spare);
        self.bytes -= spare;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let before = self.memory.used.fetch_sub(self.bytes, Ordering::AcqRel);
        self.memory.show(before - self.bytes);
    }
}

/// A request that may have to be sent more than once.
pub enum Replayable {
    /// Its body is still to be read ([`Replayable::read_body`]).
    Unread(Option<Request<Body>>),
    /// The body is in memory: the request can be rebuilt for every attempt. The head is
    /// a copy of its own (see [`Replayable::new`]); the extensions go with the first
    /// attempt.
    Buffered {
        /// The request head.
        parts: http::request::Parts,
        /// The whole body.
        body: Bytes,
        /// The body's share of `replay_memory` (none for an empty body), held until the
        /// request is done with, and given back when dropped.
        _memory: Option<Reservation>,
    },
    /// The body streams: one attempt only (taken by the first).
    Once(Option<Request<Body>>),
}

impl Replayable {
    /// `req`, ready to be sent when it has no body (nearly every request), else to have
    /// its body read ([`Replayable::read_body`]).
    ///
    /// The head and body kept for the attempts are copies: hyper parses a request in
    /// place, its URI, header values and a small body being slices of the connection's
    /// read buffer, which a waiting request would otherwise keep allocated, so that
    /// hyper needs a second one to notice the client leave (a few KiB per waiting
    /// request on a kept-alive connection).
    pub fn new(req: Request<Body>) -> Replayable {
        if !http_body::Body::is_end_stream(req.body()) {
            return Replayable::Unread(Some(req));
        }
        let (parts, _) = req.into_parts();
        Replayable::Buffered {
            parts: owned_head(parts),
            body: Bytes::new(),
            _memory: None,
        }
    }

    /// Reads the body into memory if it is at most `limit` bytes and fits in `memory`
    /// (reserved at its largest: its length, else `limit`); otherwise it will stream
    /// through once. Reading it before the wait also lets hyper notice a client that
    /// leaves while its request waits (it only looks once the request body has been
    /// read), so the request is never sent.
    pub async fn read_body(
        &mut self,
        limit: u64,
        memory: &Arc<ReplayMemory>,
    ) -> Result<(), ProxyError> {
        let Replayable::Unread(req) = self else {
            return Ok(());
        };
        let hint = http_body::Body::size_hint(req.as_ref().expect("read once").body());
        let largest = hint.upper().unwrap_or(limit).min(limit);
        let reserved = match hint.lower() <= limit {
            true => memory.reserve(largest),
            false => None,
        };
        let Some(mut reserved) = reserved else {
            // Too big to replay, or no room: not read ahead at all. Its head is a copy,
            // as a buffered one's, so that it keeps no buffer of hyper's while it waits.
            let (parts, body) = req.take().expect("read once").into_parts();
            *self = Replayable::Once(Some(Request::from_parts(owned_head(parts), body)));
            return Ok(());
        };
        let (parts, body) = req.take().expect("read once").into_parts();
        // Boxed: few requests have a body, and this state would size every one's future.
        let read = Box::pin(body::read_up_to(body, limit));
        let read = read.await.map_err(|e| ProxyError::request_body(&e))?;
        *self = match read {
            Buffered::Complete(bytes) => {
                reserved.shrink_to(bytes.len() as u64);
                Replayable::Buffered {
                    parts: owned_head(parts),
                    body: bytes,
                    _memory: Some(reserved),
                }
            }
            // The part already read stays in memory until it has streamed: so does
            // its share of the budget.
            Buffered::Streaming(body) => {
                let body = body::boxed(body::Holding::new(body, reserved));
                Replayable::Once(Some(Request::from_parts(parts, body)))
            }
        };
        Ok(())
    }

    /// The request's URI and headers, and its body when it is in memory: what an
    /// estimate of its tokens reads.
    pub fn peek(&self) -> Option<(&http::Uri, &http::HeaderMap, Option<&Bytes>)> {
        match self {
            Replayable::Buffered { parts, body, .. } => {
                Some((&parts.uri, &parts.headers, Some(body)))
            }
            Replayable::Once(Some(req)) | Replayable::Unread(Some(req)) => {
                Some((req.uri(), req.headers(), None))
            }
            Replayable::Once(None) | Replayable::Unread(None) => None,
        }
    }

    /// Whether the request can be sent again.
    pub fn can_replay(&self) -> bool {
        matches!(self, Replayable::Buffered { .. })
    }

    /// The request for attempt `attempt` (0 for the first).
    pub fn attempt(&mut self, attempt: u32) -> Request<Body> {
        match self {
            Replayable::Buffered { parts, body, .. } => {
                let body = if body.is_empty() {
                    body::empty()
                } else {
                    body::full(body.clone())
                };
                let mut req = Request::new(body);
                *req.method_mut() = parts.method.clone();
                *req.uri_mut() = parts.uri.clone();
                *req.version_mut() = parts.version;
                *req.headers_mut() = parts.headers.clone();
                if attempt == 0 {
                    *req.extensions_mut() = std::mem::take(&mut parts.extensions);
                }
                req
            }
            Replayable::Once(req) | Replayable::Unread(req) => {
                req.take().expect("a streamed request is sent once")
            }
        }
    }
}

/// `parts` with a URI and header values that share no memory with the buffer they were
/// parsed from, in a header map of their size: on a kept-alive connection hyper parses
/// a request into the map of the connection's previous response, whose room (a KiB or
/// more) a waiting request would otherwise keep.
fn owned_head(mut parts: http::request::Parts) -> http::request::Parts {
    if let Ok(uri) = Uri::try_from(parts.uri.to_string()) {
        parts.uri = uri;
    }
    let mut headers = HeaderMap::with_capacity(parts.headers.len());
    for (name, value) in &parts.headers {
        let copy = match HeaderValue::from_bytes(value.as_bytes()) {
            Ok(mut copy) => {
                copy.set_sensitive(value.is_sensitive());
                copy
            }
            Err(_) => value.clone(),
        };
        headers.append(name.clone(), copy);
    }
    parts.headers = headers;
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copied_head_keeps_every_value_in_order_in_a_map_of_its_size() {
        let mut headers = HeaderMap::with_capacity(64);
        headers.append("accept", HeaderValue::from_static("a"));
        headers.append("x-custom", HeaderValue::from_static("1"));
        headers.append("accept", HeaderValue::from_static("b"));
        let mut secret = HeaderValue::from_static("Basic c2VjcmV0");
        secret.set_sensitive(true);
        headers.append("proxy-authorization", secret);
        let (mut parts, ()) = Request::new(()).into_parts();
        let before: Vec<_> = headers
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        parts.headers = headers;
        let copied = owned_head(parts).headers;
        let after: Vec<_> = copied.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        assert_eq!(after, before);
        assert!(copied["proxy-authorization"].is_sensitive());
        assert!(copied.capacity() < 64, "{}", copied.capacity());
    }

    #[test]
    fn reservations_fit_the_budget_and_give_back() {
        let memory = ReplayMemory::new(100, None);
        let mut a = memory.reserve(60).expect("fits");
        assert!(memory.reserve(41).is_none());
        let b = memory.reserve(40).expect("fits exactly");
        assert_eq!((memory.used(), memory.gauge.get()), (100, 100));
        a.shrink_to(10);
        assert_eq!(memory.used(), 50);
        a.shrink_to(20); // never grows
        assert_eq!(memory.used(), 50);
        drop(b);
        drop(a);
        assert_eq!((memory.used(), memory.gauge.get()), (0, 0));
        assert!(memory.reserve(u64::MAX).is_none());
    }

    #[test]
    fn non_idempotent_requests_replay_only_when_not_processed() {
        let cases = [
            (Method::GET, 429, true),
            (Method::GET, 502, true),
            (Method::PUT, 500, true),
            (Method::DELETE, 408, true),
            (Method::POST, 429, true),
            (Method::POST, 503, true),
            (Method::POST, 500, false),
            (Method::POST, 502, false),
            (Method::PATCH, 408, false),
            (Method::PATCH, 429, true),
        ];
        for (method, status, replay) in cases {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(may_replay(&method, status), replay, "{method} {status}");
        }
    }
}
