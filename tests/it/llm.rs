//! Token budgets of LLM APIs (docs/tokens.md): the official OpenAI and Anthropic
//! Python SDKs, with their own retries off, call an upstream that limits tokens as the
//! providers document it (`tests/upstreams/llm-upstream.py`: a token bucket, admission
//! on prompt plus maximum output, corrected to the usage when the answer ends, 429
//! with the provider's error body) through a `[[route]]` of the real binary. Every
//! third call streams.
//!
//! Twenty clients start at once, asking for far more than the bucket holds: without
//! token budgets most of the first round would be refused. Every call must succeed, the
//! upstream must refuse almost none, and what tollgate read of the usage must be what
//! the upstream reported. How much of the budget a longer run uses is
//! `scripts/bench-llm`'s (BENCHMARKS.md).

use crate::support::*;

const CALLS: usize = 40;
const CLIENTS: usize = 20;

/// The upstream's limits: 8 000 tokens when full, full again after 2 s (the forty calls
/// ask for about 40 000); Anthropic's, 6 000 input and 4 000 output.
const OPENAI_LIMITS: [&str; 4] = ["--tokens", "8000", "--period", "2"];
const ANTHROPIC_LIMITS: [&str; 6] = [
    "--input-tokens",
    "6000",
    "--output-tokens",
    "4000",
    "--period",
    "2",
];

/// What the upstream said of a run.
#[derive(serde::Deserialize, Debug)]
struct Stats {
    admitted: usize,
    refused: usize,
    used_input: u64,
    used_output: u64,
}

/// What the SDK client said of its calls.
#[derive(serde::Deserialize, Debug)]
struct Calls {
    ok: usize,
    failed: Vec<String>,
    usage: (u64, u64),
}

/// How the SDK reaches the upstream.
enum Via {
    /// A `[[route]]` as its base URL.
    Route,
    /// `HTTPS_PROXY`, to an HTTPS upstream that tollgate intercepts (its CA in
    /// `SSL_CERT_FILE`; the upstream's CA is tollgate's `ca_file`, not the client's).
    Intercept,
    /// The same, from Node's `openai` package (the CA in `NODE_EXTRA_CA_CERTS`).
    InterceptNode,
}

impl Via {
    fn intercepts(&self) -> bool {
        matches!(self, Via::Intercept | Via::InterceptNode)
    }
}

/// Starts the upstream (`dialect`, `limits` its command-line limits) and tollgate with
/// `told` in the group; runs the calls `via` a route or interception; returns what the
/// client, the upstream and tollgate's `/status` said, and tollgate's log.
async fn run(
    dialect: &str,
    limits: &[&str],
    told: &str,
    via: Via,
) -> (Calls, Stats, serde_json::Value, String) {
    let upstream_ca = TestCa::new();
    let certs = tempfile::tempdir().unwrap();
    upstream_ca.write_server_pem(certs.path());
    let (cert, key) = (certs.path().join("cert.pem"), certs.path().join("key.pem"));
    let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let mut args = vec!["-I", "tests/upstreams/llm-upstream.py", dialect];
    args.extend_from_slice(limits);
    if via.intercepts() {
        args.extend_from_slice(&["--tls", cert, key]);
    }
    let upstream = External::start("python3", &args);
    let authority = upstream.url("").replace("http://", "");
    let group = format!("[[limit]]\nname = \"llm\"\nmax_wait = \"120s\"\n{told}\n");
    let v1 = if dialect == "openai" { "/v1" } else { "" };
    let intercept = tempfile::tempdir().unwrap();
    let (config, base, mut env) = match via {
        Via::Route => (
            format!(
                "[[route]]\nprefix = \"/llm/\"\nupstream = \"{}\"\n{group}hosts = [\"127.0.0.1\"]\n{ADMIN_ON_PORT_0}",
                upstream.url("/")
            ),
            None,
            vec![],
        ),
        Via::Intercept | Via::InterceptNode => {
            tollgate::init_ca(intercept.path()).unwrap();
            let ca = intercept.path().join("ca.pem").display().to_string();
            let key = intercept.path().join("ca-key.pem").display().to_string();
            let config = format!(
                "[proxy]\nconnect_ports = [\"*\"]\nca_file = {:?}\n\
                 [intercept]\nca_cert = {ca:?}\nca_key = {key:?}\n\
                 {group}hosts = [\"{authority}\"]\n{ADMIN_ON_PORT_0}",
                upstream_ca.ca_pem_path().display().to_string(),
            );
            let base = format!("https://{authority}{v1}");
            let env = vec![("SSL_CERT_FILE", ca.clone()), ("NODE_EXTRA_CA_CERTS", ca)];
            (config, Some(base), env)
        }
    };
    let proxy = Tollgate::start(&config).await;
    let base = base.unwrap_or_else(|| format!("{}/llm{v1}", proxy.url()));
    if via.intercepts() {
        env.push(("HTTPS_PROXY", proxy.url()));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let calls = match via {
        Via::InterceptNode => node_calls(&base, &env).await,
        _ => sdk_calls(dialect, &base, &env, CALLS, CLIENTS).await,
    };
    let scheme = if via.intercepts() { "https" } else { "http" };
    let ca = upstream_ca.ca_pem_path().display().to_string();
    let stats = curl(
        &["--cacert", &ca, &format!("{scheme}://{authority}/stats")],
        &[],
    )
    .await;
    let stats: Stats =
        serde_json::from_str(&stats.text()).unwrap_or_else(|e| panic!("{e}: {}", stats.stderr));
    let (_, status) = proxy.admin("/status").await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let group = status["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "llm")
        .expect("the group")
        .clone();
    // Every call answered: nothing is reserved, and each bucket /status shows is a
    // series of /metrics.
    let (_, metrics) = proxy.admin("/metrics").await;
    assert!(
        metrics.contains("tollgate_tokens_reserved{group=\"llm\"} 0\n"),
        "{metrics}"
    );
    for bucket in group["tokens"]["buckets"].as_array().unwrap() {
        let (kind, source) = (
            bucket["kind"].as_str().unwrap(),
            bucket["source"].as_str().unwrap(),
        );
        for name in ["tollgate_token_rate", "tollgate_tokens_in_use"] {
            let series = format!("{name}{{group=\"llm\",kind=\"{kind}\",source=\"{source}\"}} ");
            assert!(metrics.contains(&series), "{series} in {metrics}");
        }
    }
    // Access lines reach the log in batches, within about a second.
    let calls_logged = |log: &str| {
        let lines = log
            .lines()
            .filter(|l| l.contains(" access: ") && l.contains(v1));
        lines.filter(|l| l.contains("status=200")).count() >= CALLS
    };
    let log = within_bound(async || Some(proxy.log()).filter(|log| calls_logged(log))).await;
    (calls, stats, group, log.unwrap_or_else(|| proxy.log()))
}

/// Runs `calls` calls from `clients` threads of the `dialect`'s SDK against `base`,
/// with `env`; what the client said of them.
async fn sdk_calls(
    dialect: &str,
    base: &str,
    env: &[(&str, &str)],
    calls: usize,
    clients: usize,
) -> Calls {
    let mut cmd = clean_command("python3", env);
    let (calls, clients) = (calls.to_string(), clients.to_string());
    cmd.args([
        "-W",
        "ignore",
        "tests/python/llm_calls.py",
        dialect,
        base,
        &calls,
        &clients,
    ]);
    client_calls(cmd).await
}

/// What a client program (`cmd`) printed of its calls, once it ends.
async fn client_calls(mut cmd: tokio::process::Command) -> Calls {
    let out = tokio::time::timeout(BOUND * 3, cmd.output())
        .await
        .expect("the calls end in time")
        .expect("the client runs (scripts/test installs it)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {stdout} {}", String::from_utf8_lossy(&out.stderr)))
}

/// The calls of Node's `openai` package (`tests/node/llm-calls.js`) to `base`.
async fn node_calls(base: &str, env: &[(&str, &str)]) -> Calls {
    let mut cmd = clean_command("node", env);
    let (calls, clients) = (CALLS.to_string(), CLIENTS.to_string());
    cmd.args(["tests/node/llm-calls.js", base, &calls, &clients]);
    client_calls(cmd).await
}

/// What the upstream said of its run (plain HTTP).
async fn upstream_stats(upstream: &External) -> Stats {
    let stats = curl(&[&upstream.url("/stats")], &[]).await;
    serde_json::from_str(&stats.text()).unwrap_or_else(|e| panic!("{e}: {}", stats.stderr))
}

/// The OpenAI-like upstream at [`OPENAI_LIMITS`], plain HTTP.
fn openai_upstream() -> External {
    let mut args = vec!["-I", "tests/upstreams/llm-upstream.py", "openai"];
    args.extend_from_slice(&OPENAI_LIMITS);
    External::start("python3", &args)
}

/// A config that routes `/llm/` to `upstream`, its group `llm` told `told`.
fn routed(upstream: &External, told: &str) -> String {
    format!(
        "[[route]]\nprefix = \"/llm/\"\nupstream = \"{}\"\n\
         [[limit]]\nname = \"llm\"\nhosts = [\"127.0.0.1\"]\nmax_wait = \"120s\"\n\
         {told}\n{ADMIN_ON_PORT_0}",
        upstream.url("/")
    )
}

/// Every call succeeded, the upstream refused at most one in forty (a loaded machine
/// may let one request meet the bucket's edge; without token budgets the first round
/// alone is refused by the dozen), and tollgate read the same usage as the upstream
/// reported, for JSON and streams alike.
fn check(calls: &Calls, stats: &Stats, group: &serde_json::Value) {
    assert!(calls.failed.is_empty(), "every call succeeds: {calls:?}");
    assert_eq!(calls.ok, CALLS);
    assert_eq!(stats.admitted, CALLS, "each call admitted once: {stats:?}");
    assert!(
        stats.refused * 40 <= stats.admitted,
        "the upstream refused {} of {}: the token budget was not kept ({:?})",
        stats.refused,
        stats.admitted,
        group["tokens"]
    );
    assert_eq!(
        calls.usage,
        (stats.used_input, stats.used_output),
        "the SDK read the usage"
    );
    let tokens = &group["tokens"];
    let read = (
        tokens["used_input"].as_u64(),
        tokens["used_output"].as_u64(),
    );
    assert_eq!(
        read,
        (Some(stats.used_input), Some(stats.used_output)),
        "{tokens}"
    );
    assert_eq!(tokens["reserved"], 0, "every reservation settled: {tokens}");
}

#[tokio::test]
async fn openai_sdk_told_nothing_keeps_the_announced_token_budget() {
    // 8 000 tokens when full, 4 000 a second: the forty calls ask for about 40 000.
    let limits = OPENAI_LIMITS;
    let (calls, stats, group, log) = run("openai", &limits, "llm = \"openai\"", Via::Route).await;
    check(&calls, &stats, &group);
    let buckets = &group["tokens"]["buckets"];
    assert_eq!(buckets[0]["source"], "announced", "{buckets}");
    assert_eq!(buckets[0]["capacity"], 8000, "{buckets}");
    // Each call's access line tells its tokens; the upstream's count, once per call.
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("/v1/chat/completions") && l.contains("status=200"))
        .collect();
    assert_eq!(lines.len(), CALLS, "{log}");
    let field = |line: &str, name: &str| -> u64 {
        let start = line.find(&format!("{name}=")).expect(name) + name.len() + 1;
        line[start..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let logged: u64 = lines.iter().map(|l| field(l, "tokens_out")).sum();
    assert_eq!(logged, stats.used_output);
}

#[tokio::test]
async fn anthropic_sdk_told_input_and_output_rates_keeps_both() {
    let limits = ANTHROPIC_LIMITS;
    let told = "input_tokens = \"6000/2s\"\noutput_tokens = \"4000/2s\"";
    let (calls, stats, group, _) = run("anthropic", &limits, told, Via::Route).await;
    check(&calls, &stats, &group);
    let kinds: Vec<&str> = group["tokens"]["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["source"] == "configured")
        .map(|b| b["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["input", "output"]);
}

#[tokio::test]
async fn sdks_through_https_proxy_with_interception_keep_the_token_budget() {
    let limits = OPENAI_LIMITS;
    let told = "tokens = \"8000/2s\"";
    let (calls, stats, group, log) = run("openai", &limits, told, Via::Intercept).await;
    check(&calls, &stats, &group);
    let intercepted = log
        .lines()
        .filter(|l| l.contains("url=https://127.0.0.1:") && l.contains("status=200"))
        .count();
    assert_eq!(
        intercepted, CALLS,
        "each call's line, inside the tunnel: {log}"
    );
    let limits = ANTHROPIC_LIMITS;
    let told = "llm = \"anthropic\"";
    let (calls, stats, group, _) = run("anthropic", &limits, told, Via::Intercept).await;
    check(&calls, &stats, &group);
}

/// Three replicas on Redis share one configured token budget: a third of the calls
/// through each, all at once. The buckets live in Redis, so together they keep it.
#[tokio::test]
async fn three_replicas_on_redis_keep_one_token_budget() {
    let redis = RedisServer::start().await;
    let upstream = openai_upstream();
    let backend = format!(
        "[backend]\nkind = \"redis\"\nurl = {:?}\ntimeout = \"300ms\"\n",
        redis.url()
    );
    let config = backend + &routed(&upstream, "tokens = \"8000/2s\"");
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Tollgate::start(&config).await);
    }
    let runs = replicas.iter().map(|proxy| {
        let base = format!("{}/llm/v1", proxy.url());
        async move { sdk_calls("openai", &base, &[], CALLS / 2, CLIENTS / 2).await }
    });
    let runs = futures_util::future::join_all(runs).await;
    let stats = upstream_stats(&upstream).await;
    let calls = 3 * (CALLS / 2);
    for run in &runs {
        assert!(run.failed.is_empty(), "every call succeeds: {run:?}");
    }
    assert_eq!(runs.iter().map(|r| r.ok).sum::<usize>(), calls);
    assert_eq!(stats.admitted, calls, "{stats:?}");
    assert!(
        stats.refused * 50 <= stats.admitted,
        "the upstream refused {} of {}: the replicas did not share the budget",
        stats.refused,
        stats.admitted
    );
    let mut read = (0, 0);
    for proxy in &replicas {
        let (_, status) = proxy.admin("/status").await;
        let status: serde_json::Value = serde_json::from_str(&status).unwrap();
        let tokens = &status["groups"][0]["tokens"];
        read.0 += tokens["used_input"].as_u64().unwrap();
        read.1 += tokens["used_output"].as_u64().unwrap();
        assert_eq!(tokens["reserved"], 0, "{tokens}");
    }
    assert_eq!(read, (stats.used_input, stats.used_output));
}

/// Node's `openai` package (fetch, streams) through a route, told nothing.
#[tokio::test]
async fn node_openai_package_through_a_route_keeps_the_token_budget() {
    let upstream = openai_upstream();
    let config = routed(&upstream, "llm = \"openai\"");
    let proxy = Tollgate::start(&config).await;
    let calls = node_calls(&format!("{}/llm/v1", proxy.url()), &[]).await;
    let stats = upstream_stats(&upstream).await;
    let (_, status) = proxy.admin("/status").await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    check(&calls, &stats, &status["groups"][0]);
}

#[tokio::test]
async fn node_openai_package_through_https_proxy_with_interception_keeps_the_token_budget() {
    let limits = OPENAI_LIMITS;
    let told = "tokens = \"8000/2s\"";
    let (calls, stats, group, _) = run("openai", &limits, told, Via::InterceptNode).await;
    check(&calls, &stats, &group);
}
