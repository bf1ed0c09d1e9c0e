//! The service stack a request passes through — the one place where layer order shows.
//!
//! ```text
//! classify ─► [layers added by later stages] ─► Dispatch ─┬─► tunnel::open   (CONNECT)
//!                                                          └─► Upstream::send (everything else)
//! ```
//!
//! [`Proxy::handle`] is the outermost service and never fails: a [`ProxyError`] from any
//! step becomes a response there.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Method, Request, Response};
use hyper::body::Incoming;
use tokio_util::task::TaskTracker;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceBuilder};

use crate::body::{self, Body};
use crate::classify::{Classifier, Target};
use crate::config::{Config, ConfigError};
use crate::error::ProxyError;
use crate::tunnel;
use crate::upstream::{Dialer, Upstream};

/// The type-erased inner stack, so the layer list can change without touching callers.
type Stack = BoxCloneSyncService<Request<Body>, Response<Body>, ProxyError>;

/// Everything a request needs, built once from the configuration and shared by all
/// connections.
pub struct Proxy {
    classifier: Classifier,
    stack: Stack,
    tunnels: TaskTracker,
}

impl Proxy {
    /// Builds the proxy; fails only on settings that need I/O to check (`ca_file`).
    pub fn new(config: &Config) -> Result<Proxy, ConfigError> {
        let dialer = Dialer {
            connect_timeout: config.proxy.connect_timeout.0,
        };
        let upstream =
            Upstream::new(&config.proxy, dialer.clone()).map_err(|message| ConfigError::Other {
                file: "proxy.ca_file".into(),
                message,
            })?;
        let tunnels = TaskTracker::new();
        let dispatch = Dispatch {
            upstream,
            dialer,
            tunnels: tunnels.clone(),
        };
        let stack = ServiceBuilder::new().service(dispatch);
        Ok(Proxy {
            classifier: Classifier::new(config),
            stack: BoxCloneSyncService::new(stack),
            tunnels,
        })
    }

    /// Serves one request from a client connected to `local`. Never fails.
    pub async fn handle(&self, req: Request<Incoming>, local: SocketAddr) -> Response<Body> {
        let mut req = req.map(body::boxed);
        let target = match self.classifier.classify(&mut req, local) {
            Ok(target) => target,
            Err(e) => return e.into_response(),
        };
        tracing::debug!(method = %req.method(), uri = %req.uri(), ?target.kind, "request");
        req.extensions_mut().insert(target);
        // Calling through `Service::call` on a clone (rather than `oneshot` in this async
        // fn) keeps rustc from asking for a higher-ranked `Service` impl it cannot prove.
        let mut stack = self.stack.clone();
        let ready = std::future::poll_fn(|cx| stack.poll_ready(cx)).await;
        let outcome = match ready {
            Ok(()) => stack.call(req).await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(resp) => resp,
            Err(e) => {
                tracing::debug!(error = %e, "request failed");
                e.into_response()
            }
        }
    }

    /// The open CONNECT tunnels, which shutdown waits for.
    pub fn tunnels(&self) -> &TaskTracker {
        &self.tunnels
    }
}

/// The leaf of the stack: CONNECT opens a tunnel, everything else goes upstream.
#[derive(Clone)]
struct Dispatch {
    upstream: Upstream,
    dialer: Dialer,
    tunnels: TaskTracker,
}

impl Service<Request<Body>> for Dispatch {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, ProxyError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            if req.method() == Method::CONNECT {
                let target = req
                    .extensions()
                    .get::<Target>()
                    .cloned()
                    .expect("classify inserts the target");
                tunnel::open(&this.dialer, &this.tunnels, &target, req, ()).await
            } else {
                this.upstream.send(req).await
            }
        })
    }
}
