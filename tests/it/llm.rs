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

/// Starts the upstream (`dialect`, `limits` its command-line limits) and tollgate with
/// `told` in the group; runs the calls; returns what the client, the upstream and
/// tollgate's `/status` said, and tollgate's log.
async fn run(
    dialect: &str,
    limits: &[&str],
    told: &str,
) -> (Calls, Stats, serde_json::Value, String) {
    let mut args = vec!["-I", "tests/upstreams/llm-upstream.py", dialect];
    args.extend_from_slice(limits);
    let upstream = External::start("python3", &args);
    let config = format!(
        "[[route]]\nprefix = \"/llm/\"\nupstream = \"{}\"\n\
         [[limit]]\nname = \"llm\"\nhosts = [\"127.0.0.1\"]\nmax_wait = \"120s\"\n{told}\n{ADMIN_ON_PORT_0}",
        upstream.url("/"),
    );
    let proxy = Tollgate::start(&config).await;
    let base = match dialect {
        "openai" => format!("{}/llm/v1", proxy.url()),
        _ => format!("{}/llm", proxy.url()),
    };
    let mut cmd = clean_command("python3", &[]);
    let (calls, clients) = (CALLS.to_string(), CLIENTS.to_string());
    cmd.args([
        "-W",
        "ignore",
        "tests/python/llm_calls.py",
        dialect,
        &base,
        &calls,
        &clients,
    ]);
    let out = tokio::time::timeout(BOUND * 3, cmd.output())
        .await
        .expect("the calls end in time")
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let calls: Calls = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {stdout} {}", String::from_utf8_lossy(&out.stderr)));
    let stats = reqwest_direct()
        .get(upstream.url("/stats"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let stats: Stats = serde_json::from_str(&stats).unwrap();
    let (_, status) = proxy.admin("/status").await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let group = status["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "llm")
        .expect("the group")
        .clone();
    (calls, stats, group, proxy.log())
}

/// Every call succeeded, the upstream refused at most 2 % of what it was sent, and
/// tollgate read the same usage as the upstream reported, for JSON and streams alike.
fn check(calls: &Calls, stats: &Stats, group: &serde_json::Value) {
    assert!(calls.failed.is_empty(), "every call succeeds: {calls:?}");
    assert_eq!(calls.ok, CALLS);
    assert_eq!(stats.admitted, CALLS, "each call admitted once: {stats:?}");
    assert!(
        stats.refused * 50 <= stats.admitted,
        "the upstream refused {} of {}: the token budget was not kept",
        stats.refused,
        stats.admitted
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
    let limits = ["--tokens", "8000", "--period", "2"];
    let (calls, stats, group, log) = run("openai", &limits, "llm = \"openai\"").await;
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
    let limits = [
        "--input-tokens",
        "6000",
        "--output-tokens",
        "4000",
        "--period",
        "2",
    ];
    let told = "input_tokens = \"6000/2s\"\noutput_tokens = \"4000/2s\"";
    let (calls, stats, group, _) = run("anthropic", &limits, told).await;
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
