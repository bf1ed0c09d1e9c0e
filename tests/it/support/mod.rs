//! Shared parts for the integration tests: real loopback servers on port 0, the proxy
//! on port 0, and real clients (curl, Python's urllib, reqwest) driven against them.
//!
//! Everything listens on 127.0.0.1 only, and everything is bounded: servers stop when
//! their handle is dropped, child processes are killed if they outlive their timeout.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

mod binary;
mod bodies;
mod clients;
mod external;
mod misbehave;
mod proxy;
mod redis_ha;
mod redis_server;
mod redis_tls;
mod sockets;
mod tls;
mod upstream;
mod waits;

// Each test file uses a different part.
#[allow(unused_imports)]
pub use {
    binary::*, bodies::*, clients::*, external::*, misbehave::*, proxy::*, redis_ha::*,
    redis_server::*, redis_tls::*, sockets::*, tls::*, upstream::*, waits::*,
};

/// 127.0.0.1, where everything listens unless a test asks for another loopback address.
pub const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Upper bound for any single child process or network exchange a test starts, so a
/// hang fails the test instead of stalling the suite.
pub const BOUND: Duration = Duration::from_secs(60);
