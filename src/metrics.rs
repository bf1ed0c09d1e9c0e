//! Prometheus metrics, served by the admin listener at `/metrics`.
//!
//! Each group takes its metric handles once, when it is created ([`Metrics::group`]), so
//! the request path only touches atomics, never the label maps. When an idle group for an
//! unlisted host is evicted its series are removed too ([`Metrics::forget`]), so a million
//! distinct hosts cannot grow the registry without bound.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

mod settings;
mod tokens;
pub mod waits;

pub use tokens::{BucketFigures, TokenFigures, TokenMetrics};

pub use waits::WaitHistogram;

/// The label of per-group series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupLabel {
    group: String,
}

/// The labels of `tollgate_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    group: String,
    outcome: &'static str,
}

/// The labels of `tollgate_upstream_responses_total`: the status code only, so a
/// group has at most a few dozen series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    group: String,
    status: u16,
}

/// The labels of `tollgate_upstream_errors_total`: `kind` is the `Proxy-Status` error.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    group: String,
    kind: &'static str,
}

/// The label of `tollgate_refusals_total`: `reason` is the `Proxy-Status` error.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// A gauge of a rate, in requests per second.
pub type RateGauge = Gauge<f64, AtomicU64>;

/// What can happen to a request at the throttle, as the `outcome` label.
const OUTCOMES: [&str; 5] = ["admitted", "queue_full", "max_wait", "cancelled", "denied"];

type HistogramFamily = Family<GroupLabel, Histogram, fn() -> Histogram>;

/// All of tollgate's metrics.
pub struct Metrics {
    /// Reloads of the configuration that took effect.
    pub config_reloads: Counter,
    /// Reloads refused (an invalid file, a change that needs a restart).
    pub config_reload_failures: Counter,
    /// Client connections open now (see [`Metrics::connection_opened`]).
    client_connections: Gauge,
    /// bcrypt checks of proxy credentials.
    pub credential_checks: Counter,
    /// Requests tollgate refused itself, by `Proxy-Status` error type.
    refusals: Family<ReasonLabel, Counter>,
    registry: Mutex<Registry>,
    queue_depth: Family<GroupLabel, Gauge>,
    in_flight: Family<GroupLabel, Gauge>,
    requests: Family<OutcomeLabels, Counter>,
    queue_wait: Family<GroupLabel, WaitHistogram>,
    pauses: Family<GroupLabel, Counter>,
    pause_seconds: HistogramFamily,
    retries: Family<GroupLabel, Counter>,
    passed_through: Family<GroupLabel, Counter>,
    upstream_responses: Family<StatusLabels, Counter>,
    upstream_duration: HistogramFamily,
    upstream_errors: Family<KindLabels, Counter>,
    learned: Family<GroupLabel, RateGauge>,
    in_force: Family<GroupLabel, RateGauge>,
    tokens: Family<KindLabels, Counter>,
    settings: settings::Families,
    token_budgets: tokens::Families,
}

/// A client connection counted in `tollgate_client_connections` while it lives.
pub struct OpenConnection(Gauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One group's metric handles (clones share the underlying atomics).
#[derive(Clone, Debug)]
pub struct GroupMetrics {
    /// Requests waiting or at the head of the queue.
    pub queue_depth: Gauge,
    /// Requests holding a concurrency permit.
    pub in_flight: Gauge,
    /// Requests that left the queue for the upstream: departures, retries included.
    pub admitted: Counter,
    /// Clients' requests that left for the upstream the first time (retries not
    /// counted again); `/status` only, beside the departures.
    pub requests_admitted: Counter,
    /// Requests refused because the queue was full.
    pub queue_full: Counter,
    /// Requests refused after waiting `max_wait`.
    pub max_wait: Counter,
    /// Requests whose client left while they were queued.
    pub cancelled: Counter,
    /// Requests to a destination `[access]` refuses, answered before the queue.
    pub denied: Counter,
    /// Time from arrival to departure, in seconds.
    pub queue_wait: WaitHistogram,
    /// Pauses imposed by the upstream (429/503 + Retry-After, rate-limit headers).
    pub pauses: Counter,
    /// Their lengths, in seconds.
    pub pause_seconds: Histogram,
    /// Requests sent again after a push-back.
    pub retries: Counter,
    /// Push-back responses handed to the client (not replayable, or out of retries).
    pub passed_through: Counter,
    /// Upstream answers by status, latency and failures.
    pub upstream: Arc<UpstreamMetrics>,
    /// The pace learned from the upstream's refusals (docs/budget.md).
    pub learned_pace: RateSeries,
    /// The rate the group keeps to now, whatever holds it (set when `/metrics` is read).
    pub pace_in_force: RateSeries,
    /// The tokens its upstream reported used.
    pub tokens: TokenMetrics,
    /// What the group is configured to allow.
    pub settings: settings::SettingsMetrics,
}

/// A rate of one group (`tollgate_learned_pace`, `tollgate_pace_in_force`): a series
/// only while the group has one, so that no group reads as "learned 0" and an
/// unlimited one does not read as "0 per second".
#[derive(Debug, Clone)]
pub struct RateSeries {
    /// `None` for the budget of one key: its group's series stays the group's own.
    family: Option<Family<GroupLabel, RateGauge>>,
    label: GroupLabel,
}

impl RateSeries {
    /// The group keeps to `pace` requests per second (`None`: no such rate).
    pub fn set(&self, pace: Option<f64>) {
        let Some(family) = &self.family else { return };
        match pace {
            Some(pace) => _ = family.get_or_create(&self.label).set(pace),
            None => _ = family.remove(&self.label),
        }
    }
}

impl GroupMetrics {
    /// The handles of one key's budget in this group (docs/keys.md): its counts add
    /// up in the group's series (and its `/status` counters), so the series stay one
    /// per group however many keys come; its paces, one per key, are shown by
    /// `/status` only.
    pub fn for_key(&self) -> GroupMetrics {
        let mut metrics = self.clone();
        metrics.learned_pace.family = None;
        metrics.pace_in_force.family = None;
        metrics
    }
}

/// One group's upstream answers: counted by status code, timed, and its failures to
/// get one counted by kind.
#[derive(Debug)]
pub struct UpstreamMetrics {
    group: String,
    responses: Family<StatusLabels, Counter>,
    duration: Histogram,
    errors: Family<KindLabels, Counter>,
    /// The codes and kinds seen, to read them back and to remove their series.
    seen: Mutex<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    statuses: BTreeMap<u16, Counter>,
    kinds: Vec<&'static str>,
}

impl UpstreamMetrics {
    /// Counts an answer with `status` that took `elapsed` to its head.
    pub fn response(&self, status: u16, elapsed: std::time::Duration) {
        self.duration.observe(elapsed.as_secs_f64());
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.statuses
            .entry(status)
            .or_insert_with(|| {
                self.responses
                    .get_or_create(&StatusLabels {
                        group: self.group.clone(),
                        status,
                    })
                    .clone()
            })
            .inc();
    }

    /// Counts a failure to get an answer, of `kind` (a `Proxy-Status` error type).
    pub fn error(&self, kind: &'static str) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.kinds.contains(&kind) {
            seen.kinds.push(kind);
        }
        drop(seen);
        self.errors
            .get_or_create(&KindLabels {
                group: self.group.clone(),
                kind,
            })
            .inc();
    }

    /// Answers so far by status code.
    pub fn statuses(&self) -> BTreeMap<u16, u64> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.statuses.iter().map(|(s, c)| (*s, c.get())).collect()
    }

    /// Removes this group's series (an evicted group's; see [`Metrics::forget`]).
    pub fn forget(&self) {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        for &status in seen.statuses.keys() {
            self.responses.remove(&StatusLabels {
                group: self.group.clone(),
                status,
            });
        }
        for &kind in &seen.kinds {
            self.errors.remove(&KindLabels {
                group: self.group.clone(),
                kind,
            });
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// A series' name and help, as `/metrics` shows them.
type Series = (&'static str, &'static str);

const QUEUE_DEPTH: Series = (
    "tollgate_queue_depth",
    "Requests waiting in the group's queue",
);
const IN_FLIGHT: Series = (
    "tollgate_in_flight",
    "Requests of the group in flight to the upstream (or open tunnels)",
);
const REQUESTS: Series = (
    "tollgate_requests",
    "Requests by group and what the throttle did with them",
);
const QUEUE_WAIT: Series = (
    "tollgate_queue_wait_seconds",
    "Time requests spent queued before leaving for the upstream",
);
const PAUSES: Series = (
    "tollgate_upstream_pauses",
    "Pauses of the group imposed by the upstream (429/503, rate-limit headers)",
);
const PAUSE_SECONDS: Series = (
    "tollgate_upstream_pause_seconds",
    "Length of the pauses imposed by the upstream",
);
const RETRIES: Series = (
    "tollgate_retries",
    "Requests sent again after the upstream pushed back",
);
const PASSED_THROUGH: Series = (
    "tollgate_pushback_passed_through",
    "Push-back responses (429/503) handed to the client unchanged",
);
const UPSTREAM_RESPONSES: Series = (
    "tollgate_upstream_responses",
    "Upstream answers by group and status code (every attempt, replays included)",
);
const UPSTREAM_DURATION: Series = (
    "tollgate_upstream_duration_seconds",
    "Time from sending a request upstream to its response head",
);
const CREDENTIAL_CHECKS: Series = (
    "tollgate_credential_checks",
    "bcrypt checks of proxy credentials (a flood of wrong passwords shows here)",
);
const REFUSALS: Series = (
    "tollgate_refusals",
    "Requests tollgate refused itself (400, 403, 407, 429, 508), by Proxy-Status error",
);
const UPSTREAM_ERRORS: Series = (
    "tollgate_upstream_errors",
    "Requests that got no upstream answer, by group and Proxy-Status error type",
);
const CONFIG_RELOADS: Series = (
    "tollgate_config_reloads",
    "Reloads of the configuration that took effect",
);
const CONFIG_RELOAD_FAILURES: Series = (
    "tollgate_config_reload_failures",
    "Reloads refused: nothing changed (the log says why)",
);
const CLIENT_CONNECTIONS: Series = (
    "tollgate_client_connections",
    "Client connections open now, idle ones and those with a request waiting",
);
const TOKENS: Series = (
    "tollgate_tokens",
    "Tokens the upstream reported used, by group and kind (input, output)",
);
const LEARNED: Series = (
    "tollgate_learned_pace",
    "Requests per second the group keeps to, learned from the upstream's refusals",
);

const IN_FORCE: Series = (
    "tollgate_pace_in_force",
    "Requests per second the group keeps to now (0 while paused); none when unlimited",
);

/// `metric`, registered in `registry` as `series`.
fn registered<M: Metric + Clone>(registry: &mut Registry, series: Series, metric: M) -> M {
    registry.register(series.0, series.1, metric.clone());
    metric
}

impl Metrics {
    /// Registers every family.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let r = &mut registry;
        // Buckets, in seconds: 1 ms to ~65 s (up to the default response_timeout, as
        // the queue waits of `waits::WaitHistogram`); 10 ms to ~11 min (from a short
        // Retry-After to the default max_pause).
        let ms_to_minute = || Histogram::new(exponential_buckets(0.001, 2.0, 17));
        let pause_buckets = || Histogram::new(exponential_buckets(0.01, 2.0, 17));
        let queue_depth = registered(r, QUEUE_DEPTH, Family::default());
        let in_flight = registered(r, IN_FLIGHT, Family::default());
        let requests = registered(r, REQUESTS, Family::default());
        let queue_wait = registered(r, QUEUE_WAIT, Family::default());
        let pauses = registered(r, PAUSES, Family::default());
        let pause_seconds = registered(
            r,
            PAUSE_SECONDS,
            HistogramFamily::new_with_constructor(pause_buckets),
        );
        let retries = registered(r, RETRIES, Family::default());
        let passed_through = registered(r, PASSED_THROUGH, Family::default());
        let upstream_responses = registered(r, UPSTREAM_RESPONSES, Family::default());
        let upstream_duration = registered(
            r,
            UPSTREAM_DURATION,
            HistogramFamily::new_with_constructor(ms_to_minute),
        );
        let upstream_errors = registered(r, UPSTREAM_ERRORS, Family::default());
        let config_reloads = registered(r, CONFIG_RELOADS, Counter::default());
        let config_reload_failures = registered(r, CONFIG_RELOAD_FAILURES, Counter::default());
        let client_connections = registered(r, CLIENT_CONNECTIONS, Gauge::default());
        let learned = registered(r, LEARNED, Family::default());
        let in_force = registered(r, IN_FORCE, Family::default());
        let tokens = registered(r, TOKENS, Family::default());
        let credential_checks = registered(r, CREDENTIAL_CHECKS, Counter::default());
        let refusals = registered(r, REFUSALS, Family::default());
        Metrics {
            settings: settings::Families::new(r),
            token_budgets: tokens::Families::new(r),
            credential_checks,
            refusals,
            config_reloads,
            config_reload_failures,
            client_connections,
            upstream_responses,
            upstream_duration,
            upstream_errors,
            registry: Mutex::new(registry),
            learned,
            in_force,
            tokens,
            queue_depth,
            in_flight,
            requests,
            queue_wait,
            pauses,
            pause_seconds,
            retries,
            passed_through,
        }
    }

    /// Counts a request tollgate refused itself, by its `Proxy-Status` error type.
    pub fn refused(&self, reason: &'static str) {
        self.refusals.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Counts a client connection as open until the guard drops (however its task
    /// ends: closed, drained or cut).
    pub fn connection_opened(&self) -> OpenConnection {
        self.client_connections.inc();
        OpenConnection(self.client_connections.clone())
    }

    /// The handles of group `name`, creating its series.
    pub fn group(&self, name: &str) -> GroupMetrics {
        let label = GroupLabel {
            group: name.to_string(),
        };
        let outcome = |outcome| {
            self.requests
                .get_or_create(&OutcomeLabels {
                    group: name.to_string(),
                    outcome,
                })
                .clone()
        };
        GroupMetrics {
            queue_depth: self.queue_depth.get_or_create(&label).clone(),
            in_flight: self.in_flight.get_or_create(&label).clone(),
            admitted: outcome(OUTCOMES[0]),
            requests_admitted: Counter::default(),
            queue_full: outcome(OUTCOMES[1]),
            max_wait: outcome(OUTCOMES[2]),
            cancelled: outcome(OUTCOMES[3]),
            denied: outcome(OUTCOMES[4]),
            queue_wait: self.queue_wait.get_or_create(&label).clone(),
            pauses: self.pauses.get_or_create(&label).clone(),
            pause_seconds: self.pause_seconds.get_or_create(&label).clone(),
            retries: self.retries.get_or_create(&label).clone(),
            passed_through: self.passed_through.get_or_create(&label).clone(),
            upstream: Arc::new(UpstreamMetrics {
                group: name.to_string(),
                responses: self.upstream_responses.clone(),
                duration: self.upstream_duration.get_or_create(&label).clone(),
                errors: self.upstream_errors.clone(),
                seen: Mutex::default(),
            }),
            learned_pace: RateSeries {
                family: Some(self.learned.clone()),
                label: label.clone(),
            },
            pace_in_force: RateSeries {
                family: Some(self.in_force.clone()),
                label: label.clone(),
            },
            tokens: TokenMetrics::new(self.tokens.clone(), name),
            settings: self.settings.group(label),
        }
    }

    /// Removes the series of an evicted group (its upstream series go with
    /// [`UpstreamMetrics::forget`]).
    pub fn forget(&self, name: &str) {
        let label = GroupLabel {
            group: name.to_string(),
        };
        self.queue_depth.remove(&label);
        self.in_flight.remove(&label);
        self.queue_wait.remove(&label);
        self.upstream_duration.remove(&label);
        self.pauses.remove(&label);
        self.pause_seconds.remove(&label);
        self.retries.remove(&label);
        self.passed_through.remove(&label);
        self.learned.remove(&label);
        self.in_force.remove(&label);
        self.settings.forget(&label);
        for outcome in OUTCOMES {
            self.requests.remove(&OutcomeLabels {
                group: name.to_string(),
                outcome,
            });
        }
    }

    /// Lets later stages register their own families.
    pub fn register(&self, f: impl FnOnce(&mut Registry)) {
        f(&mut self.registry.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Shows the token budgets of `groups` (name and tokens), and no other group's.
    pub fn show_tokens<'a>(&self, groups: impl IntoIterator<Item = (&'a str, &'a TokenFigures)>) {
        self.token_budgets.clear();
        for (name, tokens) in groups {
            self.token_budgets.show(name, tokens);
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        prometheus_client::encoding::text::encode(&mut text, &registry)
            .expect("writing to a String cannot fail");
        text
    }
}
