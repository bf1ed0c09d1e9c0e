//! The admin listener: `/metrics` (Prometheus), `/healthz`, `/status` (JSON per group).
//!
//! Kept on its own address so metrics and status are never exposed to, nor throttled
//! with, the proxied traffic.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use crate::body::{self, Body};
use crate::proxy::Proxy;

/// Serves the admin endpoints on `listener` until `shutdown` completes.
pub async fn serve(listener: TcpListener, proxy: Arc<Proxy>, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    continue;
                }
            },
        };
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let proxy = proxy.clone();
                async move { Ok::<_, Infallible>(answer(&proxy, req)) }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn answer(proxy: &Proxy, req: Request<Incoming>) -> Response<Body> {
    let (status, content_type, text) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            proxy.metrics().encode(),
        ),
        (&Method::GET, "/healthz") => (StatusCode::OK, "text/plain", "ok\n".to_string()),
        (&Method::GET, "/status") => {
            let groups: Vec<_> = proxy.limits().groups().iter().map(|g| g.status()).collect();
            let json = serde_json::json!({ "groups": groups });
            (StatusCode::OK, "application/json", format!("{json:#}\n"))
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "tollgate admin: GET /metrics, /healthz or /status\n".to_string(),
        ),
    };
    let mut resp = Response::new(body::full(text));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    resp
}
