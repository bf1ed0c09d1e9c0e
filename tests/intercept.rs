//! TLS interception (`[intercept]`): apps that only set `HTTPS_PROXY` get every request
//! inside their tunnels limited on its own.
//!
//! The upstream's certificate is signed by a CA that tollgate trusts (`ca_file`) and the
//! clients do not; the clients trust tollgate's interception CA alone. So a client
//! that succeeds proves the tunnel was decrypted and the request sent on by tollgate,
//! and the `Via` the upstream sees says so too.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::*;

/// An interception CA in a temporary directory, as `tollgate ca init` makes one.
struct InterceptCa {
    dir: tempfile::TempDir,
}

impl InterceptCa {
    fn new() -> InterceptCa {
        let dir = tempfile::tempdir().unwrap();
        tollgate::intercept::init(dir.path()).unwrap();
        InterceptCa { dir }
    }

    fn cert(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    fn cert_str(&self) -> String {
        self.cert().display().to_string()
    }

    /// The `[intercept]` table for this CA, with `extra` lines.
    fn table(&self, extra: &str) -> String {
        format!(
            "[intercept]\nca_cert = {:?}\nca_key = {:?}\n{extra}\n",
            self.cert().display().to_string(),
            self.dir.path().join("ca-key.pem").display().to_string()
        )
    }
}

/// A config that intercepts `upstream`, trusts `upstream_ca` for the upstream side, and
/// limits it with `limit` (lines of its `[[limit]]`).
fn config(ca: &InterceptCa, upstream_ca: &TestCa, upstream: &Upstream, limit: &str) -> String {
    format!(
        "[proxy]\nconnect_ports = [\"*\"]\nca_file = {:?}\n\n{}\n[[limit]]\nname = \"api\"\nhosts = [\"{}\"]\n{limit}\n",
        upstream_ca.ca_pem_path().display().to_string(),
        ca.table(""),
        upstream.authority()
    )
}

#[tokio::test]
async fn curl_requests_in_one_tunnel_are_each_paced() {
    let upstream_ca = TestCa::new();
    let upstream = Upstream::start_tls_http1(|_| Reply::ok("hello"), &upstream_ca).await;
    let ca = InterceptCa::new();
    let proxy = start_proxy(&config(&ca, &upstream_ca, &upstream, "rate = \"10/s\"")).await;

    // Six URLs in one curl run: one kept-alive tunnel.
    let urls: Vec<String> = (0..6).map(|i| upstream.url(&format!("/r{i}"))).collect();
    let cert = ca.cert_str();
    let mut args = vec!["--cacert", cert.as_str()];
    args.extend(urls.iter().map(String::as_str));
    let out = curl(&args, &[("https_proxy", &proxy.url())]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(String::from_utf8_lossy(&out.body), "hello".repeat(6));
    let heads: Vec<&str> = out
        .headers
        .lines()
        .filter(|l| l.starts_with("HTTP/"))
        .collect();
    assert_eq!(heads.len(), 1 + 6, "one CONNECT, six answers: {heads:?}");
    assert!(heads.iter().all(|h| h.contains(" 200")), "{heads:?}");

    let seen = upstream.requests();
    let paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(paths, ["/r0", "/r1", "/r2", "/r3", "/r4", "/r5"]);
    for s in &seen {
        // tollgate sent it on: a blind tunnel would carry curl's own request.
        assert!(
            s.header("via").is_some_and(|v| v.ends_with("tollgate")),
            "{s:?}"
        );
        assert_eq!(s.header("host"), Some(upstream.authority().as_str()));
    }
    // 10/s: six departures span at least 5 intervals (less a little for the slot credit).
    let at: Vec<_> = seen.iter().map(|s| s.at).collect();
    let span = at[5] - at[0];
    assert!(
        span >= Duration::from_millis(450),
        "six requests in {span:?}"
    );
}

#[tokio::test]
async fn curl_speaks_h2_inside_the_tunnel() {
    let upstream_ca = TestCa::new();
    let upstream = Upstream::start_tls(|_| Reply::ok("hello"), &upstream_ca).await;
    let ca = InterceptCa::new();
    let proxy = start_proxy(&config(&ca, &upstream_ca, &upstream, "")).await;

    let out = curl(
        &[
            "--http2",
            "--cacert",
            &ca.cert_str(),
            "-w",
            "%{http_version}",
            &upstream.url("/h2"),
        ],
        &[("https_proxy", &proxy.url())],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    // The version curl spoke inside the tunnel, to tollgate.
    assert_eq!(String::from_utf8_lossy(&out.body), "hello2");
    assert_eq!(upstream.paths(), ["/h2"]);
    let via = upstream.requests()[0].header("via").unwrap().to_string();
    assert_eq!(
        via, "2 tollgate",
        "the client's h2, as the upstream was told"
    );
}
