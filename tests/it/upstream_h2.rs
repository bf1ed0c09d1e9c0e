//! Gateway routes to HTTPS upstreams run by a real nginx (Debian's nginx-light):
//! over HTTP/2 a request names its upstream in `:authority` alone, over HTTP/1.1 in
//! `Host`. nginx 1.22 turns `:authority` into a `Host` header of its own and answers
//! 400 to a request that carries both (RFC 9113 §8.3.1: clients use `:authority`, not
//! `Host`).
//!
//! nginx is found on `PATH` or at /usr/sbin/nginx; `scripts/test` installs it.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::support::*;

/// The nginx binary: on `PATH`, or where Debian puts it (root's `PATH` has it, other
/// users' may not).
/// Two ports on 127.0.0.1 that were free a moment ago.
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").expect("bind");
    let b = TcpListener::bind("127.0.0.1:0").expect("bind");
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

/// nginx on 127.0.0.1 answering every request with `proto=<protocol> host=<Host>`,
/// over TLS on two ports: [`Nginx::h2`] offers h2 and HTTP/1.1 by ALPN,
/// [`Nginx::http1`] HTTP/1.1 alone. Its files (configuration, certificates, logs) are
/// in a temporary directory; the process is killed when this is dropped.
struct Nginx {
    child: Child,
    h2: u16,
    http1: u16,
    /// The CA nginx's certificate is signed by; tollgate trusts it (`ca_file`).
    ca: TestCa,
    dir: tempfile::TempDir,
}

impl Nginx {
    async fn start() -> Nginx {
        let nginx = nginx_binary();
        // The ports are free when picked but not reserved: another process may take one
        // before nginx binds it, in which case nginx exits and is started again.
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("tempdir");
            let ca = TestCa::new();
            ca.write_server_pem(dir.path());
            let (h2, http1) = free_ports();
            let config = nginx_config(dir.path(), h2, http1);
            let config = write_file(dir.path(), "nginx.conf", &config);
            let child = Command::new(&nginx)
                .arg("-c")
                .arg(&config)
                .arg("-p")
                .arg(dir.path())
                .arg("-e")
                .arg(dir.path().join("error.log"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", nginx.display()));
            let mut server = Nginx {
                child,
                h2,
                http1,
                ca,
                dir,
            };
            if server.listening().await {
                return server;
            }
            eprintln!(
                "nginx did not start, trying other ports; its log:\n{}",
                server.log()
            );
        }
        panic!("nginx did not start in 5 attempts");
    }

    /// Waits until nginx accepts connections on both ports; false if it exited first.
    async fn listening(&mut self) -> bool {
        let started = within_bound(async || {
            if self.child.try_wait().expect("nginx's status").is_some() {
                return Some(false);
            }
            let accepts = |port| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
            (accepts(self.h2) && accepts(self.http1)).then_some(true)
        })
        .await;
        started.unwrap_or_else(|| {
            panic!(
                "nginx did not listen within {BOUND:?}; its log:\n{}",
                self.log()
            )
        })
    }

    /// What nginx logged.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// nginx's configuration: one process in the foreground, everything it writes in `dir`.
fn nginx_config(dir: &Path, h2: u16, http1: u16) -> String {
    let dir = dir.display();
    let server = |listen: String| {
        format!(
            "    server {{
        listen {listen};
        server_name localhost;
        ssl_certificate {dir}/cert.pem;
        ssl_certificate_key {dir}/key.pem;
        location / {{
            default_type text/plain;
            return 200 \"proto=$server_protocol host=$http_host\\n\";
        }}
    }}
"
        )
    };
    format!(
        "daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
events {{
    worker_connections 64;
}}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
{}{}}}
",
        server(format!("127.0.0.1:{h2} ssl http2")),
        server(format!("127.0.0.1:{http1} ssl")),
    )
}

/// tollgate with a route to each of `nginx`'s ports, trusting its CA: `/h2/` and `/h1/`.
async fn routes_to(nginx: &Nginx) -> Proxy {
    start_proxy(&format!(
        "[proxy]\nca_file = {:?}\n\
         [[route]]\nprefix = \"/h2/\"\nupstream = \"https://127.0.0.1:{}\"\n\
         [[route]]\nprefix = \"/h1/\"\nupstream = \"https://127.0.0.1:{}\"\n",
        nginx.ca.ca_pem_path().to_str().unwrap(),
        nginx.h2,
        nginx.http1,
    ))
    .await
}

/// GETs `path` from tollgate; returns the status and the body.
async fn get(proxy: &Proxy, path: &str) -> (u16, String) {
    let resp = reqwest_direct()
        .get(format!("{}{path}", proxy.url()))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body"))
}

#[tokio::test]
async fn an_h2_upstream_gets_the_authority_in_authority_alone() {
    let nginx = Nginx::start().await;
    let proxy = routes_to(&nginx).await;
    // Several requests, so that the pooled connection carries some of them.
    for i in 0..3 {
        let (status, body) = get(&proxy, &format!("/h2/{i}")).await;
        assert_eq!(
            (status, body.as_str()),
            (
                200,
                format!("proto=HTTP/2.0 host=127.0.0.1:{}\n", nginx.h2).as_str()
            ),
            "request {i}; nginx's log:\n{}",
            nginx.log()
        );
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn an_http1_upstream_gets_host() {
    let nginx = Nginx::start().await;
    let proxy = routes_to(&nginx).await;
    for i in 0..3 {
        let (status, body) = get(&proxy, &format!("/h1/{i}")).await;
        assert_eq!(
            (status, body.as_str()),
            (
                200,
                format!("proto=HTTP/1.1 host=127.0.0.1:{}\n", nginx.http1).as_str()
            ),
            "request {i}; nginx's log:\n{}",
            nginx.log()
        );
    }
    proxy.shutdown().await;
}
