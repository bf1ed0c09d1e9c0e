//! What tollgate and its Lua scripts say to each other: one JSON document each way
//! (Redis's Lua has `cjson`), with named fields, so that a script and its caller can
//! only disagree loudly. Times on Redis's clock are strings of µs (a JSON number in
//! `cjson` keeps 14 digits); durations are µs.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A change of the shared controller's record ([`super::super::budget`]), made on the
/// record of version `base` (empty: none yet).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Publish {
    /// The version the change was made on.
    pub base: String,
    /// The pace, per second ('' for none).
    pub rate: String,
    /// The pace refused, per second ('' for none).
    pub ceiling: String,
}

impl Publish {
    /// A change to `rate` and `ceiling`, made on version `base`.
    pub fn new(base: &str, rate: Option<f64>, ceiling: Option<f64>) -> Publish {
        let text = |x: Option<f64>| x.map_or(String::new(), |x| x.to_string());
        Publish {
            base: base.to_string(),
            rate: text(rate),
            ceiling: text(ceiling),
        }
    }
}

/// The shared controller's record as a script answers it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Record {
    /// Its version: the Redis clock at its last change, in µs.
    pub v: String,
    /// The pace, per second ('' for none).
    pub rate: String,
    /// The pace refused, per second ('' for none).
    pub ceiling: String,
}

impl Record {
    /// The pace and the ceiling; `None` in place of what is absent or not a positive
    /// number (a replica of another version, say).
    pub fn values(&self) -> (Option<f64>, Option<f64>) {
        let read = |s: &str| s.parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0);
        (read(&self.rate), read(&self.ceiling))
    }
}

/// `reserve.lua`'s request: book the next slot.
#[derive(Debug, Serialize)]
pub struct Reserve<'a> {
    /// The request's cost, in cells of every configured rate.
    pub cost: u32,
    /// Each configured rate's interval and tolerance, µs, in the order of its TAT key.
    pub rates: Vec<[u64; 2]>,
    /// The pace's interval, µs (0: none).
    pub pace: u64,
    /// The announced window: its quota and span (µs), counted over every replica.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<[u64; 2]>,
    /// This replica's id.
    pub id: &'a str,
    /// Whether this replica's probe is on.
    pub probing: bool,
    /// Whether this replica learned anything of the upstream (no probe needed).
    pub learned: bool,
    /// How long a probe lasts at most, ms.
    pub probe_ms: u64,
    /// How long the group's records live after its last booking, ms.
    pub ttl_ms: u64,
    /// A change of the shared controller to publish first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publish: Option<Publish>,
    /// µs from now before which the slot may not be (0: none).
    pub floor: u64,
}

/// `reserve.lua`'s answer.
#[derive(Debug, Deserialize)]
pub struct Reserved {
    /// µs until the slot.
    pub wait: f64,
    /// µs of pause left (nothing was booked), or 0.
    pub paused: f64,
    /// When it was booked, µs on Redis's clock.
    pub stamp: String,
    /// Who probes: `no`, `group` (this replica, for the group), `over`, or
    /// `elsewhere` (another replica, for `probe_left` µs at least: nothing booked).
    pub probe: String,
    /// See `probe`.
    pub probe_left: f64,
    /// The shared controller's record in force.
    pub shared: Option<Record>,
}

/// `pause.lua`'s request.
#[derive(Debug, Serialize)]
pub struct Pause {
    /// The pause, µs.
    pub pause_us: u64,
    /// The refusal's id, when the upstream refused a request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    /// How long refusals are kept, µs.
    pub keep_us: u64,
    /// How long a probe lasts at most, ms.
    pub probe_ms: u64,
    /// How long the group's records live, ms.
    pub ttl_ms: u64,
    /// A change of the shared controller to publish.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publish: Option<Publish>,
}

/// `recheck.lua`'s answer.
#[derive(Debug, Deserialize)]
pub struct Rechecked {
    /// µs of pause left (≤ 0: not paused).
    pub paused: f64,
    /// Refusals recorded since the booking.
    pub refused: u64,
}

/// A µs count from a script as a duration (0 for anything not positive).
pub fn micros(us: f64) -> Duration {
    Duration::from_micros(if us.is_finite() && us > 0.0 {
        us as u64
    } else {
        0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_only_positive_numbers() {
        let record = |rate: &str, ceiling: &str| Record {
            v: "1".into(),
            rate: rate.into(),
            ceiling: ceiling.into(),
        };
        let cases = [
            (("4.5", "5"), (Some(4.5), Some(5.0))),
            (("4.5", ""), (Some(4.5), None)),
            (("", ""), (None, None)),
            (("NaN", "-1"), (None, None)),
            (("tea", "0"), (None, None)),
        ];
        for ((rate, ceiling), want) in cases {
            assert_eq!(record(rate, ceiling).values(), want, "{rate} {ceiling}");
        }
    }

    #[test]
    fn a_request_leaves_out_what_it_does_not_have() {
        let reserve = Reserve {
            cost: 1,
            rates: vec![[100_000, 0]],
            pace: 0,
            window: None,
            id: "r",
            probing: false,
            learned: true,
            probe_ms: 1000,
            ttl_ms: 600_000,
            publish: None,
            floor: 0,
        };
        let json = serde_json::to_string(&reserve).unwrap();
        assert!(
            !json.contains("window") && !json.contains("publish"),
            "{json}"
        );
        assert!(!json.contains("null"), "{json}");
    }
}
