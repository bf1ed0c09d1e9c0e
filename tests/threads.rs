//! Serving on several threads (`server::serve_threads`): each thread has its own socket
//! on the proxy's address and its own upstream pool, and all of them spend the same
//! budgets.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use support::*;

#[tokio::test]
async fn threads_share_one_budget_and_each_serves_connections() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_on_threads(
        r#"
        [[limit]]
        name = "paced"
        hosts = ["127.0.0.1"]
        rate = "20/s"
        "#,
        3,
    )
    .await;

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
    // Requests leave 50 ms apart and are answered at once, so one thread's pool would
    // carry them all on one upstream connection; each thread has a pool of its own, so
    // more than one connection means more than one thread served.
    let connections: BTreeSet<usize> = upstream.requests().iter().map(|s| s.conn).collect();
    assert!(
        connections.len() >= 2,
        "all 40 requests came through one thread's pool: {connections:?}"
    );

    let addr = proxy.addr;
    // Every thread drains and returns (shutdown panics past its bound)...
    proxy.shutdown().await;
    // ...and every thread's socket is closed.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
