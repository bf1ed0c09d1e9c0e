//! `[access]` and the canonical destination, end to end on loopback: what is denied is
//! never dialled, what is allowed is, every spelling of a host spends its group's
//! budget, proxy credentials are asked for and never forwarded, routed paths stay in
//! their route, and a request that comes round again is stopped.
//!
//! Only loopback is ever contacted; the other built-in ranges are tested through the
//! policy's pure functions (`src/access/policy.rs`).

use std::time::Duration;

use crate::support::*;

/// A raw absolute-form GET of `url` through `proxy`, with `extra` header lines.
async fn raw_get(proxy: &Proxy, url: &str, extra: &str) -> RawResponse {
    let request = format!("GET {url} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n");
    raw_request(proxy.addr, request.as_bytes()).await
}

/// Asserts a `403 destination_ip_prohibited` whose text names `what`.
fn assert_denied(response: &RawResponse, what: &str) {
    let body = response.text();
    assert_proxy_error(
        response.status,
        response.header("content-type"),
        response.header("proxy-status"),
        &body,
        403,
        "destination_ip_prohibited",
    );
    assert!(body.contains(what), "{body}");
    assert!(
        body.contains("[access] allow"),
        "says how to allow it: {body}"
    );
}

#[tokio::test]
async fn loopback_is_denied_by_default_and_never_dialled() {
    let upstream = Upstream::start(|_| Reply::ok("reached")).await;
    let proxy = start_proxy("[proxy]\nconnect_ports = [\"*\"]\n[access]\n").await;
    let port = upstream.addr().port();
    for host in [
        "127.0.0.1",
        "127.1",
        "2130706433",
        "0177.0.0.1",
        "[::ffff:127.0.0.1]",
    ] {
        let response = raw_get(&proxy, &format!("http://{host}:{port}/x"), "").await;
        assert_denied(&response, "127.0.0.1");
    }
    let response = raw_get(&proxy, &format!("http://localhost:{port}/x"), "").await;
    assert_denied(&response, "localhost");
    // CONNECT is judged the same way, before anything is dialled.
    let connect = format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    let response = raw_request(proxy.addr, connect.as_bytes()).await;
    assert_denied(&response, "127.0.0.1");
    assert_eq!(upstream.connections(), 0, "nothing reached the upstream");
    proxy.shutdown().await;
}

/// A destination `[access]` refuses by its literal address is answered before the queue:
/// five such requests to a group of one a second all get their `403` and none is
/// admitted, so the group's rate is untouched (no slot spent, nothing queued).
#[tokio::test]
async fn refused_destinations_are_answered_before_the_queue_and_spend_no_slot() {
    let upstream = Upstream::start(|_| Reply::ok("reached")).await;
    let port = upstream.addr().port();
    let proxy = start_proxy_with_admin(
        "[access]\n\n[[limit]]\nname = \"slow\"\nhosts = [\"127.0.0.1\"]\nrate = \"1/s\"\n",
    )
    .await;
    let url = format!("http://127.0.0.1:{port}/x");
    let answers = futures_util::future::join_all((0..5).map(|_| raw_get(&proxy, &url, ""))).await;
    for response in &answers {
        assert_denied(response, "127.0.0.1");
    }
    let metrics = admin_get(&proxy, "/metrics").await;
    let count = |outcome: &str| {
        let series = format!("tollgate_requests_total{{group=\"slow\",outcome=\"{outcome}\"}}");
        metric_value(&metrics, &series).unwrap_or(0.0)
    };
    assert_eq!(
        (count("denied"), count("admitted")),
        (5.0, 0.0),
        "{metrics}"
    );
    assert_eq!(upstream.connections(), 0, "nothing reached the upstream");
    proxy.shutdown().await;
}

#[tokio::test]
async fn allow_opens_a_range_and_deny_closes_part_of_it() {
    let upstream = Upstream::start(|_| Reply::ok("reached")).await;
    let port = upstream.addr().port();
    let proxy = start_proxy(
        "[access]\nallow = [\"127.0.0.0/8\"]\ndeny = [\"127.0.0.1/32\", \"*.blocked.test\"]\n",
    )
    .await;
    let response = raw_get(&proxy, &format!("http://127.0.0.1:{port}/x"), "").await;
    assert_eq!(response.status, 403);
    assert!(
        response.text().contains("[access] deny"),
        "{}",
        response.text()
    );
    let response = raw_get(&proxy, &format!("http://api.blocked.test:{port}/x"), "").await;
    assert_eq!(
        response.status, 403,
        "a denied name is refused before it is resolved"
    );
    assert_eq!(upstream.connections(), 0);
    proxy.shutdown().await;

    let proxy = start_proxy("[access]\nallow = [\"127.0.0.0/8\"]\n").await;
    let response = raw_get(&proxy, &format!("http://127.1:{port}/x"), "").await;
    assert_eq!((response.status, response.text()), (200, "reached".into()));
    assert_eq!(upstream.paths(), ["/x"]);
    proxy.shutdown().await;
}

#[tokio::test]
async fn tollgate_does_not_proxy_to_itself() {
    let proxy = start_proxy_with_admin("").await;
    let admin = proxy.admin.unwrap();
    let response = raw_get(
        &proxy,
        &format!("http://127.0.0.1:{}/status", admin.port()),
        "",
    )
    .await;
    assert_eq!(response.status, 403, "{}", response.text());
    assert!(
        response.text().contains("own listening address"),
        "{}",
        response.text()
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn every_spelling_of_a_limited_host_spends_its_budget() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy(
        "[[limit]]\nname = \"local\"\nhosts = [\"127.0.0.1\", \"localhost\"]\nrate = \"5/s\"\n",
    )
    .await;
    let port = upstream.addr().port();
    let spellings = [
        "127.0.0.1",
        "127.1",
        "2130706433",
        "0177.0.0.1",
        "0x7f.1",
        "[::ffff:127.0.0.1]",
        "127.0.0.1.",
        "127.000.000.001",
    ];
    let sent: Vec<_> = spellings
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let url = format!("http://{host}:{port}/{i}");
            let addr = proxy.addr;
            tokio::spawn(async move {
                let request = format!("GET {url} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
                raw_request(addr, request.as_bytes()).await.status
            })
        })
        .collect();
    for status in sent {
        assert_eq!(status.await.unwrap(), 200);
    }
    // One group at 5/s: eight requests take at least seven intervals at the upstream.
    // (A spelling with a group of its own would have gone at once.) Lateness only
    // stretches the span, so a busy machine cannot fail this.
    let at = arrivals(&upstream);
    assert_eq!(at.len(), spellings.len());
    let span = *at.last().unwrap() - at[0];
    assert!(span >= Duration::from_millis(7 * 200 - 100), "{span:?}");
    assert!(max_in_window(&at, Duration::from_secs(1)) <= 6);
    let hosts: Vec<String> = upstream
        .requests()
        .iter()
        .map(|s| s.header("host").unwrap_or("").to_string())
        .collect();
    assert!(
        hosts.iter().all(|h| *h == format!("127.0.0.1:{port}")),
        "the upstream is named by its canonical address: {hosts:?}"
    );
    proxy.shutdown().await;
}

/// An htpasswd file with `alice:wonderland` (bcrypt, as `htpasswd -B` writes it).
fn users_file(dir: &std::path::Path) -> std::path::PathBuf {
    let hash = bcrypt::hash("wonderland", 4).unwrap();
    write_file(dir, "users", &format!("# test users\nalice:{hash}\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_credentials_are_asked_for_checked_and_never_forwarded() {
    let upstream = Upstream::start(|_| Reply::ok("in")).await;
    let dir = tempfile::tempdir().unwrap();
    let users = users_file(dir.path());
    let proxy = start_proxy(&format!(
        "[proxy]\nconnect_ports = [\"*\"]\n[access]\nallow = [\"127.0.0.0/8\"]\nusers = \"{}\"\n",
        users.display()
    ))
    .await;
    let url = upstream.url("/secret");
    let via = proxy.url();

    // No credentials, and wrong ones: 407 with the challenge, nothing sent.
    for user in [None, Some("alice:wrong"), Some("mallory:wonderland")] {
        let mut args = vec!["-x", via.as_str(), url.as_str()];
        if let Some(user) = user {
            args.extend(["--proxy-user", user]);
        }
        let out = curl(&args, &[]).await;
        assert_eq!(out.status, 407, "{user:?}: {}", out.stderr);
        assert_eq!(
            out.header("proxy-authenticate").as_deref(),
            Some("Basic realm=\"tollgate\"")
        );
    }
    assert_eq!(upstream.connections(), 0);

    // curl with --proxy-user, and a plain CONNECT tunnel with it.
    let out = curl(&["-x", &via, "--proxy-user", "alice:wonderland", &url], &[]).await;
    assert_eq!(
        (out.status, out.text()),
        (200, "in".into()),
        "{}",
        out.stderr
    );
    let out = curl(
        &["-p", "-x", &via, "--proxy-user", "alice:wonderland", &url],
        &[],
    )
    .await;
    assert_eq!(
        (out.status, out.text()),
        (200, "in".into()),
        "{}",
        out.stderr
    );
    let out = curl(&["-p", "-x", &via, &url], &[]).await;
    assert_eq!(
        out.code, 56,
        "a CONNECT without credentials gets no tunnel: {}",
        out.stderr
    );

    // Python requests with the credentials in HTTP_PROXY.
    let proxy_url = format!("http://alice:wonderland@{}", proxy.addr);
    let py = python(
        &format!("import requests\nr = requests.get({url:?})\nprint(r.status_code, r.text)"),
        &[("HTTP_PROXY", &proxy_url), ("http_proxy", &proxy_url)],
    )
    .await;
    assert_eq!(py.stdout.trim(), "200 in", "{}", py.stderr);

    // The credential is tollgate's, not the upstream's.
    let seen = upstream.requests();
    assert_eq!(
        seen.len(),
        3,
        "two forwarded GETs and one through the tunnel"
    );
    assert!(seen
        .iter()
        .all(|s| s.header("proxy-authorization").is_none()));
    proxy.shutdown().await;
}

#[tokio::test]
async fn routed_paths_stay_inside_their_route() {
    let upstream = Upstream::start(|seen| Reply::ok(format!("got {}", seen.path))).await;
    let proxy = start_proxy(&format!(
        "[[route]]\nprefix = \"/api/\"\nupstream = \"http://{}/base\"\n",
        upstream.authority()
    ))
    .await;
    for escape in [
        "/api/../internal",
        "/api/%2e%2e/internal",
        "/api/..%2finternal",
        "/api/a/../../x",
        "/api/..;/internal",
        "/api/..%5cinternal",
        "/api/..%5Cinternal",
    ] {
        let request = format!("GET {escape} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let response = raw_request(proxy.addr, request.as_bytes()).await;
        assert_eq!(response.status, 400, "{escape}: {}", response.text());
    }
    assert_eq!(
        upstream.connections(),
        0,
        "nothing outside the base was asked for"
    );
    let request = "GET /api/a/./b/../c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let response = raw_request(proxy.addr, request.as_bytes()).await;
    assert_eq!(
        (response.status, response.text()),
        (200, "got /base/a/c".into())
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_request_that_already_passed_through_tollgate_is_a_loop() {
    let upstream = Upstream::start(|_| Reply::ok("reached")).await;
    let proxy = start_proxy("").await;
    let response = raw_get(
        &proxy,
        &upstream.url("/x"),
        "Via: 1.1 corp, 1.1 tollgate\r\n",
    )
    .await;
    assert_proxy_error(
        response.status,
        response.header("content-type"),
        response.header("proxy-status"),
        &response.text(),
        508,
        "proxy_loop_detected",
    );
    assert_eq!(upstream.connections(), 0);
    proxy.shutdown().await;
}

/// A wrong credential sent again and again costs one bcrypt check, and every refusal is
/// counted by reason; while wrong credentials flood in, one already verified is
/// answered from the cache, and the checks never exceed one per credential.
#[tokio::test]
async fn wrong_credentials_cost_one_check_each_and_leave_good_ones_alone() {
    let upstream = Upstream::start(|_| Reply::ok("in")).await;
    let dir = tempfile::tempdir().unwrap();
    let users = users_file(dir.path());
    let proxy = start_proxy_with_admin(&format!(
        "[access]\nallow = [\"127.0.0.0/8\"]\nusers = \"{}\"\n",
        users.display()
    ))
    .await;
    let url = upstream.url("/x");
    let via = proxy.url();
    let series = |metrics: &str, name: &str| metric_value(metrics, name).unwrap_or(0.0);
    for _ in 0..5 {
        let out = curl(&["-x", &via, "--proxy-user", "alice:wrong", &url], &[]).await;
        assert_eq!(out.status, 407, "{}", out.stderr);
    }
    let metrics = admin_get(&proxy, "/metrics").await;
    assert_eq!(series(&metrics, "tollgate_credential_checks_total"), 1.0);
    let auth_required = "tollgate_refusals_total{reason=\"auth_required\"}";
    assert_eq!(series(&metrics, auth_required), 5.0, "{metrics}");
    // alice is verified once, then cached.
    let out = curl(&["-x", &via, "--proxy-user", "alice:wonderland", &url], &[]).await;
    assert_eq!(out.status, 200, "{}", out.stderr);
    // 40 different wrong passwords at once, and alice again among them.
    let wrong: Vec<String> = (0..40).map(|i| format!("alice:guess{i}")).collect();
    let flood = futures_util::future::join_all(wrong.iter().map(|user| {
        let (via, url) = (via.clone(), url.clone());
        async move { curl(&["-x", &via, "--proxy-user", user, &url], &[]).await }
    }));
    let alice = async { curl(&["-x", &via, "--proxy-user", "alice:wonderland", &url], &[]).await };
    let (flood, alice) = tokio::join!(flood, alice);
    assert_eq!(alice.status, 200, "{}", alice.stderr);
    let busy = flood.iter().filter(|out| out.status == 429).count();
    assert!(
        flood.iter().all(|out| [407, 429].contains(&out.status)),
        "{:?}",
        flood.iter().map(|o| o.status).collect::<Vec<_>>()
    );
    let metrics = admin_get(&proxy, "/metrics").await;
    let checks = series(&metrics, "tollgate_credential_checks_total");
    assert!(
        checks <= 1.0 + 1.0 + 40.0 - busy as f64,
        "{checks} checks, {busy} busy"
    );
    let busy_counted = series(&metrics, "tollgate_refusals_total{reason=\"auth_busy\"}");
    assert_eq!(busy_counted, busy as f64);
    assert_eq!(
        upstream.requests().len(),
        2,
        "only alice's requests went upstream"
    );
    proxy.shutdown().await;
}

/// However many different wrong passwords come at once, the checks let in are bounded
/// by their bcrypt time, a second in all: against a cost-12 hash, before any check has
/// been timed (each taken to last 410 ms), two are checked and the rest answered `429`
/// with `Retry-After: 1` at once, and counted. A cheap check still fits beside them,
/// and a credential verified once is not checked again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_wrong_passwords_is_bounded_by_bcrypt_time() {
    // `wonderland` at cost 4, and a password nobody guesses at cost 12.
    const ALICE: &str = "alice:$2b$04$zzozvk3JWR8x68XNiTz4ZuDmo.Q8HXgJpTT6mSbvu4.eR2vMMxcj6";
    const BOB: &str = "bob:$2b$12$QGHu4Wwylc6cqPXy3wR7POE8SFgofY1wsv3NX3koD4d63EinOFjM6";
    const FLOOD: usize = 20;
    let upstream = Upstream::start(|_| Reply::ok("in")).await;
    let dir = tempfile::tempdir().unwrap();
    let users = write_file(dir.path(), "users", &format!("{ALICE}\n{BOB}\n"));
    let tollgate = Tollgate::start(&format!(
        "[access]\nallow = [\"127.0.0.0/8\"]\nusers = \"{}\"\n{ADMIN_ON_PORT_0}",
        users.display()
    ))
    .await;
    let get = |credentials: String| {
        let (addr, url) = (tollgate.addr, upstream.url("/x"));
        async move {
            use base64::Engine;
            let token = base64::engine::general_purpose::STANDARD.encode(credentials);
            let request = format!(
                "GET {url} HTTP/1.1\r\nHost: x\r\nProxy-Authorization: Basic {token}\r\n\
                 Connection: close\r\n\r\n"
            );
            raw_request(addr, request.as_bytes()).await
        }
    };
    let flood = (0..FLOOD).map(|i| get(format!("bob:guess-{i}")));
    let flood = futures_util::future::join_all(flood).await;
    let statuses = |status| flood.iter().filter(|r| r.status == status).count();
    assert_eq!((statuses(407), statuses(429)), (2, FLOOD - 2));
    for busy in flood.iter().filter(|r| r.status == 429) {
        let body = busy.text();
        let (content_type, proxy_status) =
            (busy.header("content-type"), busy.header("proxy-status"));
        assert_proxy_error(
            429,
            content_type,
            proxy_status,
            &body,
            429,
            "http_request_denied",
        );
        assert_eq!(busy.header("retry-after"), Some("1"));
    }
    for _ in 0..2 {
        let alice = get("alice:wonderland".into()).await;
        assert_eq!((alice.status, alice.text()), (200, "in".into()));
    }
    assert_eq!(
        tollgate.metric("tollgate_credential_checks_total").await,
        3.0
    );
    let refused = |reason| format!("tollgate_refusals_total{{reason=\"{reason}\"}}");
    assert_eq!(
        tollgate.metric(&refused("auth_busy")).await,
        (FLOOD - 2) as f64
    );
    assert_eq!(tollgate.metric(&refused("auth_required")).await, 2.0);
    assert_eq!(
        upstream.requests().len(),
        2,
        "only alice's requests went upstream"
    );
}
