//! The last step: sending a request to its upstream and streaming the answer back.
//!
//! Connections are made by [`Dialer`] (DNS, TCP, `connect_timeout`), wrapped in rustls
//! by hyper-rustls (h2 offered by ALPN), and kept for reuse in a pool of our own, one
//! per serving thread (`pool.rs`), so repeated requests to one upstream reuse
//! connections. The dialer is ours rather than hyper-util's `HttpConnector` because its
//! errors are typed ([`ProxyError::Dns`], [`ProxyError::ConnectionRefused`], ...) and
//! CONNECT tunnels share it.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::FutureExt;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tower::Service;

use crate::access::Policy;
use crate::access::PROXY_NAME;
use crate::body::{Body, BoxError};
use crate::config::ProxyConfig;
use crate::error::ProxyError;
use pool::Pool;

mod pool;
pub mod upgrade;

/// Headers that describe one connection, not the message; never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

/// Removes hop-by-hop headers: the fixed list and every header `Connection` names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(&HOP_BY_HOP) {
        headers.remove(name);
    }
}

/// Appends tollgate to `Via` (RFC 9110 §7.6.3), keeping what earlier proxies wrote.
pub fn add_via(headers: &mut HeaderMap, version: Version) {
    let protocol = match version {
        Version::HTTP_10 => "1.0",
        Version::HTTP_2 => "2",
        Version::HTTP_3 => "3",
        _ => "1.1",
    };
    let hop = HeaderValue::from_str(&format!("{protocol} {PROXY_NAME}"))
        .expect("a protocol version and a name are a valid header");
    headers.append(header::VIA, hop);
}

/// Makes `Host` name `authority`, the upstream the request goes to, and nothing else.
pub fn set_host(headers: &mut HeaderMap, authority: &Authority) {
    let host = HeaderValue::from_str(authority.as_str()).expect("an authority is a valid header");
    headers.insert(header::HOST, host);
}

/// `host:port` of a URI, with the scheme's default port filled in.
pub fn authority_of(uri: &Uri) -> String {
    let authority = uri.authority();
    let host = authority.map_or("", Authority::host);
    let port = authority.and_then(Authority::port_u16).unwrap_or(
        if uri.scheme() == Some(&Scheme::HTTPS) {
            443
        } else {
            80
        },
    );
    format!("{host}:{port}")
}

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
struct Connector {
    tls: hyper_rustls::HttpsConnector<Dialer>,
    timeout: Duration,
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

/// Why `[proxy] ca_file` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CaFileError {
    /// The file cannot be read, or holds a PEM block that is not readable.
    #[error("ca_file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// What reading it met.
        source: std::io::Error,
    },
    /// A certificate in it is not one rustls accepts as a root.
    #[error("ca_file {path}: {source}")]
    Certificate {
        /// The file.
        path: String,
        /// What rustls said.
        source: rustls::Error,
    },
    /// It holds no certificate.
    #[error("ca_file {path}: no PEM certificates found")]
    Empty {
        /// The file.
        path: String,
    },
    /// rustls has no protocol version for its default provider.
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
}

/// The rustls configuration for upstreams: the public web roots plus `ca_file`.
pub fn tls_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, CaFileError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let shown = || path.display().to_string();
        let read = |source| CaFileError::Read {
            path: shown(),
            source,
        };
        let pem = std::fs::read(path).map_err(read)?;
        let mut found = 0;
        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
            roots
                .add(cert.map_err(read)?)
                .map_err(|source| CaFileError::Certificate {
                    path: shown(),
                    source,
                })?;
            found += 1;
        }
        if found == 0 {
            return Err(CaFileError::Empty { path: shown() });
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Sends requests upstream over pooled connections.
#[derive(Clone)]
pub struct Upstream {
    pool: Pool,
    response_timeout: Duration,
    dialer: Dialer,
    /// TLS for connections that switch protocols: HTTP/1.1 alone by ALPN.
    http1_tls: Arc<rustls::ClientConfig>,
}

impl Upstream {
    /// Builds the connector and an empty pool from the `[proxy]` settings.
    pub fn new(config: &ProxyConfig, dialer: Dialer) -> Result<Self, CaFileError> {
        let mut http1_tls = tls_config(config.ca_file.as_deref())?;
        http1_tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tls = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config(config.ca_file.as_deref())?)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(dialer.clone());
        let connector = Connector {
            tls,
            timeout: config.connect_timeout.0,
        };
        Ok(Upstream {
            pool: Pool::new(
                connector,
                config.upstream_idle_timeout.0,
                config.body_idle_timeout.0,
            ),
            response_timeout: config.response_timeout.0,
            dialer,
            http1_tls: Arc::new(http1_tls),
        })
    }

    /// How requests that ask to switch protocols are sent; the switched connections
    /// run on `tasks` and close on `cut`.
    pub fn switching<'a>(
        &'a self,
        tasks: &'a tokio_util::task::TaskTracker,
        cut: &'a tokio_util::sync::CancellationToken,
    ) -> upgrade::Switching<'a> {
        upgrade::Switching {
            dialer: &self.dialer,
            tls: &self.http1_tls,
            tasks,
            cut,
            response_timeout: self.response_timeout,
        }
    }

    /// Sends one request whose URI is absolute (`http(s)://host/...`) and returns the
    /// upstream's response head with its body still streaming; the body holds `held`
    /// (the request's concurrency permit) until it ends.
    pub fn send<H: Send + Sync + 'static>(
        &self,
        mut req: Request<Body>,
        held: H,
    ) -> impl Future<Output = Result<Response<Body>, ProxyError>> + Send + 'static {
        let authority = authority_of(req.uri());
        let client_version = req.version();
        strip_hop_by_hop(req.headers_mut());
        add_via(req.headers_mut(), client_version);
        // The client side may have spoken h2 to us; the upstream side is chosen by ALPN.
        *req.version_mut() = Version::HTTP_11;

        let after = self.response_timeout;
        tokio::time::timeout(after, self.pool.send(req, held)).map(move |outcome| {
            let response = outcome
                .map_err(|_| ProxyError::ResponseTimeout {
                    authority: authority.clone(),
                    after,
                })?
                .map_err(|e| upstream_error(e.as_ref(), authority.clone()))?;
            let (mut parts, body) = response.into_parts();
            if let Some(reason) = malformed(parts.status, &parts.headers) {
                // Dropping the body unread also drops the connection: after an answer
                // like this one, where the next one starts is not known.
                drop(body);
                return Err(ProxyError::Upstream {
                    authority,
                    reason: format!("malformed response: {reason}"),
                });
            }
            strip_hop_by_hop(&mut parts.headers);
            add_via(&mut parts.headers, parts.version);
            parts.version = Version::HTTP_11;
            Ok(Response::from_parts(parts, body))
        })
    }
}

/// Why an upstream's response head cannot be passed on, if it cannot: it would be
/// framed two ways (RFC 9112 §6.3 calls that a smuggling risk), or it switches
/// protocols for a request that asked for no switch (those that do take
/// [`Upstream::switching`]), which an HTTP/2 client's connection cannot even carry.
pub fn malformed(status: StatusCode, headers: &HeaderMap) -> Option<&'static str> {
    if status.is_informational() {
        return Some("an interim (1xx) status as the final answer, or an unrequested upgrade");
    }
    let lengths = headers.get_all(header::CONTENT_LENGTH);
    if lengths.iter().next().is_some() && headers.contains_key(header::TRANSFER_ENCODING) {
        return Some("both Content-Length and Transfer-Encoding");
    }
    let mut values = lengths
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(|v| v.trim_ascii());
    if let Some(first) = values.next() {
        let number = |v: &[u8]| !v.is_empty() && v.iter().all(u8::is_ascii_digit);
        if !number(first) || values.any(|v| v != first) {
            return Some("an invalid or conflicting Content-Length");
        }
    }
    None
}

/// The causes of an error, outermost first. hyper-rustls wraps rustls errors in
/// `io::Error`s, whose `source()` skips the wrapped error, so look inside those too.
fn causes<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(err), |e| {
        e.downcast_ref::<io::Error>()
            .and_then(|io| io.get_ref())
            .map(|inner| inner as &(dyn std::error::Error + 'static))
            .or_else(|| e.source())
    })
}

/// The [`ProxyError`] for a failed exchange with `authority`, from the most telling
/// cause in the client's error: our own from the dialer (DNS, refused, timeout), a rustls
/// error from the handshake, or else what hyper said.
fn upstream_error(err: &(dyn std::error::Error + 'static), authority: String) -> ProxyError {
    for cause in causes(err) {
        if let Some(found) = cause.downcast_ref::<ProxyError>() {
            return found.clone();
        }
        // The client's body stalled while it went upstream.
        if let Some(idle) = cause.downcast_ref::<crate::body::BodyIdle>() {
            return ProxyError::RequestBodyIdle { after: idle.0 };
        }
        if let Some(tls) = cause.downcast_ref::<rustls::Error>() {
            let reason = tls.to_string();
            return match tls {
                rustls::Error::InvalidCertificate(_) => {
                    ProxyError::TlsCertificate { authority, reason }
                }
                _ => ProxyError::Tls { authority, reason },
            };
        }
    }
    let reason = causes(err)
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(": ");
    ProxyError::Upstream { authority, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_fixed_and_named_hop_by_hop_headers() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, X-Secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("proxy-authorization", HeaderValue::from_static("Basic x"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));

        // Every `Connection` line counts, and a name it lists need not be present.
        let mut h = HeaderMap::new();
        h.append("connection", HeaderValue::from_static("keep-alive"));
        h.append("connection", HeaderValue::from_static(" x-a ,x-absent"));
        h.insert("x-a", HeaderValue::from_static("1"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn answers_framed_two_ways_or_upgraded_are_malformed() {
        let head = |status: u16, pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(*n, HeaderValue::from_static(v));
            }
            malformed(StatusCode::from_u16(status).unwrap(), &h)
        };
        assert_eq!(head(200, &[("content-length", "5")]), None);
        assert_eq!(head(200, &[("transfer-encoding", "chunked")]), None);
        assert_eq!(
            head(200, &[("content-length", "5"), ("content-length", "5")]),
            None
        );
        assert_eq!(head(204, &[]), None);
        let bad = [
            head(101, &[("upgrade", "websocket")]),
            head(
                200,
                &[("content-length", "5"), ("transfer-encoding", "chunked")],
            ),
            head(200, &[("content-length", "5"), ("content-length", "6")]),
            head(200, &[("content-length", "5, 6")]),
            head(200, &[("content-length", "-1")]),
        ];
        for (i, verdict) in bad.iter().enumerate() {
            assert!(verdict.is_some(), "case {i}");
        }
    }

    #[test]
    fn via_is_appended() {
        let mut h = HeaderMap::new();
        h.insert(header::VIA, HeaderValue::from_static("1.0 corp-proxy"));
        add_via(&mut h, Version::HTTP_11);
        let all: Vec<_> = h.get_all(header::VIA).iter().collect();
        assert_eq!(all, ["1.0 corp-proxy", "1.1 tollgate"]);
        for (version, hop) in [
            (Version::HTTP_10, "1.0"),
            (Version::HTTP_11, "1.1"),
            (Version::HTTP_2, "2"),
            (Version::HTTP_3, "3"),
        ] {
            let mut h = HeaderMap::new();
            add_via(&mut h, version);
            assert_eq!(h[header::VIA], format!("{hop} {PROXY_NAME}"));
        }
    }

    #[test]
    fn host_names_the_upstream() {
        let authority: Authority = "api.example:8443".parse().unwrap();
        let mut h = HeaderMap::new();
        set_host(&mut h, &authority);
        assert_eq!(h[header::HOST], "api.example:8443");
        h.insert(header::HOST, HeaderValue::from_static("other"));
        h.append(header::HOST, HeaderValue::from_static("api.example:8443"));
        set_host(&mut h, &authority);
        assert_eq!(h.get_all(header::HOST).iter().count(), 1);
        assert_eq!(h[header::HOST], "api.example:8443");
        set_host(&mut h, &authority);
        assert_eq!(h[header::HOST], "api.example:8443");
    }

    #[test]
    fn authority_fills_default_ports() {
        assert_eq!(
            authority_of(&"https://a.example/x".parse().unwrap()),
            "a.example:443"
        );
        assert_eq!(
            authority_of(&"http://a.example/x".parse().unwrap()),
            "a.example:80"
        );
        assert_eq!(
            authority_of(&"http://[::1]:81/".parse().unwrap()),
            "[::1]:81"
        );
    }
}
