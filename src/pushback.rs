//! Upstream push-back: a 429 (or 503 with `Retry-After`) pauses the whole group, and
//! the refused request is sent again for the client.
//!
//! The layer sits *outside* the throttle, so a retry goes through the throttle again:
//! back to the head of its group's queue ([`Exchange::retrying`]), behind the pause, and
//! within the `max_wait` counted from the client's first arrival.
//!
//! ```text
//! Pushback ─► Throttle ─► Dispatch ─► upstream
//!    ▲                                   │ 429 + Retry-After: 30
//!    └── pause the group 30 s, replay ◄──┘
//! ```
//!
//! A request can be replayed when its body was read whole (no body, or one of at most
//! `max_replay_body` bytes); a bigger body streams through once, and its 429 goes to the
//! client unchanged. So does the 429 of a request out of retries or out of time: apps
//! that handle 429 themselves still can.
//!
//! Responses that are not push-back are read too: `X-RateLimit-Remaining: 0` or
//! `RateLimit: ...;r=0` pause the group until the reset, before the upstream has to
//! refuse anything.

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use http::uri::{Authority, PathAndQuery};
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, Uri};
use tokio::time::Instant;
use tower::{Layer, Service};

use crate::body::{self, Body, Buffered};
use crate::config::GroupSettings;
use crate::error::ProxyError;
use crate::limit::layer::{Admission, Exchange, Routed};
use crate::limit::Group;
use crate::ratelimit_headers::{names_a_rate_limit, pause_hint};
use crate::retry_after::{backoff, retry_after};

/// What a response means for its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing to do.
    Pass,
    /// The budget is spent (rate-limit headers): pause, but this response is fine.
    Pause(Duration),
    /// The upstream refused the request: pause, and retry it if possible.
    PushBack(Duration),
}

/// Judges an upstream response. Pure: the time and the jitter come in as arguments.
///
/// `now` reads our wall clock at the response; it is called only for a response that
/// says when to come back or carries rate-limit headers (nearly every response has
/// neither, and the read was one of the nine clock reads of a forwarded request).
/// `pushbacks_in_row` counts the group's push-backs since its last normal answer, for the
/// fallback backoff; `jitter` is in `[0, 1)`.
pub fn judge(
    status: u16,
    headers: &HeaderMap,
    settings: &GroupSettings,
    now: impl Fn() -> SystemTime,
    pushbacks_in_row: u32,
    jitter: f64,
) -> Verdict {
    let text = |name| headers.get(name).and_then(|v| v.to_str().ok());
    let max = settings.max_pause;
    // Epoch resets are read against the upstream's own clock when it says what it is:
    // `pause_hint` reads `Date` itself and falls back to `now`.
    let hint = if names_a_rate_limit(headers) {
        pause_hint(headers, now(), max)
    } else {
        None
    };
    if settings.retry_statuses.contains(&status) {
        let fallback = || backoff(pushbacks_in_row, max, jitter);
        match text(header::RETRY_AFTER) {
            Some(value) => {
                let pause = retry_after(value, text(header::DATE), now(), max);
                return Verdict::PushBack(pause.unwrap_or_else(fallback));
            }
            // A 503 that does not say when to come back is an outage, not a limit.
            None if status == 503 => {}
            None => return Verdict::PushBack(hint.unwrap_or_else(fallback)),
        }
    }
    match hint {
        Some(pause) if !pause.is_zero() => Verdict::Pause(pause),
        _ => Verdict::Pass,
    }
}

/// Adds push-back handling in front of the throttle.
#[derive(Debug, Clone, Default)]
pub struct PushbackLayer;

impl<S> Layer<S> for PushbackLayer {
    type Service = Pushback<S>;

    fn layer(&self, inner: S) -> Pushback<S> {
        Pushback { inner }
    }
}

/// The push-back service (see the module documentation).
#[derive(Debug, Clone)]
pub struct Pushback<S> {
    inner: S,
}

impl<S> Service<Exchange> for Pushback<S>
where
    S: Service<Exchange, Response = Response<Body>, Error = ProxyError> + Clone + Send + 'static,
    S::Future: Unpin,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = Pushing<S>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut exchange: Exchange) -> Pushing<S> {
        let mut inner = self.inner.clone();
        if exchange.req.method() == Method::CONNECT {
            // A tunnel has no HTTP answer to read.
            if exchange.early.is_none() && worth_detaching(&exchange.routed.group) {
                exchange.req = with_own_head(exchange.req);
            }
            let tunnel = inner.call(exchange);
            return Pushing::new(inner, None, Stage::Through(tunnel));
        }
        let Exchange {
            req, routed, early, ..
        } = exchange;
        let (parts, body) = req.into_parts();
        // Nearly every request has no body: nothing to read, and no future boxed to read it.
        if http_body::Body::is_end_stream(&body) {
            let request = Replayable::new(parts, Buffered::Complete(Bytes::new()), routed, early);
            return Pushing::new(inner, Some(request), Stage::Ready);
        }
        // Read before queueing: this also lets hyper notice a client that leaves while
        // its request waits (it only looks once the request body has been read), so the
        // request is never sent.
        let limit = routed.group.settings.max_replay_body;
        let read = async move {
            let body = body::read_up_to(body, limit).await.map_err(|e| {
                ProxyError::BadRequest(format!("reading the request body failed: {e}"))
            })?;
            Ok(Replayable::new(parts, body, routed, early))
        };
        Pushing::new(inner, None, Stage::Reading(Box::pin(read)))
    }
}

/// The future of a request through [`Pushback`]: it reads the request's body, sends
/// the request through the throttle, and sends it again as the upstream's answers say.
///
/// Written out as a state machine rather than an `async` block so that its type can be
/// named as the service's future and need not be boxed: it goes into the slot hyper
/// keeps for the future of a connection's current request, instead of into a fresh box
/// per request, and it is less than half the `async` block's size (312 bytes against
/// 696: the block held the exchange it captured beside the request it became). That
/// took ≈ 450 instructions and ≈ 25 L1 data misses off a forwarded request
/// (docs/performance-log.md, "Twentieth session").
pub struct Pushing<S: Service<Exchange>> {
    /// The throttle, called for each attempt.
    inner: S,
    /// The request, once its body has been read (`None` for a tunnel).
    request: Option<Replayable>,
    /// The attempt being made or about to be (0 for the first).
    attempt: u32,
    /// Where it is.
    stage: Stage<S::Future>,
}

/// The stages of a [`Pushing`] future, whose inner service's future is `F`.
enum Stage<F> {
    /// A CONNECT, through the throttle and to the tunnel as it is.
    Through(F),
    /// Reading the request body into memory (a request that has one).
    Reading(Pin<Box<dyn Future<Output = Result<Replayable, ProxyError>> + Send>>),
    /// Read: the next attempt goes out when next polled.
    Ready,
    /// Out through the throttle, waiting for the upstream's answer.
    Sending(F),
    /// Answered (or failed): not to be polled again.
    Done,
}

impl<S: Service<Exchange>> Pushing<S> {
    fn new(inner: S, request: Option<Replayable>, stage: Stage<S::Future>) -> Pushing<S> {
        Pushing {
            inner,
            request,
            attempt: 0,
            stage,
        }
    }
}

/// Nothing in a [`Pushing`] future is pinned in place: the inner future must be `Unpin`
/// to be polled, and the body's reading is boxed.
impl<S: Service<Exchange>> Unpin for Pushing<S> {}

impl<S> Future for Pushing<S>
where
    S: Service<Exchange, Response = Response<Body>, Error = ProxyError>,
    S::Future: Unpin,
{
    type Output = Result<Response<Body>, ProxyError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            match &mut this.stage {
                Stage::Through(tunnel) => return Pin::new(tunnel).poll(cx),
                Stage::Reading(read) => {
                    let read = ready!(read.as_mut().poll(cx));
                    // Done until the next stage is set (an error ends it here).
                    this.stage = Stage::Done;
                    this.request = Some(read?);
                    this.stage = Stage::Ready;
                }
                Stage::Ready => {
                    // Sent when first polled, not when the stack was called: hyper may
                    // drop a request's future unpolled (its client gone), and the
                    // throttle spends the group's budget when it is called.
                    let request = this.request.as_mut().expect("read before it is sent");
                    // A request that waited before hyper read it (`early`) leaves now;
                    // any other may join a queue, copied out of its connection's
                    // buffer if the queue is deep (a retry waits out the pause at the
                    // front of it).
                    if request.early.is_none() && worth_detaching(&request.routed.group) {
                        request.detach_from_connection();
                    }
                    let sent = this.inner.call(request.attempt(this.attempt));
                    this.stage = Stage::Sending(sent);
                }
                Stage::Sending(answer) => {
                    let answer = ready!(Pin::new(answer).poll(cx));
                    this.stage = Stage::Done;
                    let request = this.request.as_ref().expect("sent after it was read");
                    match after_answer(request, this.attempt, answer?) {
                        ControlFlow::Break(response) => return Poll::Ready(Ok(response)),
                        ControlFlow::Continue(()) => {
                            this.attempt += 1;
                            this.stage = Stage::Ready;
                        }
                    }
                }
                Stage::Done => panic!("a push-back future polled after it completed"),
            }
        }
    }
}

/// A request joining a queue of at least this many is copied out of its client
/// connection's read buffer first ([`Replayable::detach_from_connection`]).
///
/// Why not every request that waits: skipping the copy took a median 1.6k instructions off
/// a queued request with a `Host` header alone (≈ 4 %) and 3.1k with seven headers (≈ 6 %)
/// (callgrind, together with [`worth_detaching`]'s test replacing a dearer one, ≈ 0.15k of
/// that; docs/performance-log.md, "Thirteenth session"), and what the copy saves is memory,
/// which only counts when many wait: ≈ 4 KiB resident per waiting request on an HTTP/1
/// connection (of the 8 KiB buffer hyper must then allocate anew). A request that joins a
/// shorter queue keeps the buffer, so in each group at most this many waiting requests do
/// (≈ 0.5 MiB; the depth is read just before joining, so requests arriving together on
/// several threads can overshoot it by a few). A deep queue, the case the copy is for, is
/// copied as before.
const DETACH_BEHIND: usize = 128;

/// Whether a request about to queue in `group` should copy its head out of the client
/// connection's buffer first: when it would wait behind [`DETACH_BEHIND`] others or more.
fn worth_detaching(group: &Group) -> bool {
    group.queued_at_least(DETACH_BEHIND)
}

/// A request that may have to be sent more than once.
struct Replayable {
    /// Its head and body.
    message: Message,
    /// Its routing, for every attempt.
    routed: Arc<Routed>,
    /// Its early admission, for the first attempt.
    early: Option<Box<Admission>>,
}

/// The request's head and body, as [`body::read_up_to`] left them.
enum Message {
    /// The body is in memory: the request can be rebuilt for every attempt.
    Buffered(http::request::Parts, Bytes),
    /// The body streams: one attempt only (taken by the first).
    Once(Option<Request<Body>>),
}

impl Replayable {
    /// The request with `parts` for its head and `body` as [`body::read_up_to`] left it.
    fn new(
        parts: http::request::Parts,
        body: Buffered,
        routed: Arc<Routed>,
        early: Option<Box<Admission>>,
    ) -> Replayable {
        let message = match body {
            Buffered::Complete(bytes) => Message::Buffered(parts, bytes),
            Buffered::Streaming(body) => Message::Once(Some(Request::from_parts(parts, body))),
        };
        Replayable {
            message,
            routed,
            early,
        }
    }

    /// Copies the request's head, and a buffered body, out of the client connection's
    /// read buffer.
    ///
    /// hyper parses a request in place: the URI and every header value are slices of the
    /// connection's 8 KiB read buffer, and so is a small body. While any of them lives,
    /// hyper must allocate a second buffer for its next read, so a request waiting in a
    /// queue would hold two. Copying the few hundred bytes that matter lets the first one
    /// go: ≈ 8 KiB less allocated per waiting request, ≈ 4 KiB less resident
    /// (BENCHMARKS.md, "Queue memory"). A request that leaves at once, or waits in a short
    /// queue ([`DETACH_BEHIND`]), skips the copies. Copying twice is harmless: the second
    /// copy only copies the first.
    fn detach_from_connection(&mut self) {
        match &mut self.message {
            Message::Buffered(parts, bytes) => {
                own_head(parts);
                if !bytes.is_empty() {
                    *bytes = Bytes::copy_from_slice(bytes);
                }
            }
            Message::Once(req) => *req = req.take().map(with_own_head),
        }
    }

    /// Whether the request can be sent again.
    fn can_replay(&self) -> bool {
        matches!(self.message, Message::Buffered(..))
    }

    /// The request for attempt `attempt` (0 for the first).
    fn attempt(&mut self, attempt: u32) -> Exchange {
        let req = match &mut self.message {
            Message::Buffered(parts, bytes) => {
                // No body is the common case; an empty body needs no allocation.
                let body = if bytes.is_empty() {
                    body::empty()
                } else {
                    body::full(bytes.clone())
                };
                let mut req = Request::new(body);
                *req.method_mut() = parts.method.clone();
                *req.uri_mut() = parts.uri.clone();
                *req.version_mut() = parts.version;
                *req.headers_mut() = parts.headers.clone();
                if attempt == 0 {
                    // The first attempt sends the header map hyper parsed into and leaves
                    // the copy for replays: a clone has no spare room, and `Via`, then the
                    // response (hyper parses it into the map the request went out in),
                    // grew it twice per request (~1.1k instructions of realloc,
                    // callgrind). It takes the extensions too (hyper's; rarely any):
                    // nothing in them is read past the client connection, and a clone
                    // would allocate.
                    std::mem::swap(req.headers_mut(), &mut parts.headers);
                    *req.extensions_mut() = std::mem::take(&mut parts.extensions);
                }
                req
            }
            Message::Once(req) => req.take().expect("a streamed request is sent once"),
        };
        let mut exchange = Exchange::new(req, self.routed.clone(), self.early.take());
        exchange.retrying = attempt > 0;
        exchange
    }
}

/// Replaces the URI and header values of `parts` by copies that share no memory with
/// the buffer they were parsed from (see [`Replayable::detach_from_connection`]).
///
/// The copies are slices of one new buffer: one allocation per request instead of one
/// per value (an API call carries half a dozen headers or more).
fn own_head(parts: &mut http::request::Parts) {
    let uri = &parts.uri;
    let authority = uri.authority().map(Authority::as_str).unwrap_or("");
    let path = uri.path_and_query().map(PathAndQuery::as_str).unwrap_or("");
    let values: usize = parts.headers.values().map(HeaderValue::len).sum();
    let mut text = BytesMut::with_capacity(authority.len() + path.len() + values);
    text.extend_from_slice(authority.as_bytes());
    text.extend_from_slice(path.as_bytes());
    // `values_mut` here too, so that the slices below are cut in the order the values
    // were written, whatever order the map's iterators keep.
    for value in parts.headers.values_mut() {
        text.extend_from_slice(value.as_bytes());
    }
    let mut text = text.freeze();
    // Each part is parsed again from its copy; it was valid, so that cannot fail in
    // practice, and if it did the shared part would simply stay.
    let mut copy = http::uri::Parts::default();
    copy.scheme = uri.scheme().cloned();
    let authority_copy = text.split_to(authority.len());
    copy.authority = uri
        .authority()
        .map(|a| Authority::from_maybe_shared(authority_copy).unwrap_or_else(|_| a.clone()));
    let path_copy = text.split_to(path.len());
    copy.path_and_query = uri
        .path_and_query()
        .map(|p| PathAndQuery::from_maybe_shared(path_copy).unwrap_or_else(|_| p.clone()));
    // Built beside the original, which stays if this ever failed: no copy of it is
    // kept just in case.
    if let Ok(copy) = Uri::from_parts(copy) {
        parts.uri = copy;
    }
    for value in parts.headers.values_mut() {
        let bytes = text.split_to(value.len());
        if let Ok(mut copy) = HeaderValue::from_maybe_shared(bytes) {
            copy.set_sensitive(value.is_sensitive());
            *value = copy;
        }
    }
}

/// `req` with its head copied by [`own_head`].
fn with_own_head(req: Request<Body>) -> Request<Body> {
    let (mut parts, body) = req.into_parts();
    own_head(&mut parts);
    Request::from_parts(parts, body)
}

/// What the upstream's answer to attempt `attempt` of `request` means: the response
/// for the client (`Break`), or, when the upstream refused it and it can go again in
/// time, another attempt (`Continue`). The group is paused as the answer says either way.
fn after_answer(
    request: &Replayable,
    attempt: u32,
    response: Response<Body>,
) -> ControlFlow<Response<Body>> {
    let group = &request.routed.group;
    let settings = &group.settings;
    let status = response.status().as_u16();
    // Jitter only spreads the fallback backoff of a refusal; skip its hashing on every
    // other answer.
    let jitter = if settings.retry_statuses.contains(&status) {
        jitter()
    } else {
        0.0
    };
    let verdict = judge(
        status,
        response.headers(),
        settings,
        SystemTime::now,
        group.pushbacks_in_row(),
        jitter,
    );
    let pause = match verdict {
        Verdict::Pass => {
            group.calm();
            return ControlFlow::Break(response);
        }
        Verdict::Pause(pause) => {
            group.calm();
            group.pause_for(pause);
            record_pause(group, pause, "budget spent (rate-limit headers)");
            return ControlFlow::Break(response);
        }
        Verdict::PushBack(pause) => pause,
    };
    group.push_back(pause);
    record_pause(group, pause, "upstream pushed back");
    let in_time = Instant::now() + pause < request.routed.arrived + settings.max_wait;
    if request.can_replay() && attempt < settings.max_retries && in_time {
        group.metrics.retries.inc();
        tracing::debug!(group = %group.name, attempt = attempt + 1, "retrying after push-back");
        // Dropped here, before the retry queues: that frees its concurrency permit.
        drop(response);
        return ControlFlow::Continue(());
    }
    group.metrics.passed_through.inc();
    ControlFlow::Break(response)
}

fn record_pause(group: &Group, pause: Duration, why: &str) {
    group.metrics.pauses.inc();
    group.metrics.pause_seconds.observe(pause.as_secs_f64());
    tracing::info!(
        group = %group.name,
        pause = %humantime::format_duration(Duration::from_millis(pause.as_millis() as u64)),
        "pausing group: {why}"
    );
}

/// A number in `[0, 1)` for backoff jitter. The standard library's per-instance random
/// hash keys are plenty for spreading retries; no cryptographic quality is needed.
fn jitter() -> f64 {
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (header::HeaderName::from_static(k), v.parse().unwrap()))
            .collect()
    }

    #[test]
    fn own_head_copies_the_uri_and_header_values_out_of_the_parse_buffer() {
        // What hyper hands over: the URI and the values are slices of one read buffer.
        let buffer = Bytes::from_static(b"http://api.example:8080/v1/x?q=1 secret text/plain");
        let uri = Uri::from_maybe_shared(buffer.slice(0..32)).unwrap();
        let mut secret = HeaderValue::from_maybe_shared(buffer.slice(33..39)).unwrap();
        secret.set_sensitive(true);
        let accept = HeaderValue::from_maybe_shared(buffer.slice(40..)).unwrap();
        let (mut parts, ()) = Request::builder()
            .uri(uri)
            .header("authorization", secret)
            .header("accept", accept)
            .body(())
            .unwrap()
            .into_parts();

        own_head(&mut parts);

        let inside = |p: *const u8| buffer.as_ptr_range().contains(&p);
        assert_eq!(parts.uri, "http://api.example:8080/v1/x?q=1");
        assert!(!inside(parts.uri.authority().unwrap().as_str().as_ptr()));
        assert!(!inside(
            parts.uri.path_and_query().unwrap().as_str().as_ptr()
        ));
        let auth = &parts.headers["authorization"];
        assert_eq!(auth, "secret");
        assert!(auth.is_sensitive(), "the sensitive flag survives the copy");
        assert!(!inside(auth.as_bytes().as_ptr()));
        assert_eq!(parts.headers["accept"], "text/plain");
        assert!(!inside(parts.headers["accept"].as_bytes().as_ptr()));
    }

    #[test]
    fn own_head_keeps_every_value_in_place() {
        // Repeated names (the map's extra values), values of equal length that a shift
        // would swap, and the URI forms without an authority or without a path.
        let buffer = Bytes::from_static(
            b"/v1/x?q=1 api.example:443 aaaa bbbb cccc text/plain application/json",
        );
        let slice = |a: usize, b: usize| HeaderValue::from_maybe_shared(buffer.slice(a..b));
        for uri in [buffer.slice(0..9), buffer.slice(10..25)] {
            let connect = !uri.starts_with(b"/");
            let uri = Uri::from_maybe_shared(uri).unwrap();
            let mut builder = Request::builder().uri(uri.clone());
            if connect {
                builder = builder.method(Method::CONNECT);
            }
            let (mut parts, ()) = builder
                .header("x-a", slice(26, 30).unwrap())
                .header("accept", slice(41, 51).unwrap())
                .header("x-b", slice(31, 35).unwrap())
                .header("accept", slice(52, 68).unwrap())
                .header("x-a", slice(36, 40).unwrap())
                .body(())
                .unwrap()
                .into_parts();
            let listed = |headers: &HeaderMap| -> Vec<(String, String)> {
                headers
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
                    .collect()
            };
            let before = listed(&parts.headers);

            own_head(&mut parts);

            let inside = |p: *const u8| buffer.as_ptr_range().contains(&p);
            assert_eq!(parts.uri, uri);
            assert_eq!(parts.uri.path_and_query().is_none(), connect);
            if let Some(authority) = parts.uri.authority() {
                assert!(!inside(authority.as_str().as_ptr()));
            }
            if let Some(path) = parts.uri.path_and_query() {
                assert!(!inside(path.as_str().as_ptr()));
            }
            assert_eq!(listed(&parts.headers), before);
            assert!(parts
                .headers
                .values()
                .all(|v| !inside(v.as_bytes().as_ptr())));
        }
    }

    fn judged(status: u16, pairs: &[(&'static str, &str)]) -> Verdict {
        let now = httpdate::parse_http_date("Sun, 22 Nov 2026 10:00:00 GMT").unwrap();
        judge(
            status,
            &headers(pairs),
            &GroupSettings::default(),
            || now,
            0,
            0.5,
        )
    }

    #[test]
    fn ordinary_answers_pass() {
        assert_eq!(judged(200, &[]), Verdict::Pass);
        assert_eq!(judged(500, &[("retry-after", "5")]), Verdict::Pass);
    }

    /// The wall clock is read for a response that needs it, not for every response.
    #[test]
    fn the_clock_is_read_only_for_a_response_that_needs_it() {
        let settings = GroupSettings::default();
        let at = httpdate::parse_http_date("Sun, 22 Nov 2026 10:00:00 GMT").unwrap();
        let reads = std::cell::Cell::new(0);
        let now = || {
            reads.set(reads.get() + 1);
            at
        };
        let plain = headers(&[("content-type", "text/plain"), ("retry-after", "5")]);
        assert_eq!(judge(200, &plain, &settings, now, 0, 0.5), Verdict::Pass);
        assert_eq!(reads.get(), 0, "an ordinary answer reads no clock");
        let refused = headers(&[("retry-after", "5")]);
        let verdict = judge(429, &refused, &settings, now, 0, 0.5);
        assert_eq!(verdict, Verdict::PushBack(Duration::from_secs(5)));
        assert_eq!(reads.get(), 1, "a Retry-After is read against the clock");
        let spent = headers(&[("ratelimit", r#""default";r=0;t=30"#)]);
        let verdict = judge(200, &spent, &settings, now, 0, 0.5);
        assert_eq!(verdict, Verdict::Pause(Duration::from_secs(30)));
        assert_eq!(reads.get(), 2, "so is a rate-limit header");
    }

    #[test]
    fn a_429_pushes_back_for_retry_after() {
        let v = judged(429, &[("retry-after", "7")]);
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(7)));
    }

    #[test]
    fn a_date_is_read_against_the_upstreams_own_date() {
        // The upstream's clock is an hour ahead of ours: what counts is its 20 s.
        let v = judged(
            429,
            &[
                ("retry-after", "Sun, 22 Nov 2026 11:00:20 GMT"),
                ("date", "Sun, 22 Nov 2026 11:00:00 GMT"),
            ],
        );
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(20)));
    }

    #[test]
    fn a_503_without_retry_after_is_an_outage_not_a_limit() {
        assert_eq!(judged(503, &[]), Verdict::Pass);
        let v = judged(503, &[("retry-after", "3")]);
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(3)));
    }

    #[test]
    fn garbage_falls_back_to_backoff() {
        match judged(429, &[("retry-after", "soon")]) {
            Verdict::PushBack(d) => assert!(d <= Duration::from_secs(1), "{d:?}"),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn a_429_without_retry_after_uses_the_rate_limit_reset() {
        let v = judged(
            429,
            &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "12")],
        );
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(12)));
    }

    #[test]
    fn a_spent_budget_pauses_before_any_429() {
        let v = judged(
            200,
            &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "12")],
        );
        assert_eq!(v, Verdict::Pause(Duration::from_secs(12)));
        let v = judged(200, &[("ratelimit", "\"default\";r=0;t=4")]);
        assert_eq!(v, Verdict::Pause(Duration::from_secs(4)));
        assert_eq!(
            judged(200, &[("x-ratelimit-remaining", "3")]),
            Verdict::Pass
        );
    }

    #[test]
    fn pauses_are_capped() {
        let v = judged(429, &[("retry-after", "99999999")]);
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(600)));
    }

    #[test]
    fn statuses_are_configurable() {
        let settings = GroupSettings {
            retry_statuses: vec![429],
            ..GroupSettings::default()
        };
        let v = judge(
            503,
            &headers(&[("retry-after", "3")]),
            &settings,
            SystemTime::now,
            0,
            0.0,
        );
        assert_eq!(v, Verdict::Pass);
    }

    #[test]
    fn jitter_is_in_range() {
        for _ in 0..1000 {
            let j = jitter();
            assert!((0.0..1.0).contains(&j));
        }
    }
}
