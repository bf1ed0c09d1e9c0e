//! README, "What a client sees at a limit" and `adaptive`: the 503s of a full queue and
//! of `max_wait` (their `Proxy-Status` details, `Retry-After` and `/metrics` counts), a
//! client that leaves, `max_wait` counted across retries, and the adaptive rate, all
//! through the built binary.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::promises::{client, get, group_status, outcome, send, Answer};
use crate::support::*;

/// `[admin]` on port 0 and one `[[limit]]` named `name` for `upstream`.
fn one_group(name: &str, upstream: &Upstream, extra: &str) -> String {
    format!(
        "{ADMIN_ON_PORT_0}\n[[limit]]\nname = \"{name}\"\nhosts = [\"{}\"]\n{extra}\n",
        upstream.authority()
    )
}

/// Starts `GET url` through `tollgate` in the background; abort it to disconnect.
fn start_get(tollgate: &Tollgate, url: String) -> tokio::task::JoinHandle<Answer> {
    let client = client(tollgate);
    tokio::spawn(async move { send(&client, "GET", &url).await })
}

#[tokio::test]
async fn a_full_queue_answers_503_as_the_readme_shows_and_counts_it() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let config = one_group(
        "mailer",
        &upstream,
        "rate = \"1/m\"\nqueue = 2\nmax_wait = \"1h\"",
    );
    let tollgate = Tollgate::start(&config).await;
    let depth = "tollgate_queue_depth{group=\"mailer\"}";
    assert_eq!(get(&tollgate, &upstream.url("/first")).await.status, 200);
    let waiting = [
        start_get(&tollgate, upstream.url("/w1")),
        start_get(&tollgate, upstream.url("/w2")),
    ];
    tollgate.wait_metric(depth, 2.0).await;

    let full = get(&tollgate, &upstream.url("/third")).await;
    assert_eq!(full.status, 503, "{full:?}");
    assert_eq!(
        full.header("content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(
        full.header("proxy-status"),
        Some(
            "tollgate; error=http_request_denied; \
             details=\"queue full: group mailer already has 2 requests waiting\""
        )
    );
    assert_eq!(
        full.body,
        "tollgate: queue full: group mailer already has 2 requests waiting\n"
    );
    // As README counts it (200 ahead at 5/s: 40 s, rounded up to 41): two ahead at one
    // a minute and this one's own slot, from the first's departure: 180 s, less the
    // seconds the test took since.
    let retry_after: u64 = full.header("retry-after").unwrap().parse().unwrap();
    assert!((170..=181).contains(&retry_after), "{retry_after}");
    assert_eq!(tollgate.metric(&outcome("mailer", "queue_full")).await, 1.0);
    assert_eq!(tollgate.metric(&outcome("mailer", "admitted")).await, 1.0);

    // Clients that leave take their requests out of the queue; they are never sent.
    for w in &waiting {
        w.abort();
    }
    tollgate.wait_metric(depth, 0.0).await;
    tollgate
        .wait_metric(&outcome("mailer", "cancelled"), 2.0)
        .await;
    assert_eq!(upstream.paths(), ["/first"]);
    let status = group_status(&tollgate, "mailer").await;
    assert_eq!(status["counters"]["queue_full"], 1, "{status}");
    assert_eq!(status["counters"]["cancelled"], 2, "{status}");
}

#[tokio::test]
async fn a_request_that_waited_max_wait_gets_503_and_is_never_sent() {
    // One in flight at a time, and the first takes 5 s: the second waits for its turn
    // (no estimate can tell how long) until max_wait ends it.
    let upstream = Upstream::start(|s| {
        Reply::ok("slow").delay(Duration::from_secs(match s.path.as_str() {
            "/slow" => 5,
            _ => 0,
        }))
    })
    .await;
    let config = one_group("single", &upstream, "concurrency = 1\nmax_wait = \"1s\"");
    let tollgate = Tollgate::start(&config).await;
    let slow = start_get(&tollgate, upstream.url("/slow"));
    upstream.wait_for_requests(1).await;

    let late = get(&tollgate, &upstream.url("/late")).await;
    let proxy_status = late.assert_max_wait("single");
    assert!(
        proxy_status.contains("details=\"waited 1s") && proxy_status.contains("(max_wait)"),
        "{proxy_status}"
    );
    assert!(late.body.contains("waited 1s"), "{late:?}");
    assert_eq!(tollgate.metric(&outcome("single", "max_wait")).await, 1.0);

    assert_eq!(slow.await.unwrap().status, 200);
    assert_eq!(upstream.paths(), ["/slow"], "the late request never left");
}

#[tokio::test]
async fn max_wait_counts_from_arrival_with_the_retries_inside_it() {
    // Every answer is a 429 asking for 2 s. The first pause ends within max_wait (3 s),
    // so the request is sent again; the second would end past it, so the client gets
    // the upstream's 429 although retries are left.
    let upstream = Upstream::start(|_| {
        Reply::status(429)
            .header("retry-after", "2")
            .body("slow down")
    })
    .await;
    let config = one_group("retried", &upstream, "max_wait = \"3s\"\nmax_retries = 5");
    let tollgate = Tollgate::start(&config).await;
    let answer = get(&tollgate, &upstream.url("/once")).await;
    assert_eq!(answer.status, 429, "{answer:?}");
    assert_eq!(answer.body, "slow down", "the upstream's own answer");
    assert_eq!(upstream.paths(), ["/once", "/once"]);
    let at = arrivals(&upstream);
    assert!(at[1] - at[0] >= Duration::from_millis(1900), "{at:?}");
    assert_eq!(
        tollgate
            .metric("tollgate_retries_total{group=\"retried\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn a_push_back_steps_the_pace_down_to_min_rate_and_a_calm_round_climbs_back() {
    let refusals = Arc::new(AtomicUsize::new(0));
    let counted = refusals.clone();
    let upstream = Upstream::start(move |s| {
        if s.path.starts_with("/refuse") {
            counted.fetch_add(1, Ordering::SeqCst);
            Reply::status(429).header("retry-after", "2")
        } else {
            Reply::ok("ok")
        }
    })
    .await;
    // max_retries = 0: each refusal reaches the client, so each is one push-back.
    let config = one_group(
        "adaptive",
        &upstream,
        "rate = \"20/s\"\nadaptive = true\nmin_rate = \"17/s\"\nmax_retries = 0",
    );
    let tollgate = Tollgate::start(&config).await;
    let pace = |status: &serde_json::Value| status["pace_per_second"].as_f64();
    assert_eq!(pace(&group_status(&tollgate, "adaptive").await), None);

    // docs/budget.md: a paced refusal steps to `decrease` (0.9) of the pace refused.
    assert_eq!(get(&tollgate, &upstream.url("/refuse1")).await.status, 429);
    let status = group_status(&tollgate, "adaptive").await;
    assert_eq!(pace(&status), Some(18.0), "{status}");
    // Sent after the 2 s pause, so a step of its own: 16.2/s is below the floor.
    assert_eq!(get(&tollgate, &upstream.url("/refuse2")).await.status, 429);
    assert_eq!(refusals.load(Ordering::SeqCst), 2);
    let status = group_status(&tollgate, "adaptive").await;
    assert_eq!(pace(&status), Some(17.0), "held at min_rate: {status}");

    // After the pause, five at once leave at that pace, not at 20/s; their answers are
    // a calm round, which climbs halfway back to the pace last refused (18/s).
    let calls = (0..5).map(|i| start_get(&tollgate, upstream.url(&format!("/ok{i}"))));
    for call in calls.collect::<Vec<_>>() {
        assert_eq!(call.await.unwrap().status, 200);
    }
    let at: Vec<_> = arrivals(&upstream)[2..].to_vec();
    assert_eq!(at.len(), 5);
    assert_paced(&at, Duration::from_secs_f64(1.0 / 17.0), 1);
    let climbed = pace(&group_status(&tollgate, "adaptive").await).unwrap();
    assert!((climbed - 17.5).abs() < 1e-9, "{climbed}");
}

/// "Try it" (docs/try-it.md): scripts/demo-upstream.py's rule on port 0 (one request a
/// second, 429 with Retry-After: 1 to anything faster), behind a group told 2/s.
async fn try_it() -> (Tollgate, Upstream, Vec<u16>, Duration) {
    let next_allowed = std::sync::Mutex::new(std::time::Instant::now());
    let upstream = Upstream::start(move |_| {
        let mut next = next_allowed.lock().unwrap();
        let now = std::time::Instant::now();
        if now >= *next {
            *next = now + Duration::from_secs(1);
            Reply::ok("ok\n")
        } else {
            Reply::status(429)
                .header("retry-after", "1")
                .body("too many requests\n")
        }
    })
    .await;
    let config = one_group("demo", &upstream, "rate = \"2/s\"");
    let tollgate = Tollgate::start(&config).await;
    let started = std::time::Instant::now();
    let calls: Vec<_> = (0..8)
        .map(|i| start_get(&tollgate, upstream.url(&format!("/{i}"))))
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.unwrap().status);
    }
    (tollgate, upstream, statuses, started.elapsed())
}

#[tokio::test]
async fn try_it_eight_parallel_calls_to_an_upstream_of_one_a_second_all_get_200() {
    let (tollgate, upstream, statuses, _) = try_it().await;
    assert_eq!(
        statuses, [200; 8],
        "the app sees a slower 200, not an error"
    );
    // The upstream answered eight 200s (and the 429s tollgate replayed).
    assert!(upstream.requests().len() >= 8, "{:?}", upstream.paths());
    let status = group_status(&tollgate, "demo").await;
    assert_eq!(status["upstream_statuses"]["200"], 8, "{status}");
    assert_eq!(status["phase"], "paced", "{status}");
}

/// README: "its first refusal teaches the group the upstream's 1/s" (a pace of 0.9/s,
/// then 0.98/s once calm). Timed by counting: after the first refusal no other is
/// needed, so the upstream sees eight 200s and one 429 (two if a replay raced the
/// lesson).
#[tokio::test]
async fn try_it_the_first_refusal_teaches_the_group_one_a_second() {
    let (tollgate, upstream, statuses, _) = try_it().await;
    assert_eq!(statuses, [200; 8]);
    let status = group_status(&tollgate, "demo").await;
    assert_eq!(status["ceiling_per_second"], 1.0, "{status}");
    let learned = status["pace_per_second"].as_f64().unwrap();
    assert!((0.9..=0.98).contains(&learned), "{status}");
    let refused = upstream.requests().len() - 8;
    assert!((1..=2).contains(&refused), "{refused} refused: {status}");
}
