//! The path of a request, from the client's head to the upstream's answer.
//!
//! ```text
//! Proxy::handle
//!   0. access        the client's address, its proxy credentials, a loop
//!   1. classify      where it goes (forward, route, tunnel) and whose budget it spends
//!   2. tunnel        CONNECT: wait in the group, then open it (permit held while open)
//!   3. forward       read the body into memory when small, so it can be replayed;
//!   4.               wait in the group → send upstream → judge the answer:
//!                    done, or paused and sent again at the head of the queue
//! ```
//!
//! Every step returns a [`ProxyError`] on failure, and [`Proxy::handle`], the only
//! caller, turns it into the client's response: the request path never fails.
//!
//! The waiting, sending and tunnelling futures are boxed: hyper keeps each request's
//! future inside its connection for as long as the request waits, so this one stays
//! small, and a waiting request holds only the state of its wait.

use std::future::Future;
use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::access::Access;
use crate::body::{self, Body};
use crate::classify::{Classifier, Kind, Target};
use crate::config::{BackendKind, Config, ConfigError};
use crate::error::ProxyError;
use crate::limit::{Group, Limits, Permit, Redis, Store};
use crate::metrics::Metrics;
use crate::pushback::{self, Replayable};
use crate::tunnel;
use crate::upstream::{Dialer, Upstream};

/// Everything a request needs, built once from the configuration and shared by all
/// connections.
pub struct Proxy {
    access: Access,
    classifier: Classifier,
    limits: Arc<Limits>,
    metrics: Arc<Metrics>,
    redis: Option<Arc<Redis>>,
    upstream: Upstream,
    dialer: Dialer,
    tunnels: TaskTracker,
    /// Cancelled when shutdown's grace is over: open tunnels close.
    cut: CancellationToken,
}

impl Proxy {
    /// Builds the proxy; fails only on settings that need I/O to check (`ca_file`, the
    /// Redis URL).
    pub fn new(config: &Config) -> Result<Proxy, ConfigError> {
        let metrics = Arc::new(Metrics::new());
        let redis = match config.backend.kind {
            BackendKind::Memory => None,
            BackendKind::Redis => {
                Some(Redis::new(&config.backend, &metrics).map_err(|message| {
                    ConfigError::Other {
                        file: "backend.url".into(),
                        message,
                    }
                })?)
            }
        };
        let store = redis.clone().map_or(Store::Memory, Store::Redis);
        let limits = Arc::new(Limits::new(config, metrics.clone(), store));
        let access = Access::new(config)?;
        let dialer = Dialer {
            connect_timeout: config.proxy.connect_timeout.0,
            policy: access.policy.clone(),
        };
        let upstream =
            Upstream::new(&config.proxy, dialer.clone()).map_err(|message| ConfigError::Other {
                file: "proxy.ca_file".into(),
                message,
            })?;
        Ok(Proxy {
            access,
            classifier: Classifier::new(config),
            limits,
            metrics,
            redis,
            upstream,
            dialer,
            tunnels: TaskTracker::new(),
            cut: CancellationToken::new(),
        })
    }

    /// Serves one request from `client`, connected to `local`. Never fails: an error is
    /// answered with its own response.
    ///
    /// The request is classified before the future is built, and kept in a box: hyper
    /// holds this future in the client's connection for as long as the request waits,
    /// and an `async fn` would keep its arguments there besides what they become.
    pub fn handle(
        &self,
        req: Request<Incoming>,
        local: SocketAddr,
        client: SocketAddr,
    ) -> impl Future<Output = Response<Body>> + Send + '_ {
        let arrived = Instant::now();
        let req = req.map(body::boxed);
        // 0. Who asks, and whether it came round again (a password is checked below).
        let checked = self.access.check(client, req.headers());
        let classified = self.classify(req, local).map(Box::new);
        async move {
            let answered = match (checked, classified) {
                (Err(e), _) => Err(e),
                (Ok(check), classified) => match (check.user().await, classified) {
                    (Err(e), _) | (Ok(_), Err(e)) => Err(e),
                    (Ok(_), Ok(to)) if to.target.kind == Kind::Tunnel => {
                        self.tunnel(to, arrived).await
                    }
                    (Ok(_), Ok(to)) => self.forward(to, arrived).await,
                },
            };
            answered.unwrap_or_else(|e| {
                tracing::debug!(error = %e, "request failed");
                e.into_response()
            })
        }
    }

    /// 1. Where a request goes, and whose budget it spends.
    fn classify(
        &self,
        mut req: Request<Body>,
        local: SocketAddr,
    ) -> Result<Classified, ProxyError> {
        let target = self.classifier.classify(&mut req, local)?;
        let group = self
            .limits
            .group_for(&target.host, target.port, target.limit.as_deref());
        let cost = group
            .settings
            .cost_of(req.method(), &crate::path::for_matching(req.uri().path()));
        tracing::debug!(method = %req.method(), uri = %req.uri(), group = %group.name, "request");
        Ok(Classified {
            request: Replayable::new(req),
            target,
            group,
            cost,
        })
    }

    /// 2. A tunnel has no HTTP answer to judge: one wait, then it opens.
    async fn tunnel(
        &self,
        mut to: Box<Classified>,
        arrived: Instant,
    ) -> Result<Response<Body>, ProxyError> {
        let permit = admit(&to.group, to.cost, arrived, false).await?;
        let (dialer, tunnels, cut) = (&self.dialer, &self.tunnels, &self.cut);
        let req = to.request.attempt(0);
        let open = Box::pin(tunnel::open(dialer, tunnels, cut, &to.target, req, permit));
        open.await
    }

    /// Steps 3 and 4: the body, read before the wait; then wait, send, judge, and
    /// again while the upstream pushes back and time is left.
    async fn forward(
        &self,
        mut to: Box<Classified>,
        arrived: Instant,
    ) -> Result<Response<Body>, ProxyError> {
        let Classified {
            request,
            group,
            cost,
            ..
        } = &mut *to;
        request.read_body(group.settings.max_replay_body).await?;
        let mut attempt = 0;
        loop {
            let permit = admit(group, *cost, arrived, attempt > 0).await?;
            let sent = Instant::now();
            let send = Box::pin(self.upstream.send(request.attempt(attempt), permit));
            let response = send.await?;
            let replay = request.can_replay();
            match pushback::after_answer(group, arrived, sent, replay, attempt, response) {
                ControlFlow::Break(response) => return Ok(response),
                ControlFlow::Continue(()) => attempt += 1,
            }
        }
    }

    /// Starts background work that needs a runtime (the Redis store's heartbeat).
    pub fn start_background(&self) {
        if let Some(redis) = &self.redis {
            redis.spawn_maintenance();
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

/// A request, classified.
struct Classified {
    request: Replayable,
    target: Target,
    group: Arc<Group>,
    cost: u32,
}

/// Waits in `group` for a request of `cost` (`retry`: at the head of the queue).
async fn admit(
    group: &Arc<Group>,
    cost: u32,
    arrived: Instant,
    retry: bool,
) -> Result<Permit, ProxyError> {
    let wait = Box::pin(group.admit(cost, arrived, retry));
    wait.await
        .map_err(|refusal| ProxyError::refused(group, refusal))
}
