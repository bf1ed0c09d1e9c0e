//! TLS interception: a CONNECT to a host in `[intercept] hosts` is answered `200`, and
//! what the client sends through the tunnel is served by tollgate itself, so that each
//! request inside is limited on its own rather than the tunnel once.
//!
//! The client's first byte tells TLS (a handshake record, `0x16`) from plain HTTP (a
//! method's first letter: Node's undici sends `http://` URLs through CONNECT too).
//! TLS is served with a leaf certificate for the tunnel's host, signed by the
//! operator's CA ([`Leaves`]); ALPN offers h2 and HTTP/1.1. The decrypted requests
//! then take the same path as a forward request (`connection.rs` serves the connection,
//! [`crate::proxy::Proxy::handle`] each request), so limits, push-back, errors and
//! metrics are the same. Upstream TLS is verified as for any `https://` request: a
//! certificate tollgate does not trust is a `502`, never a pass.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::uri::Scheme;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use rustls::AlertDescription;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, BufReader};

use crate::config::{ConnectPorts, HostPattern, InterceptConfig};

mod ca;

pub use ca::{init, Ca, CaError, InitError, Leaves, LEAF_CACHE};

/// Which tunnels are decrypted, and the certificates to do it with.
pub struct Intercept {
    hosts: Vec<HostPattern>,
    web_ports_only: bool,
    bypass: Vec<HostPattern>,
    leaves: Leaves,
    /// Hosts whose clients refused tollgate's certificate, each logged once.
    untrusted: Mutex<HashSet<String>>,
}

/// How many hosts' refusals of the certificate are logged, once each: enough for every
/// host a deployment intercepts, and bounded against clients that make up host names.
const UNTRUSTED_LOGGED: usize = 1024;

/// The ports a `[[limit]]` host without a port is intercepted on, when `[intercept]
/// hosts` is not written: HTTPS, and plain HTTP through CONNECT (Node's undici). A
/// limit's host names no protocol, so another one tunnelled to it (SSH, IMAPS, MQTT)
/// stays a blind tunnel. A host written in `[intercept] hosts` is meant: any port.
const WEB_PORTS: [u16; 2] = [443, 80];

/// A byte stream a decrypted (or plain) tunnel is served over.
pub trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

/// A tunnel ready to be served as HTTP.
pub struct Accepted {
    /// What the client sends, decrypted.
    pub io: Box<dyn Stream>,
    /// `https` when the client spoke TLS, `http` when it sent plain HTTP.
    pub scheme: Scheme,
    /// Whether the client chose h2 by ALPN.
    pub h2: bool,
}

impl Intercept {
    /// Interception as configured; makes the key every leaf shares.
    pub fn new(config: &InterceptConfig) -> Result<Intercept, CaError> {
        Ok(Intercept {
            hosts: config.hosts.clone(),
            web_ports_only: config.web_ports_only,
            bypass: config.bypass.clone(),
            leaves: Leaves::new(Arc::new(Ca::load(&config.ca_cert, &config.ca_key)?))?,
            untrusted: Mutex::default(),
        })
    }

    /// Whether a CONNECT to `host` (canonical) on `port` is decrypted.
    pub fn covers(&self, host: &str, port: u16) -> bool {
        covers(&self.hosts, self.web_ports_only, &self.bypass, host, port)
    }

    /// Reads the client's first byte from the opened tunnel to `host` and, for TLS,
    /// completes the handshake, both within `within`. `None` when the client left or failed the
    /// handshake (logged).
    pub async fn accept(&self, tunnel: Upgraded, host: &str, within: Duration) -> Option<Accepted> {
        let deadline = tokio::time::Instant::now() + within;
        // A buffer of a few bytes is enough to look at the first one; larger reads pass
        // it by once it is empty.
        let mut io = BufReader::with_capacity(16, TokioIo::new(tunnel));
        let first = match tokio::time::timeout_at(deadline, io.fill_buf()).await {
            Ok(Ok([first, ..])) => *first,
            Ok(Ok([])) => return None,
            Ok(Err(e)) => {
                tracing::debug!(host, error = %e, "intercepted tunnel failed");
                return None;
            }
            Err(_) => {
                tracing::debug!(host, "intercepted tunnel sent nothing");
                return None;
            }
        };
        // A TLS handshake record; anything else is taken for HTTP/1.
        if first != 0x16 {
            return Some(Accepted {
                io: Box::new(io),
                scheme: Scheme::HTTP,
                h2: false,
            });
        }
        let config = match self.leaves.server_config(host) {
            Ok(config) => config,
            Err(e) => {
                tracing::error!(host, error = %e, "cannot make a certificate");
                return None;
            }
        };
        let handshake = tokio_rustls::TlsAcceptor::from(config).accept(io);
        let tls = match tokio::time::timeout_at(deadline, handshake).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                self.handshake_failed(host, &e);
                return None;
            }
            Err(_) => {
                tracing::debug!(host, "TLS handshake inside the tunnel timed out");
                return None;
            }
        };
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        Some(Accepted {
            io: Box::new(tls),
            scheme: Scheme::HTTPS,
            h2,
        })
    }

    /// Logs a failed handshake: once per host, with a hint, when the client refused
    /// tollgate's certificate (the usual first-run mistake); at debug level otherwise.
    fn handshake_failed(&self, host: &str, e: &std::io::Error) {
        let alert = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        let refused = matches!(
            alert,
            Some(rustls::Error::AlertReceived(
                AlertDescription::UnknownCA
                    | AlertDescription::BadCertificate
                    | AlertDescription::CertificateUnknown
                    | AlertDescription::UnsupportedCertificate
            ))
        );
        if !refused {
            tracing::debug!(host, error = %e, "TLS handshake inside the tunnel failed");
            return;
        }
        let mut untrusted = self.untrusted.lock().unwrap_or_else(|p| p.into_inner());
        if untrusted.len() < UNTRUSTED_LOGGED && untrusted.insert(host.to_string()) {
            tracing::warn!(
                host,
                error = %e,
                "client does not trust tollgate's CA: see `tollgate ca init` for how to \
                 trust it, or add the host to [intercept] bypass"
            );
        }
    }
}

/// Whether `host` on `port` is in `hosts` and not in `bypass`. With `web_ports_only`, a
/// pattern without a port covers [`WEB_PORTS`] only; `bypass` matches on any port.
fn covers(
    hosts: &[HostPattern],
    web_ports_only: bool,
    bypass: &[HostPattern],
    host: &str,
    port: u16,
) -> bool {
    let listed = hosts.iter().any(|p| {
        p.matches(host, port)
            && (!web_ports_only || p.port().is_some() || WEB_PORTS.contains(&port))
    });
    listed && !bypass.iter().any(|p| p.matches(host, port))
}

/// Why some `[intercept]` hosts can never be decrypted, if they cannot: each is
/// decrypted on ports (its own, or the web ports when it came from a `[[limit]]`) that
/// `connect_ports` refuses to tunnel to. `check-config` warns, since their tunnels would
/// otherwise stay blind without a word (and a host on another port needs the port
/// written in `[intercept] hosts`).
pub fn blind(config: &InterceptConfig, connect: &ConnectPorts) -> Option<String> {
    let blind: Vec<String> = (config.hosts.iter())
        .filter_map(|pattern| {
            let ports = match pattern.port() {
                Some(port) => vec![port],
                None if config.web_ports_only => WEB_PORTS.to_vec(),
                None => return None,
            };
            let shown = ports.iter().map(u16::to_string).collect::<Vec<_>>();
            let host = match pattern {
                HostPattern::Exact(exact) => exact.clone(),
                HostPattern::Suffix(suffix) => format!("*{suffix}"),
            };
            let allowed = ports.iter().any(|p| connect.allows(*p));
            (!allowed).then(|| format!("{host} (port {})", shown.join(", ")))
        })
        .collect();
    let ConnectPorts::Only(allowed) = connect else {
        return None;
    };
    if blind.is_empty() {
        return None;
    }
    let allowed: Vec<String> = allowed.iter().map(u16::to_string).collect();
    Some(format!(
        "[intercept] decrypts {} only on ports [proxy] connect_ports does not allow ({}): \
         their tunnels stay blind; write each host with its port in [intercept] hosts \
         (e.g. \"api.example.com:8443\")",
        blind.join(", "),
        allowed.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_that_no_allowed_port_reaches() {
        let config = |hosts: &[&str], web_ports_only| InterceptConfig {
            ca_cert: "ca.pem".into(),
            ca_key: "ca.key".into(),
            hosts: hosts
                .iter()
                .map(|h| HostPattern::parse(h).unwrap())
                .collect(),
            web_ports_only,
            bypass: vec![],
        };
        let only = |ports: &[u16]| ConnectPorts::Only(ports.to_vec());
        for (hosts, from_limits, connect, blind) in [
            // The defaults: a limit's host, on 443.
            (&["api.example.com"][..], true, only(&[443]), None),
            (&["api.example.com"], true, only(&[80]), None),
            (
                &["127.0.0.1"],
                true,
                only(&[8443]),
                Some("127.0.0.1 (port 443, 80)"),
            ),
            (
                &["*.example.com"],
                true,
                only(&[8443]),
                Some("*.example.com (port 443, 80)"),
            ),
            (&["127.0.0.1:8443"], true, only(&[8443]), None),
            (
                &["127.0.0.1:9000"],
                false,
                only(&[8443]),
                Some("127.0.0.1:9000 (port 9000)"),
            ),
            // Written in [intercept]: any port, so some allowed one reaches it.
            (&["127.0.0.1"], false, only(&[8443]), None),
            (&["127.0.0.1"], true, ConnectPorts::Any, None),
            (
                &["a.example", "127.0.0.1:8443"],
                true,
                only(&[8443]),
                Some("a.example (port 443, 80)"),
            ),
        ] {
            let warning = super::blind(&config(hosts, from_limits), &connect);
            match (blind, &warning) {
                (None, None) => {}
                (Some(host), Some(w)) => assert!(
                    w.starts_with(&format!("[intercept] decrypts {host} only on ports")),
                    "{hosts:?}: {w}"
                ),
                _ => panic!("{hosts:?} {connect:?}: {warning:?}"),
            }
        }
    }

    #[test]
    fn hosts_minus_bypass() {
        let p = |s: &str| HostPattern::parse(s).unwrap();
        let hosts = [p("api.github.com"), p("*.stripe.com"), p("127.0.0.1:8443")];
        let bypass = [p("pinned.stripe.com")];
        for (host, port, written, from_limits) in [
            ("api.github.com", 443, true, true),
            ("github.com", 443, false, false),
            ("api.stripe.com", 443, true, true),
            ("pinned.stripe.com", 443, false, false),
            ("stripe.com", 443, false, false),
            ("127.0.0.1", 8443, true, true),
            ("127.0.0.1", 443, false, false),
            ("example.com", 443, false, false),
            // A pattern without a port: any port when written in [intercept], the
            // web ports only when it came from a [[limit]].
            ("api.github.com", 80, true, true),
            ("api.github.com", 22, true, false),
            ("api.stripe.com", 8883, true, false),
            ("pinned.stripe.com", 8883, false, false),
        ] {
            assert_eq!(
                covers(&hosts, false, &bypass, host, port),
                written,
                "{host}:{port}"
            );
            assert_eq!(
                covers(&hosts, true, &bypass, host, port),
                from_limits,
                "{host}:{port} from limits"
            );
        }
    }
}
