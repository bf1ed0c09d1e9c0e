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
    /// The request already passed through this tollgate.
    Loop {
        /// The request's `Via` header.
        via: String,
    },
}

impl Access {
    /// The checks of `config`; tollgate's own listeners are the configured `listen`
    /// addresses. Fails when the users file cannot be used.
    pub fn new(config: &Config) -> Result<Access, ConfigError> {
        let mut own = vec![config.proxy.listen];
        own.extend(config.admin.as_ref().map(|a| a.listen));
        let users = match &config.access.users {
            None => None,
            Some(path) => Some(Arc::new(Users::load(path).map_err(|e| {
                ConfigError::Other {
                    file: "access.users".into(),
                    message: e.to_string(),
                }
            })?)),
        };
        Ok(Access {
            policy: Arc::new(Policy::new(&config.access, own)),
            users,
            clients: config.access.clients.iter().map(|c| c.0).collect(),
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
            None => Check::Verify(users.clone(), header.cloned()),
        };
        loop_free(headers)?;
        Ok(check)
    }
}

/// What [`Access::check`] found out about a request's user.
pub enum Check {
    /// Known: the user (none when `[access] users` is not set).
    Passed(Option<String>),
    /// Credentials not seen before: the bcrypt check is still to be made.
    Verify(Arc<Users>, Option<http::HeaderValue>),
}

impl Check {
    /// The user the request authenticated as; `407` when its credentials are missing
    /// or wrong. A bcrypt check takes milliseconds by design: it runs on a thread made
    /// for blocking, so that a client guessing passwords does not stall the serving
    /// threads (verified credentials are cached, so this happens once per credential).
    pub async fn user(self) -> Result<Option<String>, Refused> {
        match self {
            Check::Passed(user) => Ok(user),
            Check::Verify(users, header) => {
                let verify = tokio::task::spawn_blocking(move || users.verify(header.as_ref()));
                match verify.await {
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
}
