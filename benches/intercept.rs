//! What interception costs per new host and per new tunnel, in memory (no sockets):
//!
//! * `leaf/new_host` — a host's first tunnel: sign a leaf and build its TLS
//!   configuration (the cache is cleared by using a new host name each time);
//! * `leaf/cached` — every later tunnel to the host: the cache lookup;
//! * `handshake/tls13` — a whole TLS 1.3 handshake with a cached leaf, client and
//!   server in one thread (rustls both sides): the CPU a new intercepted tunnel costs
//!   beyond the CONNECT;
//! * and, printed once, the resident memory of [`LEAF_CACHE`] cached leaves.
//!
//! `cargo bench --bench intercept`; `cargo bench --bench intercept -- --test` runs each once.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use rustls::pki_types::ServerName;
use tollgate::parts::{Ca, Leaves, LEAF_CACHE};

fn new_leaves() -> (Leaves, String) {
    let (cert, key) = Ca::generate("bench CA").unwrap();
    let ca = Arc::new(Ca::from_pem(&cert, &key).unwrap());
    (Leaves::new(ca).unwrap(), cert)
}

/// Resident memory of this process, in bytes (Linux).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn bench(c: &mut Criterion) {
    let (leaves, ca_pem) = new_leaves();
    let mut group = c.benchmark_group("leaf");
    let mut n = 0u64;
    group.bench_function("new_host", |b| {
        b.iter(|| {
            n += 1;
            black_box(leaves.server_config(&format!("h{n}.example.com")).unwrap())
        })
    });
    leaves.server_config("api.example.com").unwrap();
    group.bench_function("cached", |b| {
        b.iter(|| black_box(leaves.server_config("api.example.com").unwrap()))
    });
    group.finish();

    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let client = Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let server = leaves.server_config("api.example.com").unwrap();
    let name = ServerName::try_from("api.example.com").unwrap();
    c.bench_function("handshake/tls13", |b| {
        b.iter(|| {
            let mut client = rustls::ClientConnection::new(client.clone(), name.clone()).unwrap();
            let mut server = rustls::ServerConnection::new(server.clone()).unwrap();
            let mut buf = Vec::new();
            while client.is_handshaking() || server.is_handshaking() {
                buf.clear();
                while client.wants_write() {
                    client.write_tls(&mut buf).unwrap();
                }
                server.read_tls(&mut buf.as_slice()).unwrap();
                server.process_new_packets().unwrap();
                buf.clear();
                while server.wants_write() {
                    server.write_tls(&mut buf).unwrap();
                }
                client.read_tls(&mut buf.as_slice()).unwrap();
                client.process_new_packets().unwrap();
            }
        })
    });

    // Memory: a fresh cache filled to its bound.
    let (full, _) = new_leaves();
    let before = rss();
    for i in 0..LEAF_CACHE {
        full.server_config(&format!("m{i}.example.com")).unwrap();
    }
    let after = rss();
    println!(
        "leaf cache: {} leaves, {} KiB resident, {:.1} KiB per leaf",
        full.cached(),
        after.saturating_sub(before) / 1024,
        after.saturating_sub(before) as f64 / 1024.0 / LEAF_CACHE as f64
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
