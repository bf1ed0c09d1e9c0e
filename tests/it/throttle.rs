//! Throttling end to end: real upstreams record when requests arrive; the assertions are
//! about order, spacing and counts seen there, never about how long the test took.

use std::time::{Duration, Instant};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_requests_leave_at_the_pace() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy(
        r#"
        [[limit]]
        name = "paced"
        hosts = ["127.0.0.1"]
        rate = "20/s"
        "#,
    )
    .await;
    let urls = (0..100).map(|i| upstream.url(&format!("/item/{i}")));
    let statuses = get_all_at_once(&proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");

    let at = arrivals(&upstream);
    assert_eq!(at.len(), 100, "every request reached the upstream once");
    assert_paced(&at, Duration::from_millis(50), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_of_one_group_share_its_budget() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy(
        r#"
        [[limit]]
        name = "shared"
        hosts = ["127.0.0.1", "localhost"]
        rate = "10/s"
        "#,
    )
    .await;
    let port = upstream.addr().port();
    let host = |i: usize| if i % 2 == 0 { "127.0.0.1" } else { "localhost" };
    // One request per host name first, one after the other, so that each has a pooled
    // upstream connection: a request that must resolve `localhost` and dial on a busy
    // machine can reach the upstream tens of milliseconds late, which would make its gap
    // to the next one look short. These are not part of the spacing measured below.
    for i in 0..2 {
        let warm = format!("http://{}:{port}/warm", host(i));
        assert_eq!(get_all_at_once(&proxy, [warm]).await, [200]);
    }
    let urls = (0..20).map(|i| format!("http://{}:{port}/{i}", host(i)));
    let statuses = get_all_at_once(&proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");

    let seen: Vec<_> = upstream
        .requests()
        .into_iter()
        .filter(|s| s.path != "/warm")
        .collect();
    assert_eq!(seen.len(), 20);
    let hosts: std::collections::HashSet<_> = seen
        .iter()
        .map(|s| s.header("host").unwrap().to_string())
        .collect();
    assert_eq!(hosts.len(), 2, "both host names were used: {hosts:?}");
    let mut at: Vec<_> = seen.iter().map(|s| s.at).collect();
    at.sort();
    assert_paced(&at, Duration::from_millis(100), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_group_is_not_slowed_by_a_busy_one() {
    let slow = Upstream::start(|_| Reply::ok("slow")).await;
    let fast = Upstream::start_at([127, 0, 0, 2].into(), |_| Reply::ok("fast")).await;
    let proxy = start_proxy(
        r#"
        [[limit]]
        name = "slow"
        hosts = ["127.0.0.1"]
        rate = "2/s"
        "#,
    )
    .await;
    let client = reqwest_via(&proxy, None);
    // Six requests queue in the slow group: they need 2.5 s to drain.
    let queued: Vec<_> = (0..6)
        .map(|i| {
            let (client, url) = (client.clone(), slow.url(&format!("/{i}")));
            tokio::spawn(async move { client.get(url).send().await.unwrap().status() })
        })
        .collect();
    slow.wait_for_requests(1).await;
    // Ten requests to a host of another group meanwhile.
    for i in 0..10 {
        let resp = client.get(fast.url(&format!("/{i}"))).send().await.unwrap();
        assert_eq!(resp.status(), 200);
    }
    let fast_done = Instant::now();
    for q in queued {
        assert_eq!(q.await.unwrap(), 200);
    }
    // All ten fast requests were answered while the slow group still had most of its
    // queue waiting.
    let slow_after = slow.requests().iter().filter(|s| s.at > fast_done).count();
    assert!(
        slow_after >= 3,
        "only {slow_after} slow requests were still queued"
    );
    assert_eq!(fast.requests().len(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_never_exceeds_the_limit() {
    let upstream = Upstream::start(|_| Reply::ok("slow").delay(Duration::from_millis(150))).await;
    let proxy = start_proxy(
        r#"
        [[limit]]
        name = "two-at-a-time"
        hosts = ["127.0.0.1"]
        concurrency = 2
        "#,
    )
    .await;
    let client = reqwest_via(&proxy, None);
    let calls = (0..10).map(|i| {
        let (client, url) = (client.clone(), upstream.url(&format!("/{i}")));
        async move { client.get(url).send().await.unwrap().text().await.unwrap() }
    });
    let bodies = futures_util::future::join_all(calls).await;
    assert!(bodies.iter().all(|b| b == "slow"));
    assert_eq!(upstream.requests().len(), 10);
    assert_eq!(
        upstream.max_in_flight(),
        2,
        "the upstream saw more than 2 at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_with_retry_after() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy(
        r#"
        [[limit]]
        name = "tiny"
        hosts = ["127.0.0.1"]
        rate = "1/s"
        queue = 2
        "#,
    )
    .await;
    let client = reqwest_via(&proxy, None);
    let calls = (0..5).map(|i| {
        let (client, url) = (client.clone(), upstream.url(&format!("/{i}")));
        async move {
            let resp = client.get(url).send().await.unwrap();
            let status = resp.status().as_u16();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            let proxy_status = resp
                .headers()
                .get("proxy-status")
                .map(|v| v.to_str().unwrap().to_string());
            let body = resp.text().await.unwrap();
            (status, retry_after, proxy_status, body)
        }
    });
    let results = futures_util::future::join_all(calls).await;
    let ok = results.iter().filter(|r| r.0 == 200).count();
    let refused: Vec<_> = results.iter().filter(|r| r.0 == 503).collect();
    assert_eq!(ok + refused.len(), 5, "{results:?}");
    assert!(
        !refused.is_empty(),
        "a queue of 2 cannot hold 5 requests: {results:?}"
    );
    for (_, retry_after, proxy_status, body) in refused {
        let secs: u64 = retry_after.as_ref().expect("Retry-After").parse().unwrap();
        assert!((1..=5).contains(&secs), "Retry-After {secs}");
        let ps = proxy_status.as_ref().expect("Proxy-Status");
        assert!(
            ps.starts_with("tollgate; error=http_request_denied"),
            "{ps}"
        );
        assert!(
            body.contains("queue full") && body.contains("tiny"),
            "{body}"
        );
    }
    // Exactly the answered requests reached the upstream.
    assert_eq!(upstream.requests().len(), ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_wait_answers_503_and_the_request_is_never_sent() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy(
        r#"
        [[limit]]
        name = "patient"
        hosts = ["127.0.0.1"]
        rate = "1/m"
        max_wait = "300ms"
        "#,
    )
    .await;
    let client = reqwest_via(&proxy, None);
    let first = client.get(upstream.url("/first")).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let second = client.get(upstream.url("/second")).send().await.unwrap();
    assert_eq!(second.status(), 503);
    let retry_after: u64 = second.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (50..=60).contains(&retry_after),
        "the next slot is ~1 min away: {retry_after}"
    );
    let body = second.text().await.unwrap();
    assert!(
        body.contains("max_wait") && body.contains("patient"),
        "{body}"
    );
    let paths = upstream.paths();
    assert_eq!(paths, ["/first"]);
}

/// Sends one request on a raw connection, waits until `group`'s queue holds it (and
/// only it), closes the connection without reading the answer, and waits until the
/// request is counted as the `cancelled`-th one cancelled.
async fn send_and_leave(proxy: &Proxy, request: String, group: &str, cancelled: usize) {
    use tokio::io::AsyncWriteExt;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(request.as_bytes()).await.unwrap();
    conn.flush().await.unwrap();
    wait_queued(proxy, group, 1).await;
    drop(conn);
    let line =
        format!("tollgate_requests_total{{group=\"{group}\",outcome=\"cancelled\"}} {cancelled}");
    wait_metric_line(proxy, &line).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_left_is_never_sent() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "one-per-2s"
        hosts = ["127.0.0.1"]
        rate = "1/2s"
        "#,
    )
    .await;
    take_the_slot(&proxy, &upstream).await;

    // Two clients queue and leave: one without a body, one with a small body.
    let authority = upstream.authority();
    send_and_leave(
        &proxy,
        format!("GET http://{authority}/gone-get HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
        "one-per-2s",
        1,
    )
    .await;
    send_and_leave(
        &proxy,
        format!(
            "POST http://{authority}/gone-post HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 5\r\n\r\nhello"
        ),
        "one-per-2s",
        2,
    )
    .await;
    // A request that stays takes the next slot; the abandoned ones never went out.
    assert_eq!(
        reqwest_via(&proxy, None)
            .get(upstream.url("/stayed"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let paths = upstream.paths();
    assert_eq!(paths, ["/first", "/stayed"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_are_paced_and_hold_a_permit_while_open() {
    let ca = TestCa::new();
    let upstream = Upstream::start_tls(|_| Reply::ok("secret"), &ca).await;
    let proxy = start_proxy(
        r#"
        [proxy]
        connect_ports = ["*"]
        [[limit]]
        name = "tunnels"
        hosts = ["127.0.0.1"]
        rate = "5/s"
        "#,
    )
    .await;
    let cacert = ca.ca_pem_path();
    let url = upstream.url("/x");
    let runs = (0..6).map(|_| {
        let (cacert, url, proxy_url) = (cacert.clone(), url.clone(), proxy.url());
        async move {
            curl(
                &["--cacert", cacert.to_str().unwrap(), &url],
                &[("https_proxy", &proxy_url)],
            )
            .await
        }
    });
    for out in futures_util::future::join_all(runs).await {
        assert_eq!(out.status, 200, "{}", out.text());
        assert_eq!(out.text(), "secret");
    }
    // Each curl opened its own tunnel (one TLS connection each), paced at 5/s: the
    // tunnel openings are what is limited, so measure when the upstream accepted them
    // (the request heads come after each client's TLS handshake).
    assert_eq!(upstream.connections(), 6);
    let mut accepted = upstream.accepted_at();
    accepted.sort();
    assert_paced(&accepted, Duration::from_millis(200), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_tunnel_holds_its_concurrency_permit() {
    // A plain HTTP server behind the tunnel: it closes its side when the client does.
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_with_admin(
        r#"
        [proxy]
        connect_ports = ["*"]
        [[limit]]
        name = "one-tunnel"
        hosts = ["127.0.0.1"]
        concurrency = 1
        max_wait = "300ms"
        "#,
    )
    .await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let target = upstream.addr();
    let connect = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    let mut first = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    first.write_all(connect.as_bytes()).await.unwrap();
    let mut head = [0u8; 12];
    first.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    // While the first tunnel is open, a second waits for the permit and gives up.
    let mut second = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    second.write_all(connect.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 12];
    second.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"HTTP/1.1 503");
    let status = admin_get(&proxy, "/status").await;
    assert!(status.contains(r#""in_flight": 1"#), "{status}");
    // Closing the first tunnel returns the permit.
    drop(first);
    let mut third = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    third.write_all(connect.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 12];
    third.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"HTTP/1.1 200");
    assert_eq!(
        upstream.connections(),
        2,
        "the refused tunnel never dialled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_happened() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "counted"
        hosts = ["127.0.0.1"]
        "#,
    )
    .await;
    let client = reqwest_via(&proxy, None);
    for i in 0..3 {
        client
            .get(upstream.url(&format!("/{i}")))
            .send()
            .await
            .unwrap();
    }
    let metrics = admin_get(&proxy, "/metrics").await;
    for line in [
        r#"tollgate_requests_total{group="counted",outcome="admitted"} 3"#,
        r#"tollgate_queue_depth{group="counted"} 0"#,
        r#"tollgate_in_flight{group="counted"} 0"#,
        r#"tollgate_queue_wait_seconds_count{group="counted"} 3"#,
    ] {
        assert!(metrics.contains(line), "missing {line} in\n{metrics}");
    }
    assert_eq!(admin_get(&proxy, "/healthz").await, "ok\n");
    assert_eq!(upstream.requests().len(), 3);
}

/// A new connection's first request waits in its group before hyper reads it; a later
/// request on a kept-alive connection waits inside hyper. The two are one queue.
const ONE_AT_A_TIME: &str = r#"
    [[limit]]
    name = "one-at-a-time"
    hosts = ["127.0.0.1"]
    concurrency = 1
    "#;

/// An upstream that answers `/hold` after `hold`, everything else at once.
async fn upstream_holding(hold: Duration) -> Upstream {
    Upstream::start(move |seen| match seen.path.as_str() {
        "/hold" => Reply::ok("held").delay(hold),
        _ => Reply::ok("ok"),
    })
    .await
}

/// Sends `GET /hold` on its own connection and waits until the upstream has it, so the
/// group's one permit is taken; returns the client's task.
async fn hold_the_permit(
    proxy: &Proxy,
    upstream: &Upstream,
) -> tokio::task::JoinHandle<RawResponse> {
    let (addr, authority) = (proxy.addr, upstream.authority());
    let before = upstream.requests().len();
    let held = tokio::spawn(async move {
        let get = format!("GET http://{authority}/hold HTTP/1.1\r\nHost: {authority}\r\n\r\n");
        raw_request(addr, get.as_bytes()).await
    });
    upstream.wait_for_requests(before + 1).await;
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_and_kept_alive_connections_wait_in_one_queue_in_arrival_order() {
    use tokio::io::AsyncWriteExt;
    let upstream = upstream_holding(Duration::from_millis(500)).await;
    let proxy = start_proxy_with_admin(ONE_AT_A_TIME).await;
    let authority = upstream.authority();
    let get =
        |path: &str| format!("GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n\r\n");

    // Three kept-alive connections, each past its first request.
    let mut kept = Vec::new();
    for i in 0..3 {
        let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        conn.write_all(get(&format!("/warm-{i}")).as_bytes())
            .await
            .unwrap();
        assert_eq!(read_response(&mut conn).await.status, 200);
        kept.push(conn);
    }
    let held = hold_the_permit(&proxy, &upstream).await;

    // Alternate: a kept-alive connection's request, then a new connection's, each
    // queued before the next is sent.
    let mut fresh = Vec::new();
    for i in 0..6 {
        let request = get(&format!("/{i}"));
        if i % 2 == 0 {
            kept[i / 2].write_all(request.as_bytes()).await.unwrap();
        } else {
            let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
            conn.write_all(request.as_bytes()).await.unwrap();
            fresh.push(conn);
        }
        wait_queued(&proxy, "one-at-a-time", i + 1).await;
    }
    assert_eq!(
        upstream.requests().len(),
        4,
        "nothing left while the permit was held"
    );

    assert_eq!(held.await.unwrap().status, 200);
    for conn in kept.iter_mut().chain(fresh.iter_mut()) {
        let response = read_response(conn).await;
        assert_eq!((response.status, response.text()), (200, "ok".into()));
    }
    let paths = upstream.paths();
    assert_eq!(
        paths,
        ["/warm-0", "/warm-1", "/warm-2", "/hold", "/0", "/1", "/2", "/3", "/4", "/5"],
        "one queue, first come first served, whichever kind of connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_on_a_kept_alive_connection_whose_client_left_is_never_sent() {
    use tokio::io::AsyncWriteExt;
    let upstream = upstream_holding(Duration::from_millis(300)).await;
    let proxy = start_proxy_with_admin(ONE_AT_A_TIME).await;
    let authority = upstream.authority();
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let first = format!("GET http://{authority}/first HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    conn.write_all(first.as_bytes()).await.unwrap();
    assert_eq!(read_response(&mut conn).await.status, 200);

    let held = hold_the_permit(&proxy, &upstream).await;
    let gone = format!("GET http://{authority}/gone HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    conn.write_all(gone.as_bytes()).await.unwrap();
    wait_queued(&proxy, "one-at-a-time", 1).await;
    drop(conn);
    wait_queued(&proxy, "one-at-a-time", 0).await;

    assert_eq!(held.await.unwrap().status, 200);
    let client = reqwest_via(&proxy, None);
    let after = client.get(upstream.url("/after")).send().await.unwrap();
    assert_eq!(after.status(), 200);
    let paths = upstream.paths();
    assert_eq!(paths, ["/first", "/hold", "/after"]);
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(
        metrics.contains(r#"tollgate_requests_total{group="one-at-a-time",outcome="cancelled"} 1"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_pieces_and_one_pipelined_behind_it_reach_the_upstream_whole() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Held long enough for the three pieces below to arrive on a loaded machine:
    // the permit must still be taken when the request is whole, or it never queues.
    let upstream = upstream_holding(Duration::from_secs(3)).await;
    let proxy = start_proxy_with_admin(ONE_AT_A_TIME).await;
    let authority = upstream.authority();
    let held = hold_the_permit(&proxy, &upstream).await;

    // A new connection's request arrives in three pieces; it queues once it is whole.
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST http://{authority}/upload HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 11\r\n\r\n"
    );
    for piece in [head.as_bytes(), b"hello", b" world"] {
        conn.write_all(piece).await.unwrap();
        // The proxy reads each piece before the next is sent.
        wait_until_read(&conn).await;
    }
    wait_queued(&proxy, "one-at-a-time", 1).await;
    // A second request behind it on the same connection is not the client leaving.
    let next = format!(
        "GET http://{authority}/next HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(next.as_bytes()).await.unwrap();

    // Both answers, in order, then the close the second asked for.
    let mut answers = String::new();
    conn.read_to_string(&mut answers).await.unwrap();
    assert_eq!(
        answers.matches("HTTP/1.1 200 OK\r\n").count(),
        2,
        "{answers}"
    );
    assert_eq!(held.await.unwrap().status, 200);
    let seen = upstream.requests();
    let paths: Vec<_> = seen.iter().map(|s| s.path.clone()).collect();
    assert_eq!(paths, ["/hold", "/upload", "/next"]);
    assert_eq!(seen[1].body, "hello world");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_body_has_not_arrived_holds_no_permit() {
    use tokio::io::AsyncWriteExt;
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "one-at-a-time"
        hosts = ["127.0.0.1"]
        concurrency = 1
        max_wait = "2s"
        "#,
    )
    .await;
    let authority = upstream.authority();
    let mut slow = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST http://{authority}/late HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 5\r\n\r\n"
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    // The proxy has the head and waits for the body.
    wait_until_read(&slow).await;

    // The group's one permit is free for others until the body is there.
    let client = reqwest_via(&proxy, None);
    let after = client.get(upstream.url("/meanwhile")).send().await.unwrap();
    assert_eq!(after.status(), 200);
    slow.write_all(b"hello").await.unwrap();
    let late = read_response(&mut slow).await;
    assert_eq!(late.status, 200);
    let seen = upstream.requests();
    let paths: Vec<_> = seen.iter().map(|s| s.path.clone()).collect();
    assert_eq!(paths, ["/meanwhile", "/late"]);
    assert_eq!(seen[1].body, "hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_hyper_refuses_does_not_take_a_slot() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "slow"
        hosts = ["127.0.0.1"]
        rate = "1/m"
        "#,
    )
    .await;
    take_the_slot(&proxy, &upstream).await;

    // The group would make it wait, but its head is bad: answered at once, not queued
    // for a minute and refused after spending the next slot.
    let authority = upstream.authority();
    let bad = format!(
        "POST http://{authority}/bad HTTP/1.1\r\nHost: {authority}\r\nContent-Length: abc\r\n\r\n"
    );
    let response = raw_request(proxy.addr, bad.as_bytes()).await;
    assert_eq!(response.status, 400);
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(
        metrics.contains(r#"tollgate_requests_total{group="slow",outcome="admitted"} 1"#)
            && metrics.contains(r#"tollgate_queue_depth{group="slow"} 0"#),
        "{metrics}"
    );
    let paths = upstream.paths();
    assert_eq!(paths, ["/first"]);
}

/// A request that waits has its head and body copied out of its
/// connection's read buffer before it queues (`pushback.rs`, `Replayable::read`). 160
/// requests on kept-alive connections queue behind one that holds the group's only
/// permit: every one must reach the upstream whole and in order, its repeated headers
/// and its `Authorization` included (a copy that lost or mixed up a value shows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_deep_arrive_whole_and_in_order() {
    use tokio::io::AsyncWriteExt;
    const QUEUED: usize = 160;
    // The holder's download waits at the bulk upstream's gate, and with it the permit.
    let holder = Upstream::start_bulk().await;
    let upstream = Upstream::start_at([127, 0, 0, 2].into(), |seen| {
        Reply::ok(format!("got {}", seen.path))
    })
    .await;
    let proxy = start_proxy_with_admin(
        r#"
        [proxy]
        client_header_timeout = "1h"
        [[limit]]
        name = "one-at-a-time"
        hosts = ["127.0.0.1", "127.0.0.2"]
        concurrency = 1
        queue = 1000
        max_wait = "1h"
        "#,
    )
    .await;
    let authority = upstream.authority();
    // Each connection's first request is answered first: a later request on a
    // connection is the kind that queues after hyper has parsed it.
    let mut conns = Vec::new();
    for _ in 0..QUEUED {
        let warm = format!("GET http://{authority}/warm HTTP/1.1\r\nHost: {authority}\r\n\r\n");
        let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        conn.write_all(warm.as_bytes()).await.unwrap();
        let warmed = tokio::time::timeout(BOUND, read_response(&mut conn)).await;
        assert_eq!(warmed.expect("warm-up answered").status, 200);
        conns.push(conn);
    }
    let mut holding = reqwest_via(&proxy, None)
        .get(holder.url("/bytes/100000?hold=1000"))
        .send()
        .await
        .unwrap();
    assert_eq!(holding.status(), 200);
    assert!(
        holding.chunk().await.unwrap().is_some(),
        "the held body began"
    );

    for (i, conn) in conns.iter_mut().enumerate() {
        let body = format!("body-{i}");
        let request = format!(
            "POST http://{authority}/q/{i} HTTP/1.1\r\nHost: {authority}\r\n\
             Authorization: Bearer token-{i}\r\nAccept: text/plain\r\n\
             Accept: application/json;n={i}\r\nX-N: {i}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(request.as_bytes()).await.unwrap();
        // Joined before the next is sent, so the queue's order is this loop's.
        wait_queued(&proxy, "one-at-a-time", i + 1).await;
    }
    holder.release();
    while holding.chunk().await.unwrap().is_some() {}
    for (i, conn) in conns.iter_mut().enumerate() {
        let response = tokio::time::timeout(BOUND, read_response(conn))
            .await
            .unwrap_or_else(|_| panic!("request {i} unanswered"));
        assert_eq!(response.status, 200);
        assert_eq!(
            String::from_utf8_lossy(&response.body),
            format!("got /q/{i}")
        );
    }

    let seen: Vec<_> = upstream
        .requests()
        .into_iter()
        .filter(|s| s.path != "/warm")
        .collect();
    assert_eq!(
        seen.len(),
        QUEUED,
        "each queued request reached the upstream once"
    );
    for (i, s) in seen.iter().enumerate() {
        assert_eq!(
            s.path,
            format!("/q/{i}"),
            "the upstream's order is the queue's"
        );
        let bearer = format!("Bearer token-{i}");
        assert_eq!(s.header("authorization"), Some(bearer.as_str()));
        assert_eq!(s.header("x-n"), Some(i.to_string().as_str()));
        let accept: Vec<_> = s.headers.get_all("accept").iter().collect();
        let json = format!("application/json;n={i}");
        assert_eq!(accept, ["text/plain", json.as_str()], "request {i}");
        assert_eq!(s.body, format!("body-{i}"));
    }
}
