//! The two `[proxy]` timeouts that bound idle connections: `client_header_timeout`
//! (clients that connect and then send no request head, or only part of one, are
//! disconnected) and `upstream_idle_timeout` (pooled upstream connections are dropped
//! once idle that long, and reused before).
//!
//! Nothing here asserts how fast a timeout fires beyond generous upper bounds that only
//! keep a broken proxy from hanging the suite; what is asserted is what happened: the
//! proxy closed the connection, the upstream saw these requests on these connections.

mod support;

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The short timeout the tests configure, as written in the config and as a duration.
const SHORT: &str = "300ms";
const SHORT_DUR: Duration = Duration::from_millis(300);

/// Far longer than [`SHORT`]; a connection still open after this was never going to be
/// closed by the timeout.
const CLOSE_BOUND: Duration = Duration::from_secs(10);

/// Reads from `stream` until the peer closes it (EOF or a reset) and returns what
/// arrived before; panics if the connection is still open after [`CLOSE_BOUND`].
async fn read_until_closed(stream: &mut TcpStream, what: &str) -> Vec<u8> {
    let mut got = Vec::new();
    let closed = tokio::time::timeout(CLOSE_BOUND, async {
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) => return,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
                // The proxy may close with bytes of ours unread, which resets.
                Err(e)
                    if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) =>
                {
                    return
                }
                Err(e) => panic!("{what}: unexpected read error {e}"),
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "{what}: the proxy kept the connection open for {CLOSE_BOUND:?} (client_header_timeout = {SHORT}); \
         received so far: {:?}",
        String::from_utf8_lossy(&got)
    );
    got
}

/// Whatever the proxy wrote before closing must not be a forwarded response: either
/// nothing, or a 4xx of its own (hyper may answer a stalled head with an error).
fn assert_no_response_or_client_error(got: &[u8], what: &str) {
    let text = String::from_utf8_lossy(got);
    assert!(
        got.is_empty() || text.starts_with("HTTP/1.1 4"),
        "{what}: the proxy answered {text:?}"
    );
}

/// Connects to the proxy, writes `first` (possibly nothing), stalls, and returns what the
/// proxy wrote before it closed the connection. Also asserts the connection was not
/// closed before the timeout could have fired: timers never fire early, and the proxy
/// accepted the connection after `connect` began, so this lower bound cannot flake.
async fn stall_until_closed(proxy: &Proxy, first: &[u8], what: &str) -> Vec<u8> {
    let started = Instant::now();
    let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
    if !first.is_empty() {
        stream.write_all(first).await.expect("write");
    }
    let got = read_until_closed(&mut stream, what).await;
    let elapsed = started.elapsed();
    assert!(
        elapsed >= SHORT_DUR,
        "{what}: closed after {elapsed:?}, before client_header_timeout = {SHORT} could fire"
    );
    got
}

#[tokio::test]
async fn client_header_timeout_disconnects_stalled_clients() {
    let upstream = Upstream::start(|_| Reply::ok("fine")).await;
    let proxy = start_proxy(&format!("[proxy]\nclient_header_timeout = \"{SHORT}\"\n")).await;

    // (a) Connects and sends nothing: the peek at the first bytes gives up.
    let got = stall_until_closed(&proxy, b"", "silent client").await;
    assert!(
        got.is_empty(),
        "silent client got {:?}",
        String::from_utf8_lossy(&got)
    );

    // (b) Half a request head, then nothing: hyper's header read timeout.
    let half = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\n",
        upstream.url("/half"),
        upstream.authority()
    );
    let got = stall_until_closed(&proxy, half.as_bytes(), "half a request head").await;
    assert_no_response_or_client_error(&got, "half a request head");

    // (b') A partial HTTP/2 preface: the version cannot be told yet, the peek waits for
    // more until the timeout, then hyper's HTTP/1 side must still close it.
    let got = stall_until_closed(&proxy, b"PRI * HTTP/2.0\r\n", "partial h2 preface").await;
    assert_no_response_or_client_error(&got, "partial h2 preface");

    // None of the stalled clients got anything through.
    assert!(
        upstream.requests().is_empty(),
        "a stalled request reached the upstream: {:?}",
        upstream.requests()
    );
    assert_eq!(upstream.connections(), 0, "the proxy dialled the upstream");

    // (c) The proxy still serves a complete request afterwards.
    let out = curl(&["-x", &proxy.url(), &upstream.url("/whole")], &[]).await;
    assert_eq!(out.status, 200, "curl: {} {}", out.stderr, out.headers);
    assert_eq!(out.text(), "fine");
    let seen = upstream.requests();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].path, "/whole");
    proxy.shutdown().await;
}

#[tokio::test]
async fn client_header_timeout_closes_idle_keep_alive_connections() {
    // The config documents that on HTTP/1.1 the timeout also bounds how long a
    // keep-alive connection may sit idle between requests.
    let upstream = Upstream::start(|_| Reply::ok("fine")).await;
    let proxy = start_proxy(&format!("[proxy]\nclient_header_timeout = \"{SHORT}\"\n")).await;
    let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
        upstream.url("/first"),
        upstream.authority()
    );
    stream.write_all(request.as_bytes()).await.expect("write");

    // The response (Content-Length 4, keep-alive), then the proxy closes the idle
    // connection: everything read until the close is exactly one response.
    let got = read_until_closed(&mut stream, "idle keep-alive connection").await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text:?}");
    assert!(text.ends_with("\r\n\r\nfine"), "{text:?}");
    assert_eq!(text.matches("HTTP/1.1").count(), 1, "{text:?}");
    assert_eq!(upstream.requests().len(), 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn client_header_timeout_disconnects_http2_clients_that_send_no_request() {
    let upstream = Upstream::start(|_| Reply::ok("fine")).await;
    let proxy = start_proxy(&format!("[proxy]\nclient_header_timeout = \"{SHORT}\"\n")).await;
    // The preface and an empty SETTINGS frame, as an h2c client opens; then no HEADERS.
    // What the proxy writes back (its SETTINGS, the ack, pings) does not matter, only
    // that it closes the connection.
    let mut opening = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    opening.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    stall_until_closed(&proxy, &opening, "h2 client sending no request").await;
    assert!(upstream.requests().is_empty());
    proxy.shutdown().await;
}

/// Sends `GET path` through `client` and checks the answer.
async fn get(client: &reqwest::Client, upstream: &Upstream, path: &str) {
    let resp = client
        .get(upstream.url(path))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    assert_eq!(resp.status(), 200, "GET {path}");
    assert_eq!(resp.text().await.expect("body"), "pooled");
}

/// The upstream connection index of each request, in arrival order.
fn conns(upstream: &Upstream) -> Vec<(String, usize)> {
    upstream
        .requests()
        .iter()
        .map(|s| (s.path.clone(), s.conn))
        .collect()
}

#[tokio::test]
async fn upstream_idle_timeout_expires_pooled_connections() {
    let upstream = Upstream::start(|_| Reply::ok("pooled")).await;
    let proxy = start_proxy(&format!("[proxy]\nupstream_idle_timeout = \"{SHORT}\"\n")).await;
    let client = reqwest_via(&proxy, None);

    get(&client, &upstream, "/one").await;
    // Five times the idle timeout: the pooled connection has expired by now.
    tokio::time::sleep(SHORT_DUR * 5).await;
    get(&client, &upstream, "/two").await;

    let seen = conns(&upstream);
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_ne!(
        seen[0].1, seen[1].1,
        "the second request reused the upstream connection after it was idle past \
         upstream_idle_timeout = {SHORT}: {seen:?}"
    );
    assert_eq!(upstream.connections(), 2);
    proxy.shutdown().await;
}

#[tokio::test]
async fn upstream_connections_are_reused_within_the_idle_timeout() {
    // The counterpart: without it, the test above would also pass for a proxy that never
    // reuses upstream connections at all.
    let upstream = Upstream::start(|_| Reply::ok("pooled")).await;
    let proxy = start_proxy("[proxy]\nupstream_idle_timeout = \"60s\"\n").await;
    let client = reqwest_via(&proxy, None);

    get(&client, &upstream, "/one").await;
    // Long enough for the connection to be back in the pool once the response is done,
    // far short of the idle timeout.
    tokio::time::sleep(Duration::from_millis(200)).await;
    get(&client, &upstream, "/two").await;

    let seen = conns(&upstream);
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(
        seen[0].1, seen[1].1,
        "the second request did not reuse the pooled upstream connection \
         (upstream_idle_timeout = 60s): {seen:?}"
    );
    assert_eq!(upstream.connections(), 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_connection_out_on_a_long_response_is_pooled_again_past_the_idle_sweeps() {
    // The pool's sweeper runs every half idle timeout and drops upstreams with no idle
    // connection left. One whose only connection is out, carrying a response that
    // streams across several sweeps, must keep its place: the connection goes back to it
    // when the body ends, and is reused.
    let upstream = Upstream::start_bulk().await;
    let proxy = start_proxy("[proxy]\nupstream_idle_timeout = \"1s\"\n").await;
    let client = reqwest_via(&proxy, None);

    let len = 100_000u64;
    let mut held = client
        .get(upstream.url(&format!("/bytes/{len}?hold=1000")))
        .send()
        .await
        .expect("GET of a held body");
    assert_eq!(held.status(), 200);
    let mut got = held
        .chunk()
        .await
        .expect("first bytes")
        .map_or(0, |c| c.len() as u64);
    // Five sweeps (every 500 ms) while the body is held at 1 000 bytes.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    upstream.release();
    while let Some(chunk) = held.chunk().await.expect("the rest of the body") {
        got += chunk.len() as u64;
    }
    assert_eq!(got, len);

    // At once, well within the idle timeout.
    let again = client
        .get(upstream.url("/bytes/10"))
        .send()
        .await
        .expect("second GET");
    assert_eq!(again.bytes().await.expect("second body").len(), 10);
    assert_eq!(
        upstream.connections(),
        1,
        "the connection that carried the long response was not reused"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn http2_requests_slower_than_client_header_timeout_are_answered() {
    // The idle close counts only time with no request open: a slow answer, and the time
    // its body takes, are not idleness.
    let upstream = Upstream::start(|_| Reply::ok("late").delay(Duration::from_millis(900))).await;
    let proxy = start_proxy(&format!(
        "[proxy]\nclient_header_timeout = \"{SHORT}\"\n[[route]]\nprefix = \"/r/\"\nupstream = \"{}\"\n",
        upstream.url("/")
    ))
    .await;
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .timeout(BOUND)
        .build()
        .unwrap();
    for path in ["one", "two"] {
        let resp = h2
            .get(format!("{}/r/{path}", proxy.url()))
            .send()
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(resp.version(), reqwest::Version::HTTP_2);
        assert_eq!(resp.text().await.unwrap(), "late");
    }
    let paths = upstream.paths();
    assert_eq!(paths, ["/one", "/two"]);
    proxy.shutdown().await;
}
