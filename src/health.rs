//! `tollgate health --url ...`: one bounded `GET` of the admin `/healthz`, so a container
//! image without curl can check itself (Docker's `HEALTHCHECK`, compose healthchecks).
//!
//! Plain HTTP/1.1 over a blocking socket: the admin listener speaks nothing else, and
//! a check that starts a runtime and a client would cost more than the proxy it checks.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Why a health check failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HealthError {
    /// The URL is not `http://host[:port][/path]`.
    #[error("not an http:// URL: {0}")]
    BadUrl(String),
    /// The host did not resolve, or refused, or the exchange failed or timed out.
    #[error("{0}")]
    Io(String),
    /// The answer was not an HTTP/1.x response.
    #[error("not an HTTP response: {0:?}")]
    BadResponse(String),
    /// It answered, but not 200.
    #[error("answered {0}")]
    Status(u16),
}

/// The parts of an `http://` URL a check needs.
#[derive(Debug, PartialEq, Eq)]
pub struct Target {
    /// Host as written (a name, an IPv4 address, or an IPv6 address in brackets).
    pub host: String,
    /// The port (80 when the URL has none).
    pub port: u16,
    /// Path and query, at least `/`.
    pub path: String,
}

/// Splits `url` into host, port and path; only `http://` (the admin listener has no TLS).
pub fn parse_url(url: &str) -> Result<Target, HealthError> {
    let bad = || HealthError::BadUrl(url.to_string());
    let rest = url.strip_prefix("http://").ok_or_else(bad)?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let (host, port) = match authority.rfind(':') {
        // A colon inside brackets belongs to an IPv6 address, not a port.
        Some(i) if !authority[i..].contains(']') => {
            let port = authority[i + 1..].parse().map_err(|_| bad())?;
            (&authority[..i], port)
        }
        _ => (authority, 80),
    };
    if host.is_empty() || host.contains('@') {
        return Err(bad());
    }
    Ok(Target {
        host: host.to_string(),
        port,
        path: path.to_string(),
    })
}

/// The status code of a response that begins with `head`.
pub fn parse_status(head: &[u8]) -> Result<u16, HealthError> {
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    match (words.next(), words.next()) {
        (Some(version), Some(code)) if version.starts_with("HTTP/1.") && code.len() == 3 => code
            .parse()
            .map_err(|_| HealthError::BadResponse(line.to_string())),
        _ => Err(HealthError::BadResponse(line.trim_end().to_string())),
    }
}

/// GETs `url` and succeeds on `200`; connecting, sending and reading the status line
/// all finish within `timeout` together.
pub fn check(url: &str, timeout: Duration) -> Result<(), HealthError> {
    let target = parse_url(url)?;
    let deadline = Instant::now() + timeout;
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| HealthError::Io(format!("no answer within {timeout:?}")))
    };
    let io = |e: std::io::Error| match e.kind() {
        // What a socket timeout looks like on Linux (EAGAIN) and elsewhere.
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            HealthError::Io(format!("no answer within {timeout:?}"))
        }
        _ => HealthError::Io(e.to_string()),
    };
    let host = target.host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = (host, target.port)
        .to_socket_addrs()
        .map_err(|e| HealthError::Io(format!("{}: {e}", target.host)))?
        .collect();
    let mut last = HealthError::Io(format!("{}: no address", target.host));
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, left()?) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = HealthError::Io(format!("{addr}: {e}")),
        }
    }
    let mut stream = stream.ok_or(last)?;
    stream.set_write_timeout(Some(left()?)).map_err(io)?;
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}:{}\r\nUser-Agent: tollgate-health\r\nConnection: close\r\n\r\n",
        target.path, target.host, target.port
    );
    stream.write_all(request.as_bytes()).map_err(io)?;
    let mut head = Vec::new();
    let mut buf = [0u8; 512];
    while !head.contains(&b'\n') && head.len() < 4096 {
        stream.set_read_timeout(Some(left()?)).map_err(io)?;
        match stream.read(&mut buf).map_err(io)? {
            0 => break,
            n => head.extend_from_slice(&buf[..n]),
        }
    }
    match parse_status(&head)? {
        200 => Ok(()),
        code => Err(HealthError::Status(code)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let t = |host: &str, port, path: &str| {
            Ok(Target {
                host: host.into(),
                port,
                path: path.into(),
            })
        };
        let table = [
            (
                "http://127.0.0.1:9090/healthz",
                t("127.0.0.1", 9090, "/healthz"),
            ),
            ("http://localhost/healthz", t("localhost", 80, "/healthz")),
            ("http://localhost:9090", t("localhost", 9090, "/")),
            (
                "http://[::1]:9090/healthz?x=1",
                t("[::1]", 9090, "/healthz?x=1"),
            ),
            ("http://[::1]/healthz", t("[::1]", 80, "/healthz")),
        ];
        for (url, want) in table {
            assert_eq!(parse_url(url), want, "{url}");
        }
        for url in [
            "https://127.0.0.1:9090/healthz",
            "127.0.0.1:9090",
            "http://",
            "http://:9090/",
            "http://host:99999/",
            "http://host:port/",
            "http://user@host/",
        ] {
            assert_eq!(
                parse_url(url),
                Err(HealthError::BadUrl(url.into())),
                "{url}"
            );
        }
    }

    #[test]
    fn status_lines() {
        assert_eq!(parse_status(b"HTTP/1.1 200 OK\r\n"), Ok(200));
        assert_eq!(
            parse_status(b"HTTP/1.0 503 Service Unavailable\r\nx"),
            Ok(503)
        );
        assert_eq!(parse_status(b"HTTP/1.1 404\r\n"), Ok(404));
        assert!(parse_status(b"").is_err());
        assert!(parse_status(b"SSH-2.0-OpenSSH\r\n").is_err());
        assert!(parse_status(b"HTTP/1.1 2000 OK\r\n").is_err());
        assert!(parse_status(b"HTTP/2 200\r\n").is_err());
    }
}
