//! The last step: sending a request to its upstream and streaming the answer back.
//!
//! Connections are made by [`Dialer`] (DNS, TCP, `connect_timeout`), wrapped in rustls
//! by hyper-rustls (h2 offered by ALPN), and kept for reuse in a pool of our own, one
//! per serving thread (`pool.rs`), so repeated requests to one upstream reuse
//! connections. The dialer is ours rather than hyper-util's `HttpConnector` because its
//! errors are typed ([`ProxyError::Dns`], [`ProxyError::ConnectionRefused`], ...) and
//! CONNECT tunnels share it.
//!
//! Here: [`Upstream`], which sends and maps a failed exchange to its [`ProxyError`];
//! `dial.rs` the dialer and the connector; `tls.rs` the roots and `ca_file`;
//! `headers.rs` what changes in a message's head on its way; `pool.rs` the pool;
//! `upgrade.rs` a switch of protocols.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use http::{Request, Response, Version};

use crate::body::Body;
use crate::config::ProxyConfig;
use crate::error::ProxyError;
use pool::Pool;

mod dial;
mod headers;
mod pool;
mod tls;
pub mod upgrade;

use dial::Connector;
pub use dial::Dialer;
pub use headers::{
    add_via, authority_of, malformed, malformed_request, set_host, strip_hop_by_hop,
};
pub use tls::{tls_config, CaFileError};

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
        // `response_timeout` counts from the last time the upstream read from the
        // request's body (its end, once it is sent), and not while the body waits for
        // the client: an upload may take longer than the upstream takes to answer it, a
        // stalled client is `body_idle_timeout`'s business, and an upstream that stops
        // reading is as stuck as one that does not answer.
        let progress = match http_body::Body::is_end_stream(req.body()) {
            true => None,
            false => {
                let progress = crate::body::Progress::now();
                req = req.map(|body| crate::body::boxed(progress.track(body)));
                Some(progress)
            }
        };
        let exchange = self.pool.send(req, held);
        let timer = async move {
            let start = tokio::time::Instant::now();
            loop {
                let now = tokio::time::Instant::now();
                let last = progress.as_ref().map_or(Some(start), |p| p.last());
                match last {
                    Some(last) if now >= last + after => break,
                    Some(last) => tokio::time::sleep_until(last + after).await,
                    // Waiting for the client: looked at again a timeout later.
                    None => tokio::time::sleep(after).await,
                }
            }
        };
        async move {
            tokio::select! {
                biased;
                answered = exchange => Ok(answered),
                () = timer => Err(()),
            }
        }
        .map(move |outcome| {
            let response = outcome
                .map_err(|()| ProxyError::ResponseTimeout {
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
    use crate::access::PROXY_NAME;
    use http::header::{self, HeaderMap, HeaderValue};
    use http::uri::Authority;
    use http::StatusCode;

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
    fn requests_framed_in_odd_forms_are_malformed() {
        // (headers, refused)
        let cases: &[(&[(&str, &str)], bool)] = &[
            (&[], false),
            (&[("transfer-encoding", "chunked")], false),
            (&[("transfer-encoding", "Chunked")], false),
            (&[("content-length", "5")], false),
            (&[("content-length", "005")], false),
            (&[("transfer-encoding", "identity, chunked")], true),
            (&[("transfer-encoding", "gzip, chunked")], true),
            (&[("transfer-encoding", "chunked, identity")], true),
            (&[("transfer-encoding", "identity")], true),
            (
                &[
                    ("transfer-encoding", "chunked"),
                    ("transfer-encoding", "chunked"),
                ],
                true,
            ),
            (&[("content-length", "+5")], true),
            (&[("content-length", "0x5")], true),
            (&[("content-length", "5 5")], true),
        ];
        for (pairs, refused) in cases {
            let mut h = HeaderMap::new();
            for (n, v) in *pairs {
                h.append(
                    http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                );
            }
            assert_eq!(malformed_request(&h).is_some(), *refused, "{pairs:?}");
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
