//! The last 15 minutes of each group, one sample a second, for the dashboard's charts.
//!
//! The admin listener reads each group's counters, queue, pace and wait histogram once
//! a second and keeps the differences here, so a page opened now draws the last 15
//! minutes at once and the request path pays nothing (it only bumps the counters and
//! the histogram it bumps anyway).
//!
//! Memory: a [`Sample`] is 20 bytes, so a group's full ring is 900 × 20 = 18 000 bytes,
//! plus its last reading (~250 bytes); [`MAX_GROUPS`] of them hold at most ~18.3 MB
//! (docs/operations.md says so too). Rings grow as seconds pass, so a young process or
//! a handful of groups hold far less.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::metrics::waits::{quantile_bucket, upper_bound, Counts, BUCKETS};

/// Seconds of history kept per group.
pub const SECONDS: usize = 900;

/// Seconds of departures `/status` repeats per group (its `departures_per_second`),
/// and the window of its `wait_last_minute`.
pub const MINUTE: usize = 60;

/// Groups followed at most: unlisted hosts each make a group, and a dashboard of
/// thousands of charts helps nobody; the rest still show their counters.
pub const MAX_GROUPS: usize = 1000;

/// What the sampler reads of one group: counters as they stand (never reset) and the
/// state of the moment.
#[derive(Debug, Clone, Default)]
pub struct Reading {
    /// Departures so far (`tollgate_requests_total{outcome="admitted"}`).
    pub departures: u64,
    /// Requests queued now.
    pub queued: usize,
    /// The pace in force now, per second; `None` when no rate holds the group.
    pub pace: Option<f64>,
    /// Whether the upstream holds the group paused now.
    pub paused: bool,
    /// The queue-wait histogram's buckets so far.
    pub waits: Counts,
    /// Seconds waited so far by the requests that departed (the histogram's sum).
    pub waited: f64,
    /// Upstream answers so far: `429`s.
    pub refused: u64,
    /// Upstream answers so far: `5xx`s.
    pub failed: u64,
}

/// No departure in the second: no wait quantile.
const NO_WAIT: u8 = u8::MAX;

/// One second of one group. Counts saturate at 65 535 a second (the page says "65535").
#[derive(Debug, Clone, Copy)]
struct Sample {
    departed: u16,
    queued: u16,
    /// NaN when unlimited.
    pace: f32,
    /// Seconds waited by the requests that departed in the second.
    waited: f32,
    /// The wait histogram's bucket of the second's median and 99th percentile.
    p50: u8,
    p99: u8,
    paused: bool,
    refused: u16,
    failed: u16,
}

fn saturated(n: u64) -> u16 {
    n.min(u64::from(u16::MAX)) as u16
}

/// One group's last reading and its samples since.
#[derive(Debug)]
struct Ring {
    last: Reading,
    samples: VecDeque<Sample>,
}

impl Ring {
    fn push(&mut self, now: Reading) {
        let last = &self.last;
        // A counter that went back (a group evicted and rebuilt) counts from zero again.
        let delta = |now: u64, then: u64| now.checked_sub(then).unwrap_or(now);
        let mut waits: Counts = [0; BUCKETS + 1];
        for (i, w) in waits.iter_mut().enumerate() {
            *w = delta(now.waits[i], last.waits[i]);
        }
        let quantile = |q| quantile_bucket(&waits, q).map_or(NO_WAIT, |b| b as u8);
        let waited = if now.waited >= last.waited {
            now.waited - last.waited
        } else {
            now.waited
        };
        let sample = Sample {
            departed: saturated(delta(now.departures, last.departures)),
            queued: saturated(now.queued as u64),
            pace: now.pace.map_or(f32::NAN, |p| p as f32),
            waited: waited as f32,
            p50: quantile(0.5),
            p99: quantile(0.99),
            paused: now.paused,
            refused: saturated(delta(now.refused, last.refused)),
            failed: saturated(delta(now.failed, last.failed)),
        };
        if self.samples.len() == SECONDS {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
        self.last = now;
    }

    fn last_minute(&self) -> impl Iterator<Item = &Sample> {
        self.samples
            .iter()
            .skip(self.samples.len().saturating_sub(MINUTE))
    }
}

/// The rings of all followed groups.
#[derive(Debug, Default)]
pub struct History {
    rings: Mutex<HashMap<Arc<str>, Ring>>,
}

/// The seconds of a bucket's upper bound, `None` for no departure (JSON `null`).
fn bound(bucket: u8) -> Option<f64> {
    (bucket != NO_WAIT).then(|| upper_bound(usize::from(bucket)))
}

impl History {
    /// Records one second: the groups' readings now. A group seen for the first time
    /// starts with no history; a group no longer listed is forgotten.
    pub fn record(&self, readings: impl IntoIterator<Item = (Arc<str>, Reading)>) {
        let mut rings = self.lock();
        let mut next = HashMap::with_capacity(rings.len());
        for (name, reading) in readings.into_iter().take(MAX_GROUPS) {
            let ring = match rings.remove(&name) {
                Some(mut ring) => {
                    ring.push(reading);
                    ring
                }
                None => Ring {
                    last: reading,
                    samples: VecDeque::new(),
                },
            };
            next.insert(name, ring);
        }
        *rings = next;
    }

    /// Departures in each of the last seconds (at most a minute) of `group`, oldest
    /// first (empty for a group not followed yet).
    pub fn per_second(&self, group: &str) -> Vec<u64> {
        self.lock().get(group).map_or_else(Vec::new, |r| {
            r.last_minute().map(|s| u64::from(s.departed)).collect()
        })
    }

    /// The waits of `group`'s last minute: what departed, the seconds its requests
    /// waited in all, and the 99th percentile of its worst second (`null` without a
    /// departure). The dashboard sorts its group list by `waited_seconds`.
    pub fn last_minute(&self, group: &str) -> serde_json::Value {
        let rings = self.lock();
        let Some(ring) = rings.get(group) else {
            return serde_json::Value::Null;
        };
        let (mut departed, mut waited, mut worst) = (0u64, 0f64, None::<u8>);
        for s in ring.last_minute() {
            departed += u64::from(s.departed);
            waited += f64::from(s.waited);
            if s.p99 != NO_WAIT {
                worst = worst.max(Some(s.p99));
            }
        }
        serde_json::json!({
            "seconds": ring.last_minute().count(),
            "departed": departed,
            "waited_seconds": (waited * 1000.0).round() / 1000.0,
            "worst_second_p99_seconds": worst.and_then(bound),
        })
    }

    /// Every series of `group`, oldest second first, for `/history`; empty ones for a
    /// group not followed (yet): the page asks for a group as it appears.
    pub fn series(&self, group: &str) -> serde_json::Value {
        let rings = self.lock();
        let none = VecDeque::new();
        let s = rings.get(group).map_or(&none, |r| &r.samples);
        // f32 keeps 7 digits: 0.9 comes back as 0.8999999761581421 unless rounded.
        let pace: Vec<Option<f64>> = (s.iter())
            .map(|s| Some((f64::from(s.pace) * 1e6).round() / 1e6).filter(|p| !p.is_nan()))
            .collect();
        serde_json::json!({
            "group": group,
            "seconds": s.len(),
            "departures": s.iter().map(|s| s.departed).collect::<Vec<_>>(),
            "pace_in_force": pace,
            "queued": s.iter().map(|s| s.queued).collect::<Vec<_>>(),
            "wait_p50_seconds": s.iter().map(|s| bound(s.p50)).collect::<Vec<_>>(),
            "wait_p99_seconds": s.iter().map(|s| bound(s.p99)).collect::<Vec<_>>(),
            "paused": s.iter().map(|s| u8::from(s.paused)).collect::<Vec<_>>(),
            "upstream_429": s.iter().map(|s| s.refused).collect::<Vec<_>>(),
            "upstream_5xx": s.iter().map(|s| s.failed).collect::<Vec<_>>(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Ring>> {
        // Plain numbers: valid after any panic of a holder.
        self.rings.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(history: &History, counts: &[(&str, u64)]) {
        history.record(counts.iter().map(|(n, c)| {
            let reading = Reading {
                departures: *c,
                ..Reading::default()
            };
            (Arc::from(*n), reading)
        }));
    }

    #[test]
    fn a_sample_is_twenty_bytes() {
        // The memory bound in the module's comment and the docs rests on it.
        assert_eq!(std::mem::size_of::<Sample>(), 20);
    }

    #[test]
    fn differences_per_second() {
        let h = History::default();
        at(&h, &[("a", 10)]);
        assert_eq!(h.per_second("a"), Vec::<u64>::new());
        at(&h, &[("a", 15), ("b", 0)]);
        at(&h, &[("a", 15), ("b", 3)]);
        at(&h, &[("a", 22), ("b", 3)]);
        assert_eq!(h.per_second("a"), vec![5, 0, 7]);
        assert_eq!(h.per_second("b"), vec![3, 0]);
        assert_eq!(h.per_second("unknown"), Vec::<u64>::new());
    }

    #[test]
    fn keeps_fifteen_minutes_and_repeats_the_last_one() {
        let h = History::default();
        for second in 0..=(SECONDS as u64 + 10) {
            at(&h, &[("a", second * second)]);
        }
        let kept = h.per_second("a");
        assert_eq!(kept.len(), MINUTE);
        // The newest second: n² - (n-1)² = 2n - 1.
        let n = SECONDS as u64 + 10;
        assert_eq!(kept.last(), Some(&(2 * n - 1)));
        let series = h.series("a");
        assert_eq!(series["seconds"], SECONDS);
        assert_eq!(series["departures"].as_array().unwrap().len(), SECONDS);
    }

    #[test]
    fn wait_quantiles_pauses_and_statuses_per_second() {
        let h = History::default();
        let mut reading = Reading::default();
        h.record([(Arc::from("a"), reading.clone())]);
        // 99 short waits and one of 0.3 s (bucket 9, up to 0.512 s) in one second.
        reading.waits[0] = 99;
        reading.waits[9] = 1;
        reading.waited = 0.35;
        reading.departures = 100;
        reading.queued = 7;
        reading.pace = Some(2.0);
        reading.refused = 3;
        h.record([(Arc::from("a"), reading.clone())]);
        // A paused second with nothing departing.
        reading.paused = true;
        reading.pace = Some(0.0);
        reading.failed = 2;
        h.record([(Arc::from("a"), reading.clone())]);
        let s = h.series("a");
        assert_eq!(s["departures"], serde_json::json!([100, 0]));
        assert_eq!(s["queued"], serde_json::json!([7, 7]));
        assert_eq!(s["pace_in_force"], serde_json::json!([2.0, 0.0]));
        assert_eq!(s["wait_p50_seconds"], serde_json::json!([0.001, null]));
        assert_eq!(s["wait_p99_seconds"], serde_json::json!([0.001, null]));
        assert_eq!(s["paused"], serde_json::json!([0, 1]));
        assert_eq!(s["upstream_429"], serde_json::json!([3, 0]));
        assert_eq!(s["upstream_5xx"], serde_json::json!([0, 2]));
        let minute = h.last_minute("a");
        assert_eq!(minute["departed"], 100);
        assert_eq!(minute["waited_seconds"], 0.35);
        assert_eq!(minute["worst_second_p99_seconds"], 0.001);
        // With two slow ones in a hundred, the p99 is slow.
        reading.waits[9] = 3;
        reading.departures = 102;
        h.record([(Arc::from("a"), reading.clone())]);
        assert_eq!(h.last_minute("a")["worst_second_p99_seconds"], 0.512);
        assert_eq!(h.last_minute("unknown"), serde_json::Value::Null);
        assert_eq!(h.series("unknown")["seconds"], 0);
    }

    #[test]
    fn forgets_removed_groups_and_restarts_reset_counters() {
        let h = History::default();
        at(&h, &[("a", 5), ("b", 5)]);
        at(&h, &[("a", 8)]);
        assert_eq!(h.per_second("b"), Vec::<u64>::new());
        // "b" comes back as a new group: no history until its second sample.
        at(&h, &[("a", 2), ("b", 1)]);
        assert_eq!(h.per_second("a"), vec![3, 2]);
        assert_eq!(h.per_second("b"), Vec::<u64>::new());
    }

    #[test]
    fn follows_a_bounded_number_of_groups() {
        let h = History::default();
        let names: Vec<String> = (0..MAX_GROUPS + 5).map(|i| format!("g{i}")).collect();
        for _ in 0..2 {
            h.record((names.iter()).map(|n| (Arc::from(n.as_str()), Reading::default())));
        }
        assert_eq!(h.lock().len(), MAX_GROUPS);
        assert_eq!(h.per_second("g0"), vec![0]);
        assert_eq!(h.per_second(&names[MAX_GROUPS]), Vec::<u64>::new());
    }
}
