//! What a new connection's first bytes say, read with a peek so that they stay in the
//! socket for hyper: the HTTP version, and for HTTP/1 the head of the first request when
//! it has arrived whole (for [`super::early`]).

use std::mem::MaybeUninit;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::header::{CONTENT_LENGTH, EXPECT, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri, Version};
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
/// HTTP version. `None` when the client closes, stays silent until `give_up`, or shutdown
/// begins first (`drain`: nothing was asked yet, so nothing is lost); a preface still
/// incomplete after a few looks is served as HTTP/1, which answers it with an error.
pub(super) async fn sniff_stream(
    stream: &TcpStream,
    give_up: Instant,
    drain: &CancellationToken,
) -> Option<Sniffed> {
    let mut first = [0u8; H2_PREFACE.len()];
    let mut wait = FIRST_LOOK_AGAIN;
    for _ in 0..=LOOKS_AGAIN {
        let seen = tokio::select! {
            // The bytes first: a request that is already there when shutdown begins was
            // asked before the listener closed.
            biased;
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

/// The most bytes of a first request [`peek_request`] looks at, head and body: a
/// request that does not fit is left to hyper.
const MAX_PEEKED: usize = 8 * 1024;
/// The most header fields [`parse_request`] reads; more are left to hyper.
const MAX_PEEKED_FIELDS: usize = 64;

/// What a peek at the start of an HTTP/1 connection found.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // returned and matched at once, never kept
pub(super) enum Peeked {
    /// The first request's head, with all of its body (if any) behind it in the socket.
    Whole(Request<()>),
    /// A proper beginning; more bytes may complete it.
    Partial,
    /// Not a request that can wait before hyper reads it: longer than [`MAX_PEEKED`], a
    /// body of unknown length (chunked), or a head hyper would refuse (hyper answers it).
    Unusable,
}

/// Peeks at the first request on an HTTP/1 connection: the bytes stay in the socket,
/// and hyper parses them again when it serves the connection.
///
/// It does not wait: right after the version peek the socket's readiness is still set,
/// so the peek returns at once. Finding nothing counts as [`Peeked::Partial`].
pub(super) fn peek_request(stream: &TcpStream) -> Peeked {
    let mut bytes = [MaybeUninit::<u8>::uninit(); MAX_PEEKED];
    let mut buf = ReadBuf::uninit(&mut bytes);
    let mut cx = Context::from_waker(Waker::noop());
    match stream.poll_peek(&mut cx, &mut buf) {
        Poll::Ready(Ok(seen)) if seen > 0 => parse_request(buf.filled()),
        Poll::Pending => Peeked::Partial,
        Poll::Ready(_) => Peeked::Unusable,
    }
}

/// Parses the start of a connection as hyper would. Only a request whose body has all
/// arrived is [`Peeked::Whole`]: once admitted it holds a concurrency permit, and a
/// body still to come would hold it for as long as the client takes to send it.
fn parse_request(bytes: &[u8]) -> Peeked {
    let mut fields = [httparse::EMPTY_HEADER; MAX_PEEKED_FIELDS];
    let mut head = httparse::Request::new(&mut fields);
    let head_len = match head.parse(bytes) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if bytes.len() < MAX_PEEKED => return Peeked::Partial,
        _ => return Peeked::Unusable,
    };
    let Some(req) = request_from(&head) else {
        return Peeked::Unusable;
    };
    match declared_body(req.headers()) {
        Some(body) if (bytes.len() - head_len) as u64 >= body => Peeked::Whole(req),
        // `Expect: 100-continue`: the body comes once hyper has answered `100`.
        _ if req.headers().contains_key(EXPECT) => Peeked::Unusable,
        Some(body) if (head_len as u64).saturating_add(body) <= MAX_PEEKED as u64 => {
            Peeked::Partial
        }
        _ => Peeked::Unusable,
    }
}

/// The `http` form of a parsed head; `None` where hyper would refuse it.
fn request_from(head: &httparse::Request<'_, '_>) -> Option<Request<()>> {
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

/// The length of the body behind a request head, when the head says it up front: 0
/// without one, else its single, well-formed `Content-Length`. `None` for a chunked
/// body and for anything hyper might refuse (several lengths, a malformed one).
fn declared_body(headers: &HeaderMap) -> Option<u64> {
    if headers.contains_key(TRANSFER_ENCODING) {
        return None;
    }
    let mut lengths = headers.get_all(CONTENT_LENGTH).iter();
    match (lengths.next(), lengths.next()) {
        (None, _) => Some(0),
        (Some(length), None)
            if !length.is_empty() && length.as_bytes().iter().all(u8::is_ascii_digit) =>
        {
            length.to_str().ok()?.parse().ok()
        }
        _ => None,
    }
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

    fn whole(bytes: &[u8]) -> Request<()> {
        match parse_request(bytes) {
            Peeked::Whole(req) => req,
            other => panic!("{other:?} for {:?}", String::from_utf8_lossy(bytes)),
        }
    }

    fn is_partial(bytes: &[u8]) -> bool {
        matches!(parse_request(bytes), Peeked::Partial)
    }

    fn is_unusable(bytes: &[u8]) -> bool {
        matches!(parse_request(bytes), Peeked::Unusable)
    }

    #[test]
    fn reads_a_whole_request_as_hyper_will() {
        let req = whole(
            b"GET http://api.example:8080/v1?q=1 HTTP/1.1\r\nHost: api.example:8080\r\n\
              X-Two: a\r\nx-two: b\r\n\r\n",
        );
        assert_eq!(req.method(), Method::GET);
        assert_eq!(req.uri(), "http://api.example:8080/v1?q=1");
        assert_eq!(req.version(), Version::HTTP_11);
        assert_eq!(req.headers()["host"], "api.example:8080");
        let two: Vec<_> = req.headers().get_all("x-two").iter().collect();
        assert_eq!(two, ["a", "b"]);

        let old = whole(b"DELETE /x HTTP/1.0\r\n\r\n");
        assert_eq!(
            (old.method(), old.version()),
            (&Method::DELETE, Version::HTTP_10)
        );
        let connect = whole(b"CONNECT a.example:443 HTTP/1.1\r\n\r\n");
        assert_eq!(connect.uri().authority().unwrap(), "a.example:443");
        // A pipelined request behind the first does not matter.
        whole(b"GET /1 HTTP/1.1\r\n\r\nGET /2 HTTP/1.1\r\n\r\n");
    }

    #[test]
    fn a_request_is_whole_only_with_all_of_its_body() {
        whole(b"POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello");
        whole(b"POST /x HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        assert!(is_partial(
            b"POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhel"
        ));
        assert!(is_partial(b"POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\n"));
        // Its client waits for hyper's `100 Continue` before it sends the body.
        let expect = b"POST /x HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n";
        assert!(is_unusable(expect));
        whole(b"POST /x HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\nhello");
        // A body that cannot be all there before the peek's limit, or whose length is
        // not known up front, is left to hyper.
        assert!(is_unusable(
            b"POST /x HTTP/1.1\r\nContent-Length: 9000\r\n\r\nhello"
        ));
        assert!(is_unusable(
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        ));
    }

    #[test]
    fn leaves_what_hyper_would_refuse_to_hyper() {
        assert!(is_unusable(
            b"POST /x HTTP/1.1\r\nContent-Length: abc\r\n\r\n"
        ));
        assert!(is_unusable(
            b"POST /x HTTP/1.1\r\nContent-Length: +5\r\n\r\nhello"
        ));
        assert!(is_unusable(
            b"POST /x HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello"
        ));
        assert!(is_unusable(b"GET /\x01 HTTP/1.1\r\n\r\n"));
        assert!(is_unusable(b"NOT HTTP AT ALL\r\n\r\n"));
        let many: String = (0..MAX_PEEKED_FIELDS + 1)
            .map(|i| format!("x-{i}: v\r\n"))
            .collect();
        assert!(is_unusable(
            format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes()
        ));
    }

    #[test]
    fn a_head_in_pieces_is_partial_until_the_limit() {
        assert!(is_partial(b"GET / HTTP/1.1\r\nHost: a\r\n"));
        assert!(is_partial(b"GET / HTTP/1.1\r\nHost: a\r\n\r"));
        assert!(is_partial(b"GE"));
        let long = format!("GET / HTTP/1.1\r\nCookie: {}", "c".repeat(MAX_PEEKED));
        assert!(is_unusable(&long.as_bytes()[..MAX_PEEKED]));
    }
}
