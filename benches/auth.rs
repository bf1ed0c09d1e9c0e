//! What proxy authentication costs per request: `Users::verify` on a
//! `Proxy-Authorization: Basic` value, against a bcrypt hash of cost 5 (what
//! `htpasswd -B` writes by default).
//!
//! * `cached` — a credential verified before: the price of every request after a
//!   client's first;
//! * `uncached` — the first request with a credential: one bcrypt check (the `Users`
//!   is fresh for each iteration, its loading outside the measurement);
//! * `wrong_password` and `unknown_user` — never cached, so every such request pays
//!   one bcrypt check.
//!
//! `cargo bench --bench auth`; `cargo bench --bench auth -- --test` runs each once.

use std::hint::black_box;
use std::io::Write;
use std::time::Duration;

use base64::Engine;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use http::HeaderValue;
use tollgate::parts::Users;

/// `htpasswd -B`'s default cost.
const COST: u32 = 5;

fn basic(credentials: &str) -> HeaderValue {
    let token = base64::engine::general_purpose::STANDARD.encode(credentials);
    HeaderValue::from_str(&format!("Basic {token}")).unwrap()
}

fn verify(c: &mut Criterion) {
    let hash = bcrypt::hash("open sesame", COST).unwrap();
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(file, "alice:{hash}").unwrap();
    let load = || Users::load(file.path()).unwrap();
    let good = basic("alice:open sesame");

    let mut group = c.benchmark_group("auth");
    let users = load();
    assert_eq!(users.verify(Some(&good)).as_deref(), Some("alice"));
    group.bench_function("cached", |b| {
        b.iter(|| users.verify(black_box(Some(&good))))
    });

    // A bcrypt check takes milliseconds: fewer samples keep the run short.
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(10));
    group.bench_function("uncached", |b| {
        b.iter_batched_ref(
            load,
            |users| users.verify(black_box(Some(&good))),
            BatchSize::PerIteration,
        )
    });
    for (name, credentials) in [
        ("wrong_password", "alice:open sesame!"),
        ("unknown_user", "mallory:open sesame"),
    ] {
        let header = basic(credentials);
        group.bench_function(name, |b| b.iter(|| users.verify(black_box(Some(&header)))));
    }
    group.finish();
}

criterion_group!(benches, verify);
criterion_main!(benches);
