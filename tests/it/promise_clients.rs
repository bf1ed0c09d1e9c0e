//! README, "Pointing your apps at it": the clients of its table, set up as the table
//! says, through the built binary. Python `requests`, `urllib` and `aiohttp` with the
//! upper-case `HTTP_PROXY`/`HTTPS_PROXY`/`NO_PROXY`, curl with its lower-case variables
//! and `-x`, Node's `fetch` with undici's `EnvHttpProxyAgent`, and Java's
//! `HttpURLConnection` with `-Dhttp(s).proxyHost` and a `keytool` trust store. HTTPS
//! goes through interception with a CA made by `tollgate ca init`.
//!
//! Each test checks what the upstream received: tollgate's `Via` on every request it
//! sent on (none on a request that bypassed it), and the group's pace, which a client
//! reaching the upstream any other way would not keep.

use std::path::PathBuf;

use crate::support::*;

/// The group's rate in these tests: five requests span at least 0.4 s through it.
const RATE: &str = "rate = \"10/s\"";
/// One request per this at [`RATE`].
const RATE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// Whether tollgate sent this request on.
fn via_tollgate(seen: &Seen) -> bool {
    seen.header("via").is_some_and(|v| v.ends_with(" tollgate"))
}

/// Runs `program args` with a proxy-free environment plus `env`; bounded.
async fn run(program: &str, args: &[&str], env: &[(&str, &str)]) -> PyOutput {
    let mut cmd = clean_command(program, env);
    cmd.args(args);
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{program} finished in time"))
        .unwrap_or_else(|e| panic!("{program} runs: {e}"));
    PyOutput {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A file beside this one, e.g. `node/fetch.js`.
fn beside(path: &str) -> String {
    format!("{}/tests/{path}", env!("CARGO_MANIFEST_DIR"))
}

/// The arrivals of the requests whose path starts with `prefix`, in time order.
fn arrivals_of(upstream: &Upstream, prefix: &str) -> Vec<std::time::Instant> {
    let mut at: Vec<_> = (upstream.requests().iter())
        .filter(|s| s.path.starts_with(prefix))
        .map(|s| s.at)
        .collect();
    at.sort();
    at
}

/// Asserts that `upstream` got exactly `paths` (in any order), each sent on by
/// tollgate, and that those with `prefix` kept to [`RATE`].
fn assert_sent_on_and_paced(upstream: &Upstream, prefix: &str, expected: usize) {
    let seen: Vec<Seen> = (upstream.requests().into_iter())
        .filter(|s| s.path.starts_with(prefix))
        .collect();
    assert_eq!(seen.len(), expected, "{prefix}: {:?}", upstream.paths());
    assert!(seen.iter().all(via_tollgate), "{prefix}: {seen:?}");
    assert_paced(&arrivals_of(upstream, prefix), RATE_INTERVAL, 1);
}

#[tokio::test]
async fn python_requests_and_aiohttp_read_upper_case_http_proxy_and_no_proxy() {
    let upstream = Upstream::start(|s| Reply::ok(s.path.clone())).await;
    let tollgate = Tollgate::start(&format!(
        "[[limit]]\nname = \"api\"\nhosts = [\"{}\"]\n{RATE}\n",
        upstream.authority()
    ))
    .await;
    let proxy = tollgate.url();
    let env = [("HTTP_PROXY", proxy.as_str())];
    let script = requests_script(&upstream.url("/requests"), 5);
    let out = python(&script, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let expected: String = (0..5).map(|i| format!("200 /requests{i}\n")).collect();
    assert_eq!(out.stdout, expected);
    assert_sent_on_and_paced(&upstream, "/requests", 5);

    // aiohttp reads the variables with trust_env=True; five at once leave paced.
    let script = aiohttp_script(&upstream.url("/aiohttp"), 5);
    let out = python(&script, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "[200, 200, 200, 200, 200]\n");
    assert_sent_on_and_paced(&upstream, "/aiohttp", 5);

    // NO_PROXY sends a host straight to it.
    let script = format!(
        "import requests\nprint(requests.get(\"{}\").status_code)",
        upstream.url("/direct")
    );
    let env = [("HTTP_PROXY", proxy.as_str()), ("NO_PROXY", "127.0.0.1")];
    let out = python(&script, &env).await;
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "200\n"),
        "{}",
        out.stderr
    );
    let direct: Vec<Seen> = (upstream.requests().into_iter())
        .filter(|s| s.path == "/direct")
        .collect();
    assert_eq!(direct.len(), 1);
    assert!(!via_tollgate(&direct[0]), "{direct:?}");
}

#[tokio::test]
async fn curl_reads_lower_case_http_proxy_only_and_no_proxy_even_with_x() {
    let upstream = Upstream::start(|s| Reply::ok(s.path.clone())).await;
    let tollgate = Tollgate::start("").await;
    let proxy = tollgate.url();
    let via = |path: &str| {
        let seen: Vec<Seen> = (upstream.requests().into_iter())
            .filter(|s| s.path == path)
            .collect();
        assert_eq!(seen.len(), 1, "{path}: {:?}", upstream.paths());
        via_tollgate(&seen[0])
    };
    let ok = |out: &CurlOutput| assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);

    ok(&curl(&[&upstream.url("/lower")], &[("http_proxy", &proxy)]).await);
    assert!(via("/lower"));
    // curl ignores an upper-case HTTP_PROXY (a CGI could set it from a request header).
    ok(&curl(&[&upstream.url("/upper")], &[("HTTP_PROXY", &proxy)]).await);
    assert!(!via("/upper"));
    ok(&curl(&["-x", &proxy, &upstream.url("/x")], &[]).await);
    assert!(via("/x"));
    // NO_PROXY wins over -x, unless --noproxy '' clears it.
    let no_proxy = [("NO_PROXY", "127.0.0.1")];
    ok(&curl(&["-x", &proxy, &upstream.url("/skipped")], &no_proxy).await);
    assert!(!via("/skipped"));
    let args = ["--noproxy", "", "-x", &proxy, &upstream.url("/forced")];
    ok(&curl(&args, &no_proxy).await);
    assert!(via("/forced"));
}

/// tollgate intercepting HTTPS to an upstream whose certificate it trusts by
/// `ca_file`, with its CA made by `tollgate ca init`; a plain upstream in the same
/// group (undici tunnels `http://` URLs too).
struct Intercepting {
    tollgate: Tollgate,
    tls: Upstream,
    plain: Upstream,
    /// The CA that signs the upstream's certificate: not one the clients trust.
    upstream_ca: TestCa,
    ca_dir: tempfile::TempDir,
}

impl Intercepting {
    async fn start() -> Intercepting {
        let ca_dir = tempfile::tempdir().unwrap();
        let init = run(
            env!("CARGO_BIN_EXE_tollgate"),
            &["ca", "init", "--dir", &ca_dir.path().display().to_string()],
            &[],
        )
        .await;
        assert_eq!(init.code, 0, "{}", init.stderr);
        let upstream_ca = TestCa::new();
        let tls = Upstream::start_tls_http1(|s| Reply::ok(s.path.clone()), &upstream_ca).await;
        let plain = Upstream::start(|s| Reply::ok(s.path.clone())).await;
        let config = format!(
            "[proxy]\nconnect_ports = [\"*\"]\nca_file = {:?}\n\
             [intercept]\nca_cert = {:?}\nca_key = {:?}\n\
             [[limit]]\nname = \"api\"\nhosts = [\"{}\", \"{}\"]\n{RATE}\n",
            upstream_ca.ca_pem_path().display().to_string(),
            ca_dir.path().join("ca.pem").display().to_string(),
            ca_dir.path().join("ca-key.pem").display().to_string(),
            tls.authority(),
            plain.authority(),
        );
        let tollgate = Tollgate::start(&config).await;
        Intercepting {
            tollgate,
            tls,
            plain,
            upstream_ca,
            ca_dir,
        }
    }

    /// tollgate's CA, `ca.pem`.
    fn ca(&self) -> String {
        self.ca_dir.path().join("ca.pem").display().to_string()
    }
}

#[tokio::test]
async fn python_clients_through_upper_case_https_proxy_trust_the_ca_by_environment() {
    let it = Intercepting::start().await;
    let (proxy, ca) = (it.tollgate.url(), it.ca());
    let env = [
        ("HTTPS_PROXY", proxy.as_str()),
        ("REQUESTS_CA_BUNDLE", ca.as_str()),
        ("SSL_CERT_FILE", ca.as_str()),
    ];
    // Session.verify names a CA that cannot verify tollgate's certificates:
    // REQUESTS_CA_BUNDLE wins over it.
    let script = format!(
        r#"
import requests
s = requests.Session()
s.verify = "{}"
for i in range(5):
    r = s.get("{}" + str(i))
    print(r.status_code, r.text)
"#,
        it.upstream_ca.ca_pem_path().display(),
        it.tls.url("/requests")
    );
    let out = python(&script, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let expected: String = (0..5).map(|i| format!("200 /requests{i}\n")).collect();
    assert_eq!(out.stdout, expected);
    assert_sent_on_and_paced(&it.tls, "/requests", 5);

    // aiohttp (trust_env=True) and urllib with SSL_CERT_FILE alone.
    let script = aiohttp_script(&it.tls.url("/aiohttp"), 5);
    let out = python(&script, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "[200, 200, 200, 200, 200]\n");
    assert_sent_on_and_paced(&it.tls, "/aiohttp", 5);

    let script = format!(
        r#"
import urllib.request
for i in range(5):
    with urllib.request.urlopen("{}" + str(i)) as r:
        print(r.status, r.read().decode())
"#,
        it.tls.url("/urllib")
    );
    let out = python(&script, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let expected: String = (0..5).map(|i| format!("200 /urllib{i}\n")).collect();
    assert_eq!(out.stdout, expected);
    assert_sent_on_and_paced(&it.tls, "/urllib", 5);
}

#[tokio::test]
async fn curl_through_upper_case_https_proxy_trusts_the_ca_by_curl_ca_bundle() {
    let it = Intercepting::start().await;
    let (proxy, ca) = (it.tollgate.url(), it.ca());
    let urls: Vec<String> = (0..5).map(|i| it.tls.url(&format!("/curl{i}"))).collect();
    let mut args: Vec<&str> = urls.iter().map(String::as_str).collect();
    args.insert(0, "-s");
    let env = [
        ("HTTPS_PROXY", proxy.as_str()),
        ("CURL_CA_BUNDLE", ca.as_str()),
    ];
    let out = curl(&args, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.text(), "/curl0/curl1/curl2/curl3/curl4");
    assert_sent_on_and_paced(&it.tls, "/curl", 5);
}

#[tokio::test]
async fn node_fetch_with_env_http_proxy_agent_and_node_extra_ca_certs() {
    let it = Intercepting::start().await;
    let (proxy, ca) = (it.tollgate.url(), it.ca());
    let env = [
        ("HTTPS_PROXY", proxy.as_str()),
        ("HTTP_PROXY", proxy.as_str()),
        ("NODE_EXTRA_CA_CERTS", ca.as_str()),
    ];
    let mut args = vec![beside("node/fetch.js")];
    args.extend((0..5).map(|i| it.tls.url(&format!("/node{i}"))));
    args.extend((0..3).map(|i| it.plain.url(&format!("/plain{i}"))));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("node", &args, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let expected: String = (0..5)
        .map(|i| format!("200 /node{i}\n"))
        .chain((0..3).map(|i| format!("200 /plain{i}\n")))
        .collect();
    assert_eq!(out.stdout, expected);
    assert_sent_on_and_paced(&it.tls, "/node", 5);
    // undici sends http:// URLs through CONNECT too: served as requests of their own.
    assert_sent_on_and_paced(&it.plain, "/plain", 3);
}

#[tokio::test]
async fn java_with_proxy_properties_and_a_keytool_trust_store() {
    let it = Intercepting::start().await;
    let (host, port) = ("127.0.0.1", it.tollgate.addr.port().to_string());
    // keytool -importcert, into a trust store of the test's own (README imports into
    // the JDK's cacerts, which the test does not touch).
    let store: PathBuf = it.ca_dir.path().join("trust.p12");
    let store = store.display().to_string();
    let ca = it.ca();
    let import = run(
        "keytool",
        &[
            "-importcert",
            "-noprompt",
            "-alias",
            "tollgate",
            "-file",
            &ca,
            "-keystore",
            &store,
            "-storetype",
            "PKCS12",
            "-storepass",
            "changeit",
        ],
        &[],
    )
    .await;
    assert_eq!(import.code, 0, "{}{}", import.stdout, import.stderr);
    let trust_store = format!("-Djavax.net.ssl.trustStore={store}");
    let (http_host, http_port) = (
        format!("-Dhttp.proxyHost={host}"),
        format!("-Dhttp.proxyPort={port}"),
    );
    let (https_host, https_port) = (
        format!("-Dhttps.proxyHost={host}"),
        format!("-Dhttps.proxyPort={port}"),
    );
    let tls_urls: Vec<String> = (0..5).map(|i| it.tls.url(&format!("/java{i}"))).collect();
    let plain_urls: Vec<String> = (0..3)
        .map(|i| it.plain.url(&format!("/jplain{i}")))
        .collect();
    let source = beside("java/Fetch.java");
    let mut args = vec![
        trust_store.as_str(),
        "-Djavax.net.ssl.trustStorePassword=changeit",
        &http_host,
        &http_port,
        &https_host,
        &https_port,
        // Java skips the proxy for loopback by default; the upstreams here are there.
        "-Dhttp.nonProxyHosts=",
        &source,
    ];
    args.extend(tls_urls.iter().chain(&plain_urls).map(String::as_str));
    let out = run("java", &args, &[]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let expected: String = (0..5)
        .map(|i| format!("200 /java{i}\n"))
        .chain((0..3).map(|i| format!("200 /jplain{i}\n")))
        .collect();
    assert_eq!(out.stdout, expected);
    assert_sent_on_and_paced(&it.tls, "/java", 5);
    assert_sent_on_and_paced(&it.plain, "/jplain", 3);
}
