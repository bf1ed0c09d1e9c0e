//! `[backend] ca_file`, `client_cert_file` and `client_key_file`: the tollgate binary
//! sharing its budget through a real redis-server that speaks TLS alone, with a
//! certificate of a private CA made for the test (`support/redis_tls.rs`). With the CA
//! the budget lives in that Redis; without it the web roots do not trust the server,
//! and the proxy reports the backend down (`on_backend_error = "deny"`: 503).

use crate::support::*;

fn config(backend: &str) -> String {
    format!(
        r#"
        [backend]
        kind = "redis"
        on_backend_error = "deny"
        # Longer than the 50 ms default: a TLS handshake on a loaded test machine must
        # not make tollgate think Redis is down.
        timeout = "1s"
        {backend}

        [[limit]]
        name = "api"
        hosts = ["127.0.0.1"]
        rate = "10/s"
        {ADMIN_ON_PORT_0}
        "#
    )
}

fn quoted(path: &std::path::Path) -> String {
    format!("{:?}", path.display().to_string())
}

/// `n` GETs through `tollgate`, one after another; their statuses.
async fn get(tollgate: &Tollgate, upstream: &Upstream, n: usize) -> Vec<u16> {
    let proxy = reqwest::Proxy::all(tollgate.url()).unwrap();
    let client = reqwest::Client::builder()
        .proxy(proxy)
        .timeout(BOUND)
        .build()
        .unwrap();
    let mut statuses = Vec::new();
    for i in 0..n {
        let resp = client.get(upstream.url(&format!("/{i}"))).send().await;
        statuses.push(resp.map_or(0, |r| r.status().as_u16()));
    }
    statuses
}

async fn backend_up(tollgate: &Tollgate) -> serde_json::Value {
    let (_, status) = tollgate.admin("/status").await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    status["backend"]["up"].clone()
}

/// The budget's keys on every node of `redis`.
async fn budget_keys(redis: &[RedisTls]) -> Vec<String> {
    let mut keys = Vec::new();
    for node in redis {
        let some: Vec<String> = node.ask(&["KEYS", "tollgate:{api}:*"]).await.unwrap();
        keys.extend(some);
    }
    keys
}

/// Every request reaches the upstream through Redis (deny mode: none would without
/// it), the budget's keys are in that Redis, and the backend shows up.
async fn assert_shared_through(redis: &[RedisTls], backend: &str) {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let tollgate = Tollgate::start(&config(backend)).await;
    let statuses = get(&tollgate, &upstream, 5).await;
    assert_eq!(statuses, [200; 5], "log:\n{}", tollgate.log());
    assert_eq!(upstream.paths().len(), 5);
    let keys = budget_keys(redis).await;
    assert!(
        keys.contains(&"tollgate:{api}:booked".to_string()),
        "{keys:?}"
    );
    assert_eq!(backend_up(&tollgate).await, true);
}

/// Nothing reaches the upstream: Redis is down for tollgate, which says why in its
/// log (`reason`), and nothing of the budget is in Redis.
async fn assert_refused_by(redis: &[RedisTls], backend: &str, reason: &str) {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let mut tollgate = Tollgate::start(&config(backend)).await;
    let statuses = get(&tollgate, &upstream, 2).await;
    assert_eq!(statuses, [503; 2]);
    assert!(upstream.paths().is_empty());
    let line = tollgate.wait_for_log("Redis unreachable").await;
    assert!(line.contains(reason), "{line}");
    assert_eq!(backend_up(&tollgate).await, false);
    assert_eq!(budget_keys(redis).await, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_of_a_private_ca_is_reached_with_ca_file_alone() {
    let ca = TestCa::new();
    let redis = RedisTls::start(&ca, false).await;
    let url = format!("url = {:?}", redis.url());
    // The web roots alone do not know the private CA.
    assert_refused_by(std::slice::from_ref(&redis), &url, "UnknownIssuer").await;
    let with_ca = format!("{url}\nca_file = {}", quoted(&ca.ca_pem_path()));
    assert_shared_through(std::slice::from_ref(&redis), &with_ca).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_shown_to_a_redis_that_asks_for_one() {
    let ca = TestCa::new();
    let redis = RedisTls::start(&ca, true).await;
    let (cert, key) = redis.client_pem().expect("it asks for one").clone();
    let with_ca = format!(
        "url = {:?}\nca_file = {}",
        redis.url(),
        quoted(&ca.ca_pem_path())
    );
    // Trusting the server is not enough: it hangs up on a client without a certificate.
    assert_refused_by(
        std::slice::from_ref(&redis),
        &with_ca,
        "CertificateRequired",
    )
    .await;
    let mutual = format!(
        "{with_ca}\nclient_cert_file = {}\nclient_key_file = {}",
        quoted(&cert),
        quoted(&key)
    );
    assert_shared_through(std::slice::from_ref(&redis), &mutual).await;
}

/// Sentinel over TLS: the sentinel and the master it names (which the client checks
/// the role of before handing it over) both take `ca_file`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_and_its_master_of_a_private_ca_are_reached_with_ca_file() {
    let ca = TestCa::new();
    let redis = RedisTls::start(&ca, false).await;
    let sentinel = redis.sentinel("main").await;
    let at = format!(
        "sentinels = [\"rediss://127.0.0.1:{}\"]\nmaster_name = \"main\"",
        sentinel.port
    );
    assert_refused_by(std::slice::from_ref(&redis), &at, "UnknownIssuer").await;
    let with_ca = format!("{at}\nca_file = {}", quoted(&ca.ca_pem_path()));
    assert_shared_through(std::slice::from_ref(&redis), &with_ca).await;
}

/// A Redis Cluster over TLS: the seeds and the nodes discovered from them take
/// `ca_file`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_of_a_private_ca_is_reached_with_ca_file() {
    let ca = TestCa::new();
    let nodes = RedisTls::cluster(&ca).await;
    // One seed: the other two masters are found through it.
    let at = format!("cluster = [{:?}]", nodes[0].url());
    // The cluster client does not pass on why no seed could be reached.
    assert_refused_by(&nodes, &at, "No connections found").await;
    let with_ca = format!("{at}\nca_file = {}", quoted(&ca.ca_pem_path()));
    assert_shared_through(&nodes, &with_ca).await;
}

/// A reload reads `ca_file` again, and refuses a file that became unusable at its
/// line, keeping the configuration in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_file_gone_bad_is_refused_on_reload() {
    let ca = TestCa::new();
    let dir = tempfile::tempdir().unwrap();
    let ca_file = write_file(dir.path(), "ca.pem", ca.ca_pem());
    // Nothing listens there: the connection is made lazily, and a reload dials nothing.
    let backend = format!(
        "url = \"rediss://127.0.0.1:1\"\nca_file = {}",
        quoted(&ca_file)
    );
    let tollgate = Tollgate::start(&config(&backend)).await;
    std::fs::write(&ca_file, "not a certificate\n").unwrap();
    let admin = tollgate.admin.expect("an admin listener");
    let resp = reqwest_direct()
        .post(format!("http://{admin}/reload"))
        .send()
        .await
        .unwrap();
    let (code, body) = (resp.status().as_u16(), resp.text().await.unwrap());
    assert_eq!(code, 400, "{body}");
    let at = format!("{}:", tollgate.config_path().display());
    assert!(body.contains(&at), "{body}");
    assert!(body.contains("ca_file"), "{body}");
    assert!(body.contains("no PEM certificate found"), "{body}");
}
