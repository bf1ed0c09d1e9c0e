//! Serving on a multi-threaded runtime, as the binary does: connections served by
//! different threads spend the same budgets, and shutdown drains every thread's.

use std::time::Duration;

use crate::support::*;

/// One group for the loopback upstream at 20/s: requests leave 50 ms apart.
const PACED: &str = r#"
[[limit]]
name = "paced"
hosts = ["127.0.0.1"]
rate = "20/s"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn threads_share_one_budget() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_with_admin(PACED).await;

    // 40 requests at once, each on a connection of its own (nothing is idle in the
    // client's pool while they all wait), served by whichever thread runs them.
    let urls = (0..40).map(|i| upstream.url(&format!("/item/{i}")));
    let statuses = get_all_at_once(&proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");

    // One budget: the pace holds across threads (three budgets would let three
    // requests out per 50 ms).
    let at = arrivals(&upstream);
    assert_eq!(at.len(), 40, "every request reached the upstream once");
    assert_paced(&at, Duration::from_millis(50), 1);

    let addr = proxy.addr;
    // The server drains and returns (shutdown panics past its bound)...
    proxy.shutdown().await;
    // ...and its socket is closed.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_on_every_thread_are_served_during_the_grace() {
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    let config = format!("[proxy]\nshutdown_grace = \"30s\"\n{PACED}");
    let mut proxy = start_proxy_with_admin(&config).await;
    take_the_slot(&proxy, &upstream).await;

    // Twelve new connections whose requests wait in the group when shutdown begins.
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
    proxy.begin_shutdown();

    // Each was asked before the listener closed, so each is served, on whichever
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
