//! The values in `config.toml` with a grammar of their own: rates, durations, byte
//! sizes, statuses, host patterns, cost rules, CONNECT ports, route prefixes, and
//! upstream and Redis URLs.
//!
//! Each type checks itself as it is deserialized, so a bad value is refused by `toml`
//! with the span it came from, and [`Config::parse`](super::Config::parse) can name its
//! line and column.

use std::fmt;
use std::time::Duration;

use http::uri::{Scheme, Uri};
use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::Invalid;

/// A rate: `limit` requests (cost units) per `period`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// How many per period.
    pub limit: u64,
    /// The period.
    pub period: Duration,
}

impl Rate {
    /// Requests (cost units) a second, on average over the period.
    pub fn per_second(&self) -> f64 {
        self.limit as f64 / self.period.as_secs_f64()
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            self.limit,
            humantime::format_duration(self.period)
        )
    }
}

impl std::str::FromStr for Rate {
    type Err = Invalid;

    /// `N/s`, `N/m`, `N/h`, `N/d` or `N/<duration>` such as `100/10s`.
    fn from_str(text: &str) -> Result<Rate, Invalid> {
        let bad = || {
            Invalid(format!(
                "invalid rate {text:?}: expected \"N/s\", \"N/m\", \"N/h\", \"N/d\", \"N/<duration>\" (e.g. \"100/10s\") or \"unlimited\""
            ))
        };
        let (count, per) = text.trim().split_once('/').ok_or_else(bad)?;
        let limit: u64 = count.trim().parse().map_err(|_| bad())?;
        let per = per.trim();
        let period = if per.starts_with(|c: char| c.is_ascii_digit()) {
            humantime::parse_duration(per)
        } else {
            humantime::parse_duration(&format!("1{per}"))
        }
        .map_err(|_| bad())?;
        if limit == 0 || period.is_zero() {
            return Err(Invalid(format!(
                "invalid rate {text:?}: the count and the period must be above zero"
            )));
        }
        if period > MAX_DURATION {
            return Err(Invalid(format!(
                "invalid rate {text:?}: the period is longer than a year"
            )));
        }
        if period / u32::try_from(limit).map_err(|_| bad())? < Duration::from_micros(1) {
            return Err(Invalid(format!(
                "invalid rate {text:?}: faster than one per microsecond"
            )));
        }
        Ok(Rate { limit, period })
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(de::Error::custom)
    }
}

/// One rate or several (all must allow), or `"unlimited"`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rates(pub Vec<Rate>);

impl<'de> Deserialize<'de> for Rates {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        let texts = match OneOrMany::deserialize(d).map_err(|_| {
            de::Error::custom("expected a rate like \"10/s\", a list of rates, or \"unlimited\"")
        })? {
            OneOrMany::One(text) if text.trim() == "unlimited" => return Ok(Rates(Vec::new())),
            OneOrMany::One(text) => vec![text],
            OneOrMany::Many(texts) => texts,
        };
        texts
            .iter()
            .map(|t| t.parse().map_err(de::Error::custom))
            .collect::<Result<_, _>>()
            .map(Rates)
    }
}

/// A duration written the humane way: `"250ms"`, `"10s"`, `"5m"`, `"1h 30m"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl Dur {
    pub(super) const fn secs(s: u64) -> Self {
        Dur(Duration::from_secs(s))
    }
}

/// The longest duration any setting takes: longer ones are typos, and added to a clock
/// reading they could overflow it.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let dur = humantime::parse_duration(text.trim()).map_err(|e| {
            de::Error::custom(format!(
                "invalid duration {text:?} ({e}): expected a number and a unit, e.g. \"250ms\", \"10s\", \"5m\""
            ))
        })?;
        if dur > MAX_DURATION {
            return Err(de::Error::custom(format!(
                "duration {text:?} is longer than a year, the longest any setting takes"
            )));
        }
        Ok(Dur(dur))
    }
}

/// A [`Dur`] that must be more than zero: a timeout of zero would fail everything.
pub(super) fn timeout<'de, D: Deserializer<'de>>(d: D) -> Result<Dur, D::Error> {
    let dur = Dur::deserialize(d)?;
    if dur.0.is_zero() {
        return Err(de::Error::custom(
            "a timeout of 0 would fail every request: expected more than 0, e.g. \"10s\"",
        ));
    }
    Ok(dur)
}

/// A byte size: a number of bytes, or a string like `"512KiB"`, `"1MiB"`, `"10MB"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        let bad = |t: &str| {
            de::Error::custom(format!(
                "invalid size {t:?}: expected bytes as a number or e.g. \"64KiB\", \"1MiB\", \"10MB\""
            ))
        };
        let text = match Raw::deserialize(d).map_err(|_| bad("?"))? {
            Raw::Number(n) => return Ok(ByteSize(n)),
            Raw::Text(text) => text,
        };
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (digits, unit) = t.split_at(split);
        let n: u64 = digits.parse().map_err(|_| bad(&text))?;
        let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kb" => 1000,
            "kib" => 1 << 10,
            "mb" => 1_000_000,
            "mib" => 1 << 20,
            "gb" => 1_000_000_000,
            "gib" => 1 << 30,
            _ => return Err(bad(&text)),
        };
        n.checked_mul(scale).map(ByteSize).ok_or_else(|| bad(&text))
    }
}

/// An HTTP status code (100-599).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusCode(pub u16);

impl<'de> Deserialize<'de> for StatusCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let code = u16::deserialize(d)?;
        if (100..=599).contains(&code) {
            Ok(StatusCode(code))
        } else {
            Err(de::Error::custom(format!(
                "invalid status {code}: expected 100-599"
            )))
        }
    }
}

/// A host name, or `*.domain` for every name under `domain` (not `domain` itself).
/// An exact host may carry a port (`api.example.com:8443`): it then matches requests to
/// that port only. Hosts are kept in their canonical form ([`crate::host::canonical`]),
/// so `127.1` in the file is `127.0.0.1`, as it is in a request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// Exactly this host, or `host:port`.
    Exact(String),
    /// Any host ending in `.domain`; holds `.domain`.
    Suffix(String),
}

impl HostPattern {
    /// Reads a pattern as written in the file.
    pub fn parse(text: &str) -> Result<HostPattern, Invalid> {
        let text = text.trim();
        let bad = |why: &str| {
            Invalid(format!(
                "invalid host {text:?}: {why}; expected a host like \"api.github.com\", \"api.example.com:8443\" or a pattern like \"*.github.com\""
            ))
        };
        if let Some(domain) = text.strip_prefix("*.") {
            let domain = crate::host::canonical(domain)
                .filter(|d| is_name(d))
                .ok_or_else(|| bad("not a domain name"))?;
            return Ok(HostPattern::Suffix(format!(".{domain}")));
        }
        // A bare IPv6 address is written in brackets in a URI.
        if let Ok(v6) = text.parse::<std::net::Ipv6Addr>() {
            return Ok(HostPattern::Exact(crate::host::from_ip(v6.into())));
        }
        let (host, port) =
            split_port(text).ok_or_else(|| bad("the port is not a number from 1 to 65535"))?;
        let host = crate::host::canonical(host)
            .filter(|h| crate::host::ip_of(h).is_some() || is_name(h))
            .ok_or_else(|| bad("not a host name or address"))?;
        Ok(HostPattern::Exact(match port {
            Some(port) => format!("{host}:{port}"),
            None => host,
        }))
    }

    /// The port the pattern names, if it names one.
    pub fn port(&self) -> Option<u16> {
        match self {
            HostPattern::Exact(exact) if !exact.ends_with(']') => {
                exact.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
            }
            _ => None,
        }
    }

    /// Whether `host` (canonical) on `port` matches.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        match self {
            HostPattern::Suffix(suffix) => host.ends_with(suffix.as_str()),
            HostPattern::Exact(exact) => match exact.rsplit_once(':') {
                Some((h, p)) if !exact.ends_with(']') => h == host && p == port.to_string(),
                _ => exact == host,
            },
        }
    }
}

/// `host[:port]` split, an IPv6 literal with or without brackets; `None` for a port
/// that is not 1–65535.
fn split_port(text: &str) -> Option<(&str, Option<u16>)> {
    let port = |p: &str| p.parse::<u16>().ok().filter(|p| *p != 0);
    if text.starts_with('[') {
        return match text.split_once("]:") {
            Some((host, p)) => Some((&text[..host.len() + 1], Some(port(p)?))),
            None => Some((text, None)),
        };
    }
    match text.split_once(':') {
        // More than one colon: a bare IPv6 literal.
        Some((_, rest)) if rest.contains(':') => Some((text, None)),
        Some((host, p)) => Some((host, Some(port(p)?))),
        None => Some((text, None)),
    }
}

/// Whether a canonical host is a plausible DNS name.
fn is_name(host: &str) -> bool {
    !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

impl<'de> Deserialize<'de> for HostPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        HostPattern::parse(&String::deserialize(d)?).map_err(de::Error::custom)
    }
}

/// An `[access]` rule: an address range (`10.0.0.0/8`, `::1`, `127.0.0.1`) or a host
/// pattern (`internal.example.com`, `*.corp.example`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessRule {
    /// Every address in the range.
    Net(ipnet::IpNet),
    /// Every host the pattern matches, on any port.
    Host(HostPattern),
}

impl std::fmt::Display for AccessRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AccessRule::Net(net) => write!(f, "{net}"),
            AccessRule::Host(HostPattern::Exact(host)) => write!(f, "{host}"),
            AccessRule::Host(HostPattern::Suffix(suffix)) => write!(f, "*{suffix}"),
        }
    }
}

impl<'de> Deserialize<'de> for AccessRule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let text = text.trim();
        if let Ok(net) = text.parse::<ipnet::IpNet>() {
            return Ok(AccessRule::Net(canonical_net(net)));
        }
        let pattern = HostPattern::parse(text).map_err(de::Error::custom)?;
        if let HostPattern::Exact(host) = &pattern {
            if host.contains(':') && !host.starts_with('[') || host.contains("]:") {
                return Err(de::Error::custom(format!(
                    "invalid rule {text:?}: [access] rules name hosts or address ranges, without a port"
                )));
            }
            if let Some(ip) = crate::host::ip_of(host) {
                return Ok(AccessRule::Net(ipnet::IpNet::from(ip)));
            }
        }
        Ok(AccessRule::Host(pattern))
    }
}

/// A range of client addresses (`10.0.0.0/8`, or one address, `192.0.2.7`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientRange(pub ipnet::IpNet);

impl<'de> Deserialize<'de> for ClientRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let text = text.trim();
        let net = text
            .parse::<ipnet::IpNet>()
            .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                de::Error::custom(format!(
                    "invalid client range {text:?}: expected an address range like \"10.0.0.0/8\" or an address"
                ))
            })?;
        Ok(ClientRange(canonical_net(net)))
    }
}

/// `net` with an IPv4-mapped IPv6 range written as the IPv4 range it maps.
fn canonical_net(net: ipnet::IpNet) -> ipnet::IpNet {
    match net {
        ipnet::IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96)
                .map(ipnet::IpNet::V4)
                .unwrap_or(net),
            None => net.trunc(),
        },
        _ => net.trunc(),
    }
}

/// A request weight rule: requests matching `method` and `path_prefix` cost `cost`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostRule {
    /// Only requests with this method (any when absent).
    #[serde(default, deserialize_with = "method")]
    pub method: Option<http::Method>,
    /// Only requests whose upstream path starts with this (any when absent).
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// The cost, in rate units (≥ 1).
    pub cost: u32,
}

impl CostRule {
    pub(super) fn matches(&self, method: &http::Method, path: &str) -> bool {
        self.method.as_ref().is_none_or(|m| m == method)
            && self
                .path_prefix
                .as_ref()
                .is_none_or(|p| path.starts_with(p.as_str()))
    }
}

fn method<'de, D: Deserializer<'de>>(d: D) -> Result<Option<http::Method>, D::Error> {
    let text = String::deserialize(d)?;
    http::Method::from_bytes(text.to_ascii_uppercase().as_bytes())
        .map(Some)
        .map_err(|_| de::Error::custom(format!("invalid method {text:?}")))
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
                other => {
                    return Err(de::Error::custom(format!(
                        "invalid port {other}: {EXPECTED}"
                    )))
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_grammar() {
        let r: Rate = "100/10s".parse().unwrap();
        assert_eq!((r.limit, r.period), (100, Duration::from_secs(10)));
        assert_eq!(
            "5/m".parse::<Rate>().unwrap().period,
            Duration::from_secs(60)
        );
        assert_eq!(
            "1/d".parse::<Rate>().unwrap().period,
            Duration::from_secs(86_400)
        );
        for bad in ["10", "0/s", "10/parsec", "x/s", "10/0s"] {
            assert!(bad.parse::<Rate>().is_err(), "{bad}");
        }
    }
}
