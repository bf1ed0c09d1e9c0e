//! Redis deployments that survive a node, made of real processes on loopback: a Redis
//! Cluster (3 masters, 3 replicas) and a Sentinel set (1 master, 1 replica, 3
//! sentinels). Every process is this test's own, on ports the kernel chose free, and is
//! killed by its PID when dropped. `scripts/test` installs `redis-server` and
//! `redis-sentinel`; `redis-cli` comes with the first.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::*;

/// The name the sentinels know the master by.
pub const MASTER_NAME: &str = "main";
/// Every data node's password (`requirepass`, and `masterauth` for its replication),
/// so that the tests pass it the way users do: in the nodes' URLs.
pub const PASSWORD: &str = "node-secret";
/// The sentinels' own password (`requirepass` in sentinel.conf), apart from the
/// nodes': `[backend] sentinel_password`.
pub const SENTINEL_PASSWORD: &str = "sentinel-secret";

/// A port the kernel chose free a moment ago. Redis Cluster and Sentinel announce the
/// port they listen on to each other, so it cannot be 0.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind((LOCALHOST, 0)).expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// One `redis-server` or `redis-sentinel` process, killed (SIGKILL, by PID) when
/// dropped.
pub struct RedisProcess {
    child: Option<Child>,
    pub port: u16,
}

impl RedisProcess {
    fn spawn(program: &str, args: &[String], port: u16) -> RedisProcess {
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{program} runs (scripts/test installs it): {e}"));
        RedisProcess {
            child: Some(child),
            port,
        }
    }

    /// Kills it like a crash (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends `args` to the data node on `port`, on a connection of its own, within a few
/// seconds.
pub async fn ask<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> redis::RedisResult<T> {
    ask_with(PASSWORD, port, args).await
}

/// Sends `args` to the sentinel on `port`.
async fn ask_sentinel<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> redis::RedisResult<T> {
    ask_with(SENTINEL_PASSWORD, port, args).await
}

async fn ask_with<T: redis::FromRedisValue>(
    password: &str,
    port: u16,
    args: &[&str],
) -> redis::RedisResult<T> {
    let timeout = || std::io::Error::from(std::io::ErrorKind::TimedOut).into();
    let call = async {
        let client = redis::Client::open(format!("redis://:{password}@127.0.0.1:{port}"))?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd(args[0])
            .arg(&args[1..])
            .query_async::<T>(&mut conn)
            .await
    };
    tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .unwrap_or_else(|_| Err(timeout()))
}

/// The common settings of a test's redis-server: no persistence, loopback only, a
/// password.
/// Runs `create`, a `redis-cli --cluster create`, and checks it succeeded.
pub(super) async fn create_cluster(mut create: tokio::process::Command) {
    let out = tokio::time::timeout(BOUND, create.output())
        .await
        .expect("redis-cli --cluster create finished in time")
        .expect("redis-cli runs");
    assert!(
        out.status.success(),
        "redis-cli --cluster create failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

fn server_args(port: u16, dir: &std::path::Path) -> Vec<String> {
    let dir = dir.join(port.to_string());
    std::fs::create_dir_all(&dir).expect("node directory");
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        dir.to_str().unwrap(),
        "--requirepass",
        PASSWORD,
        "--masterauth",
        PASSWORD,
    ]
    .map(String::from)
    .to_vec()
}

/// Waits until every node on `ports` answers PING (with `password`).
async fn wait_answering(password: &str, ports: &[u16]) {
    for &port in ports {
        let up =
            within_bound(async || ask_with::<String>(password, port, &["PING"]).await.ok()).await;
        assert!(up.is_some(), "redis on {port} never answered");
    }
}

/// A Redis Cluster of 3 masters with a replica each.
pub struct RedisCluster {
    nodes: Vec<RedisProcess>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    /// Starts six nodes, joins them with `redis-cli --cluster create`, and waits until
    /// every node sees the cluster whole and every replica is in sync.
    pub async fn start() -> RedisCluster {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let nodes: Vec<RedisProcess> = (0..6)
            .map(|_| {
                let (port, bus) = (free_port(), free_port());
                let mut args = server_args(port, dir.path());
                args.extend(
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-port",
                        &bus.to_string(),
                        // A master not heard of for this long fails over to its
                        // replica: a test's failover takes seconds, not the default 15.
                        "--cluster-node-timeout",
                        "1000",
                        // However long a replica lost its master, it may take over.
                        "--cluster-replica-validity-factor",
                        "0",
                    ]
                    .map(String::from),
                );
                RedisProcess::spawn("redis-server", &args, port)
            })
            .collect();
        let cluster = RedisCluster { nodes, _dir: dir };
        wait_answering(PASSWORD, &cluster.ports()).await;
        let mut create = clean_command("redis-cli", &[("REDISCLI_AUTH", PASSWORD)]);
        create.arg("--cluster").arg("create");
        create.args(cluster.ports().iter().map(|p| format!("127.0.0.1:{p}")));
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        create_cluster(create).await;
        let whole = within_bound(async || cluster.whole().await.then_some(())).await;
        assert!(whole.is_some(), "the cluster never came up whole");
        cluster
    }

    fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// Every node as `[backend] cluster` takes it: a URL, with the password.
    pub fn seeds(&self) -> Vec<String> {
        self.ports()
            .iter()
            .map(|p| format!("redis://:{PASSWORD}@127.0.0.1:{p}"))
            .collect()
    }

    /// Whether every live node says the cluster is ok, with 3 masters and a replica in
    /// sync for each.
    async fn whole(&self) -> bool {
        for node in self.nodes.iter().filter(|n| n.child.is_some()) {
            let Ok(info) = ask::<String>(node.port, &["CLUSTER", "INFO"]).await else {
                return false;
            };
            if !info.contains("cluster_state:ok") {
                return false;
            }
            let Ok(replication) = ask::<String>(node.port, &["INFO", "replication"]).await else {
                return false;
            };
            let synced = replication.contains("master_link_status:up")
                || replication.contains("connected_slaves:1");
            if !synced {
                return false;
            }
        }
        true
    }

    /// The port of the master that holds `key`'s slot, as the node on `asked` sees it.
    async fn master_of_at(&self, key: &str, asked: u16) -> Option<u16> {
        let slot: i64 = ask(asked, &["CLUSTER", "KEYSLOT", key]).await.ok()?;
        let nodes: String = ask(asked, &["CLUSTER", "NODES"]).await.ok()?;
        nodes.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let serving = fields.get(2)?.contains("master") && !fields[2].contains("fail");
            let holds = fields.iter().skip(8).any(|range| {
                let (from, to) = range.split_once('-').unwrap_or((range, range));
                matches!((from.parse::<i64>(), to.parse::<i64>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
            });
            let port = fields.get(1)?.split(['@', ',']).next()?.rsplit(':').next()?;
            (serving && holds).then(|| port.parse().ok()).flatten()
        })
    }

    /// The port of the master that holds `key`'s slot now.
    pub async fn master_of(&self, key: &str) -> u16 {
        let asked = self.nodes.iter().find(|n| n.child.is_some()).unwrap().port;
        eventually_async(async || self.master_of_at(key, asked).await).await
    }

    /// Kills (SIGKILL) the master that holds `key`'s slot; returns its port.
    pub async fn kill_master_of(&mut self, key: &str) -> u16 {
        let port = self.master_of(key).await;
        let node = self.nodes.iter_mut().find(|n| n.port == port).unwrap();
        node.kill();
        port
    }

    /// Waits until a node other than `old` is the master of `key`'s slot in the eyes
    /// of every live node, and the cluster is ok again; returns its port.
    pub async fn wait_promoted(&self, key: &str, old: u16) -> u16 {
        let live: Vec<u16> = (self.nodes.iter())
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect();
        let promoted = within_bound(async || {
            let mut seen = Vec::new();
            for &port in &live {
                let info = ask::<String>(port, &["CLUSTER", "INFO"]).await.ok()?;
                if !info.contains("cluster_state:ok") {
                    return None;
                }
                seen.push(self.master_of_at(key, port).await?);
            }
            let first = seen[0];
            (first != old && seen.iter().all(|p| *p == first)).then_some(first)
        })
        .await;
        promoted.expect("no replica took over the slot")
    }
}

/// A master, its replica, and three sentinels watching them.
pub struct RedisSentinels {
    master: RedisProcess,
    _replica: RedisProcess,
    sentinels: Vec<RedisProcess>,
    _dir: tempfile::TempDir,
}

impl RedisSentinels {
    /// Starts them, and waits until the replica is in sync and every sentinel knows
    /// the replica and the other two sentinels (a failover needs a majority of them).
    pub async fn start() -> RedisSentinels {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (m, r) = (free_port(), free_port());
        let master = RedisProcess::spawn("redis-server", &server_args(m, dir.path()), m);
        let mut args = server_args(r, dir.path());
        args.extend(["--replicaof", "127.0.0.1", &m.to_string()].map(String::from));
        let replica = RedisProcess::spawn("redis-server", &args, r);
        wait_answering(PASSWORD, &[m, r]).await;
        let sentinels = (0..3)
            .map(|i| {
                let port = free_port();
                let conf = write_file(
                    dir.path(),
                    &format!("sentinel-{i}.conf"),
                    &format!(
                        "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                         requirepass {SENTINEL_PASSWORD}\n\
                         sentinel monitor {MASTER_NAME} 127.0.0.1 {m} 2\n\
                         sentinel auth-pass {MASTER_NAME} {PASSWORD}\n\
                         sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                         sentinel failover-timeout {MASTER_NAME} 10000\n",
                        dir = dir.path().display()
                    ),
                );
                let conf = conf.to_str().unwrap().to_string();
                RedisProcess::spawn("redis-sentinel", &[conf], port)
            })
            .collect();
        let set = RedisSentinels {
            master,
            _replica: replica,
            sentinels,
            _dir: dir,
        };
        let ports: Vec<u16> = set.sentinels.iter().map(|s| s.port).collect();
        wait_answering(SENTINEL_PASSWORD, &ports).await;
        let ready = within_bound(async || set.ready().await.then_some(())).await;
        assert!(
            ready.is_some(),
            "the sentinels never saw each other and the replica"
        );
        set
    }

    async fn ready(&self) -> bool {
        let synced = ask::<String>(self._replica.port, &["INFO", "replication"]).await;
        if !synced.is_ok_and(|i| i.contains("master_link_status:up")) {
            return false;
        }
        for sentinel in &self.sentinels {
            let port = sentinel.port;
            let replicas =
                ask_sentinel::<Vec<redis::Value>>(port, &["SENTINEL", "REPLICAS", MASTER_NAME]);
            let others =
                ask_sentinel::<Vec<redis::Value>>(port, &["SENTINEL", "SENTINELS", MASTER_NAME]);
            match (replicas.await, others.await) {
                (Ok(r), Ok(o)) if r.len() == 1 && o.len() == 2 => {}
                _ => return false,
            }
        }
        true
    }

    /// Every sentinel as `[backend] sentinels` takes it: a URL whose password is the
    /// master's (the sentinels' own is `sentinel_password`, [`SENTINEL_PASSWORD`]).
    pub fn sentinels(&self) -> Vec<String> {
        (self.sentinels.iter())
            .map(|s| format!("redis://:{PASSWORD}@127.0.0.1:{}", s.port))
            .collect()
    }

    /// The port of the node started as the master.
    pub fn master(&self) -> u16 {
        self.master.port
    }

    /// Kills the master (SIGKILL), like a crash.
    pub fn kill_master(&mut self) {
        self.master.kill();
    }

    /// Waits until every sentinel names another node than `old` as the master, and
    /// that node answers as one; returns its port.
    pub async fn wait_failover(&self, old: u16) -> u16 {
        let promoted = within_bound(async || {
            let mut named = Vec::new();
            for sentinel in &self.sentinels {
                let args = ["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME];
                let addr: Vec<String> = ask_sentinel(sentinel.port, &args).await.ok()?;
                named.push(addr.get(1)?.parse::<u16>().ok()?);
            }
            let new = named[0];
            if new == old || named.iter().any(|p| *p != new) {
                return None;
            }
            let role: Vec<redis::Value> = ask(new, &["ROLE"]).await.ok()?;
            let master =
                matches!(role.first(), Some(redis::Value::BulkString(b)) if b == b"master");
            master.then_some(new)
        })
        .await;
        promoted.expect("the sentinels never promoted the replica")
    }
}
