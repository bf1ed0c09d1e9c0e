//! Opening TCP connections to upstreams: name resolution and the handshake within
//! `connect_timeout`, to addresses the destination policy allows, with typed errors.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tower::Service;

use super::headers::authority_of;
use crate::access::Policy;
use crate::body::BoxError;
use crate::error::ProxyError;

/// Opens TCP connections to upstreams the destination policy allows, within
/// `connect_timeout`.
#[derive(Debug, Clone)]
pub struct Dialer {
    /// The longest time name resolution plus the TCP handshake may take.
    pub connect_timeout: Duration,
    /// Which addresses may be dialled (swapped by a reload).
    pub policy: Arc<arc_swap::ArcSwap<Policy>>,
}

impl Dialer {
    /// Resolves `host` (canonical; an IPv6 literal in brackets), checks every address
    /// it resolves to against the policy, and connects to the first vetted address that
    /// accepts, within the connect timeout. The vetted addresses themselves are dialled:
    /// a name is never resolved twice, so DNS cannot answer one address to the check
    /// and another to the connection. One refused address refuses the name: a name
    /// that resolves to a public and a private address is not trusted with either.
    pub async fn dial(&self, host: &str, port: u16) -> Result<TcpStream, ProxyError> {
        let denied = |denial| ProxyError::DestinationDenied { denial };
        // Whatever spelling reached here (a route's upstream as configured, a forward
        // URI that kept its name's case), the policy judges the canonical host.
        let host = &crate::host::canonical(host).ok_or_else(|| {
            ProxyError::BadRequest(format!("{host:?} is not a host name or address"))
        })?;
        let policy = self.policy.load_full();
        policy.check_host(host).map_err(denied)?;
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let authority = format!("{host}:{port}");
        let attempt = async {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((bare, port))
                .await
                .map_err(|e| ProxyError::Dns {
                    host: host.to_string(),
                    reason: e.to_string(),
                })?
                .collect();
            for addr in &addrs {
                policy.check_addr(host, *addr).map_err(denied)?;
            }
            let mut last_error = None;
            for addr in addrs {
                match TcpStream::connect(addr).await {
                    Ok(stream) => {
                        // Proxied requests are small writes answered by small writes;
                        // Nagle's delay would add up to 40 ms to each.
                        let _ = stream.set_nodelay(true);
                        return Ok(stream);
                    }
                    Err(e) => last_error = Some(e),
                }
            }
            Err(match last_error {
                Some(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    ProxyError::ConnectionRefused {
                        authority: authority.clone(),
                    }
                }
                Some(e) => ProxyError::Connect {
                    authority: authority.clone(),
                    reason: e.to_string(),
                },
                None => ProxyError::Dns {
                    host: host.to_string(),
                    reason: "no addresses".into(),
                },
            })
        };
        tokio::time::timeout(self.connect_timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(ProxyError::ConnectTimeout {
                    authority: authority.clone(),
                    after: self.connect_timeout,
                })
            })
    }
}

/// The connector is a `Service<Uri>` (the shape hyper-rustls wraps), called by the pool.
impl Service<Uri> for Dialer {
    type Response = TokioIo<TcpStream>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ProxyError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let dialer = self.clone();
        Box::pin(async move {
            let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
                Some("https") => 443,
                _ => 80,
            });
            let stream = dialer.dial(uri.host().unwrap_or(""), port).await?;
            Ok(TokioIo::new(stream))
        })
    }
}

/// The TLS connector over [`Dialer`], bounded as a whole by `connect_timeout` so that a
/// stalled TLS handshake counts as a connect timeout too.
#[derive(Clone)]
pub(super) struct Connector {
    pub(super) tls: hyper_rustls::HttpsConnector<Dialer>,
    pub(super) timeout: Duration,
}

/// An upstream connection's stream: TCP, or TLS over it.
pub(crate) type UpstreamIo = hyper_rustls::MaybeHttpsStream<TokioIo<TcpStream>>;

impl Service<Uri> for Connector {
    type Response = UpstreamIo;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tls.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let timeout = self.timeout;
        let authority = authority_of(&uri);
        let connecting = self.tls.call(uri);
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(result) => result,
                Err(_) => Err(ProxyError::ConnectTimeout {
                    authority,
                    after: timeout,
                }
                .into()),
            }
        })
    }
}
