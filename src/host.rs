//! One canonical identity per destination host.
//!
//! A host can be written many ways that reach one place: `API.Example.com.`,
//! `127.1`, `2130706433`, `0177.0.0.1`, `0x7f.1` and `[::ffff:127.0.0.1]`. Everything
//! that matches on a host (groups, the destination policy, the connection pool,
//! metrics) uses the form [`canonical`] gives, so no spelling escapes a limit or a
//! rule: lower case, no trailing dot, an IPv4 address in any form `inet_aton` (and so
//! `getaddrinfo`) accepts as dotted decimal, an IPv4-mapped IPv6 address as its IPv4
//! address, and any other IPv6 address compressed, in brackets.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The canonical form of `host` as it appears in a URI's authority (an IPv6 literal in
/// brackets). `None` when it cannot name a host (empty, or brackets around something
/// that is not an IPv6 address).
pub fn canonical(host: &str) -> Option<String> {
    if let Some(inner) = host.strip_prefix('[') {
        let ip: Ipv6Addr = inner.strip_suffix(']')?.parse().ok()?;
        return Some(from_ip(IpAddr::V6(ip)));
    }
    let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    if name.is_empty() || name.contains(['[', ']', '@', '/', ' ']) {
        return None;
    }
    Some(match ipv4(&name) {
        Some(ip) => ip.to_string(),
        None => name,
    })
}

/// The canonical form of an address, as [`canonical`] writes it.
pub fn from_ip(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => format!("[{v6}]"),
        },
    }
}

/// The address a canonical host names, if it is an address literal.
pub fn ip_of(canonical: &str) -> Option<IpAddr> {
    let bare = canonical
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(canonical);
    bare.parse().ok()
}

/// `text` read as `inet_aton` reads an IPv4 address: one to four parts separated by
/// dots, each decimal, octal (a leading `0`) or hexadecimal (`0x`); the last part fills
/// the bytes the others leave (`127.1` is 127.0.0.1, `2130706433` is 127.0.0.1).
fn ipv4(text: &str) -> Option<Ipv4Addr> {
    let parts: Vec<u64> = text.split('.').map(number).collect::<Option<_>>()?;
    let (last, leading) = parts.split_last()?;
    if leading.len() > 3 || leading.iter().any(|p| *p > 0xff) {
        return None;
    }
    let last_bits = 8 * (4 - leading.len() as u32);
    if *last >= 1u64 << last_bits {
        return None;
    }
    let high = leading
        .iter()
        .enumerate()
        .fold(0u64, |acc, (i, p)| acc | p << (24 - 8 * i));
    Some(Ipv4Addr::from((high | last) as u32))
}

/// One part of an `inet_aton` address.
fn number(part: &str) -> Option<u64> {
    let (digits, radix) = match part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
        Some(hex) => (hex, 16),
        None if part.len() > 1 && part.starts_with('0') => (&part[1..], 8),
        None => (part, 10),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    // Any number of leading zeros, as glibc reads them; what is left must fit.
    let significant = digits.trim_start_matches('0');
    if significant.len() > 12 {
        return None;
    }
    u64::from_str_radix(
        if significant.is_empty() {
            "0"
        } else {
            significant
        },
        radix,
    )
    .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_of_one_place_is_one_host() {
        let cases = [
            ("127.0.0.1", "127.0.0.1"),
            ("127.1", "127.0.0.1"),
            ("127.0.1", "127.0.0.1"),
            ("2130706433", "127.0.0.1"),
            ("0177.0.0.1", "127.0.0.1"),
            ("0x7f.1", "127.0.0.1"),
            ("0X7F.0.0.01", "127.0.0.1"),
            ("0x7f000001", "127.0.0.1"),
            ("017700000001", "127.0.0.1"),
            ("0x000000000000007f.1", "127.0.0.1"),
            ("00000000000000177.0.0.1", "127.0.0.1"),
            ("127.0.0.1.", "127.0.0.1"),
            ("[::ffff:127.0.0.1]", "127.0.0.1"),
            ("[::FFFF:7f00:1]", "127.0.0.1"),
            ("[0:0:0:0:0:ffff:a9fe:a9fe]", "169.254.169.254"),
            ("0", "0.0.0.0"),
            ("[::1]", "[::1]"),
            ("[0:0::1]", "[::1]"),
            ("[FD00:EC2::254]", "[fd00:ec2::254]"),
            ("API.GitHub.com", "api.github.com"),
            ("api.github.com.", "api.github.com"),
            ("localhost", "localhost"),
        ];
        for (written, want) in cases {
            assert_eq!(canonical(written).as_deref(), Some(want), "{written}");
        }
    }

    #[test]
    fn names_that_only_look_numeric_stay_names() {
        for name in [
            "256.0.0.1",
            "1.2.3.4.5",
            "1.2.3.256",
            "1.2.65536",
            "4294967296",
            "08.0.0.1",
            "0x.1",
            "1..2",
            "1.2.3.4.example",
            "123.example.com",
        ] {
            assert_eq!(canonical(name).as_deref(), Some(name), "{name}");
        }
    }

    #[test]
    fn what_cannot_name_a_host_is_refused() {
        for bad in [
            "",
            ".",
            "[::1",
            "[127.0.0.1]",
            "[nothing]",
            "a b",
            "user@host",
        ] {
            assert_eq!(canonical(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn addresses_round_trip() {
        for text in ["127.0.0.1", "[::1]", "[fd00::1]"] {
            let ip = ip_of(text).unwrap();
            assert_eq!(from_ip(ip), text);
        }
        assert_eq!(ip_of("api.github.com"), None);
    }
}
