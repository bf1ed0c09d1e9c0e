//! What each group is configured to allow, as gauges beside what it does, so that an
//! alert or a dashboard compares a queue's depth with its `queue`, waits with
//! `max_wait` and departures with the rate without a copy of the configuration.

use std::time::Duration;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{registered, GroupLabel, RateGauge, Series};

const QUEUE_LIMIT: Series = (
    "tollgate_queue_limit",
    "Requests that may wait in the group's queue (its `queue` setting)",
);
const MAX_WAIT: Series = (
    "tollgate_max_wait_seconds",
    "The longest one request may wait in the group's queue (its `max_wait` setting)",
);
const CONFIGURED_RATE: Series = (
    "tollgate_configured_rate",
    "Units of cost per second the group's configured rates allow, the slowest of them; \
     no series while it has none",
);

/// The families of every group's settings.
#[derive(Clone, Debug)]
pub(super) struct Families {
    queue: Family<GroupLabel, Gauge>,
    max_wait: Family<GroupLabel, RateGauge>,
    rate: Family<GroupLabel, RateGauge>,
}

impl Families {
    /// Registers them in `registry`.
    pub(super) fn new(registry: &mut Registry) -> Families {
        Families {
            queue: registered(registry, QUEUE_LIMIT, Family::default()),
            max_wait: registered(registry, MAX_WAIT, Family::default()),
            rate: registered(registry, CONFIGURED_RATE, Family::default()),
        }
    }

    /// The handle of the group labelled `label`.
    pub(super) fn group(&self, label: GroupLabel) -> SettingsMetrics {
        SettingsMetrics {
            families: self.clone(),
            label,
        }
    }

    /// Removes the series of an evicted group.
    pub(super) fn forget(&self, label: &GroupLabel) {
        self.queue.remove(label);
        self.max_wait.remove(label);
        self.rate.remove(label);
    }
}

/// One group's settings as gauges.
#[derive(Clone, Debug)]
pub struct SettingsMetrics {
    families: Families,
    label: GroupLabel,
}

impl SettingsMetrics {
    /// The group now allows `queue` waiting requests, each for at most `max_wait`, at
    /// `rate` units per second (`None`: no configured rate).
    pub fn show(&self, queue: usize, max_wait: Duration, rate: Option<f64>) {
        let families = &self.families;
        let queue = i64::try_from(queue).unwrap_or(i64::MAX);
        families.queue.get_or_create(&self.label).set(queue);
        (families.max_wait.get_or_create(&self.label)).set(max_wait.as_secs_f64());
        match rate {
            Some(rate) => _ = families.rate.get_or_create(&self.label).set(rate),
            None => _ = families.rate.remove(&self.label),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use super::*;

    #[test]
    fn a_group_shows_its_settings_and_loses_its_rate_series_without_a_rate() {
        let metrics = Metrics::new();
        let group = metrics.group("api");
        group
            .settings
            .show(100, Duration::from_millis(1500), Some(2.5));
        let text = metrics.encode();
        for line in [
            "tollgate_queue_limit{group=\"api\"} 100",
            "tollgate_max_wait_seconds{group=\"api\"} 1.5",
            "tollgate_configured_rate{group=\"api\"} 2.5",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
        }
        group.settings.show(100, Duration::from_secs(60), None);
        assert!(!metrics.encode().contains("tollgate_configured_rate{"));
        metrics.forget("api");
        assert!(!metrics.encode().contains("{group=\"api\"}"));
    }
}
