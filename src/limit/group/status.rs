//! What `/status` shows of a group, and whether it is idle.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::super::budget::{self, Phase};
use super::super::keys::{hex, id_of};
use super::super::tokens::TokenStatus;
use super::Group;

/// A snapshot of a group for the admin `/status` page.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GroupStatus {
    /// The group's name.
    pub name: String,
    /// Requests waiting or at the head of the queue.
    pub queued: usize,
    /// Requests holding a concurrency permit.
    pub in_flight: usize,
    /// Seconds until the upstream's pause ends, if paused.
    pub paused_for_seconds: Option<f64>,
    /// The configured rates, in requests per second; empty when the group has none.
    pub effective_rates_per_second: Vec<f64>,
    /// The rate the group keeps to now, per second ([`pace_in_force`]).
    pub pace_in_force_per_second: Option<f64>,
    /// Why that rate, in plain words.
    pub pace_reason: String,
    /// What the group learned of its upstream's budget (docs/budget.md).
    #[serde(flatten)]
    pub budget: budget::Status,
    /// Its tokens, in a group that counts them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenStatus>,
    /// The name `key_labels` gives a key's budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Its keys' budgets, in a `[[limit]]` with `key`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keys: Option<KeysStatus>,
    /// The flows with requests waiting, the busiest first, in a group with `fair_by`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub flows: Vec<FlowStatus>,
}

/// How many of the most waiting keys and flows `/status` shows: the rest are counted.
pub const BUSIEST: usize = 10;

/// The keys of a `[[limit]]` with `key`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KeysStatus {
    /// Keys with a budget now.
    pub count: usize,
    /// `max_keys`.
    pub max_keys: usize,
    /// Requests queued in all its keys' budgets together.
    pub queued: usize,
    /// Requests in flight in all its keys' budgets together.
    pub in_flight: usize,
    /// The budgets with the most requests queued and in flight, at most [`BUSIEST`];
    /// each named `<limit>/<first 16 hex digits of the key's SHA-256>`.
    pub busiest: Vec<GroupStatus>,
}

/// One flow of a fair queue.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FlowStatus {
    /// The first 16 hex digits of its value's SHA-256.
    pub flow: String,
    /// Its value, when `weights` names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Its requests in the queue.
    pub queued: u32,
    /// Its weight.
    pub weight: u32,
}

/// The rate a group keeps to now, in requests per second, and why: `None` when no
/// request rate holds it (a group that counts `tokens` may still wait for them). A
/// pause holds it at 0; else the learned pace, the announced window's quota per
/// window, the slowest configured rate, whichever the budget model has, and a
/// configured rate still wins where it is slower (it is never exceeded).
///
/// One function, so that `/status`, the dashboard and `tollgate_pace_in_force` cannot
/// disagree: the configured rate alone reads wrong once the group learned a slower one.
/// A pause is `(seconds left, when it ends on the wall clock)`.
pub fn pace_in_force(
    paused: Option<(f64, SystemTime)>,
    budget: &budget::Status,
    configured: &[f64],
    tokens: bool,
) -> (Option<f64>, String) {
    if let Some((seconds, until)) = paused {
        let until = humantime::format_rfc3339_seconds(until);
        return (
            Some(0.0),
            format!("paused by the upstream for {seconds:.1} s, until {until}"),
        );
    }
    let slowest = configured.iter().copied().reduce(f64::min);
    let window = match (budget.window_quota, budget.window_seconds) {
        (Some(quota), Some(seconds)) if seconds > 0.0 => Some(quota as f64 / seconds),
        _ => None,
    };
    let learned = budget
        .pace_per_second
        .map(|p| (p, "learned from refusals"))
        .or(window.map(|w| (w, "announced window (RateLimit-Policy / X-RateLimit-*)")));
    match (learned, slowest) {
        (Some((pace, why)), Some(rate)) if pace < rate => (Some(pace), why.to_string()),
        (Some((pace, why)), None) => (Some(pace), why.to_string()),
        (_, Some(rate)) => (Some(rate), "configured rate".to_string()),
        (None, None) if tokens => (None, "no request rate: tokens hold it".to_string()),
        (None, None) if budget.phase == Phase::Probing => {
            (None, "probing: told no rate".to_string())
        }
        (None, None) => (None, "unlimited".to_string()),
    }
}

impl Group {
    /// A snapshot for `/status`.
    pub fn status(&self) -> GroupStatus {
        let state = self.lock();
        let now = Instant::now();
        let paused_for = state.pause.until(now).map(|p| (p - now).as_secs_f64());
        let configured = state.rates.per_second();
        let budget = state.budget.status(now);
        let paused = paused_for.map(|s| (s, SystemTime::now() + Duration::from_secs_f64(s)));
        let (pace, reason) = pace_in_force(paused, &budget, &configured, state.tokens.is_some());
        let tokens = state.tokens.as_ref().map(|t| t.status(now));
        let flows = state.queue.busiest_flows(BUSIEST);
        let queued = state.queue.len();
        drop(state);
        let settings = self.settings();
        let flows = (flows.into_iter())
            .map(|(id, queued, weight)| FlowStatus {
                flow: hex(id),
                label: (settings.keys.weights.keys())
                    .find(|value| id_of(value.as_bytes()) == id)
                    .cloned(),
                queued,
                weight,
            })
            .collect();
        let keys = settings.keys.key.is_some().then(|| self.keys_status());
        GroupStatus {
            label: None,
            keys,
            flows,
            name: self.name.to_string(),
            queued,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            paused_for_seconds: paused_for,
            effective_rates_per_second: configured,
            pace_in_force_per_second: pace,
            pace_reason: reason,
            budget,
            tokens,
        }
    }

    /// Its keys: how many, and the busiest, with their labels.
    fn keys_status(&self) -> KeysStatus {
        let mut all: Vec<_> = (self.keys.groups().into_iter())
            .map(|key| {
                let queued = key.lock().queue.len();
                (queued, key.in_flight.load(Ordering::Relaxed), key)
            })
            .collect();
        let (queued, in_flight) = (all.iter()).fold((0, 0), |(q, f), k| (q + k.0, f + k.1));
        all.sort_by(|a, b| {
            (b.0 + b.1)
                .cmp(&(a.0 + a.1))
                .then_with(|| a.2.name.cmp(&b.2.name))
        });
        let settings = self.settings();
        let busiest = (all.iter().take(BUSIEST))
            .map(|(_, _, key)| {
                let mut status = key.status();
                // A key's group shares its limit's settings, `key` included, but
                // has no keys of its own.
                status.keys = None;
                let digits = key.name.rsplit('/').next().unwrap_or_default();
                status.label = (settings.keys.key_labels.iter())
                    .find(|(prefix, _)| digits.starts_with(prefix.as_str()))
                    .map(|(_, label)| label.clone());
                status
            })
            .collect();
        KeysStatus {
            count: all.len(),
            max_keys: settings.keys.max_keys,
            queued,
            in_flight,
            busiest,
        }
    }

    /// Counts a request that leaves for the upstream after arriving at `arrived`: a
    /// departure, and a client's request admitted unless it is a `retry` (a client's
    /// request may depart more than once, so the two counts differ).
    pub(super) fn count_departure(&self, arrived: Instant, retry: bool) {
        self.metrics.admitted.inc();
        if !retry {
            self.metrics.requests_admitted.inc();
        }
        self.metrics
            .queue_wait
            .observe(arrived.elapsed().as_secs_f64());
    }

    /// Whether the group holds no state worth keeping: nothing queued, in flight or
    /// paused, and its rates back to idle. An idle group can be dropped and rebuilt
    /// later without any request noticing.
    pub fn is_idle(&self) -> bool {
        let state = self.lock();
        let now = Instant::now();
        state.queue.is_empty()
            && self.in_flight.load(Ordering::Relaxed) == 0
            && state.pause.until(now).is_none()
            && state.rates.is_idle(now)
            && state.tokens.as_ref().is_none_or(|t| t.is_idle(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::budget::Params;

    /// A budget in `phase`, with a learned `pace` and an announced `window`.
    fn budget(phase: Phase, pace: Option<f64>, window: Option<(u64, f64)>) -> budget::Status {
        budget::Status {
            phase,
            pace_per_second: pace,
            ceiling_per_second: None,
            window_quota: window.map(|(q, _)| q),
            window_seconds: window.map(|(_, w)| w),
            remaining: None,
            params: Params::default(),
        }
    }

    #[test]
    fn the_pace_in_force_and_why() {
        const WINDOW: &str = "announced window (RateLimit-Policy / X-RateLimit-*)";
        const LEARNED: &str = "learned from refusals";
        const CONFIGURED: &str = "configured rate";
        let open = budget(Phase::Open, None, None);
        let paced = |p| budget(Phase::Paced, Some(p), None);
        let windowed = |q, w| budget(Phase::Windowed, None, Some((q, w)));
        let both = budget(Phase::WindowedPaced, Some(0.5), Some((60, 60.0)));
        let probing = budget(Phase::Probing, None, None);
        // Paused for, until; the budget; the configured rates; the pace in force and why.
        type Case<'a> = (
            Option<(f64, SystemTime)>,
            &'a budget::Status,
            &'a [f64],
            Option<f64>,
            &'a str,
        );
        let cases: [Case; 11] = [
            (None, &open, &[2.0], Some(2.0), CONFIGURED),
            (None, &open, &[5.0, 0.5], Some(0.5), CONFIGURED),
            (None, &paced(0.98), &[2.0], Some(0.98), LEARNED),
            (None, &paced(1.5), &[], Some(1.5), LEARNED),
            // A configured rate is never exceeded, so a slower one holds.
            (None, &paced(3.0), &[2.0], Some(2.0), CONFIGURED),
            (None, &windowed(60, 60.0), &[], Some(1.0), WINDOW),
            (None, &windowed(600, 60.0), &[2.0], Some(2.0), CONFIGURED),
            // Refused within its window: the pace decides.
            (None, &both, &[], Some(0.5), LEARNED),
            (None, &probing, &[], None, "probing: told no rate"),
            (None, &open, &[], None, "unlimited"),
            (
                Some((
                    3.24,
                    SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_000_003),
                )),
                &paced(0.98),
                &[2.0],
                Some(0.0),
                "paused by the upstream for 3.2 s, until 2026-11-18T11:06:43Z",
            ),
        ];
        for (paused, status, configured, rate, why) in cases {
            assert_eq!(
                pace_in_force(paused, status, configured, false),
                (rate, why.to_string()),
                "{paused:?} {status:?} {configured:?}"
            );
        }
        // A group that counts tokens: they hold it when no request rate does.
        let tokens = |status, configured| pace_in_force(None, status, configured, true);
        let no_rate = (None, "no request rate: tokens hold it".to_string());
        assert_eq!(tokens(&open, &[]), no_rate);
        assert_eq!(tokens(&probing, &[]), no_rate);
        assert_eq!(tokens(&open, &[2.0]), (Some(2.0), CONFIGURED.to_string()));
        assert_eq!(tokens(&paced(0.5), &[]), (Some(0.5), LEARNED.to_string()));
    }
}
