//! The headers of a message on its way upstream and back: hop-by-hop headers dropped,
//! `Via` added, `Host` set, and a response head that cannot be passed on.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, Scheme};
use http::{StatusCode, Uri, Version};

use crate::access::PROXY_NAME;

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

/// Why a request's framing cannot be passed on, if it cannot (RFC 9112 §6): a
/// `Transfer-Encoding` other than `chunked` alone (the request is sent on re-framed,
/// so a coding before `chunked` would be lost, and `identity` is no coding at all), or a
/// `Content-Length` that is not a number. Either would mean one message to tollgate and
/// another to a server that reads it differently.
pub fn malformed_request(headers: &HeaderMap) -> Option<&'static str> {
    let codings: Vec<&[u8]> = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|c| !c.is_empty())
        .collect();
    if !codings.is_empty()
        && !matches!(&codings[..], [only] if only.eq_ignore_ascii_case(b"chunked"))
    {
        return Some("a Transfer-Encoding other than chunked");
    }
    let number = |v: &[u8]| !v.is_empty() && v.iter().all(u8::is_ascii_digit);
    let lengths = headers.get_all(header::CONTENT_LENGTH);
    if !lengths
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .all(|v| number(v.trim_ascii()))
    {
        return Some("a Content-Length that is not a number");
    }
    None
}
