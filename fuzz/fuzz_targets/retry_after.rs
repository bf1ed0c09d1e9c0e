//! Arbitrary bytes as `Retry-After`, `Date` and rate-limit header values: the parsers
//! must never panic and never answer more than `max_pause`.
//!
//! How to run it: fuzz/README.md.

#![no_main]

use std::time::{Duration, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tollgate::ratelimit_headers::pause_hint;
use tollgate::retry_after::{backoff, retry_after};

include!("../check.rs");

fuzz_target!(|data: &[u8]| check_input(data));
