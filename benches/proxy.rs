//! Small GETs to a loopback upstream, direct and through tollgate in forward mode, so
//! the report shows what the proxy hop costs. `cargo bench --bench proxy -- --test`
//! runs each once as a smoke test.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

/// A minimal hyper server on 127.0.0.1:0 answering every request with "ok".
async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(|_: Request<hyper::body::Incoming>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// tollgate with the default configuration on 127.0.0.1:0, running until the runtime
/// is dropped.
async fn tollgate() -> SocketAddr {
    // The upstream is on loopback, which tollgate refuses unless allowed.
    let config = "[access]\nallow = [\"127.0.0.0/8\"]\n";
    let config = tollgate::config::Config::parse(config, "bench.toml").unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        tollgate::run(listener, None, config, std::future::pending())
            .await
            .unwrap();
    });
    addr
}

/// One GET that must come back `200 ok`.
async fn get(client: &reqwest::Client, url: &str) {
    let resp = client.get(url).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(&resp.bytes().await.unwrap()[..], b"ok");
}

fn small_gets(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (upstream, proxy) = rt.block_on(async { (upstream().await, tollgate().await) });
    let url = format!("http://{upstream}/");
    // One keep-alive client each, so the numbers are per request, not per connection.
    let direct = reqwest::Client::builder().no_proxy().build().unwrap();
    let via = reqwest::Client::builder()
        .proxy(reqwest::Proxy::http(format!("http://{proxy}")).unwrap())
        .build()
        .unwrap();
    // Warm both paths (connections, pools) before criterion starts timing.
    rt.block_on(async {
        get(&direct, &url).await;
        get(&via, &url).await;
    });

    let mut group = c.benchmark_group("small_get");
    group.bench_function("direct", |b| {
        b.to_async(&rt).iter(|| get(&direct, &url));
    });
    group.bench_function("via_tollgate", |b| {
        b.to_async(&rt).iter(|| get(&via, &url));
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(50)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    targets = small_gets
}
criterion_main!(benches);
