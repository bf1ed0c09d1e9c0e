//! Two tollgate replicas (the binary) sharing a budget through Redis deployments that
//! survive a node: a Redis Cluster of 3 masters and 3 replicas, and a master with a
//! replica watched by 3 sentinels, all real processes on loopback
//! (`support/redis_ha.rs`), with passwords (in the nodes' URLs, and the sentinels'
//! own). What is asserted is what the upstream received: how
//! many requests, and how many in any second; and that no client call failed while
//! the master holding the budget was killed and its replica promoted.

use std::time::{Duration, Instant};

use crate::support::*;

/// The budget the replicas share, and the key of it that decides its slot.
const RATE: usize = 10;
const BUDGET_KEY: &str = "tollgate:{api}:pause";

/// Each test starts six to nine Redis processes and two tollgates, and measures a pace:
/// one at a time, so that they do not load the machine for each other.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config(backend: &str) -> String {
    format!(
        r#"
        [backend]
        kind = "redis"
        # Longer than the 50 ms default: a loaded test machine must not make tollgate
        # think Redis is down (that mode has tests of its own).
        timeout = "300ms"
        {backend}

        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        rate = "{RATE}/s"
        {ADMIN_ON_PORT_0}
        "#
    )
}

fn list(nodes: &[String]) -> String {
    let quoted: Vec<String> = nodes.iter().map(|n| format!("{n:?}")).collect();
    format!("[{}]", quoted.join(", "))
}

/// Two replicas with `backend`, each counting the other alive in Redis (the
/// heartbeat works on this deployment; the local fallback would take half the rate).
async fn two_replicas(backend: &str) -> [Tollgate; 2] {
    let a = Tollgate::start(&config(backend)).await;
    let b = Tollgate::start(&config(backend)).await;
    for tollgate in [&a, &b] {
        let counted = within_bound(async || {
            let (_, status) = tollgate.admin("/status").await;
            let status: serde_json::Value = serde_json::from_str(&status).ok()?;
            (status["backend"]["replicas"] == 2).then_some(())
        })
        .await;
        assert!(counted.is_some(), "a replica never saw the other in Redis");
    }
    [a, b]
}

/// Sends `n` GETs, half through each replica, all at once (they queue in the group);
/// returns their statuses.
async fn load(replicas: &[Tollgate; 2], upstream: &Upstream, n: usize) -> Vec<u16> {
    let calls = (0..n).map(|i| {
        let proxy = reqwest::Proxy::all(replicas[i % 2].url()).unwrap();
        let client = reqwest::Client::builder()
            .proxy(proxy)
            .timeout(BOUND)
            .build()
            .unwrap();
        let url = upstream.url(&format!("/{i}"));
        async move {
            match client.get(url).send().await {
                Ok(resp) => resp.status().as_u16(),
                Err(_) => 0,
            }
        }
    });
    futures_util::future::join_all(calls).await
}

/// Steady state: 100 calls, all answered 200, all reaching the upstream, never more
/// than the rate (one more for a request a loaded machine delivered late) in any
/// second, and at the rate, not slower (the span and the median gap).
fn assert_shared(statuses: &[u16], upstream: &Upstream, n: usize) {
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let at = arrivals(upstream);
    assert_eq!(at.len(), n, "the upstream saw {} of {n}", at.len());
    let busiest = max_in_window(&at, Duration::from_secs(1));
    assert!(
        busiest <= RATE + 1,
        "{busiest} requests reached the upstream within 1 s at a shared {RATE}/s"
    );
    assert_paced(&at, Duration::from_secs(1) / RATE as u32, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_a_budget_in_a_redis_cluster() {
    let _alone = ALONE.lock().await;
    let cluster = RedisCluster::start().await;
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let replicas = two_replicas(&format!("cluster = {}", list(&cluster.seeds()))).await;
    let statuses = load(&replicas, &upstream, 100).await;
    assert_shared(&statuses, &upstream, 100);
    // The budget lives on the master of its slot, and nowhere else.
    let master = cluster.master_of(BUDGET_KEY).await;
    let keys: Vec<String> = ask(master, &["KEYS", "tollgate:{api}:*"]).await.unwrap();
    assert!(
        keys.contains(&"tollgate:{api}:booked".to_string()),
        "{keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_a_budget_through_sentinel() {
    let _alone = ALONE.lock().await;
    let set = RedisSentinels::start().await;
    let backend = format!(
        "sentinels = {}\nmaster_name = {MASTER_NAME:?}\nsentinel_password = {SENTINEL_PASSWORD:?}",
        list(&set.sentinels())
    );
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let replicas = two_replicas(&backend).await;
    let statuses = load(&replicas, &upstream, 100).await;
    assert_shared(&statuses, &upstream, 100);
    let keys: Vec<String> = ask(set.master(), &["KEYS", "tollgate:{api}:*"])
        .await
        .unwrap();
    assert!(
        keys.contains(&"tollgate:{api}:booked".to_string()),
        "{keys:?}"
    );
}

/// What a failover mid-run did, as the upstream and the replicas saw it.
struct Failover {
    statuses: Vec<u16>,
    arrivals: Vec<Instant>,
    /// From the promotion until both replicas were back on the shared budget, as
    /// their `/metrics` showed it.
    back_after: Duration,
}

/// Runs 100 calls through `replicas` and, once the upstream has seen 30, `fail` (which
/// kills the master and waits for the promotion); then waits until both replicas are
/// back on the shared budget.
async fn failover_mid_run(
    replicas: &[Tollgate; 2],
    upstream: &Upstream,
    fail: impl std::future::Future<Output = ()>,
) -> Failover {
    let (statuses, back_after) = tokio::join!(load(replicas, upstream, 100), async {
        upstream.wait_for_requests(30).await;
        fail.await;
        let promoted = Instant::now();
        for tollgate in replicas {
            tollgate.wait_metric("tollgate_backend_up", 1.0).await;
        }
        promoted.elapsed()
    });
    Failover {
        statuses,
        arrivals: arrivals(upstream),
        back_after,
    }
}

/// No client call failed, the upstream saw every call once, and the replicas fell
/// back for a while (the failover was seen) and came back on their own. During the
/// fallback each replica takes its share (rate / 2) from its own last booked
/// departure, and back on the shared budget it books no earlier than its local rates
/// allow: the busiest second holds one more than the rate's for the change of store
/// besides the one for a late delivery, and a strict limiter at the rate would have
/// refused at most 2 % of the run.
async fn assert_survived(run: &Failover, replicas: &[Tollgate; 2]) {
    assert!(run.statuses.iter().all(|s| *s == 200), "{:?}", run.statuses);
    assert_eq!(run.arrivals.len(), 100);
    let busiest = max_in_window(&run.arrivals, Duration::from_secs(1));
    assert!(
        busiest <= RATE + 2,
        "{busiest} requests reached the upstream within 1 s at a shared {RATE}/s"
    );
    let over = over_limit(&run.arrivals);
    assert!(
        over <= 2,
        "a strict {RATE}/s limiter would have refused {over} of 100"
    );
    let mut fell_back = 0.0;
    for tollgate in replicas {
        fell_back += tollgate
            .metric("tollgate_backend_fallback_seconds_total")
            .await;
    }
    assert!(
        fell_back > 0.0,
        "neither replica fell back: was the master killed?"
    );
    eprintln!(
        "failover: busiest second {busiest}, over a strict {RATE}/s limiter {}, \
         fallback {fell_back:.2} s over both replicas, back {:?} after the promotion",
        over, run.back_after
    );
}

/// How many of `arrivals` a strict limiter of `RATE`/s (a bucket of 2: one request's
/// room for a late delivery) would have refused.
fn over_limit(arrivals: &[Instant]) -> usize {
    let interval = Duration::from_secs(1) / RATE as u32;
    let (mut tat, mut refused) = (arrivals[0], 0);
    for &at in arrivals {
        if tat > at + interval {
            refused += 1;
        } else {
            tat = tat.max(at) + interval;
        }
    }
    refused
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_master_killed_mid_run_fails_no_call() {
    let _alone = ALONE.lock().await;
    let mut cluster = RedisCluster::start().await;
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let replicas = two_replicas(&format!("cluster = {}", list(&cluster.seeds()))).await;
    let cluster_ref = &mut cluster;
    let run = failover_mid_run(&replicas, &upstream, async move {
        let old = cluster_ref.kill_master_of(BUDGET_KEY).await;
        cluster_ref.wait_promoted(BUDGET_KEY, old).await;
    })
    .await;
    assert_survived(&run, &replicas).await;
    // The shared budget is on the promoted master: the replicas book there again.
    let master = cluster.master_of(BUDGET_KEY).await;
    let keys: Vec<String> = ask(master, &["KEYS", "tollgate:{api}:*"]).await.unwrap();
    assert!(
        keys.contains(&"tollgate:{api}:booked".to_string()),
        "{keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_master_killed_mid_run_fails_no_call() {
    let _alone = ALONE.lock().await;
    let mut set = RedisSentinels::start().await;
    let backend = format!(
        "sentinels = {}\nmaster_name = {MASTER_NAME:?}\nsentinel_password = {SENTINEL_PASSWORD:?}",
        list(&set.sentinels())
    );
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let replicas = two_replicas(&backend).await;
    let old = set.master();
    let set_ref = &mut set;
    let run = failover_mid_run(&replicas, &upstream, async move {
        set_ref.kill_master();
        set_ref.wait_failover(old).await;
    })
    .await;
    assert_survived(&run, &replicas).await;
    let new = set.wait_failover(old).await;
    // One more call through each replica books on the new master.
    let statuses = load(&replicas, &upstream, 2).await;
    assert_eq!(statuses, [200, 200]);
    let keys: Vec<String> = ask(new, &["KEYS", "tollgate:{api}:*"]).await.unwrap();
    assert!(
        keys.contains(&"tollgate:{api}:booked".to_string()),
        "{keys:?}"
    );
}
