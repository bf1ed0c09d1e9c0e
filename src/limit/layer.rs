//! The throttle as tower middleware: each request waits its turn in its group, then
//! goes on holding a concurrency permit until its response body ends.
//!
//! The group was chosen by [`crate::proxy::Proxy::handle`] and travels in the request's
//! extensions ([`Routed`]), with the time the request arrived.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use http::{Method, Request, Response};
use tokio::time::Instant;
use tower::{Layer, Service};

use super::{Group, Permit, Refusal};
use crate::body::{self, Body, Holding};
use crate::classify::Target;
use crate::error::ProxyError;

/// What [`crate::proxy::Proxy::handle`] decided about a request, carried to the layers
/// in its extensions as one shared value: inserting or cloning it per attempt is one
/// small allocation, where a value per fact cost one each (the allocation profile counted
/// a fifth of all per-request allocations in extensions).
pub struct Routed {
    /// Where the request goes.
    pub target: Target,
    /// The group whose budget it spends.
    pub group: Arc<Group>,
    /// When the client's request reached tollgate (a retried request keeps its first
    /// arrival, so `max_wait` counts from when the client asked).
    pub arrived: Instant,
}

/// The group [`crate::proxy::Proxy::handle`] chose for `req`, and when it arrived.
pub fn group_and_arrival<B>(req: &Request<B>) -> (Arc<Group>, Instant) {
    let routed = routed(req);
    (routed.group.clone(), routed.arrived)
}

/// What the proxy decided about `req` (see [`Routed`]).
pub fn routed<B>(req: &Request<B>) -> &Routed {
    req.extensions()
        .get::<Arc<Routed>>()
        .expect("the proxy puts the routing in the extensions")
}

/// Marks a request that the upstream refused and that is retried: it goes to the head
/// of its group's queue.
#[derive(Debug, Clone, Copy)]
pub struct Retrying;

/// A value one part of the stack hands to another through a request's extensions,
/// taken out exactly once. (Extensions must be `Clone`; a replayed request's copy finds
/// it already taken.)
#[derive(Debug)]
pub struct Handoff<T>(Arc<Mutex<Option<T>>>);

impl<T> Handoff<T> {
    /// Wraps `value` for handing over.
    pub fn new(value: T) -> Handoff<T> {
        Handoff(Arc::new(Mutex::new(Some(value))))
    }

    /// Takes the value out; `None` if already taken.
    pub fn take(&self) -> Option<T> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl<T> Clone for Handoff<T> {
    fn clone(&self) -> Self {
        Handoff(self.0.clone())
    }
}

/// A CONNECT request's permit, handed to the tunnel, which holds it while open.
pub type TunnelPermit = Handoff<Permit>;

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

/// Whether `req` already waited in its group before hyper read it (its first attempt
/// will not queue).
pub fn admitted_early<B>(req: &Request<B>) -> bool {
    req.extensions().get::<Handoff<Admission>>().is_some()
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

impl<S> Service<Request<Body>> for Throttle<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = ProxyError, Future = BoxFuture>
        + Clone
        + Send
        + 'static,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        // Readiness is decided per request, by its group, inside the future.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let mut inner = self.inner.clone();
        Box::pin(async move {
            let (group, arrived) = group_and_arrival(&req);
            let front = req.extensions().get::<Retrying>().is_some();
            let cost = group.settings.cost_of(req.method(), req.uri().path());
            let deadline = arrived + group.settings.max_wait;
            let early = req
                .extensions_mut()
                .remove::<Handoff<Admission>>()
                .and_then(|handoff| handoff.take())
                // Decided from the same bytes by the same classifier, and the admission
                // keeps its group alive, so it is this request's group. Were it ever not,
                // the request would queue in its own group (the other's permit dropped,
                // its slot spent).
                .filter(|admission| {
                    debug_assert!(Arc::ptr_eq(&admission.group, &group), "early group differs");
                    Arc::ptr_eq(&admission.group, &group)
                });
            let outcome = match early {
                Some(admission) => admission.outcome,
                None => group.admit(cost, arrived, deadline, front).await,
            };
            let permit = outcome.map_err(|refusal| ProxyError::refused(&group, refusal))?;
            if req.method() == Method::CONNECT {
                req.extensions_mut().insert(TunnelPermit::new(permit));
                return inner.call(req).await;
            }
            let response = inner.call(req).await?;
            // The permit is held until the response body ends: the exchange with the upstream
            // is over then, whenever hyper gets round to dropping the body.
            Ok(response.map(|b| body::boxed(Holding::new(b, permit))))
        })
    }
}

/// The future of every service in the stack. The inner service must return one too:
/// awaiting a generic `S::Future` inside the `async` block makes rustc demand `Send` for
/// every lifetime of the boxed error type in `Body` (a known limitation of its
/// higher-ranked reasoning), and re-boxing it to erase the type cost an allocation per
/// layer per request.
pub type BoxFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, ProxyError>> + Send>>;
