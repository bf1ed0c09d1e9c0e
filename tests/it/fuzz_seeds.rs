//! The fuzz target's checks (`fuzz/check.rs`) over its seeds and simple mutations of
//! them, in every `cargo test`: the target itself needs cargo-fuzz and a nightly-style
//! build, so without this its assertions would only run when someone fuzzes.

use std::time::{Duration, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};
use tollgate::parts::pause_hint;
use tollgate::parts::{backoff, retry_after};

include!("../../fuzz/check.rs");

fn seeds() -> Vec<(String, Vec<u8>)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/seeds/retry_after");
    let mut seeds: Vec<_> = std::fs::read_dir(dir)
        .expect("fuzz/seeds/retry_after")
        .map(|e| e.unwrap().path())
        .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    seeds.sort();
    seeds
}

#[test]
fn every_seed_passes_the_fuzz_checks() {
    let seeds = seeds();
    assert!(seeds.len() >= 8, "seeds went missing: {seeds:?}");
    for (name, data) in &seeds {
        assert!(
            data.len() > 12,
            "{name} has no field after now and max_pause"
        );
        check_input(data);
    }
}

/// Every prefix of every seed, and every byte of it replaced by a few that parsers
/// trip on (NUL ends a field, digits and signs change numbers, 0xff is not UTF-8).
#[test]
fn truncated_and_mutated_seeds_pass_the_fuzz_checks() {
    for (_, data) in seeds() {
        for end in 0..data.len() {
            check_input(&data[..end]);
        }
        for at in 0..data.len() {
            for byte in [0u8, b'9', b'-', b'.', b' ', 0xff] {
                let mut mutated = data.clone();
                mutated[at] = byte;
                check_input(&mutated);
            }
        }
    }
}
