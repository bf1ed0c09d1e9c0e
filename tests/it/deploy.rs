//! What running tollgate in a cluster relies on: `/readyz`, which a readiness probe
//! asks.

use crate::support::*;

// ---------------------------------------------------------------------------------
// /readyz
// ---------------------------------------------------------------------------------

/// SIGTERM with a request queued: `/readyz` turns `503` at once (a Service stops
/// sending) while the request still waits for its slot, `/healthz` stays `200` (a
/// liveness probe does not kill a draining pod), and the queued request is answered
/// by the upstream before the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_503_at_sigterm_while_a_queued_request_is_still_answered() {
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    // One request per 5 s: the second waits for its slot far longer than the checks
    // below take.
    let mut tollgate = Tollgate::start(&format!(
        "[proxy]\nshutdown_grace = \"30s\"\n\n[[limit]]\nname = \"slow\"\n\
         hosts = [\"127.0.0.1\"]\nrate = \"1/5s\"\n{ADMIN_ON_PORT_0}"
    ))
    .await;
    assert_eq!(tollgate.admin("/readyz").await, (200, "ready\n".into()));
    let first = curl(&["-x", &tollgate.url(), &upstream.url("/first")], &[]).await;
    assert_eq!((first.code, first.status), (0, 200), "{}", first.stderr);
    let (proxy_url, url) = (tollgate.url(), upstream.url("/queued"));
    let queued = tokio::spawn(async move { curl(&["-x", &proxy_url, &url], &[]).await });
    let depth = "tollgate_queue_depth{group=\"slow\"}";
    tollgate.wait_metric(depth, 1.0).await;

    tollgate.signal("TERM").await;
    let unready = within_bound(async || {
        let (status, body) = tollgate.admin("/readyz").await;
        (status == 503).then_some(body)
    })
    .await
    .expect("/readyz turned 503 after SIGTERM");
    assert_eq!(unready, "shutting down: draining queued requests\n");
    // Asked after /readyz said 503: the request was queued then, as it still is now.
    assert_eq!(tollgate.metric(depth).await, 1.0, "{}", tollgate.log());
    assert_eq!(tollgate.admin("/healthz").await, (200, "ok\n".into()));

    let out = queued.await.unwrap();
    assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);
    assert_eq!(out.text(), "served");
    assert_eq!(upstream.paths(), ["/first", "/queued"]);
    let status = tollgate.wait_exit().await;
    assert_eq!(status.code(), Some(0), "{}", tollgate.log());
    assert!(
        tollgate.log().contains("sent=1 answered_503=0 cut=0"),
        "{}",
        tollgate.log()
    );
}
