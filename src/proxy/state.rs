//! Building the proxy from the configuration, swapping what a reload changes, and what
//! the server and the admin endpoints read of it.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Live, Proxy};
use crate::access::Access;
use crate::classify::Classifier;
use crate::config::{BackendKind, Config, ConfigError};
use crate::intercept::Intercept;
use crate::limit::{Limits, Redis, Store};
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;
use crate::upstream::{Dialer, Upstream};

impl Live {
    /// Everything of `config` a reload may change, with the groups `limits` builds for
    /// it once nothing else can fail (a reload reconfigures the groups in force).
    pub(crate) fn new(
        config: &Config,
        metrics: &Metrics,
        limits: impl FnOnce() -> Arc<Limits>,
    ) -> Result<Live, ConfigError> {
        Ok(Live {
            access: Access::new(config, metrics.credential_checks.clone())?,
            classifier: Classifier::new(config),
            limits: limits(),
            access_log: config.log.access,
            server_timing: config.proxy.server_timing,
            loaded: crate::reload::Loaded::of(config),
        })
    }
}

impl Proxy {
    /// Builds the proxy; fails only on settings that need I/O to check (`ca_file`, the
    /// Redis URL).
    pub fn new(config: &Config) -> Result<Proxy, ConfigError> {
        let metrics = Arc::new(Metrics::new());
        let redis = match config.backend.kind {
            BackendKind::Memory => None,
            BackendKind::Redis => {
                Some(
                    Redis::new(&config.backend, &metrics).map_err(|e| ConfigError::Other {
                        file: format!("backend.{}", e.setting()),
                        message: e.to_string(),
                    })?,
                )
            }
        };
        let store = redis.clone().map_or(Store::Memory, Store::Redis);
        let live = Live::new(config, &metrics, || {
            Arc::new(Limits::new(config, metrics.clone(), store))
        })?;
        let dialer = Dialer {
            connect_timeout: config.proxy.connect_timeout.0,
            policy: Arc::new(arc_swap::ArcSwap::new(live.access.policy.clone())),
        };
        let upstream =
            Upstream::new(&config.proxy, dialer.clone()).map_err(|e| ConfigError::Other {
                file: "proxy.ca_file".into(),
                message: e.to_string(),
            })?;
        let replay_memory =
            crate::replay::ReplayMemory::new(config.proxy.replay_memory.0, Some(&metrics));
        let intercept = match &config.intercept {
            Some(intercept) => Some(Intercept::new(intercept).map_err(|e| ConfigError::Other {
                file: "intercept".into(),
                message: e.to_string(),
            })?),
            None => None,
        };
        Ok(Proxy {
            intercept,
            live: arc_swap::ArcSwap::from_pointee(live),
            reload: crate::reload::Reload::new(config),
            metrics,
            redis,
            upstream,
            dialer,
            tunnels: TaskTracker::new(),
            cut: CancellationToken::new(),
            shutdown: Shutdown::default(),
            body_idle: config.proxy.body_idle_timeout.0,
            replay_memory,
        })
    }

    /// Starts background work that needs a runtime (the Redis store's heartbeat).
    pub fn start_background(&self) {
        if let Some(redis) = &self.redis {
            redis.spawn_maintenance();
        }
    }

    /// TLS interception, when `[intercept]` is configured.
    pub fn intercept(&self) -> Option<&Intercept> {
        self.intercept.as_ref()
    }

    /// The groups in force, for the admin endpoints.
    pub fn limits(&self) -> Arc<Limits> {
        self.live.load().limits.clone()
    }

    /// The configuration file in force, for `/status`.
    pub fn loaded(&self) -> crate::reload::Loaded {
        self.live.load().loaded.clone()
    }

    /// Reads the configuration file again and, if it is usable and changes nothing
    /// that needs a restart, swaps it in (see [`crate::reload`]); `Err` says why not,
    /// and nothing changed.
    pub fn reload(&self) -> Result<crate::reload::Loaded, crate::reload::ReloadError> {
        let _one_at_a_time = self.reload.lock();
        let answer = self.reload.read().and_then(|config| {
            let limits = || Arc::new(self.limits().reconfigured(&config));
            let live = Live::new(&config, &self.metrics, limits)?;
            self.dialer.policy.store(live.access.policy.clone());
            let loaded = live.loaded.clone();
            self.live.store(Arc::new(live));
            Ok(loaded)
        });
        self.reload.record(&answer, &self.metrics);
        answer
    }

    /// The metrics, for the admin endpoints.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The shared Redis store, when `[backend]` is Redis, for the admin endpoints.
    pub fn redis(&self) -> Option<&Arc<Redis>> {
        self.redis.as_ref()
    }

    /// The open CONNECT tunnels, which shutdown waits for.
    pub fn tunnels(&self) -> &TaskTracker {
        &self.tunnels
    }

    /// Closes every open tunnel now (shutdown, once the grace is over).
    pub fn cut_tunnels(&self) {
        self.cut.cancel();
    }

    /// Shutdown's state and counts.
    pub fn shutdown(&self) -> &Shutdown {
        &self.shutdown
    }
}
