//! The listener: accepts connections and serves them with hyper until shutdown.
//!
//! HTTP/1.1 with keep-alive, HTTP/2 where the client offers it (prior knowledge), and
//! upgrades so CONNECT can take over the connection. The caller binds the listener, so
//! tests pass one bound to port 0.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ConfigError, ProxyConfig};
use crate::proxy::Proxy;

/// Builds the proxy from `config` and serves `listener` until `shutdown` completes, then
/// drains in-flight requests and tunnels for up to `proxy.shutdown_grace`.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConfigError> {
    run_with_admin(listener, None, config, shutdown).await
}

/// Like [`run`], and serves the admin endpoints on `admin` too, when given.
pub async fn run_with_admin(
    listener: TcpListener,
    admin: Option<TcpListener>,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConfigError> {
    let proxy = Arc::new(Proxy::new(&config)?);
    proxy.start_background();
    let stop = CancellationToken::new();
    if let Some(admin) = admin {
        let stop = stop.clone();
        tokio::spawn(crate::admin::serve(
            admin,
            proxy.clone(),
            stop.cancelled_owned(),
        ));
    }
    serve(listener, proxy, &config.proxy, shutdown).await;
    stop.cancel();
    Ok(())
}

/// Serves `listener` with an already built [`Proxy`]; see [`run`].
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    settings: &ProxyConfig,
    shutdown: impl Future<Output = ()>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Against slowloris; hyper also applies it while a keep-alive connection is idle.
        .header_read_timeout(settings.client_header_timeout.0);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(20));

    let graceful = GracefulShutdown::new();
    // Cancelled when the grace is over: every client connection still open is closed.
    let cut = CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, remote) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let proxy = proxy.clone();
        let service = service_fn(move |req| {
            let proxy = proxy.clone();
            async move { Ok::<_, Infallible>(proxy.handle(req, local).await) }
        });
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        let cut = cut.clone();
        tokio::spawn(async move {
            tokio::select! {
                ended = conn => if let Err(e) = ended {
                    tracing::debug!(%remote, error = %e, "client connection ended with an error");
                },
                _ = cut.cancelled() => tracing::debug!(%remote, "connection cut at shutdown"),
            }
        });
    }
    drop(listener);

    let grace = settings.shutdown_grace.0;
    let open = graceful.count();
    tracing::info!(connections = open, grace = %humantime::format_duration(grace), "shutting down");
    proxy.tunnels().close();
    let drained = async {
        graceful.shutdown().await;
        proxy.tunnels().wait().await;
    };
    if tokio::time::timeout(grace, drained).await.is_err() {
        tracing::warn!(
            tunnels = proxy.tunnels().len(),
            "shutdown_grace elapsed; closing what is still open"
        );
        cut.cancel();
        proxy.cut_tunnels();
        // The cut tasks end at their next poll; let them, so nothing outlives `run`.
        let _ = tokio::time::timeout(Duration::from_secs(1), proxy.tunnels().wait()).await;
    }
}
