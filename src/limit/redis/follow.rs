//! The master a set of Redis Sentinels names, followed through failovers.
//!
//! The sentinels are asked for the master's address when there is no connection, and
//! again as soon as a call on the connection breaks, times out (the caller's timeout
//! drops it unfinished), or is answered `READONLY`: after a failover the old master
//! is gone, or back as a replica of the new one. Until the new master answers, the
//! store is down and groups limit locally; the store's probe brings it back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, RedisError, RedisResult,
    TlsCertificates, TlsMode, Value,
};

use super::connect::{lost, BackendError};

/// The longest the sentinels and the master they name may take to be reached: the
/// resolution runs on its own, so a call's timeout does not cut it short.
const RESOLVE_BOUND: Duration = Duration::from_secs(2);

/// A connection to the master of `master_name`, made again when it is lost.
pub struct Follower {
    /// The sentinels, and how to reach the master they name.
    sentinel: tokio::sync::Mutex<SentinelClient>,
    master_name: String,
    db: i64,
    config: AsyncConnectionConfig,
    /// The connection in use and its generation, which a loss names so that it does
    /// not drop a newer connection.
    current: Mutex<Option<(u64, MultiplexedConnection)>>,
    generation: AtomicU64,
    /// The master's address last connected to, to log a change once.
    master: Mutex<String>,
}

impl Follower {
    /// A follower of `master_name` through `sentinels` (parsed URLs: their scheme and
    /// userinfo are the master's, which every URL must agree on), which authenticate
    /// with `sentinel_password` if given; over TLS, the sentinels and the master are
    /// reached with `certs` when given (`ca_file`, a client certificate). Dials nothing.
    pub fn new(
        sentinels: Vec<ConnectionInfo>,
        master_name: &str,
        sentinel_password: Option<&str>,
        certs: Option<TlsCertificates>,
        timeout: Duration,
    ) -> Result<Follower, BackendError> {
        let first = sentinels.first().ok_or(BackendError::Nowhere)?;
        let (tls, master) = (tls_mode(first.addr()), first.redis_settings().clone());
        let same = |info: &ConnectionInfo| {
            let r = info.redis_settings();
            tls_mode(info.addr()) == tls
                && (r.username(), r.password(), r.db())
                    == (master.username(), master.password(), master.db())
        };
        if !sentinels.iter().all(same) {
            return Err(BackendError::SentinelsDisagree);
        }
        let tcp = super::connect::tcp_settings();
        let addrs = sentinels.iter().map(|info| info.addr().clone());
        let failed = || super::connect::failed("sentinels", &[]);
        let mut builder =
            SentinelClientBuilder::new(addrs, master_name, SentinelServerType::Master)
                .map_err(failed())?
                .set_client_to_sentinel_tcp_settings(tcp.clone())
                .set_client_to_redis_tcp_settings(tcp)
                .set_client_to_redis_db(master.db())
                .set_client_to_redis_protocol(master.protocol());
        if let Some(username) = master.username() {
            builder = builder.set_client_to_redis_username(username);
        }
        if let Some(password) = master.password() {
            builder = builder.set_client_to_redis_password(password);
        }
        if let Some(password) = sentinel_password {
            builder = builder.set_client_to_sentinel_password(password);
        }
        if let Some(mode) = tls {
            builder = builder.set_client_to_redis_tls_mode(mode);
            if let Some(certs) = certs {
                builder = builder
                    .set_client_to_sentinel_certificates(certs.clone())
                    .set_client_to_redis_certificates(certs);
            }
        }
        Ok(Follower {
            sentinel: tokio::sync::Mutex::new(builder.build().map_err(failed())?),
            master_name: master_name.to_string(),
            db: master.db(),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout)),
            current: Mutex::new(None),
            generation: AtomicU64::new(0),
            master: Mutex::new(String::new()),
        })
    }

    /// The master's database.
    pub fn db(&self) -> i64 {
        self.db
    }

    /// Sends `cmd` to the master.
    pub async fn command(self: Arc<Self>, cmd: &Cmd) -> RedisResult<Value> {
        let (generation, mut conn) = self.connection().await?;
        let watch = Watch {
            follower: &self,
            generation,
            settled: false,
        };
        let answer = conn.req_packed_command(cmd).await;
        watch.settle(answer.as_ref().err());
        answer
    }

    /// Sends a pipeline to the master.
    pub async fn pipeline(
        self: Arc<Self>,
        pipeline: &redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let (generation, mut conn) = self.connection().await?;
        let watch = Watch {
            follower: &self,
            generation,
            settled: false,
        };
        let answer = conn.req_packed_commands(pipeline, offset, count).await;
        watch.settle(answer.as_ref().err());
        answer
    }

    /// The connection in use, or a new one to the master the sentinels name now.
    async fn connection(self: &Arc<Self>) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        // Spawned: a caller that gives up (its timeout) leaves the resolution running,
        // and the next call finds its connection.
        let follower = self.clone();
        let resolve = tokio::spawn(async move {
            tokio::time::timeout(RESOLVE_BOUND, follower.resolve())
                .await
                .unwrap_or_else(|_| Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into()))
        });
        resolve
            .await
            .unwrap_or_else(|e| Err(RedisError::from(std::io::Error::other(e.to_string()))))
    }

    async fn resolve(self: Arc<Self>) -> RedisResult<(u64, MultiplexedConnection)> {
        let mut sentinel = self.sentinel.lock().await;
        // Another call may have connected while this one waited for the sentinels.
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let client = sentinel.async_get_client().await?;
        let conn = client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        let address = client.get_connection_info().addr().to_string();
        let mut master = self.master.lock().unwrap_or_else(|p| p.into_inner());
        if *master != address {
            tracing::info!(master_name = %self.master_name, %address, "Redis Sentinel names this master");
            *master = address;
        }
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let current = (generation, conn);
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(current.clone());
        Ok(current)
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Drops the connection of `generation`, if still in use: the next call asks the
    /// sentinels again.
    fn forget(&self, generation: u64) {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            *current = None;
        }
    }
}

/// A call on the connection of `generation`: forgotten if the call fails for the
/// connection's sake, or is dropped before it ends (its caller's timeout: a master
/// that stopped answering without closing the connection).
struct Watch<'a> {
    follower: &'a Follower,
    generation: u64,
    settled: bool,
}

impl Watch<'_> {
    fn settle(mut self, error: Option<&RedisError>) {
        self.settled = !error.is_some_and(lost);
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.follower.forget(self.generation);
        }
    }
}

/// The TLS mode of a parsed URL's address, `None` for plain TCP.
fn tls_mode(addr: &ConnectionAddr) -> Option<TlsMode> {
    match addr {
        ConnectionAddr::TcpTls { insecure, .. } => Some(if *insecure {
            TlsMode::Insecure
        } else {
            TlsMode::Secure
        }),
        _ => None,
    }
}
