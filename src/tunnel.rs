//! CONNECT: a TCP tunnel between the client and `host:port`.
//!
//! The upstream connection is opened *before* answering, so a refused or unreachable
//! upstream becomes a 502/504 with `Proxy-Status` instead of a 200 followed by a closed
//! socket. After the `200`, hyper hands over the raw client connection and bytes are
//! copied both ways until either side closes. Tunnels outlive the HTTP exchange, so they
//! run on a [`TaskTracker`] that shutdown waits for.

use http::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::body::{self, Body};
use crate::classify::Target;
use crate::error::ProxyError;
use crate::relay::{relay, KeepWhileOpen};
use crate::upstream::Dialer;

/// A CONNECT tollgate answered itself, to serve what the client sends through it
/// (`[intercept]`). The proxy puts it in the `200`'s extensions; the server takes it out
/// and serves the tunnel as a connection of its own once hyper hands it over.
#[derive(Clone)]
pub struct Intercepted {
    /// The client's side of the tunnel, once the `200` has gone out.
    pub on_upgrade: hyper::upgrade::OnUpgrade,
    /// The CONNECT's host, canonical.
    pub host: String,
    /// The CONNECT's port.
    pub port: u16,
    /// The CONNECT request's [`KeepWhileOpen`], if any.
    pub keep: Option<KeepWhileOpen>,
    /// The proxy user who opened it: the user of every request inside.
    pub user: Option<String>,
}

/// Answers a CONNECT to `target` with `200` and an [`Intercepted`] for the server.
/// Nothing is dialled now: each request inside is, on its own.
pub fn intercept(target: &Target, mut req: Request<Body>, user: Option<String>) -> Response<Body> {
    let mut resp = Response::new(body::empty());
    resp.extensions_mut().insert(Intercepted {
        on_upgrade: hyper::upgrade::on(&mut req),
        host: target.host.clone(),
        port: target.port,
        keep: req.extensions_mut().remove::<KeepWhileOpen>(),
        user,
    });
    resp
}

/// Dials the target, answers `200`, and spawns the copy loop on `tunnels`. `hold` is
/// kept alive until the tunnel closes (the group's concurrency permit), and so
/// is the request's [`KeepWhileOpen`], if any; `cut` closes the tunnel at once
/// (shutdown after `shutdown_grace`).
pub async fn open<H: Send + 'static>(
    dialer: &Dialer,
    tunnels: &TaskTracker,
    cut: &CancellationToken,
    target: &Target,
    mut req: Request<Body>,
    hold: H,
) -> Result<Response<Body>, ProxyError> {
    let mut upstream = dialer.dial(&target.host, target.port).await?;
    let on_upgrade = hyper::upgrade::on(&mut req);
    let keep = req.extensions_mut().remove::<KeepWhileOpen>();
    let authority = format!("{}:{}", target.host, target.port);
    let cut = cut.clone();
    tunnels.spawn(async move {
        let _hold = (hold, keep);
        match on_upgrade.await {
            Ok(upgraded) => {
                tokio::select! {
                    (up, down) = relay(TokioIo::new(upgraded), &mut upstream) => {
                        tracing::debug!(%authority, up, down, "tunnel closed");
                    }
                    _ = cut.cancelled() => tracing::debug!(%authority, "tunnel cut at shutdown"),
                }
            }
            Err(e) => {
                tracing::debug!(%authority, error = %e, "client left before the tunnel opened")
            }
        }
    });
    let mut resp = Response::new(body::empty());
    *resp.status_mut() = StatusCode::OK;
    Ok(resp)
}
