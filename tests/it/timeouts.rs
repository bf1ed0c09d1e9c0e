//! The two `[proxy]` timeouts that bound idle connections: `client_header_timeout`
//! (clients that connect and then send no request head, or only part of one, are
//! disconnected) and `upstream_idle_timeout` (pooled upstream connections are dropped
//! once idle that long, and reused before). And what `client_header_timeout` must not
//! cut: a slow download or upload, an upload still going after an early answer, an
//! idle tunnel.
//!
//! Nothing here asserts how fast a timeout fires beyond generous upper bounds that only
//! keep a broken proxy from hanging the suite; what is asserted is what happened: the
//! proxy closed the connection, the upstream saw these requests on these connections.

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use crate::support::*;
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
    // Idle past the timeout, the pooled connection is closed.
    wait_connections_closed(upstream.addr()).await;
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
    // A client's pause between requests, far short of the idle timeout, in which the
    // connection goes back to the pool (nothing outside the proxy shows when it has).
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

// ---------------------------------------------------------------------------------
// What `client_header_timeout` must leave alone on HTTP/1: it bounds the wait for a
// request head, never a message already under way, in either direction, nor a tunnel.
// Each test runs within `BOUND`, so that a proxy that stops answering fails them
// instead of hanging the suite.
// ---------------------------------------------------------------------------------

/// How long the upload and tunnel tests below stall: far longer than [`SHORT`], so a
/// header timeout running meanwhile would fire during it.
const STALL: Duration = Duration::from_secs(1);

/// How long the download test's reader stalls each time: longer than [`SHORT`], so that a
/// timeout started as a stall begins fires before it ends.
const READ_STALL: Duration = Duration::from_millis(400);

/// The download. With the default `tcp_wmem` (at most 4 MiB of send buffer) and a
/// client's receive buffer of 16 KiB (32 KiB once the kernel doubles it), the kernel
/// cannot hold it: while the client stalls, the proxy is still writing.
const DOWNLOAD: u64 = 16 << 20;

/// Where the reader stalls: every 256 KiB of the last 5 MiB, the stretch where the
/// proxy may hold the end of the body with nothing more to read from the upstream
/// (see [`read_body_with_stalls`]).
const STALLS_FROM: u64 = 5 << 20;
const STALL_EVERY: u64 = 256 << 10;

/// Runs `test` within [`BOUND`].
async fn bounded<F: std::future::Future>(what: &str, test: F) -> F::Output {
    tokio::time::timeout(BOUND, test)
        .await
        .unwrap_or_else(|_| panic!("{what}: not done within {BOUND:?}"))
}

/// Connects to `proxy` with a small receive buffer (see [`DOWNLOAD`]).
async fn connect_slow_reader(proxy: &Proxy) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(16 * 1024).expect("SO_RCVBUF");
    socket.connect(proxy.addr).await.expect("connect")
}

/// Reads `len` body bytes (`first` already read) into a digest, stalling for
/// [`READ_STALL`] every [`STALL_EVERY`] bytes of the last [`STALLS_FROM`]; panics if the
/// connection closes before the last byte.
///
/// The stalls are for the moment near the end when the proxy has the whole body from
/// the upstream but is still writing its last few hundred KiB (hyper's write buffer),
/// which falls wherever the kernel's buffers put it. A header timeout started when the
/// body ended, rather than once hyper has flushed the response and reads for the next
/// head, cuts the response there: such a proxy loses the last few hundred KiB of the
/// keep-alive download.
async fn read_body_with_stalls(stream: &mut TcpStream, first: Vec<u8>, len: u64) -> Digest {
    let mut hasher = Hasher::default();
    hasher.update(&first);
    let mut got = first.len() as u64;
    let mut stalls = 0;
    let mut chunk = vec![0u8; 16 * 1024];
    while got < len {
        let want = chunk.len().min((len - got) as usize);
        let n = stream.read(&mut chunk[..want]).await.expect("read body");
        assert!(
            n > 0,
            "the proxy closed the download after {got} of {len} bytes"
        );
        hasher.update(&chunk[..n]);
        let before = len - got;
        got += n as u64;
        let left = len - got;
        if left > 0 && left < STALLS_FROM && before / STALL_EVERY != left / STALL_EVERY {
            stalls += 1;
            // The slow reader: it stops reading for longer than the header timeout.
            tokio::time::sleep(READ_STALL).await;
        }
    }
    assert!(stalls >= STALLS_FROM / STALL_EVERY - 1, "{stalls} stalls");
    hasher.finish()
}

/// Writes bytes `from..to` of [`pattern`] to `stream`.
async fn write_pattern(stream: &mut TcpStream, from: usize, to: usize) -> std::io::Result<()> {
    let mut offset = from;
    while offset < to {
        let piece = (to - offset).min(64 * 1024);
        stream.write_all(&pattern(offset as u64, piece)).await?;
        offset += piece;
    }
    Ok(())
}

#[tokio::test]
async fn client_header_timeout_leaves_a_slow_download_alone() {
    let upstream = Upstream::start_bulk().await;
    let proxy = start_proxy(&format!("[proxy]\nclient_header_timeout = \"{SHORT}\"\n")).await;
    for connection in ["keep-alive", "close"] {
        bounded(connection, async {
            let mut stream = connect_slow_reader(&proxy).await;
            let request = format!(
                "GET {} HTTP/1.1\r\nHost: {}\r\nConnection: {connection}\r\n\r\n",
                upstream.url(&format!("/bytes/{DOWNLOAD}")),
                upstream.authority()
            );
            stream.write_all(request.as_bytes()).await.expect("write");
            let (head, first) = read_response_head(&mut stream).await;
            assert_eq!(head.status, 200, "{connection}");
            assert_eq!(
                head.content_length(),
                Some(DOWNLOAD as usize),
                "{connection}"
            );
            let digest = read_body_with_stalls(&mut stream, first, DOWNLOAD).await;
            assert_eq!(
                digest,
                pattern_digest(DOWNLOAD),
                "{connection}: the body arrived changed"
            );
            if connection == "close" {
                // Nothing after the body, then the close the client asked for.
                let rest = read_until_closed(&mut stream, "Connection: close download").await;
                assert!(rest.is_empty(), "bytes after the body: {}", rest.len());
            }
        })
        .await;
    }
    assert_eq!(upstream.requests().len(), 2);
    proxy.shutdown().await;
}

/// Uploads `len` bytes of [`pattern`] to the bulk upstream's `/upload` through `proxy`,
/// in three parts with a [`STALL`] before each of the last two, and asserts the
/// upstream's answer: `200` and the digest of what it received.
async fn upload_with_stalls(proxy: &Proxy, upstream: &Upstream, len: usize) {
    let what = format!("{len}-byte upload");
    bounded(&what, async {
        let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Length: {len}\r\n\r\n",
            upstream.url("/upload"),
            upstream.authority()
        );
        stream.write_all(head.as_bytes()).await.expect("write head");
        let cuts = [0, len / 3, 2 * len / 3, len];
        for (i, part) in cuts.windows(2).enumerate() {
            if i > 0 {
                // The slow uploader: silent for longer than the timeout under test.
                tokio::time::sleep(STALL).await;
            }
            write_pattern(&mut stream, part[0], part[1])
                .await
                .unwrap_or_else(|e| panic!("{what}: write after {} failed: {e}", part[0]));
        }
        let response = read_response(&mut stream).await;
        let expected = pattern_digest(len as u64);
        assert_eq!(response.status, 200, "{what}: {}", response.text());
        assert_eq!(
            response.text(),
            format!("{} {}", expected.len, expected.hash),
            "{what}: the upstream received something else"
        );
    })
    .await;
}

#[tokio::test]
async fn client_header_timeout_leaves_a_slow_upload_alone() {
    // One body small enough to be read whole before it is sent (replayable after a
    // push-back; `max_replay_body` is 1 MiB), and one that streams through.
    let upstream = Upstream::start_bulk().await;
    let proxy = start_proxy(&format!("[proxy]\nclient_header_timeout = \"{SHORT}\"\n")).await;
    for len in [256 * 1024, 3 << 20] {
        upload_with_stalls(&proxy, &upstream, len).await;
    }
    assert_eq!(
        upstream.uploads(),
        vec![pattern_digest(256 * 1024), pattern_digest(3 << 20)]
    );
    proxy.shutdown().await;
}

/// `response_timeout` counts from the end of the request's body, not from its start: an
/// upload that streams (larger than `max_replay_body`) for longer than the timeout, with
/// the client's pauses between its parts, still gets the upstream's answer, and the
/// upstream gets every byte.
#[tokio::test]
async fn response_timeout_leaves_a_long_upload_alone() {
    let upstream = Upstream::start_bulk().await;
    let proxy = start_proxy(&format!("[proxy]\nresponse_timeout = \"{SHORT}\"\n")).await;
    upload_with_stalls(&proxy, &upstream, 3 << 20).await;
    assert_eq!(upstream.uploads(), vec![pattern_digest(3 << 20)]);
    proxy.shutdown().await;
}

#[tokio::test]
async fn client_header_timeout_leaves_an_upload_answered_early_alone() {
    // An upstream may answer before it has read the request body (an error it could
    // tell from the head, say) and go on reading. The exchange with the client is not
    // over until its upload is: a client still sending after the answer is not idle.
    // A body over `max_replay_body` (1 MiB) streams through, so the answer can come
    // back while the client still sends; the client waits for it half-way.
    const LEN: usize = 3 << 20;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind upstream");
    let upstream = listener.local_addr().expect("upstream address");
    let received = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.expect("accept");
        let (_head, first) = read_head(&mut conn).await;
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nearly")
            .await
            .expect("write the early answer");
        let mut hasher = Hasher::default();
        hasher.update(&first);
        let mut got = first.len();
        let mut chunk = vec![0u8; 64 * 1024];
        while got < LEN {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    hasher.update(&chunk[..n]);
                    got += n;
                }
            }
        }
        hasher.finish()
    });
    let proxy = start_proxy(&format!("[proxy]\nclient_header_timeout = \"{SHORT}\"\n")).await;
    bounded("upload answered early", async {
        let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
        let head = format!(
            "POST http://{upstream}/upload HTTP/1.1\r\nHost: {upstream}\r\nContent-Length: {LEN}\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).await.expect("write head");
        write_pattern(&mut stream, 0, LEN / 2)
            .await
            .expect("first half");
        let response = read_response(&mut stream).await;
        assert_eq!(response.status, 200);
        assert_eq!(response.text(), "early");

        // Answered, but half the body is still to come: a stall now is not an idle
        // keep-alive connection.
        tokio::time::sleep(STALL).await;
        write_pattern(&mut stream, LEN / 2, LEN)
            .await
            .expect("the proxy closed the connection while the client was still uploading");
        let digest = received.await.expect("upstream task");
        assert_eq!(digest, pattern_digest(LEN as u64), "the upstream got another body");
    })
    .await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn client_header_timeout_leaves_an_idle_http1_tunnel_alone() {
    // After its `200`, a CONNECT's connection carries the tunnel's bytes, not requests:
    // a tunnel idle for longer than the timeout stays open.
    let upstream = Upstream::start(|seen| Reply::ok(format!("saw {}", seen.path))).await;
    let proxy = start_proxy(&format!(
        "[proxy]\nconnect_ports = [\"*\"]\nclient_header_timeout = \"{SHORT}\"\n"
    ))
    .await;
    bounded("idle tunnel", async {
        let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
        let authority = upstream.authority();
        let connect = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
        stream.write_all(connect.as_bytes()).await.expect("write");
        let (answer, rest) = read_response_head(&mut stream).await;
        assert_eq!(answer.status, 200);
        assert!(rest.is_empty(), "bytes after the CONNECT answer: {rest:?}");

        // The tunnel idles for longer than the header timeout.
        tokio::time::sleep(STALL).await;
        let request = format!("GET /after-idle HTTP/1.1\r\nHost: {authority}\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .expect("the tunnel was closed while idle");
        let response = read_response(&mut stream).await;
        assert_eq!(response.status, 200);
        assert_eq!(response.text(), "saw /after-idle");
        assert_eq!(upstream.paths(), ["/after-idle"]);
        // The client closes it, as tunnels end, so that shutdown need not wait for it.
    })
    .await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn client_header_timeout_closes_a_half_read_head_during_shutdown() {
    // Shutdown lets requests in hand finish, for up to `shutdown_grace`. A request head
    // hyper has begun to read and never gets the end of is not one: hyper's header
    // timeout closes it as at any other time, and shutdown does not wait the hour.
    // Over 8 KiB in one write: a head hyper has surely begun to read.
    let upstream = Upstream::start(|_| Reply::ok("fine")).await;
    let mut proxy = start_proxy(&format!(
        "[proxy]\nclient_header_timeout = \"{SHORT}\"\nshutdown_grace = \"1h\"\n"
    ))
    .await;
    let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let half = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nX-Filler: {}\r\n",
        upstream.url("/half"),
        upstream.authority(),
        "x".repeat(9000)
    );
    stream.write_all(half.as_bytes()).await.expect("write");
    // Once the proxy has the bytes (it answers nothing yet), shut down.
    wait_until_read(&stream).await;
    proxy.begin_shutdown();
    let got = read_until_closed(&mut stream, "half-read head during shutdown").await;
    assert_no_response_or_client_error(&got, "half-read head during shutdown");
    proxy.shutdown().await;
    assert!(upstream.requests().is_empty(), "{:?}", upstream.requests());
}
