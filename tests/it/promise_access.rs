//! README, "Pointing your apps at it" and Security, through the built binary: who may
//! connect (`[access] clients`), and what a blind tunnel is: one request of its group,
//! only to `connect_ports`, and a 429 inside it reaches the app untouched.

use std::net::{IpAddr, Ipv4Addr};

use crate::promises::{outcome, send};
use crate::support::*;

#[tokio::test]
async fn only_clients_in_access_clients_may_use_it() {
    let upstream = Upstream::start(|_| Reply::ok("in")).await;
    let tollgate =
        Tollgate::start("[access]\nallow = [\"127.0.0.0/8\"]\nclients = [\"127.0.0.2/32\"]\n")
            .await;
    let from = |ip: Ipv4Addr| {
        reqwest::Client::builder()
            .proxy(reqwest::Proxy::all(tollgate.url()).unwrap())
            .local_address(IpAddr::V4(ip))
            .timeout(BOUND)
            .build()
            .unwrap()
    };
    let listed = send(
        &from(Ipv4Addr::new(127, 0, 0, 2)),
        "GET",
        &upstream.url("/a"),
    )
    .await;
    assert_eq!((listed.status, listed.body.as_str()), (200, "in"));
    let other = send(
        &from(Ipv4Addr::new(127, 0, 0, 1)),
        "GET",
        &upstream.url("/b"),
    )
    .await;
    assert_eq!(other.status, 403, "{other:?}");
    assert!(
        other
            .header("proxy-status")
            .is_some_and(|p| p.starts_with("tollgate; error=")),
        "{other:?}"
    );
    assert!(
        other.body.contains("127.0.0.1"),
        "names the client: {other:?}"
    );
    assert_eq!(upstream.paths(), ["/a"]);
}

#[tokio::test]
async fn a_blind_tunnel_is_one_request_of_its_group_and_a_429_inside_reaches_the_app() {
    let upstream = Upstream::start(|s| match s.path.as_str() {
        "/refused" => Reply::status(429).header("retry-after", "1"),
        path => Reply::ok(path.to_string()),
    })
    .await;
    let config = format!(
        "[proxy]\nconnect_ports = [\"*\"]\n{ADMIN_ON_PORT_0}\n\
         [[limit]]\nname = \"tunnels\"\nhosts = [\"{}\"]\nrate = \"1/m\"\nmax_wait = \"2s\"\n",
        upstream.authority()
    );
    let tollgate = Tollgate::start(&config).await;
    let proxy = tollgate.url();
    // One tunnel (curl -p) carrying three requests: the group counts the tunnel once,
    // and tollgate, not reading inside, neither replays the 429 nor pauses the group.
    let (a, refused, b) = (
        upstream.url("/a"),
        upstream.url("/refused"),
        upstream.url("/b"),
    );
    let out = curl(
        &["-p", "-x", &proxy, "-w", "%{http_code} ", &a, &refused, &b],
        &[],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.text(), "/a200 429 /b200 ");
    assert_eq!(upstream.paths(), ["/a", "/refused", "/b"]);
    assert!(
        upstream
            .requests()
            .iter()
            .all(|s| s.header("via").is_none()),
        "curl's own requests, not tollgate's"
    );
    assert_eq!(tollgate.metric(&outcome("tunnels", "admitted")).await, 1.0);
    // The group's one request a minute is spent: the next tunnel is refused.
    let out = curl(&["-p", "-x", &proxy, &a], &[]).await;
    assert_ne!(out.code, 0);
    assert!(out.headers.starts_with("HTTP/1.1 503"), "{}", out.headers);
    assert_eq!(upstream.requests().len(), 3);

    // Without connect_ports, only 443: a tunnel to the upstream's port is refused.
    let strict = Tollgate::start("").await;
    let out = curl(&["-p", "-x", &strict.url(), &a], &[]).await;
    assert_ne!(out.code, 0);
    assert!(out.headers.starts_with("HTTP/1.1 403"), "{}", out.headers);
    assert_eq!(upstream.requests().len(), 3);
}
