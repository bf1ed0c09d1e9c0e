//! Hot reload: `SIGHUP` or `POST /reload` reads the configuration file again.
//!
//! A usable file that changes nothing needing a restart is swapped in
//! ([`crate::proxy::Proxy::reload`]): groups whose names survive keep their queue, rate
//! state, pause and permits and take their new limits; routes, costs, access and the
//! destination policy apply to the next request. Anything else — an unreadable or
//! invalid file, a changed listener — changes nothing, and is told in the log, the
//! `POST /reload` answer and `tollgate_config_reload_failures_total`.
//!
//! What needs a restart is what was bound or built once: the listeners, the other
//! `[proxy]` settings (timeouts, TLS roots, the pool, memory budgets), `[backend]` and
//! `[intercept]` (its hosts; its CA files are read once). [`needs_restart`] names them,
//! pure, from the two configurations.

use std::net::SocketAddr;
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

#[cfg(test)]
use crate::config::Source;
use crate::config::{Config, ConfigError};
use crate::metrics::Metrics;

/// The configuration in force, for `/status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Loaded {
    /// Its file, if it came from one.
    pub path: Option<String>,
    /// SHA-256 of the file's text.
    pub sha256: Option<String>,
    /// When it was loaded, RFC 3339.
    pub loaded_at: String,
}

impl Loaded {
    /// `config`, loaded now.
    pub fn of(config: &Config) -> Loaded {
        let source = config.source.as_ref();
        Loaded {
            path: source.map(|s| s.path.display().to_string()),
            sha256: source.map(|s| s.sha256.clone()),
            loaded_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        }
    }
}

/// Why a reload was refused; nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// tollgate was started without a configuration file.
    #[error("tollgate was started without a configuration file")]
    NoFile,
    /// The file is not a usable configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// It changes settings that only a restart applies.
    #[error("{path}: {settings} changed: restart tollgate to apply it (nothing was reloaded)")]
    NeedsRestart {
        /// The file.
        path: String,
        /// The settings, as written in the file's tables.
        settings: String,
    },
}

/// The settings that `new` changes from `old` and that only a restart applies.
pub fn needs_restart(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    let old_source = old.source.clone().unwrap_or_default();
    let new_source = new.source.clone().unwrap_or_default();
    if old_source.listen != new_source.listen {
        changed.push("[proxy] listen");
    }
    if old_source.admin != new_source.admin {
        changed.push("[admin] listen");
    }
    // The rest of `[proxy]` is read once, when the pool and listeners are built;
    // `server_timing` is read per request.
    let rest = |c: &Config| {
        let mut proxy = c.proxy.clone();
        proxy.listen = SocketAddr::from(([0, 0, 0, 0], 0));
        proxy.server_timing = false;
        format!("{proxy:?}")
    };
    if rest(old) != rest(new) {
        changed.push("[proxy] (other than server_timing)");
    }
    if format!("{:?}", old.backend) != format!("{:?}", new.backend) {
        changed.push("[backend]");
    }
    let intercept =
        |c: &Config| (c.intercept.as_ref()).map(|i| format!("{:?} {:?}", i.hosts, i.bypass));
    if intercept(old) != intercept(new) {
        changed.push("[intercept]");
    }
    changed
}

/// How a running proxy reloads: the configuration it started with, the addresses it
/// bound, and one reload at a time.
pub struct Reload {
    started: Config,
    listen: SocketAddr,
    admin: Option<SocketAddr>,
    one: Mutex<()>,
}

impl Reload {
    /// For a proxy built from `config` (its listeners already bound to the addresses
    /// it names).
    pub fn new(config: &Config) -> Reload {
        Reload {
            started: config.clone(),
            listen: config.proxy.listen,
            admin: config.admin.as_ref().map(|a| a.listen),
            one: Mutex::new(()),
        }
    }

    /// Held while a reload runs.
    pub fn lock(&self) -> MutexGuard<'_, ()> {
        self.one.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The file read again and checked, with the bound addresses in place of those
    /// it names; `Err` says why it cannot be used.
    pub fn read(&self) -> Result<Config, ReloadError> {
        let Some(source) = &self.started.source else {
            return Err(ReloadError::NoFile);
        };
        let mut config = Config::load(&source.path)?;
        crate::external::check(&config)?;
        let settings = needs_restart(&self.started, &config);
        if !settings.is_empty() {
            return Err(ReloadError::NeedsRestart {
                path: source.path.display().to_string(),
                settings: settings.join(", "),
            });
        }
        config.proxy.listen = self.listen;
        if let (Some(admin), Some(listen)) = (&mut config.admin, self.admin) {
            admin.listen = listen;
        }
        Ok(config)
    }

    /// Logs and counts what a reload came to.
    pub fn record(&self, answer: &Result<Loaded, ReloadError>, metrics: &Metrics) {
        match answer {
            Ok(loaded) => {
                metrics.config_reloads.inc();
                tracing::info!(
                    sha256 = loaded.sha256.as_deref().unwrap_or("-"),
                    "configuration reloaded"
                );
            }
            Err(e) => {
                metrics.config_reload_failures.inc();
                tracing::error!("configuration not reloaded: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        let mut config = Config::parse(text, "t.toml").unwrap();
        config.source = Some(Source::of("t.toml".into(), text, &config));
        config
    }

    #[test]
    fn what_needs_a_restart() {
        let base = "[proxy]\nlisten = \"127.0.0.1:8080\"\n[[limit]]\nname = \"a\"\nhosts = [\"a.example\"]\nrate = \"1/s\"\n";
        let cases: [(&str, &[&str]); 6] = [
            (base, &[]),
            (
                "[proxy]\nlisten = \"127.0.0.1:8080\"\nserver_timing = true\n[[limit]]\nname = \"b\"\nhosts = [\"b.example\"]\nrate = \"20/s\"\n",
                &[],
            ),
            ("[proxy]\nlisten = \"127.0.0.1:9999\"\n", &["[proxy] listen"]),
            (
                "[proxy]\nlisten = \"127.0.0.1:8080\"\nconnect_timeout = \"3s\"\n",
                &["[proxy] (other than server_timing)"],
            ),
            (
                "[proxy]\nlisten = \"127.0.0.1:8080\"\n[admin]\nlisten = \"127.0.0.1:9090\"\n",
                &["[admin] listen"],
            ),
            (
                "[proxy]\nlisten = \"127.0.0.1:8080\"\n[log]\naccess = false\n[access]\nclients = [\"10.0.0.0/8\"]\n",
                &[],
            ),
        ];
        let old = config(base);
        for (text, want) in cases {
            assert_eq!(needs_restart(&old, &config(text)), want, "{text}");
        }
    }

    #[test]
    fn the_source_hashes_the_text() {
        let text = "[proxy]\n";
        let source = Source::of("x".into(), text, &config(text));
        assert_eq!(
            source.sha256,
            "f5341fdf130f51eca309ccac7183c980281b8d08328b8a2ada6fb0ee473aa5e7"
        );
        assert_ne!(
            source.sha256,
            Source::of("x".into(), "[log]\n", &config(text)).sha256
        );
    }
}
