//! `Upgrade` (WebSocket and the like): a request that asks to switch protocols is sent
//! on an HTTP/1.1 connection of its own, and once the upstream answers `101`, bytes are
//! copied both ways between the client and the upstream until either closes.
//!
//! It counts as one request of its group, and holds its concurrency permit for as long
//! as the switched connection is open, as a tunnel does. The connection is not pooled:
//! after a `101` it belongs to the protocol switched to. Only HTTP/1.1 clients can ask
//! (HTTP/2 has no `Upgrade`), and the upstream is offered HTTP/1.1 alone by ALPN.

use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{add_via, authority_of, set_host, strip_hop_by_hop, upstream_error, Dialer};
use crate::body::{self, Body, Holding};
use crate::error::ProxyError;
use crate::relay::{relay, KeepWhileOpen};

/// The protocol a request asks to switch to: its `Upgrade` header, when `Connection`
/// names `upgrade` too (RFC 9110 §7.8), on HTTP/1.1.
pub fn requested(version: Version, headers: &HeaderMap) -> Option<HeaderValue> {
    if version != Version::HTTP_11 {
        return None;
    }
    let named = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    named
        .then(|| headers.get(header::UPGRADE).cloned())
        .flatten()
}

/// What switching protocols needs besides the request.
pub struct Switching<'a> {
    /// Dials the upstream (the destination policy applies).
    pub dialer: &'a Dialer,
    /// TLS to the upstream, offering HTTP/1.1 alone.
    pub tls: &'a Arc<rustls::ClientConfig>,
    /// Where the switched connections run; shutdown waits for them.
    pub tasks: &'a TaskTracker,
    /// Closes them (shutdown, once the grace is over).
    pub cut: &'a CancellationToken,
    /// `response_timeout`.
    pub response_timeout: Duration,
}

impl Switching<'_> {
    /// Sends `req` (absolute URI, asking to switch to `protocol`) on a connection of its
    /// own. A `101` is passed to the client and the two connections joined; any other
    /// answer is passed on as it is. `held` lives until the switched connection closes,
    /// or the other answer's body ends.
    pub async fn send<H: Send + Sync + 'static>(
        &self,
        mut req: Request<Body>,
        protocol: HeaderValue,
        held: H,
    ) -> Result<Response<Body>, ProxyError> {
        let uri = req.uri().clone();
        let authority = authority_of(&uri);
        let client_side = hyper::upgrade::on(&mut req);
        // The outer HTTP/2 stream of an intercepted tunnel, if it came through one.
        let keep = req.extensions_mut().remove::<KeepWhileOpen>();
        strip_hop_by_hop(req.headers_mut());
        add_via(req.headers_mut(), Version::HTTP_11);
        req.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        req.headers_mut().insert(header::UPGRADE, protocol);
        let host = uri
            .authority()
            .cloned()
            .ok_or_else(|| ProxyError::BadRequest(format!("no host in {uri}")))?;
        set_host(req.headers_mut(), &host);
        *req.uri_mut() = Uri::from(
            uri.path_and_query()
                .cloned()
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
        );

        let exchange = async {
            let mut sender = self.connect(&uri, &authority).await?;
            sender
                .send_request(req)
                .await
                .map_err(|e| upstream_error(&e, authority.clone()))
        };
        let after = self.response_timeout;
        let mut response = tokio::time::timeout(after, exchange).await.map_err(|_| {
            ProxyError::ResponseTimeout {
                authority: authority.clone(),
                after,
            }
        })??;
        if response.status() != StatusCode::SWITCHING_PROTOCOLS {
            strip_hop_by_hop(response.headers_mut());
            add_via(response.headers_mut(), Version::HTTP_11);
            return Ok(response.map(|b| body::boxed(Holding::new(b, held))));
        }
        let upstream_side = hyper::upgrade::on(&mut response);
        let cut = self.cut.clone();
        let relayed = authority.clone();
        self.tasks.spawn(async move {
            let _held = (held, keep);
            let joined = async {
                let (client, upstream) = tokio::try_join!(client_side, upstream_side)?;
                Ok::<_, hyper::Error>(relay(TokioIo::new(client), TokioIo::new(upstream)).await)
            };
            tokio::select! {
                ended = joined => match ended {
                    Ok((up, down)) => tracing::debug!(authority = %relayed, up, down, "switched connection closed"),
                    Err(e) => tracing::debug!(authority = %relayed, error = %e, "switched connection failed"),
                },
                () = cut.cancelled() => {},
            }
        });
        // The `101` keeps `Connection` and `Upgrade`: they are what it says.
        add_via(response.headers_mut(), Version::HTTP_11);
        Ok(response.map(|_| body::empty()))
    }

    /// A new HTTP/1.1 connection to the URI's upstream, over TLS for `https`.
    async fn connect(
        &self,
        uri: &Uri,
        authority: &str,
    ) -> Result<hyper::client::conn::http1::SendRequest<Body>, ProxyError> {
        let host = uri.host().unwrap_or_default();
        let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
            Some("https") => 443,
            _ => 80,
        });
        let tcp = self.dialer.dial(host, port).await?;
        let handshake_failed = |e: hyper::Error| upstream_error(&e, authority.to_string());
        if uri.scheme_str() != Some("https") {
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .map_err(handshake_failed)?;
            self.tasks.spawn(conn.with_upgrades());
            return Ok(sender);
        }
        let name = ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']'))
            .map_err(|e| ProxyError::BadRequest(format!("{host:?}: {e}")))?
            .to_owned();
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| upstream_error(&e, authority.to_string()))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(handshake_failed)?;
        self.tasks.spawn(conn.with_upgrades());
        Ok(sender)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upgrade_is_asked_with_both_headers_on_http1() {
        let headers = |pairs: &[(&str, &str)]| {
            let mut h = HeaderMap::new();
            for (name, value) in pairs {
                h.append(
                    header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(value).unwrap(),
                );
            }
            h
        };
        let ws = [
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
        ];
        for (version, pairs, asked) in [
            (Version::HTTP_11, &ws[..], Some("websocket")),
            (Version::HTTP_2, &ws[..], None),
            (Version::HTTP_11, &ws[1..], None),
            (Version::HTTP_11, &ws[..1], None),
            (Version::HTTP_11, &[("connection", "close")][..], None),
        ] {
            let got = requested(version, &headers(pairs));
            assert_eq!(
                got.as_ref().map(|v| v.to_str().unwrap()),
                asked,
                "{version:?} {pairs:?}"
            );
        }
    }
}
