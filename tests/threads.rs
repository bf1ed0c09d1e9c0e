//! Serving on several threads (`server::serve_threads`): each thread has its own socket
//! on the proxy's address and its own upstream pool, and all of them spend the same
//! budgets.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use support::*;
use tokio::sync::oneshot;
use tollgate::server::Sockets;

#[tokio::test]
async fn threads_share_one_budget_and_each_serves_connections() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let config = tollgate::config::Config::parse(
        r#"
        [[limit]]
        name = "paced"
        hosts = ["127.0.0.1"]
        rate = "20/s"
        "#,
        "threads.toml",
    )
    .unwrap();
    let sockets = Sockets::listen("127.0.0.1:0".parse().unwrap(), 3).unwrap();
    let addr = sockets.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = tokio::spawn(tollgate::server::serve_threads(
        sockets,
        None,
        config,
        async {
            let _ = stopped.await;
        },
    ));

    // 40 requests at once, each on a connection of its own (nothing is idle in the
    // client's pool while they all wait), so the kernel spreads them over the threads.
    let client = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://{addr}")).unwrap())
        .timeout(BOUND)
        .build()
        .unwrap();
    let calls = (0..40).map(|i| {
        let client = client.clone();
        let url = upstream.url(&format!("/item/{i}"));
        async move { client.get(url).send().await.unwrap().status().as_u16() }
    });
    let statuses = futures_util::future::join_all(calls).await;
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

    let _ = stop.send(());
    tokio::time::timeout(BOUND, serving)
        .await
        .expect("every thread drains and returns")
        .unwrap()
        .unwrap();
    // Every thread's socket is closed.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
