//! What budgets per key and fair queues cost (docs/keys.md), without any network:
//!
//! * `keys/id_of` — hashing a key's value (SHA-256 of a 60-byte bearer token);
//! * `keys/lookup` — a request's key found among 1 000: its hash, then its group;
//! * a note of the resident memory of 10 000 idle keys (each made by one request).
//!
//! What fair scheduling adds is `cargo bench --bench limiter -- long_queue`.
//!
//! `cargo bench --bench keys`; `cargo bench --bench keys -- --test` runs each once.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tokio::time::Instant;
use tollgate::config::{GroupSettings, KeySource, Rate};
use tollgate::parts::{id_of, Group, Metrics, Store};

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

criterion_group!(benches, bench_keys);
criterion_main!(benches);
