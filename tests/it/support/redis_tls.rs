//! A redis-server that speaks TLS alone, with a certificate of a throwaway private CA
//! ([`TestCa`]), on a loopback port the kernel chose free; killed by its PID when
//! dropped. Debian's redis-server is built with TLS.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::*;

/// A real `redis-server` with `--port 0` (no plain TCP) and a TLS port.
pub struct RedisTls {
    child: Option<Child>,
    pub port: u16,
    ca: PathBuf,
    /// The client certificate and key it trusts, when it asks clients for one.
    client: Option<(PathBuf, PathBuf)>,
    _dir: tempfile::TempDir,
}

impl RedisTls {
    /// Starts it with the server certificate `ca` signed; when `auth_clients`, it
    /// refuses clients without a certificate `ca` signed. Waits until it answers PING
    /// over TLS.
    pub async fn start(ca: &TestCa, auth_clients: bool) -> RedisTls {
        let dir = tempfile::tempdir().expect("a temporary directory");
        ca.write_server_pem(dir.path());
        let client = auth_clients.then(|| ca.write_client_pem(dir.path()));
        // `--tls-port 0` turns TLS off: the kernel picks a free port a moment before.
        let port = std::net::TcpListener::bind((LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let at = |name: &str| dir.path().join(name).display().to_string();
        let args = [
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &at("cert.pem"),
            "--tls-key-file",
            &at("key.pem"),
            "--tls-ca-cert-file",
            &ca.ca_pem_path().display().to_string(),
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            &at(""),
        ];
        let child = Command::new("redis-server")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (scripts/test installs it)");
        let server = RedisTls {
            child: Some(child),
            port,
            ca: ca.ca_pem_path(),
            client,
            _dir: dir,
        };
        let up = within_bound(async || server.ask::<String>(&["PING"]).await.ok()).await;
        assert!(
            up.is_some(),
            "redis-server never answered over TLS on {port}"
        );
        server
    }

    /// `rediss://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    /// The client certificate and key it trusts, when it asks for one.
    pub fn client_pem(&self) -> Option<&(PathBuf, PathBuf)> {
        self.client.as_ref()
    }

    /// Sends `args` over TLS, trusting the test CA alone, within a few seconds.
    pub async fn ask<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let read = |path: &PathBuf| std::fs::read(path).expect("PEM file");
        let certs = redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: read(cert),
                    client_key: read(key),
                }),
            root_cert: Some(read(&self.ca)),
        };
        let call = async {
            let client = redis::Client::build_with_tls(self.url(), certs)?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd(args[0])
                .arg(&args[1..])
                .query_async::<T>(&mut conn)
                .await
        };
        let timeout = || std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        tokio::time::timeout(Duration::from_secs(5), call)
            .await
            .unwrap_or_else(|_| Err(timeout()))
    }
}

impl Drop for RedisTls {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
