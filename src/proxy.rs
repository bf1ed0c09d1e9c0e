//! The service stack a request passes through — the one place where layer order shows.
//!
//! ```text
//! Proxy::handle: classify → pick the group
//!   └─► Pushback (pushback.rs): read a small body; on 429 pause the group and replay
//!        └─► Throttle (limit::layer): wait in the group's queue, take a concurrency permit
//!             └─► Dispatch ─┬─► tunnel::open   (CONNECT: permit held while the tunnel is open)
//!                           └─► Upstream::send (permit held until the response body ends)
//! ```
//!
//! Push-back sits outside the throttle so that a replayed request queues again, at the
//! head of its group, behind the pause it caused.
//!
//! [`Proxy::handle`] is the outermost service and never fails: a [`ProxyError`] from any
//! step becomes a response there.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::Either;
use futures_util::FutureExt;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::{Service, ServiceBuilder};

use crate::body::{self, Body};
use crate::classify::Classifier;
use crate::config::{BackendKind, Config, ConfigError};
use crate::error::ProxyError;
use crate::limit::layer::{Admission, BoxFuture, Exchange, Routed, Throttle, ThrottleLayer};
use crate::limit::{Group, Limits, Shared};
use crate::metrics::Metrics;
use crate::pushback::{Pushback, PushbackLayer};
use crate::tunnel;
use crate::upstream::{Dialer, Upstream};

/// The inner stack, by its concrete type: cloning it per request (`Service::call` takes
/// `&mut self`) is then one reference count, where a boxed service would allocate.
type Stack = Pushback<Throttle<Dispatch>>;

/// Everything a request needs, built once from the configuration and shared by all
/// connections.
pub struct Proxy {
    classifier: Classifier,
    shared: Option<Arc<Shared>>,
    limits: Arc<Limits>,
    metrics: Arc<Metrics>,
    stack: Stack,
    tunnels: TaskTracker,
    /// Cancelled when shutdown's grace is over: open tunnels close.
    cut: CancellationToken,
}

impl Proxy {
    /// Builds the proxy; fails only on settings that need I/O to check (`ca_file`).
    pub fn new(config: &Config) -> Result<Proxy, ConfigError> {
        let metrics = Arc::new(Metrics::new());
        let shared = match config.backend.kind {
            BackendKind::Memory => None,
            BackendKind::Redis => {
                Some(Shared::new(&config.backend, &metrics).map_err(|message| {
                    ConfigError::Other {
                        file: "backend.url".into(),
                        message,
                    }
                })?)
            }
        };
        let limits = Arc::new(Limits::new(config, metrics.clone(), shared.clone()));
        Proxy::assemble(config, limits, metrics, shared)
    }

    /// Another proxy for the same configuration that spends the same budgets: groups,
    /// metrics and the shared store are this one's; the upstream connection pool and the
    /// tunnels are its own. One per serving thread (see [`crate::server::serve_threads`]),
    /// so that a request and the upstream connection it uses are served by one thread.
    pub fn sibling(&self, config: &Config) -> Result<Proxy, ConfigError> {
        Proxy::assemble(
            config,
            self.limits.clone(),
            self.metrics.clone(),
            self.shared.clone(),
        )
    }

    fn assemble(
        config: &Config,
        limits: Arc<Limits>,
        metrics: Arc<Metrics>,
        shared: Option<Arc<Shared>>,
    ) -> Result<Proxy, ConfigError> {
        let dialer = Dialer {
            connect_timeout: config.proxy.connect_timeout.0,
        };
        let upstream =
            Upstream::new(&config.proxy, dialer.clone()).map_err(|message| ConfigError::Other {
                file: "proxy.ca_file".into(),
                message,
            })?;
        let tunnels = TaskTracker::new();
        let cut = CancellationToken::new();
        let dispatch = Dispatch(Arc::new(DispatchInner {
            upstream,
            dialer,
            tunnels: tunnels.clone(),
            cut: cut.clone(),
        }));
        let stack = ServiceBuilder::new()
            .layer(PushbackLayer)
            .layer(ThrottleLayer)
            .service(dispatch);
        Ok(Proxy {
            classifier: Classifier::new(config),
            shared,
            limits,
            metrics,
            stack,
            tunnels,
            cut,
        })
    }

    /// Serves one request from a client connected to `local`. Never fails. `early` is
    /// the outcome of its wait in its group when it waited before hyper read it (see
    /// [`Proxy::group_of`]).
    ///
    /// Not an `async fn`: hyper moves this future into its connection's slot for every
    /// request, and an `async fn` would hold the request and `early` twice (its
    /// arguments, and the locals they move into). The work before the stack is done
    /// here; the future is the stack's.
    pub fn handle(
        &self,
        req: Request<Incoming>,
        local: SocketAddr,
        early: Option<Admission>,
    ) -> impl Future<Output = Response<Body>> + Send + 'static {
        let arrived = early.as_ref().map_or_else(Instant::now, |a| a.arrived);
        // No body, nearly every request's case, needs no allocation: our empty body is
        // a zero-sized value, which boxing does not allocate. (What hyper's body is
        // dropped with here is already at its end.)
        let mut req = req.map(|b| {
            if http_body::Body::is_end_stream(&b) {
                body::empty()
            } else {
                body::boxed(b)
            }
        });
        let target = match self.classifier.classify(&mut req, local) {
            Ok(target) => target,
            Err(e) => return Either::Left(std::future::ready(e.into_response())),
        };
        let group = self.limits.group_for(&target.host, target.limit.as_deref());
        tracing::debug!(method = %req.method(), uri = %req.uri(), group = %group.name, "request");

        let routed = Arc::new(Routed {
            target,
            group,
            arrived,
        });
        let exchange = Exchange::new(req, routed, early.map(Box::new));
        // Called directly rather than through `ServiceExt::oneshot`, whose state machine
        // moves the exchange once more and polls readiness inside the future. Every
        // layer of this stack is always ready (see their `poll_ready`; a test checks
        // it), so asking once here with a no-op waker costs nothing. A layer that can be
        // not ready (tower's `Buffer`, `ConcurrencyLimit`) must not be added without
        // going back to `oneshot`: this call would not wait for it.
        let mut stack = self.stack.clone();
        let ready = stack.poll_ready(&mut Context::from_waker(std::task::Waker::noop()));
        debug_assert!(
            matches!(ready, Poll::Ready(Ok(()))),
            "the stack is always ready"
        );
        let answered = stack.call(exchange).map(|outcome| {
            outcome.unwrap_or_else(|e| {
                tracing::debug!(error = %e, "request failed");
                e.into_response()
            })
        });
        Either::Right(answered)
    }

    /// The group of a request with this head, and its cost; `None` when it cannot be
    /// classified ([`Proxy::handle`] answers that). Decides exactly as [`Proxy::handle`]
    /// will for the same head, so that a new connection's first request can go to its
    /// group's thread and wait there before hyper reads it (`server::early`).
    pub fn group_of(&self, head: &mut Request<()>, local: SocketAddr) -> Option<(Arc<Group>, u32)> {
        let target = self.classifier.classify(head, local).ok()?;
        let group = self.limits.group_for(&target.host, target.limit.as_deref());
        let cost = group.settings.cost_of(head.method(), head.uri().path());
        Some((group, cost))
    }

    /// Starts background work that needs a runtime (the shared store's heartbeat).
    pub fn start_background(&self) {
        if let Some(shared) = &self.shared {
            shared.spawn_maintenance();
        }
    }

    /// The groups, for the admin endpoints.
    pub fn limits(&self) -> &Arc<Limits> {
        &self.limits
    }

    /// The metrics, for the admin endpoints.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The open CONNECT tunnels, which shutdown waits for.
    pub fn tunnels(&self) -> &TaskTracker {
        &self.tunnels
    }

    /// Closes every open tunnel now (shutdown, once the grace is over).
    pub fn cut_tunnels(&self) {
        self.cut.cancel();
    }
}

/// The leaf of the stack: CONNECT opens a tunnel, everything else goes upstream.
/// Shared behind an `Arc`: a tunnel's future holds its own handle, and cloning the
/// pooled client and the rest field by field showed in the profile.
#[derive(Clone)]
struct Dispatch(Arc<DispatchInner>);

struct DispatchInner {
    upstream: Upstream,
    dialer: Dialer,
    tunnels: TaskTracker,
    cut: CancellationToken,
}

impl Service<Exchange> for Dispatch {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, exchange: Exchange) -> Self::Future {
        if exchange.req.method() != Method::CONNECT {
            return Box::pin(self.0.upstream.send(exchange.req, exchange.permit));
        }
        let this = self.0.clone();
        Box::pin(async move {
            let Exchange {
                req,
                routed,
                permit,
                ..
            } = exchange;
            let target = &routed.target;
            tunnel::open(&this.dialer, &this.tunnels, &this.cut, target, req, permit).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::Layer;

    /// glibc serves allocations up to this size from its per-thread cache; a bigger box
    /// takes the slower general path.
    const SMALL_ALLOCATION: usize = 1024;

    /// The layers' futures are written or moved for every request (push-back's into the
    /// slot hyper keeps per connection, the others into boxes): each was brought under
    /// the small-allocation limit (docs/performance-log.md, "Fourth session run"), and an
    /// innocent-looking change (an `async fn` taking the request by value, a new local
    /// held across an `.await`) can double one without any test of behaviour noticing.
    #[tokio::test]
    async fn the_futures_boxed_for_every_request_stay_small() {
        let config = Config::parse("", "t.toml").unwrap();
        let dialer = Dialer {
            connect_timeout: config.proxy.connect_timeout.0,
        };
        let dispatch = Dispatch(Arc::new(DispatchInner {
            upstream: Upstream::new(&config.proxy, dialer.clone()).unwrap(),
            dialer,
            tunnels: TaskTracker::new(),
            cut: CancellationToken::new(),
        }));
        let limits = Limits::new(&config, Arc::new(Metrics::new()), None);
        let to = |host: &str| {
            let req = Request::get(format!("http://{host}:9/x"))
                .body(body::empty())
                .unwrap();
            let routed = Arc::new(Routed {
                target: crate::classify::Target {
                    kind: crate::classify::Kind::Forward,
                    host: host.into(),
                    port: 9,
                    limit: None,
                },
                group: limits.group_for(host, None),
                arrived: Instant::now(),
            });
            Exchange::new(req, routed, None)
        };
        let get = || to("127.0.0.1");
        // The throttle builds a future of its own only for a request that must wait
        // (one that may leave at once gets the dispatch's): one in a paused group.
        limits
            .group_for("127.0.0.2", None)
            .pause_for(std::time::Duration::from_secs(60));
        // `Proxy::handle` calls the stack without waiting for readiness: it must be ready
        // at once, always.
        let mut stack: Stack = PushbackLayer.layer(ThrottleLayer.layer(dispatch.clone()));
        let ready = stack.poll_ready(&mut Context::from_waker(std::task::Waker::noop()));
        assert!(matches!(ready, Poll::Ready(Ok(()))));
        // Calling a layer builds its future (the throttle may admit the request then);
        // nothing is sent until it is polled.
        let push_back = PushbackLayer
            .layer(ThrottleLayer.layer(dispatch.clone()))
            .call(get());
        let throttle = ThrottleLayer.layer(dispatch.clone()).call(to("127.0.0.2"));
        let paused = limits.group_for("127.0.0.2", None);
        assert_eq!(paused.metrics.admitted.get(), 0, "the paused request waits");
        let upstream = dispatch.clone().call(get());
        for (layer, size) in [
            ("push-back", std::mem::size_of_val(&push_back)),
            ("throttle", std::mem::size_of_val(&*throttle)),
            (
                "dispatch and upstream send",
                std::mem::size_of_val(&*upstream),
            ),
        ] {
            assert!(
                size <= SMALL_ALLOCATION,
                "the {layer} future is {size} bytes, over {SMALL_ALLOCATION}"
            );
        }
    }
}
