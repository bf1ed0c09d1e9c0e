//! Serving on several threads (`server::serve_threads`): each thread has its own socket
//! on the proxy's address and its own upstream pool, and all of them spend the same
//! budgets.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use support::*;

/// One group for the loopback upstream at 20/s: one thread's work, so it has a home
/// thread, and requests leave 50 ms apart.
const PACED: &str = r#"
[[limit]]
name = "paced"
hosts = ["127.0.0.1"]
rate = "20/s"
"#;

/// The value of the counter `series` (name and labels) in the proxy's `/metrics`.
async fn counter(proxy: &Proxy, series: &str) -> u64 {
    let metrics = admin_get(proxy, "/metrics").await;
    let line = metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in:\n{metrics}"));
    line.parse().unwrap()
}

#[tokio::test]
async fn threads_share_one_budget_and_a_paced_group_is_served_by_one_of_them() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_on_threads(PACED, 3).await;

    // 40 requests at once, each on a connection of its own (nothing is idle in the
    // client's pool while they all wait), so the kernel spreads them over the threads.
    let urls = (0..40).map(|i| upstream.url(&format!("/item/{i}")));
    let statuses = get_all_at_once(&proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");

    // One budget: the pace holds across threads (three budgets would let three
    // requests out per 50 ms).
    let at = arrivals(&upstream);
    assert_eq!(at.len(), 40, "every request reached the upstream once");
    assert_paced(&at, Duration::from_millis(50), Duration::from_millis(20));

    // The group's rate is one thread's work, so its connections are served by its home
    // thread: those the kernel gave the two other threads were moved there (with 40
    // connections over three threads, all on one thread is a chance of 3^-39)...
    let moved = counter(&proxy, r#"tollgate_connections_moved_total{group="paced"}"#).await;
    assert!((1..40).contains(&moved), "{moved} of 40 connections moved");
    // ...and one thread's pool carried every request. They left 50 ms apart and were
    // answered at once, so one pool needs one upstream connection (two if a stall kept
    // the first busy when the next left); each thread has a pool of its own, and the
    // three threads that accepted them would have needed three.
    let connections: BTreeSet<usize> = upstream.requests().iter().map(|s| s.conn).collect();
    assert!(connections.len() <= 2, "{connections:?}");

    let addr = proxy.addr;
    // Every thread drains and returns (shutdown panics past its bound)...
    proxy.shutdown().await;
    // ...and every thread's socket is closed.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn a_group_without_a_rate_is_served_where_its_connections_arrive() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_on_threads(
        r#"
        [[limit]]
        name = "open"
        hosts = ["127.0.0.1"]
        concurrency = 4
        "#,
        3,
    )
    .await;
    let urls = (0..40).map(|i| upstream.url(&format!("/item/{i}")));
    let statuses = get_all_at_once(&proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(upstream.requests().len(), 40);
    // Its work is not bounded by a rate, so no thread is its home: every thread serves
    // the connections it accepted.
    let moved = counter(&proxy, r#"tollgate_connections_moved_total{group="open"}"#).await;
    assert_eq!(moved, 0);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_moved_to_their_groups_thread_are_served_during_the_grace() {
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    let config = format!("[proxy]\nshutdown_grace = \"30s\"\n{PACED}");
    let mut proxy = start_proxy_on_threads(&config, 3).await;
    take_the_slot(&proxy, &upstream).await;

    // Twelve new connections whose requests wait in the group when shutdown begins,
    // those the other threads accepted on its home thread.
    let (addr, authority) = (proxy.addr, upstream.authority());
    let waiting: Vec<_> = (0..12)
        .map(|i| {
            let authority = authority.clone();
            tokio::spawn(async move {
                let get =
                    format!("GET http://{authority}/w{i} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
                raw_request(addr, get.as_bytes()).await
            })
        })
        .collect();
    wait_queued(&proxy, "paced", 12).await;
    let moved = counter(&proxy, r#"tollgate_connections_moved_total{group="paced"}"#).await;
    assert!(moved >= 1, "none of 12 connections moved");
    proxy.begin_shutdown();

    // Each was asked before the listeners closed, so each is served, on whichever
    // thread it waited, and its connection then closed.
    for waited in waiting {
        let response = waited.await.unwrap();
        assert_eq!((response.status, response.text()), (200, "served".into()));
        assert_eq!(response.header("connection"), Some("close"));
    }
    let mut paths = upstream.paths();
    paths.sort();
    let mut expected: Vec<String> = (0..12).map(|i| format!("/w{i}")).collect();
    expected.push("/first".into());
    expected.sort();
    assert_eq!(paths, expected);
    proxy.shutdown().await;
}
