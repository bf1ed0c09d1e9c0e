//! Several tollgate instances sharing limits through a real `redis-server` (started
//! here on a free port, never 6379, and stopped by PID). Assertions are about what the
//! upstream saw: spacing and counts across all instances.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::*;
use tollgate::limit::redis::{ReserveAnswer, PAUSE, PAUSE_KEYS, RESERVE, RESERVE_KEYS};

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

    redis.restart().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !admin_get(&proxy, "/metrics")
        .await
        .contains("tollgate_backend_up 1")
    {
        assert!(
            Instant::now() < deadline,
            "tollgate did not notice Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
// `PAUSE`, whose comments give their keys and arguments), run here on a real
// redis-server for what they keep there.

/// How far ahead a slot is checked again, in µs.
const AHEAD: u64 = tollgate::limit::store::RECHECK_AHEAD.as_micros() as u64;

/// The key of `what` for group `g`, under the prefix `t`.
fn key(what: &str) -> String {
    format!("t{{g}}:{what}")
}

/// Redis's clock, in µs: the scripts count on it.
async fn redis_now(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1_000_000 + micros
}

/// Books a slot of group `g` for replica `id` (`probing`: its own probe is on), with no
/// rate and nothing to publish: the µs of pause left and the probe's answer.
async fn reserve(
    conn: &mut redis::aio::MultiplexedConnection,
    id: &str,
    probing: bool,
) -> (bool, i64) {
    let script = redis::Script::new(RESERVE);
    let mut call = script.prepare_invoke();
    for what in RESERVE_KEYS {
        call.key(key(what));
    }
    call.arg("").arg("").arg("").arg("").arg(600_000).arg(0);
    call.arg(1)
        .arg(0)
        .arg(1_000)
        .arg(id)
        .arg(u8::from(probing))
        .arg(1_000);
    let answer: ReserveAnswer = call.invoke_async(conn).await.unwrap();
    (answer.1 > 0, answer.8)
}

/// Pauses group `g` for `pause` µs: a refusal when `id` is not empty.
async fn pause(conn: &mut redis::aio::MultiplexedConnection, pause: u64, id: &str) {
    let script = redis::Script::new(PAUSE);
    let mut call = script.prepare_invoke();
    for what in PAUSE_KEYS {
        call.key(key(what));
    }
    call.arg("").arg("").arg("").arg("").arg(600_000).arg(0);
    call.arg(pause)
        .arg(id)
        .arg(5_000_000)
        .arg(1_000)
        .arg(1_000)
        .arg(AHEAD);
    let _: i64 = call.invoke_async(conn).await.unwrap();
}

async fn get(conn: &mut redis::aio::MultiplexedConnection, cmd: &str, args: &[&str]) -> u64 {
    redis::cmd(cmd).arg(args).query_async(conn).await.unwrap()
}

#[tokio::test]
async fn a_refusal_restarts_the_learned_chain_after_the_slots_not_checked_again() {
    let redis = RedisServer::start().await;
    let mut conn = redis.conn().await;
    let interval: u64 = 200_000;
    let tat = key("rate:learned");
    let set = |value: u64| redis::cmd("SET").arg(&tat).arg(value).clone();
    let _: () = redis::cmd("HSET")
        .arg(key("learned"))
        .arg("interval")
        .arg(interval)
        .query_async(&mut conn)
        .await
        .unwrap();
    // Ten slots booked ahead at 5/s: the chain ends 2 s from now.
    let far = redis_now(&mut conn).await + 10 * interval;
    let _: () = set(far).query_async(&mut conn).await.unwrap();
    // A pause that is not a refusal leaves the chain alone.
    pause(&mut conn, 5_000, "").await;
    assert_eq!(get(&mut conn, "GET", &[&tat]).await, far);
    // A refusal: the slots booked `AHEAD` or more ahead are checked again and left
    // unused; the next booking comes an interval after the last slot that is not.
    let before = redis_now(&mut conn).await;
    pause(&mut conn, 5_000, "replica:1").await;
    let after = redis_now(&mut conn).await;
    let restarted = get(&mut conn, "GET", &[&tat]).await;
    let expected = before + AHEAD + interval..=after + AHEAD + interval;
    assert!(
        expected.contains(&restarted),
        "{restarted} not in {expected:?}"
    );
    // A chain that ends sooner than that is kept.
    let near = redis_now(&mut conn).await + AHEAD;
    let _: () = set(near).query_async(&mut conn).await.unwrap();
    pause(&mut conn, 5_000, "replica:2").await;
    assert_eq!(get(&mut conn, "GET", &[&tat]).await, near);
}

#[tokio::test]
async fn one_replica_probes_for_the_group_and_the_others_wait_for_it() {
    let redis = RedisServer::start().await;
    let mut conn = redis.conn().await;
    // The first to ask while its probe is on probes for the group; the others are held
    // (a negative answer: the µs the probe lasts at least), a second at most.
    assert_eq!(reserve(&mut conn, "a", true).await, (false, 1));
    let (_, held) = reserve(&mut conn, "b", true).await;
    assert!((-1_000_000..0).contains(&held), "{held}");
    // A replica whose own probe is over is not held.
    assert_eq!(reserve(&mut conn, "c", false).await, (false, 0));
    assert_eq!(reserve(&mut conn, "a", true).await, (false, 1));
    // A refusal keeps them waiting through its pause and a probe's time after it.
    let before = redis_now(&mut conn).await;
    pause(&mut conn, 1_000, "a:1").await;
    let until = get(&mut conn, "HGET", &[&key("probe"), "until"]).await;
    assert!(until >= before + 1_000 + 1_000_000, "{until}");
    // Paused: nothing else is answered until the pause ends.
    while reserve(&mut conn, "a", false).await.0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The prober booked with its own probe over: the group's is over, and so is that of
    // every replica that asks from now on, which books.
    assert_eq!(reserve(&mut conn, "b", true).await, (false, 2));
    assert_eq!(reserve(&mut conn, "d", true).await, (false, 2));
    assert!(get(&mut conn, "HGET", &[&key("probe"), "until"]).await <= redis_now(&mut conn).await);
}
