//! What one access line costs the request that writes it, in user space:
//!
//! * `access_log/line` — the line formatted into the thread's buffer, as the binary
//!   writes it (a batch's `write` to stderr is shared by about 150 lines);
//! * `access_log/tracing_event` — the same line as a `tracing` event through
//!   tracing-subscriber's text formatter into a sink, as every line was written
//!   before, and a library user's still are (the `write` per line not included).
//!
//! `cargo bench --bench access_log`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use tollgate::parts::{access_line, AccessFormat, Answered, Record, Timing};

fn record() -> Record {
    Record {
        client: "10.0.0.7:51234".parse().unwrap(),
        user: None,
        method: http::Method::GET,
        url: "https://api.github.com/repos/rust-lang/rust/issues".into(),
        group: Some("github".into()),
        status: 200,
        answered: Answered::Upstream,
        timing: Timing {
            wait: Duration::from_micros(412_345),
            upstream: Duration::from_micros(88_123),
            retries: 0,
            tokens: None,
        },
        bytes: 4242,
        complete: true,
        tunnel: None,
    }
}

fn bench(c: &mut Criterion) {
    let record = record();
    let mut g = c.benchmark_group("access_log");
    let mut out = Vec::with_capacity(64 * 1024);
    for (name, format) in [
        ("line", AccessFormat::Text),
        ("line_json", AccessFormat::Json),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                out.clear();
                access_line(black_box(&record), format, &mut out);
                black_box(out.len())
            })
        });
    }
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(std::io::sink)
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        g.bench_function("tracing_event", |b| b.iter(|| black_box(&record).emit()));
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
