//! A redis-server that speaks TLS alone, with a certificate of a throwaway private CA
//! ([`TestCa`]), on a loopback port the kernel chose free; killed by its PID when
//! dropped; and a `redis-sentinel` watching it, over TLS too. Debian's redis-server is
//! built with TLS.

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
    dir: tempfile::TempDir,
}

/// A `redis-sentinel` speaking TLS alone, watching a [`RedisTls`] over TLS; killed by
/// its PID when dropped.
pub struct SentinelTls {
    child: Option<Child>,
    pub port: u16,
}

/// A port the kernel chose free a moment ago: `--tls-port 0` turns TLS off, and a
/// sentinel announces its port.
fn free_port() -> u16 {
    std::net::TcpListener::bind((LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn spawn(program: &str, args: &[&str]) -> Child {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{program} runs (scripts/test installs it): {e}"))
}

fn kill(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl RedisTls {
    /// Starts it with the server certificate `ca` signed; when `auth_clients`, it
    /// refuses clients without a certificate `ca` signed. Waits until it answers PING
    /// over TLS.
    pub async fn start(ca: &TestCa, auth_clients: bool) -> RedisTls {
        RedisTls::start_with(ca, auth_clients, None).await
    }

    /// [`RedisTls::start`], a node of a cluster if given its bus port: the bus is TLS
    /// too, and always asks the other nodes for a client certificate.
    async fn start_with(ca: &TestCa, auth_clients: bool, bus: Option<u16>) -> RedisTls {
        let dir = tempfile::tempdir().expect("a temporary directory");
        ca.write_server_pem(dir.path());
        let client_pem = ca.write_client_pem(dir.path());
        let client = auth_clients.then(|| client_pem.clone());
        let port = free_port();
        let at = |name: &str| dir.path().join(name).display().to_string();
        let bus = bus.map(|p| p.to_string());
        let (client_cert, client_key) = (at("client.pem"), at("client-key.pem"));
        let cluster = match &bus {
            Some(bus) => vec![
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                bus,
                "--tls-cluster",
                "yes",
                "--tls-client-cert-file",
                &client_cert,
                "--tls-client-key-file",
                &client_key,
            ],
            None => vec![],
        };
        let base = [
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
        let args: Vec<&str> = base.iter().chain(&cluster).copied().collect();
        let server = RedisTls {
            child: Some(spawn("redis-server", &args)),
            port,
            ca: ca.ca_pem_path(),
            client,
            dir,
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
        self.ask_at(self.port, args).await
    }

    /// Starts a sentinel that knows it as `master_name`, over TLS (with its server
    /// certificate, as a client certificate if asked), and waits until the sentinel
    /// sees it up.
    pub async fn sentinel(&self, master_name: &str) -> SentinelTls {
        let port = free_port();
        let at = |name: &str| self.dir.path().join(name).display().to_string();
        let conf = write_file(
            self.dir.path(),
            "sentinel.conf",
            &format!(
                "port 0\nbind 127.0.0.1\ndir {dir}\ntls-port {port}\n\
                 tls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {ca}\n\
                 tls-auth-clients no\ntls-replication yes\n\
                 sentinel monitor {master_name} 127.0.0.1 {master} 1\n",
                dir = at(""),
                cert = at("cert.pem"),
                key = at("key.pem"),
                ca = self.ca.display(),
                master = self.port,
            ),
        );
        let sentinel = SentinelTls {
            child: Some(spawn("redis-sentinel", &[conf.to_str().unwrap()])),
            port,
        };
        let watching = within_bound(async || {
            let args = ["SENTINEL", "MASTER", master_name];
            let fields: Vec<String> = self.ask_at(port, &args).await.ok()?;
            let flags = fields.iter().skip_while(|f| *f != "flags").nth(1)?;
            (flags == "master").then_some(())
        })
        .await;
        assert!(watching.is_some(), "the sentinel never saw its master up");
        sentinel
    }

    /// Three of them, masters of a Redis Cluster (no replicas) that also talk to each
    /// other over TLS; waits until every one says the cluster is ok.
    pub async fn cluster(ca: &TestCa) -> Vec<RedisTls> {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            nodes.push(RedisTls::start_with(ca, false, Some(free_port())).await);
        }
        let mut create = clean_command("redis-cli", &[]);
        create.arg("--tls").arg("--cacert").arg(ca.ca_pem_path());
        create.args(["--cluster", "create"]);
        create.args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)));
        create.args(["--cluster-replicas", "0", "--cluster-yes"]);
        create_cluster(create).await;
        let ok = within_bound(async || {
            for node in &nodes {
                let info: String = node.ask(&["CLUSTER", "INFO"]).await.ok()?;
                info.contains("cluster_state:ok").then_some(())?;
            }
            Some(())
        })
        .await;
        assert!(ok.is_some(), "the TLS cluster never came up");
        nodes
    }

    /// Sends `args` to the TLS port `port` (this server's, or its sentinel's).
    async fn ask_at<T: redis::FromRedisValue>(
        &self,
        port: u16,
        args: &[&str],
    ) -> redis::RedisResult<T> {
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
            let url = format!("rediss://127.0.0.1:{port}");
            let client = redis::Client::build_with_tls(url, certs)?;
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
        kill(&mut self.child);
    }
}

impl Drop for SentinelTls {
    fn drop(&mut self) {
        kill(&mut self.child);
    }
}
