//! The token budgets of the groups that count tokens (docs/tokens.md), as gauges set
//! when `/metrics` is read: what is reserved now, and each bucket's refill and what of
//! it is in use, configured or learned from the upstream's headers. Read from each
//! group's `/status` snapshot, so the request path pays nothing for them.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use prometheus_client::metrics::counter::Counter;

use super::{registered, GroupLabel, KindLabels, RateGauge, Series};

const RESERVED: Series = (
    "tollgate_tokens_reserved",
    "Tokens the requests in flight are estimated at, until their answers report usage",
);
const RATE: Series = (
    "tollgate_token_rate",
    "Tokens per second a token bucket refills (this replica's share), by kind and source \
     (configured, or announced by the upstream and learned from its answers)",
);
const IN_USE: Series = (
    "tollgate_tokens_in_use",
    "Tokens of a bucket in use now: reserved or spent, not yet refilled",
);

/// `tollgate_tokens_total` of one group: the tokens its upstream reported used, by
/// kind. Series appear with the first answer that reports usage, so a group that
/// counts no tokens has none.
#[derive(Debug, Clone)]
pub struct TokenMetrics {
    family: Family<KindLabels, Counter>,
    group: String,
}

impl TokenMetrics {
    pub(super) fn new(family: Family<KindLabels, Counter>, group: &str) -> TokenMetrics {
        TokenMetrics {
            family,
            group: group.to_string(),
        }
    }

    /// Counts the usage of one answer.
    pub fn used(&self, input: u64, output: u64) {
        for (kind, n) in [("input", input), ("output", output)] {
            let labels = KindLabels {
                group: self.group.clone(),
                kind,
            };
            self.family.get_or_create(&labels).inc_by(n);
        }
    }
}

/// What a group's token budgets are now, as `/status` shows them.
#[derive(Debug, Clone, Default)]
pub struct TokenFigures {
    /// Estimates of the requests in flight.
    pub reserved: u64,
    /// Each bucket.
    pub buckets: Vec<BucketFigures>,
}

/// One token bucket now.
#[derive(Debug, Clone)]
pub struct BucketFigures {
    /// `total`, `input` or `output`.
    pub kind: &'static str,
    /// `configured` or `announced`.
    pub source: &'static str,
    /// Tokens refilled per second.
    pub per_second: f64,
    /// Tokens in use.
    pub in_use: u64,
}

/// A bucket's labels: `kind` is `total`, `input` or `output`; `source` `configured` or
/// `announced`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BucketLabels {
    group: String,
    kind: &'static str,
    source: &'static str,
}

/// The families, registered once.
#[derive(Clone, Debug)]
pub(super) struct Families {
    reserved: Family<GroupLabel, Gauge>,
    rate: Family<BucketLabels, RateGauge>,
    in_use: Family<BucketLabels, Gauge>,
}

impl Families {
    /// Registers them in `registry`.
    pub(super) fn new(registry: &mut Registry) -> Families {
        Families {
            reserved: registered(registry, RESERVED, Family::default()),
            rate: registered(registry, RATE, Family::default()),
            in_use: registered(registry, IN_USE, Family::default()),
        }
    }

    /// Forgets every series, before a scrape sets those of the groups there are.
    pub(super) fn clear(&self) {
        self.reserved.clear();
        self.rate.clear();
        self.in_use.clear();
    }

    /// Sets the series of `group`.
    pub(super) fn show(&self, group: &str, tokens: &TokenFigures) {
        let label = GroupLabel {
            group: group.to_string(),
        };
        let reserved = i64::try_from(tokens.reserved).unwrap_or(i64::MAX);
        self.reserved.get_or_create(&label).set(reserved);
        for bucket in &tokens.buckets {
            let labels = BucketLabels {
                group: group.to_string(),
                kind: bucket.kind,
                source: bucket.source,
            };
            self.rate.get_or_create(&labels).set(bucket.per_second);
            let in_use = i64::try_from(bucket.in_use).unwrap_or(i64::MAX);
            self.in_use.get_or_create(&labels).set(in_use);
        }
    }
}
