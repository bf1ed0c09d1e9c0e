//! The access log: one line per request, written once its response is complete.
//!
//! [`Record`] is what is known about a request; [`Logged`] wraps the response body,
//! counts the bytes the client is sent and writes the record when the body ends or is
//! dropped, so a client that leaves mid-body is seen (`complete=false`), and a request
//! has one line, never two. [`write`] writes it: `key=value` text, or JSON with
//! `--log-format json`, in batches to stderr.

use std::fmt;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Uri};
use http_body::{Body as _, Frame, SizeHint};

use crate::body::{Body, BoxError};

pub mod write;

/// Who wrote the response the client got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    /// The upstream (or, for a CONNECT, the tunnel that opened to it).
    Upstream,
    /// tollgate itself, with its `Proxy-Status` error type.
    Tollgate(&'static str),
    /// Nobody: the client left before its answer (status 499, as nginx logs it).
    ClientLeft,
}

impl fmt::Display for Answered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answered::Upstream => f.write_str("upstream"),
            Answered::Tollgate(error) => write!(f, "tollgate:{error}"),
            Answered::ClientLeft => f.write_str("client-left"),
        }
    }
}

/// The input and output tokens a request to an LLM API spent, set when its answer's
/// body ends (docs/tokens.md).
pub type Spent = std::sync::Arc<std::sync::OnceLock<(u32, u32)>>;

/// What the path of a request measured: its waits in the queue, its time upstream and
/// its replays.
#[derive(Debug, Clone, Default)]
pub struct Timing {
    /// Time spent waiting in the group's queue, over every attempt.
    pub wait: Duration,
    /// Time from sending upstream to the response head, over every attempt.
    pub upstream: Duration,
    /// Attempts sent again after a push-back.
    pub retries: u32,
    /// The tokens it spent, in a group that counts them.
    pub tokens: Option<Spent>,
}

/// One request, as its access-log line tells it.
#[derive(Debug, Clone)]
pub struct Record {
    /// The client's address.
    pub client: SocketAddr,
    /// The user `[access] users` authenticated, if any.
    pub user: Option<String>,
    /// The request method.
    pub method: Method,
    /// Where it went: see [`url`].
    pub url: String,
    /// The group whose budget it spent, once classified.
    pub group: Option<String>,
    /// The response status.
    pub status: u16,
    /// Who answered.
    pub answered: Answered,
    /// Waits and replays.
    pub timing: Timing,
    /// Body bytes sent to the client.
    pub bytes: u64,
    /// Whether the whole body was sent.
    pub complete: bool,
    /// For a CONNECT: `blind` (bytes relayed, what goes inside unseen) or
    /// `intercepted` (decrypted: each request inside has a line of its own).
    pub tunnel: Option<&'static str>,
}

impl Record {
    /// Logs the line ([`write`]).
    pub fn emit(&self) {
        write::emit(self);
    }

    /// The line as a `tracing` event, for a process that did not ask for
    /// [`write::to_stderr`].
    fn event(&self) {
        tracing::info!(
            target: "access",
            client = %self.client,
            user = %self.user.as_deref().unwrap_or("-"),
            method = %self.method,
            url = %self.url,
            group = %self.group.as_deref().unwrap_or("-"),
            status = self.status,
            answered = %self.answered,
            wait_ms = millis(self.timing.wait),
            upstream_ms = millis(self.timing.upstream),
            retries = self.timing.retries,
            bytes = self.bytes,
            complete = self.complete,
            tunnel = %self.tunnel.unwrap_or("-"),
            tokens_in = %Count(self.tokens().map(|t| t.0)),
            tokens_out = %Count(self.tokens().map(|t| t.1)),
        );
    }

    fn tokens(&self) -> Option<(u32, u32)> {
        self.timing.tokens.as_ref()?.get().copied()
    }
}

/// A count, or `-` for none.
struct Count(Option<u32>);

impl std::fmt::Display for Count {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("-"),
        }
    }
}

/// `scheme://authority/path` of `uri`, without its query string (which may carry
/// secrets: keys, tokens); a CONNECT's authority-form is kept as it is.
pub fn url(uri: &Uri) -> String {
    match (uri.scheme(), uri.authority()) {
        (Some(scheme), Some(authority)) => format!("{scheme}://{authority}{}", uri.path()),
        (None, Some(authority)) => authority.to_string(),
        _ => uri.path().to_string(),
    }
}

/// A duration in milliseconds, to a tenth.
pub fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 10_000.0).round() / 10.0
}

/// The `Server-Timing` header value telling the client how long it queued.
pub fn server_timing(wait: Duration) -> String {
    format!("tollgate;desc=\"queue\";dur={:.1}", millis(wait))
}

/// A response body that writes its request's [`Record`] when it ends or is dropped.
pub struct Logged {
    inner: Body,
    record: Option<Record>,
    sink: fn(&Record),
}

impl Logged {
    /// Wraps `inner`, to log `record` with the bytes sent.
    pub fn wrap(inner: Body, record: Record) -> Body {
        Logged::wrap_to(inner, record, Record::emit)
    }

    /// Wraps `inner`, to hand `record` to `sink` when done.
    pub fn wrap_to(inner: Body, record: Record, sink: fn(&Record)) -> Body {
        http_body_util::BodyExt::boxed(Logged {
            inner,
            record: Some(record),
            sink,
        })
    }

    fn finish(&mut self, complete: bool) {
        if let Some(mut record) = self.record.take() {
            record.complete = complete;
            (self.sink)(&record);
        }
    }
}

impl http_body::Body for Logged {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(record)) = (frame.data_ref(), self.record.as_mut()) {
                    record.bytes += data.len() as u64;
                }
                if self.inner.is_end_stream() {
                    self.finish(true);
                }
            }
            Poll::Ready(None) => self.finish(true),
            Poll::Ready(Some(Err(_))) => self.finish(false),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        // A body with nothing left (an empty one hyper never polls, a HEAD's) was sent.
        let complete = self.inner.is_end_stream();
        self.finish(complete);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_drops_the_query_string() {
        let cases = [
            (
                "http://example.com/a/b?key=secret",
                "http://example.com/a/b",
            ),
            (
                "https://api.example.com:8443/v1?x",
                "https://api.example.com:8443/v1",
            ),
            ("http://[::1]:80/", "http://[::1]:80/"),
            ("example.com:443", "example.com:443"),
            ("/relative/path?q=1", "/relative/path"),
            ("*", "*"),
        ];
        for (uri, want) in cases {
            assert_eq!(url(&uri.parse().unwrap()), want, "{uri}");
        }
    }

    #[test]
    fn millis_round_to_a_tenth() {
        let cases = [
            (Duration::ZERO, 0.0),
            (Duration::from_micros(1_249), 1.2),
            (Duration::from_micros(1_250), 1.3),
            (Duration::from_secs(40), 40_000.0),
        ];
        for (d, want) in cases {
            assert_eq!(millis(d), want, "{d:?}");
        }
    }

    #[test]
    fn answered_names_tollgate_errors() {
        assert_eq!(Answered::Upstream.to_string(), "upstream");
        assert_eq!(
            Answered::Tollgate("destination_not_found").to_string(),
            "tollgate:destination_not_found"
        );
    }

    #[test]
    fn server_timing_has_the_wait_in_milliseconds() {
        let cases = [
            (Duration::ZERO, "tollgate;desc=\"queue\";dur=0.0"),
            (
                Duration::from_micros(123_440),
                "tollgate;desc=\"queue\";dur=123.4",
            ),
        ];
        for (wait, want) in cases {
            assert_eq!(server_timing(wait), want);
        }
    }

    fn record() -> Record {
        Record {
            client: "127.0.0.1:5000".parse().unwrap(),
            user: None,
            method: Method::GET,
            url: "http://example.com/".into(),
            group: None,
            status: 200,
            answered: Answered::Upstream,
            timing: Timing::default(),
            bytes: 0,
            complete: false,
            tunnel: None,
        }
    }

    thread_local! {
        static SEEN: std::cell::RefCell<Vec<(u64, bool)>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    fn capture(record: &Record) {
        SEEN.with(|seen| seen.borrow_mut().push((record.bytes, record.complete)));
    }

    fn seen() -> Vec<(u64, bool)> {
        SEEN.with(|seen| std::mem::take(&mut *seen.borrow_mut()))
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_body_read_to_its_end_is_logged_once_complete() {
        use http_body_util::BodyExt;
        let body = Logged::wrap_to(crate::body::full("hello"), record(), capture);
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"hello");
        assert_eq!(seen(), [(5, true)]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_body_dropped_midway_is_logged_once_incomplete() {
        use http_body_util::BodyExt;
        let chunks = futures_util::stream::iter(
            [&b"abc"[..], b"defg"].map(|c| Ok::<_, BoxError>(Frame::data(Bytes::from(c)))),
        );
        let inner = crate::body::boxed(http_body_util::StreamBody::new(chunks));
        let mut body = Logged::wrap_to(inner, record(), capture);
        body.frame().await.unwrap().unwrap();
        drop(body);
        assert_eq!(seen(), [(3, false)]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_empty_body_never_polled_is_logged_complete() {
        drop(Logged::wrap_to(crate::body::empty(), record(), capture));
        assert_eq!(seen(), [(0, true)]);
    }
}
