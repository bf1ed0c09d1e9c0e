//! The workload a profile-guided build of tollgate learns from (`scripts/build-pgo`).
//!
//! A PGO build runs an instrumented tollgate once under a realistic load, records how often
//! each branch and call was taken, and compiles tollgate again with that record, so the
//! compiler lays out and inlines the request path for the way it actually runs
//! (docs/performance-log.md, "Sixteenth session"). This program is that load. It starts
//! real loopback upstreams (plain http and TLS, from the tests' `support` module), runs the
//! tollgate binary it is given as a child process with a configuration of its own, and
//! drives it the ways apps do, in proportions that put the forward path first:
//!
//! | phase | what | requests |
//! |---|---|---|
//! | forward | absolute-form GETs (and every tenth a POST) on kept-alive connections, an unlimited group | 32 × 1 000 |
//! | fresh | the same, one connection per request | 1 000 |
//! | paced | a `[[route]]` into a group at 2 000/s, `burst = 1`: every request queues | 32 × 100 + 400 fresh |
//! | tls | a `[[route]]` to the TLS upstream | 16 × 500 |
//! | tunnel | `CONNECT` tunnels carrying HTTP/1.1 requests | 16 × 200 |
//! | pushback | an upstream that answers each request's first try with `429` and `Retry-After: 0` | 8 × 50 |
//! | headers | responses with `RateLimit` and `X-RateLimit-*` headers that do not pause | 8 × 100 |
//!
//! plus a few admin requests (`/metrics`, `/status`). Every answer is checked, and at the
//! end so is what each upstream received, so a run that trained on errors fails instead
//! of producing a profile of the error path. tollgate is then stopped with SIGTERM: an
//! instrumented binary writes its profile when it exits normally.
//!
//! ```text
//! cargo build --example pgo_training
//! target/debug/examples/pgo_training path/to/instrumented/tollgate
//! ```
//!
//! Only 127.0.0.1 is used. The child is killed if the run fails or takes over two
//! minutes.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::HashSet;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use support::{Reply, TestCa, Upstream};

/// The longest the whole run may take before it is called a failure.
const DEADLINE: Duration = Duration::from_secs(120);

/// A client connection to the proxy (or, inside a tunnel, to the upstream).
type Sender = SendRequest<Full<Bytes>>;

fn main() -> ExitCode {
    let Some(binary) = std::env::args().nth(1) else {
        eprintln!("usage: pgo_training TOLLGATE_BINARY");
        return ExitCode::from(2);
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("the tokio runtime starts");
    match runtime.block_on(async { tokio::time::timeout(DEADLINE, train(&binary)).await }) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("pgo_training: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("pgo_training: not finished within {DEADLINE:?}");
            ExitCode::FAILURE
        }
    }
}

/// Starts the upstreams and tollgate, runs every phase, stops tollgate and checks what
/// the upstreams received.
async fn train(binary: &str) -> Result<(), String> {
    // The first try of each request on the push-back path is refused; its retry is not.
    let refused_once = Arc::new(Mutex::new(HashSet::<String>::new()));
    let plain = Upstream::start(move |seen| answer(seen, &refused_once)).await;
    let ca = TestCa::new();
    let tls =
        Upstream::start_tls_http1(|seen| Reply::ok(format!("{}\n", seen.body.len())), &ca).await;

    let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let proxy_addr = free_port()?;
    let admin_addr = free_port()?;
    let config = dir.path().join("tollgate.toml");
    std::fs::write(
        &config,
        config_toml(&plain, &tls, &ca, proxy_addr, admin_addr),
    )
    .map_err(|e| format!("writing the configuration: {e}"))?;
    let child = Command::new(binary)
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {binary}: {e}"))?;
    let mut tollgate = Running(Some(child));
    tollgate.wait_listening(proxy_addr).await?;

    let total = Instant::now();
    // Each phase, and what each of its requests makes the upstreams receive: (plain,
    // TLS) requests; a push-back request is refused once and sent again.
    let phases: [(&str, Load, (usize, usize)); 8] = [
        ("forward", Load::kept(32, 1_000, forward(&plain)), (1, 0)),
        ("fresh", Load::fresh(1_000, forward(&plain)), (1, 0)),
        ("paced", Load::kept(32, 100, route("/paced/items")), (1, 0)),
        (
            "paced-fresh",
            Load::fresh(400, route("/paced/items")),
            (1, 0),
        ),
        ("tls", Load::kept(16, 500, route("/tls/items")), (0, 1)),
        ("tunnel", Load::tunnels(16, 200, plain.addr()), (1, 0)),
        ("pushback", Load::kept(8, 50, route("/busy/items")), (2, 0)),
        (
            "headers",
            Load::kept(8, 100, route("/limits/items")),
            (1, 0),
        ),
    ];
    let (mut expected_plain, mut expected_tls) = (0, 0);
    for (name, load, (to_plain, to_tls)) in phases {
        let started = Instant::now();
        let sent = load
            .run(proxy_addr)
            .await
            .map_err(|e| format!("{name}: {e}"))?;
        println!("{name:>12}: {sent:>6} requests in {:?}", started.elapsed());
        expected_plain += sent * to_plain;
        expected_tls += sent * to_tls;
    }
    for path in ["/metrics", "/status", "/healthz"] {
        let (status, _) = get_admin(admin_addr, path).await?;
        if status != StatusCode::OK {
            return Err(format!("admin {path}: {status}"));
        }
    }
    println!("       total: {:?}", total.elapsed());
    tollgate.stop().await?;

    let (got_plain, got_tls) = (plain.requests().len(), tls.requests().len());
    if (got_plain, got_tls) != (expected_plain, expected_tls) {
        return Err(format!(
            "the upstreams received {got_plain} and {got_tls} requests, not {expected_plain} and {expected_tls}"
        ));
    }
    Ok(())
}

/// What the plain upstream answers: the length of a request's body (all the TLS one
/// answers), `429` to the first try of a push-back request, rate-limit headers on
/// `/limits/`.
fn answer(seen: &support::Seen, refused_once: &Mutex<HashSet<String>>) -> Reply {
    if seen.path.starts_with("/busy/") {
        let key = seen.header("x-request-id").unwrap_or_default().to_string();
        if refused_once.lock().unwrap().insert(key) {
            return Reply::status(429).header("retry-after", "0");
        }
    }
    let reply = Reply::ok(format!("{}\n", seen.body.len())).header("content-type", "text/plain");
    if seen.path.starts_with("/limits/") {
        return reply
            .header("ratelimit-policy", "\"default\";q=1000;w=60")
            .header("ratelimit", "\"default\";r=900;t=30")
            .header("x-ratelimit-remaining", "900")
            .header("x-ratelimit-reset", "30");
    }
    reply
}

/// tollgate's configuration for the run: an unlimited `[defaults]` group for the
/// forward path, and one route (with its own group) for each of the other phases. A
/// route replaces its prefix with the upstream's base path, so `/busy/` and `/limits/`
/// keep theirs there for the upstream to tell them apart.
fn config_toml(
    plain: &Upstream,
    tls: &Upstream,
    ca: &TestCa,
    proxy: SocketAddr,
    admin: SocketAddr,
) -> String {
    let plain = plain.url("");
    let tls = tls.url("");
    let ca_file = ca.ca_pem_path();
    format!(
        r#"
[proxy]
listen = "{proxy}"
connect_ports = ["*"]
ca_file = "{ca_file}"
shutdown_grace = "5s"

[admin]
listen = "{admin}"

[defaults]
rate = "unlimited"
concurrency = 100000

[[route]]
prefix = "/paced/"
upstream = "{plain}"
limit = "paced"

[[route]]
prefix = "/tls/"
upstream = "{tls}"

[[route]]
prefix = "/busy/"
upstream = "{plain}/busy"
limit = "busy"

[[route]]
prefix = "/limits/"
upstream = "{plain}/limits"
limit = "limits"

[[limit]]
name = "paced"
hosts = ["paced.invalid"]
rate = "2000/s"
burst = 1
queue = 10000

[[limit]]
name = "busy"
hosts = ["busy.invalid"]
rate = "unlimited"
retry_statuses = [429]
max_retries = 3

[[limit]]
name = "limits"
hosts = ["limits.invalid"]
rate = "unlimited"
"#,
        ca_file = ca_file.display(),
    )
}

/// How a phase's requests are built: from the request's number within the phase.
type MakeRequest = Arc<dyn Fn(usize) -> Request<Full<Bytes>> + Send + Sync>;

/// The absolute-form requests an app with `HTTP_PROXY` set sends: GETs with the headers
/// of an API client, and every tenth a POST with a small JSON body.
fn forward(upstream: &Upstream) -> MakeRequest {
    let (base, host) = (upstream.url(""), upstream.authority());
    Arc::new(move |n| {
        let uri = format!("{base}/v1/items/{n}?page=2&per_page=50");
        with_api_headers(n, Request::builder().uri(uri).header("host", &host))
    })
}

/// Origin-form requests to one of tollgate's gateway routes, as an app sends them to
/// tollgate's address.
fn route(prefix: &'static str) -> MakeRequest {
    Arc::new(move |n| {
        let builder = Request::builder().header("host", "tollgate.internal:8080");
        with_api_headers(n, builder.uri(format!("{prefix}/{n}")))
    })
}

/// Adds the headers an API client sends (but `Host`, which the caller sets) and, for every tenth request, a POST body.
fn with_api_headers(n: usize, builder: http::request::Builder) -> Request<Full<Bytes>> {
    let builder = builder
        .header("user-agent", "pgo-training/1.0")
        .header("accept", "application/json")
        .header("accept-encoding", "gzip")
        .header("authorization", "Bearer 0123456789abcdef0123456789abcdef")
        .header("x-request-id", format!("req-{n:08}"));
    let (method, body) = if n % 10 == 9 {
        let body = format!(r#"{{"name":"item {n}","tags":["a","b"],"count":{n}}}"#);
        (Method::POST, Bytes::from(body))
    } else {
        (Method::GET, Bytes::new())
    };
    builder
        .method(method)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .expect("a valid request")
}

/// One phase: how many connections, how many requests on each, and what they are.
struct Load {
    /// Connections (or tunnels) used at once.
    connections: usize,
    /// Requests sent one after another on each connection.
    per_connection: usize,
    /// Whether each request gets a connection of its own (the others keep theirs).
    fresh: bool,
    /// For a tunnel phase, where the tunnels go; `None` sends requests to tollgate.
    tunnel_to: Option<SocketAddr>,
    /// The requests.
    make: MakeRequest,
}

impl Load {
    /// `connections` kept-alive connections, `per_connection` requests on each.
    fn kept(connections: usize, per_connection: usize, make: MakeRequest) -> Load {
        Load {
            connections,
            per_connection,
            fresh: false,
            tunnel_to: None,
            make,
        }
    }

    /// `requests` requests, each on a new connection, eight at a time.
    fn fresh(requests: usize, make: MakeRequest) -> Load {
        Load {
            connections: 8,
            per_connection: requests / 8,
            fresh: true,
            ..Load::kept(0, 0, make)
        }
    }

    /// `tunnels` CONNECT tunnels to `upstream`, `per_tunnel` requests through each.
    fn tunnels(tunnels: usize, per_tunnel: usize, upstream: SocketAddr) -> Load {
        let make: MakeRequest = Arc::new(move |n| {
            let builder = Request::builder().header("host", upstream.to_string());
            with_api_headers(n, builder.uri(format!("/v1/tunnelled/{n}")))
        });
        Load {
            tunnel_to: Some(upstream),
            ..Load::kept(tunnels, per_tunnel, make)
        }
    }

    /// Runs the phase and returns how many requests were answered as expected.
    async fn run(self, proxy: SocketAddr) -> Result<usize, String> {
        let mut tasks = JoinSet::new();
        for c in 0..self.connections {
            let make = self.make.clone();
            let (per, fresh, tunnel_to) = (self.per_connection, self.fresh, self.tunnel_to);
            tasks.spawn(async move {
                let mut sender = open(proxy, tunnel_to).await?;
                for i in 0..per {
                    let n = c * per + i;
                    if fresh && i > 0 {
                        sender = open(proxy, tunnel_to).await?;
                    }
                    let req = make(n);
                    let expected = format!("{}\n", body_len(&req));
                    let (status, body) = send(&mut sender, req).await?;
                    if status != StatusCode::OK || body != expected.as_bytes() {
                        return Err(format!("request {n}: {status} {body:?}"));
                    }
                }
                Ok::<usize, String>(per)
            });
        }
        let mut sent = 0;
        while let Some(done) = tasks.join_next().await {
            sent += done.map_err(|e| format!("a client task failed: {e}"))??;
        }
        Ok(sent)
    }
}

/// A request body's length, which the plain upstream answers with.
fn body_len(req: &Request<Full<Bytes>>) -> u64 {
    http_body::Body::size_hint(req.body()).exact().unwrap_or(0)
}

/// An HTTP/1.1 connection to tollgate or, with `tunnel_to`, through a `CONNECT` tunnel
/// tollgate opened to that address.
async fn open(proxy: SocketAddr, tunnel_to: Option<SocketAddr>) -> Result<Sender, String> {
    let stream = TcpStream::connect(proxy)
        .await
        .map_err(|e| format!("connect to tollgate: {e}"))?;
    let (mut sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn.with_upgrades());
    let Some(target) = tunnel_to else {
        return Ok(sender);
    };
    let connect = Request::builder()
        .method(Method::CONNECT)
        .uri(target.to_string())
        .header("host", target.to_string())
        .body(Full::new(Bytes::new()))
        .expect("a valid CONNECT");
    let response = sender
        .send_request(connect)
        .await
        .map_err(|e| format!("CONNECT: {e}"))?;
    if response.status() != StatusCode::OK {
        return Err(format!("CONNECT answered {}", response.status()));
    }
    let tunnel = hyper::upgrade::on(response)
        .await
        .map_err(|e| format!("CONNECT upgrade: {e}"))?;
    let (inner, conn) = http1::handshake(tunnel)
        .await
        .map_err(|e| format!("handshake in the tunnel: {e}"))?;
    tokio::spawn(conn);
    Ok(inner)
}

/// Sends one request and reads its whole answer.
async fn send(
    sender: &mut Sender,
    req: Request<Full<Bytes>>,
) -> Result<(StatusCode, Bytes), String> {
    sender
        .ready()
        .await
        .map_err(|e| format!("connection: {e}"))?;
    let response = sender
        .send_request(req)
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok((status, body))
}

/// `GET path` on the admin listener.
async fn get_admin(admin: SocketAddr, path: &str) -> Result<(StatusCode, Bytes), String> {
    let mut sender = open(admin, None).await?;
    let req = Request::get(path)
        .header("host", admin.to_string())
        .body(Full::new(Bytes::new()))
        .expect("a valid request");
    send(&mut sender, req).await
}

/// A port on 127.0.0.1 that was free a moment ago, for tollgate to listen on.
fn free_port() -> Result<SocketAddr, String> {
    let listener = StdListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    listener.local_addr().map_err(|e| format!("bind: {e}"))
}

/// The tollgate child process; killed if dropped while still running.
struct Running(Option<Child>);

impl Running {
    /// Waits until tollgate accepts connections on `addr`, or fails if it exited.
    async fn wait_listening(&mut self, addr: SocketAddr) -> Result<(), String> {
        let child = self.0.as_mut().expect("running");
        for _ in 0..300 {
            if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
                return Err(format!("tollgate exited at start: {status}"));
            }
            if TcpStream::connect(addr).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("tollgate did not listen on {addr} within 6 s"))
    }

    /// Stops tollgate with SIGTERM and checks that it exited with 0, so that an
    /// instrumented binary has written its profile.
    async fn stop(&mut self) -> Result<(), String> {
        // Signalled while still held, so that a failure leaves it to `drop` to kill.
        let pid = rustix::process::Pid::from_child(self.0.as_ref().expect("running"));
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)
            .map_err(|e| format!("SIGTERM: {e}"))?;
        let mut child = self.0.take().expect("running");
        let status = tokio::task::spawn_blocking(move || child.wait())
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("waiting for tollgate: {e}"))?;
        if !status.success() {
            return Err(format!("tollgate exited with {status}"));
        }
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
