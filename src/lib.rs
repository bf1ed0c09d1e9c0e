//! tollgate: an HTTP egress proxy that keeps outbound calls inside the rate limits of
//! the services they call.
//!
//! # Layout
//!
//! The modules in the order a request meets them:
//!
//! * [`server`] — accepts client connections, one thread per core, and drains them
//!   on shutdown;
//! * [`connection`] — serves one: HTTP/1.1 or h2, CONNECT upgrades, and intercepted
//!   tunnels as connections of their own ([`half_close`]: a half-closed HTTP/1
//!   client's request is never sent, or answered);
//! * [`proxy`] — the whole path of one request, on one screen: check access, classify,
//!   wait in the group, send, judge the answer, retry;
//! * [`access`] — client addresses, proxy authentication, loops, and the destination
//!   policy the dialer applies;
//! * [`classify`] — decides forward / tunnel / route and rewrites route URIs, on the
//!   canonical host ([`host`]) and the normalised path ([`path`]);
//! * [`limit`] — groups: the FIFO queue, the rate (GCRA, in memory or in Redis), the
//!   pause and concurrency permits, the probe of a group told no rate, and the rate
//!   learned from the upstream;
//! * [`tunnel`] — CONNECT: dial, answer 200, copy bytes both ways ([`relay`]);
//! * [`intercept`] — or, for hosts in `[intercept]`, serve the tunnel with a
//!   certificate for its host, so each request inside goes through this path again;
//! * [`upstream`] — pooled hyper connections over rustls, timeouts, hop-by-hop headers;
//! * [`pushback`] — judges the upstream's answer: 429/`Retry-After` and rate-limit
//!   headers ([`retry_after`], [`ratelimit_headers`]) pause the group, and refused
//!   requests are replayed ([`replay`] says which may be);
//! * [`error`] — every failure as a response with `Proxy-Status` (RFC 9209);
//! * [`access_log`] — one line per request, written when its response is done;
//! * [`shutdown`] — queued requests answered `503` once the grace is over, and counts.
//!
//! Around them: [`config`] (the `config.toml` contract, checked at start with
//! file:line:column errors; [`external`] reads the files it names; [`reload`] reads it
//! again on SIGHUP or `POST /reload`),
//! [`body`] (the one streamed body type), [`metrics`] and [`admin`] (a dashboard,
//! `/metrics`, `/healthz`, `/status` on their own listener), [`health`] (`tollgate health`, the container's check of `/healthz`),
//! [`precise_sleep`] (the queue's head waits for its slot on a kernel timer), and
//! [`descriptors`] (the open-file limit, raised before the runtime starts).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod access;
mod access_log;
mod admin;
mod body;
mod classify;
pub mod config;
mod connection;
pub mod descriptors;
mod error;
pub mod external;
mod half_close;
pub mod health;
mod host;
mod intercept;
#[cfg(test)]
mod layers;
mod limit;
mod llm;
mod metrics;
mod path;
mod precise_sleep;
mod proxy;
mod pushback;
mod ratelimit_headers;
mod relay;
mod reload;
mod replay;
mod retry_after;
mod server;
mod shutdown;
mod tunnel;
mod upstream;

pub use access_log::write::{to_stderr as log_access_to_stderr, Format as AccessLogFormat};
pub use intercept::{blind as blind_intercept, init as init_ca, InitError};
pub use server::{run, Sockets};

/// What the benchmarks and the integration tests use below the binary's surface, to
/// measure or test one part on its own: the throttle, the header parsers, the access
/// policy, interception's certificates and the Lua scripts of the shared store. Not a
/// stable API: it follows the code.
pub mod parts {
    pub use crate::access::{Policy, Users};
    pub use crate::access_log::write::{line as access_line, Format as AccessFormat};
    pub use crate::access_log::{Answered, Record, Timing};
    pub use crate::classify::Classifier;
    pub use crate::host::canonical;
    pub use crate::intercept::{Ca, Leaves, LEAF_CACHE};
    pub use crate::limit::fair::Flow;
    pub use crate::limit::gcra::{self, Gcra};
    pub use crate::limit::keys::id_of;
    pub use crate::limit::redis::{PAUSE, PAUSE_KEYS, RESERVE, RESERVE_KEYS};
    pub use crate::limit::{Cost, Group, Limits, Permit, Store};
    pub use crate::llm::{estimate, usage::Scanner};
    pub use crate::metrics::Metrics;
    pub use crate::ratelimit_headers::pause_hint;
    pub use crate::retry_after::{backoff, retry_after};
    pub use crate::upstream::{add_via, set_host, strip_hop_by_hop};
}
