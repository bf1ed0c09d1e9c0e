//! Operating tollgate: the admin dashboard as a real browser renders it, the `health`
//! subcommand a container runs, log lines without colour codes in a file, and the
//! compose file.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

use crate::support::*;

mod dashboard;

// ---------------------------------------------------------------------------------
// The dashboard
// ---------------------------------------------------------------------------------

/// Debian's `chromium` (scripts/test installs it).
fn chromium() -> PathBuf {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join("chromium"))
        .find(|p| p.is_file());
    found.expect("chromium is needed by this test: run scripts/test, which installs it")
}

/// Runs headless Chromium on `url` with `args`, bounded by [`BOUND`]; returns stdout.
async fn headless(url: &str, args: &[&str]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = clean_command(chromium().to_str().unwrap(), &[]);
    cmd.args([
        "--headless",
        // Tests run as root in CI containers, where Chromium's sandbox cannot start.
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--hide-scrollbars",
        "--window-size=1000,600",
        // Virtual time runs the page's timers at once and waits for its fetches: the
        // page has polled when the budget is spent, however slow the machine.
        "--virtual-time-budget=3000",
        // The page's console (script errors, failed fetches) goes to stderr, checked
        // below.
        "--enable-logging=stderr",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .args(args)
    .arg(url)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let child = cmd.spawn().expect("chromium starts");
    let out = tokio::time::timeout(BOUND, child.wait_with_output())
        .await
        .expect("chromium finished in time")
        .expect("chromium ran");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let console: Vec<&str> = stderr.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(
        console.is_empty(),
        "the page wrote to its console: {console:#?}"
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The text of the element of `section` that has `data-field="<field>"`.
fn field<'a>(section: &'a str, field: &str) -> &'a str {
    let tag = format!("data-field=\"{field}\"");
    let at = section
        .find(&tag)
        .unwrap_or_else(|| panic!("no {field} in {section}"));
    let text = &section[at..];
    let text = &text[text.find('>').unwrap() + 1..];
    &text[..text.find('<').unwrap()]
}

/// The `<section>` the dashboard drew for `group`.
fn group_section<'a>(dom: &'a str, group: &str) -> &'a str {
    let at = dom
        .find(&format!("data-group=\"{group}\""))
        .unwrap_or_else(|| panic!("no section for {group} in the dashboard:\n{dom}"));
    let section = &dom[at..];
    &section[..section.find("</section>").unwrap()]
}

/// A group that counts tokens: the dashboard shows its bucket and the usage its
/// upstream's answer reported, as `/status` has them.
#[tokio::test]
async fn dashboard_shows_the_tokens_of_a_group_that_counts_them() {
    let answer = r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":34}}"#;
    let upstream = Upstream::start(move |_| Reply::ok(answer)).await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "llm"
        hosts = ["127.0.0.1"]
        tokens = "6000/m"
        "#,
    )
    .await;
    let client = reqwest_via(&proxy, None);
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":50}"#;
    let sent = client
        .post(upstream.url("/v1/chat/completions"))
        .body(body)
        .send();
    let answered = sent.await.unwrap();
    assert_eq!(answered.text().await.unwrap(), answer);
    let status: serde_json::Value =
        serde_json::from_str(&admin_get(&proxy, "/status").await).unwrap();
    let tokens = &status["groups"][0]["tokens"];
    assert_eq!(
        (
            tokens["used_input"].as_u64(),
            tokens["used_output"].as_u64()
        ),
        (Some(12), Some(34))
    );
    assert_eq!(tokens["buckets"][0]["capacity"], 6000);
    // No request rate holds it: no pace in force, and no series that reads as 0.
    let llm = &status["groups"][0];
    assert_eq!(llm["pace_in_force_per_second"], serde_json::Value::Null);
    assert_eq!(llm["pace_reason"], "no request rate: tokens hold it");
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(!metrics.contains("tollgate_pace_in_force{"), "{metrics}");

    let url = format!("http://{}/", proxy.admin.unwrap());
    let dom = headless(&url, &["--dump-dom"]).await;
    let section = group_section(&dom, "llm");
    assert!(field(section, "tokens").starts_with("total "), "{section}");
    assert!(
        field(section, "tokens").ends_with("/ 6000 at 100/s (configured)"),
        "{section}"
    );
    assert_eq!(
        field(section, "tokens_used"),
        "12 in + 34 out; 0 reserved now"
    );
}

/// One slow group with one request gone and three waiting: the dashboard, loaded in
/// Chromium, shows them, and a screenshot is kept as `dashboard.png` in cargo's
/// directory for test artifacts (`target/tmp/` unless `CARGO_TARGET_DIR` moves it).
#[tokio::test]
async fn dashboard_shows_a_group_with_traffic_in_a_browser() {
    let upstream = Upstream::start(|_| Reply::ok("done")).await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "slow"
        hosts = ["127.0.0.1"]
        rate = "1/m"
        concurrency = 4
        max_wait = "5m"
        "#,
    )
    .await;
    let client = reqwest_via(&proxy, None);
    let mut waiting = Vec::new();
    for i in 0..4 {
        let request = client.get(upstream.url(&format!("/{i}"))).send();
        waiting.push(tokio::spawn(request));
        if i == 0 {
            // The first takes the slot, so exactly three wait behind it.
            upstream.wait_for_requests(1).await;
        }
    }
    wait_queued(&proxy, "slow", 3).await;
    assert_eq!(upstream.requests().len(), 1);

    let status: serde_json::Value =
        serde_json::from_str(&admin_get(&proxy, "/status").await).unwrap();
    let slow = &status["groups"][0];
    assert_eq!(slow["name"], "slow");
    assert_eq!(slow["counters"]["departures"], 1);
    assert_eq!(slow["counters"]["requests_admitted"], 1);
    assert_eq!(slow["pace_reason"], "configured rate");
    assert_eq!(slow["queued"], 3);
    assert_eq!(slow["concurrency"], 4);
    assert_eq!(status["backend"]["kind"], "memory");
    let per_second = slow["configured_rates_per_second"][0].as_f64().unwrap();
    assert!((per_second - 1.0 / 60.0).abs() < 1e-9, "{per_second}");

    let url = format!("http://{}/", proxy.admin.unwrap());
    let dom = headless(&url, &["--dump-dom"]).await;
    assert!(
        dom.contains("data-polls="),
        "the page never rendered /status:\n{dom}"
    );
    let section = group_section(&dom, "slow");
    assert_eq!(field(section, "queued"), "3");
    assert_eq!(field(section, "in_flight"), "0");
    assert_eq!(field(section, "departures"), "1");
    assert_eq!(field(section, "rate"), "1/min");
    assert_eq!(field(section, "pace_reason"), "configured rate");
    assert!(field(section, "pushbacks").starts_with("0 pauses"));

    let png = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&png);
    headless(&url, &[&format!("--screenshot={}", png.display())]).await;
    let bytes = std::fs::read(&png).expect("chromium wrote the screenshot");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");

    // Still exactly one sent: the page only reads.
    assert_eq!(upstream.requests().len(), 1);
    for request in waiting {
        request.abort();
    }
    proxy.shutdown().await;
}

/// An upstream that pushed back with `Retry-After: 600`: the card counts the pause
/// down and highlights the push-back, while the request waits to be replayed.
#[tokio::test]
async fn dashboard_shows_a_pause_in_a_browser() {
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = answered.clone();
    let upstream =
        Upstream::start(
            move |_| match count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
                0 => Reply::status(429).header("retry-after", "600"),
                _ => Reply::ok("done"),
            },
        )
        .await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "pushy"
        hosts = ["127.0.0.1"]
        max_wait = "15m"
        max_pause = "15m"
        "#,
    )
    .await;
    let request = tokio::spawn(reqwest_via(&proxy, None).get(upstream.url("/")).send());
    // Paused, with the request queued again for its replay.
    wait_queued(&proxy, "pushy", 1).await;
    let status: serde_json::Value =
        serde_json::from_str(&admin_get(&proxy, "/status").await).unwrap();
    let pushy = &status["groups"][0];
    assert_eq!(pushy["counters"]["pauses"], 1, "{status}");
    assert!(
        pushy["paused_for_seconds"].as_f64().unwrap() > 500.0,
        "{status}"
    );
    // Paused, it keeps to nothing: 0, and the reason says for how long.
    assert_eq!(pushy["pace_in_force_per_second"], 0.0, "{status}");
    let reason = pushy["pace_reason"].as_str().unwrap();
    assert!(
        reason.starts_with("paused by the upstream for "),
        "{reason}"
    );
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(
        metrics.contains("tollgate_pace_in_force{group=\"pushy\"} 0.0"),
        "{metrics}"
    );

    let dom = headless(
        &format!("http://{}/", proxy.admin.unwrap()),
        &["--dump-dom"],
    )
    .await;
    let section = group_section(&dom, "pushy");
    assert!(
        dom.contains("class=\"group paused\" data-group=\"pushy\""),
        "{section}"
    );
    let pause = field(section, "pause");
    let seconds: f64 = pause
        .strip_prefix("paused ")
        .and_then(|p| p.strip_suffix(" s"))
        .unwrap_or_else(|| panic!("pause shows {pause:?}"))
        .parse()
        .unwrap();
    assert!(seconds > 500.0 && seconds <= 600.0, "{pause}");
    assert!(
        section.contains("class=\"hot\" data-field=\"pushbacks\"")
            || section.contains("data-field=\"pushbacks\" class=\"hot\""),
        "{section}"
    );
    assert!(field(section, "pushbacks").starts_with("1 pauses"));
    assert_eq!(field(section, "rate"), "0/s");
    let reason = field(section, "pace_reason");
    assert!(
        reason.starts_with("paused by the upstream for "),
        "{reason}"
    );
    assert_eq!(answered.load(std::sync::atomic::Ordering::SeqCst), 1);
    request.abort();
    proxy.shutdown().await;
}

/// How the page shows a rate of at least 1 per second (dashboard.html's `num`).
fn shown_per_second(x: f64) -> String {
    if (x - x.round()).abs() < 1e-9 * x {
        format!("{}/s", x.round())
    } else if x >= 100.0 {
        format!("{x:.0}/s")
    } else if x >= 10.0 {
        format!("{x:.1}/s")
    } else {
        format!("{x:.2}/s")
    }
}

/// A group configured at 20/s whose upstream refused its first request keeps to the
/// pace it learned: `/status`, `/metrics` and the page show that pace and why, not
/// the configured rate; and the replay counts as a second departure of one request.
#[tokio::test]
async fn dashboard_shows_the_learned_pace_in_force_not_the_configured_rate() {
    let answered = std::sync::atomic::AtomicUsize::new(0);
    let upstream = Upstream::start(move |_| {
        match answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => Reply::status(429),
            _ => Reply::ok("ok"),
        }
    })
    .await;
    let proxy = start_proxy_with_admin(
        r#"
        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        rate = "20/s"
        retry_statuses = [429]
        "#,
    )
    .await;
    let reply = reqwest_via(&proxy, None).get(upstream.url("/")).send();
    assert_eq!(reply.await.unwrap().status(), 200);
    let status: serde_json::Value =
        serde_json::from_str(&admin_get(&proxy, "/status").await).unwrap();
    let api = &status["groups"][0];
    assert_eq!(api["phase"], "paced", "{api}");
    let learned = api["pace_per_second"].as_f64().unwrap();
    assert!((1.0..20.0).contains(&learned), "{api}");
    assert_eq!(api["pace_in_force_per_second"].as_f64(), Some(learned));
    assert_eq!(api["pace_reason"], "learned from refusals", "{api}");
    assert_eq!(api["counters"]["departures"], 2, "{api}");
    assert_eq!(api["counters"]["requests_admitted"], 1, "{api}");
    let metrics = admin_get(&proxy, "/metrics").await;
    let exported = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tollgate_pace_in_force{group=\"api\"} "))
        .unwrap_or_else(|| panic!("no pace in force:\n{metrics}"));
    assert_eq!(exported.parse::<f64>().ok(), Some(learned), "{metrics}");

    let dom = headless(
        &format!("http://{}/", proxy.admin.unwrap()),
        &["--dump-dom"],
    )
    .await;
    let section = group_section(&dom, "api");
    assert_eq!(
        field(section, "rate"),
        shown_per_second(learned),
        "{section}"
    );
    assert_eq!(field(section, "pace_reason"), "learned from refusals");
    assert!(section.contains("(configured 20/s)"), "{section}");
    assert_eq!(field(section, "departures"), "2");
    proxy.shutdown().await;
}

/// The page is self-contained (no CDN, nothing to build) and /status stays JSON.
#[tokio::test]
async fn dashboard_page_loads_nothing_from_elsewhere() {
    let proxy = start_proxy_with_admin("").await;
    let html = admin_get(&proxy, "/").await;
    assert!(html.starts_with("<!doctype html>"));
    assert!(html.contains("fetch(\"status\""));
    for external in ["<script src", "<link", "@import", "https://"] {
        assert!(!html.contains(external), "the dashboard loads {external}");
    }
    let status: serde_json::Value =
        serde_json::from_str(&admin_get(&proxy, "/status").await).unwrap();
    assert_eq!(status["groups"], serde_json::json!([]));
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------
// The binary: `tollgate health`, and its log lines
// ---------------------------------------------------------------------------------

/// `tollgate health --url <url> [--timeout s]`: its exit code and stderr, bounded.
async fn health(url: &str, timeout: &str) -> (Option<i32>, String) {
    let mut cmd = clean_command(env!("CARGO_BIN_EXE_tollgate"), &[]);
    cmd.args(["health", "--url", url, "--timeout", timeout])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("tollgate health returned in time")
        .expect("tollgate health ran");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn health_exits_0_only_on_a_200() {
    let proxy = start_proxy_with_admin("").await;
    let admin = proxy.admin.unwrap();

    let (code, stderr) = health(&format!("http://{admin}/healthz"), "10").await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stderr, "");

    let (code, stderr) = health(&format!("http://{admin}/nothing-here"), "10").await;
    assert_eq!(code, Some(1));
    assert!(stderr.contains("answered 404"), "{stderr}");

    let (code, stderr) = health(
        &format!("http://{}/healthz", ClosedPort::new().addr()),
        "10",
    )
    .await;
    assert_eq!(code, Some(1));
    assert!(stderr.contains("refused"), "{stderr}");

    let (code, stderr) = health("https://127.0.0.1:1/healthz", "10").await;
    assert_eq!(code, Some(1));
    assert!(stderr.contains("not an http:// URL"), "{stderr}");
    proxy.shutdown().await;
}

/// A listener that accepts and never answers: the check gives up after its timeout
/// instead of hanging the container's health probe.
#[tokio::test]
async fn health_gives_up_on_a_silent_server() {
    let silent = Silent::start().await;
    let started = Instant::now();
    let (code, stderr) = health(&format!("http://{}/healthz", silent.addr()), "0.5").await;
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains("timed out") || stderr.contains("within"),
        "{stderr}"
    );
    // Far below BOUND: the timeout, not the test's bound, ended it.
    assert!(started.elapsed() < BOUND / 2, "{:?}", started.elapsed());
}

/// Log lines written to a file carry no ANSI escape codes.
#[tokio::test]
async fn logs_to_a_file_have_no_colour_codes() {
    let tollgate = Tollgate::start("[proxy]\n").await;
    let text = tollgate.log().into_bytes();
    let shown = String::from_utf8_lossy(&text);
    assert!(shown.contains("INFO"), "{shown}");
    assert!(
        !text.contains(&0x1b),
        "escape codes in the log file:\n{shown:?}"
    );
}

// ---------------------------------------------------------------------------------
// compose.yaml (no Docker engine here: scripts/check-compose checks what it can)
// ---------------------------------------------------------------------------------

/// `scripts/check-compose` on `compose`: its exit code and stderr.
async fn check_compose(compose: &Path) -> (Option<i32>, String) {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut cmd = clean_command("python3", &[]);
    cmd.arg(format!("{root}/scripts/check-compose"))
        .args(["--tollgate", env!("CARGO_BIN_EXE_tollgate")])
        .arg(compose)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("check-compose returned in time")
        .expect("check-compose ran");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), stderr)
}

#[tokio::test]
async fn compose_file_is_consistent() {
    let compose = Path::new(env!("CARGO_MANIFEST_DIR")).join("compose.yaml");
    let (code, stderr) = check_compose(&compose).await;
    assert_eq!(code, Some(0), "{stderr}");
}

/// The check is not a formality: a copy with a missing file, an admin listener the
/// published port cannot reach and a Redis host that is no service fails it.
#[tokio::test]
async fn compose_check_finds_what_is_broken() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(root.join("compose.yaml"), dir.path().join("compose.yaml")).unwrap();
    std::fs::copy(root.join("Dockerfile"), dir.path().join("Dockerfile")).unwrap();
    let config = std::fs::read_to_string(root.join("deploy/compose/tollgate.toml")).unwrap();
    let config = config
        .replace("listen = \"0.0.0.0:9090\"", "listen = \"127.0.0.1:9090\"")
        .replace("redis://redis:", "redis://elsewhere:");
    std::fs::create_dir_all(dir.path().join("deploy/compose")).unwrap();
    write_file(&dir.path().join("deploy/compose"), "tollgate.toml", &config);
    // scripts/demo-upstream.py is left out.
    let (code, stderr) = check_compose(&dir.path().join("compose.yaml")).await;
    assert_eq!(code, Some(1), "{stderr}");
    for problem in [
        "./scripts/demo-upstream.py does not exist",
        "[admin] listen '127.0.0.1:9090' is unreachable",
        "url names 'elsewhere', not a compose service",
    ] {
        assert!(stderr.contains(problem), "{problem} not in:\n{stderr}");
    }
}

// ---------------------------------------------------------------------------------
// A second instance on the same port
// ---------------------------------------------------------------------------------

/// A second tollgate started on the port a first one serves exits at once, non-zero,
/// naming the port, before it listens: with `SO_REUSEPORT` the kernel would split the
/// connections between two processes that each keep a budget of their own. The first
/// serves every request after. `--reuse-port` shares the port on purpose.
#[tokio::test]
async fn a_second_instance_on_a_served_port_refuses_to_start_unless_told_to_share() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let first = Tollgate::launch("[proxy]\n")
        .arg("--worker-threads")
        .arg("2")
        .start()
        .await;
    let port = first.addr.port();
    let dir = tempfile::tempdir().unwrap();
    let config = write_file(dir.path(), "config.toml", &allowing_loopback("[proxy]\n"));
    let listen = format!("127.0.0.1:{port}");
    let mut second = clean_command(env!("CARGO_BIN_EXE_tollgate"), &[]);
    second
        .arg("--config")
        .arg(&config)
        .args(["--listen", &listen, "--worker-threads", "2"])
        .stdout(Stdio::null());
    let out = tokio::time::timeout(BOUND, second.output())
        .await
        .expect("the second instance exits instead of serving")
        .expect("runs");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains(&format!("port {port} is already served")) && said.contains("--reuse-port"),
        "{said}"
    );
    for i in 0..20 {
        let url = upstream.url(&format!("/n/{i}"));
        let got = curl(&["-x", &first.url(), &url], &[]).await;
        assert_eq!(got.status, 200, "{i}");
    }
    assert_eq!(upstream.requests().len(), 20);
    // Told to share, it starts on the same port.
    let shared = Tollgate::launch("[proxy]\n")
        .without_listen_flag()
        .arg("--listen")
        .arg(&listen)
        .arg("--worker-threads")
        .arg("2")
        .arg("--reuse-port")
        .start()
        .await;
    assert_eq!(shared.addr.port(), port);
}
