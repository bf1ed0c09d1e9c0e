//! Upstream push-back end to end: loopback upstreams answer 429 with `Retry-After` in
//! each form and with rate-limit headers; the assertions are about what the upstream
//! received and when (relative to its own earlier arrivals), and what the client got.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::*;

const GROUP: &str = r#"
[[limit]]
name = "api"
hosts = ["127.0.0.1"]
"#;

/// Time between the upstream's first and second arrival.
fn retry_gap(upstream: &Upstream) -> Duration {
    let seen = upstream.requests();
    assert!(
        seen.len() >= 2,
        "expected a retry, the upstream saw {}",
        seen.len()
    );
    seen[1].at - seen[0].at
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_delta_seconds_is_retried_after_the_pause() {
    let upstream = refusing(1, || Reply::status(429).header("retry-after", "1")).await;
    let proxy = start_proxy_with_admin(GROUP).await;
    let resp = reqwest_via(&proxy, None)
        .get(upstream.url("/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "ok");
    assert_eq!(upstream.requests().len(), 2);
    assert!(
        retry_gap(&upstream) >= Duration::from_millis(995),
        "{:?}",
        retry_gap(&upstream)
    );
    let metrics = admin_get(&proxy, "/metrics").await;
    for line in [
        r#"tollgate_retries_total{group="api"} 1"#,
        r#"tollgate_upstream_pauses_total{group="api"} 1"#,
        r#"tollgate_pushback_passed_through_total{group="api"} 0"#,
    ] {
        assert!(metrics.contains(line), "missing {line}:\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_date_is_read_against_the_upstreams_date_header() {
    // The upstream's clock is one hour ahead; it asks for 2 s by its own clock.
    let upstream = refusing(1, || {
        let skewed = SystemTime::now() + Duration::from_secs(3600);
        Reply::status(429)
            .header("date", &httpdate::fmt_http_date(skewed))
            .header(
                "retry-after",
                &httpdate::fmt_http_date(skewed + Duration::from_secs(2)),
            )
    })
    .await;
    let proxy = start_proxy(GROUP).await;
    let resp = reqwest_via(&proxy, None)
        .get(upstream.url("/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let gap = retry_gap(&upstream);
    assert!(gap >= Duration::from_millis(1995), "{gap:?}");
    assert!(
        gap < Duration::from_secs(60),
        "the skew was not ignored: {gap:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc850_and_asctime_dates_work_too() {
    for form in ["rfc850", "asctime"] {
        // The wall clock at each arrival, and the second the refusal names.
        let arrivals = Arc::new(std::sync::Mutex::new(Vec::<SystemTime>::new()));
        let seen = arrivals.clone();
        let upstream = Upstream::start(move |_| {
            let now = SystemTime::now();
            let mut seen = seen.lock().unwrap();
            seen.push(now);
            if seen.len() > 1 {
                return Reply::ok("ok");
            }
            let date = httpdate::fmt_http_date(now);
            // Three seconds on: the fallback backoff (< 1 s) cannot pass for it.
            let later = httpdate::HttpDate::from(now + Duration::from_secs(3));
            let retry = format_obsolete(later, form);
            Reply::status(429)
                .header("date", &date)
                .header("retry-after", &retry)
        })
        .await;
        let proxy = start_proxy(GROUP).await;
        let resp = reqwest_via(&proxy, None)
            .get(upstream.url("/x"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{form}");
        let arrivals = arrivals.lock().unwrap().clone();
        assert_eq!(arrivals.len(), 2, "{form}");
        // The retry comes in the second the refusal named or later (a date names whole
        // seconds: the third after the refusal's), not after a fallback backoff.
        let named = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_secs();
        assert!(
            named(arrivals[1]) >= named(arrivals[0]) + 3,
            "{form}: retried before the date it was given: {arrivals:?}"
        );
        let gap = arrivals[1].duration_since(arrivals[0]).unwrap();
        assert!(gap < Duration::from_secs(30), "{form}: {gap:?}");
    }
}

/// An HTTP-date in the obsolete RFC 850 or asctime form (RFC 9110 §5.6.7).
fn format_obsolete(date: httpdate::HttpDate, form: &str) -> String {
    // IMF-fixdate: "Sun, 06 Nov 1994 08:49:37 GMT"
    let imf = date.to_string();
    let parts: Vec<&str> = imf.split([' ', ',']).filter(|p| !p.is_empty()).collect();
    let (wday, day, month, year, time) = (parts[0], parts[1], parts[2], parts[3], parts[4]);
    let long_day = match wday {
        "Mon" => "Monday",
        "Tue" => "Tuesday",
        "Wed" => "Wednesday",
        "Thu" => "Thursday",
        "Fri" => "Friday",
        "Sat" => "Saturday",
        _ => "Sunday",
    };
    match form {
        "rfc850" => format!("{long_day}, {day}-{month}-{} {time} GMT", &year[2..]),
        _ => format!(
            "{wday} {month} {:>2} {time} {year}",
            day.trim_start_matches('0')
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_past_date_means_now_and_garbage_means_backoff() {
    // A date in the past is a pause of zero: the pause histogram counts it in its
    // lowest bucket, where the fallback backoff (0.5 s at least) never lands.
    let past = refusing(1, || {
        Reply::status(429).header("retry-after", "Sun, 06 Nov 1994 08:49:37 GMT")
    })
    .await;
    let proxy = start_proxy_with_admin(GROUP).await;
    let client = reqwest_via(&proxy, None);
    assert_eq!(
        client.get(past.url("/x")).send().await.unwrap().status(),
        200
    );
    assert_eq!(past.requests().len(), 2);
    let metrics = admin_get(&proxy, "/metrics").await;
    let lowest = r#"tollgate_upstream_pause_seconds_bucket{le="0.01",group="api"} 1"#;
    assert!(metrics.lines().any(|l| l == lowest), "{metrics}");

    // Garbage: the first backoff step is 0.5–1 s.
    let garbage = refusing(1, || Reply::status(429).header("retry-after", "soon-ish")).await;
    let proxy = start_proxy_with_admin(GROUP).await;
    let client = reqwest_via(&proxy, None);
    assert_eq!(
        client.get(garbage.url("/x")).send().await.unwrap().status(),
        200
    );
    let gap = retry_gap(&garbage);
    assert!(gap >= Duration::from_millis(495), "{gap:?}");
    let metrics = admin_get(&proxy, "/metrics").await;
    let below = r#"tollgate_upstream_pause_seconds_bucket{le="0.32",group="api"} 0"#;
    assert!(metrics.lines().any(|l| l == below), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_value_is_capped_by_max_pause() {
    let upstream = refusing(1, || Reply::status(429).header("retry-after", "86400000")).await;
    let proxy = start_proxy(
        r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        max_pause = "1s"
        "#,
    )
    .await;
    let resp = reqwest_via(&proxy, None)
        .get(upstream.url("/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let gap = retry_gap(&upstream);
    assert!(
        gap >= Duration::from_millis(995) && gap < Duration::from_secs(30),
        "{gap:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_the_group_is_sent_during_a_pause_and_order_is_kept() {
    let upstream = refusing(1, || Reply::status(429).header("retry-after", "1")).await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        concurrency = 1
        "#,
    )
    .await;
    let client = reqwest_via(&proxy, None);
    let first = {
        let (client, url) = (client.clone(), upstream.url("/0"));
        tokio::spawn(async move { client.get(url).send().await.unwrap().status() })
    };
    upstream.wait_for_requests(1).await;
    // Queued one at a time, so their order is known: /1 first, /4 last.
    let mut rest = Vec::new();
    for i in 1..5 {
        let (client, url) = (client.clone(), upstream.url(&format!("/{i}")));
        rest.push(tokio::spawn(async move {
            client.get(url).send().await.unwrap().status()
        }));
        wait_queued(&proxy, "api", i + 1).await;
    }
    assert_eq!(first.await.unwrap(), 200);
    for r in rest {
        assert_eq!(r.await.unwrap(), 200);
    }
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(
        metrics.contains("tollgate_upstream_pauses_total{group=\"api\"} 1\n"),
        "{metrics}"
    );

    let seen = upstream.requests();
    let paths: Vec<_> = seen.iter().map(|s| s.path.as_str()).collect();
    // The refused request went back to the head: it is the first one after the pause,
    // and the others follow in the order they came.
    assert_eq!(paths, ["/0", "/0", "/1", "/2", "/3", "/4"]);
    let refused_at = seen[0].at;
    for s in &seen[1..] {
        assert!(
            s.at - refused_at >= Duration::from_millis(995),
            "{} arrived {:?} after the 429, inside the 1 s pause",
            s.path,
            s.at - refused_at
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_post_is_replayed_byte_for_byte() {
    let upstream = refusing(1, || Reply::status(429).header("retry-after", "0")).await;
    let proxy = start_proxy(GROUP).await;
    let body: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let resp = reqwest_via(&proxy, None)
        .post(upstream.url("/upload"))
        .header("x-custom", "kept")
        // A hop-by-hop header named by Connection: tollgate strips it on every attempt.
        .header("connection", "x-drop")
        .header("x-drop", "1")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let seen = upstream.requests();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        assert_eq!(s.method, "POST");
        assert_eq!(s.body.as_ref(), body.as_slice(), "the replay differs");
        assert_eq!(s.header("x-custom"), Some("kept"), "{:?}", s.headers);
        assert_eq!(s.header("host"), Some(upstream.authority().as_str()));
        assert_eq!(
            s.headers.get_all("via").iter().count(),
            1,
            "{:?}",
            s.headers
        );
        assert!(s.headers.get("x-drop").is_none(), "{:?}", s.headers);
    }
    assert_eq!(
        seen[0].headers, seen[1].headers,
        "the replay's head differs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_max_replay_body_is_not_replayed_and_the_429_passes_through() {
    let upstream = refusing(1, || {
        Reply::status(429)
            .header("retry-after", "0")
            .header("x-upstream", "said-no")
            .body("slow down\n")
    })
    .await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        max_replay_body = "1KiB"
        "#,
    )
    .await;
    let body = vec![b'x'; 4096];
    let resp = reqwest_via(&proxy, None)
        .post(upstream.url("/big"))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["x-upstream"], "said-no");
    assert_eq!(resp.headers()["retry-after"], "0");
    assert_eq!(resp.text().await.unwrap(), "slow down\n");
    assert_eq!(upstream.requests().len(), 1);
    assert_eq!(upstream.requests()[0].body.len(), 4096);
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(metrics.contains(r#"tollgate_pushback_passed_through_total{group="api"} 1"#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_stop_at_max_retries() {
    let upstream = refusing(usize::MAX, || {
        Reply::status(429).header("retry-after", "0").body("no\n")
    })
    .await;
    let proxy = start_proxy(
        r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        max_retries = 2
        "#,
    )
    .await;
    let resp = reqwest_via(&proxy, None)
        .get(upstream.url("/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.text().await.unwrap(), "no\n");
    assert_eq!(upstream.requests().len(), 3, "one try and two retries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_without_retry_after_is_passed_through() {
    let upstream = refusing(1, || Reply::status(503).body("down\n")).await;
    let proxy = start_proxy(GROUP).await;
    let resp = reqwest_via(&proxy, None)
        .get(upstream.url("/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.text().await.unwrap(), "down\n");
    assert_eq!(upstream.requests().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_groups_flow_during_a_pause() {
    let paused = refusing(1, || Reply::status(429).header("retry-after", "2")).await;
    let other = Upstream::start_at([127, 0, 0, 2].into(), |_| Reply::ok("other")).await;
    let proxy = start_proxy(GROUP).await;
    let client = reqwest_via(&proxy, None);
    let refused = {
        let (client, url) = (client.clone(), paused.url("/x"));
        tokio::spawn(async move { client.get(url).send().await.unwrap().status() })
    };
    paused.wait_for_requests(1).await;
    for i in 0..5 {
        let resp = client
            .get(other.url(&format!("/{i}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    assert_eq!(refused.await.unwrap(), 200);
    let retry_at = paused.requests()[1].at;
    assert!(
        other.requests().iter().all(|s| s.at < retry_at),
        "the other group waited for the pause"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_budget_pauses_before_the_upstream_says_429() {
    for headers in [
        vec![("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1")],
        vec![
            ("ratelimit", "\"default\";r=0;t=1"),
            ("ratelimit-policy", "\"default\";q=5;w=1"),
        ],
    ] {
        let count = Arc::new(AtomicUsize::new(0));
        let upstream = Upstream::start(move |_| {
            let mut reply = Reply::ok("ok");
            if count.fetch_add(1, Ordering::SeqCst) == 0 {
                for (k, v) in &headers {
                    reply = reply.header(k, v);
                }
            }
            reply
        })
        .await;
        let proxy = start_proxy(GROUP).await;
        let client = reqwest_via(&proxy, None);
        assert_eq!(
            client
                .get(upstream.url("/1"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        assert_eq!(
            client
                .get(upstream.url("/2"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        let gap = retry_gap(&upstream);
        assert!(gap >= Duration::from_millis(995), "{gap:?}");
    }
}
