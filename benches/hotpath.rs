//! The per-request work tollgate adds in forward mode, without any network, so a
//! regression shows without running the peers benchmark (`../shared/bench/peers.sh`):
//!
//! * `limiter/unlimited_defaults` — `Limits::group_for` for an unlisted host (the
//!   `[defaults]` group, as in the peers benchmark) + `Group::admit` + dropping the
//!   permit: the throttle's whole decision for an uncontended group (`benches/limiter.rs`
//!   covers rated and contended groups);
//! * `headers/request` and `headers/response` — hop-by-hop stripping, `Via` and `Host`
//!   on a typical forward-proxy request, and on a typical upstream response;
//! * `classify/forward` — classifying an absolute-form request;
//! * `classify/route` — classifying an origin-form request to a `[[route]]`, its URI
//!   rewritten to the upstream's (the gateway mode);
//! * `access/policy` — the destination policy's checks of a name and the address it
//!   resolved to (once per new upstream connection);
//! * `access/canonical_host` — a host brought to its canonical form (every request).
//!
//! `cargo bench --bench hotpath`; `cargo bench --bench hotpath -- --test` runs each once.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{header, HeaderMap, HeaderValue, Method, Request, Version};
use tokio::time::Instant;
use tollgate::config::Config;
use tollgate::parts::Classifier;
use tollgate::parts::Metrics;
use tollgate::parts::Policy;
use tollgate::parts::{add_via, set_host, strip_hop_by_hop};
use tollgate::parts::{Limits, Store};

fn limits(defaults: &str) -> Limits {
    let config = Config::parse(&format!("[defaults]\n{defaults}\n"), "bench").unwrap();
    Limits::new(&config, std::sync::Arc::new(Metrics::new()), Store::Memory)
}

fn limiter(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut g = c.benchmark_group("limiter");
    let limits = limits("rate = \"unlimited\"\nconcurrency = 100000");
    g.bench_function("unlimited_defaults", |b| {
        b.to_async(&runtime).iter(|| async {
            let group = limits.group_for(black_box("127.0.0.1"), 80, None);
            let now = Instant::now();
            let permit = group.admit(1, now, false).await.unwrap();
            drop(black_box(permit));
        })
    });
    g.finish();
}

/// The headers wrk sends through a forward proxy, plus a typical hop-by-hop one.
fn request_headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:18080"));
    h.insert(header::USER_AGENT, HeaderValue::from_static("bench/1.0"));
    h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
    h.insert("proxy-connection", HeaderValue::from_static("keep-alive"));
    h
}

fn response_headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(header::SERVER, HeaderValue::from_static("nginx"));
    h.insert(
        header::DATE,
        HeaderValue::from_static("Sun, 22 Nov 2026 10:00:00 GMT"),
    );
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("3"));
    h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
    h
}

fn headers(c: &mut Criterion) {
    let mut g = c.benchmark_group("headers");
    let authority = "127.0.0.1:18080".parse().unwrap();
    let request = request_headers();
    g.bench_function("request", |b| {
        b.iter_batched_ref(
            || request.clone(),
            |h| {
                strip_hop_by_hop(h);
                add_via(h, Version::HTTP_11);
                set_host(h, &authority);
            },
            criterion::BatchSize::SmallInput,
        )
    });
    let response = response_headers();
    g.bench_function("response", |b| {
        b.iter_batched_ref(
            || response.clone(),
            |h| {
                strip_hop_by_hop(h);
                add_via(h, Version::HTTP_11);
            },
            criterion::BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn classify(c: &mut Criterion) {
    let routes = "[[route]]\nprefix = \"/gh/\"\nupstream = \"https://api.github.com/v3\"\n";
    let classifier = Classifier::new(&Config::parse(routes, "bench").unwrap());
    let local = "127.0.0.1:18088".parse().unwrap();
    // An absolute-form URI is forwarded; an origin-form one matches the route.
    for (name, uri) in [
        ("classify/forward", "http://127.0.0.1:18080/"),
        ("classify/route", "/gh/repos/tollgate/issues?state=open"),
    ] {
        c.bench_function(name, |b| {
            b.iter_batched_ref(
                || {
                    Request::builder()
                        .method(Method::GET)
                        .uri(uri)
                        .body(())
                        .unwrap()
                },
                |req| black_box(classifier.classify(req, local).unwrap()),
                criterion::BatchSize::SmallInput,
            )
        });
    }
}

fn access(c: &mut Criterion) {
    let config = Config::parse(
        "[access]\nallow = [\"10.20.0.0/16\", \"internal.example\"]\ndeny = [\"*.evil.example\"]\n",
        "bench",
    )
    .unwrap();
    let policy = Policy::new(&config.access, vec!["127.0.0.1:8080".parse().unwrap()]);
    let public: std::net::SocketAddr = "140.82.112.6:443".parse().unwrap();
    // What the dialer asks for each new upstream connection: the name, then its address.
    c.bench_function("access/policy", |b| {
        b.iter(|| {
            let host = black_box("api.github.com");
            policy.check_host(host).unwrap();
            policy.check_addr(host, black_box(public)).unwrap();
        })
    });
    // What every request's host goes through before anything matches on it.
    c.bench_function("access/canonical_host", |b| {
        b.iter(|| black_box(tollgate::parts::canonical(black_box("API.GitHub.com"))))
    });
}

criterion_group!(benches, limiter, headers, classify, access);
criterion_main!(benches);
