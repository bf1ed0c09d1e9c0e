//! How the store reaches Redis: one node, the master a set of Sentinels names, or a
//! Redis Cluster. [`Conn`] is one connection type for the three, so that every call is
//! written once; [`Lua`] runs a script by its hash and whole when a node has not seen
//! it.
//!
//! * One node: redis-rs's `ConnectionManager`, which reconnects to the same address.
//! * Sentinel: [`Follower`] asks the sentinels for the master, and asks again when the
//!   master stops answering or answers as a replica (`READONLY`), as it does once a
//!   failover has demoted it.
//! * Cluster: redis-rs's cluster client, which routes each call to the master of its
//!   key's slot, follows `MOVED` and `ASK`, and reads the slots again when a node goes.
//!   Every script touches the keys of one group, which share one hash tag (`{group}`),
//!   so no call spans slots.
//!
//! `rediss://` connections of all three trust `[backend] ca_file` instead of the web
//! roots when it is set, and show `client_cert_file` to servers that ask for one.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::TcpSettings;
use redis::{
    Client, Cmd, ConnectionInfo, ErrorKind, FromRedisValue, IntoConnectionInfo, RedisError,
    RedisFuture, RedisResult, ServerErrorKind, Value,
};

use super::follow::Follower;
use crate::config::{BackendConfig, RedisAt, RedisUrl};

/// A connection to wherever `[backend]` says Redis is; cloned per call.
#[derive(Clone)]
pub enum Conn {
    /// One node.
    Node(ConnectionManager),
    /// The slots' masters of a Redis Cluster.
    Cluster(ClusterConnection),
    /// The master the sentinels name.
    Sentinel(Arc<Follower>),
}

/// Why `[backend]` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// `kind = "redis"` without saying where Redis is.
    #[error("the redis backend needs a url, sentinels or cluster")]
    Nowhere,
    /// A node's URL, or the nodes together, are not what the Redis client takes.
    #[error("invalid Redis URL {shown:?} (backend.{setting}): {source}")]
    Url {
        /// The setting: `url`, `sentinels` or `cluster`.
        setting: &'static str,
        /// The URLs without their passwords.
        shown: String,
        /// What the client said.
        source: RedisError,
    },
    /// Sentinel URLs that disagree on what reaches the master.
    #[error(
        "backend.sentinels: every sentinel URL must give the same scheme, user, password and \
         database, which are the master's (the sentinels' own password is sentinel_password)"
    )]
    SentinelsDisagree,
    /// A TLS file that cannot be read, or holds no certificate or key.
    #[error("{setting} {path}: {problem}")]
    TlsFile {
        /// The setting: `ca_file`, `client_cert_file` or `client_key_file`.
        setting: &'static str,
        /// The file.
        path: String,
        /// What is wrong with it.
        problem: String,
    },
}

impl BackendError {
    /// The `[backend]` setting at fault.
    pub fn setting(&self) -> &'static str {
        match self {
            BackendError::Nowhere => "kind",
            BackendError::Url { setting, .. } => setting,
            BackendError::SentinelsDisagree => "sentinels",
            BackendError::TlsFile { setting, .. } => setting,
        }
    }
}

/// Nagle's algorithm is on by default in redis-rs; every call here is a small request
/// waiting on a small answer, which it can only delay (no gain measured with one call
/// at a time; it matters when calls overlap).
pub(super) fn tcp_settings() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

/// What [`connect`] would dial, checked without dialling or needing a runtime.
enum Plan {
    Node(Client),
    Cluster(ClusterClient),
    Sentinel(Follower),
}

fn plan(config: &BackendConfig) -> Result<Plan, BackendError> {
    let timeout = config.timeout.0;
    let at = config.redis.as_ref().ok_or(BackendError::Nowhere)?;
    let certs = super::tls::certificates(&config.tls)?;
    match at {
        RedisAt::Node(url) => {
            let info = parse("url", std::slice::from_ref(url))?.remove(0);
            let info = info.set_tcp_settings(tcp_settings());
            match certs {
                Some(certs) => Client::build_with_tls(info, certs),
                None => Client::open(info),
            }
            .map(Plan::Node)
            .map_err(failed("url", std::slice::from_ref(url)))
        }
        RedisAt::Cluster(nodes) => {
            // A retry comes after the call's timeout anyway: redis-rs waits more than a
            // second between retries by default. MOVED and ASK are followed at once.
            let mut builder = ClusterClient::builder(parse("cluster", nodes)?)
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(2)
                .min_retry_wait(1)
                .max_retry_wait(20)
                .tcp_settings(tcp_settings());
            if let Some(certs) = certs {
                builder = builder.certs(certs);
            }
            builder
                .build()
                .map(Plan::Cluster)
                .map_err(failed("cluster", nodes))
        }
        RedisAt::Sentinel {
            sentinels,
            master_name,
            sentinel_password,
        } => {
            let infos = parse("sentinels", sentinels)?;
            let password = sentinel_password.as_deref();
            let follower = Follower::new(infos, master_name, password, certs, timeout)?;
            Ok(Plan::Sentinel(follower))
        }
    }
}

/// Checks `config`'s Redis URLs as the client reads them, without dialling anything.
pub fn check(config: &BackendConfig) -> Result<(), BackendError> {
    plan(config).map(drop)
}

/// The connection `config` describes, made lazily: tollgate starts while Redis is
/// down. Needs a runtime (the cluster client's task starts on it).
pub fn connect(config: &BackendConfig) -> Result<Conn, BackendError> {
    let timeout = config.timeout.0;
    match plan(config)? {
        Plan::Node(client) => {
            let manager = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_secs(1));
            ConnectionManager::new_lazy_with_config(client, manager)
                .map(Conn::Node)
                .map_err(failed("url", &[]))
        }
        Plan::Cluster(client) => {
            let config = ClusterConfig::new()
                .set_connection_timeout(timeout)
                .set_response_timeout(timeout);
            Ok(Conn::Cluster(
                client.get_pending_async_connection_with_config(config),
            ))
        }
        Plan::Sentinel(follower) => Ok(Conn::Sentinel(Arc::new(follower))),
    }
}

/// The URLs as the client reads them.
pub(super) fn parse(
    setting: &'static str,
    urls: &[RedisUrl],
) -> Result<Vec<ConnectionInfo>, BackendError> {
    urls.iter()
        .map(|url| {
            url.0
                .as_str()
                .into_connection_info()
                .map_err(failed(setting, std::slice::from_ref(url)))
        })
        .collect()
}

/// A client's refusal of `urls`, shown without their passwords.
pub(super) fn failed(
    setting: &'static str,
    urls: &[RedisUrl],
) -> impl FnOnce(RedisError) -> BackendError {
    let shown = urls
        .iter()
        .map(|u| redacted(&u.0))
        .collect::<Vec<_>>()
        .join(", ");
    move |source| BackendError::Url {
        setting,
        shown,
        source,
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Node(conn) => conn.req_packed_command(cmd),
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
            Conn::Sentinel(follower) => Box::pin(follower.clone().command(cmd)),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Node(conn) => conn.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(follower) => {
                Box::pin(follower.clone().pipeline(pipeline, offset, count))
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(conn) => conn.get_db(),
            Conn::Cluster(conn) => conn.get_db(),
            Conn::Sentinel(follower) => follower.db(),
        }
    }
}

/// Whether `error` says the connection no longer reaches a master: it broke, timed out,
/// or the node answers as a replica. An error of the script itself says nothing of
/// the connection.
pub(super) fn lost(error: &RedisError) -> bool {
    match error.kind() {
        ErrorKind::Server(kind) => matches!(kind, ServerErrorKind::ReadOnly),
        _ => true,
    }
}

/// A Lua script, run by its hash (`EVALSHA`); a node that answers `NOSCRIPT` (one that
/// just started, was promoted, or took over a slot) is sent the whole script
/// (`EVAL`), which it keeps for the next time. `SCRIPT LOAD` is not used: in a cluster it
/// goes to every node and fails while any is down.
pub struct Lua {
    code: &'static str,
    hash: String,
}

impl Lua {
    /// The script `code`.
    pub fn new(code: &'static str) -> Lua {
        Lua {
            code,
            hash: redis::Script::new(code).get_hash().to_string(),
        }
    }

    /// Runs it on `conn` with `keys` (all of one slot) and `args`.
    pub async fn run<T: FromRedisValue>(
        &self,
        conn: &mut Conn,
        keys: &[String],
        args: &[Vec<u8>],
    ) -> RedisResult<T> {
        let call = |verb: &str, script: &str| {
            let mut cmd = redis::cmd(verb);
            cmd.arg(script).arg(keys.len()).arg(keys);
            for arg in args {
                cmd.arg(arg.as_slice());
            }
            cmd
        };
        match call("EVALSHA", &self.hash).query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                call("EVAL", self.code).query_async(conn).await
            }
            answer => answer,
        }
    }
}

/// One argument of a script, as bytes.
pub fn arg(value: impl redis::ToRedisArgs) -> Vec<u8> {
    value.to_redis_args().concat()
}

/// `url` with any password in its userinfo replaced by `***`.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
            None => format!("{scheme}://***@{host}"),
        },
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_shown_without_its_password() {
        let cases = [
            ("redis://:secret@redis:6379/0", "redis://:***@redis:6379/0"),
            ("rediss://app:secret@redis/1", "rediss://app:***@redis/1"),
            ("redis://token@redis", "redis://***@redis"),
            ("redis://redis:6379", "redis://redis:6379"),
        ];
        for (url, shown) in cases {
            assert_eq!(redacted(url), shown);
        }
    }

    fn backend(redis: RedisAt) -> BackendConfig {
        BackendConfig {
            kind: crate::config::BackendKind::Redis,
            redis: Some(redis),
            ..BackendConfig::default()
        }
    }

    fn urls(list: &[&str]) -> Vec<RedisUrl> {
        list.iter().map(|u| RedisUrl(u.to_string())).collect()
    }

    /// A plain test, outside any runtime: the check dials nothing and spawns nothing.
    #[test]
    fn the_three_are_checked_without_dialling() {
        let good = [
            RedisAt::Node(RedisUrl("redis://127.0.0.1:1/0".into())),
            RedisAt::Cluster(urls(&[
                "redis://:pw@127.0.0.1:1",
                "redis://:pw@127.0.0.1:2",
            ])),
            RedisAt::Sentinel {
                sentinels: urls(&["rediss://:pw@127.0.0.1:1", "rediss://:pw@127.0.0.1:2"]),
                master_name: "main".into(),
                sentinel_password: Some("s".into()),
            },
        ];
        for at in good {
            check(&backend(at.clone())).unwrap_or_else(|e| panic!("{at:?}: {e}"));
        }
        let bad = [
            (
                RedisAt::Cluster(urls(&["redis://:a@127.0.0.1:1", "redis://:b@127.0.0.1:2"])),
                "cluster",
            ),
            (
                RedisAt::Sentinel {
                    sentinels: urls(&["redis://:a@127.0.0.1:1", "rediss://:a@127.0.0.1:2"]),
                    master_name: "main".into(),
                    sentinel_password: None,
                },
                "sentinels",
            ),
            (
                RedisAt::Node(RedisUrl("redis://:secret@127.0.0.1:notaport".into())),
                "url",
            ),
        ];
        for (at, setting) in bad {
            let e = check(&backend(at.clone())).expect_err("refused");
            assert_eq!(e.setting(), setting, "{at:?}: {e}");
            assert!(!e.to_string().contains("secret"), "{e}");
        }
    }
}
