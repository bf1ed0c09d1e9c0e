//! The integration tests: the real `tollgate` binary (and, for a few, the library) on
//! loopback, driven by real clients against real upstreams. One crate, so that the
//! binary's dependencies link once; docs/testing.md says what each module covers.

mod promises;
mod support;

mod access;
mod access_log;
mod check_config;
mod deploy;
mod errors;
mod faults;
mod forward;
mod fuzz_seeds;
mod intercept;
mod keys;
mod limiters;
mod llm;
mod operate;
mod promise_access;
mod promise_clients;
mod promise_limits;
mod promise_operations;
mod promise_waits;
mod pushback;
mod real_limiters;
mod redis_ha;
mod redis_tls;
mod reload;
mod routes;
mod shared;
mod shutdown;
mod shutdown_answers;
mod threads;
mod throttle;
mod timeouts;
mod tunnel;
mod upstream_h2;
