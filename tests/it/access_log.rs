//! The access log, as the proxy writes it: one `access` line per request, with its
//! status, who answered, its group, replays and bytes. The proxy runs in this process;
//! its log lines are captured by the subscriber this file installs.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::support::*;

/// Everything logged in this test binary.
fn captured() -> &'static Mutex<Vec<u8>> {
    static LOG: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    LOG.get_or_init(Mutex::default)
}

struct Capture;

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        captured().lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn install() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        tracing_subscriber::fmt()
            .with_env_filter("info")
            .with_ansi(false)
            .with_writer(|| Capture)
            .init();
    });
}

/// The access lines mentioning `needle`, waiting (bounded) until there are `n`.
async fn access_lines(needle: &str, n: usize) -> Vec<String> {
    let lines = || {
        let text = String::from_utf8_lossy(&captured().lock().unwrap()).into_owned();
        (text.lines())
            .filter(|l| l.contains(" access: ") && l.contains(needle))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // Short of `n` after the bound: the caller's assertion says what is missing.
    let found = within_bound(async || Some(lines()).filter(|l| l.len() >= n)).await;
    found.unwrap_or_else(lines)
}

/// `key=value` of an access line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let start = line
        .find(&format!(" {key}="))
        .unwrap_or_else(|| panic!("no {key} in {line}"));
    let rest = &line[start + key.len() + 2..];
    rest.split(' ').next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_has_one_line_refused_and_replayed_ones_included() {
    install();
    let refused_once = Arc::new(AtomicUsize::new(0));
    let count = refused_once.clone();
    let upstream = Upstream::start(move |seen| {
        if seen.path == "/busy" && count.fetch_add(1, Ordering::SeqCst) == 0 {
            Reply::status(429).header("retry-after", "1")
        } else {
            Reply::ok("hello")
        }
    })
    .await;
    let proxy = start_proxy_with_admin(
        "[[limit]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n[proxy]\nserver_timing = true\n",
    )
    .await;
    let client = reqwest_via(&proxy, None);
    let ok = client
        .get(upstream.url("/ok?token=secret"))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let timing = ok.headers()["server-timing"].to_str().unwrap().to_string();
    assert!(
        timing.starts_with("tollgate;desc=\"queue\";dur="),
        "{timing}"
    );
    assert_eq!(ok.text().await.unwrap(), "hello");
    let busy = client.get(upstream.url("/busy")).send().await.unwrap();
    assert_eq!(busy.status(), 200);
    assert_eq!(busy.text().await.unwrap(), "hello");
    // Origin-form, to a proxy with no routes: tollgate answers 404 itself.
    let port = proxy.addr.port();
    let refused = raw_request(
        proxy.addr,
        format!("GET /nowhere-{port}?key=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await;
    assert_eq!(refused.status, 404);
    // What the upstream got: the first request, then the refused one and its replay.
    assert_eq!(upstream.paths(), ["/ok?token=secret", "/busy", "/busy"]);

    let authority = upstream.authority();
    let ok = access_lines(&format!("{authority}/ok"), 1).await;
    assert_eq!(ok.len(), 1, "{ok:?}");
    let line = &ok[0];
    assert!(line.contains(" INFO "), "{line}");
    assert!(
        !line.contains("secret"),
        "the query string is logged: {line}"
    );
    assert_eq!(field(line, "url"), format!("http://{authority}/ok"));
    assert_eq!(field(line, "method"), "GET");
    assert!(field(line, "client").starts_with("127.0.0.1:"), "{line}");
    assert_eq!(field(line, "group"), "api");
    assert_eq!(field(line, "status"), "200");
    assert_eq!(field(line, "answered"), "upstream");
    assert_eq!(field(line, "retries"), "0");
    assert_eq!(field(line, "bytes"), "5");
    assert_eq!(field(line, "complete"), "true");

    let busy = access_lines(&format!("{authority}/busy"), 1).await;
    assert_eq!(busy.len(), 1, "one line for a replayed request: {busy:?}");
    let line = &busy[0];
    assert_eq!(field(line, "status"), "200");
    assert_eq!(field(line, "retries"), "1");
    // It waited for the pause the 429 asked for, in the queue.
    let wait: f64 = field(line, "wait_ms").parse().unwrap();
    assert!(wait >= 900.0, "{line}");

    let refused = access_lines(&format!("/nowhere-{port}"), 1).await;
    assert_eq!(refused.len(), 1, "{refused:?}");
    let line = &refused[0];
    assert_eq!(field(line, "url"), format!("/nowhere-{port}"));
    assert_eq!(field(line, "status"), "404");
    assert_eq!(field(line, "answered"), "tollgate:destination_not_found");
    assert_eq!(field(line, "group"), "-");

    // The same answers, counted by the upstream metrics and in /status.
    let metrics = admin_get(&proxy, "/metrics").await;
    for line in [
        r#"tollgate_upstream_responses_total{group="api",status="200"} 2"#,
        r#"tollgate_upstream_responses_total{group="api",status="429"} 1"#,
        r#"tollgate_upstream_duration_seconds_count{group="api"} 3"#,
    ] {
        assert!(metrics.contains(line), "missing {line}:\n{metrics}");
    }
    let status: serde_json::Value =
        serde_json::from_str(&admin_get(&proxy, "/status").await).unwrap();
    let api = &status["groups"][0];
    assert_eq!(api["name"], "api", "{status}");
    assert_eq!(
        api["upstream_statuses"],
        serde_json::json!({"200": 2, "429": 1})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_refused_is_counted_by_kind_and_logged() {
    install();
    let closed_port = ClosedPort::new();
    let closed = closed_port.addr();
    let proxy = start_proxy_with_admin("[log]\naccess = true\n").await;
    let url = format!("http://{closed}/gone");
    let resp = reqwest_via(&proxy, None).get(&url).send().await.unwrap();
    assert_eq!(resp.status(), 502);
    let lines = access_lines(&format!("{closed}/gone"), 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(field(&lines[0], "answered"), "tollgate:connection_refused");
    assert_eq!(field(&lines[0], "group"), "127.0.0.1");
    let metrics = admin_get(&proxy, "/metrics").await;
    let line = r#"tollgate_upstream_errors_total{group="127.0.0.1",kind="connection_refused"} 1"#;
    assert!(metrics.contains(line), "missing {line}:\n{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_false_writes_no_lines() {
    use tokio::io::AsyncWriteExt;
    install();
    let upstream = Upstream::start(|_| Reply::ok("x")).await;
    let proxy = start_proxy("[log]\naccess = false\n").await;
    // Two requests on one connection: tollgate ends the first response, where its line
    // is written, before it reads the second, so once that is answered the first line
    // would be there.
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    for path in ["/quiet", "/after"] {
        let get = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
            upstream.url(path),
            upstream.authority()
        );
        conn.write_all(get.as_bytes()).await.unwrap();
        let resp = read_response(&mut conn).await;
        assert_eq!(resp.status, 200, "{path}: {}", resp.text());
        assert!(resp.header("server-timing").is_none(), "{path}: {resp:?}");
        assert_eq!(resp.text(), "x");
    }
    assert_eq!(upstream.paths(), ["/quiet", "/after"]);
    let lines = access_lines(&format!("{}/quiet", upstream.authority()), 0).await;
    assert!(lines.is_empty(), "{lines:?}");
}

/// The binary with `--log-format json` writes each access line as one JSON object,
/// numbers as numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_writes_json_lines_with_log_format_json() {
    let upstream = Upstream::start(|_| Reply::ok("hello")).await;
    let mut tollgate = Tollgate::launch("[proxy]\n")
        .arg("--log-format")
        .arg("json")
        .start()
        .await;
    let listen = tollgate.addr;
    let client = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://{listen}")).unwrap())
        .timeout(BOUND)
        .build()
        .unwrap();
    let resp = client.get(upstream.url("/json?q=1")).send().await.unwrap();
    assert_eq!(resp.text().await.unwrap(), "hello");
    let line = tollgate.wait_for_log("\"target\":\"access\"").await;
    let json: serde_json::Value = serde_json::from_str(&line).unwrap();
    let fields = &json["fields"];
    assert_eq!(json["level"], "INFO", "{line}");
    assert_eq!(fields["url"], upstream.url("/json"), "{line}");
    assert_eq!(fields["status"], 200, "{line}");
    assert_eq!(fields["bytes"], 5, "{line}");
    assert_eq!(fields["retries"], 0, "{line}");
    assert_eq!(fields["answered"], "upstream", "{line}");
    assert_eq!(fields["group"], "127.0.0.1", "{line}");
    assert_eq!(fields["complete"], true, "{line}");
    assert!(fields["wait_ms"].is_number(), "{line}");
}

/// A CONNECT has its line when the tunnel opens, and a refused one too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_has_its_line() {
    install();
    let upstream = Upstream::start(|_| Reply::ok("x")).await;
    let proxy = start_proxy("[proxy]\nconnect_ports = [\"*\"]\n").await;
    let authority = upstream.authority();
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let connect = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    tokio::io::AsyncWriteExt::write_all(&mut stream, connect.as_bytes())
        .await
        .unwrap();
    let (head, _) = read_head(&mut stream).await;
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    let lines = access_lines(&format!("url={authority} "), 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(field(&lines[0], "method"), "CONNECT");
    assert_eq!(field(&lines[0], "status"), "200");
    assert_eq!(field(&lines[0], "answered"), "upstream");
    assert_eq!(field(&lines[0], "tunnel"), "blind");
    drop(stream);

    // Refused: no tunnels to a closed port are opened, and that is logged as tollgate's.
    let closed_port = ClosedPort::new();
    let closed = closed_port.addr();
    let refused = raw_request(
        proxy.addr,
        format!("CONNECT {closed} HTTP/1.1\r\nHost: {closed}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(refused.status, 502);
    let lines = access_lines(&format!("url={closed} "), 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(field(&lines[0], "answered"), "tollgate:connection_refused");
}

/// A request whose client leaves while it waits in its group still has its line: status
/// 499, answered by nobody (`client-left`), and it was never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_left_while_queued_has_its_line() {
    install();
    let upstream = Upstream::start(|_| Reply::ok("hello")).await;
    let proxy = start_proxy_with_admin(
        "[[limit]]\nname = \"once\"\nhosts = [\"127.0.0.1\"]\nrate = \"1/m\"\n",
    )
    .await;
    let first = raw_request(
        proxy.addr,
        format!(
            "GET {} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            upstream.url("/first")
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(first.status, 200);
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: x\r\n\r\n",
        upstream.url("/left-while-queued")
    );
    tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes())
        .await
        .unwrap();
    wait_queued(&proxy, "once", 1).await;
    drop(stream);
    let lines = access_lines("/left-while-queued", 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(field(&lines[0], "status"), "499", "{}", lines[0]);
    assert_eq!(field(&lines[0], "answered"), "client-left", "{}", lines[0]);
    assert_eq!(field(&lines[0], "group"), "once", "{}", lines[0]);
    assert_eq!(upstream.paths(), vec!["/first".to_string()]);
    proxy.shutdown().await;
}
