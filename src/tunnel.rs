//! CONNECT: a TCP tunnel between the client and `host:port`.
//!
//! The upstream connection is opened *before* answering, so a refused or unreachable
//! upstream becomes a 502/504 with `Proxy-Status` instead of a 200 followed by a closed
//! socket. After the `200`, hyper hands over the raw client connection and bytes are
//! copied both ways until either side closes. Tunnels outlive the HTTP exchange, so they
//! run on a [`TaskTracker`] that shutdown waits for.

use http::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio_util::task::TaskTracker;

use crate::body::{self, Body};
use crate::classify::Target;
use crate::error::ProxyError;
use crate::upstream::Dialer;

/// Dials the target, answers `200`, and spawns the copy loop on `tunnels`. `hold` is
/// kept alive until the tunnel closes (the throttle layer's concurrency permit).
pub async fn open<H: Send + 'static>(
    dialer: &Dialer,
    tunnels: &TaskTracker,
    target: &Target,
    mut req: Request<Body>,
    hold: H,
) -> Result<Response<Body>, ProxyError> {
    let mut upstream = dialer.dial(&target.host, target.port).await?;
    let on_upgrade = hyper::upgrade::on(&mut req);
    let authority = format!("{}:{}", target.host, target.port);
    tunnels.spawn(async move {
        let _hold = hold;
        match on_upgrade.await {
            Ok(upgraded) => {
                let mut client = TokioIo::new(upgraded);
                match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                    Ok((up, down)) => {
                        tracing::debug!(%authority, up, down, "tunnel closed");
                    }
                    Err(e) => tracing::debug!(%authority, error = %e, "tunnel ended with an error"),
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
