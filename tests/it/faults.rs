//! Faults: a POST is never replayed after a status that may mean it was carried out;
//! malformed upstream answers; stalled bodies; buffered bodies within a memory budget.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::support::*;

const RETRY_500: &str = r#"
[[limit]]
name = "api"
hosts = ["127.0.0.1"]
retry_statuses = [429, 500, 503]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_is_not_replayed_after_a_status_that_may_mean_it_was_processed() {
    let upstream = refusing(1, || Reply::status(500).header("retry-after", "0")).await;
    let proxy = start_proxy(RETRY_500).await;
    let client = reqwest_via(&proxy, None);
    let resp = client
        .post(upstream.url("/charge"))
        .body("once")
        .send()
        .await
        .unwrap();
    // The 500 goes to the client; the upstream saw the POST once.
    assert_eq!(resp.status(), 500);
    assert_eq!(upstream.paths(), ["/charge"]);

    // A GET after the same status is replayed: sending it twice is harmless.
    let upstream = refusing(1, || Reply::status(500).header("retry-after", "0")).await;
    let resp = client.get(upstream.url("/read")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(upstream.paths(), ["/read", "/read"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_is_replayed_after_429_and_503_with_retry_after() {
    for status in [429, 503] {
        let upstream = refusing(1, move || Reply::status(status).header("retry-after", "0")).await;
        let proxy = start_proxy(RETRY_500).await;
        let resp = reqwest_via(&proxy, None)
            .post(upstream.url("/charge"))
            .body("not processed")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "after {status}");
        let seen = upstream.requests();
        assert_eq!(seen.len(), 2, "after {status}");
        assert_eq!(&seen[1].body[..], b"not processed");
        proxy.shutdown().await;
    }
}

// ---------------------------------------------------------------------------------
// Malformed upstream answers
// ---------------------------------------------------------------------------------

/// An upstream that answers every request on a connection with `answer`, verbatim,
/// and counts its connections and the requests it read.
struct RawUpstream {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
}

impl RawUpstream {
    async fn start(answer: &'static [u8]) -> RawUpstream {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let mut chunk = [0u8; 4096];
                        let Ok(n) = stream.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            if stream.write_all(answer).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        RawUpstream { addr, connections }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_content_length_and_transfer_encoding_is_a_502() {
    let upstream = RawUpstream::start(
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    let proxy = start_proxy("").await;
    let authority = upstream.addr.to_string();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let get = format!(
            "GET {} HTTP/1.1\r\nHost: {authority}\r\n\r\n",
            upstream.url("/x")
        );
        answers.push(raw_request(proxy.addr, get.as_bytes()).await);
    }
    for resp in answers {
        assert_eq!(resp.status, 502, "{resp:?}");
        let ps = resp.header("proxy-status").unwrap_or_default();
        assert!(
            ps.starts_with("tollgate; error=http_protocol_error"),
            "{ps}"
        );
    }
    // Each request had a connection of its own: the first was discarded.
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 2);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_101_to_a_get_fails_only_its_own_http2_stream() {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let upgrading = RawUpstream::start(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    )
    .await;
    let slow =
        Upstream::start(|_| Reply::ok("fine").delay(std::time::Duration::from_millis(300))).await;
    let proxy = start_proxy(&format!(
        "[[route]]\nprefix = \"/ok/\"\nupstream = \"{}\"\n\
         [[route]]\nprefix = \"/ws/\"\nupstream = \"{}\"\n",
        slow.url("/"),
        upgrading.url("/")
    ))
    .await;
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake::<_, _, Empty<bytes::Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let base = format!("http://{}", proxy.addr);
    let urls = [
        format!("{base}/ok/a"),
        format!("{base}/ws/x"),
        format!("{base}/ok/b"),
    ];
    let streams: Vec<_> = urls
        .into_iter()
        .map(|url| {
            let mut send = send.clone();
            tokio::spawn(async move {
                let req = http::Request::get(url).body(Empty::new()).unwrap();
                let resp = send
                    .send_request(req)
                    .await
                    .expect("an answer on the stream");
                let (head, body) = resp.into_parts();
                let body = body.collect().await.expect("the whole body").to_bytes();
                (head.status.as_u16(), head.headers, body)
            })
        })
        .collect();
    let mut answers = Vec::new();
    for stream in streams {
        answers.push(stream.await.unwrap());
    }
    assert_eq!((answers[0].0, &answers[0].2[..]), (200, &b"fine"[..]));
    assert_eq!((answers[2].0, &answers[2].2[..]), (200, &b"fine"[..]));
    assert_eq!(answers[1].0, 502);
    let ps = answers[1].1["proxy-status"].to_str().unwrap();
    assert!(
        ps.starts_with("tollgate; error=http_protocol_error"),
        "{ps}"
    );
    // The two streams run side by side: either may reach the upstream first.
    let mut paths = slow.paths();
    paths.sort();
    assert_eq!(paths, ["/a", "/b"]);
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------
// Stalled bodies (body_idle_timeout)
// ---------------------------------------------------------------------------------

/// One group of `concurrency = 1` for every loopback upstream, with a short
/// `body_idle_timeout`.
fn one_at_a_time(extra: &str) -> String {
    format!(
        "[proxy]\nbody_idle_timeout = \"300ms\"\n\
         [[limit]]\nname = \"one\"\nhosts = [\"127.0.0.1\"]\nconcurrency = 1\n{extra}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_response_body_is_cut_and_frees_the_permit() {
    use tokio::io::AsyncReadExt;
    let stalled =
        RawUpstream::start(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial").await;
    let fine = Upstream::start(|_| Reply::ok("next")).await;
    let proxy = start_proxy(&one_at_a_time("")).await;

    let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let get = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
        stalled.url("/stall"),
        stalled.addr
    );
    tokio::io::AsyncWriteExt::write_all(&mut client, get.as_bytes())
        .await
        .unwrap();
    let (head, mut body) = read_response_head(&mut client).await;
    assert_eq!(head.status, 200);
    // The client sees the truncation: the connection ends before the 100 bytes.
    let end = tokio::time::timeout(BOUND, client.read_to_end(&mut body)).await;
    assert!(end.is_ok(), "the stalled body was never cut");
    assert_eq!(body, b"partial");

    // The group's only permit is free again: the next request is served.
    let resp = reqwest_via(&proxy, None)
        .get(fine.url("/after"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "next");
    // The stalled upstream's connection was discarded, not pooled for reuse: the next
    // request to it opens another.
    let mut again = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let get = get.replace("/stall", "/again");
    tokio::io::AsyncWriteExt::write_all(&mut again, get.as_bytes())
        .await
        .unwrap();
    let (head, _) = read_response_head(&mut again).await;
    assert_eq!(head.status, 200);
    assert_eq!(stalled.connections.load(Ordering::SeqCst), 2);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_request_body_is_cut_before_and_after_it_goes_upstream() {
    let fine = Upstream::start(|seen| Reply::ok(format!("got {}", seen.body.len()))).await;
    // Buffered for replay (the default 1 MiB) or streamed upstream (0 bytes kept).
    for keep in ["", "max_replay_body = 0\n"] {
        let proxy = start_proxy(&one_at_a_time(keep)).await;
        let post = format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Length: 10\r\n\r\nabc",
            fine.url("/upload"),
            fine.authority()
        );
        let resp = raw_request(proxy.addr, post.as_bytes()).await;
        assert!(
            resp.status == 408,
            "{keep:?}: {} {:?}",
            resp.status,
            resp.text()
        );
        assert!(resp.text().contains("body_idle_timeout"), "{}", resp.text());
        // The permit is free: the next request is served.
        let next = reqwest_via(&proxy, None)
            .post(fine.url("/next"))
            .body("whole")
            .send()
            .await
            .unwrap();
        assert_eq!(next.text().await.unwrap(), "got 5", "{keep:?}");
        proxy.shutdown().await;
    }
    // The buffered upload never went upstream; the streamed one went as far as the
    // client sent it, and was cut there: never a whole request of 10 bytes.
    for seen in fine.requests() {
        match seen.path.as_str() {
            "/next" => assert_eq!(&seen.body[..], b"whole"),
            _ => assert!(seen.body.len() < 10, "{:?}", seen.body),
        }
    }
    assert_eq!(fine.paths().iter().filter(|p| *p == "/upload").count(), 1);
}

// ---------------------------------------------------------------------------------
// The memory of bodies held for replay (replay_memory)
// ---------------------------------------------------------------------------------

/// `pattern`'s first `len` bytes in one buffer.
fn pattern_bytes(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let n = (len - out.len()).min(16 * 1024);
        out.extend_from_slice(&pattern(out.len() as u64, n));
    }
    out
}

/// The peak resident memory of process `pid`, in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line["VmHWM:".len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_uploads_stay_within_replay_memory_and_are_all_served() {
    use tokio::io::AsyncWriteExt;
    const CLIENTS: usize = 150;
    const SIZE: usize = 1 << 20;
    let upstream = Upstream::start_bulk().await;
    let tollgate = Tollgate::launch(
        "[proxy]\nreplay_memory = \"32MiB\"\n\
         [[limit]]\nname = \"uploads\"\nhosts = [\"127.0.0.1\"]\nrate = \"50/s\"\n\
         queue = 1000\nmax_wait = \"5m\"\n",
    )
    .env("RUST_LOG", "warn,tollgate=info")
    .start()
    .await;
    let listen = tollgate.addr;
    let pid = tollgate.pid();
    let idle = peak_rss_kib(pid);

    let body = Arc::new(pattern_bytes(SIZE));
    let authority = upstream.authority();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (body, authority) = (body.clone(), authority.clone());
            tokio::spawn(async move {
                let mut stream = tokio::net::TcpStream::connect(listen).await.unwrap();
                let head = format!(
                    "POST http://{authority}/up/{i} HTTP/1.1\r\nHost: {authority}\r\n\
                     Content-Length: {SIZE}\r\nConnection: close\r\n\r\n"
                );
                stream.write_all(head.as_bytes()).await.unwrap();
                stream.write_all(&body).await.unwrap();
                read_response(&mut stream).await
            })
        })
        .collect();
    let expected = format!("{} {}", SIZE, pattern_digest(SIZE as u64).hash);
    for (i, client) in clients.into_iter().enumerate() {
        let resp = tokio::time::timeout(BOUND * 4, client)
            .await
            .unwrap_or_else(|_| panic!("client {i} was not answered"))
            .unwrap();
        assert_eq!(
            (resp.status, resp.text()),
            (200, expected.clone()),
            "client {i}"
        );
    }
    let uploads = upstream.uploads();
    assert_eq!(uploads.len(), CLIENTS);
    assert!(uploads.iter().all(|d| *d == pattern_digest(SIZE as u64)));
    let peak = peak_rss_kib(pid);
    eprintln!("peak RSS {peak} KiB (idle {idle} KiB) for {CLIENTS} x 1 MiB, replay_memory 32MiB");
    assert!(peak < 96 * 1024, "peak RSS {peak} KiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_beyond_replay_memory_streams_once_and_is_not_replayed() {
    let upstream = refusing(1, || Reply::status(429).header("retry-after", "0")).await;
    let proxy = start_proxy(&format!("[proxy]\nreplay_memory = \"1KiB\"\n{}", RETRY_500)).await;
    let client = reqwest_via(&proxy, None);
    // Within the budget: read ahead, and replayed after the 429.
    let small = client
        .post(upstream.url("/small"))
        .body(vec![b's'; 1000])
        .send()
        .await
        .unwrap();
    assert_eq!(small.status(), 200);
    assert_eq!(upstream.paths(), ["/small", "/small"]);

    // Beyond it (though within max_replay_body): sent once, its 429 passed through.
    let upstream = refusing(1, || Reply::status(429).header("retry-after", "0")).await;
    let big = client
        .post(upstream.url("/big"))
        .body(vec![b'b'; 2000])
        .send()
        .await
        .unwrap();
    assert_eq!(big.status(), 429);
    let seen = upstream.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body.len(), 2000);
    proxy.shutdown().await;
}

/// The only permit of group `one`, held by a download the upstream stalls until
/// [`Upstream::release`].
async fn hold_the_permit(tollgate: &Tollgate, upstream: &Upstream) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut held = tokio::net::TcpStream::connect(tollgate.addr).await.unwrap();
    let url = upstream.url("/bytes/100?hold=10");
    let hold = format!(
        "GET {url} HTTP/1.1\r\nHost: {}\r\n\r\n",
        upstream.authority()
    );
    held.write_all(hold.as_bytes()).await.unwrap();
    assert_eq!(read_response_head(&mut held).await.0.status, 200);
    held
}

/// How much of the `sent` bytes written on `client` the other end has read, once all
/// of them have reached it (what is not in its receive queue was read).
fn read_of(client: &tokio::net::TcpStream, sent: usize) -> Option<usize> {
    let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
    let sockets = tcp_sockets();
    let end = |local, remote| {
        sockets
            .iter()
            .find(|s| (s.local, s.remote) == (local, remote))
    };
    if end(ours, theirs)?.tx_queue > 0 {
        return None;
    }
    Some(sent - end(theirs, ours)?.rx_queue as usize)
}

/// A request whose body is beyond `replay_memory` waits with its body unread, in the
/// kernel's buffers: tollgate has read its head and nothing more. A client that leaves
/// while it waits is noticed all the same, by a reset in the middle of its upload or by
/// the end of its stream behind a whole body, and its request is counted cancelled,
/// never sent; one that stays is sent whole when its turn comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_waits_unread_and_a_client_that_leaves_it_is_noticed() {
    use crate::promises::{group_status, outcome};
    use tokio::io::AsyncWriteExt;
    const BIG: usize = 1 << 20;
    // Beyond replay_memory, and small enough to sit whole in the kernel's buffers.
    const SMALL: usize = 32 * 1024;
    let upstream = Upstream::start_bulk().await;
    let tollgate = Tollgate::start(&format!(
        "[proxy]\nreplay_memory = \"16KiB\"\n\
         [[limit]]\nname = \"one\"\nhosts = [\"127.0.0.1\"]\nconcurrency = 1\n\
         max_wait = \"5m\"\n{ADMIN_ON_PORT_0}"
    ))
    .await;
    let queued = async |n: u64| {
        eventually_async(async || {
            (group_status(&tollgate, "one").await["queued"] == n).then_some(())
        })
        .await
    };
    let _held = hold_the_permit(&tollgate, &upstream).await;

    let body = pattern_bytes(BIG);
    let upload = |path: &str, len: usize| {
        let (url, host) = (upstream.url(path), upstream.authority());
        let head = format!("POST {url} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len}\r\n\r\n");
        [head.as_bytes(), &body[..len]].concat()
    };
    // One leaves with a reset, in the middle of its upload.
    let reset = tokio::net::TcpStream::connect(tollgate.addr).await.unwrap();
    let request = upload("/reset", BIG);
    let mut written = 0;
    while let Ok(n @ 1..) = reset.try_write(&request[written..]) {
        written += n;
    }
    queued(1).await;
    // One sends its whole body, which stays unread: tollgate has read its head only.
    let mut half = tokio::net::TcpStream::connect(tollgate.addr).await.unwrap();
    let request = upload("/half", SMALL);
    half.write_all(&request).await.unwrap();
    queued(2).await;
    let read = eventually(|| read_of(&half, request.len())).await;
    assert_eq!(
        read,
        request.len() - SMALL,
        "tollgate read more than the head"
    );
    // One stays.
    let stays = tokio::spawn({
        let (addr, request) = (tollgate.addr, upload("/stays", BIG));
        async move {
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.write_all(&request).await.unwrap();
            read_response(&mut stream).await
        }
    });
    queued(3).await;

    reset.set_zero_linger().unwrap();
    drop(reset);
    tollgate
        .wait_metric(&outcome("one", "cancelled"), 1.0)
        .await;
    // The end of its stream, behind its body: the client is gone while its request waits.
    half.shutdown().await.unwrap();
    tollgate
        .wait_metric(&outcome("one", "cancelled"), 2.0)
        .await;
    assert_eq!(group_status(&tollgate, "one").await["queued"], 1);

    upstream.release();
    let stays = tokio::time::timeout(BOUND, stays).await.unwrap().unwrap();
    let whole = format!("{BIG} {}", pattern_digest(BIG as u64).hash);
    assert_eq!((stays.status, stays.text()), (200, whole));
    assert_eq!(
        upstream.uploads(),
        [pattern_digest(BIG as u64)],
        "only the upload that stayed reached the upstream"
    );
}

// ---------------------------------------------------------------------------------
// Half-closed clients
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_closed_client_is_treated_as_gone_and_counted_cancelled() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    // max_wait long enough for all of them: none is refused at once as hopeless, so
    // each either leaves or is cancelled.
    let proxy = start_proxy_with_admin(
        "[[limit]]\nname = \"slow\"\nhosts = [\"127.0.0.1\"]\nrate = \"1/min\"\nmax_wait = \"10m\"\n",
    )
    .await;
    take_the_slot(&proxy, &upstream).await;
    const CLIENTS: usize = 5;
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let get = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
            upstream.url(&format!("/half-{i}")),
            upstream.authority()
        );
        stream.write_all(get.as_bytes()).await.unwrap();
        // Request sent, then the write side closed, once tollgate has read the request
        // (a head and a FIN in one read are never seen as a request at all: nothing is
        // sent, nothing is counted).
        wait_until_read(&stream).await;
        stream.shutdown().await.unwrap();
        clients.push(stream);
    }
    // And one that leaves in the middle of its upload, before its request queues.
    let mut upload = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let post = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Length: 100\r\n\r\nonly ten b",
        upstream.url("/upload"),
        upstream.authority()
    );
    upload.write_all(post.as_bytes()).await.unwrap();
    wait_until_read(&upload).await;
    drop(upload);
    let cancelled = format!(
        "tollgate_requests_total{{group=\"slow\",outcome=\"cancelled\"}} {}",
        CLIENTS + 1
    );
    wait_metric_line(&proxy, &cancelled).await;
    for mut stream in clients {
        let mut got = Vec::new();
        let _ = tokio::time::timeout(BOUND, stream.read_to_end(&mut got)).await;
        assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    }
    assert_eq!(upstream.paths(), ["/first"]);
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------
// client_header_timeout: the whole budget of a head, from its first byte
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_trickles_gets_client_header_timeout_from_its_first_byte() {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    // 2 s for the head. `P` at 0 s and `O` at 1.6 s keep the version check busy (HTTP/2's
    // preface starts with `P` too); the rest of the head is in by 3 s. Counted from the
    // first byte it is cut at 2 s; counted from the end of the check, only at 3.6 s.
    let proxy = start_proxy("[proxy]\nclient_header_timeout = \"2s\"\n").await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\n\r\n",
        upstream.url("/trickled"),
        upstream.authority()
    );
    let (first, rest) = head.as_bytes().split_at(2);
    stream.write_all(&first[..1]).await.unwrap();
    // The trickle: `O` only at 1.6 s, then a byte at a time until 3 s.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    stream.write_all(&first[1..]).await.unwrap();
    let pause = Duration::from_millis(1400) / rest.len() as u32;
    for byte in rest {
        if stream.write_all(&[*byte]).await.is_err() {
            break;
        }
        // A byte per pause: the head is whole only at 3 s.
        tokio::time::sleep(pause).await;
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(BOUND, stream.read_to_end(&mut answer)).await;
    assert!(
        !answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    assert!(upstream.paths().is_empty());
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_closed_client_whose_request_went_upstream_is_answered() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream =
        Upstream::start(|_| Reply::ok("answered").delay(std::time::Duration::from_millis(300)))
            .await;
    let proxy = start_proxy("").await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let get = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
        upstream.url("/sent"),
        upstream.authority()
    );
    stream.write_all(get.as_bytes()).await.unwrap();
    // Once the request is out upstream, the client closes its write side.
    wait_in_flight(&upstream, 1).await;
    stream.shutdown().await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(BOUND, stream.read_to_end(&mut answer))
        .await
        .expect("the connection ends")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(answer.ends_with("answered"), "{answer:?}");
    assert_eq!(upstream.paths(), ["/sent"]);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_of_its_response_is_cut_and_frees_the_permit() {
    use tokio::io::AsyncWriteExt;
    let upstream = Upstream::start_bulk().await;
    // A request that waited 5 s for the permit would get 503 (max_wait).
    let proxy = start_proxy(&one_at_a_time("max_wait = \"5s\"\n")).await;
    // A response far bigger than the sockets' buffers, which the client never reads.
    let mut stalled = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let get = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
        upstream.url("/bytes/268435456"),
        upstream.authority()
    );
    stalled.write_all(get.as_bytes()).await.unwrap();
    let (head, _) = read_response_head(&mut stalled).await;
    assert_eq!(head.status, 200);

    // The group's only permit comes back once the write has waited body_idle_timeout.
    let next = reqwest_via(&proxy, None)
        .post(upstream.url("/next"))
        .body("after")
        .send()
        .await
        .unwrap();
    assert_eq!(next.status(), 200);
    assert_eq!(upstream.uploads().len(), 1);
    drop(stalled);
    proxy.shutdown().await;
}
