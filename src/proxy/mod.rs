//! The path of a request, from the client's head to the upstream's answer.
//!
//! ```text
//! Proxy::handle
//!   0. access        the client's address, its proxy credentials, a loop
//!   1. classify      where it goes (forward, route, tunnel) and whose budget it spends
//!   2. tunnel        CONNECT: wait in the group, then open it (permit held while open);
//!                    or, to an intercepted host, answer it and serve what comes
//!                    through as requests of their own (they start again at 1)
//!   3. forward       read the body into memory when small, so it can be replayed;
//!   4.               wait in the group → send upstream → judge the answer:
//!                    done, or paused and sent again at the head of the queue
//!                    (a switch of protocols, WebSocket, is sent once and relayed)
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
use crate::access_log::{self, Timing};
use crate::body::{self, Body};
use crate::classify::{Classifier, Inside, Kind, Target};
use crate::error::ProxyError;
use crate::half_close::{Sending, Unread};
use crate::intercept::Intercept;
use crate::limit::{Cost, Group, Limits, Permit, Redis};
use crate::metrics::Metrics;
use crate::pushback;
use crate::replay::Replayable;
use crate::shutdown::Shutdown;
use crate::tunnel;
use crate::upstream::{Dialer, Upstream};

mod keys;
mod respond;
mod state;
mod tokens;

use respond::{respond, Done, Unanswered};

/// Everything a request needs, built once from the configuration and shared by all
/// connections.
pub struct Proxy {
    /// What a reload swaps, read once per request.
    live: arc_swap::ArcSwap<Live>,
    /// How to reload, and what it may not change.
    reload: crate::reload::Reload,
    metrics: Arc<Metrics>,
    redis: Option<Arc<Redis>>,
    upstream: Upstream,
    dialer: Dialer,
    /// Which CONNECT tunnels are decrypted (`[intercept]`).
    intercept: Option<Intercept>,
    tunnels: TaskTracker,
    /// Cancelled when shutdown's grace is over: open tunnels close.
    cut: CancellationToken,
    shutdown: Shutdown,
    /// `body_idle_timeout`, for request bodies.
    body_idle: std::time::Duration,
    /// `replay_memory`: what the bodies read ahead for replay may take together.
    replay_memory: Arc<crate::replay::ReplayMemory>,
}

/// The part of the proxy a reload replaces: a request takes the one in force when it
/// arrives and keeps it to its end.
pub(crate) struct Live {
    pub(crate) access: Access,
    pub(crate) classifier: Classifier,
    pub(crate) limits: Arc<Limits>,
    /// `[log] access`: one line per request.
    pub(crate) access_log: bool,
    /// `[proxy] server_timing`: tell the client how long it queued.
    pub(crate) server_timing: bool,
    /// Which file, when loaded.
    pub(crate) loaded: crate::reload::Loaded,
}

impl Proxy {
    /// Serves one request from `client`, connected to `local` (and sent `inside` an
    /// intercepted tunnel, if it was; on a plain HTTP/1 connection, `sending` counts its
    /// requests out upstream, see [`crate::half_close`]). Never fails: an error is
    /// answered with its own response.
    ///
    /// The request is classified before the future is built, and kept in a box: hyper
    /// holds this future in the client's connection for as long as the request waits,
    /// and an `async fn` would keep its arguments there besides what they become.
    pub fn handle(
        self: &Arc<Self>,
        req: Request<Unread<Incoming>>,
        local: SocketAddr,
        client: SocketAddr,
        inside: Option<&Inside>,
        sending: Option<&Arc<Sending>>,
    ) -> impl Future<Output = Response<Body>> + Send + 'static {
        let arrived = Instant::now();
        let live = self.live.load_full();
        // What the access log tells besides the answer; taken before classifying, which
        // may refuse the request or rewrite its URI.
        let asked = live
            .access_log
            .then(|| (req.method().clone(), access_log::url(req.uri())));
        // A CONNECT's body is its tunnel, which may idle as long as it likes.
        let req = match req.method() == http::Method::CONNECT {
            true => req.map(body::boxed),
            false => req.map(|b| body::idle_limited(b, self.body_idle)),
        };
        // 0. Who asks, and whether it came round again (a password is checked below).
        // Inside a tunnel, the CONNECT that opened it was checked, and its user asks.
        let checked = match inside {
            None => live.access.check(client, req.headers()),
            Some(inside) => Ok(crate::access::Check::Passed(inside.user.clone())),
        };
        let mut classified = self.classify(&live, req, local, inside).map(|mut to| {
            to.sending = sending.cloned();
            Box::new(to)
        });
        // Where it goes once classified: a route's upstream, a tunnelled request's host.
        let asked = match (asked, &mut classified) {
            (Some((method, _)), Ok(to)) => Some((method, to.url.take().unwrap_or_default())),
            (asked, _) => asked,
        };
        let proxy = self.clone();
        async move {
            let this = &*proxy;
            let mut unanswered = Unanswered::new(asked, client, arrived);
            let mut timing = Timing::default();
            let (mut user, mut tunnel) = (None, None);
            let group = classified.as_ref().ok().map(|to| to.group.clone());
            unanswered.group.clone_from(&group);
            // One value matched at a time: a tuple of them would be kept, beside its
            // parts, in this future for as long as the request waits.
            let answered = match checked {
                Err(e) => Err(answered_early(e.into(), classified)),
                Ok(check) => match check.user().await {
                    Err(e) => Err(answered_early(e.into(), classified)),
                    Ok(who) => match classified {
                        Err(e) => Err(e),
                        Ok(to) => {
                            user = who;
                            let user = user.as_deref();
                            let asker = keys::Asker {
                                user,
                                client: client.ip(),
                            };
                            match &this.intercept {
                                _ if to.target.kind != Kind::Tunnel => {
                                    this.forward(to, arrived, asker, &mut timing).await
                                }
                                Some(i) if i.covers(&to.target.host, to.target.port) => {
                                    tunnel = Some("intercepted");
                                    this.open_intercepted(to, user.map(str::to_string))
                                }
                                _ => {
                                    tunnel = Some("blind");
                                    this.tunnel(to, arrived, asker, &mut timing).await
                                }
                            }
                        }
                    },
                },
            };
            let done = Done {
                tunnel,
                client,
                user,
                group,
                timing,
            };
            let asked = unanswered.asked.take();
            respond(answered, &live, &this.metrics, asked, done)
        }
    }

    /// 1. Where a request goes, and whose budget it spends.
    fn classify(
        &self,
        live: &Live,
        mut req: Request<Body>,
        local: SocketAddr,
        inside: Option<&Inside>,
    ) -> Result<Classified, ProxyError> {
        if let Some(why) = crate::upstream::malformed_request(req.headers()) {
            return Err(ProxyError::BadRequest(format!("malformed request: {why}")));
        }
        let target = match inside {
            None => live.classifier.classify(&mut req, local)?,
            Some(inside) => Classifier::inside(&mut req, inside)?,
        };
        let group = live
            .limits
            .group_for(&target.host, target.port, target.limit.as_deref());
        let cost = group
            .settings()
            .cost_of(req.method(), &crate::path::for_matching(req.uri().path()));
        tracing::debug!(method = %req.method(), uri = %req.uri(), group = %group.name, "request");
        let upgrade = crate::upstream::upgrade::requested(req.version(), req.headers());
        let url = live.access_log.then(|| access_log::url(req.uri()));
        Ok(Classified {
            url,
            left: LeftEarly(Some(group.clone())),
            method: req.method().clone(),
            sending: None,
            upgrade,
            request: Replayable::new(req),
            target,
            group,
            cost,
        })
    }

    /// A destination `[access]` refuses by its name or literal address is answered
    /// now: it spends no slot of its group and counts as denied, not admitted. The
    /// dialer still judges every address a name resolves to.
    fn refuse_denied(&self, to: &mut Classified) -> Result<(), ProxyError> {
        let policy = self.dialer.policy.load();
        let checked = policy.check_destination(&to.target.host, to.target.port);
        checked.map_err(|denial| {
            to.left.disarm();
            to.group.metrics.denied.inc();
            ProxyError::DestinationDenied { denial }
        })
    }

    /// 2. A tunnel has no HTTP answer to judge: one wait, then it opens.
    async fn tunnel(
        &self,
        mut to: Box<Classified>,
        arrived: Instant,
        asker: keys::Asker<'_>,
        timing: &mut Timing,
    ) -> Result<Response<Body>, ProxyError> {
        to.left.disarm();
        self.refuse_denied(&mut to)?;
        let (group, flow) = keys::budget(&to.group, &to.request, asker)?;
        let cost = Cost {
            requests: to.cost,
            tokens: None,
            flow,
        };
        let permit = self.admit(&group, cost, arrived, false).await;
        timing.wait = arrived.elapsed();
        let permit = permit?;
        let (dialer, tunnels, cut) = (&self.dialer, &self.tunnels, &self.cut);
        let req = to.request.attempt(0);
        let open = Box::pin(tunnel::open(dialer, tunnels, cut, &to.target, req, permit));
        let opened = Instant::now();
        let answer = open.await;
        timing.upstream = opened.elapsed();
        let upstream = &group.metrics.upstream;
        match &answer {
            Ok(response) => {
                upstream.response(response.status().as_u16(), timing.upstream);
                // An open tunnel is a request the upstream took: it counts as an
                // answer for the group's probe and push-back backoff.
                if response.status().is_success() {
                    group.accepted(opened);
                }
            }
            Err(e) => {
                upstream.error(e.proxy_status_error());
                group.unanswered();
            }
        }
        answer
    }

    /// Step 2 for a CONNECT to an intercepted host: answered at once, for the server to
    /// serve what comes through. A destination the policy refuses by name or address
    /// is refused now; a name's addresses are checked as each request inside is sent.
    fn open_intercepted(
        &self,
        mut to: Box<Classified>,
        user: Option<String>,
    ) -> Result<Response<Body>, ProxyError> {
        // Not a request of its group: each one inside the tunnel is.
        to.left.disarm();
        let (host, port) = (&to.target.host, to.target.port);
        let policy = self.dialer.policy.load();
        policy
            .check_host(host)
            .and_then(|()| match crate::host::ip_of(host) {
                // An address needs no resolving to be judged now.
                Some(ip) => policy.check_addr(host, std::net::SocketAddr::new(ip, port)),
                None => Ok(()),
            })
            .map_err(|denial| ProxyError::DestinationDenied { denial })?;
        tracing::debug!(host = %to.target.host, port = to.target.port, "tunnel intercepted");
        Ok(tunnel::intercept(&to.target, to.request.attempt(0), user))
    }

    /// Steps 3 and 4: the body, read before the wait; then wait, send, judge, and
    /// again while the upstream pushes back and time is left.
    async fn forward(
        &self,
        mut to: Box<Classified>,
        arrived: Instant,
        asker: keys::Asker<'_>,
        timing: &mut Timing,
    ) -> Result<Response<Body>, ProxyError> {
        self.refuse_denied(&mut to)?;
        let Classified {
            left,
            method,
            sending,
            request,
            group,
            cost,
            upgrade,
            ..
        } = &mut *to;
        // A switch of protocols (WebSocket) is one request of its group, not replayed;
        // its permit is held while the switched connection is open.
        if let Some(protocol) = upgrade.take() {
            left.disarm();
            let (group, flow) = keys::budget(group, request, asker)?;
            let group = &group;
            let cost = Cost {
                requests: *cost,
                tokens: None,
                flow,
            };
            let permit = self.admit(group, cost, arrived, false).await;
            timing.wait = arrived.elapsed();
            let switching = self.upstream.switching(&self.tunnels, &self.cut);
            let sent = Instant::now();
            let send = Box::pin(switching.send(request.attempt(0), protocol, permit?));
            let response = answer(group, send, timing).await?;
            // A refusal still pauses the group; it is not replayed.
            let answered = pushback::Answered::now();
            return Ok(
                match pushback::after_answer(group, arrived, sent, false, 0, response, answered) {
                    ControlFlow::Break(response) => response,
                    ControlFlow::Continue(()) => {
                        unreachable!("a request that cannot be replayed is not")
                    }
                },
            );
        }
        let memory = &self.replay_memory;
        let read = request.read_body(group.settings().max_replay_body, memory);
        // A body that fails (its client left, or stalled) is counted as `cancelled`.
        read.await?;
        // From here the group counts what becomes of the request.
        left.disarm();
        let (group, flow) = keys::budget(group, request, asker)?;
        let group = &group;
        let estimate = tokens::estimate(group, request);
        let cost = Cost {
            requests: *cost,
            tokens: estimate,
            flow,
        };
        let mut attempt = 0;
        loop {
            let queued = Instant::now();
            let permit = self.admit(group, cost, arrived, attempt > 0).await;
            timing.wait += queued.elapsed();
            let reserved = estimate
                .filter(|_| permit.is_ok())
                .map(|e| tokens::Reserved::new(group.clone(), e));
            // Until its response has been written, the client's end of stream waits:
            // a request that went upstream is answered (see `half_close`).
            let held = (permit?, sending.as_ref().map(Sending::start));
            let sent = Instant::now();
            let send = Box::pin(self.upstream.send(request.attempt(attempt), held));
            let response = answer(group, send, timing).await?;
            if let Some(reserved) = &reserved {
                reserved.announced(&response);
            }
            let replay =
                request.can_replay() && crate::replay::may_replay(method, response.status());
            let answered = pushback::Answered::now_for(estimate);
            match pushback::after_answer(group, arrived, sent, replay, attempt, response, answered)
            {
                ControlFlow::Break(response) => {
                    return Ok(match reserved {
                        Some(reserved) => reserved.answer(response, &mut timing.tokens),
                        None => response,
                    })
                }
                ControlFlow::Continue(()) => {
                    if let Some(reserved) = reserved {
                        reserved.refunded();
                    }
                    attempt += 1;
                    timing.retries = attempt;
                }
            }
        }
    }

    /// Waits in `group` for a request of `cost` (`retry`: at the head of the queue),
    /// unless shutdown gives up on the queue first.
    async fn admit(
        &self,
        group: &Arc<Group>,
        cost: Cost,
        arrived: Instant,
        retry: bool,
    ) -> Result<Permit, ProxyError> {
        let wait = Box::pin(group.admit(cost, arrived, retry));
        let admitted = tokio::select! {
            admitted = wait => admitted.map_err(|refusal| ProxyError::refused(group, refusal)),
            () = self.shutdown.given_up() => {
                self.shutdown.answered();
                return Err(ProxyError::ShuttingDown);
            }
        };
        if admitted.is_ok() {
            self.shutdown.sent();
        }
        admitted
    }
}

/// A request, classified.
struct Classified {
    /// Where it goes, for the access log (when it is on).
    url: Option<String>,
    left: LeftEarly,
    method: http::Method,
    /// Its connection's requests out upstream, if it came on a plain HTTP/1 connection.
    sending: Option<Arc<Sending>>,
    request: Replayable,
    /// The protocol it asks to switch to (`Upgrade`), if any.
    upgrade: Option<http::HeaderValue>,
    target: Target,
    group: Arc<Group>,
    cost: u32,
}

/// Counts a request whose client left before it reached its group's queue as
/// `cancelled`, as the queue counts one whose client leaves while it waits: hyper
/// drops the request's future when the client closes (or half-closes) its connection,
/// possibly before the future ever runs. Disarmed once the group counts the request,
/// or once it is answered without the group.
struct LeftEarly(Option<Arc<Group>>);

impl LeftEarly {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for LeftEarly {
    fn drop(&mut self) {
        if let Some(group) = self.0.take() {
            group.metrics.cancelled.inc();
        }
    }
}

/// The upstream's answer to `send`, timed and counted in `group`'s upstream metrics.
async fn answer(
    group: &Group,
    send: impl Future<Output = Result<Response<Body>, ProxyError>>,
    timing: &mut Timing,
) -> Result<Response<Body>, ProxyError> {
    let sent = Instant::now();
    let answer = send.await;
    let took = sent.elapsed();
    timing.upstream += took;
    let upstream = &group.metrics.upstream;
    match &answer {
        Ok(response) => upstream.response(response.status().as_u16(), took),
        Err(e) => {
            upstream.error(e.proxy_status_error());
            // Not the upstream's answer: it teaches the group nothing.
            group.unanswered();
        }
    }
    answer
}

/// `e`, for a classified request answered before it reached its group.
fn answered_early(e: ProxyError, classified: Result<Box<Classified>, ProxyError>) -> ProxyError {
    if let Ok(mut to) = classified {
        to.left.disarm();
    }
    e
}
