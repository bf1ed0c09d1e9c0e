//! The dashboard's 15 minutes, group list and top lists in headless Chromium: a demo
//! run drawn into the picture docs/ shows, and pages of 1, 50 and 1000 groups whose
//! numbers are `/status`'s.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{field, group_section, headless, shown_per_second};
use crate::support::*;

/// `/status` as JSON.
async fn status(proxy: &Proxy) -> serde_json::Value {
    serde_json::from_str(&admin_get(proxy, "/status").await).unwrap()
}

/// The group of `/status` named `name`.
fn group<'a>(status: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    let groups = status["groups"].as_array().unwrap();
    let found = groups.iter().find(|g| g["name"] == name);
    found.unwrap_or_else(|| panic!("no group {name} in {status}"))
}

/// `/history` of `group`.
async fn history(proxy: &Proxy, group: &str) -> serde_json::Value {
    let json = admin_get(proxy, &format!("/history?group={group}")).await;
    serde_json::from_str(&json).unwrap()
}

/// Where the picture goes: `screenshots/` in cargo's target directory, never the
/// source tree (scripts/screenshots copies it to docs/).
fn screenshot_path() -> PathBuf {
    let tmp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = tmp.parent().unwrap().join("screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("dashboard.png")
}

/// The rows of the group list: each `data-row` name with its cells' texts.
fn rows(dom: &str) -> Vec<(String, String, String)> {
    let mut found = Vec::new();
    for row in dom.split("<tr data-row=\"").skip(1) {
        let name = &row[..row.find('"').unwrap()];
        let row = &row[..row.find("</tr>").unwrap()];
        let (queued, rate) = (field(row, "queued"), field(row, "rate"));
        found.push((name.to_string(), queued.to_string(), rate.to_string()));
    }
    found
}

/// A demo run: a paced group an upstream pauses while twenty requests queue, a group
/// with a budget per key, a fair queue. Once the pause, departures after it and a queue
/// are in the history, the page is dumped (its numbers checked) and photographed.
#[tokio::test]
async fn dashboard_draws_a_demo_run_and_its_picture() {
    let answered = Arc::new(AtomicUsize::new(0));
    let count = answered.clone();
    let demo = Upstream::start(move |_| match count.fetch_add(1, Ordering::SeqCst) {
        2 => Reply::status(429).header("retry-after", "2"),
        _ => Reply::ok("ok"),
    })
    .await;
    let keyed = Upstream::start(|_| Reply::ok("ok")).await;
    let fair = Upstream::start(|_| Reply::ok("ok")).await;
    let proxy = start_proxy_with_admin(&format!(
        r#"
        [[limit]]
        name = "demo"
        hosts = ["{}"]
        rate = "2/s"
        max_wait = "5m"
        [[limit]]
        name = "keyed"
        hosts = ["{}"]
        rate = "1/m"
        max_wait = "5m"
        key = "header:x-key"
        key_labels = {{ "8ed3f6ad" = "alpha-bot" }}
        [[limit]]
        name = "fair"
        hosts = ["{}"]
        rate = "1/m"
        max_wait = "5m"
        fair_by = "header:x-tenant"
        weights = {{ interactive = 4, batch = 1 }}
        "#,
        demo.authority(),
        keyed.authority(),
        fair.authority()
    ))
    .await;
    let client = reqwest_via(&proxy, None);
    let mut sent = Vec::new();
    for i in 0..20 {
        sent.push(tokio::spawn(client.get(demo.url(&format!("/{i}"))).send()));
    }
    for (header, value, n, upstream) in [
        ("x-key", "alpha", 3, &keyed),
        ("x-key", "beta", 2, &keyed),
        ("x-tenant", "interactive", 3, &fair),
        ("x-tenant", "batch", 2, &fair),
    ] {
        for i in 0..n {
            let request = client.get(upstream.url(&format!("/{value}/{i}")));
            sent.push(tokio::spawn(request.header(header, value).send()));
        }
    }
    // Each key's first request leaves at once, the other two wait; the fair queue's
    // first leaves and four wait.
    wait_queued(&proxy, "fair", 4).await;
    eventually_async(async || {
        let s = status(&proxy).await;
        let keys = &group(&s, "keyed")["keys"];
        let queued: u64 = (keys["busiest"].as_array()?.iter())
            .map(|k| k["queued"].as_u64().unwrap_or(0))
            .sum();
        (keys["count"] == 2 && queued == 3).then_some(())
    })
    .await;
    // The pause, and departures after it, while requests still wait (twenty at under
    // 2/s take over ten seconds).
    eventually_async(async || {
        let h = history(&proxy, "demo").await;
        let paused = h["paused"].as_array()?;
        let ended = paused.iter().rposition(|p| p == 1)?;
        let after: u64 = (h["departures"].as_array()?[ended + 1..].iter())
            .map(|d| d.as_u64().unwrap_or(0))
            .sum();
        let queued = h["queued"].as_array()?.last()?.as_u64()?;
        // A dozen seconds drawn, for a picture that shows what the charts are for.
        let seconds = h["seconds"].as_u64()?;
        (after > 0 && queued > 0 && seconds >= 12).then_some(())
    })
    .await;

    let url = format!("http://{}/", proxy.admin.unwrap());
    let dom = headless(&url, &["--dump-dom"]).await;
    let s = status(&proxy).await;
    let section = group_section(&dom, "keyed");
    assert!(section.contains("keys: 2 of at most 10000"), "{section}");
    let keys = &section[section.find("data-field=\"keys\"").unwrap()..];
    assert!(keys.contains("data-name=\"alpha-bot\""), "{keys}");
    let beta = (group(&s, "keyed")["keys"]["busiest"]
        .as_array()
        .unwrap()
        .iter())
    .find(|k| k["label"].is_null())
    .unwrap();
    assert!(
        keys.contains(&format!("data-name=\"{}\"", beta["name"].as_str().unwrap())),
        "{keys}"
    );
    let section = group_section(&dom, "fair");
    let flows = &section[section.find("data-field=\"flows\"").unwrap()..];
    // Flows as /status has them: the most waiting first, label, queued, weight.
    let listed = group(&s, "fair")["flows"].as_array().unwrap();
    assert_eq!(listed.len(), 2, "{s}");
    let cells = |label: &str| {
        let row = &flows[flows.find(&format!("data-name=\"{label}\"")).unwrap()..];
        let row = &row[..row.find("</tr>").unwrap()];
        (row.split("<td>").skip(1))
            .map(|c| c[..c.find('<').unwrap()].to_string())
            .collect::<Vec<_>>()
    };
    // Which tenant's request left first is the scheduler's choice; four wait in all.
    let mut total = 0;
    for flow in listed {
        let label = flow["label"].as_str().unwrap();
        let queued = flow["queued"].as_u64().unwrap();
        total += queued;
        assert_eq!(
            cells(label),
            [queued.to_string(), flow["weight"].to_string()]
        );
    }
    assert_eq!(total, 4);
    // The demo's card draws its four charts, with the pause shaded.
    let section = group_section(&dom, "demo");
    for chart in ["departures", "queued", "waits", "statuses"] {
        assert!(
            section.contains(&format!("data-chart=\"{chart}\"")),
            "{chart}"
        );
    }
    assert!(section.contains("class=\"band\""), "{section}");
    assert!(
        field(section, "pushbacks").starts_with("1 pauses"),
        "{section}"
    );

    let png = screenshot_path();
    let _ = std::fs::remove_file(&png);
    let shot = format!("--screenshot={}", png.display());
    headless(&url, &[&shot, "--window-size=1000,1900"]).await;
    let bytes = std::fs::read(&png).expect("chromium wrote the screenshot");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    for request in sent {
        request.abort();
    }
    proxy.shutdown().await;
}

/// `n` groups: `busy` (one request gone, three waiting behind a rate of 1/min) and
/// `n - 1` idle ones at `i/s`. The page draws the list (`busy` first, who waits most)
/// and cards without a script error, with `/status`'s numbers in every row.
async fn renders_groups(n: usize) {
    let upstream = Upstream::start(|_| Reply::ok("done")).await;
    let mut config = format!(
        "[[limit]]\nname = \"busy\"\nhosts = [\"{}\"]\nrate = \"1/m\"\nmax_wait = \"5m\"\n",
        upstream.authority()
    );
    for i in 1..n {
        config +=
            &format!("[[limit]]\nname = \"g{i}\"\nhosts = [\"g{i}.test\"]\nrate = \"{i}/s\"\n");
    }
    let proxy = start_proxy_with_admin(&config).await;
    let client = reqwest_via(&proxy, None);
    let mut waiting = Vec::new();
    for i in 0..4 {
        waiting.push(tokio::spawn(
            client.get(upstream.url(&format!("/{i}"))).send(),
        ));
        if i == 0 {
            upstream.wait_for_requests(1).await;
        }
    }
    wait_queued(&proxy, "busy", 3).await;
    let s = status(&proxy).await;
    assert_eq!(s["groups"].as_array().unwrap().len(), n);

    let dom = headless(
        &format!("http://{}/", proxy.admin.unwrap()),
        &["--dump-dom"],
    )
    .await;
    assert!(
        dom.contains("data-polls="),
        "the page never rendered:\n{dom}"
    );
    assert!(!dom.contains("data-errors="), "{dom}");
    let cards = dom.matches("<section class=\"group").count();
    assert_eq!(cards, n.min(20));
    let rows = rows(&dom);
    if n == 1 {
        // One group needs no list.
        assert!(dom.contains("<section id=\"list\" hidden"), "{dom}");
    }
    assert_eq!(rows.len(), n.min(100));
    assert_eq!(rows[0].0, "busy", "who waits most comes first");
    for (name, queued, rate) in &rows {
        let g = group(&s, name);
        assert_eq!(queued, &g["queued"].to_string(), "{name}");
        let pace = g["pace_in_force_per_second"].as_f64().unwrap();
        let shown = if name == "busy" {
            "1/min".to_string()
        } else {
            shown_per_second(pace)
        };
        assert_eq!(rate, &shown, "{name}");
    }
    if n > 100 {
        let more = format!("and {} more groups, waiting less", n - 100);
        assert!(dom.contains(&more), "{more}");
    }
    let busy = group_section(&dom, "busy");
    assert_eq!(field(busy, "queued"), "3");
    for request in waiting {
        request.abort();
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn dashboard_renders_one_group() {
    renders_groups(1).await;
}

#[tokio::test]
async fn dashboard_renders_fifty_groups() {
    renders_groups(50).await;
}

#[tokio::test]
async fn dashboard_renders_a_thousand_groups() {
    renders_groups(1000).await;
}

/// What `/status` costs with 1000 groups, printed (`--nocapture` shows it): a
/// measurement, not a check; docs/operations.md quotes it.
#[tokio::test]
async fn status_of_a_thousand_groups_is_timed() {
    let mut config = String::new();
    for i in 0..1000 {
        config += &format!("[[limit]]\nname = \"g{i}\"\nhosts = [\"g{i}.test\"]\nrate = \"5/s\"\n");
    }
    let proxy = start_proxy_with_admin(&config).await;
    let mut took = Vec::new();
    for _ in 0..20 {
        let started = std::time::Instant::now();
        let s = status(&proxy).await;
        took.push(started.elapsed());
        assert_eq!(s["groups"].as_array().unwrap().len(), 1000);
    }
    took.sort();
    println!(
        "GET /status, 1000 groups, 20 times: median {:?}, max {:?}",
        took[10], took[19]
    );
    proxy.shutdown().await;
}

/// The bucket of the wait histogram a wait of `seconds` falls in (1 ms doubling).
fn bucket(seconds: f64) -> i32 {
    (0..17)
        .find(|i| seconds <= 0.001 * f64::from(1u32 << i))
        .unwrap_or(17)
}

/// The wait chart agrees with the access log: twelve requests sent at once to a group
/// at 4/s wait 0 to 2.75 s; each second's p50 on the chart is in the histogram bucket
/// of the median wait the access log gives the requests that left in that second, or
/// the next one (the chart reads buckets, the log milliseconds).
#[tokio::test]
async fn the_wait_chart_agrees_with_the_access_log() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let mut proxy = Tollgate::start(&format!(
        "[[limit]]\nname = \"waits\"\nhosts = [\"127.0.0.1\"]\nrate = \"4/s\"\n{ADMIN_ON_PORT_0}"
    ))
    .await;
    let client = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(proxy.url()).unwrap())
        .build()
        .unwrap();
    let sends = (0..12).map(|i| client.get(upstream.url(&format!("/wait/{i}"))).send());
    for answer in futures_util::future::join_all(sends).await {
        assert_eq!(answer.unwrap().status(), 200);
    }
    proxy.wait_for_log("/wait/11").await;
    // The access log's waits, in the order the requests left (they arrived together).
    let lines = within_bound(async || {
        let log = proxy.log();
        let lines: Vec<String> = (log.lines())
            .filter(|l| l.contains(" access: ") && l.contains("/wait/"))
            .map(str::to_string)
            .collect();
        (lines.len() == 12).then_some(lines)
    })
    .await
    .expect("twelve access lines");
    let mut waits: Vec<f64> = (lines.iter())
        .map(|l| field_of(l, "wait_ms").parse::<f64>().unwrap() / 1000.0)
        .collect();
    waits.sort_by(f64::total_cmp);
    // Once the history has every departure, each second's share of them.
    let series = within_bound(async || {
        let (_, body) = proxy.admin("/history?group=waits").await;
        let series: serde_json::Value = serde_json::from_str(&body).unwrap();
        let departed: u64 = (series["departures"].as_array()?.iter())
            .map(|d| d.as_u64().unwrap_or(0))
            .sum();
        (departed == 12).then_some(series)
    })
    .await
    .expect("the history counts twelve departures");
    let departures = series["departures"].as_array().unwrap();
    let p50 = series["wait_p50_seconds"].as_array().unwrap();
    let mut left = waits.as_slice();
    let mut compared = 0;
    for (n, chart) in departures.iter().zip(p50) {
        let n = n.as_u64().unwrap() as usize;
        if n == 0 {
            continue;
        }
        let (these, rest) = left.split_at(n);
        left = rest;
        let median = these[(n - 1) / 2];
        let chart = chart.as_f64().expect("a p50 for a second with departures");
        let (ours, theirs) = (bucket(chart), bucket(median));
        assert!(
            (ours - theirs).abs() <= 1,
            "chart p50 {chart} s, access log median {median} s: {series} {waits:?}"
        );
        compared += 1;
    }
    assert!(compared >= 3, "{series}");
}

/// `key=value` of an access line.
fn field_of<'a>(line: &'a str, key: &str) -> &'a str {
    let start = line.find(&format!(" {key}=")).expect(key) + key.len() + 2;
    line[start..].split(' ').next().unwrap()
}
