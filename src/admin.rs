//! The admin listener: `/` (a live dashboard), `/metrics` (Prometheus), `/healthz`,
//! `/readyz`, `/status` (JSON per group).
//!
//! `/healthz` says the process serves (a liveness probe); `/readyz` says it takes new
//! requests, and turns `503` the moment shutdown begins, while queued requests drain
//! (a readiness probe: the Service stops sending, nothing restarts the process).
//!
//! Kept on its own address so metrics and status are never exposed to, nor throttled
//! with, the proxied traffic.
//!
//! The dashboard is one static page compiled into the binary (`admin/dashboard.html`)
//! that polls `/status`, and `/history?group=<name>` for the charts of the groups it
//! draws; the only history behind them is the last 15 minutes of each group
//! (`admin/history.rs`), sampled here once a second.

mod history;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::time::{interval, Duration, MissedTickBehavior};

use crate::body::{self, Body};
use crate::limit::Group;
use crate::metrics::{BucketFigures, TokenFigures};
use crate::proxy::Proxy;
use history::{History, Reading};

/// The dashboard: HTML, CSS and JS in one file, no external resources.
const DASHBOARD: &str = include_str!("admin/dashboard.html");

/// Serves the admin endpoints on `listener` until `shutdown` completes.
pub async fn serve(listener: TcpListener, proxy: Arc<Proxy>, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    let history = Arc::new(History::default());
    let mut second = interval(Duration::from_secs(1));
    second.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => return,
            _ = second.tick() => {
                let groups = proxy.limits().groups();
                // Read before taking the history's lock, which `/status` waits on.
                let readings: Vec<_> = (groups.iter().take(history::MAX_GROUPS))
                    .map(|g| (g.name.clone(), reading(g)))
                    .collect();
                history.record(readings);
                continue;
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    continue;
                }
            },
        };
        let proxy = proxy.clone();
        let history = history.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let (proxy, history) = (proxy.clone(), history.clone());
                async move { Ok::<_, Infallible>(answer(&proxy, &history, req)) }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn answer(proxy: &Proxy, history: &History, req: Request<Incoming>) -> Response<Body> {
    let (status, content_type, text) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics(proxy),
        ),
        (&Method::GET, "/healthz") => (StatusCode::OK, "text/plain", "ok\n".to_string()),
        (&Method::GET, "/readyz") if proxy.shutdown().draining() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "shutting down: draining queued requests\n".to_string(),
        ),
        (&Method::GET, "/readyz") => (StatusCode::OK, "text/plain", "ready\n".to_string()),
        (&Method::GET, "/") => (
            StatusCode::OK,
            "text/html; charset=utf-8",
            DASHBOARD.to_string(),
        ),
        (&Method::POST, "/reload") => match proxy.reload() {
            Ok(loaded) => (
                StatusCode::OK,
                "text/plain",
                format!(
                    "reloaded {} (sha256 {})\n",
                    loaded.path.unwrap_or_default(),
                    loaded.sha256.unwrap_or_default()
                ),
            ),
            Err(e) => (StatusCode::BAD_REQUEST, "text/plain", format!("{e}\n")),
        },
        (&Method::GET, "/history") => match group_param(req.uri().query()) {
            Some(group) => {
                let json = history.series(&group);
                (StatusCode::OK, "application/json", format!("{json}\n"))
            }
            None => (
                StatusCode::BAD_REQUEST,
                "text/plain",
                "GET /history?group=<name>\n".to_string(),
            ),
        },
        (&Method::GET, "/status") => {
            let json = status(proxy, history);
            (StatusCode::OK, "application/json", format!("{json:#}\n"))
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "tollgate admin: GET / (dashboard), /metrics, /healthz, /readyz, /status or \
             /history?group=<name>; POST /reload\n"
                .to_string(),
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

/// The `/metrics` text. The pace in force moves with the clock (a pause ends, a probe
/// times out) as well as with answers, so it is read from each group as it is scraped,
/// with the group's token budgets.
fn metrics(proxy: &Proxy) -> String {
    let mut tokens = Vec::new();
    for group in proxy.limits().groups() {
        let status = group.status();
        group
            .metrics
            .pace_in_force
            .set(status.pace_in_force_per_second);
        if let Some(counted) = status.tokens {
            let buckets = (counted.buckets.iter())
                .map(|b| BucketFigures {
                    kind: b.kind,
                    source: b.source,
                    per_second: b.per_second,
                    in_use: b.in_use,
                })
                .collect();
            let reserved = counted.reserved;
            tokens.push((status.name, TokenFigures { reserved, buckets }));
        }
    }
    let metrics = proxy.metrics();
    metrics.show_tokens(tokens.iter().map(|(name, t)| (name.as_str(), t)));
    metrics.encode()
}

/// What the once-a-second sampler reads of `group`: counters and the moment's state,
/// nothing that the request path keeps for it.
fn reading(group: &Group) -> Reading {
    let status = group.status();
    let metrics = &group.metrics;
    let (waits, waited) = metrics.queue_wait.read();
    let statuses = metrics.upstream.statuses();
    let count = |codes: std::ops::RangeInclusive<u16>| statuses.range(codes).map(|(_, n)| n).sum();
    Reading {
        departures: metrics.admitted.get(),
        queued: status.queued,
        pace: status.pace_in_force_per_second,
        paused: status.paused_for_seconds.is_some(),
        waits,
        waited,
        refused: count(429..=429),
        failed: count(500..=599),
    }
}

/// The group named by `group=` in a query string, percent-decoded (names are host
/// names and `[[limit]]` names, which may hold any character).
fn group_param(query: Option<&str>) -> Option<String> {
    let value = query?.split('&').find_map(|p| p.strip_prefix("group="))?;
    let mut bytes = Vec::with_capacity(value.len());
    let mut rest = value.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        let hex = |i: usize| char::from(*tail.get(i)?).to_digit(16);
        match (b, hex(0), hex(1)) {
            (b'%', Some(hi), Some(lo)) => {
                bytes.push((hi * 16 + lo) as u8);
                rest = &tail[2..];
                continue;
            }
            (b'+', _, _) => bytes.push(b' '),
            _ => bytes.push(b),
        }
        rest = tail;
    }
    String::from_utf8(bytes).ok()
}

/// The `/status` document: the backend, and each group's snapshot with its configured
/// limits and counters beside it.
fn status(proxy: &Proxy, history: &History) -> serde_json::Value {
    let backend = match proxy.redis() {
        None => serde_json::json!({ "kind": "memory" }),
        Some(redis) => serde_json::json!({
            "kind": "redis",
            "up": redis.is_up(),
            "replicas": redis.replicas(),
        }),
    };
    let groups: Vec<_> = (proxy.limits().groups().iter())
        .map(|g| group_status(g, history))
        .collect();
    serde_json::json!({ "backend": backend, "config": proxy.loaded(), "groups": groups })
}

/// One group: its own snapshot (whatever fields it has), plus what was configured and
/// its counters, recent departures and the waits of its last minute.
fn group_status(group: &Group, history: &History) -> serde_json::Value {
    let mut json = serde_json::to_value(group.status()).unwrap_or_default();
    let settings = group.settings();
    let metrics = &group.metrics;
    let extra = serde_json::json!({
        "configured_rates_per_second":
            settings.rates.iter().map(|r| r.per_second()).collect::<Vec<_>>(),
        "concurrency": settings.concurrency,
        "queue_limit": settings.queue,
        "adaptive": settings.adaptive,
        "departures_per_second": history.per_second(&group.name),
        "wait_last_minute": history.last_minute(&group.name),
        "upstream_statuses": metrics.upstream.statuses(),
        "counters": {
            "requests_admitted": metrics.requests_admitted.get(),
            "departures": metrics.admitted.get(),
            "queue_full": metrics.queue_full.get(),
            "max_wait": metrics.max_wait.get(),
            "cancelled": metrics.cancelled.get(),
            "denied": metrics.denied.get(),
            "pauses": metrics.pauses.get(),
            "retries": metrics.retries.get(),
            "passed_through": metrics.passed_through.get(),
        },
    });
    if let (Some(json), serde_json::Value::Object(extra)) = (json.as_object_mut(), extra) {
        for (key, value) in extra {
            // The group's own fields win: they are the live state.
            json.entry(key).or_insert(value);
        }
    }
    json
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_param_is_percent_decoded() {
        let of = |q: &str| group_param(Some(q));
        assert_eq!(
            of("group=api.example.com").as_deref(),
            Some("api.example.com")
        );
        assert_eq!(of("x=1&group=a%2Fb%20c+d").as_deref(), Some("a/b c d"));
        assert_eq!(of("group=%E2%9C%93").as_deref(), Some("✓"));
        assert_eq!(of("group=50%").as_deref(), Some("50%"));
        assert_eq!(of("other=1"), None);
        assert_eq!(group_param(None), None);
    }
}
