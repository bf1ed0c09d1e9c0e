//! What one throttle decision costs, without any network: `Group::admit` + dropping the
//! permit, and `Limits::group_for`.
//!
//! * `gcra` — the pure rate arithmetic (`earliest_all` + `advance_all`), the floor;
//! * `uncontended` — one task admitting through one group, unlimited or with a rate so
//!   fast (10⁹/s) that the head never sleeps, so the whole GCRA path runs;
//! * `contended` — one hot group, N tasks on a 2-worker runtime admitting as fast as they
//!   can; the time reported is per admission (all tasks together), so elements/s is the
//!   group's admission throughput;
//! * `group_for` — 100 000 distinct unlisted hosts: creating their groups (all kept
//!   alive, so none is swept), then looking existing ones up round-robin;
//! * `admit_100k_groups` — admit + drop round-robin over 100 000 live groups (lookup
//!   included or not), where each group's state is cold in the caches;
//! * `long_queue` — 10 000 requests join one group's queue (behind a head that waits an
//!   hour) and are then all cancelled, in arrival order or in the 10 flows of a fair
//!   queue; also prints the resident memory the waiting requests cost the limiter alone.
//!
//! `cargo bench --bench limiter` for numbers (see BENCHMARKS.md);
//! `cargo bench --bench limiter -- --test` (or `cargo test --benches`) runs each once.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use tokio::runtime::Runtime;
use tokio::time::Instant;
use tollgate::config::{Config, GroupSettings, Rate};
use tollgate::parts::Metrics;
use tollgate::parts::{gcra, Gcra};
use tollgate::parts::{Cost, Flow, Group, Limits, Store};

/// Distinct hosts in the many-groups benchmarks.
const HOSTS: usize = 100_000;

/// A rate no benchmark can reach: one cell per nanosecond, with slack for bursts.
fn huge_rate(settings: &mut GroupSettings) {
    settings.rates = vec![Rate {
        limit: 1_000_000_000,
        period: Duration::from_secs(1),
    }];
    settings.burst = 1_000_000;
}

fn group(configure: impl FnOnce(&mut GroupSettings)) -> Arc<Group> {
    let mut settings = GroupSettings::default();
    configure(&mut settings);
    let metrics = Arc::new(Metrics::new());
    Arc::new(Group::new(
        "bench".into(),
        settings,
        metrics.group("bench"),
        Store::Memory,
    ))
}

fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn multi_thread() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// One admission that must succeed, and its permit dropped at once.
async fn admit_and_drop(group: &Arc<Group>) {
    let now = Instant::now();
    let permit = group.admit(1, now, false).await.expect("admitted");
    drop(black_box(permit));
}

fn bench_gcra(c: &mut Criterion) {
    let rates = [Gcra::new(50, Duration::from_secs(1), 1)];
    let two = [
        Gcra::new(50, Duration::from_secs(1), 5),
        Gcra::new(5000, Duration::from_secs(3600), 1),
    ];
    let mut g = c.benchmark_group("gcra");
    g.bench_function("one_rate", |b| {
        let mut tats = [Duration::ZERO];
        let mut now = Duration::ZERO;
        b.iter(|| {
            let depart = gcra::earliest_all(black_box(&rates), &tats, now);
            gcra::advance_all(&rates, &mut tats, depart, 1);
            now = depart;
        })
    });
    g.bench_function("two_rates", |b| {
        let mut tats = [Duration::ZERO; 2];
        let mut now = Duration::ZERO;
        b.iter(|| {
            let depart = gcra::earliest_all(black_box(&two), &tats, now);
            gcra::advance_all(&two, &mut tats, depart, 1);
            now = depart;
        })
    });
    g.finish();
}

fn bench_uncontended(c: &mut Criterion) {
    let rt = current_thread();
    let mut g = c.benchmark_group("uncontended");
    g.throughput(Throughput::Elements(1));
    for (name, configure) in [
        (
            "unlimited",
            (|_: &mut GroupSettings| {}) as fn(&mut GroupSettings),
        ),
        ("huge_rate", huge_rate),
    ] {
        let grp = group(configure);
        g.bench_function(name, |b| {
            b.to_async(&rt).iter(|| admit_and_drop(&grp));
        });
    }
    g.finish();
}

fn bench_contended(c: &mut Criterion) {
    let rt = multi_thread();
    let mut g = c.benchmark_group("contended");
    g.throughput(Throughput::Elements(1));
    g.measurement_time(Duration::from_secs(4));
    for (name, configure) in [
        (
            "unlimited",
            (|_: &mut GroupSettings| {}) as fn(&mut GroupSettings),
        ),
        ("huge_rate", huge_rate),
    ] {
        for tasks in [1u64, 2, 8, 64] {
            let grp = group(configure);
            g.bench_function(format!("{name}/{tasks}_tasks"), |b| {
                b.to_async(&rt).iter_custom(|iters| {
                    let grp = grp.clone();
                    async move {
                        // Every task does its share; the time is for all of them.
                        let each = iters.div_ceil(tasks);
                        let start = Instant::now();
                        let handles: Vec<_> = (0..tasks)
                            .map(|_| {
                                let grp = grp.clone();
                                tokio::spawn(async move {
                                    for _ in 0..each {
                                        admit_and_drop(&grp).await;
                                    }
                                })
                            })
                            .collect();
                        for h in handles {
                            h.await.expect("task");
                        }
                        start
                            .elapsed()
                            .mul_f64(iters as f64 / (each * tasks) as f64)
                    }
                });
            });
            assert_eq!(grp.status().queued, 0, "the queue drains");
        }
    }
    g.finish();
}

/// `Limits` whose unlisted hosts get a real rate (1000/s: each group sees one request
/// per round of 100 000, far slower than that, so nobody sleeps) and one listed group.
fn limits() -> Limits {
    let config = Config::parse(
        r#"
        [defaults]
        rate = "1000/s"

        [[limit]]
        name = "listed"
        hosts = ["api.example.com"]
        rate = "1000000/s"
        burst = 1000000
        "#,
        "bench.toml",
    )
    .expect("bench config");
    Limits::new(&config, Arc::new(Metrics::new()), Store::Memory)
}

fn hosts() -> Vec<String> {
    (0..HOSTS).map(|i| format!("h{i}.bench.example")).collect()
}

/// Resident memory of this process in KiB (Linux), for a note on the size of a group.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn bench_many_groups(c: &mut Criterion) {
    let hosts = hosts();

    let mut g = c.benchmark_group("group_for");
    g.sample_size(10);
    g.throughput(Throughput::Elements(HOSTS as u64));
    g.bench_function("create_100k", |b| {
        b.iter_batched(
            limits,
            |limits| {
                let kept: Vec<_> = hosts
                    .iter()
                    .map(|h| limits.group_for(h, 443, None))
                    .collect();
                (limits, kept)
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();

    let before = rss_kib();
    let limits = limits();
    let kept: Vec<Arc<Group>> = hosts
        .iter()
        .map(|h| limits.group_for(h, 443, None))
        .collect();
    if let (Some(before), Some(after)) = (before, rss_kib()) {
        eprintln!(
            "note: {HOSTS} live host groups (with their metric series): +{} MiB RSS, ~{} bytes per group",
            (after.saturating_sub(before)) / 1024,
            after.saturating_sub(before) * 1024 / HOSTS as u64
        );
    }
    assert_eq!(limits.dynamic_groups(), HOSTS);

    let mut g = c.benchmark_group("group_for");
    g.throughput(Throughput::Elements(1));
    g.bench_function("listed_host", |b| {
        b.iter(|| limits.group_for(black_box("api.example.com"), 443, None))
    });
    let mut next = 0;
    g.bench_function("existing_of_100k", |b| {
        b.iter(|| {
            next = (next + 1) % HOSTS;
            limits.group_for(black_box(&hosts[next]), 443, None)
        })
    });
    g.finish();

    let rt = current_thread();
    let mut g = c.benchmark_group("admit_100k_groups");
    g.throughput(Throughput::Elements(1));
    let mut next = 0;
    g.bench_function("admit", |b| {
        b.to_async(&rt).iter(|| {
            next = (next + 1) % HOSTS;
            admit_and_drop(&kept[next])
        })
    });
    let mut next = 0;
    g.bench_function("group_for+admit", |b| {
        b.to_async(&rt).iter(|| {
            next = (next + 1) % HOSTS;
            let grp = limits.group_for(&hosts[next], 443, None);
            async move { admit_and_drop(&grp).await }
        })
    });
    g.finish();
    drop(kept);
}

/// Requests in the long-queue benchmark.
const WAITERS: usize = 10_000;

/// A group at 1/h whose only burst slot is taken: everyone else waits, without a
/// deadline.
async fn slow_group() -> (Arc<Group>, tollgate::parts::Permit) {
    let grp = group(|s| {
        s.rates = vec![Rate {
            limit: 1,
            period: Duration::from_secs(3600),
        }];
        s.queue = 2 * WAITERS;
        // No deadline at all: at 1/h the queue ahead outlasts any finite max_wait, and
        // such a request is refused at once instead of waiting.
        s.max_wait = Duration::MAX;
    });
    let now = Instant::now();
    let first = grp.admit(1, now, false).await.expect("burst");
    (grp, first)
}

/// Spawns `n` requests that wait in `grp`'s queue (in 10 flows of a fair queue when
/// `fair`); returns when all are queued.
async fn queue_up(grp: &Arc<Group>, n: usize, fair: bool) -> Vec<tokio::task::JoinHandle<()>> {
    let tasks = (0..n)
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
                let now = Instant::now();
                let _ = grp.admit(cost, now, false).await;
            })
        })
        .collect();
    while grp.status().queued < n {
        tokio::task::yield_now().await;
    }
    tasks
}

/// Aborts the waiters and returns when the queue is empty again.
async fn cancel_all(grp: &Arc<Group>, tasks: Vec<tokio::task::JoinHandle<()>>) {
    for t in &tasks {
        t.abort();
    }
    for t in tasks {
        let _ = t.await;
    }
    assert_eq!(grp.status().queued, 0, "every waiter left the queue");
}

fn bench_long_queue(c: &mut Criterion) {
    let rt = current_thread();
    // The limiter's share of a waiting request, without any HTTP connection: the
    // queue entry, its channel, and the task that awaits `admit` (in the proxy, the
    // connection's task). scripts/bench-queue-memory measures the whole proxy.
    rt.block_on(async {
        let (grp, _first) = slow_group().await;
        let before = rss_kib();
        let tasks = queue_up(&grp, WAITERS, false).await;
        if let (Some(before), Some(after)) = (before, rss_kib()) {
            eprintln!(
                "note: {WAITERS} requests waiting in one group (limiter only, a task each): \
                 +{} KiB RSS, ~{} bytes per waiting request",
                after.saturating_sub(before),
                after.saturating_sub(before) * 1024 / WAITERS as u64
            );
        }
        cancel_all(&grp, tasks).await;
    });

    let mut g = c.benchmark_group("long_queue");
    g.sample_size(10);
    g.throughput(Throughput::Elements(WAITERS as u64));
    // `_fair`: the same requests in 10 flows of a fair queue (docs/keys.md), whose
    // difference per request is what fair scheduling adds.
    for (name, fair) in [
        ("enqueue_then_cancel_10k", false),
        ("enqueue_then_cancel_10k_fair", true),
    ] {
        g.bench_function(name, |b| {
            b.to_async(&rt).iter_custom(|iters| async move {
                let (grp, _first) = slow_group().await;
                let start = Instant::now();
                for _ in 0..iters {
                    let tasks = queue_up(&grp, WAITERS, fair).await;
                    cancel_all(&grp, tasks).await;
                }
                start.elapsed()
            })
        });
    }
    g.finish();
}

// The long queue goes first: its memory note needs a process that has not yet
// allocated and freed the 100 000 groups (freed memory is reused without growing RSS).
criterion_group!(
    benches,
    bench_long_queue,
    bench_gcra,
    bench_uncontended,
    bench_contended,
    bench_many_groups
);
criterion_main!(benches);
