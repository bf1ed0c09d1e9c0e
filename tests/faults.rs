//! Faults: a POST is never replayed after a status that may mean it was carried out;
//! malformed upstream answers; stalled bodies; buffered bodies within a memory budget.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use support::*;

/// An upstream that answers the first request with `refusal()` and 200 "ok" after that.
async fn refusing_once(refusal: impl Fn() -> Reply + Send + Sync + 'static) -> Upstream {
    let count = Arc::new(AtomicUsize::new(0));
    Upstream::start(move |_| {
        if count.fetch_add(1, Ordering::SeqCst) == 0 {
            refusal()
        } else {
            Reply::ok("ok")
        }
    })
    .await
}

const RETRY_500: &str = r#"
[[limit]]
name = "api"
hosts = ["127.0.0.1"]
retry_statuses = [429, 500, 503]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_is_not_replayed_after_a_status_that_may_mean_it_was_processed() {
    let upstream = refusing_once(|| Reply::status(500).header("retry-after", "0")).await;
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
    let upstream = refusing_once(|| Reply::status(500).header("retry-after", "0")).await;
    let resp = client.get(upstream.url("/read")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(upstream.paths(), ["/read", "/read"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_is_replayed_after_429_and_503_with_retry_after() {
    for status in [429, 503] {
        let upstream =
            refusing_once(move || Reply::status(status).header("retry-after", "0")).await;
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
