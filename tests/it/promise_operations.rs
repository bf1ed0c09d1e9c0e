//! README, "Build, run, test", Configuration and Operations: what the built binary
//! does as a process. Its two ready lines, where it listens (`listen`, `--listen`,
//! `TOLLGATE_LISTEN`), the admin listener only with `[admin] listen`, exit 64 on a bad
//! file with `file:line:column`, SIGINT ending it like SIGTERM, and `ca init`.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use crate::promises::{client, get, group_status, send};
use crate::support::*;

#[tokio::test]
async fn ready_it_logs_the_admin_line_then_the_proxy_line_with_one_thread_per_core() {
    let tollgate = Tollgate::start(ADMIN_ON_PORT_0).await;
    let log = tollgate.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" INFO tollgate: "))
        .collect();
    let admin = tollgate.admin.expect("admin line");
    let cores = std::thread::available_parallelism().unwrap().get();
    assert!(
        lines.len() >= 2
            && lines[0].ends_with(&format!(
                "INFO tollgate: admin endpoints listening listen={admin}"
            ))
            && lines[1].ends_with(&format!(
                "INFO tollgate: tollgate listening listen={} threads={cores}",
                tollgate.addr
            )),
        "{log}"
    );
    // Each line starts with its UTC time, as README shows.
    let stamp = lines[1].split_whitespace().next().unwrap();
    assert!(
        stamp.len() > 20 && stamp.ends_with('Z') && stamp.as_bytes()[10] == b'T',
        "{stamp}"
    );
}

#[tokio::test]
async fn tollgate_listen_and_the_flag_override_the_config_s_listen() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let config = "[proxy]\nlisten = \"127.0.0.2:0\"\n";
    let loopback = |n: u8| IpAddr::V4(Ipv4Addr::new(127, 0, 0, n));

    // The config alone.
    let from_file = Tollgate::launch(config).without_listen_flag().start().await;
    assert_eq!(from_file.addr.ip(), loopback(2), "{}", from_file.log());
    // TOLLGATE_LISTEN over the file; its log says the port the kernel chose.
    let from_env = Tollgate::launch(config)
        .without_listen_flag()
        .env("TOLLGATE_LISTEN", "127.0.0.1:0")
        .start()
        .await;
    assert_eq!(from_env.addr.ip(), loopback(1), "{}", from_env.log());
    assert_ne!(from_env.addr.port(), 0);
    // --listen over the file (and over the environment).
    let from_flag = Tollgate::launch(config)
        .env("TOLLGATE_LISTEN", "127.0.0.3:0")
        .start()
        .await;
    assert_eq!(from_flag.addr.ip(), loopback(1), "{}", from_flag.log());

    // Each serves where its log says.
    for tollgate in [&from_file, &from_env, &from_flag] {
        assert_eq!(get(tollgate, &upstream.url("/")).await.status, 200);
    }
    assert_eq!(upstream.requests().len(), 3);
}

/// The TCP ports process `pid` listens on, from /proc: its socket descriptors matched
/// against the kernel's table of listening sockets.
fn listening_ports(pid: u32) -> BTreeSet<u16> {
    let listening: std::collections::HashMap<String, u16> = (tcp_sockets().into_iter())
        .filter(|s| s.state == TCP_LISTEN)
        .map(|s| (s.inode, s.local.port()))
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's descriptors")
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?;
            listening.get(inode).copied()
        })
        .collect()
}

#[tokio::test]
async fn the_admin_endpoints_listen_only_with_admin_listen() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let without = Tollgate::start("").await;
    assert_eq!(
        listening_ports(without.pid()),
        BTreeSet::from([without.addr.port()]),
        "the proxy's port alone"
    );
    assert!(!without.log().contains("admin"), "{}", without.log());

    let with = Tollgate::start(ADMIN_ON_PORT_0).await;
    let admin = with.admin.expect("admin listening");
    assert_eq!(
        listening_ports(with.pid()),
        BTreeSet::from([with.addr.port(), admin.port()])
    );
    assert_eq!(get(&with, &upstream.url("/seen")).await.status, 200);
    let (status, body) = with.admin("/healthz").await;
    assert_eq!(status, 200, "{body}");
    let (status, page) = with.admin("/").await;
    assert_eq!(status, 200);
    assert!(page.contains("<html"), "the dashboard");
    // /metrics has the upstream's statuses and latency; /status is JSON.
    let (_, metrics) = with.admin("/metrics").await;
    assert!(
        metrics.contains("tollgate_upstream_responses_total{group=\"127.0.0.1\",status=\"200\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tollgate_upstream_duration_seconds_count{group=\"127.0.0.1\"} 1"),
        "{metrics}"
    );
    let status = group_status(&with, "127.0.0.1").await;
    assert_eq!(status["counters"]["departures"], 1, "{status}");
    assert_eq!(status["counters"]["requests_admitted"], 1, "{status}");
    // The proxy port does not serve the admin endpoints.
    let on_proxy = reqwest_direct()
        .get(format!("{}/metrics", with.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(on_proxy.status(), 404);
}

/// Runs the binary on a config file holding `toml`, returns its exit code and stderr.
async fn run_with(toml: &str) -> (Option<i32>, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(dir.path(), "tollgate.toml", toml);
    let mut cmd = clean_command(env!("CARGO_BIN_EXE_tollgate"), &[]);
    cmd.arg("--config")
        .arg(&path)
        .args(["--listen", "127.0.0.1:0"]);
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("exits")
        .expect("runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        path.display().to_string(),
    )
}

#[tokio::test]
async fn a_bad_config_at_start_exits_64_naming_file_line_and_column() {
    let cases = [
        // An unknown key, at its line and column.
        (
            "[proxy]\nconnect_timeout = \"1s\"\nlisen = \"x\"\n",
            3,
            1,
            "lisen",
        ),
        // A bad value in a [[limit]].
        (
            "[[limit]]\nname = \"a\"\nhosts = [\"a.example\"]\nrate = \"ten/s\"\n",
            4,
            8,
            "invalid rate",
        ),
        // A bad duration.
        ("[defaults]\nmax_wait = \"soon\"\n", 2, 12, "soon"),
        // adaptive without a rate.
        (
            "[[limit]]\nname = \"a\"\nhosts = [\"a.example\"]\nadaptive = true\n",
            4,
            12,
            "adaptive",
        ),
    ];
    for (toml, line, column, says) in cases {
        let (code, stderr, path) = run_with(toml).await;
        assert_eq!(code, Some(64), "{toml}: {stderr}");
        let at = format!("tollgate: {path}:{line}:{column}: ");
        assert!(
            stderr.starts_with(&at) && stderr.contains(says),
            "{toml}: expected {at:?} … {says:?}, got {stderr}"
        );
        assert!(!stderr.contains("listening"), "{stderr}");
    }
    // The same file with the mistake fixed starts.
    let tollgate = Tollgate::start("[proxy]\nconnect_timeout = \"1s\"\n").await;
    assert!(tollgate.log().contains("tollgate listening"));
}

#[tokio::test]
async fn sigint_ends_it_like_sigterm() {
    // One request in flight (the upstream takes 1 s), one waiting at 1/m.
    let upstream = Upstream::start(|s| {
        let delay = if s.path == "/in-flight" { 1000 } else { 0 };
        Reply::ok("served").delay(Duration::from_millis(delay))
    })
    .await;
    let config = format!(
        "[proxy]\nshutdown_grace = \"3s\"\n{ADMIN_ON_PORT_0}\n\
         [[limit]]\nname = \"slow\"\nhosts = [\"{}\"]\nrate = \"1/m\"\nmax_wait = \"1h\"\n",
        upstream.authority()
    );
    let mut tollgate = Tollgate::start(&config).await;
    let client = client(&tollgate);
    let in_flight = {
        let (client, url) = (client.clone(), upstream.url("/in-flight"));
        tokio::spawn(async move { send(&client, "GET", &url).await })
    };
    upstream.wait_for_requests(1).await;
    let queued = {
        let (client, url) = (client.clone(), upstream.url("/queued"));
        tokio::spawn(async move { send(&client, "GET", &url).await })
    };
    tollgate
        .wait_metric("tollgate_queue_depth{group=\"slow\"}", 1.0)
        .await;
    assert_eq!(upstream.in_flight(), 1);

    tollgate.signal("INT").await;
    // It stops accepting at once ...
    wait_until_refused(tollgate.addr).await;
    // ... lets the request in flight finish, answers the queued one 503, exits 0.
    let finished = in_flight.await.unwrap();
    assert_eq!((finished.status, finished.body.as_str()), (200, "served"));
    let refused = queued.await.unwrap();
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(
        refused.header("proxy-status"),
        Some("tollgate; error=proxy_internal_error; details=\"shutting down\"")
    );
    assert_eq!(refused.header("retry-after"), Some("1"));
    let status = tollgate.wait_exit().await;
    assert_eq!(status.code(), Some(0), "{}", tollgate.log());
    assert_eq!(upstream.paths(), ["/in-flight"]);
}

#[tokio::test]
async fn ca_init_writes_the_certificate_and_a_private_key_and_says_how_to_trust_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let ca_dir = dir.path().join("ca");
    let mut cmd = clean_command(env!("CARGO_BIN_EXE_tollgate"), &[]);
    cmd.args(["ca", "init", "--dir"]).arg(&ca_dir);
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let mode = |name: &str| {
        std::fs::metadata(ca_dir.join(name))
            .unwrap()
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode("ca-key.pem"), 0o600);
    let cert = std::fs::read_to_string(ca_dir.join("ca.pem")).unwrap();
    assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{cert}");
    let said = String::from_utf8_lossy(&out.stdout);
    let ca = ca_dir.join("ca.pem").display().to_string();
    for line in [
        "[intercept]".to_string(),
        format!("REQUESTS_CA_BUNDLE={ca}"),
        format!("NODE_EXTRA_CA_CERTS={ca}"),
        format!("cp {ca} /usr/local/share/ca-certificates/tollgate.crt"),
        "update-ca-certificates".to_string(),
        "keytool -importcert".to_string(),
    ] {
        assert!(said.contains(&line), "{line:?} in:\n{said}");
    }
}

/// Runs `tollgate check-config FILE` and returns its exit code and output.
async fn check_config(file: &std::path::Path) -> (Option<i32>, String) {
    let mut cmd = clean_command(env!("CARGO_BIN_EXE_tollgate"), &[]);
    cmd.arg("check-config").arg(file);
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("exits")
        .expect("runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[tokio::test]
async fn the_shipped_config_the_readme_demo_and_every_value_form_pass_check_config() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let (code, said) = check_config(&root.join("config.toml")).await;
    assert_eq!(code, Some(0), "{said}");
    assert!(said.ends_with("config.toml: ok\n"), "{said}");

    // demo.toml as docs/try-it.md writes it, taken from the page itself.
    let page = std::fs::read_to_string(root.join("docs/try-it.md")).unwrap();
    let demo = page
        .split_once("cat > /tmp/demo.toml <<'EOF'\n")
        .and_then(|(_, rest)| rest.split_once("\nEOF\n"))
        .map(|(toml, _)| toml)
        .expect("docs/try-it.md's demo.toml");
    let dir = tempfile::tempdir().unwrap();
    let (code, said) = check_config(&write_file(dir.path(), "demo.toml", demo)).await;
    assert_eq!(code, Some(0), "{demo}\n{said}");
    // And the token budgets of docs/tokens.md's example.
    let page = std::fs::read_to_string(root.join("docs/tokens.md")).unwrap();
    let tokens = page
        .split_once("```toml\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(toml, _)| toml)
        .expect("docs/tokens.md's example");
    let (code, said) = check_config(&write_file(dir.path(), "tokens.toml", tokens)).await;
    assert_eq!(code, Some(0), "{tokens}\n{said}");

    // Durations and sizes in every form README names; a duration over a year is not.
    let forms = "[proxy]\nconnect_timeout = \"250ms\"\nresponse_timeout = \"10s\"\n\
                 client_header_timeout = \"5m\"\nshutdown_grace = \"1h 30m\"\n\
                 replay_memory = \"1MiB\"\n[defaults]\nmax_replay_body = \"64KiB\"\n\
                 rate = \"100/10s\"\n[[limit]]\nname = \"forms\"\nhosts = [\"a.example\"]\n\
                 max_replay_body = 4096\nrate = [\"5/s\", \"600/m\", \"5000/h\", \"20000/d\"]\n";
    let (code, said) = check_config(&write_file(dir.path(), "forms.toml", forms)).await;
    assert_eq!(code, Some(0), "{said}");
    let too_long = "[defaults]\nmax_wait = \"400days\"\n";
    let file = write_file(dir.path(), "long.toml", too_long);
    let (code, said) = check_config(&file).await;
    assert_eq!(code, Some(64), "{said}");
    assert!(said.contains("long.toml:2:"), "{said}");
}
