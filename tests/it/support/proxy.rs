//! tollgate in the test's own runtime, for tests of its internals.

use std::net::SocketAddr;
use std::path::Path;

use bytes::Bytes;
use http::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::*;

/// tollgate serving on 127.0.0.1:0 in this test's runtime.
pub struct Proxy {
    /// The proxy's listening address.
    pub addr: SocketAddr,
    /// The admin listener's address, when started with [`start_proxy_with_admin`].
    pub admin: Option<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

/// Parses `config_toml` (no `listen` key needed), binds 127.0.0.1:0 and spawns
/// `tollgate::run` on it, on the test's runtime.
pub async fn start_proxy(config_toml: &str) -> Proxy {
    launch(config_toml, false).await
}

/// Like [`start_proxy`], with the admin endpoints on another 127.0.0.1:0 listener; see
/// [`admin_get`].
pub async fn start_proxy_with_admin(config_toml: &str) -> Proxy {
    launch(config_toml, true).await
}

/// What every test config that reaches the loopback upstreams says: tollgate refuses
/// loopback destinations unless `[access] allow` names them.
pub const ALLOW_LOOPBACK: &str = "\n[access]\nallow = [\"127.0.0.0/8\", \"::1\"]\n";

/// `config_toml` with loopback allowed ([`ALLOW_LOOPBACK`]), unless it has an `[access]`
/// table of its own (a test of the policy says what it allows).
pub fn allowing_loopback(config_toml: &str) -> String {
    if config_toml.contains("[access]") {
        config_toml.to_string()
    } else {
        format!("{config_toml}{ALLOW_LOOPBACK}")
    }
}

/// Like [`start_proxy_with_admin`], loading the file at `path` as the binary does, so
/// that a reload (`POST /reload`) reads it again. The file must allow loopback itself.
pub async fn start_proxy_from_file(path: &Path) -> Proxy {
    let config = tollgate::config::Config::load(path)
        .unwrap_or_else(|e| panic!("test config does not load: {e}"));
    launch_config(config, true).await
}

async fn launch(config_toml: &str, with_admin: bool) -> Proxy {
    let config_toml = allowing_loopback(config_toml);
    let config = tollgate::config::Config::parse(&config_toml, "test.toml")
        .unwrap_or_else(|e| panic!("test config does not parse: {e}"));
    launch_config(config, with_admin).await
}

async fn launch_config(config: tollgate::config::Config, with_admin: bool) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let addr = listener.local_addr().unwrap();
    let admin = match with_admin {
        true => Some(TcpListener::bind("127.0.0.1:0").await.expect("bind admin")),
        false => None,
    };
    let admin_addr = admin.as_ref().map(|l| l.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        // A dropped sender also means "stop", so a forgotten proxy still drains.
        let shutdown = async {
            let _ = stopped.await;
        };
        let result = tollgate::run(listener, admin, config, shutdown).await;
        if let Err(e) = result {
            panic!("tollgate::run failed: {e}");
        }
    });
    Proxy {
        addr,
        admin: admin_addr,
        stop: Some(stop),
        task: Some(task),
    }
}

/// Opens a tunnel to `authority` as an HTTP/2 client does: a `CONNECT` stream on a
/// prior-knowledge h2 connection to the proxy; asserts the `200` and returns the tunnel.
pub async fn h2_connect(proxy: &Proxy, authority: &str) -> TokioIo<hyper::upgrade::Upgraded> {
    let tcp = TcpStream::connect(proxy.addr)
        .await
        .expect("connect to the proxy");
    let (mut send, conn) = hyper::client::conn::http2::handshake::<
        _,
        _,
        http_body_util::Empty<Bytes>,
    >(TokioExecutor::new(), TokioIo::new(tcp))
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let connect = Request::connect(authority)
        .body(http_body_util::Empty::new())
        .expect("a CONNECT request");
    let resp = send.send_request(connect).await.expect("CONNECT answered");
    assert_eq!(resp.status(), 200);
    TokioIo::new(hyper::upgrade::on(resp).await.expect("the tunnel opens"))
}

/// GETs `path` from the proxy's admin listener and returns the body; panics unless
/// the answer is 200.
pub async fn admin_get(proxy: &Proxy, path: &str) -> String {
    let admin = proxy
        .admin
        .expect("admin_get needs a proxy from start_proxy_with_admin");
    let resp = reqwest_direct()
        .get(format!("http://{admin}{path}"))
        .send()
        .await
        .expect("admin request");
    let status = resp.status();
    let body = resp.text().await.expect("admin body");
    assert_eq!(status, 200, "GET {path} on the admin listener: {body}");
    body
}

impl Proxy {
    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Completes the shutdown future passed to the server, without waiting.
    pub fn begin_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Whether the server has returned.
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Triggers shutdown and waits (at most [`BOUND`]) for the server to return.
    pub async fn shutdown(mut self) {
        self.begin_shutdown();
        let task = self.task.take().expect("not yet joined");
        match tokio::time::timeout(BOUND, task).await {
            Err(_) => panic!("the server did not return within {BOUND:?} of shutdown"),
            Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Ok(_) => {}
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.begin_shutdown();
    }
}
