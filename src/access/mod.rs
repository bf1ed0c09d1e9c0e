//! Who may use the proxy, and where its requests may go.
//!
//! * [`policy`] — the destination policy: non-public addresses refused unless allowed;
//!   checked by the dialer for every address a name resolves to;
//! * [`auth`] — proxy authentication against an htpasswd file (bcrypt);
//! * this module — [`Access`], the checks a request meets before anything else: the
//!   client's address, its credentials, and whether it has been here before.

pub mod auth;
pub mod policy;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http::{header, HeaderMap};

pub use auth::Users;
pub use policy::{Denial, Policy};

use crate::config::{Config, ConfigError};

/// The checks of `[access]`, built once from the configuration.
pub struct Access {
    /// Where requests may go (the dialer holds it too).
    pub policy: Arc<Policy>,
    users: Option<Arc<Users>>,
    clients: Vec<ipnet::IpNet>,
    gate: Arc<Gate>,
}

/// bcrypt checks that run at once, at most: one per core keeps a flood of wrong
/// passwords from taking more than the machine has, while cached credentials (most
/// requests) never pass through here.
fn checks_at_once() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

/// The longest a credential waits for its check: past it, one more is answered `429`
/// (`Retry-After: 1`) at once rather than wait behind the others. How many that lets
/// wait follows the users file's cost: hundreds at htpasswd's default (2 ms a check),
/// a few at cost 12 (a third of a second), so a flood of wrong passwords costs the
/// CPU of about a second of checks per second, whatever the cost.
pub const CHECKS_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Credentials that may wait before a check's time is known.
pub const CHECKS_WAITING: usize = 64;

/// The bound on bcrypt checks: a semaphore, a count of who waits for it, and how long
/// the last check took, in microseconds (0: none yet).
pub struct Gate {
    /// [`checks_at_once`], read once: it reads the cgroup's files.
    cores: usize,
    running: tokio::sync::Semaphore,
    waiting: AtomicUsize,
    check_micros: std::sync::atomic::AtomicU64,
}

impl Gate {
    fn new() -> Gate {
        let cores = checks_at_once();
        Gate {
            cores,
            running: tokio::sync::Semaphore::new(cores),
            waiting: Default::default(),
            check_micros: Default::default(),
        }
    }

    /// How many may wait: [`CHECKS_WAIT`] of checks on every core, at least one each.
    fn room(&self) -> usize {
        match self.check_micros.load(Ordering::Relaxed) {
            0 => CHECKS_WAITING,
            micros => {
                let per_core = CHECKS_WAIT.as_micros() as u64 / micros;
                self.cores * (per_core.max(1) as usize)
            }
        }
    }

    /// A place in the wait for a check, unless the wait is full.
    fn wait(&self) -> Option<Waiting<'_>> {
        let before = self.waiting.fetch_add(1, Ordering::Relaxed);
        let place = Waiting(&self.waiting);
        (before < self.room()).then_some(place)
    }

    /// A check took `took`.
    fn took(&self, took: std::time::Duration) {
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
        self.check_micros.store(micros, Ordering::Relaxed);
    }
}

/// A place in the wait for a check, given back when dropped (also when the client
/// leaves while it waits).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The name tollgate gives itself in `Via` and `Proxy-Status`: a request whose `Via`
/// names it has come round again.
pub const PROXY_NAME: &str = "tollgate";

/// Why a request may not use the proxy; the proxy answers it
/// ([`crate::error::ProxyError`] says how).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The client's address is not in `[access] clients`.
    Client {
        /// The client's address.
        client: IpAddr,
    },
    /// `[access] users` is set and the request carries no valid `Proxy-Authorization`.
    AuthRequired,
    /// Too many credentials wait for their bcrypt check ([`CHECKS_WAITING`]).
    AuthBusy,
    /// The request already passed through this tollgate.
    Loop {
        /// The request's `Via` header.
        via: String,
    },
}

impl Access {
    /// The checks of `config`; tollgate's own listeners are the configured `listen`
    /// addresses. Fails when the users file cannot be used.
    pub fn new(
        config: &Config,
        checks: prometheus_client::metrics::counter::Counter,
    ) -> Result<Access, ConfigError> {
        let mut own = vec![config.proxy.listen];
        own.extend(config.admin.as_ref().map(|a| a.listen));
        let users = match &config.access.users {
            None => None,
            Some(path) => {
                let users = Users::load(path).map_err(|e| ConfigError::Other {
                    file: "access.users".into(),
                    message: e.to_string(),
                })?;
                Some(Arc::new(users.count_checks_in(checks)))
            }
        };
        Ok(Access {
            policy: Arc::new(Policy::new(&config.access, own)),
            users,
            clients: config.access.clients.iter().map(|c| c.0).collect(),
            gate: Arc::new(Gate::new()),
        })
    }

    /// Checks a request from `client` with `headers` before it is classified: the
    /// client's address, a loop, and its proxy credentials when `[access] users` is set
    /// (see [`Check::user`] for when that waits).
    pub fn check(&self, client: SocketAddr, headers: &HeaderMap) -> Result<Check, Refused> {
        let ip = match client.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(client.ip(), IpAddr::V4),
            ip => ip,
        };
        if !self.clients.is_empty() && !self.clients.iter().any(|net| net.contains(&ip)) {
            return Err(Refused::Client { client: ip });
        }
        let Some(users) = &self.users else {
            return loop_free(headers).map(|()| Check::Passed(None));
        };
        let header = headers.get(header::PROXY_AUTHORIZATION);
        let check = match users.cached(header) {
            Some(user) => Check::Passed(Some(user)),
            None if users.failed_before(header) => return Err(Refused::AuthRequired),
            None => Check::Verify(users.clone(), header.cloned(), self.gate.clone()),
        };
        loop_free(headers)?;
        Ok(check)
    }
}

/// What [`Access::check`] found out about a request's user.
pub enum Check {
    /// Known: the user (none when `[access] users` is not set).
    Passed(Option<String>),
    /// Credentials not seen before: the bcrypt check is still to be made, through the
    /// gate.
    Verify(Arc<Users>, Option<http::HeaderValue>, Arc<Gate>),
}

impl Check {
    /// The user the request authenticated as; `407` when its credentials are missing
    /// or wrong. A bcrypt check takes milliseconds by design: it runs on a thread made
    /// for blocking, so that a client guessing passwords does not stall the serving
    /// threads (verified credentials are cached, so this happens once per credential).
    pub async fn user(self) -> Result<Option<String>, Refused> {
        match self {
            Check::Passed(user) => Ok(user),
            Check::Verify(users, header, gate) => {
                let Some(waiting) = gate.wait() else {
                    return Err(Refused::AuthBusy);
                };
                let running = gate.running.acquire().await;
                drop(waiting);
                let started = tokio::time::Instant::now();
                let verify = tokio::task::spawn_blocking(move || users.verify(header.as_ref()));
                let verified = verify.await;
                gate.took(started.elapsed());
                drop(running);
                match verified {
                    Ok(Some(user)) => Ok(Some(user)),
                    _ => Err(Refused::AuthRequired),
                }
            }
        }
    }
}

/// `Ok` unless the request has come round to this proxy again.
fn loop_free(headers: &HeaderMap) -> Result<(), Refused> {
    match looped(headers) {
        Some(via) => Err(Refused::Loop { via }),
        None => Ok(()),
    }
}

/// The request's `Via`, when one of its entries is tollgate's own (`1.1 tollgate`): the
/// request has come round to this proxy again.
fn looped(headers: &HeaderMap) -> Option<String> {
    let names_us = |entry: &str| {
        let mut words = entry.split_whitespace();
        words.next(); // the protocol version
        words.next() == Some(PROXY_NAME)
    };
    headers
        .get_all(header::VIA)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.split(',').any(names_us))
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_that_came_through_tollgate_is_a_loop() {
        let via = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::VIA, v.parse().unwrap());
            }
            looped(&h).is_some()
        };
        assert!(via(&["1.1 tollgate"]));
        assert!(via(&["1.0 corp, 1.1 tollgate"]));
        assert!(via(&["1.0 corp", "2 tollgate (comment)"]));
        assert!(!via(&[]));
        assert!(!via(&["1.1 corp-tollgate, 1.1 tollgates"]));
    }

    #[test]
    fn the_gate_lets_so_many_wait_and_gives_a_place_back_when_one_leaves() {
        let gate = Gate::new();
        let places: Vec<_> = (0..CHECKS_WAITING).map(|_| gate.wait()).collect();
        assert!(places.iter().all(Option::is_some));
        assert!(gate.wait().is_none(), "one more is answered at once");
        drop(places.into_iter().next());
        assert!(gate.wait().is_some(), "a place freed by one that left");
        // A second of checks per core may wait: few when a check is slow.
        let cores = checks_at_once();
        gate.took(std::time::Duration::from_millis(300));
        assert_eq!(gate.room(), cores * 3);
        gate.took(std::time::Duration::from_millis(2));
        assert_eq!(gate.room(), cores * 500);
        gate.took(std::time::Duration::from_secs(5));
        assert_eq!(gate.room(), cores);
    }
}
