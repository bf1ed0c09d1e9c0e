//! `tollgate_queue_wait_seconds`: a histogram whose buckets can be read back.
//!
//! prometheus-client's own histogram keeps its buckets to itself, yet the admin
//! listener's once-a-second sampler needs them to draw wait percentiles
//! (`admin/history.rs`). This one exports the same text (same buckets, same `+Inf`) and
//! costs the request path what the other did: one observation, here a few atomic adds
//! instead of a lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Finite buckets: 1 ms doubling to ~65 s (from "no wait" to the default `max_wait`).
pub const BUCKETS: usize = 17;

/// The upper bound of bucket `i`, in seconds; `+Inf` past the last finite one.
pub fn upper_bound(i: usize) -> f64 {
    if i < BUCKETS {
        0.001 * f64::from(1u32 << i)
    } else {
        f64::INFINITY
    }
}

/// Counts per bucket (the last is `+Inf`), not cumulative.
pub type Counts = [u64; BUCKETS + 1];

#[derive(Debug, Default)]
struct Inner {
    buckets: [AtomicU64; BUCKETS + 1],
    /// The sum of the observations, in nanoseconds (whole ones: no float to CAS).
    sum_nanos: AtomicU64,
}

/// A queue-wait histogram; clones share their counts.
#[derive(Debug, Clone, Default)]
pub struct WaitHistogram(Arc<Inner>);

impl WaitHistogram {
    /// Counts one wait of `seconds`.
    pub fn observe(&self, seconds: f64) {
        let bucket = (0..BUCKETS)
            .find(|&i| seconds <= upper_bound(i))
            .unwrap_or(BUCKETS);
        self.0.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let nanos = (seconds.max(0.0) * 1e9) as u64;
        self.0.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// The counts of each bucket now, and the sum of all waits in seconds.
    pub fn read(&self) -> (Counts, f64) {
        let mut counts = [0; BUCKETS + 1];
        for (count, bucket) in counts.iter_mut().zip(&self.0.buckets) {
            *count = bucket.load(Ordering::Relaxed);
        }
        let sum = self.0.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        (counts, sum)
    }
}

/// The bucket index where the `q` quantile (0..1) of `counts` falls, `None` when empty.
pub fn quantile_bucket(counts: &Counts, q: f64) -> Option<usize> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    // The rank of the quantile, 1-based: the p99 of 100 waits is the 99th.
    let rank = ((q * total as f64).ceil() as u64).max(1);
    let mut seen = 0;
    counts.iter().position(|&c| {
        seen += c;
        seen >= rank
    })
}

impl TypedMetric for WaitHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for WaitHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (counts, sum) = self.read();
        let count = counts.iter().sum();
        // The encoder accumulates; f64::MAX is how it spells `+Inf`.
        let buckets: Vec<(f64, u64)> = (counts.iter().enumerate())
            .map(|(i, &c)| {
                (
                    if i < BUCKETS {
                        upper_bound(i)
                    } else {
                        f64::MAX
                    },
                    c,
                )
            })
            .collect();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
    use prometheus_client::registry::Registry;

    fn text(name: &str, metric: impl prometheus_client::registry::Metric) -> String {
        let mut registry = Registry::default();
        registry.register(name, "help", metric);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn exports_what_the_library_histogram_exported() {
        let ours = WaitHistogram::default();
        let theirs = Histogram::new(exponential_buckets(0.001, 2.0, BUCKETS as u16));
        for seconds in [0.0, 0.0005, 0.001, 0.0011, 0.25, 3.0, 65.0, 70.0, 1e6] {
            ours.observe(seconds);
            theirs.observe(seconds);
        }
        assert_eq!(text("w", ours), text("w", theirs));
    }

    #[test]
    fn reads_back_its_buckets_and_quantiles() {
        let h = WaitHistogram::default();
        for _ in 0..98 {
            h.observe(0.0005);
        }
        h.observe(0.3);
        h.observe(100.0);
        let (counts, sum) = h.read();
        assert_eq!((counts[0], counts[9], counts[BUCKETS]), (98, 1, 1));
        assert!((sum - (98.0 * 0.0005 + 100.3)).abs() < 1e-6, "{sum}");
        assert_eq!(quantile_bucket(&counts, 0.5), Some(0));
        assert_eq!(quantile_bucket(&counts, 0.99), Some(9));
        assert_eq!(quantile_bucket(&counts, 1.0), Some(BUCKETS));
        assert_eq!(quantile_bucket(&[0; BUCKETS + 1], 0.5), None);
        assert_eq!(upper_bound(9), 0.512);
    }
}
