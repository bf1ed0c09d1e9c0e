//! tollgate: an HTTP egress proxy that keeps outbound calls inside the rate limits of
//! the services they call.
//!
//! # Layout
//!
//! The modules in the order a request meets them:
//!
//! * [`server`] — accepts client connections (HTTP/1.1, h2, CONNECT upgrades) on one
//!   thread per core, each with its own socket, and drains them on shutdown; a new
//!   connection's first request is peeked at; if its group is paced within one
//!   thread's work, the connection moves to that group's thread (`server/home.rs`),
//!   and if its group makes it wait, it waits there before hyper takes the connection
//!   (`server/early.rs`);
//! * [`classify`] — decides forward / tunnel / route and rewrites route URIs;
//! * [`proxy`] — builds the tower stack; the one place where layer order is visible;
//! * [`pushback`] — reads the upstream's answer: 429/`Retry-After` and rate-limit
//!   headers ([`retry_after`], [`ratelimit_headers`]) pause the group; refused requests
//!   are replayed;
//! * [`limit`] — groups, GCRA rates, the FIFO queue and concurrency permits, as a tower
//!   layer ([`limit::layer`]);
//! * [`tunnel`] — CONNECT: dial, answer 200, copy bytes both ways;
//! * [`upstream`] — hyper connections over rustls, pooled per serving thread, timeouts,
//!   hop-by-hop headers;
//! * [`error`] — every failure as a response with `Proxy-Status` (RFC 9209).
//!
//! Around them: [`config`] (the `config.toml` contract, checked at start with
//! file:line:column errors), [`descriptors`] (the descriptor limit and table, set up
//! before any thread starts), [`body`] (the one streamed body type), [`coalesce`] (the
//! TCP stream adapter that sends a small write's buffers with one plain write: under
//! HTTP/1 client connections, and under every upstream connection, TLS included),
//! [`coarse_timer`]
//! (the client header and upstream response timeouts, swept once per tick rather than
//! on tokio's timer wheel), [`precise_sleep`] (the wait of a queue's head for its slot,
//! on a kernel timer beside tokio's millisecond one), [`when_woken`] (work polled only
//! when its own wake-up came: a client connection's shutdown watch, a TLS upstream's
//! reads), [`metrics`] and [`admin`] (`/metrics`, `/healthz`, `/status` on their own
//! listener).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod body;
pub mod classify;
pub mod coalesce;
pub mod coarse_timer;
pub mod config;
pub mod descriptors;
pub mod error;
pub mod limit;
pub mod metrics;
pub mod precise_sleep;
pub mod proxy;
pub mod pushback;
pub mod ratelimit_headers;
pub mod retry_after;
pub mod server;
pub mod tunnel;
pub mod upstream;
pub mod when_woken;
