//! Gateway `[[route]]`s: origin-form requests to tollgate itself, rewritten to the
//! route's upstream (base path, query string, Host), over plain HTTP and over TLS.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn base_path_query_and_longest_prefix() {
    let api = Upstream::start(|seen| Reply::ok(format!("api {}", seen.path))).await;
    let v2 = Upstream::start(|seen| Reply::ok(format!("v2 {}", seen.path))).await;
    let proxy = start_proxy(&format!(
        "[[route]]\nprefix = \"/api/\"\nupstream = \"{}\"\n\
         [[route]]\nprefix = \"/api/v2\"\nupstream = \"{}\"\n",
        api.url("/base/v1/"),
        v2.url(""),
    ))
    .await;
    let base = proxy.url();

    let out = curl(&[&format!("{base}/api/things/x?a=1&b=%20two&c")], &[]).await;
    assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);
    assert_eq!(out.text(), "api /base/v1/things/x?a=1&b=%20two&c");
    assert_eq!(out.header("via").as_deref(), Some("1.1 tollgate"));
    // The bare prefix without its trailing slash is the route's root.
    let out = curl(&[&format!("{base}/api")], &[]).await;
    assert_eq!(out.text(), "api /base/v1/");
    // The longer prefix wins, though the shorter one also matches.
    let out = curl(&[&format!("{base}/api/v2/y?z=1")], &[]).await;
    assert_eq!(out.text(), "v2 /y?z=1");
    // A POST body goes along unchanged.
    let resp = reqwest_direct()
        .post(format!("{base}/api/upload"))
        .body("route body")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    let seen = api.requests();
    let paths: Vec<_> = seen.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/base/v1/things/x?a=1&b=%20two&c",
            "/base/v1/",
            "/base/v1/upload"
        ]
    );
    for s in &seen {
        // Host names the upstream, not tollgate, or virtual hosting breaks.
        assert_eq!(s.header("host"), Some(api.authority().as_str()));
        assert_eq!(s.header("via"), Some("1.1 tollgate"));
    }
    assert_eq!(seen[2].method, "POST");
    assert_eq!(&seen[2].body[..], b"route body");
    let seen = v2.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path, "/y?z=1");
    assert_eq!(seen[0].header("host"), Some(v2.authority().as_str()));
    proxy.shutdown().await;
}

#[tokio::test]
async fn http2_clients_with_prior_knowledge_are_served_over_http2() {
    let api = Upstream::start(|seen| Reply::ok(format!("api {} {}", seen.method, seen.path))).await;
    let proxy = start_proxy(&format!(
        "[[route]]\nprefix = \"/api/\"\nupstream = \"{}\"\n",
        api.url("/v1/"),
    ))
    .await;
    let base = proxy.url();

    // curl with prior knowledge (one request: curl 7.88 cannot reuse such a connection,
    // curl/curl#10634), then reqwest, which keeps one HTTP/2 connection for both of its
    // requests, then HTTP/1.1 to the same listener: the version is told apart by each
    // connection's first bytes.
    let out = curl(&["--http2-prior-knowledge", &format!("{base}/api/a")], &[]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.text(), "api GET /v1/a");
    assert!(out.headers.starts_with("HTTP/2 200"), "{}", out.headers);
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for (method, path) in [("GET", "b"), ("POST", "c")] {
        let resp = h2
            .request(method.parse().unwrap(), format!("{base}/api/{path}"))
            .body("h2 body")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.version(), reqwest::Version::HTTP_2);
        assert_eq!(
            resp.text().await.unwrap(),
            format!("api {method} /v1/{path}")
        );
    }
    let out = curl(&["--http1.1", &format!("{base}/api/d")], &[]).await;
    assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);
    assert!(out.headers.starts_with("HTTP/1.1 200"), "{}", out.headers);

    let seen = api.requests();
    let got: Vec<_> = seen
        .iter()
        .map(|s| (s.method.as_str(), s.path.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            ("GET", "/v1/a"),
            ("GET", "/v1/b"),
            ("POST", "/v1/c"),
            ("GET", "/v1/d")
        ]
    );
    assert_eq!(&seen[2].body[..], b"h2 body");
    // HTTP/2 clients send no `Host`; the HTTP/1.1 upstream gets one all the same.
    for s in &seen {
        assert_eq!(s.version, http::Version::HTTP_11);
        assert_eq!(s.header("host"), Some(api.authority().as_str()));
    }
    proxy.shutdown().await;
}

/// An HTTPS upstream that speaks HTTP/1.1 only: one pooled TLS connection carries
/// request after request, small and big, in both directions.
#[tokio::test]
async fn https_http1_upstream_carries_many_requests_on_one_connection() {
    let ca = TestCa::new();
    let upstream = Upstream::start_tls_http1(
        |seen| match seen.path.as_str() {
            "/big" => Reply::ok(vec![b'd'; 300 * 1024]),
            path => Reply::ok(format!("{path} {}", seen.body.len())),
        },
        &ca,
    )
    .await;
    let proxy = secure_route(&ca, upstream.addr().port(), "/").await;

    // One client connection, requests one after the other, as an API client does.
    let script = format!(
        r#"
import http.client
conn = http.client.HTTPConnection("127.0.0.1", {port}, timeout=20)
for i in range(20):
    conn.request("GET", "/secure/n%d" % i)
    print(conn.getresponse().read().decode())
conn.request("GET", "/secure/big")
big = conn.getresponse().read()
print(len(big), big == b"d" * len(big))
conn.request("POST", "/secure/up", body=b"u" * 100000)
print(conn.getresponse().read().decode())
"#,
        port = proxy.addr.port()
    );
    let py = python(&script, &[]).await;
    let mut expected: Vec<String> = (0..20).map(|i| format!("/n{i} 0")).collect();
    expected.push(format!("{} True", 300 * 1024));
    expected.push("/up 100000".into());
    assert_eq!(py.stdout, expected.join("\n") + "\n", "{}", py.stderr);

    let seen = upstream.requests();
    let paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
    let mut sent: Vec<String> = (0..20).map(|i| format!("/n{i}")).collect();
    sent.extend(["/big".to_string(), "/up".to_string()]);
    assert_eq!(paths, sent);
    assert!(seen.iter().all(|s| s.version == http::Version::HTTP_11));
    // Over HTTP/1.1 the upstream is named by `Host`.
    let host = format!("localhost:{}", upstream.addr().port());
    assert!(seen.iter().all(|s| s.header("host") == Some(host.as_str())));
    assert_eq!(&seen[21].body[..], &[b'u'; 100000][..]);
    assert_eq!(
        upstream.connections(),
        1,
        "every request reused the first connection"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn https_upstream_trusted_by_ca_file() {
    let ca = TestCa::new();
    let upstream = Upstream::start_tls(
        |seen| Reply::ok(format!("{} {}", seen.path, seen.body.len())).header("x-up", "tls"),
        &ca,
    )
    .await;
    let proxy = secure_route(&ca, upstream.addr().port(), "/v3").await;

    let get = curl(&[&format!("{}/secure/hello?q=1", proxy.url())], &[]).await;
    assert_eq!((get.code, get.status), (0, 200), "{}", get.stderr);
    assert_eq!(get.text(), "/v3/hello?q=1 0");
    assert_eq!(get.header("x-up").as_deref(), Some("tls"));
    let script = format!(
        r#"
import urllib.request
req = urllib.request.Request("{}/secure/post", data=b"0123456789", method="POST")
print(urllib.request.urlopen(req, timeout=20).read().decode())
"#,
        proxy.url()
    );
    let py = python(&script, &[]).await;
    assert_eq!(py.stdout, "/v3/post 10\n", "{}", py.stderr);

    let seen = upstream.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("GET", "/v3/hello?q=1")
    );
    assert_eq!(
        (seen[1].method.as_str(), &seen[1].body[..]),
        ("POST", &b"0123456789"[..])
    );
    for s in &seen {
        // tollgate offered h2 by ALPN and the upstream took it.
        assert_eq!(s.version, http::Version::HTTP_2);
        // Over HTTP/2 the upstream is named by `:authority` alone, not `Host`
        // (tests/upstream_h2.rs checks the authority against nginx).
        assert_eq!(s.header("host"), None);
        assert_eq!(s.header("via"), Some("1.1 tollgate"));
    }
    // Both requests shared one pooled h2 connection.
    assert_eq!(upstream.connections(), 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn absolute_form_to_tollgate_itself_is_routed_not_looped() {
    let upstream = Upstream::echo().await;
    let proxy = start_proxy(&format!(
        "[[route]]\nprefix = \"/r/\"\nupstream = \"{}\"\n",
        upstream.url("")
    ))
    .await;
    // A client told to use tollgate as its proxy for a URL on tollgate itself.
    let out = curl(
        &["-x", &proxy.url(), &format!("{}/r/self?x", proxy.url())],
        &[],
    )
    .await;
    assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);
    let seen = upstream.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path, "/self?x");
    assert_eq!(seen[0].header("host"), Some(upstream.authority().as_str()));
    // Exactly one hop: it did not go through tollgate twice.
    assert_eq!(seen[0].headers.get_all("via").iter().count(), 1);
    proxy.shutdown().await;
}

/// An HTTPS upstream (HTTP/1.1 only) that answers one request per connection and then
/// closes it without `Connection: close`: with a TLS `close_notify` first when `notify`,
/// or by dropping the TCP connection. Returns its address and counts of the connections
/// it accepted and the requests it answered.
async fn closing_tls_upstream(
    ca: &TestCa,
    notify: bool,
) -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(ca.server_config_http1()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (connections, requests) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let counts = (connections.clone(), requests.clone());
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            counts.0.fetch_add(1, Ordering::SeqCst);
            let (acceptor, requests) = (acceptor.clone(), counts.1.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(socket).await else {
                    return;
                };
                let mut head = Vec::new();
                let mut chunk = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                requests.fetch_add(1, Ordering::SeqCst);
                let reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                if tls.write_all(reply).await.is_ok() && notify {
                    let _ = tls.shutdown().await;
                }
            });
        }
    });
    (addr, connections, requests)
}

/// A pooled TLS connection the upstream has closed is noticed while it sits idle and is
/// not handed out again; no request reaches the upstream twice. Both ways of closing:
/// with `close_notify`, and by dropping the TCP connection.
#[tokio::test]
async fn an_https_upstream_that_closes_after_each_response_gets_each_request_once() {
    for notify in [true, false] {
        let ca = TestCa::new();
        let (addr, connections, requests) = closing_tls_upstream(&ca, notify).await;
        let proxy = secure_route(&ca, addr.port(), "/").await;
        let client = reqwest_direct();
        for i in 0..10 {
            let resp = client
                .get(format!("{}/secure/{i}", proxy.url()))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "request {i}, close_notify {notify}");
            assert_eq!(resp.text().await.unwrap(), "ok");
            // The close arrives before the next request, as in real life.
            wait_connections_closed(addr).await;
        }
        assert_eq!(requests.load(Ordering::SeqCst), 10, "close_notify {notify}");
        assert_eq!(
            connections.load(Ordering::SeqCst),
            10,
            "close_notify {notify}"
        );
        proxy.shutdown().await;
    }
}

/// tollgate with one route, `/secure/` to `https://localhost:<port><base>`, trusting
/// `ca` (by name, so the certificate is checked against `localhost`: SNI and SAN).
async fn secure_route(ca: &TestCa, port: u16, base: &str) -> Proxy {
    start_proxy(&format!(
        "[proxy]\nca_file = {:?}\n\
         [[route]]\nprefix = \"/secure/\"\nupstream = \"https://localhost:{port}{base}\"\n",
        ca.ca_pem_path().to_str().unwrap(),
    ))
    .await
}
