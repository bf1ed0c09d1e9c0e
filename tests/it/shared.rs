//! Several tollgate instances sharing limits through a real `redis-server` (started
//! here on a free port, never 6379, and stopped by PID). Assertions are about what the
//! upstream saw: spacing and counts across all instances.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::*;
use tollgate::parts::Gcra;
use tollgate::parts::{PAUSE, PAUSE_KEYS, RESERVE, RESERVE_KEYS};

fn config(redis: &RedisServer, extra: &str) -> String {
    format!(
        r#"
        [backend]
        kind = "redis"
        url = "{}"
        # Longer than the 50 ms default: a test machine under load must not make
        # tollgate think Redis is down (that mode has tests of its own).
        timeout = "300ms"
        {extra}
        "#,
        redis.url()
    )
}

/// Sends `per_instance` requests through each proxy at once; returns their statuses.
async fn load(proxies: &[&Proxy], upstream: &Upstream, per_instance: usize) -> Vec<u16> {
    let each = proxies.iter().map(|proxy| {
        let urls = (0..per_instance).map(|i| upstream.url(&format!("/{i}")));
        get_all_at_once(proxy, urls)
    });
    futures_util::future::join_all(each).await.concat()
}

/// The rate measurements run one at a time: the tests of this file run in parallel, each
/// with its own tollgates and redis-server, and on a 2-core machine their noise alone
/// can deliver a request late enough to land in the next second.
static MEASURING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn shared_rate(instances: usize) {
    let _alone = MEASURING.lock().await;
    let redis = RedisServer::start().await;
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let limit = r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        rate = "20/s"
    "#;
    let mut proxies = Vec::new();
    for _ in 0..instances {
        proxies.push(start_proxy(&config(&redis, limit)).await);
    }
    let refs: Vec<&Proxy> = proxies.iter().collect();
    let statuses = load(&refs, &upstream, 60 / instances).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");

    let at = arrivals(&upstream);
    assert_eq!(at.len(), 60);
    // At most 20/s (+ burst 1) in total across the instances, in every 1 s window. Not
    // pairwise spacing: each replica sleeps its booked wait from when Redis's answer
    // arrives, so a replica whose round trip was slow leaves a little late, next to
    // an on-time neighbour, without the total ever going over.
    // One more than rate + burst is allowed: a request delivered late by a busy
    // machine lands in the next second. A replica ignoring the shared budget would
    // show 40 or 60 here.
    let busiest = max_in_window(&at, Duration::from_secs(1));
    assert!(
        busiest <= 22,
        "{busiest} requests reached the upstream within 1 s"
    );
    // ...and the pace itself, as one budget spent by all: the span, the busiest ten
    // intervals and a median gap near 50 ms (a replica that waited for others' slots
    // would double it).
    assert_paced(&at, Duration::from_millis(50), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_rate() {
    shared_rate(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_share_one_rate() {
    shared_rate(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_seen_by_one_instance_pauses_the_others() {
    let redis = RedisServer::start().await;
    let count = Arc::new(AtomicUsize::new(0));
    let upstream = Upstream::start(move |_| {
        if count.fetch_add(1, Ordering::SeqCst) == 0 {
            Reply::status(429).header("retry-after", "2")
        } else {
            Reply::ok("ok")
        }
    })
    .await;
    let limit = r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
    "#;
    let a = start_proxy(&config(&redis, limit)).await;
    let b = start_proxy(&config(&redis, limit)).await;
    let refused = {
        let (client, url) = (reqwest_via(&a, None), upstream.url("/via-a"));
        tokio::spawn(async move { client.get(url).send().await.unwrap().status() })
    };
    upstream.wait_for_requests(1).await;
    // Once the pause is in Redis, ask through the other instance.
    redis.wait_for_key("tollgate:{api}:pause").await;
    let resp = reqwest_via(&b, None)
        .get(upstream.url("/via-b"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(refused.await.unwrap(), 200);
    let seen = upstream.requests();
    let refused_at = seen[0].at;
    let via_b = seen.iter().find(|s| s.path == "/via-b").unwrap();
    assert!(
        via_b.at - refused_at >= Duration::from_millis(1995),
        "instance b sent {:?} after a's 429 asked for 2 s",
        via_b.at - refused_at
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_concurrency_holds_across_instances() {
    let redis = RedisServer::start().await;
    let upstream = Upstream::start(|_| Reply::ok("slow").delay(Duration::from_millis(150))).await;
    let limit = r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        concurrency = 2
        shared_concurrency = true
    "#;
    let a = start_proxy(&config(&redis, limit)).await;
    let b = start_proxy(&config(&redis, limit)).await;
    let statuses = load(&[&a, &b], &upstream, 6).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(upstream.requests().len(), 12);
    assert_eq!(
        upstream.max_in_flight(),
        2,
        "more than 2 in flight across the instances"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_falls_back_to_a_local_share_and_comes_back() {
    let mut redis = RedisServer::start().await;
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let settings = r#"
        replicas = 2
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        rate = "10/s"
    "#;
    let proxy = start_proxy_with_admin(&config(&redis, settings)).await;
    let client = reqwest_via(&proxy, None);

    redis.kill();
    let statuses = load(&[&proxy], &upstream, 6).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    // Alone without Redis, this replica takes its share: 10/s over 2 replicas.
    assert_paced(&arrivals(&upstream), Duration::from_millis(200), 1);
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(metrics.contains("tollgate_backend_up 0"), "{metrics}");
    // The call that failed is counted, and each one after it that tried Redis.
    let errors = metric_value(&metrics, "tollgate_backend_errors_total");
    assert!(errors.is_some_and(|n| n >= 1.0), "{metrics}");

    redis.restart().await;
    // tollgate notices that Redis came back.
    wait_metric_line(&proxy, "tollgate_backend_up 1").await;
    let before = upstream.requests().len();
    for i in 0..3 {
        let resp = client
            .get(upstream.url(&format!("/again/{i}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    assert_eq!(upstream.requests().len(), before + 3);
    assert!(
        redis.keys().await.iter().any(|k| k.contains("{api}:rate")),
        "shared state is back in Redis"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_never_holds_a_request_past_the_timeout() {
    let redis = RedisServer::start().await;
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let settings = r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        rate = "100/s"
    "#;
    let proxy = start_proxy(&config(&redis, settings)).await;
    let client = reqwest_via(&proxy, None);
    assert_eq!(
        client
            .get(upstream.url("/warm"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    redis.freeze();
    for i in 0..5 {
        let started = Instant::now();
        let resp = client
            .get(upstream.url(&format!("/{i}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        // The 300 ms timeout, the 10 ms pace and the exchange, with room for a busy
        // machine: a request stuck on the frozen Redis would never be answered at all.
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }
    redis.thaw();
    assert_eq!(upstream.requests().len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_mode_refuses_while_redis_is_down() {
    let mut redis = RedisServer::start().await;
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let settings = r#"
        on_backend_error = "deny"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        rate = "10/s"
    "#;
    let proxy = start_proxy(&config(&redis, settings)).await;
    let client = reqwest_via(&proxy, None);
    assert_eq!(
        client
            .get(upstream.url("/ok"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    redis.kill();
    let resp = client.get(upstream.url("/refused")).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    let ps = resp.headers()["proxy-status"].to_str().unwrap().to_string();
    assert!(
        ps.starts_with("tollgate; error=proxy_internal_error"),
        "{ps}"
    );
    assert!(resp.text().await.unwrap().contains("Redis"));
    let paths = upstream.paths();
    assert_eq!(paths, ["/ok"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn serving_threads_share_one_store() {
    // One process, three runtime threads, one Redis: the store's calls come from every
    // thread and must neither fail nor split the budget.
    let _alone = MEASURING.lock().await;
    let redis = RedisServer::start().await;
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let limit = "[[limit]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\nrate = \"20/s\"\n";
    let proxy = start_proxy_with_admin(&config(&redis, limit)).await;

    let statuses = load(&[&proxy], &upstream, 40).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let at = arrivals(&upstream);
    assert_eq!(at.len(), 40);
    let busiest = max_in_window(&at, Duration::from_secs(1));
    assert!(
        busiest <= 22,
        "{busiest} requests reached the upstream within 1 s"
    );
    // Redis answered every thread's calls: the store never went down.
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(
        metrics.lines().any(|l| l == "tollgate_backend_up 1"),
        "{metrics}"
    );
    proxy.shutdown().await;
}

// The booking and pause scripts as tollgate runs them (`limit::redis`: `RESERVE` and
// `PAUSE`, whose documents are `limit::redis::protocol`), run here on a real
// redis-server for what they answer and keep there.

/// The key of `what` for group `g`, under the prefix `t`.
fn key(what: &str) -> String {
    format!("t{{g}}:{what}")
}

/// Redis's clock, in µs: the scripts count on it.
async fn redis_now(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1_000_000 + micros
}

/// Runs `script` on the group's `keys` (then `rates` TAT keys) with `request`.
async fn run_script(
    conn: &mut redis::aio::MultiplexedConnection,
    script: &str,
    keys: &[&str],
    rates: usize,
    request: serde_json::Value,
) -> serde_json::Value {
    let script = redis::Script::new(script);
    let mut call = script.prepare_invoke();
    for what in keys {
        call.key(key(what));
    }
    for i in 0..rates {
        call.key(key(&format!("rate:{i}")));
    }
    let answer: String = call
        .arg(request.to_string())
        .invoke_async(conn)
        .await
        .unwrap();
    serde_json::from_str(&answer).unwrap_or(serde_json::Value::String(answer))
}

/// A booking request with nothing but `extra`'s fields.
fn reserve_request(extra: serde_json::Value) -> serde_json::Value {
    let mut request = serde_json::json!({
        "cost": 1, "rates": [], "pace": 0, "id": "a", "probing": false,
        "learned": true, "probe_ms": 1000, "ttl_ms": 600_000,
    });
    for (k, v) in extra.as_object().unwrap() {
        request[k] = v.clone();
    }
    request
}

async fn reserve(
    conn: &mut redis::aio::MultiplexedConnection,
    rates: usize,
    extra: serde_json::Value,
) -> serde_json::Value {
    run_script(conn, RESERVE, &RESERVE_KEYS, rates, reserve_request(extra)).await
}

/// Pauses group `g` for `pause` µs: a refusal with that id, when given.
async fn pause(conn: &mut redis::aio::MultiplexedConnection, pause: u64, refusal: Option<&str>) {
    let mut request = serde_json::json!({
        "pause_us": pause, "keep_us": 5_000_000, "probe_ms": 1000, "ttl_ms": 600_000,
    });
    if let Some(id) = refusal {
        request["refusal"] = id.into();
    }
    run_script(conn, PAUSE, &PAUSE_KEYS, 0, request).await;
}

async fn get(conn: &mut redis::aio::MultiplexedConnection, cmd: &str, args: &[&str]) -> u64 {
    redis::cmd(cmd).arg(args).query_async(conn).await.unwrap()
}

/// One table of GCRA vectors, checked against `gcra.rs` and against `reserve.lua` on a
/// real redis-server: the script is the Redis form of the same two functions.
#[tokio::test]
async fn gcra_vectors_hold_for_gcra_rs_and_reserve_lua() {
    let redis = RedisServer::start().await;
    let mut conn = redis.conn().await;
    let ms = Duration::from_millis;
    // (rate, burst, the TAT this far ahead of now (ms), cost)
    let vectors = [
        ("10/s", 1, 0, 1),
        ("10/s", 1, 300, 1),
        ("10/s", 3, 150, 1),
        ("10/s", 3, 350, 2),
        ("1/s", 1, 999, 5),
        ("50/s", 5, 20, 1),
    ];
    for (rate, burst, ahead, cost) in vectors {
        let rate: tollgate::config::Rate = rate.parse().unwrap();
        let gcra = Gcra::new(rate.limit, rate.period, burst);
        // The Rust answer, from "now": when it leaves and the TAT after it.
        let now = Duration::from_secs(100);
        let tat = now + ms(ahead);
        let depart = gcra.earliest(tat, now);
        let (wait, next) = (depart - now, gcra.advance(tat, depart, cost) - now);
        // The script's, from Redis's now: a few µs after `before`, the tolerance.
        let interval = gcra.interval.as_micros() as u64;
        let tolerance = gcra.tolerance.as_micros() as u64;
        let before = redis_now(&mut conn).await;
        let _: () = redis::cmd("SET")
            .arg(key("rate:0"))
            .arg(before + ahead * 1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        let extra = serde_json::json!({ "cost": cost, "rates": [[interval, tolerance]] });
        let answer = reserve(&mut conn, 1, extra).await;
        let elapsed = redis_now(&mut conn).await - before;
        let lua_wait = answer["wait"].as_f64().unwrap() as u64;
        let lua_next = get(&mut conn, "GET", &[&key("rate:0")]).await - before;
        let case = format!("{rate:?} burst {burst} ahead {ahead} ms cost {cost}");
        let (rust_wait, rust_next) = (wait.as_micros() as u64, next.as_micros() as u64);
        assert!(
            lua_wait.abs_diff(rust_wait) <= elapsed,
            "{case}: {lua_wait} vs {rust_wait}"
        );
        assert!(
            lua_next.abs_diff(rust_next) <= elapsed,
            "{case}: {lua_next} vs {rust_next}"
        );
        let _: () = redis::cmd("DEL")
            .arg(key("rate:0"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_window_books_at_most_its_quota_in_any_span_over_every_replica() {
    let redis = RedisServer::start().await;
    let mut conn = redis.conn().await;
    // 3 per 500 ms, booked by two replicas.
    let window = serde_json::json!({ "window": [3, 500_000] });
    let mut waits = Vec::new();
    for id in ["a", "b", "a", "b", "a"] {
        let mut extra = window.clone();
        extra["id"] = id.into();
        let answer = reserve(&mut conn, 0, extra).await;
        waits.push(answer["wait"].as_f64().unwrap() as u64);
    }
    // Three at once, then the fourth and fifth a span after the first and second.
    assert!(waits[..3].iter().all(|w| *w < 50_000), "{waits:?}");
    assert!(
        waits[3..].iter().all(|w| (450_000..=500_000).contains(w)),
        "{waits:?}"
    );
    // A replica that has not heard of the window yet books under it too: with the
    // fourth and fifth, a span after the third.
    let unheard = reserve(&mut conn, 0, serde_json::json!({ "id": "c" })).await;
    let wait = unheard["wait"].as_f64().unwrap() as u64;
    assert!((450_000..=500_000).contains(&wait), "{unheard}");
    assert_eq!(get(&mut conn, "ZCARD", &[&key("booked")]).await, 6);
}

#[tokio::test]
async fn the_shared_pace_moves_only_from_the_version_it_was_changed_on() {
    let redis = RedisServer::start().await;
    let mut conn = redis.conn().await;
    let publish = |base: &str, rate: &str| serde_json::json!({ "publish": { "base": base, "rate": rate, "ceiling": "5" } });
    // The first change, made on no record, is the record.
    let first = reserve(&mut conn, 0, publish("", "4.5")).await;
    let v1 = first["shared"]["v"].as_str().unwrap().to_string();
    assert_eq!(first["shared"]["rate"], "4.5");
    // Two replicas change it, both on that version: the first wins, the second is
    // dropped and answered the first's.
    let second = reserve(&mut conn, 0, publish(&v1, "4.9")).await;
    let v2 = second["shared"]["v"].as_str().unwrap().to_string();
    assert!(v2.parse::<u64>().unwrap() > v1.parse::<u64>().unwrap());
    let third = reserve(&mut conn, 0, publish(&v1, "4.05")).await;
    assert_eq!(third["shared"]["rate"], "4.9");
    assert_eq!(third["shared"]["v"], v2.as_str());
    // A pause publishes as a booking does.
    let request = serde_json::json!({
        "pause_us": 1, "keep_us": 1000, "probe_ms": 1000, "ttl_ms": 600_000,
        "publish": { "base": v2, "rate": "4.41", "ceiling": "4.9" },
    });
    run_script(&mut conn, PAUSE, &PAUSE_KEYS, 0, request).await;
    let fourth = reserve(&mut conn, 0, serde_json::json!({})).await;
    assert_eq!(fourth["shared"]["rate"], "4.41");
}

#[tokio::test]
async fn one_replica_probes_for_the_group_and_the_others_wait_for_it() {
    let redis = RedisServer::start().await;
    let mut conn = redis.conn().await;
    let probe = |id: &str, probing: bool| serde_json::json!({ "id": id, "probing": probing, "learned": false });
    let answer = |a: &serde_json::Value| (a["paused"].as_f64().unwrap() > 0.0, a["probe"].clone());
    // The first to ask while its probe is on probes for the group; the others are held
    // (for the µs the probe lasts at least), a second at most.
    let a = reserve(&mut conn, 0, probe("a", true)).await;
    assert_eq!(answer(&a), (false, "group".into()));
    let b = reserve(&mut conn, 0, probe("b", true)).await;
    assert_eq!(b["probe"], "elsewhere");
    let left = b["probe_left"].as_f64().unwrap();
    assert!(left > 0.0 && left <= 1_000_000.0, "{b}");
    // A replica whose own probe is over is not held.
    let c = reserve(&mut conn, 0, probe("c", false)).await;
    assert_eq!(answer(&c), (false, "no".into()));
    // A refusal keeps them waiting through its pause and a probe's time after it.
    let before = redis_now(&mut conn).await;
    pause(&mut conn, 1_000, Some("a:1")).await;
    let until = get(&mut conn, "HGET", &[&key("probe"), "until"]).await;
    assert!(until >= before + 1_000 + 1_000_000, "{until}");
    // Paused: nothing else is answered until the pause ends.
    eventually_async(async || {
        let paused = answer(&reserve(&mut conn, 0, probe("a", false)).await).0;
        (!paused).then_some(())
    })
    .await;
    // The prober booked with its own probe over: the group's is over, and so is that of
    // every replica that asks from now on, which books.
    for id in ["b", "d"] {
        let over = reserve(&mut conn, 0, probe(id, true)).await;
        assert_eq!(answer(&over), (false, "over".into()));
    }
    assert!(get(&mut conn, "HGET", &[&key("probe"), "until"]).await <= redis_now(&mut conn).await);
}

/// A node that lost the scripts (restarted, promoted, or new to a slot) answers
/// `EVALSHA` with `NOSCRIPT`: the store sends the script whole (`EVAL`) and goes on,
/// without a moment on local limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_lost_the_scripts_is_sent_them_whole() {
    let redis = RedisServer::start().await;
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let settings = r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        rate = "100/s"
    "#;
    let proxy = start_proxy_with_admin(&config(&redis, settings)).await;
    let client = reqwest_via(&proxy, None);
    let mut conn = redis.conn().await;
    for round in 0..3 {
        let flushed: String = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(flushed, "OK");
        let resp = client
            .get(upstream.url(&format!("/{round}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    assert_eq!(upstream.paths(), ["/0", "/1", "/2"]);
    let metrics = admin_get(&proxy, "/metrics").await;
    assert_eq!(metric_value(&metrics, "tollgate_backend_up"), Some(1.0));
    assert_eq!(
        metric_value(&metrics, "tollgate_backend_fallback_seconds_total"),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(
        metric_value(&metrics, "tollgate_backend_errors_total"),
        Some(0.0),
        "NOSCRIPT is not an error: {metrics}"
    );
    // Each round's booking was sent whole once, after its NOSCRIPT.
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    let evals = stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_eval:calls="))
        .and_then(|rest| rest.split(',').next()?.parse::<u32>().ok());
    assert!(evals.is_some_and(|n| n >= 3), "{stats}");
}
