//! Hot reload: `POST /reload` and `SIGHUP` read the configuration file again; groups
//! that survive keep their queue and take their new limits, and nothing queued is lost.

use std::net::IpAddr;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::support::*;

/// `[[limit]]` "api" on 127.0.0.1 at `rate`, and, when given, "gone" on 127.0.0.2.
fn config(rate: &str, gone: bool) -> String {
    let mut text = format!(
        "[[limit]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\nrate = \"{rate}\"\nmax_wait = \"60s\"\n"
    );
    if gone {
        text.push_str("[[limit]]\nname = \"gone\"\nhosts = [\"127.0.0.2\"]\nrate = \"1/s\"\nmax_wait = \"60s\"\n");
    }
    allowing_loopback(&text)
}

/// `POST /reload` on the admin listener: status and body.
async fn reload(proxy: &Proxy) -> (u16, String) {
    let admin = proxy.admin.expect("an admin listener");
    let resp = reqwest_direct()
        .post(format!("http://{admin}/reload"))
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

async fn status(proxy: &Proxy) -> serde_json::Value {
    serde_json::from_str(&admin_get(proxy, "/status").await).unwrap()
}

fn group<'a>(status: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    (status["groups"].as_array().unwrap().iter()).find(|g| g["name"] == name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_survive_a_reload_and_leave_at_the_new_rate() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let other = Upstream::start_at(IpAddr::from([127, 0, 0, 2]), |_| Reply::ok("ok")).await;
    let dir = tempfile::tempdir().unwrap();
    let file = write_file(dir.path(), "config.toml", &config("1/s", true));
    let proxy = start_proxy_from_file(&file).await;
    let before = status(&proxy).await;
    // One leaves at once, five wait in "api"; one leaves at once, two wait in "gone".
    let api: Vec<String> = (0..6).map(|i| upstream.url(&format!("/{i}"))).collect();
    let gone: Vec<String> = (0..3).map(|i| other.url(&format!("/{i}"))).collect();
    let api = get_in_order(&proxy, "api", api).await;
    let gone = get_in_order(&proxy, "gone", gone).await;
    wait_queued(&proxy, "api", 5).await;
    wait_queued(&proxy, "gone", 2).await;

    write_file(dir.path(), "config.toml", &config("20/s", false));
    let (code, body) = reload(&proxy).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("reloaded"), "{body}");

    // None lost: every request answered, each sent once.
    assert_eq!(statuses(api).await, vec![200; 6]);
    assert_eq!(statuses(gone).await, vec![200; 3]);
    assert_eq!(upstream.requests().len(), 6);
    assert_eq!(other.requests().len(), 3);
    // In their order, and faster: at 1/s the last four would be a second apart each.
    assert_eq!(upstream.paths(), ["/0", "/1", "/2", "/3", "/4", "/5"]);
    let arrived = arrivals(&upstream);
    let gaps: Vec<Duration> = arrived.windows(2).map(|w| w[1] - w[0]).collect();
    let fast = gaps[2..]
        .iter()
        .filter(|g| **g < Duration::from_millis(500))
        .count();
    assert!(fast >= 3, "not faster after the reload: {gaps:?}");

    let after = status(&proxy).await;
    assert_ne!(after["config"]["sha256"], before["config"]["sha256"]);
    let api = group(&after, "api").expect("api survives");
    assert_eq!(
        api["configured_rates_per_second"],
        serde_json::json!([20.0])
    );
    assert!(group(&after, "gone").is_none(), "{after}");
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(
        metrics.contains("tollgate_config_reloads_total 1\n"),
        "{metrics}"
    );
}

/// GETs each URL through `proxy`, each once the one before has reached `group`
/// (let out or waiting in its queue), so that they queue in this order; the GETs'
/// statuses come from [`statuses`].
async fn get_in_order(proxy: &Proxy, group: &str, urls: Vec<String>) -> Vec<JoinHandle<u16>> {
    let client = reqwest_via(proxy, None);
    let admitted = format!("tollgate_requests_total{{group=\"{group}\",outcome=\"admitted\"}}");
    let queued = format!("tollgate_queue_depth{{group=\"{group}\"}}");
    let mut tasks = Vec::new();
    for (i, url) in urls.into_iter().enumerate() {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            client.get(url).send().await.unwrap().status().as_u16()
        }));
        eventually_async(async || {
            let metrics = admin_get(proxy, "/metrics").await;
            let count = |series: &str| metric_value(&metrics, series).unwrap_or(0.0);
            (count(&admitted) + count(&queued) > i as f64).then_some(())
        })
        .await;
    }
    tasks
}

/// The statuses of `tasks`, in their order.
async fn statuses(tasks: Vec<JoinHandle<u16>>) -> Vec<u16> {
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap());
    }
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_file_or_a_new_listen_address_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_file(dir.path(), "config.toml", &config("5/s", false));
    let proxy = start_proxy_from_file(&file).await;
    let before = status(&proxy).await;

    write_file(
        dir.path(),
        "config.toml",
        "[[limit]]\nname = \"api\"\nrate = \"fast\"\n",
    );
    let (code, body) = reload(&proxy).await;
    assert_eq!(code, 400, "{body}");
    let place = format!("{}:3:", file.display());
    assert!(body.contains(&place), "no file:line:column in {body}");

    let moved = format!(
        "[proxy]\nlisten = \"127.0.0.1:1\"\n{}",
        config("5/s", false)
    );
    write_file(dir.path(), "config.toml", &moved);
    let (code, body) = reload(&proxy).await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("[proxy] listen changed"), "{body}");
    assert!(body.contains("restart"), "{body}");

    let after = status(&proxy).await;
    assert_eq!(after["config"], before["config"]);
    let api = group(&after, "api").unwrap();
    assert_eq!(api["configured_rates_per_second"], serde_json::json!([5.0]));
    let metrics = admin_get(&proxy, "/metrics").await;
    assert!(
        metrics.contains("tollgate_config_reload_failures_total 2\n"),
        "{metrics}"
    );
}

/// `kill -HUP` reloads, as nginx users expect, instead of ending the process: a group
/// the file gains shows up in `/status`.
#[tokio::test]
async fn sighup_reloads_the_binary() {
    let text = format!("[proxy]\n{ADMIN_ON_PORT_0}");
    let mut tollgate = Tollgate::start(&text).await;
    let (_, status) = tollgate.admin("/status").await;
    assert!(!status.contains("\"api\""), "{status}");
    let more =
        format!("{text}[[limit]]\nname = \"api\"\nhosts = [\"api.example\"]\nrate = \"1/s\"\n");
    std::fs::write(tollgate.config_path(), allowing_loopback(&more)).unwrap();
    tollgate.signal("HUP").await;
    tollgate.wait_for_log("configuration reloaded").await;
    assert!(tollgate.is_running(), "SIGHUP ended tollgate");
    let (_, status) = tollgate.admin("/status").await;
    assert!(status.contains("\"api\""), "{status}");
}
