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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

/// The bcrypt time the checks in hand may add up to, running or waiting for a core: a
/// credential whose check would take them past it is answered `429` (`Retry-After: 1`)
/// at once (one check is always let in, however long it takes). So a flood of
/// different wrong passwords, however many at once and whatever the file's cost, costs
/// at most about a second of CPU; the rest are refused until checks are done with.
pub const CHECKS_BUDGET: Duration = Duration::from_secs(1);

/// What a check costs per step of bcrypt's cost (a check of cost `c` takes `2^c`
/// steps) until one has been timed: 100 µs, above what a core of today takes (60 to
/// 75 µs), so that a flood before the first check is timed is bounded too.
const STEP_GUESS: Duration = Duration::from_micros(100);

/// The bound on bcrypt checks: a semaphore, the time of the checks in hand, and what a
/// step of cost took in the last check, in nanoseconds.
pub struct Gate {
    running: tokio::sync::Semaphore,
    /// Microseconds of the checks in hand, as each was expected to take when it came.
    in_hand: AtomicU64,
    step_nanos: AtomicU64,
}

impl Gate {
    fn new() -> Gate {
        Gate {
            running: tokio::sync::Semaphore::new(checks_at_once()),
            in_hand: AtomicU64::new(0),
            step_nanos: AtomicU64::new(STEP_GUESS.as_nanos() as u64),
        }
    }

    /// How long a check of `cost` is expected to take, in microseconds.
    fn expected_micros(&self, cost: u32) -> u64 {
        let steps = 1u64 << cost.min(31);
        self.step_nanos
            .load(Ordering::Relaxed)
            .saturating_mul(steps)
            / 1000
    }

    /// A place for a check of `cost`, unless the checks in hand would then take more
    /// than [`CHECKS_BUDGET`].
    fn enter(&self, cost: u32) -> Option<InHand<'_>> {
        let micros = self.expected_micros(cost);
        let budget = CHECKS_BUDGET.as_micros() as u64;
        let fits = |held: u64| held == 0 || held.saturating_add(micros) <= budget;
        self.in_hand
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                fits(held).then(|| held + micros)
            })
            .ok()?;
        Some(InHand(&self.in_hand, micros))
    }

    /// A check of `cost` took `took`.
    fn took(&self, cost: u32, took: Duration) {
        let steps = 1u64 << cost.min(31);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX) / steps;
        self.step_nanos.store(nanos.max(1), Ordering::Relaxed);
    }
}

/// A check in hand, running or waiting, with the microseconds it was expected to take;
/// given back when dropped (also when the client leaves while it waits).
struct InHand<'a>(&'a AtomicU64, u64);

impl Drop for InHand<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
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
    /// The credential's bcrypt check would take the checks in hand past
    /// [`CHECKS_BUDGET`].
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
                let cost = users.cost_of(header.as_ref());
                let Some(in_hand) = gate.enter(cost) else {
                    return Err(Refused::AuthBusy);
                };
                let running = gate.running.acquire().await;
                let started = tokio::time::Instant::now();
                let verify = tokio::task::spawn_blocking(move || users.verify(header.as_ref()));
                let verified = verify.await;
                gate.took(cost, started.elapsed());
                drop((running, in_hand));
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
    fn the_gate_lets_in_a_second_of_checks_and_always_one() {
        let gate = Gate::new();
        // Untimed, a check of cost 12 is taken to last 410 ms: two fit in a second.
        let mut places: Vec<_> = (0..2).map(|_| gate.enter(12)).collect();
        assert!(places.iter().all(Option::is_some));
        assert!(gate.enter(12).is_none(), "a third is answered at once");
        let cheap = gate.enter(4);
        assert!(cheap.is_some(), "a cheap check still fits");
        places.pop();
        assert!(gate.enter(12).is_some(), "a place freed by one that left");
        // Timed at 300 ms for cost 12: three fit, and then a check of 75 ms, not 150.
        let gate = Gate::new();
        gate.took(12, Duration::from_millis(300));
        let places: Vec<_> = (0..3).map(|_| gate.enter(12)).collect();
        assert!(places.iter().all(Option::is_some) && gate.enter(12).is_none());
        assert!(gate.enter(11).is_none() && gate.enter(10).is_some());
        drop(places);
        let places: Vec<_> = (0..250).filter_map(|_| gate.enter(10)).collect();
        assert_eq!(places.len(), 13);
        drop(places);
        // A check longer than the budget is still made, one at a time.
        gate.took(12, Duration::from_secs(5));
        let one = gate.enter(12);
        assert!(one.is_some() && gate.enter(12).is_none());
    }
}
