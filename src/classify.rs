//! Which way a request goes: forward proxy, CONNECT tunnel, or gateway route.
//!
//! * absolute-form `GET http://host/path` (an app using `HTTP_PROXY`) → **forward**;
//! * `CONNECT host:443` (an app using `HTTPS_PROXY`) → **tunnel**;
//! * origin-form `GET /github/repos/x` sent to tollgate itself → **route**, rewritten to
//!   the route's upstream (`https://api.github.com/repos/x`).
//!
//! After classification every request but a tunnel carries an absolute upstream URI, so
//! the layers after this one treat the three ways alike.

use std::net::{IpAddr, SocketAddr};

use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Method, Request, Version};

use crate::config::{Config, ConnectPorts, RouteConfig};
use crate::error::ProxyError;

/// How a request reached tollgate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Absolute-form request from an app using tollgate as `HTTP_PROXY`.
    Forward,
    /// `CONNECT host:port`, a TCP tunnel.
    Tunnel,
    /// Origin-form request matched by a `[[route]]`.
    Route,
    /// A request sent inside an intercepted CONNECT tunnel.
    Inside,
}

/// An intercepted tunnel, as the requests inside it see it: where they all go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inside {
    /// The CONNECT's host, canonical.
    pub host: String,
    /// The CONNECT's port.
    pub port: u16,
    /// `https` when the client spoke TLS inside, `http` when plain HTTP.
    pub scheme: Scheme,
    /// The proxy user who opened the tunnel.
    pub user: Option<String>,
}

/// Where a request is going, decided once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// How the request reached tollgate.
    pub kind: Kind,
    /// Upstream host in its canonical form ([`crate::host::canonical`]; an IPv6
    /// literal in brackets): what groups, the policy and the pool match on.
    pub host: String,
    /// Upstream port.
    pub port: u16,
    /// The `[[limit]]` group named by the route, if any.
    pub limit: Option<String>,
}

/// Classifies requests against the configured routes and CONNECT ports.
#[derive(Debug, Clone)]
pub struct Classifier {
    /// Routes, longest prefix first so the most specific one wins.
    routes: Vec<RouteConfig>,
    connect_ports: ConnectPorts,
}

impl Classifier {
    /// Builds the classifier from the configuration.
    pub fn new(config: &Config) -> Self {
        let mut routes = config.routes.clone();
        routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.as_str().len()));
        Classifier {
            routes,
            connect_ports: config.proxy.connect_ports.clone(),
        }
    }

    /// Decides where `req` goes and, for a route, rewrites its URI to the upstream's.
    /// `local` is the address the client connected to, so a request addressed to
    /// tollgate itself is served as origin-form rather than proxied back to itself.
    pub fn classify<B>(
        &self,
        req: &mut Request<B>,
        local: SocketAddr,
    ) -> Result<Target, ProxyError> {
        if req.method() == Method::CONNECT {
            return self.tunnel(req.uri());
        }
        let uri = req.uri();
        // Clients never forward-proxy over h2 (they CONNECT); an h2 URI always carries
        // `:authority`, which then names tollgate itself.
        if let (Some(scheme), Some(authority)) = (uri.scheme(), uri.authority()) {
            if req.version() != Version::HTTP_2 {
                let (host, port) = host_and_port(authority);
                let port = port.unwrap_or(default_port(scheme));
                if !addressed_to(host, port, local) {
                    let target = forward(uri, scheme, authority, host, port)?;
                    // An address written another way (`127.1`, `[::ffff:127.0.0.1]`)
                    // goes on as its canonical form, so the pool and the dialer see
                    // what the group and the policy saw; a name keeps its spelling.
                    if target.host != host.to_ascii_lowercase() {
                        *req.uri_mut() = with_host(req.uri(), &target.host)?;
                    }
                    return Ok(target);
                }
            }
        }
        self.route(req)
    }

    /// Decides where a request sent inside the intercepted tunnel `inside` goes: always
    /// to the tunnel's host and port, whatever its head says, and its URI made absolute
    /// (`https://host/path`) so the rest of the path treats it as a forward request. A
    /// request naming another host (in `Host` or its URI) is refused with `421`: the
    /// client opened the tunnel, and got a certificate, for one host only.
    pub fn inside<B>(req: &mut Request<B>, inside: &Inside) -> Result<Target, ProxyError> {
        if req.method() == Method::CONNECT {
            return Err(ProxyError::BadRequest(
                "CONNECT inside a CONNECT tunnel is not supported".into(),
            ));
        }
        // HTTP/2 names the host in `:authority` (the URI), HTTP/1.1 in `Host`.
        let named = match req.uri().authority() {
            Some(authority) => Some(authority.clone()),
            None => match req.headers().get(http::header::HOST) {
                Some(host) => Some(
                    Authority::try_from(host.as_bytes())
                        .map_err(|_| ProxyError::BadRequest(format!("bad Host {host:?}")))?,
                ),
                None => None,
            },
        };
        if let Some(named) = named {
            let same_host =
                crate::host::canonical(named.host()).as_deref() == Some(inside.host.as_str());
            // A client names a port that is not its scheme's default (RFC 9110 §7.2).
            let same_port = named.port_u16().is_none_or(|port| port == inside.port);
            if !(same_host && same_port) {
                return Err(ProxyError::Misdirected {
                    named: named.to_string(),
                    tunnel: format!("{}:{}", inside.host, inside.port),
                });
            }
        }
        let authority = if inside.port == default_port(&inside.scheme) {
            inside.host.clone()
        } else {
            format!("{}:{}", inside.host, inside.port)
        };
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(inside.scheme.clone());
        parts.authority = Some(
            Authority::try_from(authority)
                .map_err(|e| ProxyError::BadRequest(format!("bad authority: {e}")))?,
        );
        parts.path_and_query = Some(
            req.uri()
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
        );
        *req.uri_mut() =
            Uri::from_parts(parts).map_err(|e| ProxyError::BadRequest(format!("bad URI: {e}")))?;
        Ok(Target {
            kind: Kind::Inside,
            host: inside.host.clone(),
            port: inside.port,
            limit: None,
        })
    }

    fn tunnel(&self, uri: &Uri) -> Result<Target, ProxyError> {
        let bad = || {
            ProxyError::BadRequest(format!(
                "CONNECT needs host:port, got {:?}",
                uri.to_string()
            ))
        };
        let authority = uri.authority().ok_or_else(bad)?;
        let (host, port) = host_and_port(authority);
        if uri.scheme().is_some() || authority.as_str().contains('@') || host.is_empty() {
            return Err(bad());
        }
        let port = port.filter(|p| *p != 0).ok_or_else(bad)?;
        if !self.connect_ports.allows(port) {
            return Err(ProxyError::PortNotAllowed { port });
        }
        Ok(Target {
            kind: Kind::Tunnel,
            host: canonical(host)?,
            port,
            limit: None,
        })
    }

    fn route<B>(&self, req: &mut Request<B>) -> Result<Target, ProxyError> {
        let raw = req.uri().path();
        // Matched on the normalised path, so `..` and encodings cannot reach what the
        // prefix does not name; a path written under a route that normalises out of it
        // is refused rather than sent to another route, or to the route's parent.
        let path = crate::path::normalize(raw).map_err(|e| {
            ProxyError::BadRequest(format!("{e}: routed paths stay inside their route"))
        })?;
        let within = |path: &str, prefix: &str| {
            path.strip_prefix(prefix)
                .or_else(|| (path == &prefix[..prefix.len() - 1]).then_some(""))
                .map(str::to_owned)
        };
        let matched = self.routes.iter().find_map(|route| {
            let rest = within(&path, route.prefix.as_str())?;
            Some((route, rest))
        });
        // The route the path names as written, before `.` and `..` are resolved.
        let as_written = self
            .routes
            .iter()
            .find(|route| within(raw, route.prefix.as_str()).is_some());
        if let Some(escaped) = as_written {
            let same = matched
                .as_ref()
                .is_some_and(|(m, _)| m.prefix == escaped.prefix);
            if !same {
                return Err(ProxyError::BadRequest(format!(
                    "the path {raw:?} leaves the route {:?} once '.' and '..' are resolved ({path:?})",
                    escaped.prefix.as_str()
                )));
            }
        }
        let Some((route, rest)) = matched else {
            return Err(ProxyError::NoRoute {
                path: raw.to_string(),
                routes: self
                    .routes
                    .iter()
                    .map(|r| format!("{} -> {}", r.prefix.as_str(), r.upstream))
                    .collect(),
            });
        };
        let upstream = &route.upstream;
        let base = upstream.base_path.as_str();
        let path_and_query = match req.uri().query() {
            Some(query) => format!("{base}/{rest}?{query}"),
            None => format!("{base}/{rest}"),
        };
        let path_and_query = PathAndQuery::try_from(path_and_query)
            .map_err(|e| ProxyError::BadRequest(format!("cannot rewrite path: {e}")))?;
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(upstream.scheme.clone());
        parts.authority = Some(upstream.authority.clone());
        parts.path_and_query = Some(path_and_query);
        let uri = Uri::from_parts(parts)
            .map_err(|e| ProxyError::BadRequest(format!("cannot rewrite path: {e}")))?;
        let mut target = target_of(&upstream.scheme, &upstream.authority, Kind::Route)?;
        target.limit = route.limit.clone();
        *req.uri_mut() = uri;
        Ok(target)
    }
}

/// An absolute-form request `uri` to `host:port` (as [`Authority::host`] and the port,
/// the scheme's default filled in, found them in its `authority`).
fn forward(
    uri: &Uri,
    scheme: &Scheme,
    authority: &Authority,
    host: &str,
    port: u16,
) -> Result<Target, ProxyError> {
    if *scheme != Scheme::HTTP && *scheme != Scheme::HTTPS {
        return Err(ProxyError::BadRequest(format!(
            "unsupported scheme {scheme}: tollgate forwards http and https URLs"
        )));
    }
    if host.is_empty() || authority.as_str().contains('@') {
        return Err(ProxyError::BadRequest(format!(
            "bad authority {:?} in {uri}",
            authority.as_str()
        )));
    }
    Ok(Target {
        kind: Kind::Forward,
        host: canonical(host)?,
        port,
        limit: None,
    })
}

/// The target of a request of `kind` to `authority` under `scheme`, its host lower-cased
/// and the scheme's default port filled in.
fn target_of(scheme: &Scheme, authority: &Authority, kind: Kind) -> Result<Target, ProxyError> {
    let (host, port) = host_and_port(authority);
    Ok(Target {
        kind,
        host: canonical(host)?,
        port: port.unwrap_or(default_port(scheme)),
        limit: None,
    })
}

/// `host` in its canonical form; refused when it cannot name a host.
fn canonical(host: &str) -> Result<String, ProxyError> {
    crate::host::canonical(host)
        .ok_or_else(|| ProxyError::BadRequest(format!("{host:?} is not a host name or address")))
}

/// `uri` with `host` in place of its authority's host, the port kept.
fn with_host(uri: &Uri, host: &str) -> Result<Uri, ProxyError> {
    let authority = match uri.port_u16() {
        Some(port) => format!("{host}:{port}"),
        None => host.to_string(),
    };
    let mut parts = uri.clone().into_parts();
    parts.authority = Some(
        Authority::try_from(authority)
            .map_err(|e| ProxyError::BadRequest(format!("bad authority: {e}")))?,
    );
    Uri::from_parts(parts).map_err(|e| ProxyError::BadRequest(format!("bad URI: {e}")))
}

/// `authority`'s host (with an IPv6 literal's brackets) and port, if it names one.
fn host_and_port(authority: &Authority) -> (&str, Option<u16>) {
    (authority.host(), authority.port_u16())
}

/// The port a URI of `scheme` means when it names none.
fn default_port(scheme: &Scheme) -> u16 {
    if *scheme == Scheme::HTTPS {
        443
    } else {
        80
    }
}

/// Whether an absolute URI naming `host` and `port` names the address the client
/// connected to.
fn addressed_to(host: &str, port: u16, local: SocketAddr) -> bool {
    if port != local.port() {
        return false;
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<IpAddr>() {
        Ok(ip) => ip == local.ip() || (ip.is_loopback() && local.ip().is_loopback()),
        Err(_) => host.eq_ignore_ascii_case("localhost") && local.ip().is_loopback(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: &str = "127.0.0.1:8080";

    fn classifier(extra: &str) -> Classifier {
        let text = format!(
            "[proxy]\nconnect_ports = [443, 8443]\n{extra}\n\
             [[route]]\nprefix = \"/gh/\"\nupstream = \"https://api.github.com\"\n\
             [[route]]\nprefix = \"/gh/v2/\"\nupstream = \"http://v2.example:8000/base/\"\n"
        );
        Classifier::new(&Config::parse(&text, "t").unwrap())
    }

    fn run(c: &Classifier, method: Method, uri: &str) -> (Result<Target, ProxyError>, String) {
        let mut req = Request::builder().method(method).uri(uri).body(()).unwrap();
        let t = c.classify(&mut req, LOCAL.parse().unwrap());
        (t, req.uri().to_string())
    }

    #[test]
    fn absolute_form_is_forwarded_unchanged() {
        let (t, uri) = run(&classifier(""), Method::GET, "http://Example.com:81/a?b");
        let t = t.unwrap();
        assert_eq!(
            (t.kind, t.host.as_str(), t.port),
            (Kind::Forward, "example.com", 81)
        );
        assert_eq!(uri, "http://Example.com:81/a?b");
    }

    #[test]
    fn absolute_form_finds_ipv6_hosts_and_default_ports() {
        let c = classifier("");
        let target = |uri: &str| {
            let t = run(&c, Method::GET, uri).0.unwrap();
            (t.kind, t.host.to_string(), t.port)
        };
        assert_eq!(
            target("http://[::1]:9000/x"),
            (Kind::Forward, "[::1]".to_string(), 9000)
        );
        // An empty port is the scheme's default, as for no port at all.
        assert_eq!(
            target("http://example.com:/x"),
            (Kind::Forward, "example.com".to_string(), 80)
        );
        assert_eq!(
            target("https://example.com/x"),
            (Kind::Forward, "example.com".to_string(), 443)
        );
        // Longer than a host kept inline (24 bytes): lower-cased all the same.
        assert_eq!(
            target("https://GenerativeLanguage.GoogleAPIs.com/v1"),
            (
                Kind::Forward,
                "generativelanguage.googleapis.com".to_string(),
                443
            )
        );
    }

    #[test]
    fn routes_rewrite_longest_prefix_first_and_keep_query() {
        let c = classifier("");
        let (t, uri) = run(&c, Method::GET, "/gh/repos/x?page=2");
        assert_eq!(t.unwrap().kind, Kind::Route);
        assert_eq!(uri, "https://api.github.com/repos/x?page=2");
        let (t, uri) = run(&c, Method::GET, "/gh/v2/things");
        assert_eq!(t.unwrap().port, 8000);
        assert_eq!(uri, "http://v2.example:8000/base/things");
        let (_, uri) = run(&c, Method::GET, "/gh");
        assert_eq!(uri, "https://api.github.com/");
    }

    #[test]
    fn request_to_tollgate_itself_is_routed_not_looped() {
        let (t, uri) = run(&classifier(""), Method::GET, "http://localhost:8080/gh/x");
        assert_eq!(t.unwrap().kind, Kind::Route);
        assert_eq!(uri, "https://api.github.com/x");
    }

    #[test]
    fn itself_is_recognised_by_default_ports_and_ipv6_literals() {
        let c = classifier("");
        let on = |uri: &str, local: &str| {
            let mut req = Request::builder().uri(uri).body(()).unwrap();
            c.classify(&mut req, local.parse().unwrap()).unwrap().kind
        };
        assert_eq!(on("http://[::1]:8080/gh/x", LOCAL), Kind::Route);
        assert_eq!(on("http://127.0.0.1/gh/x", "127.0.0.1:80"), Kind::Route);
        assert_eq!(on("https://127.0.0.1/gh/x", "127.0.0.1:80"), Kind::Forward);
        assert_eq!(on("https://127.0.0.1/gh/x", "127.0.0.1:443"), Kind::Route);
        assert_eq!(on("http://127.0.0.1:8081/gh/x", LOCAL), Kind::Forward);
    }

    #[test]
    fn unknown_path_lists_routes() {
        let (t, _) = run(&classifier(""), Method::GET, "/nope");
        let e = t.unwrap_err();
        assert_eq!(e.status(), 404);
        assert!(
            e.to_string().contains("/gh/ -> https://api.github.com"),
            "{e}"
        );
    }

    #[test]
    fn connect_checks_authority_and_port() {
        let c = classifier("");
        let t = run(&c, Method::CONNECT, "api.example.com:443").0.unwrap();
        assert_eq!((t.kind, t.port), (Kind::Tunnel, 443));
        assert_eq!(
            run(&c, Method::CONNECT, "api.example.com")
                .0
                .unwrap_err()
                .status(),
            400
        );
        assert_eq!(
            run(&c, Method::CONNECT, "api.example.com:22")
                .0
                .unwrap_err()
                .status(),
            403
        );
        let any = Classifier::new(&Config::parse("[proxy]\nconnect_ports = [\"*\"]", "t").unwrap());
        assert!(run(&any, Method::CONNECT, "h:22").0.is_ok());
    }

    #[test]
    fn other_schemes_are_refused() {
        let (t, _) = run(&classifier(""), Method::GET, "ftp://example.com/x");
        assert_eq!(t.unwrap_err().status(), 400);
    }

    #[test]
    fn a_request_inside_a_tunnel_goes_to_the_tunnel_s_host() {
        let inside = |port, scheme| Inside {
            host: "api.example.com".into(),
            port,
            scheme,
            user: None,
        };
        let https = inside(443, Scheme::HTTPS);
        let odd_port = inside(8443, Scheme::HTTPS);
        let plain = inside(80, Scheme::HTTP);
        for (tunnel, method, uri, host, expected) in [
            // HTTP/1.1: origin-form and Host.
            (
                &https,
                "GET",
                "/v1/x?q=1",
                Some("api.example.com"),
                Ok("https://api.example.com/v1/x?q=1"),
            ),
            (
                &https,
                "GET",
                "/",
                Some("API.Example.COM."),
                Ok("https://api.example.com/"),
            ),
            (
                &https,
                "GET",
                "/",
                Some("api.example.com:443"),
                Ok("https://api.example.com/"),
            ),
            (
                &odd_port,
                "GET",
                "/",
                Some("api.example.com:8443"),
                Ok("https://api.example.com:8443/"),
            ),
            (
                &plain,
                "POST",
                "/p",
                Some("api.example.com"),
                Ok("http://api.example.com/p"),
            ),
            (&https, "GET", "/", None, Ok("https://api.example.com/")),
            // HTTP/2 (and absolute-form): the URI's authority.
            (
                &https,
                "GET",
                "https://api.example.com/h2",
                None,
                Ok("https://api.example.com/h2"),
            ),
            (
                &https,
                "GET",
                "https://other.example.com/h2",
                None,
                Err(421),
            ),
            (
                &https,
                "GET",
                "http://other.example.com/",
                Some("api.example.com"),
                Err(421),
            ),
            // Another host, or another port, than the tunnel's.
            (&https, "GET", "/", Some("other.example.com"), Err(421)),
            (&https, "GET", "/", Some("api.example.com:8443"), Err(421)),
            (&https, "GET", "/", Some("bad host"), Err(400)),
            (&https, "CONNECT", "other.example.com:443", None, Err(400)),
        ] {
            let mut req = Request::builder().method(method).uri(uri);
            if let Some(host) = host {
                req = req.header("host", host);
            }
            let mut req = req.body(()).unwrap();
            let got = Classifier::inside(&mut req, tunnel)
                .map(|target| {
                    assert_eq!(target.kind, Kind::Inside);
                    assert_eq!(
                        (target.host.as_str(), target.port),
                        ("api.example.com", tunnel.port)
                    );
                    req.uri().to_string()
                })
                .map_err(|e| e.status().as_u16());
            assert_eq!(
                got.as_deref().map_err(|e| *e),
                expected,
                "{method} {uri} {host:?}"
            );
        }
    }
}
