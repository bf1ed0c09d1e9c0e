//! Shutdown: new connections are refused at once, requests and tunnels already in
//! flight finish, and the `tollgate` binary checks configs and stops on SIGTERM.

use std::time::Duration;

use crate::support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_request_completes_and_new_connections_are_refused() {
    let upstream =
        Upstream::start(|_| Reply::ok("worth the wait").delay(Duration::from_secs(1))).await;
    let mut proxy = start_proxy("").await;
    let (proxy_url, url) = (proxy.url(), upstream.url("/slow"));
    let client = tokio::spawn(async move { curl(&["-x", &proxy_url, &url], &[]).await });
    wait_in_flight(&upstream, 1).await;

    proxy.begin_shutdown();
    wait_until_refused(proxy.addr).await;
    let out = client.await.unwrap();
    assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);
    assert_eq!(out.text(), "worth the wait");
    assert_eq!(upstream.requests().len(), 1);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_body_in_progress_is_finished() {
    let upstream = Upstream::start_bulk().await;
    let mut proxy = start_proxy("").await;
    let len = 4 * 1024 * 1024u64;
    let half = len / 2;
    let client = reqwest_via(&proxy, None);
    let mut resp = client
        .get(upstream.url(&format!("/bytes/{len}?hold={half}")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut hasher = Hasher::default();
    let mut got = 0;
    while got < half {
        let chunk = resp.chunk().await.unwrap().expect("first half");
        got += chunk.len() as u64;
        hasher.update(&chunk);
    }

    // Half the body is out and the upstream holds the rest back: shut down now.
    proxy.begin_shutdown();
    wait_until_refused(proxy.addr).await;
    assert!(
        !proxy.is_finished(),
        "run returned with a response still streaming"
    );
    upstream.release();
    while let Some(chunk) = resp.chunk().await.unwrap() {
        hasher.update(&chunk);
    }
    assert_eq!(hasher.finish(), pattern_digest(len));
    drop(client);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_tunnel_is_drained_before_run_returns() {
    let ca = TestCa::new();
    let upstream = Upstream::start_tls(
        |seen| Reply::ok(seen.body.clone()).delay(Duration::from_secs(1)),
        &ca,
    )
    .await;
    // A grace far beyond the test's bound: run() may only return because the tunnel closed.
    let mut proxy =
        start_proxy("[proxy]\nconnect_ports = [\"*\"]\nshutdown_grace = \"1h\"\n").await;
    let (proxy_url, url) = (proxy.url(), upstream.url("/tunnelled"));
    let cacert = ca.ca_pem_path();
    let client = tokio::spawn(async move {
        let cacert = cacert.to_str().unwrap();
        let args = ["--cacert", cacert, "--data-binary", "through", &url];
        curl(&args, &[("https_proxy", &proxy_url)]).await
    });
    wait_in_flight(&upstream, 1).await;

    proxy.begin_shutdown();
    wait_until_refused(proxy.addr).await;
    let out = client.await.unwrap();
    assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);
    assert_eq!(out.text(), "through");
    assert_eq!(&upstream.requests()[0].body[..], b"through");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_client_does_not_hold_up_shutdown() {
    let upstream = Upstream::echo().await;
    let proxy = start_proxy("[proxy]\nshutdown_grace = \"1h\"\n").await;
    let client = reqwest_via(&proxy, None);
    let resp = client.get(upstream.url("/once")).send().await.unwrap();
    assert_eq!(resp.text().await.unwrap(), "");
    // The client keeps its idle connection to the proxy open; shutdown closes it instead
    // of waiting an hour (support::Proxy::shutdown panics past its bound).
    proxy.shutdown().await;
    assert_eq!(upstream.requests().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sent_nothing_does_not_hold_up_shutdown() {
    // A health check's TCP connect, a browser's preconnect: connected, nothing sent yet.
    // It has asked nothing, so shutdown closes it at once instead of waiting an hour.
    let proxy = start_proxy_with_admin(
        "[proxy]\nshutdown_grace = \"1h\"\nclient_header_timeout = \"1h\"\n",
    )
    .await;
    let mut silent = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    // Once the proxy has accepted it (the version peek is waiting), shut down: a
    // connection still in the listen queue would pass without proving anything.
    wait_metric_line(&proxy, "tollgate_client_connections 1").await;
    proxy.shutdown().await;
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(BOUND, silent.read(&mut byte))
        .await
        .expect("the proxy closed the silent connection");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_still_open_after_the_grace_period_are_closed() {
    let upstream = Upstream::echo().await;
    let proxy = start_proxy("[proxy]\nconnect_ports = [\"*\"]\nshutdown_grace = \"500ms\"\n").await;
    let target = upstream.authority();
    let mut tunnel = TcpStream::connect(proxy.addr).await.unwrap();
    let connect = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    tunnel.write_all(connect.as_bytes()).await.unwrap();
    let mut head = [0u8; 12];
    tunnel.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    // Read the rest of the CONNECT answer's head.
    let mut rest = Vec::new();
    while !rest.ends_with(b"\r\n\r\n") {
        rest.push(tunnel.read_u8().await.unwrap());
    }

    // The tunnel stays idle past the grace period; run() gives up waiting for it...
    proxy.shutdown().await;
    // ...and the tunnel must be gone with it, as the "closing what is still open" log
    // line says: writing to it finds a closed connection, not the upstream.
    let request = format!("GET /after HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n");
    let _ = tunnel.write_all(request.as_bytes()).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(BOUND, tunnel.read_to_end(&mut answer)).await;
    assert!(
        upstream.requests().is_empty(),
        "a request went through the tunnel after run() returned: {}",
        String::from_utf8_lossy(&answer)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_still_in_flight_after_the_grace_period_are_cut() {
    let upstream = Upstream::start(|_| Reply::ok("too late").delay(Duration::from_secs(3))).await;
    let proxy = start_proxy("[proxy]\nshutdown_grace = \"500ms\"\n").await;
    let client = reqwest_via(&proxy, None);
    let url = upstream.url("/slow");
    let request = tokio::spawn(async move { client.get(url).send().await });
    wait_in_flight(&upstream, 1).await;
    // The request outlives the grace period; run() gives up on it and returns...
    proxy.shutdown().await;
    // ...and the client must see its connection cut, not the answer arriving later.
    let outcome = request.await.unwrap();
    assert!(
        outcome.is_err(),
        "the request was still served after run() returned: {outcome:?}"
    );
}

// ---------------------------------------------------------------------------------
// The binary
// ---------------------------------------------------------------------------------

/// The `tollgate` binary with a clean environment (no proxy or TOLLGATE_* variables).
fn tollgate() -> tokio::process::Command {
    let mut cmd = clean_command(env!("CARGO_BIN_EXE_tollgate"), &[("RUST_LOG", "warn")]);
    cmd.env_remove("TOLLGATE_CONFIG")
        .env_remove("TOLLGATE_LISTEN");
    cmd
}

/// The value of `field` (e.g. "FDSize:") in /proc/<pid>/status.
fn proc_status(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line[field.len()..].trim().parse().unwrap()
}

/// The soft and hard limits on open files of process `pid`, from /proc/<pid>/limits
/// (`u64::MAX` for "unlimited").
fn open_files_limits(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let mut values = line["Max open files".len()..]
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(u64::MAX));
    (values.next().unwrap(), values.next().unwrap())
}

#[tokio::test]
async fn check_config_reports_file_line_column_and_exits_64() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write_file(
        dir.path(),
        "bad.toml",
        "[proxy]\nconnect_ports = [443]\n  conect_timeout = \"1s\"\n",
    );
    let out = tokio::time::timeout(BOUND, tollgate().arg("check-config").arg(&bad).output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains(&format!("{}:3:3:", bad.display())),
        "{stderr}"
    );
    assert!(stderr.contains("conect_timeout"), "{stderr}");

    let good = write_file(
        dir.path(),
        "good.toml",
        "[proxy]\nconnect_timeout = \"1s\"\n",
    );
    let out = tokio::time::timeout(BOUND, tollgate().arg("check-config").arg(&good).output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{}: ok\n", good.display())
    );
}

/// The binary's allocator is mimalloc, built to commit its arenas as they are used (the
/// setting in `.cargo/config.toml`): committed whole, 64 requests waiting on kept-alive
/// connections took 82 MiB instead of 13.5. mimalloc lists
/// its options on stderr when `MIMALLOC_VERBOSE` is set; the same option set in the
/// environment would hide a build without the setting, so it is removed.
#[tokio::test]
async fn binary_allocator_commits_arenas_as_they_are_used() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_file(dir.path(), "good.toml", "[proxy]\n");
    let out = tollgate()
        .env("MIMALLOC_VERBOSE", "1")
        .env_remove("MIMALLOC_ARENA_EAGER_COMMIT")
        .arg("check-config")
        .arg(&good)
        .output();
    let out = tokio::time::timeout(BOUND, out).await.unwrap().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("mimalloc: option 'arena_eager_commit': 0"),
        "mimalloc's options as the binary printed them:\n{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_and_exits_0_on_sigterm() {
    let upstream = Upstream::echo().await;
    let mut tollgate = Tollgate::start("[proxy]\nshutdown_grace = \"5s\"\n").await;
    let out = curl(
        &[
            "-x",
            &tollgate.url(),
            "--data-binary",
            "via binary",
            &upstream.url("/bin"),
        ],
        &[],
    )
    .await;
    assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);
    assert_eq!(out.text(), "via binary");
    assert_eq!(upstream.requests()[0].header("via"), Some("1.1 tollgate"));

    tollgate.signal("TERM").await;
    let status = tollgate.wait_exit().await;
    assert_eq!(status.code(), Some(0), "{}", tollgate.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_still_waiting_in_its_group_is_served_during_the_grace() {
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    let mut proxy = start_proxy_with_admin(
        r#"
        [proxy]
        shutdown_grace = "30s"

        [[limit]]
        name = "slow"
        hosts = ["127.0.0.1"]
        rate = "2/s"
        "#,
    )
    .await;
    take_the_slot(&proxy, &upstream).await;

    // A new connection's request waits for the next slot (before hyper reads it) when
    // shutdown begins; it was asked before the listener closed, so it is served.
    let (addr, authority) = (proxy.addr, upstream.authority());
    let waiting = tokio::spawn(async move {
        let get = format!("GET http://{authority}/waited HTTP/1.1\r\nHost: {authority}\r\n\r\n");
        raw_request(addr, get.as_bytes()).await
    });
    wait_queued(&proxy, "slow", 1).await;
    proxy.begin_shutdown();
    wait_until_refused(proxy.addr).await;

    let response = waiting.await.unwrap();
    assert_eq!((response.status, response.text()), (200, "served".into()));
    assert_eq!(
        response.header("connection"),
        Some("close"),
        "{:?}",
        response.headers
    );
    let paths = upstream.paths();
    assert_eq!(paths, ["/first", "/waited"]);
    proxy.shutdown().await;
}

/// Started with a soft limit of 256 descriptors, the binary raises it to the hard limit
/// and grows its descriptor table at start (see `tollgate::descriptors`), so it holds
/// 300 client connections at once, each with its request answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_raises_its_descriptor_limit_and_holds_more_connections_than_the_soft_one() {
    let (_, hard) = open_files_limits(std::process::id());
    // The kernel caps a soft limit at fs.nr_open, so an unlimited hard one is not given.
    let hard = hard.min(65_536);
    assert!(
        hard >= 1024,
        "this test needs a hard open-file limit of at least 1024 (ulimit -Hn), not {hard}"
    );
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let nofile = format!("--nofile=256:{hard}");
    // prlimit (util-linux, in every Debian) execs tollgate: the same process.
    let tollgate = Tollgate::launch("[proxy]\n")
        .via("prlimit", &[nofile.as_str(), "--"])
        .start()
        .await;
    let (pid, listen) = (tollgate.pid(), tollgate.addr);
    assert_eq!(open_files_limits(pid), (hard, hard));
    // The table is grown at start to 16 384 descriptors (or the limit, when lower), so
    // the first thousands of connections never wait for it to be copied.
    let table = proc_status(pid, "FDSize:");
    assert!(table >= hard.min(16_384), "descriptor table {table}");

    // 300 connections open at once, more than the soft limit the binary was given.
    const CLIENTS: usize = 300;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(TcpStream::connect(listen).await.unwrap());
    }
    let authority = upstream.authority();
    let mut answered = Vec::new();
    for (i, mut client) in clients.into_iter().enumerate() {
        let get = format!(
            "GET http://{authority}/{i} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
        );
        answered.push(tokio::spawn(async move {
            client.write_all(get.as_bytes()).await.unwrap();
            read_response(&mut client).await.status
        }));
    }
    for answer in answered {
        assert_eq!(answer.await.unwrap(), 200);
    }
    let mut paths = upstream.paths();
    paths.sort_by_key(|p| p[1..].parse::<usize>().unwrap());
    let expected: Vec<_> = (0..CLIENTS).map(|i| format!("/{i}")).collect();
    assert_eq!(paths, expected);
}
