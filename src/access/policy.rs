//! The destination policy: which addresses a request may reach.
//!
//! tollgate is meant to reach the public APIs its apps call. Addresses that are not
//! public unicast (loopback, private ranges, link-local and cloud metadata, CGNAT,
//! unique-local IPv6, multicast, translation prefixes, ...) are refused unless
//! `[access] allow` names them, so a client cannot use the proxy to reach what sits
//! beside it. The order, first match wins:
//!
//! 1. `[access] deny` (a range, or a host pattern) refuses;
//! 2. tollgate's own listening addresses are refused (no request to itself);
//! 3. `[access] allow` (a range, or a host pattern) allows;
//! 4. the built-in ranges ([`BUILT_IN`]) refuse;
//! 5. everything else, the public internet, is allowed.
//!
//! The decisions are pure; the dialer (`upstream::Dialer`) asks them for every address
//! a name resolves to, and connects to the vetted address itself, so a second lookup
//! cannot answer differently (DNS rebinding).

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use crate::config::{AccessConfig, AccessRule, HostPattern};

/// The ranges refused unless allowed, each with what it is.
pub const BUILT_IN: &[(&str, &str)] = &[
    ("0.0.0.0/8", "\"this network\""),
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("100.64.0.0/10", "carrier-grade NAT"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local and cloud metadata"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation"),
    ("192.88.99.0/24", "6to4 relay"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved and broadcast"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "IPv4-compatible (deprecated; ::a.b.c.d)"),
    ("64:ff9b::/96", "NAT64"),
    ("64:ff9b:1::/48", "local NAT64"),
    ("100::/64", "discard"),
    ("2001::/32", "Teredo"),
    ("2001:db8::/32", "documentation"),
    ("2002::/16", "6to4"),
    (
        "fc00::/7",
        "unique local (includes cloud metadata fd00:ec2::254)",
    ),
    ("fe80::/10", "link-local"),
    ("ff00::/8", "multicast"),
];

/// Why a destination is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} is {why}")]
pub struct Denial {
    /// The destination: the host, and the address when one was resolved.
    pub what: String,
    /// The rule that refused it.
    pub why: String,
    /// The `[access] allow` entry that would open it, when one would.
    pub allow: Option<String>,
}

/// The policy, built from `[access]` and tollgate's own listening addresses.
#[derive(Debug, Clone)]
pub struct Policy {
    allow: Vec<AccessRule>,
    deny: Vec<AccessRule>,
    built_in: Vec<(IpNet, &'static str)>,
    own: Vec<SocketAddr>,
}

impl Policy {
    /// The policy of `config`, refusing `own` (tollgate's listeners) as well.
    pub fn new(config: &AccessConfig, own: Vec<SocketAddr>) -> Policy {
        let built_in = BUILT_IN
            .iter()
            .map(|(net, what)| (net.parse().expect("the built-in ranges parse"), *what))
            .collect();
        Policy {
            allow: config.allow.clone(),
            deny: config.deny.clone(),
            built_in,
            own,
        }
    }

    /// A host (canonical) before it is resolved: refused when a `deny` host pattern
    /// names it. Addresses are judged by [`Policy::check_addr`].
    pub fn check_host(&self, host: &str) -> Result<(), Denial> {
        match self.deny.iter().find(|rule| names_host(rule, host)) {
            Some(rule) => Err(Denial {
                what: host.to_string(),
                why: format!("denied by [access] deny {:?}", rule.to_string()),
                allow: None,
            }),
            None => Ok(()),
        }
    }

    /// A destination before it waits in its group: its name against the `deny` host
    /// patterns, and a literal address as [`Policy::check_addr`] judges it. A name's
    /// addresses are judged when it is dialled.
    pub fn check_destination(&self, host: &str, port: u16) -> Result<(), Denial> {
        self.check_host(host)?;
        match crate::host::ip_of(host) {
            Some(ip) => self.check_addr(host, SocketAddr::new(ip, port)),
            None => Ok(()),
        }
    }

    /// One address `host` (canonical) resolved to, and the port to be dialled.
    pub fn check_addr(&self, host: &str, addr: SocketAddr) -> Result<(), Denial> {
        let ip = canonical_ip(addr.ip());
        let what = match crate::host::ip_of(host) {
            Some(_) => crate::host::from_ip(ip),
            None => format!("{host} ({})", crate::host::from_ip(ip)),
        };
        let refuse = |why: String, allow: Option<String>| {
            Err(Denial {
                what: what.clone(),
                why,
                allow,
            })
        };
        if let Some(rule) = self.deny.iter().find(|rule| matches(rule, host, ip)) {
            return refuse(
                format!("denied by [access] deny {:?}", rule.to_string()),
                None,
            );
        }
        if self.is_own(ip, addr.port()) {
            return refuse(
                format!("tollgate's own listening address (port {})", addr.port()),
                None,
            );
        }
        if self.allow.iter().any(|rule| matches(rule, host, ip)) {
            return Ok(());
        }
        if let Some((net, kind)) = self.built_in.iter().find(|(net, _)| net.contains(&ip)) {
            let allow = match crate::host::ip_of(host) {
                Some(_) => net.to_string(),
                None => host.to_string(),
            };
            return refuse(format!("not a public address ({kind}, {net})"), Some(allow));
        }
        Ok(())
    }

    /// Whether `ip:port` reaches one of tollgate's own listeners. A listener on every
    /// address (`0.0.0.0`, `[::]`) is reached through any address of this host: that is
    /// asked of the kernel (an address a socket can be bound to is local), and only for
    /// a destination on a listener's port.
    fn is_own(&self, ip: IpAddr, port: u16) -> bool {
        self.own.iter().any(|own| {
            own.port() == port
                && (canonical_ip(own.ip()) == ip
                    || (own.ip().is_unspecified()
                        && (ip.is_loopback() || ip.is_unspecified() || is_local(ip))))
        })
    }
}

/// Whether `ip` is an address of this host.
fn is_local(ip: IpAddr) -> bool {
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// `ip`, an IPv4-mapped IPv6 address as the IPv4 address it maps.
fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// Whether `rule` names `host` by pattern.
fn names_host(rule: &AccessRule, host: &str) -> bool {
    match rule {
        AccessRule::Host(HostPattern::Exact(exact)) => exact == host,
        AccessRule::Host(HostPattern::Suffix(suffix)) => host.ends_with(suffix.as_str()),
        AccessRule::Net(_) => false,
    }
}

/// Whether `rule` covers `host` at `ip`.
fn matches(rule: &AccessRule, host: &str, ip: IpAddr) -> bool {
    match rule {
        AccessRule::Net(net) => net.contains(&ip),
        AccessRule::Host(_) => names_host(rule, host),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn policy(access: &str, own: &[&str]) -> Policy {
        let config = Config::parse(&format!("[access]\n{access}\n"), "t.toml").unwrap();
        let own = own.iter().map(|a| a.parse().unwrap()).collect();
        Policy::new(&config.access, own)
    }

    /// Checks a literal address written any way a client may write it.
    fn check(p: &Policy, written: &str, port: u16) -> Result<(), Denial> {
        let host = crate::host::canonical(written).unwrap();
        let ip = crate::host::ip_of(&host).unwrap();
        p.check_host(&host)?;
        p.check_addr(&host, SocketAddr::new(ip, port))
    }

    #[test]
    fn every_built_in_range_is_refused_and_public_addresses_pass() {
        let p = policy("", &[]);
        let refused = [
            "0.0.0.0",
            "0",
            "10.1.2.3",
            "100.64.0.1",
            "127.0.0.1",
            "127.1",
            "2130706433",
            "0177.0.0.1",
            "[::ffff:127.0.0.1]",
            "169.254.169.254",
            "172.16.0.1",
            "172.31.255.255",
            "192.0.0.8",
            "192.0.2.1",
            "192.88.99.1",
            "192.168.1.1",
            "198.18.0.1",
            "198.51.100.1",
            "203.0.113.9",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "[::]",
            "[::1]",
            "[::127.0.0.1]",
            "[::8.8.8.8]",
            "[64:ff9b::7f00:1]",
            "[64:ff9b:1::1]",
            "[100::1]",
            "[2001::1]",
            "[2001:db8::1]",
            "[2002:7f00:1::]",
            "[fc00::1]",
            "[fd00:ec2::254]",
            "[fe80::1]",
            "[ff02::1]",
        ];
        for written in refused {
            let denial = check(&p, written, 80).expect_err(written);
            assert!(
                denial.why.starts_with("not a public address"),
                "{written}: {denial}"
            );
            assert!(denial.allow.is_some(), "{written}: says how to allow it");
        }
        for written in [
            "1.1.1.1",
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "[2606:4700::1111]",
        ] {
            assert_eq!(check(&p, written, 443), Ok(()), "{written}");
        }
    }

    #[test]
    fn allow_opens_deny_closes_and_deny_wins() {
        let p = policy(
            r#"allow = ["127.0.0.0/8", "10.20.0.0/16", "internal.example", "*.corp.example", "::1"]
               deny = ["127.0.0.9", "*.evil.example", "10.20.30.0/24"]"#,
            &[],
        );
        let ip = |s: &str| SocketAddr::new(s.parse().unwrap(), 80);
        // (host, address it resolved to, allowed?)
        let cases = [
            ("127.0.0.1", "127.0.0.1", true),
            ("[::1]", "::1", true),
            ("10.20.1.1", "10.20.1.1", true),
            ("10.20.30.1", "10.20.30.1", false),
            ("127.0.0.9", "127.0.0.9", false),
            ("internal.example", "192.168.7.7", true),
            ("db.corp.example", "172.16.0.5", true),
            ("other.example", "192.168.7.7", false),
            ("x.evil.example", "8.8.8.8", false),
            ("public.example", "8.8.8.8", true),
        ];
        for (host, addr, allowed) in cases {
            let got = p
                .check_host(host)
                .and_then(|()| p.check_addr(host, ip(addr)));
            assert_eq!(got.is_ok(), allowed, "{host} at {addr}: {got:?}");
        }
    }

    #[test]
    fn a_refusal_names_the_address_the_rule_and_the_allow_line() {
        let p = policy("", &[]);
        let denial = p
            .check_addr("metadata.internal", "169.254.169.254:80".parse().unwrap())
            .unwrap_err();
        assert_eq!(denial.what, "metadata.internal (169.254.169.254)");
        assert!(denial
            .why
            .contains("link-local and cloud metadata, 169.254.0.0/16"));
        assert_eq!(denial.allow.as_deref(), Some("metadata.internal"));
        let denial = check(&p, "10.9.8.7", 80).unwrap_err();
        assert_eq!(denial.allow.as_deref(), Some("10.0.0.0/8"));
    }

    #[test]
    fn tollgate_itself_is_refused_even_when_allowed() {
        let p = policy(
            r#"allow = ["127.0.0.0/8"]"#,
            &["127.0.0.1:8080", "0.0.0.0:9090"],
        );
        assert!(check(&p, "127.0.0.1", 8080).is_err());
        assert!(check(&p, "127.1", 8080).is_err());
        assert!(
            check(&p, "127.0.0.1", 9090).is_err(),
            "any loopback reaches 0.0.0.0"
        );
        assert!(
            check(&p, "127.0.0.1", 8081).is_ok(),
            "another port is another service"
        );
    }

    #[test]
    fn mapped_ipv6_ranges_in_the_file_are_their_ipv4_ranges() {
        let p = policy(r#"allow = ["::ffff:127.0.0.0/104"]"#, &[]);
        assert!(check(&p, "127.0.0.1", 80).is_ok());
        assert!(check(&p, "[::ffff:127.0.0.1]", 80).is_ok());
    }
}
