//! Upstream push-back: a 429 (or 503 with `Retry-After`) pauses the whole group, and
//! the refused request is sent again for the client.
//!
//! [`judge`] decides what an answer means, as a pure function; [`after_answer`] acts on
//! it (pause the group, count, retry or hand the answer over);
//! [`crate::replay::Replayable`] keeps what is needed to send a request again. The
//! request path (`proxy.rs`) sends a retry
//! back through its group, at the head of the queue, behind the pause it caused, and
//! within the `max_wait` counted from the client's first arrival.
//!
//! A request can be replayed when its body was read whole (no body, or one of at most
//! `max_replay_body` bytes); a bigger body streams through once, and its 429 goes to the
//! client unchanged. So does the 429 of a request out of retries or out of time: apps
//! that handle 429 themselves still can.
//!
//! Every answer's rate-limit headers teach the group's budget ([`crate::limit::budget`]):
//! a window spent (`X-RateLimit-Remaining: 0`, `RateLimit: ...;r=0`) holds the group
//! until the window is over, before the upstream has to refuse anything.

use std::hash::{BuildHasher, Hasher};
use std::ops::ControlFlow;
use std::time::{Duration, SystemTime};

use http::{header, HeaderMap, Response};
use tokio::time::Instant;

use crate::body::Body;
use crate::config::GroupSettings;
use crate::limit::Group;
use crate::ratelimit_headers::{announced, names_a_rate_limit, pause_hint};
use crate::retry_after::{backoff, retry_after};

/// What a response means for its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing to do.
    Pass,
    /// The upstream refused the request: pause, and retry it if possible.
    PushBack(Duration),
    /// The upstream refused the request without saying when to come back: pause for
    /// this guess (a backoff, or a margin when paced), and retry it if possible.
    Refused(Duration),
}

/// Judges an upstream response. Pure: the time and the jitter come in as arguments.
///
/// `now` reads our wall clock at the response; it is called only for a refusal.
/// `pushbacks_in_row` counts the group's push-backs since its last normal answer, for the
/// fallback backoff; `jitter` is in `[0, 1)`. `pace` is the group's emission interval
/// when it is paced: a first refusal that says nothing from a paced group means the
/// request came slightly early, and it pauses for a small margin ([`BARE_MARGIN`] of
/// the interval) instead of backing off from a second; the retry then takes the next
/// slot. Refused again before any normal answer, it backs off.
pub fn judge(
    status: u16,
    headers: &HeaderMap,
    settings: &GroupSettings,
    now: impl Fn() -> SystemTime,
    pushbacks_in_row: u32,
    jitter: f64,
    pace: Option<Duration>,
) -> Verdict {
    let text = |name| headers.get(name).and_then(|v| v.to_str().ok());
    let max = settings.max_pause;
    if !settings.retry_statuses.contains(&status) {
        return Verdict::Pass;
    }
    // Epoch resets are read against the upstream's own clock when it says what it is:
    // `pause_hint` reads `Date` itself and falls back to `now`.
    let hint = || match names_a_rate_limit(headers) {
        true => pause_hint(headers, now(), max),
        false => None,
    };
    // A paced group's first bare refusal is a request that came slightly early; one
    // right after it is not, and backs off like an unpaced group's.
    let fallback = || {
        Verdict::Refused(match pace {
            Some(pace) if pushbacks_in_row == 0 => pace.mul_f64(BARE_MARGIN).min(max),
            Some(_) => backoff(pushbacks_in_row - 1, max, jitter),
            None => backoff(pushbacks_in_row, max, jitter),
        })
    };
    match text(header::RETRY_AFTER) {
        Some(value) => {
            let said = retry_after(value, text(header::DATE), now(), max);
            said.map_or_else(fallback, Verdict::PushBack)
        }
        // A 503 that does not say when to come back is an outage, not a limit.
        None if status == 503 => Verdict::Pass,
        None => hint().map_or_else(fallback, Verdict::PushBack),
    }
}

/// The pause after a bare refusal from a paced group, as a fraction of its interval.
pub const BARE_MARGIN: f64 = 0.1;

/// When an answer came: our wall clock then (`None`: read it when a header needs it,
/// which nearly no answer does), and where the backoff's jitter comes from (the
/// simulator's are its own, and deterministic).
#[derive(Debug, Clone, Copy)]
pub struct Answered {
    /// Our wall clock at the answer.
    pub at: Option<SystemTime>,
    /// A number in `[0, 1)`.
    pub jitter: fn() -> f64,
    /// The tokens the request was estimated at, in a group that counts them.
    pub tokens: Option<crate::llm::Tokens>,
}

impl Answered {
    /// An answer that came now.
    pub fn now() -> Answered {
        Answered {
            at: None,
            jitter,
            tokens: None,
        }
    }

    /// An answer that came now to a request estimated at `tokens`.
    pub fn now_for(tokens: Option<crate::llm::Tokens>) -> Answered {
        Answered {
            tokens,
            ..Answered::now()
        }
    }

    fn wall_clock(&self) -> SystemTime {
        self.at.unwrap_or_else(SystemTime::now)
    }
}

/// Acts on the upstream's answer to attempt `attempt`, sent at `sent`, of a request
/// of `group` that arrived at `arrived`, `answered` then: teaches the group's budget,
/// pauses it as the answer says, and either hands the answer over (`Break`) or asks
/// for the request to be sent again (`Continue`).
pub fn after_answer(
    group: &Group,
    arrived: Instant,
    sent: Instant,
    can_replay: bool,
    attempt: u32,
    response: Response<Body>,
    answered: Answered,
) -> ControlFlow<Response<Body>> {
    let settings = group.settings();
    let status = response.status().as_u16();
    // The jitter of the fallback backoff, the push-backs in a row and the pace matter
    // to a refusal alone: every other answer skips the hashing and the group's lock.
    let (jitter, in_row, pace) = if settings.retry_statuses.contains(&status) {
        let (in_row, pace) = group.pushback_context();
        ((answered.jitter)(), in_row, pace)
    } else {
        (0.0, 0, None)
    };
    let headers = response.headers();
    if names_a_rate_limit(headers) {
        if let Some(announcement) = announced(headers, answered.wall_clock()) {
            group.announced(&announcement, sent);
        }
    }
    let verdict = judge(
        status,
        headers,
        &settings,
        || answered.wall_clock(),
        in_row,
        jitter,
        pace,
    );
    let (pause, said) = match verdict {
        Verdict::Pass => {
            group.accepted(sent);
            return ControlFlow::Break(response);
        }
        Verdict::PushBack(pause) => (pause, true),
        Verdict::Refused(pause) => (pause, false),
    };
    // A refusal on tokens (the headers say fewer remain than the request asked for)
    // says nothing of the request rate: the group pauses, its pace stays.
    let on_tokens = answered.tokens.is_some_and(|estimate| {
        crate::llm::headers::parse(headers, answered.wall_clock()).short_of(estimate)
    });
    match on_tokens {
        true => group.pause_for(pause),
        false => group.push_back(pause, said, sent),
    }
    record_pause(group, pause, "upstream pushed back");
    let in_time = arrived
        .checked_add(settings.max_wait)
        .is_none_or(|end| Instant::now() + pause < end);
    if can_replay && attempt < settings.max_retries && in_time {
        group.metrics.retries.inc();
        tracing::debug!(group = %group.name, attempt = attempt + 1, "retrying after push-back");
        // Dropped here, before the retry queues: that frees its concurrency permit.
        drop(response);
        return ControlFlow::Continue(());
    }
    group.metrics.passed_through.inc();
    ControlFlow::Break(response)
}

fn record_pause(group: &Group, pause: Duration, why: &str) {
    group.metrics.pauses.inc();
    group.metrics.pause_seconds.observe(pause.as_secs_f64());
    tracing::info!(
        group = %group.name,
        pause = %humantime::format_duration(Duration::from_millis(pause.as_millis() as u64)),
        "pausing group: {why}"
    );
}

/// A number in `[0, 1)` for backoff jitter. The standard library's per-instance random
/// hash keys are plenty for spreading retries; no cryptographic quality is needed.
fn jitter() -> f64 {
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (header::HeaderName::from_static(k), v.parse().unwrap()))
            .collect()
    }

    fn judged(status: u16, pairs: &[(&'static str, &str)]) -> Verdict {
        let now = httpdate::parse_http_date("Sun, 22 Nov 2026 10:00:00 GMT").unwrap();
        judge(
            status,
            &headers(pairs),
            &GroupSettings::default(),
            || now,
            0,
            0.5,
            None,
        )
    }

    #[test]
    fn ordinary_answers_pass() {
        assert_eq!(judged(200, &[]), Verdict::Pass);
        assert_eq!(judged(500, &[("retry-after", "5")]), Verdict::Pass);
    }

    /// The wall clock is read for a response that needs it, not for every response.
    #[test]
    fn the_clock_is_read_only_for_a_response_that_needs_it() {
        let settings = GroupSettings::default();
        let at = httpdate::parse_http_date("Sun, 22 Nov 2026 10:00:00 GMT").unwrap();
        let reads = std::cell::Cell::new(0);
        let now = || {
            reads.set(reads.get() + 1);
            at
        };
        let plain = headers(&[("content-type", "text/plain"), ("retry-after", "5")]);
        assert_eq!(
            judge(200, &plain, &settings, now, 0, 0.5, None),
            Verdict::Pass
        );
        assert_eq!(reads.get(), 0, "an ordinary answer reads no clock");
        let refused = headers(&[("retry-after", "5")]);
        let verdict = judge(429, &refused, &settings, now, 0, 0.5, None);
        assert_eq!(verdict, Verdict::PushBack(Duration::from_secs(5)));
        assert_eq!(reads.get(), 1, "a Retry-After is read against the clock");
        // A spent window is the budget's to keep to, not a verdict's.
        let spent = headers(&[("ratelimit", r#""default";r=0;t=30"#)]);
        let verdict = judge(200, &spent, &settings, now, 0, 0.5, None);
        assert_eq!(verdict, Verdict::Pass);
        assert_eq!(reads.get(), 1, "an accepted answer reads no clock");
    }

    #[test]
    fn a_429_pushes_back_for_retry_after() {
        let v = judged(429, &[("retry-after", "7")]);
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(7)));
    }

    #[test]
    fn a_date_is_read_against_the_upstreams_own_date() {
        // The upstream's clock is an hour ahead of ours: what counts is its 20 s.
        let v = judged(
            429,
            &[
                ("retry-after", "Sun, 22 Nov 2026 11:00:20 GMT"),
                ("date", "Sun, 22 Nov 2026 11:00:00 GMT"),
            ],
        );
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(20)));
    }

    #[test]
    fn a_503_without_retry_after_is_an_outage_not_a_limit() {
        assert_eq!(judged(503, &[]), Verdict::Pass);
        let v = judged(503, &[("retry-after", "3")]);
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(3)));
    }

    #[test]
    fn garbage_falls_back_to_backoff() {
        match judged(429, &[("retry-after", "soon")]) {
            Verdict::Refused(d) => assert!(d <= Duration::from_secs(1), "{d:?}"),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn a_429_without_retry_after_uses_the_rate_limit_reset() {
        let v = judged(
            429,
            &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "12")],
        );
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(12)));
    }

    #[test]
    fn pauses_are_capped() {
        let v = judged(429, &[("retry-after", "99999999")]);
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(600)));
    }

    #[test]
    fn statuses_are_configurable() {
        let settings = GroupSettings {
            retry_statuses: vec![429],
            ..GroupSettings::default()
        };
        let v = judge(
            503,
            &headers(&[("retry-after", "3")]),
            &settings,
            SystemTime::now,
            0,
            0.0,
            None,
        );
        assert_eq!(v, Verdict::Pass);
    }

    #[test]
    fn a_bare_429_from_a_paced_group_waits_a_margin_not_a_backoff() {
        let settings = GroupSettings::default();
        let ms = Duration::from_millis;
        // (pushbacks in a row, pace, pause)
        let cases = [
            (0, Some(ms(200)), ms(20)),
            // Refused again right after: not slightly early, a backoff.
            (1, Some(ms(200)), ms(750)),
            (3, Some(ms(200)), Duration::from_secs(3)),
            (0, Some(Duration::from_secs(7200)), Duration::from_secs(600)),
            (0, None, ms(750)),
            (2, None, Duration::from_secs(3)),
        ];
        for (in_row, pace, want) in cases {
            let v = judge(
                429,
                &HeaderMap::new(),
                &settings,
                SystemTime::now,
                in_row,
                0.5,
                pace,
            );
            assert_eq!(v, Verdict::Refused(want), "{in_row} {pace:?}");
        }
        // Anything the upstream says still wins.
        let said = headers(&[("retry-after", "2")]);
        let v = judge(
            429,
            &said,
            &settings,
            SystemTime::now,
            0,
            0.5,
            Some(ms(200)),
        );
        assert_eq!(v, Verdict::PushBack(Duration::from_secs(2)));
    }

    #[test]
    fn jitter_is_in_range() {
        for _ in 0..1000 {
            let j = jitter();
            assert!((0.0..1.0).contains(&j));
        }
    }
}
