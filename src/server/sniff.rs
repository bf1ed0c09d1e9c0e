//! What a new connection's first bytes say, read with a peek so that they stay in the
//! socket for hyper: the HTTP version, and for HTTP/1 the head of the first request when
//! it arrived whole (for [`super::early`]).

use std::mem::MaybeUninit;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method, Request, Uri, Version};
use tokio::io::ReadBuf;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The first bytes of an HTTP/2 connection with prior knowledge (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a connection's first bytes say about the HTTP version it speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sniffed {
    /// HTTP/1.x.
    Http1,
    /// HTTP/2 with prior knowledge.
    Http2,
    /// A proper beginning of the HTTP/2 preface: look again once more has arrived.
    NeedMore,
}

/// Decides the version from the bytes seen so far (not empty).
fn sniff(first: &[u8]) -> Sniffed {
    if first.starts_with(H2_PREFACE) {
        Sniffed::Http2
    } else if H2_PREFACE.starts_with(first) {
        Sniffed::NeedMore
    } else {
        Sniffed::Http1
    }
}

/// Looks for the rest of a partial HTTP/2 preface this many times, waiting twice as long
/// each time from [`FIRST_LOOK_AGAIN`] (≈ 300 ms in all), then lets HTTP/1 answer it. A
/// peek sees the same bytes until more arrive (or after the client has closed), so the
/// looks must be few and spaced: a client that sends "P" and stalls costs five timer
/// wake-ups, not a busy loop.
const LOOKS_AGAIN: u32 = 5;
const FIRST_LOOK_AGAIN: Duration = Duration::from_millis(10);

/// Peeks at the first bytes of `stream` (leaving them for hyper) until they tell the
/// HTTP version. `None` when the client closes, stays silent for `within`, or shutdown
/// begins first (`drain`: nothing was asked yet, so nothing is lost); a preface still
/// incomplete after a few looks is served as HTTP/1, which answers it with an error.
pub(super) async fn sniff_stream(
    stream: &TcpStream,
    within: Duration,
    drain: &CancellationToken,
) -> Option<Sniffed> {
    let give_up = Instant::now() + within;
    let mut first = [0u8; H2_PREFACE.len()];
    let mut wait = FIRST_LOOK_AGAIN;
    for _ in 0..=LOOKS_AGAIN {
        let seen = tokio::select! {
            peeked = tokio::time::timeout_at(give_up, stream.peek(&mut first)) => match peeked {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return None,
                Ok(Ok(seen)) => seen,
            },
            _ = drain.cancelled() => return None,
        };
        match sniff(&first[..seen]) {
            Sniffed::NeedMore => {
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
            decided => return Some(decided),
        }
    }
    Some(Sniffed::NeedMore)
}

/// The longest first-request head [`peek_head`] reads; a longer one is left to hyper.
const MAX_PEEKED_HEAD: usize = 8 * 1024;
/// The most header fields [`parse_head`] reads; more are left to hyper.
const MAX_PEEKED_FIELDS: usize = 64;

/// The head of the first request on an HTTP/1 connection, read with a peek: the bytes
/// stay in the socket, and hyper parses them again when it serves the connection.
/// `None` when the head has not all arrived yet, is longer than [`MAX_PEEKED_HEAD`], or
/// is malformed (hyper answers that one).
///
/// It does not wait: the version peek has just seen the first bytes, and a client
/// sends a small head in one piece; one that trickles in is simply left to hyper.
pub(super) fn peek_head(stream: &TcpStream) -> Option<Request<()>> {
    let mut bytes = [MaybeUninit::<u8>::uninit(); MAX_PEEKED_HEAD];
    let mut buf = ReadBuf::uninit(&mut bytes);
    // A peek that would block registers this waker in place of nobody's; hyper's own
    // read registers its waker later.
    let mut cx = Context::from_waker(Waker::noop());
    match stream.poll_peek(&mut cx, &mut buf) {
        Poll::Ready(Ok(seen)) if seen > 0 => parse_head(buf.filled()),
        _ => None,
    }
}

/// Parses a complete request head as hyper would (`None` if incomplete or invalid).
fn parse_head(bytes: &[u8]) -> Option<Request<()>> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_PEEKED_FIELDS];
    let mut head = httparse::Request::new(&mut fields);
    let httparse::Status::Complete(_) = head.parse(bytes).ok()? else {
        return None;
    };
    let version = match head.version? {
        0 => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut req = Request::builder()
        .method(Method::from_bytes(head.method?.as_bytes()).ok()?)
        .uri(Uri::try_from(head.path?).ok()?)
        .version(version)
        .body(())
        .ok()?;
    let headers = req.headers_mut();
    for field in head.headers.iter() {
        headers.append(
            HeaderName::from_bytes(field.name.as_bytes()).ok()?,
            HeaderValue::from_bytes(field.value).ok()?,
        );
    }
    Some(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffs_the_http2_preface_and_nothing_else() {
        assert_eq!(sniff(H2_PREFACE), Sniffed::Http2);
        assert_eq!(
            sniff(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0"),
            Sniffed::Http2
        );
        assert_eq!(sniff(b"PRI * HTTP/2"), Sniffed::NeedMore);
        assert_eq!(sniff(b"P"), Sniffed::NeedMore);
        assert_eq!(sniff(b"GET / HTTP/1.1\r\n"), Sniffed::Http1);
        assert_eq!(sniff(b"CONNECT a:443 HTTP/1.1\r\n"), Sniffed::Http1);
        assert_eq!(sniff(b"PRI * HTTP/1.1\r\n"), Sniffed::Http1);
    }

    #[test]
    fn reads_a_whole_head_as_hyper_will() {
        let req = parse_head(
            b"GET http://api.example:8080/v1?q=1 HTTP/1.1\r\nHost: api.example:8080\r\n\
              X-Two: a\r\nx-two: b\r\n\r\nbody bytes after the head",
        )
        .unwrap();
        assert_eq!(req.method(), Method::GET);
        assert_eq!(req.uri(), "http://api.example:8080/v1?q=1");
        assert_eq!(req.version(), Version::HTTP_11);
        assert_eq!(req.headers()["host"], "api.example:8080");
        let two: Vec<_> = req.headers().get_all("x-two").iter().collect();
        assert_eq!(two, ["a", "b"]);

        let old = parse_head(b"POST /x HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!(
            (old.method(), old.version()),
            (&Method::POST, Version::HTTP_10)
        );
        let connect = parse_head(b"CONNECT a.example:443 HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(connect.uri().authority().unwrap(), "a.example:443");
    }

    #[test]
    fn leaves_a_partial_or_bad_head_to_hyper() {
        assert!(parse_head(b"GET / HTTP/1.1\r\nHost: a\r\n").is_none());
        assert!(parse_head(b"GET / HTTP/1.1\r\nHost: a\r\n\r").is_none());
        assert!(parse_head(b"GET /\x01 HTTP/1.1\r\n\r\n").is_none());
        assert!(parse_head(b"NOT HTTP AT ALL\r\n\r\n").is_none());
        let many: String = (0..MAX_PEEKED_FIELDS + 1)
            .map(|i| format!("x-{i}: v\r\n"))
            .collect();
        assert!(parse_head(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes()).is_none());
    }
}
