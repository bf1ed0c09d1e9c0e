//! `config.toml`: the user's contract.
//!
//! Everything is parsed and checked here, at start, so that the data path never has to
//! handle a malformed setting. Values with a grammar of their own (durations, rates,
//! ports, URLs) are newtypes whose `Deserialize` validates them, so a bad value is reported
//! by `toml` with the exact span it came from; [`Config::parse`] turns that span into
//! `file:line:column`. Checks that need several fields (a route naming an unknown limit
//! group, the same host in two groups) keep the span of the field with [`Spanned`].

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::uri::{Scheme, Uri};
use serde::de::{self, Deserializer};
use serde::Deserialize;
use toml::Spanned;

/// The whole configuration file.
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// The proxy listener and its connections.
    pub proxy: ProxyConfig,
    /// Gateway routes: `/prefix/...` on the proxy → an upstream base URL.
    pub routes: Vec<RouteConfig>,
}

/// `[proxy]`: where tollgate listens and how it talks to upstreams.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Address of the proxy listener (`--listen` overrides it).
    pub listen: SocketAddr,
    /// Ports a CONNECT tunnel may reach.
    pub connect_ports: ConnectPorts,
    /// Longest time to resolve, connect and finish the TLS handshake with an upstream.
    pub connect_timeout: Dur,
    /// Longest time from sending a request upstream to receiving its response head.
    pub response_timeout: Dur,
    /// Longest time a client may take to send a request head; on HTTP/1.1 this is also
    /// how long an idle keep-alive connection from a client is kept open.
    pub client_header_timeout: Dur,
    /// How long an idle pooled connection to an upstream is kept for reuse.
    pub upstream_idle_timeout: Dur,
    /// Extra PEM root certificates trusted for upstream TLS, beside the public web roots.
    pub ca_file: Option<PathBuf>,
    /// After SIGTERM/SIGINT, how long in-flight requests and tunnels may take to finish.
    pub shutdown_grace: Dur,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            connect_ports: ConnectPorts::Only(vec![443]),
            connect_timeout: Dur::secs(10),
            response_timeout: Dur::secs(60),
            client_header_timeout: Dur::secs(30),
            upstream_idle_timeout: Dur::secs(90),
            ca_file: None,
            shutdown_grace: Dur::secs(30),
        }
    }
}

/// `[[route]]`: a gateway route.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Path prefix on the proxy, always starting and ending with `/`.
    pub prefix: RoutePrefix,
    /// Base URL the rest of the path is appended to.
    pub upstream: UpstreamUrl,
}

/// A duration written the humane way: `"250ms"`, `"10s"`, `"5m"`, `"1h 30m"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl Dur {
    const fn secs(s: u64) -> Self {
        Dur(Duration::from_secs(s))
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(text.trim()).map(Dur).map_err(|e| {
            de::Error::custom(format!(
                "invalid duration {text:?} ({e}): expected a number and a unit, e.g. \"250ms\", \"10s\", \"5m\""
            ))
        })
    }
}

/// Which ports CONNECT may open tunnels to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectPorts {
    /// `["*"]`: any port.
    Any,
    /// Only these ports.
    Only(Vec<u16>),
}

impl ConnectPorts {
    /// Whether a tunnel to `port` is allowed.
    pub fn allows(&self, port: u16) -> bool {
        match self {
            ConnectPorts::Any => true,
            ConnectPorts::Only(ports) => ports.contains(&port),
        }
    }
}

impl<'de> Deserialize<'de> for ConnectPorts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const EXPECTED: &str = "expected a list of port numbers (1-65535) or [\"*\"] for any port";
        let items = Vec::<toml::Value>::deserialize(d)
            .map_err(|e| de::Error::custom(format!("{e}; {EXPECTED}")))?;
        let mut ports = Vec::new();
        for item in &items {
            match item {
                toml::Value::String(s) if s == "*" => return Ok(ConnectPorts::Any),
                toml::Value::Integer(n) if (1..=65535).contains(n) => ports.push(*n as u16),
                other => return Err(de::Error::custom(format!("invalid port {other}: {EXPECTED}"))),
            }
        }
        Ok(ConnectPorts::Only(ports))
    }
}

/// A route prefix: starts with `/`; a missing trailing `/` is added so that `/github`
/// never matches `/githubusercontent/...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePrefix(String);

impl RoutePrefix {
    /// The prefix, with its leading and trailing `/`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for RoutePrefix {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut text = String::deserialize(d)?;
        if !text.starts_with('/') || text.contains(['?', '#', ' ']) {
            return Err(de::Error::custom(format!(
                "invalid route prefix {text:?}: expected a path starting with '/', e.g. \"/github/\""
            )));
        }
        if !text.ends_with('/') {
            text.push('/');
        }
        Ok(RoutePrefix(text))
    }
}

/// An upstream base URL: `http://` or `https://`, a host, an optional base path, no query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamUrl {
    /// `http` or `https`.
    pub scheme: Scheme,
    /// `host[:port]` as written (the port is omitted when it is the scheme's default).
    pub authority: http::uri::Authority,
    /// Base path without a trailing `/` (empty for the root).
    pub base_path: String,
}

impl fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.base_path)
    }
}

impl<'de> Deserialize<'de> for UpstreamUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let bad = |why: &str| {
            de::Error::custom(format!(
                "invalid upstream {text:?}: {why}; expected e.g. \"https://api.github.com\""
            ))
        };
        let uri: Uri = text.parse().map_err(|_| bad("not a URL"))?;
        let scheme = uri.scheme().cloned().ok_or_else(|| bad("no scheme"))?;
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(bad("the scheme must be http or https"));
        }
        let authority = uri.authority().cloned().ok_or_else(|| bad("no host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("credentials in the URL are not supported"));
        }
        if uri.query().is_some() {
            return Err(bad("a query string is not allowed"));
        }
        let base_path = uri.path().trim_end_matches('/').to_string();
        Ok(UpstreamUrl {
            scheme,
            authority,
            base_path,
        })
    }
}

/// A configuration that could not be loaded, with where and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read: {source}")]
    Read {
        /// The file name as given.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A value or the TOML syntax is wrong at a known place.
    #[error("{file}:{line}:{column}: {message}")]
    Invalid {
        /// The file name as given.
        file: String,
        /// 1-based line.
        line: usize,
        /// 1-based column (in characters).
        column: usize,
        /// What was wrong and what was expected.
        message: String,
    },
    /// A file that is not tied to one place (e.g. `ca_file`) is unusable.
    #[error("{file}: {message}")]
    Other {
        /// The file name as given.
        file: String,
        /// What was wrong.
        message: String,
    },
}

impl Config {
    /// Reads and checks a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: file.clone(),
            source,
        })?;
        Config::parse(&text, &file)
    }

    /// Parses and checks configuration text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        let at = |span: Option<Range<usize>>, message: String| {
            let (line, column) = line_column(text, span.map_or(0, |s| s.start));
            ConfigError::Invalid {
                file: file.to_string(),
                line,
                column,
                message,
            }
        };
        let raw: RawConfig =
            toml::from_str(text).map_err(|e| at(e.span(), e.message().trim().to_string()))?;
        raw.check().map_err(|(span, message)| at(Some(span), message))
    }
}

/// The file as deserialized, before the checks that span several fields.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    proxy: ProxyConfig,
    #[serde(default)]
    route: Vec<Spanned<RouteConfig>>,
}

impl RawConfig {
    fn check(self) -> Result<Config, (Range<usize>, String)> {
        let mut prefixes = HashSet::new();
        for route in &self.route {
            if !prefixes.insert(route.get_ref().prefix.as_str().to_string()) {
                return Err((
                    route.span(),
                    format!(
                        "route prefix {:?} is defined twice",
                        route.get_ref().prefix.as_str()
                    ),
                ));
            }
        }
        Ok(Config {
            proxy: self.proxy,
            routes: self.route.into_iter().map(Spanned::into_inner).collect(),
        })
    }
}

/// 1-based line and column (in characters) of a byte offset.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        Config::parse(text, "t.toml").unwrap_err().to_string()
    }

    #[test]
    fn empty_file_gives_defaults() {
        let c = Config::parse("", "t.toml").unwrap();
        assert_eq!(c.proxy.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(c.proxy.connect_ports, ConnectPorts::Only(vec![443]));
        assert_eq!(c.proxy.connect_timeout.0, Duration::from_secs(10));
        assert!(c.routes.is_empty());
    }

    #[test]
    fn durations_ports_and_routes_parse() {
        let c = Config::parse(
            r#"
            [proxy]
            connect_timeout = "250ms"
            shutdown_grace = "5m"
            connect_ports = ["*"]
            [[route]]
            prefix = "/gh"
            upstream = "https://api.github.com/v3/"
            "#,
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.proxy.connect_timeout.0, Duration::from_millis(250));
        assert_eq!(c.proxy.shutdown_grace.0, Duration::from_secs(300));
        assert!(c.proxy.connect_ports.allows(22));
        assert_eq!(c.routes[0].prefix.as_str(), "/gh/");
        assert_eq!(c.routes[0].upstream.base_path, "/v3");
        assert_eq!(
            c.routes[0].upstream.to_string(),
            "https://api.github.com/v3"
        );
    }

    #[test]
    fn unknown_key_names_line_and_column() {
        let e = err("[proxy]\nlisten = \"127.0.0.1:1\"\n  conect_timeout = \"1s\"\n");
        assert!(e.starts_with("t.toml:3:3: unknown field `conect_timeout`"), "{e}");
        assert!(e.contains("expected one of"), "{e}");
    }

    #[test]
    fn bad_values_say_what_was_expected() {
        let e = err("[proxy]\nconnect_timeout = \"10 parsecs\"\n");
        assert!(e.starts_with("t.toml:2:19: invalid duration"), "{e}");
        let e = err("[proxy]\nconnect_ports = [443, 0]\n");
        assert!(e.contains("invalid port 0"), "{e}");
        let e = err("[[route]]\nprefix = \"/a/\"\nupstream = \"ftp://x\"\n");
        assert!(e.starts_with("t.toml:3:12:") && e.contains("http or https"), "{e}");
        let e = err("[[route]]\nprefix = \"a\"\nupstream = \"http://x\"\n");
        assert!(e.contains("starting with '/'"), "{e}");
    }

    #[test]
    fn duplicate_prefix_is_refused_where_it_is() {
        let e = err("[[route]]\nprefix = \"/a\"\nupstream = \"http://x\"\n\n[[route]]\nprefix = \"/a/\"\nupstream = \"http://y\"\n");
        assert!(e.starts_with("t.toml:5:1:"), "{e}"); // the second [[route]]
        assert!(e.contains("defined twice"), "{e}");
    }
}
