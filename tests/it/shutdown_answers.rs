//! Shutdown answers everyone: requests still queued when `shutdown_grace` runs out get
//! a `503` with `Retry-After` and `Proxy-Status`, over HTTP/1 and HTTP/2, never a reset;
//! the binary exits 0 soon after the grace and logs what it sent, answered and cut.

use std::time::{Duration, Instant};

use crate::support::*;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SHUTTING_DOWN: &str = "tollgate; error=proxy_internal_error; details=\"shutting down\"";

/// A group that lets one request out per minute: after [`take_the_slot`], every
/// further request waits far past any grace below.
fn one_per_minute(grace: &str, upstream: &Upstream) -> String {
    format!(
        "[proxy]\nshutdown_grace = \"{grace}\"\n\
         [[route]]\nprefix = \"/r/\"\nupstream = \"{}\"\n\
         [[limit]]\nname = \"slow\"\nhosts = [\"127.0.0.1\"]\nrate = \"1/min\"\nmax_wait = \"1h\"\n",
        upstream.url("/")
    )
}

/// Sends `GET /r/<path>` on a new HTTP/1.1 connection and returns it, unanswered.
async fn queue_http1(addr: std::net::SocketAddr, path: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let get = format!("GET /r/{path} HTTP/1.1\r\nHost: tollgate\r\n\r\n");
    stream.write_all(get.as_bytes()).await.unwrap();
    stream
}

fn assert_shutting_down(status: u16, header: impl Fn(&str) -> Option<String>, who: &str) {
    assert_eq!(status, 503, "{who}");
    assert_eq!(
        header("proxy-status").as_deref(),
        Some(SHUTTING_DOWN),
        "{who}"
    );
    let after: u64 = header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{who}: no Retry-After in seconds"));
    assert!(after >= 1, "{who}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_get_503_when_the_grace_runs_out_over_http1_and_http2() {
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    let mut proxy = start_proxy_with_admin(&one_per_minute("300ms", &upstream)).await;
    let first = reqwest_direct()
        .get(format!("{}/r/first", proxy.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);

    const HTTP1: usize = 8;
    let mut h1 = Vec::new();
    for i in 0..HTTP1 {
        h1.push(queue_http1(proxy.addr, &format!("h1-{i}")).await);
    }
    // Three streams of one HTTP/2 connection.
    let tcp = TcpStream::connect(proxy.addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake::<_, _, Empty<bytes::Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut h2 = Vec::new();
    for i in 0..3 {
        let mut send = send.clone();
        let req = http::Request::get(format!("http://{}/r/h2-{i}", proxy.addr))
            .body(Empty::new())
            .unwrap();
        h2.push(tokio::spawn(async move {
            let resp = send.send_request(req).await.expect("an h2 answer");
            let (head, body) = resp.into_parts();
            let body = body.collect().await.expect("the whole h2 body").to_bytes();
            (head, body)
        }));
    }
    wait_queued(&proxy, "slow", HTTP1 + 3).await;

    proxy.begin_shutdown();
    for (i, mut stream) in h1.into_iter().enumerate() {
        let who = format!("HTTP/1 client {i}");
        let resp = tokio::time::timeout(BOUND, read_response(&mut stream))
            .await
            .unwrap_or_else(|_| panic!("{who}: no answer"));
        assert_shutting_down(resp.status, |n| resp.header(n).map(String::from), &who);
        assert_eq!(resp.header("connection"), Some("close"), "{who}");
        assert_eq!(resp.text(), "tollgate: shutting down\n", "{who}");
        // Then the proxy closes the connection: EOF, not a reset.
        let mut rest = Vec::new();
        let end = tokio::time::timeout(BOUND, stream.read_to_end(&mut rest)).await;
        assert!(matches!(end, Ok(Ok(0))), "{who}: {end:?} {rest:?}");
    }
    for (i, stream) in h2.into_iter().enumerate() {
        let (head, body) = stream.await.unwrap();
        let header = |n: &str| head.headers.get(n).map(|v| v.to_str().unwrap().to_string());
        assert_shutting_down(head.status.as_u16(), header, &format!("h2 stream {i}"));
        assert_eq!(&body[..], b"tollgate: shutting down\n");
    }
    // Nothing but the first request reached the upstream.
    assert_eq!(upstream.paths(), ["/first"]);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_leave_the_queue_within_the_grace_are_sent() {
    // Two per second: a request queued behind the slot leaves within a 5 s grace and
    // is served; shutdown waits for it instead of answering 503.
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    let mut proxy = start_proxy_with_admin(&format!(
        "[proxy]\nshutdown_grace = \"5s\"\n\
         [[route]]\nprefix = \"/r/\"\nupstream = \"{}\"\n\
         [[limit]]\nname = \"slow\"\nhosts = [\"127.0.0.1\"]\nrate = \"2/s\"\n",
        upstream.url("/")
    ))
    .await;
    let first = reqwest_direct()
        .get(format!("{}/r/first", proxy.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    let mut waiting = queue_http1(proxy.addr, "waited").await;
    wait_queued(&proxy, "slow", 1).await;
    proxy.begin_shutdown();
    let resp = tokio::time::timeout(BOUND, read_response(&mut waiting))
        .await
        .unwrap();
    assert_eq!((resp.status, resp.text()), (200, "served".to_string()));
    assert_eq!(upstream.paths(), ["/first", "/waited"]);
    proxy.shutdown().await;
}

/// `text` without the ANSI colour sequences of the text log format.
fn without_colours(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // An escape sequence runs to its final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_answers_every_queued_client_on_sigterm_and_exits_0_soon_after_the_grace() {
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    let mut tollgate = Tollgate::start(&format!(
        "[proxy]\nshutdown_grace = \"1s\"\n{ADMIN_ON_PORT_0}\
         [[route]]\nprefix = \"/r/\"\nupstream = \"{}\"\n\
         [[limit]]\nname = \"slow\"\nhosts = [\"127.0.0.1\"]\nrate = \"1/min\"\nmax_wait = \"1h\"\n",
        upstream.url("/")
    ))
    .await;
    let listen = tollgate.addr;
    const CLIENTS: usize = 50;
    let mut first = queue_http1(listen, "first").await;
    assert_eq!(read_response(&mut first).await.status, 200);
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        clients.push(queue_http1(listen, &format!("{i}")).await);
    }
    tollgate
        .wait_metric("tollgate_queue_depth{group=\"slow\"}", CLIENTS as f64)
        .await;

    let signalled = Instant::now();
    tollgate.signal("TERM").await;
    let answers: Vec<_> = clients
        .into_iter()
        .map(|mut stream| tokio::spawn(async move { read_response(&mut stream).await }))
        .collect();
    let status = tollgate.wait_exit().await;
    let took = signalled.elapsed();
    let stderr = without_colours(&tollgate.log());
    assert_eq!(status.code(), Some(0), "{stderr}");
    for (i, answer) in answers.into_iter().enumerate() {
        let resp = answer.await.unwrap();
        let who = format!("client {i}");
        assert_shutting_down(resp.status, |n| resp.header(n).map(String::from), &who);
    }
    assert_eq!(upstream.paths(), ["/first"]);
    assert!(
        stderr.contains("sent=0 answered_503=50 cut=0"),
        "the last log line counts them:\n{stderr}"
    );
    // grace (1 s) + 1 s, with room for a loaded machine.
    assert!(
        took < Duration::from_secs(6),
        "exited {took:?} after SIGTERM"
    );
}
