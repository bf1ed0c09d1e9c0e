//! Every failure becomes a response: the right status, a `Proxy-Status: tollgate;
//! error=<type>` header (RFC 9209) and a plain-text body saying what happened.

use std::time::{Duration, Instant};

use crate::support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Checks a curl response against the expected error.
fn assert_curl_error(out: &CurlOutput, status: u16, error: &str) -> String {
    assert!(out.status != 0, "no response; curl said: {}", out.stderr);
    assert_proxy_error(
        out.status,
        out.header("content-type").as_deref(),
        out.header("proxy-status").as_deref(),
        &out.text(),
        status,
        error,
    );
    out.text()
}

/// Checks a raw response against the expected error.
fn assert_raw_error(resp: &RawResponse, status: u16, error: &str) -> String {
    assert_proxy_error(
        resp.status,
        resp.header("content-type"),
        resp.header("proxy-status"),
        &resp.text(),
        status,
        error,
    );
    resp.text()
}

#[tokio::test]
async fn connection_refused() {
    let closed_port = ClosedPort::new();
    let closed = closed_port.addr();
    let proxy = start_proxy("[proxy]\nconnect_ports = [\"*\"]\n").await;

    let out = curl(&["-x", &proxy.url(), &format!("http://{closed}/x")], &[]).await;
    let body = assert_curl_error(&out, 502, "connection_refused");
    assert!(body.contains(&closed.to_string()), "{body}");
    assert!(
        out.header("proxy-status")
            .unwrap()
            .contains(&format!("details=\"connection refused by {closed}")),
        "{}",
        out.final_head()
    );

    // The same through CONNECT: the proxy dials before answering, so the client gets the
    // error instead of a 200 followed by a closed socket.
    let connect = format!("CONNECT {closed} HTTP/1.1\r\nHost: {closed}\r\n\r\n");
    let resp = raw_request(proxy.addr, connect.as_bytes()).await;
    assert_raw_error(&resp, 502, "connection_refused");

    // Python sees it as an HTTPError carrying the same header.
    let script = format!(
        r#"
import urllib.request, urllib.error
try:
    urllib.request.urlopen("http://{closed}/py", timeout=20)
except urllib.error.HTTPError as e:
    print(e.code, e.headers["Proxy-Status"].split(";")[1].strip())
"#
    );
    let py = python(&script, &[("http_proxy", &proxy.url())]).await;
    assert_eq!(py.stdout, "502 error=connection_refused\n", "{}", py.stderr);
    proxy.shutdown().await;
}

#[tokio::test]
async fn dns_failure() {
    let proxy = start_proxy("[proxy]\nconnect_timeout = \"10s\"\n").await;
    // `.invalid` never resolves (RFC 6761).
    let out = curl(&["-x", &proxy.url(), "http://no-such-host.invalid/x"], &[]).await;
    let body = assert_curl_error(&out, 502, "dns_error");
    assert!(body.contains("no-such-host.invalid"), "{body}");
    proxy.shutdown().await;
}

#[tokio::test]
async fn connect_timeout_covers_the_tls_handshake() {
    // TCP is accepted but the TLS handshake never completes.
    let silent = Silent::start().await;
    let proxy = start_proxy(&format!(
        "[proxy]\nconnect_timeout = \"500ms\"\n\
         [[route]]\nprefix = \"/stuck/\"\nupstream = \"https://{}\"\n",
        silent.addr()
    ))
    .await;
    let started = Instant::now();
    let out = curl(&[&format!("{}/stuck/x", proxy.url())], &[]).await;
    let elapsed = started.elapsed();
    let body = assert_curl_error(&out, 504, "connection_timeout");
    assert!(body.contains(&silent.addr().to_string()), "{body}");
    assert!(body.contains("500ms"), "{body}");
    // Generous: only proves the timeout fired rather than curl's own 30 s limit.
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    assert_eq!(silent.connections(), 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn response_timeout() {
    // Accepts and reads the request, never answers.
    let silent = Silent::start().await;
    let proxy = start_proxy("[proxy]\nresponse_timeout = \"500ms\"\n").await;
    let started = Instant::now();
    let out = curl(
        &[
            "-x",
            &proxy.url(),
            &format!("http://{}/slow", silent.addr()),
        ],
        &[],
    )
    .await;
    let elapsed = started.elapsed();
    let body = assert_curl_error(&out, 504, "http_response_timeout");
    assert!(body.contains(&silent.addr().to_string()), "{body}");
    // Never before the timeout; the upper bound is loose (it fires up to a tick late,
    // and this machine may be busy).
    assert!(
        elapsed >= Duration::from_millis(500) && elapsed < Duration::from_secs(10),
        "{elapsed:?}"
    );
    assert_eq!(silent.connections(), 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn untrusted_upstream_certificate() {
    let ca = TestCa::new();
    let upstream = Upstream::start_tls(|_| Reply::ok("never"), &ca).await;
    // No ca_file: the test CA is not among the public web roots.
    let proxy = start_proxy(&format!(
        "[[route]]\nprefix = \"/tls/\"\nupstream = \"{}\"\n",
        upstream.url("")
    ))
    .await;
    let out = curl(&[&format!("{}/tls/x", proxy.url())], &[]).await;
    let body = assert_curl_error(&out, 502, "tls_certificate_error");
    assert!(body.contains(&upstream.authority()), "{body}");
    assert!(
        body.contains("[proxy] ca_file"),
        "says how to trust it: {body}"
    );
    assert!(upstream.requests().is_empty());
    assert!(upstream.connections() >= 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn no_route_lists_the_routes() {
    let upstream = Upstream::echo().await;
    let proxy = start_proxy(&format!(
        "[[route]]\nprefix = \"/a/\"\nupstream = \"{}\"\n\
         [[route]]\nprefix = \"/b\"\nupstream = \"https://b.example/v1\"\n",
        upstream.url("/base")
    ))
    .await;
    let out = curl(&[&format!("{}/nope?x=1", proxy.url())], &[]).await;
    let body = assert_curl_error(&out, 404, "destination_not_found");
    assert!(body.contains("/nope"), "{body}");
    assert!(
        body.contains(&format!("/a/ -> {}", upstream.url("/base"))),
        "{body}"
    );
    assert!(body.contains("/b/ -> https://b.example/v1"), "{body}");
    // `/ab` must not match the `/a/` prefix.
    let out = curl(&[&format!("{}/ab", proxy.url())], &[]).await;
    assert_curl_error(&out, 404, "destination_not_found");
    assert!(upstream.requests().is_empty());
    proxy.shutdown().await;

    let bare = start_proxy("").await;
    let out = curl(&[&format!("{}/", bare.url())], &[]).await;
    let body = assert_curl_error(&out, 404, "destination_not_found");
    assert!(body.contains("no routes are configured"), "{body}");
    bare.shutdown().await;
}

#[tokio::test]
async fn connect_with_malformed_authority_dials_nothing() {
    let silent = Silent::start().await;
    let addr = silent.addr();
    let proxy = start_proxy("[proxy]\nconnect_ports = [\"*\"]\n").await;
    let targets = [
        format!("{}", addr.ip()),       // no port
        format!("{}:", addr.ip()),      // empty port
        format!("{}:0", addr.ip()),     // port 0
        format!("user@{addr}"),         // credentials
        format!("http://{addr}"),       // a URL, not host:port
        format!("{}:99999", addr.ip()), // port out of range
        format!(":{}", addr.port()),    // no host
    ];
    for target in &targets {
        let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
        let resp = raw_request(proxy.addr, request.as_bytes()).await;
        let status = resp.status;
        assert_eq!(status, 400, "CONNECT {target}: {}", resp.text());
        assert_raw_error(&resp, 400, "http_request_error");
    }
    // A tunnel is dialled before it is answered, so a dial would already be queued on
    // the listener. A connection of our own is a barrier: the listener accepts in order,
    // so once ours is counted, a dial from the proxy would have been counted too.
    let _barrier = tokio::net::TcpStream::connect(addr).await.unwrap();
    eventually(|| (silent.connections() > 0).then_some(())).await;
    assert_eq!(
        silent.connections(),
        1,
        "the proxy dialled a malformed target"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn connect_to_a_port_not_allowed() {
    let ca = TestCa::new();
    let upstream = Upstream::start_tls(|_| Reply::ok("never"), &ca).await;
    // Default connect_ports = [443]; the upstream's random port is not in it.
    let proxy = start_proxy("").await;
    let out = curl(
        &[
            "--cacert",
            ca.ca_pem_path().to_str().unwrap(),
            &upstream.url("/x"),
        ],
        &[("https_proxy", &proxy.url())],
    )
    .await;
    assert_ne!(out.code, 0, "curl should fail: {}", out.stderr);
    assert_eq!(out.status, 403, "{}", out.headers);
    assert!(
        out.header("proxy-status")
            .unwrap()
            .starts_with("tollgate; error=http_request_denied"),
        "{}",
        out.headers
    );
    let authority = upstream.authority();
    let request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    let resp = raw_request(proxy.addr, request.as_bytes()).await;
    let body = assert_raw_error(&resp, 403, "http_request_denied");
    assert!(body.contains(&upstream.addr().port().to_string()), "{body}");
    assert!(body.contains("connect_ports"), "{body}");
    assert_eq!(upstream.connections(), 0);
    proxy.shutdown().await;
}

#[tokio::test]
async fn unsupported_scheme() {
    let proxy = start_proxy("").await;
    // curl sends ftp:// URLs to an HTTP proxy as `GET ftp://...`.
    let out = curl(&["-x", &proxy.url(), "ftp://127.0.0.1:1/file"], &[]).await;
    let body = assert_curl_error(&out, 400, "http_request_error");
    assert!(body.contains("ftp"), "{body}");
    proxy.shutdown().await;
}

#[tokio::test]
async fn upstream_speaking_garbage() {
    // Answers every connection with something that is not HTTP, then closes.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let garbage = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf).await;
            let _ = stream.write_all(b"SSH-2.0-OpenSSH_9.0\r\n\r\n").await;
        }
    });
    let proxy = start_proxy("").await;
    let out = curl(&["-x", &proxy.url(), &format!("http://{addr}/x")], &[]).await;
    let body = assert_curl_error(&out, 502, "http_protocol_error");
    assert!(body.contains(&addr.to_string()), "{body}");
    proxy.shutdown().await;
    garbage.abort();
}

/// A request framed in a form servers read differently (`Transfer-Encoding` other than
/// `chunked` alone, a `Content-Length` that is not a number) is refused with a `400`,
/// never sent upstream.
#[tokio::test]
async fn requests_framed_in_odd_forms_are_refused_and_never_sent() {
    let upstream = Upstream::start(|_| Reply::ok("reached")).await;
    let proxy = start_proxy("[proxy]\n").await;
    let url = upstream.url("/x");
    for (framing, body) in [
        (
            "Transfer-Encoding: identity, chunked",
            "5\r\nhello\r\n0\r\n\r\n",
        ),
        (
            "Transfer-Encoding: gzip, chunked",
            "5\r\nhello\r\n0\r\n\r\n",
        ),
        ("Content-Length: +5", "hello"),
    ] {
        let request = format!(
            "POST {url} HTTP/1.1\r\nHost: x\r\n{framing}\r\nConnection: close\r\n\r\n{body}"
        );
        let response = raw_request(proxy.addr, request.as_bytes()).await;
        assert_eq!(response.status, 400, "{framing}: {}", response.text());
    }
    assert_eq!(upstream.connections(), 0, "nothing was sent upstream");
    // The plain forms pass.
    let request = format!(
        "POST {url} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    );
    let response = raw_request(proxy.addr, request.as_bytes()).await;
    assert_eq!(
        (response.status, response.text()),
        (200, "reached".to_string())
    );
    assert_eq!(upstream.requests().len(), 1);
    proxy.shutdown().await;
}
