//! TLS interception (`[intercept]`): apps that only set `HTTPS_PROXY` get every request
//! inside their tunnels limited on its own.
//!
//! The upstream's certificate is signed by a CA that tollgate trusts (`ca_file`) and the
//! clients do not; the clients trust tollgate's interception CA alone. So a client
//! that succeeds proves the tunnel was decrypted and the request sent on by tollgate,
//! and the `Via` the upstream sees says so too.

use std::path::PathBuf;
use std::time::Duration;

use crate::support::*;

/// An interception CA in a temporary directory, as `tollgate ca init` makes one.
struct InterceptCa {
    dir: tempfile::TempDir,
}

impl InterceptCa {
    fn new() -> InterceptCa {
        let dir = tempfile::tempdir().unwrap();
        tollgate::init_ca(dir.path()).unwrap();
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

/// The access log tells an intercepted CONNECT from a blind one: the CONNECT's line says
/// `tunnel=intercepted`, and each request inside has a line of its own.
#[tokio::test]
async fn the_access_log_says_a_tunnel_was_intercepted() {
    let upstream_ca = TestCa::new();
    let upstream = Upstream::start_tls_http1(|_| Reply::ok("hello"), &upstream_ca).await;
    let ca = InterceptCa::new();
    let mut tollgate = Tollgate::start(&config(&ca, &upstream_ca, &upstream, "")).await;
    let cert = ca.cert_str();
    let url = upstream.url("/inside");
    let out = curl(
        &["--cacert", &cert, &url],
        &[("https_proxy", &tollgate.url())],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let connect = tollgate.wait_for_log("method=CONNECT").await;
    assert!(connect.contains(" tunnel=intercepted"), "{connect}");
    let inside = tollgate.wait_for_log("/inside").await;
    assert!(inside.contains(" tunnel=-"), "{inside}");
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

#[tokio::test]
async fn a_429_inside_the_tunnel_pauses_the_group_and_is_replayed() {
    let upstream_ca = TestCa::new();
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let upstream = Upstream::start_tls_http1(
        move |_| match calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => Reply::status(429).header("retry-after", "1"),
            _ => Reply::ok("after the pause"),
        },
        &upstream_ca,
    )
    .await;
    let ca = InterceptCa::new();
    let proxy = start_proxy(&config(&ca, &upstream_ca, &upstream, "")).await;

    let out = curl(
        &["--cacert", &ca.cert_str(), &upstream.url("/once")],
        &[("https_proxy", &proxy.url())],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.status, 200, "{}", out.headers);
    assert_eq!(String::from_utf8_lossy(&out.body), "after the pause");
    let at: Vec<_> = upstream.requests().iter().map(|s| s.at).collect();
    assert_eq!(at.len(), 2, "refused once, replayed once");
    // The replay waited out the pause the upstream asked for.
    assert!(
        at[1] - at[0] >= Duration::from_millis(950),
        "{:?}",
        at[1] - at[0]
    );
}

#[tokio::test]
async fn concurrency_permits_are_per_request_not_per_tunnel() {
    let upstream_ca = TestCa::new();
    let upstream = Upstream::start_tls(
        |_| Reply::ok("slow").delay(Duration::from_millis(200)),
        &upstream_ca,
    )
    .await;
    let ca = InterceptCa::new();
    let proxy = start_proxy(&config(&ca, &upstream_ca, &upstream, "concurrency = 1")).await;
    // reqwest speaks h2 inside its one tunnel: three requests on one connection.
    let client = reqwest::Client::builder()
        .proxy(reqwest::Proxy::https(proxy.url()).unwrap())
        .add_root_certificate(
            reqwest::Certificate::from_pem(&std::fs::read(ca.cert()).unwrap()).unwrap(),
        )
        .timeout(BOUND)
        .build()
        .unwrap();
    let sends = (0..3).map(|i| client.get(upstream.url(&format!("/c{i}"))).send());
    for response in futures_util::future::join_all(sends).await {
        let response = response.unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        assert_eq!(response.status(), 200);
    }
    let mut at: Vec<_> = upstream.requests().iter().map(|s| s.at).collect();
    at.sort();
    assert_eq!(at.len(), 3);
    // One at a time: each arrived after the one before was answered.
    for pair in at.windows(2) {
        assert!(pair[1] - pair[0] >= Duration::from_millis(190), "{at:?}");
    }
}

#[tokio::test]
async fn a_bypassed_host_gets_the_upstream_s_own_certificate() {
    let upstream_ca = TestCa::new();
    let upstream = Upstream::start_tls_http1(|_| Reply::ok("direct"), &upstream_ca).await;
    let ca = InterceptCa::new();
    let config = format!(
        "[proxy]\nconnect_ports = [\"*\"]\n\n{}\n[[limit]]\nname = \"api\"\nhosts = [\"{}\"]\n",
        ca.table(&format!("bypass = [\"{}\"]", upstream.authority())),
        upstream.authority()
    );
    let proxy = start_proxy(&config).await;
    let upstream_cert = upstream_ca.ca_pem_path().display().to_string();
    let out = curl(
        &["--cacert", &upstream_cert, &upstream.url("/b")],
        &[("https_proxy", &proxy.url())],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(String::from_utf8_lossy(&out.body), "direct");
    // The client's own request, untouched: tollgate only carried bytes.
    assert_eq!(upstream.requests()[0].header("via"), None);
}

#[tokio::test]
async fn an_upstream_certificate_tollgate_does_not_trust_is_a_502_inside() {
    let upstream_ca = TestCa::new();
    let upstream = Upstream::start_tls_http1(|_| Reply::ok("never"), &upstream_ca).await;
    let ca = InterceptCa::new();
    // No ca_file: the upstream's CA is trusted by nobody here.
    let config = format!(
        "[proxy]\nconnect_ports = [\"*\"]\n\n{}\n[[limit]]\nname = \"api\"\nhosts = [\"{}\"]\n",
        ca.table(""),
        upstream.authority()
    );
    let proxy = start_proxy(&config).await;
    let out = curl(
        &["--cacert", &ca.cert_str(), &upstream.url("/x")],
        &[("https_proxy", &proxy.url())],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.status, 502, "{}", out.headers);
    assert!(
        out.headers
            .contains("proxy-status: tollgate; error=tls_certificate_error"),
        "{}",
        out.headers
    );
    assert!(upstream.requests().is_empty());
}

#[tokio::test]
async fn python_requests_and_aiohttp_through_https_proxy() {
    let upstream_ca = TestCa::new();
    let upstream = Upstream::start_tls_http1(|s| Reply::ok(s.path.clone()), &upstream_ca).await;
    let ca = InterceptCa::new();
    let proxy = start_proxy(&config(&ca, &upstream_ca, &upstream, "rate = \"10/s\"")).await;
    let env = [
        ("HTTPS_PROXY", proxy.url()),
        ("REQUESTS_CA_BUNDLE", ca.cert_str()),
        ("SSL_CERT_FILE", ca.cert_str()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let script = requests_script(&upstream.url("/py"), 5);
    let out = python(&script, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let expected: String = (0..5).map(|i| format!("200 /py{i}\n")).collect();
    assert_eq!(out.stdout, expected);

    let script = format!(
        r#"
import asyncio, ssl, aiohttp
async def main():
    tls = ssl.create_default_context(cafile="{}")
    async with aiohttp.ClientSession(trust_env=True) as s:
        for i in range(3):
            async with s.get("{}" + str(i), ssl=tls) as r:
                print(r.status, await r.text())
asyncio.run(main())
"#,
        ca.cert_str(),
        upstream.url("/aio")
    );
    let out = python(&script, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "200 /aio0\n200 /aio1\n200 /aio2\n");

    let seen = upstream.requests();
    assert_eq!(seen.len(), 8);
    assert!(seen.iter().all(|s| s.header("via") == Some("1.1 tollgate")));
    // Each client's requests are paced one by one at 10/s, inside its one tunnel.
    assert!(
        seen[4].at - seen[0].at >= Duration::from_millis(360),
        "requests"
    );
    assert!(
        seen[7].at - seen[5].at >= Duration::from_millis(180),
        "aiohttp"
    );
}

/// Runs `tests/node/fetch.js` (undici's `EnvHttpProxyAgent`) on `urls` with `env`.
async fn node_fetch(urls: &[String], env: &[(&str, &str)]) -> PyOutput {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/node/fetch.js");
    let mut cmd = clean_command("node", env);
    cmd.arg(script).args(urls);
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("node finished in time")
        .expect("node runs");
    PyOutput {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[tokio::test]
async fn node_fetch_with_env_proxy_agent_https_and_http() {
    let upstream_ca = TestCa::new();
    let tls = Upstream::start_tls(|s| Reply::ok(s.path.clone()), &upstream_ca).await;
    let plain = Upstream::start(|s| Reply::ok(s.path.clone())).await;
    let ca = InterceptCa::new();
    let config = format!(
        "[proxy]\nconnect_ports = [\"*\"]\nca_file = {:?}\n\n{}\n[[limit]]\nname = \"api\"\nhosts = [\"{}\", \"{}\"]\nrate = \"10/s\"\n",
        upstream_ca.ca_pem_path().display().to_string(),
        ca.table(""),
        tls.authority(),
        plain.authority()
    );
    let proxy = start_proxy(&config).await;
    let env = [
        ("HTTPS_PROXY", proxy.url()),
        ("HTTP_PROXY", proxy.url()),
        ("NODE_EXTRA_CA_CERTS", ca.cert_str()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let urls = [
        tls.url("/n0"),
        tls.url("/n1"),
        plain.url("/p0"),
        plain.url("/p1"),
    ];
    let out = node_fetch(&urls, &env).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "200 /n0\n200 /n1\n200 /p0\n200 /p1\n");
    // undici tunnels http:// URLs through CONNECT too; tollgate serves the plain HTTP
    // inside as requests of their own, so both upstreams saw tollgate's Via.
    for seen in tls.requests().iter().chain(&plain.requests()) {
        assert!(
            seen.header("via").is_some_and(|v| v.ends_with("tollgate")),
            "{seen:?}"
        );
    }
    let mut at: Vec<_> = tls
        .requests()
        .iter()
        .chain(&plain.requests())
        .map(|s| s.at)
        .collect();
    at.sort();
    assert!(at[3] - at[0] >= Duration::from_millis(270), "{at:?}");
}

#[tokio::test]
async fn a_request_for_another_host_inside_a_tunnel_is_misdirected() {
    let plain = Upstream::start(|_| Reply::ok("plain")).await;
    let ca = InterceptCa::new();
    let config = format!(
        "[proxy]\nconnect_ports = [\"*\"]\n\n{}\n[[limit]]\nname = \"api\"\nhosts = [\"{}\"]\n",
        ca.table(""),
        plain.authority()
    );
    let proxy = start_proxy(&config).await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let authority = plain.authority();
    let connect = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    tokio::io::AsyncWriteExt::write_all(&mut stream, connect.as_bytes())
        .await
        .unwrap();
    let (head, _) = read_head(&mut stream).await;
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    // Plain HTTP inside: the first request names the tunnel's host, the second another.
    let first = format!("GET /mine HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    tokio::io::AsyncWriteExt::write_all(&mut stream, first.as_bytes())
        .await
        .unwrap();
    let first = read_response(&mut stream).await;
    assert_eq!(first.status, 200);
    let second = b"GET /theirs HTTP/1.1\r\nHost: other.example\r\n\r\n";
    tokio::io::AsyncWriteExt::write_all(&mut stream, second)
        .await
        .unwrap();
    let second = read_response(&mut stream).await;
    assert_eq!(second.status, 421, "{second:?}");
    assert_eq!(plain.paths(), ["/mine"]);
}

#[tokio::test]
async fn a_websocket_inside_an_intercepted_tunnel_is_relayed() {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let upstream_ca = TestCa::new();
    let certs = tempfile::tempdir().unwrap();
    upstream_ca.write_server_pem(certs.path());
    let ca = InterceptCa::new();
    // aiohttp's WebSocket server picks its port and says it; the script then reads the
    // proxy's URL, which is started for that port, and opens a WebSocket through it.
    let script = format!(
        r#"
import asyncio, ssl, sys, aiohttp
from aiohttp import web

async def main():
    seen = []
    async def echo(request):
        seen.append(request.headers.get("Via"))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_str("echo " + msg.data)
        return ws
    app = web.Application()
    app.router.add_get("/ws", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain("{dir}/cert.pem", "{dir}/key.pem")
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(port, flush=True)
    proxy = sys.stdin.readline().strip()
    client_tls = ssl.create_default_context(cafile="{ca}")
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(f"wss://127.0.0.1:{{port}}/ws", ssl=client_tls, proxy=proxy) as ws:
            for i in range(3):
                await ws.send_str(f"m{{i}}")
                print((await ws.receive()).data)
    print("via", seen)
    await runner.cleanup()

asyncio.run(main())
"#,
        dir = certs.path().display(),
        ca = ca.cert_str(),
    );
    let mut child = clean_command("python3", &[])
        .args(["-I", "-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap());
    let mut port = String::new();
    tokio::time::timeout(BOUND, stdout.read_line(&mut port))
        .await
        .unwrap()
        .unwrap();
    let port: u16 = port.trim().parse().expect("the server's port");
    let config = format!(
        "[proxy]\nconnect_ports = [\"*\"]\nca_file = {:?}\n\n{}\n[[limit]]\nname = \"ws\"\nhosts = [\"127.0.0.1:{port}\"]\n",
        upstream_ca.ca_pem_path().display().to_string(),
        ca.table("")
    );
    let proxy = start_proxy_with_admin(&config).await;
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(format!("{}\n", proxy.url()).as_bytes())
        .await
        .unwrap();
    let mut rest = String::new();
    tokio::time::timeout(BOUND, stdout.read_to_string(&mut rest))
        .await
        .unwrap()
        .unwrap();
    let status = tokio::time::timeout(BOUND, child.wait())
        .await
        .unwrap()
        .unwrap();
    let mut stderr = String::new();
    let _ = child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .await;
    assert!(status.success(), "{stderr}");
    assert_eq!(
        rest, "echo m0\necho m1\necho m2\nvia ['1.1 tollgate']\n",
        "{stderr}"
    );
    // The switch counted as one request of the group.
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(
        metrics.contains("tollgate_requests_total{group=\"ws\",outcome=\"admitted\"} 1\n"),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_intercepted_tunnel_on_an_http2_stream_outlives_the_idle_close() {
    // A client speaking h2 to tollgate opens the tunnel as a CONNECT stream; the stream
    // stays open while the tunnel is, past client_header_timeout (an h2 connection with
    // no stream open closes after it). The connection inside is kept busy: idle for as
    // long, it would close like any keep-alive connection.

    let upstream = Upstream::start(|seen| Reply::ok(format!("saw {}", seen.path))).await;
    let ca = InterceptCa::new();
    let config = format!(
        "[proxy]\nconnect_ports = [\"*\"]\nclient_header_timeout = \"600ms\"\n\n{}\n[[limit]]\nname = \"api\"\nhosts = [\"{}\"]\n",
        ca.table(""),
        upstream.authority()
    );
    let proxy = start_proxy(&config).await;
    let mut tunnel = h2_connect(&proxy, &upstream.authority()).await;

    // 2 s in all: an h2 connection idle for 600 ms gets GOAWAY, and is dropped if still
    // idle 1.2 s later.
    let paths: Vec<String> = (0..10).map(|i| format!("/r{i}")).collect();
    for path in &paths {
        // Busy, never idle for 600 ms: one request every 200 ms, across the idle close.
        tokio::time::sleep(Duration::from_millis(200)).await;
        get_through_tunnel(&mut tunnel, &upstream.authority(), path).await;
    }
    let seen = upstream.requests();
    assert_eq!(upstream.paths(), paths);
    assert!(seen.iter().all(|s| s.header("via") == Some("1.1 tollgate")));
}

/// A plain upstream that switches to an echo of every byte when asked for WebSocket
/// (a bare `101`, no WebSocket framing: tollgate relays bytes), and answers anything
/// else `200 ok`. Records each request line it reads.
struct Switching {
    addr: std::net::SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
}

use std::sync::{Arc, Mutex};

impl Switching {
    async fn start() -> Switching {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let record = heads.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let record = record.clone();
                tokio::spawn(async move {
                    loop {
                        // Heads only (no bodies come here), read to their blank line.
                        let mut head = Vec::new();
                        let mut byte = [0u8; 1];
                        while !head.ends_with(b"\r\n\r\n") {
                            match stream.read(&mut byte).await {
                                Ok(1) => head.push(byte[0]),
                                _ => return,
                            }
                        }
                        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
                        record
                            .lock()
                            .unwrap()
                            .push(head.lines().next().unwrap_or("").to_string());
                        if head.contains("upgrade: websocket") {
                            let switched = b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n";
                            stream.write_all(switched).await.unwrap();
                            let mut buf = [0u8; 1024];
                            while let Ok(n) = stream.read(&mut buf).await {
                                if n == 0 || stream.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                            return;
                        }
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if stream.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Switching { addr, heads }
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// Opens a plain tunnel through `proxy` to `upstream` and switches it to WebSocket;
/// returns the stream, ready for bytes to echo.
async fn open_websocket(
    tunnel: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin),
    authority: &str,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ask = format!(
        "GET /ws HTTP/1.1\r\nHost: {authority}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    );
    tunnel.write_all(ask.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(BOUND, tunnel.read(&mut byte))
            .await
            .unwrap()
            .unwrap();
        assert!(
            n > 0,
            "closed before the 101: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.push(byte[0]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 101"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
}

/// Writes `message` and reads its echo back.
async fn echo(
    tunnel: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin),
    message: &[u8],
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tunnel.write_all(message).await.unwrap();
    let mut got = vec![0u8; message.len()];
    tokio::time::timeout(BOUND, tunnel.read_exact(&mut got))
        .await
        .expect("an echo")
        .expect("the switched connection is open");
    assert_eq!(got, message);
}

/// Sends CONNECT for `authority` on `stream` and reads the 200.
async fn connect(stream: &mut tokio::net::TcpStream, authority: &str) {
    use tokio::io::AsyncWriteExt;
    let connect = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    stream.write_all(connect.as_bytes()).await.unwrap();
    let (head, _) = read_head(stream).await;
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
}

#[tokio::test]
async fn a_websocket_holds_its_concurrency_permit_while_open() {
    let upstream = Switching::start().await;
    let authority = upstream.addr.to_string();
    let ca = InterceptCa::new();
    let config = format!(
        "[proxy]\nconnect_ports = [\"*\"]\n\n{}\n[[limit]]\nname = \"api\"\nhosts = [\"{authority}\"]\nconcurrency = 1\n",
        ca.table("")
    );
    let proxy = start_proxy_with_admin(&config).await;
    let mut ws = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    connect(&mut ws, &authority).await;
    open_websocket(&mut ws, &authority).await;
    echo(&mut ws, b"one").await;

    // A request in another tunnel waits for the permit the WebSocket holds.
    let url = format!("http://{authority}/after");
    let proxy_url = proxy.url();
    // -p: through a CONNECT tunnel, as undici sends http:// URLs.
    let waiting =
        tokio::spawn(async move { curl(&["-p", &url], &[("http_proxy", &proxy_url)]).await });
    wait_queued(&proxy, "api", 1).await;
    echo(&mut ws, b"two").await;
    assert_eq!(upstream.heads(), ["get /ws http/1.1"]);
    drop(ws);
    let out = waiting.await.unwrap();
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.body, b"ok");
    assert_eq!(
        upstream.heads(),
        ["get /ws http/1.1", "get /after http/1.1"]
    );
}

#[tokio::test]
async fn a_websocket_in_a_tunnel_on_an_http2_stream_outlives_the_idle_close() {
    let upstream = Switching::start().await;
    let authority = upstream.addr.to_string();
    let ca = InterceptCa::new();
    let config = format!(
        "[proxy]\nconnect_ports = [\"*\"]\nclient_header_timeout = \"300ms\"\n\n{}\n[[limit]]\nname = \"api\"\nhosts = [\"{authority}\"]\n",
        ca.table("")
    );
    let proxy = start_proxy(&config).await;
    let mut tunnel = h2_connect(&proxy, authority.as_str()).await;
    open_websocket(&mut tunnel, &authority).await;
    echo(&mut tunnel, b"before").await;
    // Idle for three header timeouts: an h2 connection with no stream open would have
    // been sent GOAWAY and dropped by now.
    tokio::time::sleep(Duration::from_millis(900)).await;
    echo(&mut tunnel, b"after").await;
}

#[tokio::test]
async fn an_intercepted_connect_still_passes_ports_policy_and_auth() {
    let ca = InterceptCa::new();
    let users = tempfile::tempdir().unwrap();
    let hash = bcrypt::hash("secret", 4).unwrap();
    let users_file = write_file(users.path(), "users", &format!("alice:{hash}\n"));
    let config = format!(
        "[proxy]\nconnect_ports = [443]\n\n{}\n[[limit]]\nname = \"api\"\nhosts = [\"api.example.com\", \"10.1.2.3\"]\n\n[access]\nusers = {:?}\n",
        ca.table(""),
        users_file.display().to_string()
    );
    let proxy = start_proxy(&config).await;
    let basic =
        base64::engine::Engine::encode(&base64::engine::general_purpose::STANDARD, "alice:secret");
    let ask = |target: &str, auth: bool| {
        let auth = if auth {
            format!("Proxy-Authorization: Basic {basic}\r\n")
        } else {
            String::new()
        };
        format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n")
    };
    for (target, auth, status, error) in [
        ("api.example.com:443", false, 407, "http_request_denied"),
        ("api.example.com:8443", true, 403, "http_request_denied"),
        ("10.1.2.3:443", true, 403, "destination_ip_prohibited"),
    ] {
        let response = raw_request(proxy.addr, ask(target, auth).as_bytes()).await;
        assert_eq!(response.status, status, "{target}: {response:?}");
        assert!(
            response
                .header("proxy-status")
                .is_some_and(|v| v.contains(&format!("error={error}"))),
            "{target}: {response:?}"
        );
    }
    // With credentials, to an allowed port: the tunnel opens.
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stream, ask("api.example.com:443", true).as_bytes())
        .await
        .unwrap();
    let (head, _) = read_head(&mut stream).await;
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
}
