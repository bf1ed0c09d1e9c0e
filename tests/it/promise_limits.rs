//! README, Configuration: the keys of a group, through the built binary. `burst`, a
//! list of rates, `costs`, a route's `limit`, `*.domain` and `host:port` patterns and
//! `[defaults]` each change what the upstream receives; each test counts it.
//!
//! Groups at `1/m` with a short `max_wait` make every outcome a count (see
//! `promises/mod.rs`); one test times the pace after a burst with robust statistics.

use crate::promises::{client, get, get_n, group_status, outcome, send, Answer};
use crate::support::*;

/// A `[[limit]]` table for the hosts `hosts` with `extra` lines.
fn limit(name: &str, hosts: &[String], extra: &str) -> String {
    let hosts: Vec<String> = hosts.iter().map(|h| format!("{h:?}")).collect();
    format!(
        "\n[[limit]]\nname = \"{name}\"\nhosts = [{}]\n{extra}\n",
        hosts.join(", ")
    )
}

/// How many of `statuses` are `status`.
fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

#[tokio::test]
async fn burst_lets_that_many_leave_at_once_and_no_more() {
    let with = Upstream::start(|_| Reply::ok("ok")).await;
    let without = Upstream::start(|_| Reply::ok("ok")).await;
    let slow = "rate = \"1/m\"\nmax_wait = \"5s\"";
    let config = format!(
        "{}{}",
        limit("burst3", &[with.authority()], &format!("{slow}\nburst = 3")),
        limit("burst1", &[without.authority()], slow)
    );
    let tollgate = Tollgate::start(&config).await;

    // Five at once to each: the burst leaves, the rest would wait a minute each.
    let client = client(&tollgate);
    let calls = (0..5).flat_map(|i| {
        [with.url(&format!("/w{i}")), without.url(&format!("/o{i}"))].map(|url| {
            let client = client.clone();
            async move { (url.clone(), send(&client, "GET", &url).await) }
        })
    });
    let answers = futures_util::future::join_all(calls).await;
    let of = |upstream: &Upstream| -> Vec<&Answer> {
        answers
            .iter()
            .filter(|(url, _)| url.starts_with(&upstream.url("/")))
            .map(|(_, a)| a)
            .collect()
    };
    let statuses = |upstream| of(upstream).iter().map(|a| a.status).collect::<Vec<_>>();
    assert_eq!(count(&statuses(&with), 200), 3, "{answers:?}");
    assert_eq!(count(&statuses(&without), 200), 1, "{answers:?}");
    for a in of(&with).iter().filter(|a| a.status != 200) {
        a.assert_max_wait("burst3");
    }
    for a in of(&without).iter().filter(|a| a.status != 200) {
        a.assert_max_wait("burst1");
    }
    assert_eq!(with.requests().len(), 3);
    assert_eq!(without.requests().len(), 1);
}

#[tokio::test]
async fn after_the_burst_requests_leave_at_the_rate() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let config = limit(
        "paced",
        &[upstream.authority()],
        "rate = \"10/s\"\nburst = 4",
    );
    let tollgate = Tollgate::start(&config).await;
    let client = client(&tollgate);
    let calls = (0..20).map(|i| {
        let (client, url) = (client.clone(), upstream.url(&format!("/p{i}")));
        async move { send(&client, "GET", &url).await.status }
    });
    let statuses = futures_util::future::join_all(calls).await;
    assert_eq!(statuses, [200; 20]);
    let at = arrivals(&upstream);
    assert_eq!(at.len(), 20);
    // Four back to back, then one every 100 ms: the last seventeen span at least
    // 1.6 s less 10 %, and no second holds more than 10 + 4 (+1).
    assert_paced(&at, std::time::Duration::from_millis(100), 4);
}

#[tokio::test]
async fn every_rate_in_a_list_must_allow() {
    let first = Upstream::start(|_| Reply::ok("ok")).await;
    let last = Upstream::start(|_| Reply::ok("ok")).await;
    let fast = Upstream::start(|_| Reply::ok("ok")).await;
    let config = format!(
        "{ADMIN_ON_PORT_0}{}{}{}",
        limit(
            "strict_first",
            &[first.authority()],
            "rate = [\"1/m\", \"50/s\"]\nmax_wait = \"2s\""
        ),
        limit(
            "strict_last",
            &[last.authority()],
            "rate = [\"50/s\", \"1/m\"]\nmax_wait = \"2s\""
        ),
        limit(
            "fast",
            &[fast.authority()],
            "rate = [\"50/s\", \"100/10s\"]\nmax_wait = \"2s\""
        ),
    );
    let tollgate = Tollgate::start(&config).await;
    // Wherever the strict rate stands in the list, it holds the group to one.
    assert_eq!(get_n(&tollgate, &first.url("/a"), 3).await, [200, 503, 503]);
    assert_eq!(get_n(&tollgate, &last.url("/b"), 3).await, [200, 503, 503]);
    // Two loose rates let all through, one after the other.
    assert_eq!(get_n(&tollgate, &fast.url("/c"), 3).await, [200, 200, 200]);
    assert_eq!(first.requests().len(), 1);
    assert_eq!(last.requests().len(), 1);
    assert_eq!(fast.requests().len(), 3);
    let status = group_status(&tollgate, "strict_last").await;
    assert_eq!(
        status["configured_rates_per_second"],
        serde_json::json!([50.0, 1.0 / 60.0]),
        "{status}"
    );
}

#[tokio::test]
async fn costs_spend_the_rate_by_method_and_upstream_path_first_rule_first() {
    let upstream = Upstream::start(|_| Reply::ok("ok")).await;
    let routed = Upstream::start(|_| Reply::ok("ok")).await;
    let config = format!(
        "[[route]]\nprefix = \"/gw/\"\nupstream = \"{}\"\n{}{}",
        routed.url("/v1"),
        limit(
            "search",
            &[upstream.authority()],
            "rate = \"1/m\"\nburst = 6\nmax_wait = \"2s\"\n\
             costs = [{ method = \"POST\", path_prefix = \"/search\", cost = 4 }, \
             { path_prefix = \"/search\", cost = 2 }]"
        ),
        limit(
            "routed",
            &[routed.authority()],
            "rate = \"1/m\"\nburst = 3\nmax_wait = \"2s\"\n\
             costs = [{ path_prefix = \"/v1/search\", cost = 3 }]"
        ),
    );
    let tollgate = Tollgate::start(&config).await;
    let client = client(&tollgate);
    // Six units: GET /search costs 2 (the POST rule does not match its method), POST
    // /search 4 (the first matching rule), then nothing is left for a GET of cost 1.
    let get = send(&client, "GET", &upstream.url("/search/a")).await;
    assert_eq!(get.status, 200, "{get:?}");
    let post = send(&client, "POST", &upstream.url("/search/b")).await;
    assert_eq!(post.status, 200, "{post:?}");
    send(&client, "GET", &upstream.url("/other"))
        .await
        .assert_max_wait("search");
    assert_eq!(upstream.paths(), ["/search/a", "/search/b"]);

    // `path_prefix` is the upstream's path: /gw/search goes out as /v1/search, cost 3.
    let gw = format!("{}/gw", tollgate.url());
    assert_eq!(
        send(&client, "GET", &format!("{gw}/search")).await.status,
        200
    );
    send(&client, "GET", &format!("{gw}/x"))
        .await
        .assert_max_wait("routed");
    assert_eq!(routed.paths(), ["/v1/search"]);
}

#[tokio::test]
async fn a_route_counts_in_the_group_its_limit_names_else_its_hosts() {
    let limited = Upstream::start(|s| Reply::ok(s.path.clone())).await;
    let other = Upstream::start(|s| Reply::ok(s.path.clone())).await;
    let config = format!(
        "[[route]]\nprefix = \"/named/\"\nupstream = \"{other}\"\nlimit = \"shared\"\n\
         [[route]]\nprefix = \"/own/\"\nupstream = \"{other}\"\n\
         [[route]]\nprefix = \"/host/\"\nupstream = \"{limited}\"\n{}",
        limit(
            "shared",
            &[limited.authority()],
            "rate = \"1/m\"\nmax_wait = \"2s\""
        ),
        other = other.url(""),
        limited = limited.url(""),
    );
    let tollgate = Tollgate::start(&config).await;
    let base = tollgate.url();
    // The route naming "shared" spends its one request ...
    assert_eq!(get(&tollgate, &format!("{base}/named/1")).await.status, 200);
    // ... so the host of "shared" is spent, through a route to it or as a proxy.
    get(&tollgate, &format!("{base}/host/2"))
        .await
        .assert_max_wait("shared");
    get(&tollgate, &limited.url("/3"))
        .await
        .assert_max_wait("shared");
    // The same upstream through a route without `limit` is its own host's group.
    assert_eq!(
        get_n(&tollgate, &format!("{base}/own/4"), 3).await,
        [200, 200, 200]
    );
    assert_eq!(other.paths(), ["/1", "/4", "/4", "/4"]);
    assert!(limited.paths().is_empty(), "{:?}", limited.paths());
}

#[tokio::test]
async fn a_wildcard_matches_names_under_the_domain_not_the_domain_itself() {
    // `[access] deny` refuses these names before they wait in their group, and before
    // any DNS: each ends in tollgate's 403 at once, counted as denied in the group its
    // name falls into. Nothing is resolved or dialled.
    let config = format!(
        "{ADMIN_ON_PORT_0}\n[access]\ndeny = [\"*.wild.invalid\", \"wild.invalid\"]\n{}",
        limit(
            "wild",
            &["*.wild.invalid".to_string()],
            "rate = \"1/m\"\nmax_wait = \"2s\""
        )
    );
    let tollgate = Tollgate::start(&config).await;
    let denied = |a: &Answer| {
        a.status == 403
            && a.header("proxy-status")
                .is_some_and(|p| p.starts_with("tollgate; error=destination_"))
    };
    for url in [
        "http://a.wild.invalid/",
        "http://b.wild.invalid/",
        "http://deep.er.wild.invalid/",
        "http://wild.invalid/",
    ] {
        let a = get(&tollgate, url).await;
        assert!(denied(&a), "{url}: {a:?}");
    }
    // Three names under the domain fall into the group; none spent its one slot.
    assert_eq!(tollgate.metric(&outcome("wild", "denied")).await, 3.0);
    assert_eq!(tollgate.metric(&outcome("wild", "admitted")).await, 0.0);
    // The domain itself is not under it: a group of its own.
    assert_eq!(
        tollgate.metric(&outcome("wild.invalid", "denied")).await,
        1.0
    );
}

#[tokio::test]
async fn a_host_with_a_port_matches_that_port_only() {
    let limited = Upstream::start(|_| Reply::ok("ok")).await;
    let other_port = Upstream::start(|_| Reply::ok("ok")).await;
    let config = limit(
        "one_port",
        &[limited.authority()],
        "rate = \"1/m\"\nmax_wait = \"2s\"",
    );
    let tollgate = Tollgate::start(&config).await;
    assert_eq!(get_n(&tollgate, &limited.url("/a"), 2).await, [200, 503]);
    assert_eq!(
        get_n(&tollgate, &other_port.url("/b"), 3).await,
        [200, 200, 200]
    );
    assert_eq!(limited.requests().len(), 1);
    assert_eq!(other_port.requests().len(), 3);
}

#[tokio::test]
async fn defaults_are_inherited_by_every_limit_and_by_hosts_in_none() {
    let listed = Upstream::start(|_| Reply::ok("ok")).await;
    let unlisted = Upstream::start(|_| Reply::ok("ok")).await;
    let config = format!(
        "[defaults]\nrate = \"1/m\"\nburst = 2\nmax_wait = \"2s\"\n{}",
        limit("listed", &[listed.authority()], "burst = 3")
    );
    let tollgate = Tollgate::start(&config).await;
    // The [[limit]] keeps its own burst and takes the rate and max_wait of [defaults].
    assert_eq!(
        get_n(&tollgate, &listed.url("/l"), 4).await,
        [200, 200, 200, 503]
    );
    // A host in no [[limit]] gets [defaults] as they are, in a group of its own.
    assert_eq!(
        get_n(&tollgate, &unlisted.url("/u"), 3).await,
        [200, 200, 503]
    );
    let refused = get(&tollgate, &unlisted.url("/u")).await;
    // Its group is named after the host (without the port).
    let proxy_status = refused.assert_max_wait("127.0.0.1");
    assert!(
        proxy_status.contains("within max_wait (2s)"),
        "max_wait comes from [defaults]: {proxy_status}"
    );
    assert_eq!(listed.requests().len(), 3);
    assert_eq!(unlisted.requests().len(), 2);
}

#[tokio::test]
async fn a_group_s_requests_leave_in_arrival_order_and_other_groups_flow_meanwhile() {
    // One in flight at a time, and the first holds its place upstream for 3 s: the
    // rest queue behind it, one by one, in a known order.
    let held = Upstream::start(|s| {
        let delay = if s.path == "/hold" { 3000 } else { 0 };
        Reply::ok("ok").delay(std::time::Duration::from_millis(delay))
    })
    .await;
    let other = Upstream::start(|_| Reply::ok("ok")).await;
    let config = format!(
        "{ADMIN_ON_PORT_0}{}{}",
        limit("held", &[held.authority()], "concurrency = 1"),
        limit("other", &[other.authority()], "concurrency = 1"),
    );
    let tollgate = Tollgate::start(&config).await;
    let client = client(&tollgate);
    let start = |path: &str| {
        let (client, url) = (client.clone(), held.url(path));
        tokio::spawn(async move { send(&client, "GET", &url).await.status })
    };
    let mut calls = vec![start("/hold")];
    held.wait_for_requests(1).await;
    for i in 1..=5 {
        calls.push(start(&format!("/q{i}")));
        tollgate
            .wait_metric("tollgate_queue_depth{group=\"held\"}", i as f64)
            .await;
    }
    // Another group is not held up: its requests are answered while /hold is out.
    assert_eq!(get_n(&tollgate, &other.url("/free"), 3).await, [200; 3]);
    assert_eq!(held.in_flight(), 1, "/hold is still out");
    assert_eq!(held.paths(), ["/hold"]);

    for call in calls {
        assert_eq!(call.await.unwrap(), 200);
    }
    assert_eq!(held.paths(), ["/hold", "/q1", "/q2", "/q3", "/q4", "/q5"]);
}
