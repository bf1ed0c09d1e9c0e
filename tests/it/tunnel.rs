//! CONNECT tunnels (apps using `HTTPS_PROXY`): curl, Python's urllib and reqwest reach
//! a TLS upstream with the test CA through tollgate, which only copies bytes.

use crate::support::*;

/// Test upstreams listen on random ports, so tunnels must be allowed to any port.
const ANY_PORT: &str = "[proxy]\nconnect_ports = [\"*\"]\n";

#[tokio::test]
async fn curl_through_https_proxy_env() {
    let ca = TestCa::new();
    let upstream = Upstream::start_tls(
        |seen| Reply::ok(format!("{} {} {:?}", seen.method, seen.path, seen.body)),
        &ca,
    )
    .await;
    let proxy = start_proxy(ANY_PORT).await;
    let cacert = ca.ca_pem_path();
    let cacert = cacert.to_str().unwrap();
    let env = [("https_proxy", proxy.url())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();

    let get = curl(&["--cacert", cacert, &upstream.url("/t?x=1")], &env).await;
    assert_eq!((get.code, get.status), (0, 200), "{}", get.stderr);
    assert_eq!(get.text(), "GET /t?x=1 b\"\"");
    // curl's -D output starts with the proxy's answer to CONNECT.
    assert!(get.headers.starts_with("HTTP/1.1 200"), "{}", get.headers);
    // The tunnel is opaque: tollgate adds no Via inside it.
    assert!(get.header("via").is_none(), "{}", get.final_head());

    // localhost is resolved by the proxy, and the certificate is checked against it.
    let localhost_url = format!("https://localhost:{}/named", upstream.addr().port());
    let post = curl(
        &[
            "--cacert",
            cacert,
            "--data-binary",
            "tunnelled",
            &localhost_url,
        ],
        &env,
    )
    .await;
    assert_eq!((post.code, post.status), (0, 200), "{}", post.stderr);

    let seen = upstream.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("GET", "/t?x=1")
    );
    // curl negotiated h2 with the upstream itself, end to end through the tunnel.
    assert_eq!(seen[0].version, http::Version::HTTP_2);
    assert!(seen[0].header("via").is_none());
    assert!(seen[0].header("user-agent").unwrap().starts_with("curl/"));
    assert_eq!(
        (seen[1].method.as_str(), seen[1].path.as_str()),
        ("POST", "/named")
    );
    assert_eq!(&seen[1].body[..], b"tunnelled");
    // One tunnel, hence one upstream connection, per curl run.
    assert_eq!(upstream.connections(), 2);
    proxy.shutdown().await;
}

#[tokio::test]
async fn python_urllib_through_https_proxy_env() {
    let ca = TestCa::new();
    let upstream = Upstream::start_tls(|seen| Reply::ok(seen.body.clone()), &ca).await;
    let proxy = start_proxy(ANY_PORT).await;
    let script = format!(
        r#"
import ssl, urllib.request
ctx = ssl.create_default_context(cafile={cafile:?})
req = urllib.request.Request("{url}", data=b"secret body", method="POST")
r = urllib.request.urlopen(req, context=ctx, timeout=20)
print(r.status, r.read().decode(), r.headers.get("Via"))
"#,
        cafile = ca.ca_pem_path().to_str().unwrap(),
        url = upstream.url("/py/tls?k=v"),
    );
    let out = python(&script, &[("https_proxy", &proxy.url())]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "200 secret body None\n");

    let seen = upstream.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "POST");
    assert_eq!(seen[0].path, "/py/tls?k=v");
    assert_eq!(seen[0].version, http::Version::HTTP_11);
    assert_eq!(&seen[0].body[..], b"secret body");
    assert_eq!(seen[0].header("host"), Some(upstream.authority().as_str()));
    assert!(seen[0].header("via").is_none());
    proxy.shutdown().await;
}

#[tokio::test]
async fn reqwest_keeps_one_tunnel_for_many_requests() {
    let ca = TestCa::new();
    let upstream = Upstream::start_tls(|seen| Reply::ok(seen.path.clone()), &ca).await;
    let proxy = start_proxy(ANY_PORT).await;
    let client = reqwest_via(&proxy, Some(&ca));
    for i in 0..20 {
        let resp = client
            .get(upstream.url(&format!("/{i}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.text().await.unwrap(), format!("/{i}"));
    }
    let seen = upstream.requests();
    assert_eq!(seen.len(), 20);
    assert!(seen
        .iter()
        .all(|s| s.conn == 0 && s.header("via").is_none()));
    assert_eq!(upstream.connections(), 1);
    // The idle tunnel stays open while the client lives, and shutdown would wait for it.
    drop(client);
    proxy.shutdown().await;
}

#[tokio::test]
async fn curl_proxytunnel_to_plain_http() {
    // A tunnel carries any bytes, not only TLS: curl -p sends plain HTTP through it.
    let upstream = Upstream::echo().await;
    let proxy = start_proxy(ANY_PORT).await;
    let out = curl(
        &[
            "-p",
            "-x",
            &proxy.url(),
            "--data-binary",
            "raw bytes",
            &upstream.url("/plain"),
        ],
        &[],
    )
    .await;
    assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);
    assert_eq!(out.text(), "raw bytes");
    let seen = upstream.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("POST", "/plain")
    );
    // Inside a tunnel tollgate neither adds Via nor sees headers to strip.
    assert!(seen[0].header("via").is_none());
    proxy.shutdown().await;
}

#[tokio::test]
async fn an_http2_tunnel_outlives_the_idle_close() {
    // HTTP/2 connections with no request open are closed after client_header_timeout;
    // a CONNECT stream is open for as long as its tunnel, long after its `200`.

    let upstream = Upstream::start(|seen| Reply::ok(format!("saw {}", seen.path))).await;
    let proxy =
        start_proxy("[proxy]\nconnect_ports = [\"*\"]\nclient_header_timeout = \"300ms\"\n").await;
    let mut tunnel = h2_connect(&proxy, &upstream.authority()).await;

    // Plain HTTP/1.1 through the tunnel, before and after three idle timeouts.
    let mut answers = Vec::new();
    for path in ["/before", "/after"] {
        if path == "/after" {
            // Idle for three client_header_timeouts, which the tunnel must outlive.
            tokio::time::sleep(std::time::Duration::from_millis(900)).await;
        }
        answers.push(get_through_tunnel(&mut tunnel, &upstream.authority(), path).await);
    }
    assert!(answers[0].starts_with("HTTP/1.1 200"), "{answers:?}");
    // One tunnel: both requests came on one upstream connection.
    let seen = upstream.requests();
    let got: Vec<_> = seen.iter().map(|s| (s.path.as_str(), s.conn)).collect();
    assert_eq!(got, [("/before", seen[0].conn), ("/after", seen[0].conn)]);
    drop(tunnel);
    proxy.shutdown().await;
}
