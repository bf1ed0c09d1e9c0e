//! What `deploy/` ships for running tollgate in a cluster, checked with the tools that
//! read it: the Kubernetes manifests rendered by `kubectl kustomize`, validated against
//! the API's schemas and checked against the config they carry
//! (`scripts/check-kubernetes`); the Prometheus alerts checked and unit-tested by
//! `promtool`; the Grafana dashboard's queries parsed by `promtool` too; and every
//! metric the two name exported by the binary. And `/readyz`, which the readiness probe
//! asks. A missing tool fails its test, naming what installs it: nothing is skipped.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::support::*;

/// The repository's root.
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `program` as found on `PATH`; fails the test, saying what installs it, when absent.
fn tool(program: &str, installed_by: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| panic!("{program} is not installed: {installed_by}"))
}

/// Runs `program args` to its end (within [`BOUND`]): its exit code, stdout and stderr.
async fn run(program: &Path, args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = clean_command(program.to_str().expect("a UTF-8 path"), &[]);
    cmd.args(args)
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{} {args:?} returned in time", program.display()))
        .expect("the program runs");
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text.into_owned())
}

// ---------------------------------------------------------------------------------
// /readyz
// ---------------------------------------------------------------------------------

/// SIGTERM with a request queued: `/readyz` turns `503` at once (a Service stops
/// sending) while the request still waits for its slot, `/healthz` stays `200` (a
/// liveness probe does not kill a draining pod), and the queued request is answered
/// by the upstream before the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_503_at_sigterm_while_a_queued_request_is_still_answered() {
    let upstream = Upstream::start(|_| Reply::ok("served")).await;
    // One request per 5 s: the second waits for its slot far longer than the checks
    // below take.
    let mut tollgate = Tollgate::start(&format!(
        "[proxy]\nshutdown_grace = \"30s\"\n\n[[limit]]\nname = \"slow\"\n\
         hosts = [\"127.0.0.1\"]\nrate = \"1/5s\"\n{ADMIN_ON_PORT_0}"
    ))
    .await;
    assert_eq!(tollgate.admin("/readyz").await, (200, "ready\n".into()));
    let first = curl(&["-x", &tollgate.url(), &upstream.url("/first")], &[]).await;
    assert_eq!((first.code, first.status), (0, 200), "{}", first.stderr);
    let (proxy_url, url) = (tollgate.url(), upstream.url("/queued"));
    let queued = tokio::spawn(async move { curl(&["-x", &proxy_url, &url], &[]).await });
    let depth = "tollgate_queue_depth{group=\"slow\"}";
    tollgate.wait_metric(depth, 1.0).await;

    tollgate.signal("TERM").await;
    let unready = within_bound(async || {
        let (status, body) = tollgate.admin("/readyz").await;
        (status == 503).then_some(body)
    })
    .await
    .expect("/readyz turned 503 after SIGTERM");
    assert_eq!(unready, "shutting down: draining queued requests\n");
    // Asked after /readyz said 503: the request was queued then, as it still is now.
    assert_eq!(tollgate.metric(depth).await, 1.0, "{}", tollgate.log());
    assert_eq!(tollgate.admin("/healthz").await, (200, "ok\n".into()));

    let out = queued.await.unwrap();
    assert_eq!((out.code, out.status), (0, 200), "{}", out.stderr);
    assert_eq!(out.text(), "served");
    assert_eq!(upstream.paths(), ["/first", "/queued"]);
    let status = tollgate.wait_exit().await;
    assert_eq!(status.code(), Some(0), "{}", tollgate.log());
    assert!(
        tollgate.log().contains("sent=1 answered_503=0 cut=0"),
        "{}",
        tollgate.log()
    );
}

// ---------------------------------------------------------------------------------
// deploy/kubernetes
// ---------------------------------------------------------------------------------

/// `scripts/check-kubernetes` on `dirs`: its exit code and output.
async fn check_kubernetes(dirs: &[&Path]) -> (Option<i32>, String) {
    tool(
        "kubectl",
        "kubectl (with kustomize) comes with the machine's image; Debian's \
         kubernetes-client conflicts with it",
    );
    let python = tool("python3", "scripts/test needs python3");
    let script = root().join("scripts/check-kubernetes");
    let mut args = vec![
        script.to_str().unwrap(),
        "--tollgate",
        env!("CARGO_BIN_EXE_tollgate"),
    ];
    args.extend(dirs.iter().map(|d| d.to_str().unwrap()));
    let (code, out) = run(&python, &args).await;
    assert!(
        !out.contains("is not installed"),
        "{out}\n(scripts/test installs kubernetes-validate with pip when missing)"
    );
    (code, out)
}

/// The base and the Redis overlay render, pass `kubernetes-validate --strict` and agree
/// with the config they carry (`scripts/check-kubernetes` lists what it checks).
#[tokio::test]
async fn kubernetes_manifests_render_validate_and_agree_with_their_config() {
    let base = root().join("deploy/kubernetes/base");
    let overlay = root().join("deploy/kubernetes/overlays/redis");
    let (code, out) = check_kubernetes(&[&base, &overlay]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("deploy/kubernetes/base: ok"), "{out}");
    assert!(
        out.contains("deploy/kubernetes/overlays/redis: ok"),
        "{out}"
    );
}

/// Replaces `from` with `to` in `path`, which must contain it.
fn edit(path: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains(from), "{from:?} not in {}", path.display());
    std::fs::write(path, text.replace(from, to)).unwrap();
}

/// Copies the directory `from` into `to`, recursively.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The check is not a formality: a copy whose grace period is too short for the drain,
/// whose root filesystem is writable, whose memory limit is below what the queues take,
/// whose readiness probe asks `/healthz`, with a field the API does not know, and whose
/// overlay's `[backend] replicas` is not its Deployment's, fails it on each count.
#[tokio::test]
async fn kubernetes_check_finds_what_is_broken() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&root().join("deploy/kubernetes"), dir.path());
    let base = dir.path().join("base");
    let deployment = base.join("deployment.yaml");
    edit(
        &deployment,
        "terminationGracePeriodSeconds: 60",
        "terminationGracePeriodSeconds: 40",
    );
    edit(
        &deployment,
        "readOnlyRootFilesystem: true",
        "readOnlyRootFilesystem: false",
    );
    edit(&deployment, "memory: 256Mi\n", "memory: 64Mi\n");
    edit(&deployment, "path: /readyz", "path: /healthz");
    edit(&deployment, "periodSeconds: 2", "periodSecond: 2");
    let overlay = dir.path().join("overlays/redis");
    edit(&overlay.join("kustomization.yaml"), "count: 3", "count: 4");

    let (code, out) = check_kubernetes(&[&base, &overlay]).await;
    assert_eq!(code, Some(1), "{out}");
    for problem in [
        "terminationGracePeriodSeconds 40 is not longer than the preStop pause (5 s) + \
         shutdown_grace (45 s) + 1 s",
        "readOnlyRootFilesystem is not true",
        "memory limit 64Mi is below 163 MiB",
        "readinessProbe: not an HTTP GET of /readyz",
        "Additional properties are not allowed ('periodSecond' was unexpected)",
        "[backend] replicas = 3, the Deployment runs 4",
    ] {
        assert!(out.contains(problem), "{problem:?} not in:\n{out}");
    }
}

// ---------------------------------------------------------------------------------
// deploy/prometheus and deploy/grafana
// ---------------------------------------------------------------------------------

/// promtool, from Debian's `prometheus`, which scripts/test installs when missing.
fn promtool() -> PathBuf {
    tool(
        "promtool",
        "it comes with Debian's `prometheus` package, which scripts/test installs",
    )
}

#[tokio::test]
async fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let promtool = promtool();
    let (code, out) = run(
        &promtool,
        &["check", "rules", "deploy/prometheus/alerts.yaml"],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("SUCCESS: 10 rules found"), "{out}");
    let tests = "deploy/prometheus/alerts_test.yaml";
    let (code, out) = run(&promtool, &["test", "rules", tests]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("SUCCESS"), "{out}");
}

/// The alerts' names, from their `- alert: Name` lines.
fn alert_names() -> Vec<String> {
    let rules = std::fs::read_to_string(root().join("deploy/prometheus/alerts.yaml")).unwrap();
    (rules.lines())
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(str::to_string)
        .collect()
}

/// Every alert points at a runbook section of docs/operations.md named after it.
#[test]
fn every_alert_has_a_runbook_section() {
    let rules = std::fs::read_to_string(root().join("deploy/prometheus/alerts.yaml")).unwrap();
    let operations = std::fs::read_to_string(root().join("docs/operations.md")).unwrap();
    let alerts = alert_names();
    assert_eq!(alerts.len(), 10, "{alerts:?}");
    for alert in &alerts {
        let anchor = format!("runbook: \"docs/operations.md#{}\"", alert.to_lowercase());
        assert!(rules.contains(&anchor), "{alert} has no {anchor}");
        let heading = format!("\n### {alert}\n");
        assert!(
            operations.contains(&heading),
            "docs/operations.md has no {heading:?}"
        );
    }
}

/// The dashboard's queries, with Grafana's variables replaced by what Prometheus reads.
fn dashboard_queries() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("deploy/grafana/tollgate.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target has an expr");
            queries.push(
                expr.replace("$__rate_interval", "5m")
                    .replace("$group", ".*"),
            );
        }
    }
    queries
}

/// Every query of the dashboard is PromQL Prometheus parses: promtool checks them as
/// the expressions of recording rules.
#[tokio::test]
async fn dashboard_queries_parse_as_promql() {
    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "{queries:?}");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, query) in queries.iter().enumerate() {
        let query = serde_json::to_string(query).unwrap();
        rules += &format!("      - record: dashboard:query{i}\n        expr: {query}\n");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = write_file(dir.path(), "dashboard.yaml", &rules);
    let (code, out) = run(&promtool(), &["check", "rules", file.to_str().unwrap()]).await;
    assert_eq!(code, Some(0), "{out}\n{rules}");
}

/// The metric names `text` mentions (`tollgate_…`).
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("tollgate_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

/// Traffic that makes every series exist: a group with a rate whose upstream refuses
/// bare (a pause, a replay and a learned pace), a request to a closed port (an
/// upstream error) and one tollgate refuses itself (a loop). Returns the `/metrics`
/// text.
async fn scrape_after_traffic(tollgate: &Tollgate, upstream: &Upstream) -> String {
    let refused = curl(&["-x", &tollgate.url(), &upstream.url("/refused")], &[]).await;
    assert_eq!(
        (refused.code, refused.status),
        (0, 200),
        "{}",
        refused.stderr
    );
    let closed = ClosedPort::new();
    let url = format!("http://{}/nobody", closed.addr());
    let nobody = curl(&["-x", &tollgate.url(), &url], &[]).await;
    assert_eq!(nobody.status, 502, "{}", nobody.stderr);
    // A request that already passed through tollgate: refused as a loop (508).
    let looped = [
        "-x",
        &tollgate.url(),
        "-H",
        "Via: 1.1 tollgate",
        &upstream.url("/loop"),
    ];
    assert_eq!(curl(&looped, &[]).await.status, 508);
    let found = within_bound(async || {
        let (_, metrics) = tollgate.admin("/metrics").await;
        metrics
            .contains("tollgate_learned_pace{group=\"api\"}")
            .then_some(metrics)
    })
    .await;
    found.unwrap_or_else(|| panic!("no learned pace:\n{}", tollgate.log()))
}

/// Every metric the dashboard and the alerts name is exported by the binary, as a
/// sample (not only a `# TYPE` line): scraped from a tollgate with the Redis backend,
/// after traffic that gives every series a value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_name_is_exported() {
    let redis = RedisServer::start().await;
    // The first request is refused bare (no Retry-After): the group pauses, learns a
    // pace, and replays it.
    let answered = std::sync::atomic::AtomicUsize::new(0);
    let upstream = Upstream::start(move |_| {
        match answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => Reply::status(429),
            _ => Reply::ok("ok"),
        }
    })
    .await;
    let tollgate = Tollgate::start(&format!(
        "[backend]\nkind = \"redis\"\nurl = \"{}\"\n\n[[limit]]\nname = \"api\"\n\
         hosts = [\"127.0.0.1\"]\nrate = \"20/s\"\nretry_statuses = [429]\n{ADMIN_ON_PORT_0}",
        redis.url()
    ))
    .await;
    let metrics = scrape_after_traffic(&tollgate, &upstream).await;
    let exported: BTreeSet<String> = metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect();

    let dashboard = std::fs::read_to_string(root().join("deploy/grafana/tollgate.json")).unwrap();
    let alerts = std::fs::read_to_string(root().join("deploy/prometheus/alerts.yaml")).unwrap();
    let named: BTreeSet<String> = metric_names(&dashboard)
        .into_iter()
        .chain(metric_names(&alerts))
        .collect();
    assert!(named.len() >= 20, "{named:?}");
    let missing: Vec<_> = named.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "named but not exported: {missing:?}\n{metrics}"
    );
    // Waited for above, and the rate that goes with it.
    assert!(
        metrics.contains("tollgate_configured_rate{group=\"api\"} 20.0"),
        "{metrics}"
    );
}
