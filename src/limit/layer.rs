//! The throttle as tower middleware: each request waits its turn in its group, then
//! goes on holding a concurrency permit until its response body ends.
//!
//! The layers of the stack take an [`Exchange`]: the request, and what
//! [`crate::proxy::Proxy::handle`] decided about it ([`Routed`]: its target, its group,
//! when it arrived).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Method, Request, Response};
use tokio::time::Instant;
use tower::{Layer, Service};

use super::{Group, Permit, Refusal};
use crate::body::Body;
use crate::classify::Target;
use crate::error::ProxyError;

/// What [`crate::proxy::Proxy::handle`] decided about a request, shared by all its
/// attempts.
pub struct Routed {
    /// Where the request goes.
    pub target: Target,
    /// The group whose budget it spends.
    pub group: Arc<Group>,
    /// When the client's request reached tollgate (a retried request keeps its first
    /// arrival, so `max_wait` counts from when the client asked).
    pub arrived: Instant,
}

/// A request on its way through the stack, and what the layers tell each other about it.
///
/// Fields rather than the request's extensions: the first value put there costs three
/// allocations (the map, its table, the value's box) and every look-up a hash. Moving to
/// fields took 400 of the 33.5k instructions of a forwarded request (callgrind;
/// docs/performance-log.md, "Seventh session"). The rarely set early admission is boxed: an
/// exchange is moved several times per layer, and inline it (with the tunnel's permit, then
/// boxed too) made it half as big again. The permit is inline: it is set for every request,
/// and boxed it would be an allocation each time.
pub struct Exchange {
    /// The request itself.
    pub req: Request<Body>,
    /// Its routing.
    pub routed: Arc<Routed>,
    /// The outcome of its wait before hyper read it, for a new connection's first request
    /// (see [`Admission`]); the throttle takes it instead of queueing the request again.
    /// The first attempt's alone.
    pub early: Option<Box<Admission>>,
    /// Set when the upstream refused the request and it is sent again: it goes to the
    /// head of its group's queue.
    pub retrying: bool,
    /// The request's concurrency permit, from the throttle to whoever holds it while
    /// the exchange lasts: a tunnel while it is open, or the response body until it ends.
    pub permit: Option<Permit>,
}

impl Exchange {
    /// A request on its first attempt.
    pub fn new(req: Request<Body>, routed: Arc<Routed>, early: Option<Box<Admission>>) -> Exchange {
        Exchange {
            req,
            routed,
            early,
            retrying: false,
            permit: None,
        }
    }
}

/// A request that already waited in its group before hyper read it (a new connection's
/// first request; see [`crate::server`]'s `early` module): the throttle takes this
/// outcome instead of queueing the request a second time.
pub struct Admission {
    /// The group it waited in; the outcome only counts for a request classified to it.
    pub group: Arc<Group>,
    /// When its head was first seen, so `max_wait` and the queue-wait metric count from then.
    pub arrived: Instant,
    /// The permit it leaves with, or why it was refused.
    pub outcome: Result<Permit, Refusal>,
}

/// Adds the throttle in front of a service.
#[derive(Debug, Clone, Default)]
pub struct ThrottleLayer;

impl<S> Layer<S> for ThrottleLayer {
    type Service = Throttle<S>;

    fn layer(&self, inner: S) -> Throttle<S> {
        Throttle { inner }
    }
}

/// The throttle service (see the module documentation).
#[derive(Debug, Clone)]
pub struct Throttle<S> {
    inner: S,
}

impl<S> Service<Exchange> for Throttle<S>
where
    S: Service<Exchange, Response = Response<Body>, Error = ProxyError, Future = BoxFuture>
        + Clone
        + Send
        + 'static,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        // Readiness is decided per request, by its group. The inner service is not asked:
        // it is the dispatch, always ready (`proxy.rs` checks the whole stack is).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut exchange: Exchange) -> Self::Future {
        let group = &exchange.routed.group;
        let arrived = exchange.routed.arrived;
        let req = &exchange.req;
        let cost = group.settings.cost_of(req.method(), req.uri().path());
        let early = exchange
            .early
            .take()
            // Decided from the same bytes by the same classifier, and the admission keeps
            // its group alive, so it is this request's group. Were it ever not, the
            // request would queue in its own group (the other's permit dropped, its slot
            // spent).
            .filter(|admission| {
                debug_assert!(Arc::ptr_eq(&admission.group, group), "early group differs");
                Arc::ptr_eq(&admission.group, group)
            });
        // Decided here, in `call`, when it can be: most requests leave at once, and then
        // the inner service's future is this one, with no future of our own to box,
        // move and poll around it (270 of the 31.6k instructions of a forwarded request,
        // callgrind). Only a request that waits gets one. The push-back layer calls the
        // throttle from inside its own future and polls what it gets at once, so this is
        // the moment that future would first have been polled anyway. A CONNECT is the
        // exception: push-back calls the throttle for it from its `call`, and hyper may
        // drop the future unpolled (the client gone before it is answered), so a tunnel
        // is admitted when its future is polled, not before.
        let connect = exchange.req.method() == Method::CONNECT;
        let outcome = match early {
            Some(admission) => Some(admission.outcome),
            None if connect => None,
            None => group.admit_now(cost, arrived).map(Ok),
        };
        match outcome {
            Some(Ok(permit)) => self.inner.call(with_permit(exchange, permit)),
            Some(Err(refusal)) => {
                let refused = ProxyError::refused(group, refusal);
                Box::pin(std::future::ready(Err(refused)))
            }
            None => {
                let mut inner = self.inner.clone();
                // A tunnel tries the fast path first (`admit`); any other request has
                // just tried it, above, and joins the queue straight away.
                Box::pin(async move {
                    let group = exchange.routed.group.clone();
                    let deadline = arrived + group.settings.max_wait;
                    let front = exchange.retrying;
                    let admitted = if connect {
                        group.admit(cost, arrived, deadline, front).await
                    } else {
                        group.join_queue(cost, arrived, deadline, front).await
                    };
                    let permit =
                        admitted.map_err(|refusal| ProxyError::refused(&group, refusal))?;
                    inner.call(with_permit(exchange, permit)).await
                })
            }
        }
    }
}

/// `exchange`, admitted with `permit`. The permit is held by the tunnel while it is
/// open, or by the response body until it ends: the exchange with the upstream is over
/// then, whenever hyper gets round to dropping the body. The upstream wraps its body with
/// it before boxing it, so that the body is boxed once (an allocation per request less).
fn with_permit(mut exchange: Exchange, permit: Permit) -> Exchange {
    exchange.permit = Some(permit);
    exchange
}

/// The future of the throttle and of the dispatch below it (push-back's is a named type
/// of its own, `crate::pushback::Pushing`, held unboxed). The inner service must return
/// one too: awaiting a generic `S::Future` inside the `async` block makes rustc demand
/// `Send` for every lifetime of the boxed error type in `Body` (a known limitation of its
/// higher-ranked reasoning), and re-boxing it to erase the type cost an allocation per
/// layer per request.
pub type BoxFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, ProxyError>> + Send>>;
