//! What budgets per key and fair queues cost (docs/keys.md), without any network:
//!
//! * `keys/id_of` — hashing a key's value (SHA-256 of a 60-byte bearer token);
//! * `keys/lookup` — a request's key found among 1 000: its hash, then its group;
//! * `queue/fifo` and `queue/fair` — 10 000 requests join one group's queue behind a
//!   head that waits an hour, and are cancelled, in arrival order or in 10 flows:
//!   the difference per request is what fair scheduling adds;
//! * a note of the resident memory of 10 000 idle keys (each made by one request).
//!
//! `cargo bench --bench keys`; `cargo bench --bench keys -- --test` runs each once.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tokio::time::Instant;
use tollgate::config::{GroupSettings, KeySource, Rate};
use tollgate::parts::{id_of, Cost, Flow, Group, Metrics, Store};

const WAITERS: usize = 10_000;
const KEYS: usize = 10_000;

fn group(configure: impl FnOnce(&mut GroupSettings)) -> Arc<Group> {
    let mut settings = GroupSettings::default();
    configure(&mut settings);
    let metrics = Arc::new(Metrics::new());
    let name = "bench".into();
    Arc::new(Group::new(
        name,
        settings,
        metrics.group("bench"),
        Store::Memory,
    ))
}

fn keyed_limit() -> Arc<Group> {
    group(|s| {
        s.rates = vec![Rate {
            limit: 1_000_000,
            period: Duration::from_secs(1),
        }];
        s.keys.key = Some(KeySource::Header(http::header::AUTHORIZATION));
        s.keys.max_keys = 2 * KEYS;
    })
}

fn token(i: usize) -> String {
    format!("Bearer ghp_{i:040}")
}

fn runtime() -> tokio::runtime::Runtime {
    let builder = &mut tokio::runtime::Builder::new_current_thread();
    builder.enable_all().build().expect("tokio runtime")
}

fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn bench_keys(c: &mut Criterion) {
    let rt = runtime();
    // Resident memory of idle keys: each made by one request that has left.
    rt.block_on(async {
        let limit = keyed_limit();
        let before = rss_kib();
        for i in 0..KEYS {
            let key = limit.keyed(id_of(token(i).as_bytes())).expect("a key");
            drop(key.admit(1, Instant::now(), false).await.expect("admitted"));
        }
        if let (Some(before), Some(after)) = (before, rss_kib()) {
            let per_key = after.saturating_sub(before) * 1024 / KEYS as u64;
            eprintln!(
                "note: {KEYS} idle keys: +{} KiB RSS, ~{per_key} bytes per key",
                after - before
            );
        }
    });
    // A key's first request starts the sweeper task.
    let _runtime = rt.enter();
    let mut g = c.benchmark_group("keys");
    g.throughput(Throughput::Elements(1));
    let value = token(7);
    g.bench_function("id_of", |b| b.iter(|| id_of(black_box(value.as_bytes()))));
    let limit = keyed_limit();
    let tokens: Vec<String> = (0..1000).map(token).collect();
    for t in &tokens {
        limit.keyed(id_of(t.as_bytes())).expect("a key");
    }
    let mut i = 0;
    g.bench_function("lookup", |b| {
        b.iter(|| {
            i = (i + 1) % tokens.len();
            limit.keyed(id_of(tokens[i].as_bytes())).expect("a key")
        })
    });
    g.finish();
}

/// A group whose head waits an hour, so everyone after it queues.
async fn slow_group() -> (Arc<Group>, tollgate::parts::Permit) {
    let grp = group(|s| {
        s.rates = vec![Rate {
            limit: 1,
            period: Duration::from_secs(3600),
        }];
        s.queue = 2 * WAITERS;
        s.max_wait = Duration::MAX;
    });
    let first = grp.admit(1, Instant::now(), false).await.expect("burst");
    (grp, first)
}

/// Queues `WAITERS` requests (in 10 flows when `fair`), then cancels them all.
async fn queue_and_cancel(grp: &Arc<Group>, fair: bool) {
    let tasks: Vec<_> = (0..WAITERS)
        .map(|i| {
            let grp = grp.clone();
            let flow = fair.then_some(Flow {
                id: (i % 10) as u64,
                weight: 1,
            });
            let cost = Cost {
                requests: 1,
                flow,
                ..Cost::default()
            };
            tokio::spawn(async move {
                let _ = grp.admit(cost, Instant::now(), false).await;
            })
        })
        .collect();
    while grp.status().queued < WAITERS {
        tokio::task::yield_now().await;
    }
    for t in &tasks {
        t.abort();
    }
    for t in tasks {
        let _ = t.await;
    }
    assert_eq!(grp.status().queued, 0, "every waiter left the queue");
}

fn bench_queue(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("queue");
    g.sample_size(10);
    g.throughput(Throughput::Elements(WAITERS as u64));
    for (name, fair) in [("fifo", false), ("fair", true)] {
        g.bench_function(name, |b| {
            b.to_async(&rt).iter_custom(|iters| async move {
                let (grp, _first) = slow_group().await;
                let start = Instant::now();
                for _ in 0..iters {
                    queue_and_cancel(&grp, fair).await;
                }
                start.elapsed()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_keys, bench_queue);
criterion_main!(benches);
