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
//! * [`tunnel`] — CONNECT: dial, answer 200, copy bytes both ways;
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
//! file:line:column errors; [`reload`] reads it again on SIGHUP or `POST /reload`),
//! [`body`] (the one streamed body type), [`metrics`] and [`admin`] (a dashboard,
//! `/metrics`, `/healthz`, `/status` on their own listener), [`health`] (`tollgate health`, the container's check of `/healthz`),
//! [`precise_sleep`] (the queue's head waits for its slot on a kernel timer), and
//! [`descriptors`] (the open-file limit, raised before the runtime starts).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod access;
pub mod access_log;
pub mod admin;
pub mod body;
pub mod classify;
pub mod config;
pub mod connection;
pub mod descriptors;
pub mod error;
pub mod half_close;
pub mod health;
pub mod host;
pub mod intercept;
pub mod limit;
pub mod metrics;
pub mod path;
pub mod precise_sleep;
pub mod proxy;
pub mod pushback;
pub mod ratelimit_headers;
pub mod reload;
pub mod replay;
pub mod retry_after;
pub mod server;
pub mod shutdown;
pub mod tunnel;
pub mod upstream;
