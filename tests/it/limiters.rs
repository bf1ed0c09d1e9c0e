//! tollgate against upstreams that limit like the common limiter families (the same
//! decisions as `scripts/limiter-upstream.py`, here in-process): what it learns from
//! each, and what the upstream saw. Every client must end with 200; the assertions are
//! counts at the upstream (refusals, accepted per window) and the pace of its
//! arrivals, never wall-clock durations of the run.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::support::*;

/// Requests per second every test upstream allows.
const LIMIT: u32 = 10;
/// Requests per test, all sent at once by as many clients.
const REQUESTS: usize = 30;
/// How long a slow upstream takes to answer.
const ANSWER_TIME: Duration = Duration::from_millis(100);

/// A limiter family's state and its decision for one request.
enum Family {
    /// Fixed windows on the Unix second, `X-RateLimit-*` with a Unix `Reset`,
    /// `Retry-After: 1` on refusal.
    Fixed { window: u64, count: u32 },
    /// A sliding 1 s window over the accepted requests; `Retry-After: 1` on refusal.
    Sliding { accepted: Vec<Instant> },
    /// IETF `RateLimit-Policy` / `RateLimit` on every answer, fixed windows, a refusal
    /// without `Retry-After`.
    Ietf { window: u64, count: u32 },
    /// A bare 429 to a request less than 1 / LIMIT after the last accepted one.
    Strict { last: Option<Instant> },
}

impl Family {
    fn decide(&mut self) -> Reply {
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let now = Instant::now();
        match self {
            Family::Fixed { window, count } | Family::Ietf { window, count } => {
                if unix.as_secs() != *window {
                    (*window, *count) = (unix.as_secs(), 0);
                }
                let ok = *count < LIMIT;
                *count += u32::from(ok);
                let remaining = (LIMIT - *count).to_string();
                let reply = if ok {
                    Reply::ok("ok")
                } else {
                    Reply::status(429)
                };
                if matches!(self, Family::Fixed { .. }) {
                    let reply = reply
                        .header("x-ratelimit-limit", &LIMIT.to_string())
                        .header("x-ratelimit-remaining", &remaining)
                        .header("x-ratelimit-reset", &(unix.as_secs() + 1).to_string());
                    return if ok {
                        reply
                    } else {
                        reply.header("retry-after", "1")
                    };
                }
                reply
                    .header("ratelimit-policy", &format!("\"default\";q={LIMIT};w=1"))
                    .header("ratelimit", &format!("\"default\";r={remaining};t=1"))
            }
            Family::Sliding { accepted } => {
                accepted.retain(|at| now - *at < Duration::from_secs(1));
                if accepted.len() < LIMIT as usize {
                    accepted.push(now);
                    Reply::ok("ok")
                } else {
                    Reply::status(429).header("retry-after", "1")
                }
            }
            Family::Strict { last } => {
                let interval = Duration::from_secs(1) / LIMIT;
                if last.is_none_or(|last| now - last >= interval) {
                    *last = Some(now);
                    Reply::ok("ok")
                } else {
                    Reply::status(429)
                }
            }
        }
    }
}

/// An upstream limiting like `family`; its record says which requests it accepted.
async fn limited(family: Family) -> (Upstream, Arc<Mutex<Vec<(Instant, u16)>>>) {
    slow_limited(family, Duration::ZERO).await
}

/// [`limited`], each answer given `delay` after its decision: a burst sent at once
/// is all at the upstream before its first answer comes back.
async fn slow_limited(
    family: Family,
    delay: Duration,
) -> (Upstream, Arc<Mutex<Vec<(Instant, u16)>>>) {
    let family = Mutex::new(family);
    let record = Arc::new(Mutex::new(Vec::new()));
    let seen = record.clone();
    let upstream = Upstream::start(move |_| {
        let reply = family.lock().unwrap().decide();
        seen.lock().unwrap().push((Instant::now(), reply.status));
        reply.delay(delay)
    })
    .await;
    (upstream, record)
}

fn config(told: Option<&str>) -> String {
    let rate = told.map_or(String::new(), |r| format!("rate = \"{r}\""));
    format!(
        r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        max_wait = "90s"
        {rate}
        "#
    )
}

/// Sends [`REQUESTS`] at once; checks every client got 200; returns the upstream's
/// record (arrival, status) in arrival order.
async fn run(
    proxy: &Proxy,
    upstream: &Upstream,
    record: &Mutex<Vec<(Instant, u16)>>,
) -> Vec<(Instant, u16)> {
    run_n(proxy, upstream, record, REQUESTS).await
}

/// [`run`] with `n` requests.
async fn run_n(
    proxy: &Proxy,
    upstream: &Upstream,
    record: &Mutex<Vec<(Instant, u16)>>,
    n: usize,
) -> Vec<(Instant, u16)> {
    let urls = (0..n).map(|i| upstream.url(&format!("/{i}")));
    let statuses = get_all_at_once(proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let record = record.lock().unwrap().clone();
    assert_eq!(record.iter().filter(|(_, s)| *s == 200).count(), n);
    record
}

fn refusals(record: &[(Instant, u16)]) -> usize {
    record.iter().filter(|(_, s)| *s == 429).count()
}

/// The median gap between the upstream's arrivals after the first refusal's pause.
fn median_gap_after_first_refusal(record: &[(Instant, u16)]) -> Duration {
    let first = record
        .iter()
        .position(|(_, s)| *s == 429)
        .expect("a refusal");
    let after: Vec<Instant> = record[first..]
        .iter()
        .map(|(at, _)| *at)
        .skip_while(|at| *at - record[first].0 < Duration::from_millis(500))
        .collect();
    let mut gaps: Vec<Duration> = after.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort();
    gaps[gaps.len() / 2]
}

async fn status_of(proxy: &Proxy) -> serde_json::Value {
    let status: serde_json::Value =
        serde_json::from_str(&admin_get(proxy, "/status").await).unwrap();
    status["groups"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn told_nothing_a_fixed_window_teaches_its_rate_and_the_replays_keep_to_it() {
    let fixed = Family::Fixed {
        window: 0,
        count: 0,
    };
    let (upstream, record) = slow_limited(fixed, ANSWER_TIME).await;
    let proxy = start_proxy_with_admin(&config(None)).await;
    let record = run(&proxy, &upstream, &record).await;
    // The first request went alone: the second arrived after its answer.
    let gap = record[1].0 - record[0].0;
    assert!(
        gap >= ANSWER_TIME,
        "the second left {gap:?} after the first"
    );
    // The group's first request goes alone (the probe) and its answer announces the
    // budget: the burst behind it leaves at that pace. A window's edge met by a late
    // departure on a loaded machine may refuse one; sent all at once, the burst would
    // have 20 refused.
    assert!(refusals(&record) <= 1, "{}", refusals(&record));
    // The window is read from its whole-second resets: 10 per second, spent as a
    // budget, with no pace to keep.
    let group = status_of(&proxy).await;
    assert_eq!(group["phase"], "windowed", "{group}");
    assert_eq!(group["window_quota"], 10, "{group}");
    assert_eq!(group["window_seconds"], 1.0, "{group}");
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(!metrics.contains("tollgate_learned_pace{"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn told_nothing_a_sliding_window_is_learned_from_its_refusals_without_a_stampede() {
    let sliding = Family::Sliding { accepted: vec![] };
    let (upstream, record) = slow_limited(sliding, ANSWER_TIME).await;
    let proxy = start_proxy_with_admin(&config(None)).await;
    let record = run(&proxy, &upstream, &record).await;
    // The probe lets out 1.5 more requests per accepted answer until the first
    // refusal comes back: fewer than 1.5 × LIMIT + 1 before it, so at most LIMIT + 1
    // refused, not the 20 of a burst sent at once. The replays leave one by one at the
    // learned pace (≈ 102 ms), not all at once to be refused again.
    assert!(
        refusals(&record) <= LIMIT as usize + 1,
        "{}",
        refusals(&record)
    );
    let gap = median_gap_after_first_refusal(&record);
    assert!(gap >= Duration::from_millis(90), "{gap:?}");
    let group = status_of(&proxy).await;
    assert_eq!(group["phase"], "paced", "{group}");
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(
        metrics.contains("tollgate_learned_pace{group=\"api\"} "),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn told_a_rate_too_high_the_ietf_policy_wins_before_any_refusal() {
    let (upstream, record) = limited(Family::Ietf {
        window: 0,
        count: 0,
    })
    .await;
    let proxy = start_proxy_with_admin(&config(Some("16/s"))).await;
    // Six windows of the upstream's, five ends of a window to stall at.
    let record = run_n(&proxy, &upstream, &record, 6 * LIMIT as usize).await;
    // The first answer teaches 10/s; a request that left at 16/s before it is the most
    // that can be refused.
    assert!(refusals(&record) <= 1, "{}", refusals(&record));
    let group = status_of(&proxy).await;
    assert_eq!(group["window_quota"], 10, "{group}");
    // Remaining: 0 at the end of a window does not stall the group for another (a gap
    // of most of a second between two arrivals), and neither does a request that a
    // loaded machine let leave late enough to meet a spent window: its refusal's
    // `t=1` (whole seconds, rounded up) is read against the group's own answers, and
    // the window has room as soon as the oldest of them leaves it. A proxy that
    // stalls at every window's end has five.
    let stalls = record
        .windows(2)
        .filter(|w| w[1].0 - w[0].0 >= Duration::from_millis(900))
        .count();
    assert_eq!(stalls, 0, "{stalls} stalls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_429_from_a_paced_group_is_retried_at_the_next_slot() {
    let (upstream, record) = limited(Family::Strict { last: None }).await;
    let proxy = start_proxy_with_admin(&config(Some("10/s"))).await;
    let record = run(&proxy, &upstream, &record).await;
    assert!(refusals(&record) <= 3, "{}", refusals(&record));
    // A refusal is followed by the next slot, not by a second of backoff: no two
    // arrivals a second apart.
    let longest = record.windows(2).map(|w| w[1].0 - w[0].0).max().unwrap();
    assert!(longest < Duration::from_millis(500), "{longest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_longer_than_max_wait_is_answered_at_once() {
    let upstream = Upstream::start(|seen| {
        if seen.path == "/first" {
            Reply::status(429).header("retry-after", "100")
        } else {
            Reply::ok("ok")
        }
    })
    .await;
    let proxy = start_proxy(&config(None).replace("\"90s\"", "\"5s\"")).await;
    let client = reqwest_via(&proxy, None);
    // Refused for 100 s: more than its max_wait, so the 429 goes to the client.
    let first = client.get(upstream.url("/first")).send().await.unwrap();
    assert_eq!(first.status(), 429);
    // The next request would wait out the pause: a 503 at once, which says when.
    let asked = Instant::now();
    let next = client.get(upstream.url("/next")).send().await.unwrap();
    let answered = asked.elapsed();
    assert_eq!(next.status(), 503);
    let after: u64 = next.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((95..=100).contains(&after), "{after}");
    let status = next.headers()["proxy-status"].to_str().unwrap().to_string();
    assert!(status.contains("http_request_denied"), "{status}");
    assert!(next.text().await.unwrap().contains("max_wait"));
    // Not held until max_wait (5 s) ran out.
    assert!(answered < Duration::from_millis(2500), "{answered:?}");
    assert_eq!(upstream.paths(), ["/first"]);
}

/// Three replicas `told` a rate (or nothing) share `redis`; an upstream limiting like
/// `family` gets six seconds' worth at its rate, a third through each replica, all at
/// once. Checks every client got 200; returns the upstream's record.
async fn three_replicas(
    redis: &RedisServer,
    family: Family,
    told: Option<&str>,
) -> (Vec<(Instant, u16)>, Vec<Seen>) {
    let (upstream, record) = limited(family).await;
    let shared = format!(
        "[backend]\nkind = \"redis\"\nurl = \"{}\"\nreplicas = 3\ntimeout = \"300ms\"\n{}",
        redis.url(),
        config(told)
    );
    let mut proxies = Vec::new();
    for _ in 0..3 {
        proxies.push(start_proxy(&shared).await);
    }
    let per_replica = 2 * LIMIT as usize;
    let each = proxies.iter().enumerate().map(|(p, proxy)| {
        let urls: Vec<String> = (0..per_replica)
            .map(|i| upstream.url(&format!("/{p}-{i}")))
            .collect();
        get_all_at_once(proxy, urls)
    });
    let statuses = futures_util::future::join_all(each).await.concat();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let record = record.lock().unwrap().clone();
    assert_eq!(
        record.iter().filter(|(_, s)| *s == 200).count(),
        3 * per_replica
    );
    (record, upstream.requests())
}

/// The group's shared controller as the replicas left it in `redis`, and its pace,
/// per second.
async fn learned_in(redis: &RedisServer) -> (std::collections::HashMap<String, String>, f64) {
    let mut conn = redis.conn().await;
    let learned: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg("tollgate:{api}:budget")
        .query_async(&mut conn)
        .await
        .unwrap();
    let rate = learned
        .get("rate")
        .and_then(|r| r.parse().ok())
        .unwrap_or(0.0);
    (learned, rate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn three_replicas_learn_a_sliding_window_as_one() {
    let redis = RedisServer::start().await;
    let (record, _) =
        three_replicas(&redis, Family::Sliding { accepted: vec![] }, Some("16/s")).await;
    // The group's pace is in Redis: about the window's 10 a second, read from what it
    // let through per pause with every replica's answers, not from one replica's third.
    // A sliding window lets a little more through at its edges, so the ceiling read can
    // be up to a tenth high (10.8 in one run of the whole suite, the pace 10.53 below
    // it); the refusals after the first episode, below, say whether that costs anything.
    let (learned, rate) = learned_in(&redis).await;
    assert!((7.0..=11.0).contains(&rate), "{learned:?}");
    // Learned once for the three: after the first episode (the requests the replicas
    // had booked at 16/s before it), the replicas keep to it.
    let first = record
        .iter()
        .position(|(_, s)| *s == 429)
        .expect("a refusal");
    let later = record[first..]
        .iter()
        .filter(|(at, s)| *s == 429 && *at - record[first].0 > Duration::from_millis(1500))
        .count();
    // After it, about the 5 % a group told too high a rate may see (60 requests): the
    // pace explores above the ceiling now and then, and a loaded machine's late
    // departures meet the limit; one run of the whole suite here saw 4 (6.7 %), above
    // the target: docs/budget.md counts it with what replicas miss.
    assert!(
        later <= 5,
        "{later} refusals after the first episode: {record:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn three_replicas_read_a_strict_limiter_from_the_groups_refusals() {
    let redis = RedisServer::start().await;
    let (record, _) = three_replicas(&redis, Family::Strict { last: None }, Some("16/s")).await;
    // Paced at 16/s, the strict limiter refuses every other request at first. Each
    // replica sees a third of the answers; the refusals every replica recorded in
    // Redis show the group's rate within about a second. Stepping down 5-10 % an
    // episode instead takes five episodes or more, a dozen refusals and more.
    assert!(refusals(&record) <= 9, "{} refused", refusals(&record));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn three_replicas_told_nothing_find_a_strict_limiters_rate_as_one() {
    let redis = RedisServer::start().await;
    let (record, _) = three_replicas(&redis, Family::Strict { last: None }, None).await;
    // The first burst reads as one request per guessed pause per replica: a floor,
    // grown by half with every answer until a paced request is refused, then bisected;
    // a refusal's step is published at once, and slots booked before it are left
    // unused. The three replicas' requests in flight when the growth meets the limit
    // are refused together: 9 to 11 of the 60 in runs here, above the 5 % target
    // (BENCHMARKS.md, nginx told nothing on three replicas). Unpaced, the 60 sent at
    // once would meet 50 refusals and more.
    assert!(refusals(&record) <= 15, "{} refused", refusals(&record));
    let (learned, rate) = learned_in(&redis).await;
    // Near the limiter's 10 a second, well above the first burst's floor (about 3);
    // a loaded machine's late departures cost a step or two more.
    assert!((6.0..=10.5).contains(&rate), "{learned:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn three_replicas_told_nothing_probe_as_one_and_read_the_whole_groups_answers() {
    let redis = RedisServer::start().await;
    let family = Family::Sliding { accepted: vec![] };
    let (record, requests) = three_replicas(&redis, family, None).await;
    // One replica probes for the group; the others wait for what it learns. Each
    // replica's requests have paths of their own (`/<replica>-<i>`).
    let first = record
        .iter()
        .find(|(_, s)| *s == 429)
        .map(|(at, _)| *at)
        .expect("a refusal");
    let senders: std::collections::BTreeSet<&str> = requests
        .iter()
        .filter(|seen| seen.at < first)
        .filter_map(|seen| seen.path.split('-').next())
        .collect();
    assert_eq!(senders.len(), 1, "before the first refusal: {senders:?}");
    // Its reading of the probe is the group's, not three times its share.
    let (learned, rate) = learned_in(&redis).await;
    assert!((8.0..=10.5).contains(&rate), "{learned:?}");
    assert!(refusals(&record) <= 3, "{} refused", refusals(&record));
}
