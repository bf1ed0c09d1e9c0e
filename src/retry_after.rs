//! When may a refused request be tried again? Parsing `Retry-After` (RFC 9110 §10.2.3).
//!
//! An upstream that answers 429 or 503 may say how long to wait, in one of two forms:
//!
//! ```text
//! Retry-After: 120                              delta-seconds
//! Retry-After: Sun, 06 Nov 1994 08:49:37 GMT    HTTP-date, IMF-fixdate
//! Retry-After: Sunday, 06-Nov-94 08:49:37 GMT   HTTP-date, obsolete RFC 850 form
//! Retry-After: Sun Nov  6 08:49:37 1994         HTTP-date, obsolete asctime form
//! ```
//!
//! The rules [`retry_after`] applies:
//!
//! * delta-seconds is `1*DIGIT` and nothing else: `1.5`, `-3`, `+3` and `""` are not
//!   delta-seconds. Surrounding spaces and tabs are allowed. A number too large for a
//!   `u64` saturates instead of failing: the upstream clearly meant "a long time".
//! * An HTTP-date is measured against the response's own `Date` header when that
//!   parses, and against our clock only when it does not. Both dates come from the
//!   upstream's clock, so their difference is what the upstream meant even when its
//!   clock and ours disagree by minutes.
//! * A date in the past means "now" ([`Duration::ZERO`]).
//! * Every answer is capped at `max_pause`, so one bad header cannot park a group for
//!   a day.
//! * Anything else is `None`, and the caller falls back to [`backoff`].
//!
//! Both functions are pure: the current time and the random jitter come in as
//! arguments, so every rule above is a unit test and a fuzz target
//! (`fuzz/fuzz_targets/retry_after.rs`).

use std::time::{Duration, SystemTime};

/// How long to wait before trying again, from a `Retry-After` value.
///
/// `value` is the `Retry-After` field value, `date` the same response's `Date` field
/// value if it has one, `now` our wall clock when the response arrived. Returns `None`
/// when `value` is neither delta-seconds nor an HTTP-date; otherwise a duration of at
/// most `max_pause` (see the module documentation for the rules).
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use tollgate::parts::retry_after;
///
/// let max = Duration::from_secs(600);
/// let now = SystemTime::now();
/// assert_eq!(retry_after("30", None, now, max), Some(Duration::from_secs(30)));
/// assert_eq!(
///     retry_after(
///         "Sun, 06 Nov 1994 08:50:07 GMT",
///         Some("Sun, 06 Nov 1994 08:49:37 GMT"),
///         now,
///         max,
///     ),
///     Some(Duration::from_secs(30)),
/// );
/// assert_eq!(retry_after("soon", None, now, max), None);
/// ```
pub fn retry_after(
    value: &str,
    date: Option<&str>,
    now: SystemTime,
    max_pause: Duration,
) -> Option<Duration> {
    let value = value.trim_matches(is_ows);
    let wait = if let Some(secs) = delta_seconds(value) {
        Duration::from_secs(secs)
    } else {
        // httpdate accepts exactly the three RFC 9110 forms (IMF-fixdate, RFC 850,
        // asctime) and rejects a weekday that does not match the date.
        let at = httpdate::parse_http_date(value).ok()?;
        let date = date.and_then(|d| httpdate::parse_http_date(d).ok());
        until(at, upstream_now(date, now))
    };
    Some(wait.min(max_pause))
}

/// The wait before retry number `attempt` when the upstream did not say: exponential
/// from one second, capped at `max_pause`, with "equal jitter".
///
/// The un-jittered step is `min(2^attempt s, max_pause)`; the result is half the step
/// plus `jitter` times the other half, so attempt 0 waits 0.5–1 s, attempt 1 waits
/// 1–2 s, attempt 3 waits 4–8 s, and so on. Equal rather than full jitter because a
/// retry after a refusal should never go out immediately: half the step is a floor,
/// the other half spreads the clients of one upstream apart.
///
/// `jitter` is the caller's random number in `[0, 1)`; values outside that range are
/// clamped (NaN counts as 0), and no `attempt` or `jitter` can make this panic or exceed
/// `max_pause`.
///
/// ```
/// use std::time::Duration;
/// use tollgate::parts::backoff;
///
/// let max = Duration::from_secs(600);
/// assert_eq!(backoff(0, max, 0.0), Duration::from_millis(500));
/// assert_eq!(backoff(3, max, 0.5), Duration::from_secs(6));
/// assert_eq!(backoff(u32::MAX, max, 0.0), Duration::from_secs(300));
/// ```
pub fn backoff(attempt: u32, max_pause: Duration, jitter: f64) -> Duration {
    // 2^attempt seconds, or "more than any cap" once that no longer fits a u64.
    let step = 1u64
        .checked_shl(attempt)
        .map_or(max_pause, |secs| Duration::from_secs(secs).min(max_pause));
    let half = step / 2;
    let jitter = if jitter.is_nan() {
        0.0
    } else {
        jitter.clamp(0.0, 1.0)
    };
    // Scale in integer nanoseconds: `Duration::mul_f64` panics on overflow, and a
    // `f64 -> u128` cast saturates instead.
    let half_nanos = half.as_nanos();
    let extra = ((half_nanos as f64 * jitter) as u128).min(half_nanos);
    half + nanos(extra)
}

/// `1*DIGIT`, saturating at `u64::MAX`.
fn delta_seconds(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.bytes().fold(0u64, |acc, b| {
        acc.saturating_mul(10).saturating_add(u64::from(b - b'0'))
    }))
}

/// The upstream's clock when it answered: its `Date` when that parses, but our own
/// clock when the two agree to within `Date`'s one-second resolution.
///
/// `Date` is whole seconds, so a reset read against it alone ends up to a second late
/// (a window that reopens at :05 is "1 s away" all through :04). Our clock has the
/// fraction; when it reads within `[Date − 1 s, Date + 2 s]` (a second of resolution,
/// a second of transit and skew) the clocks agree and ours is the precise one. Further
/// apart they disagree, and only the upstream's own `Date` measures its resets.
pub(crate) fn upstream_now(date: Option<SystemTime>, now: SystemTime) -> SystemTime {
    const SECOND: Duration = Duration::from_secs(1);
    match date {
        Some(date) if now + SECOND >= date && now <= date + 2 * SECOND => now,
        Some(date) => date,
        None => now,
    }
}

/// How far `at` lies after `reference`; zero when it does not.
pub(crate) fn until(at: SystemTime, reference: SystemTime) -> Duration {
    at.duration_since(reference).unwrap_or(Duration::ZERO)
}

/// A `u128` count of nanoseconds as a `Duration`, saturating.
fn nanos(n: u128) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    let secs = u64::try_from(n / NANOS_PER_SEC).unwrap_or(u64::MAX);
    Duration::new(secs, (n % NANOS_PER_SEC) as u32)
}

/// Optional whitespace around a field value (RFC 9110 §5.6.3).
pub(crate) fn is_ows(c: char) -> bool {
    c == ' ' || c == '\t'
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    const MAX: Duration = Duration::from_secs(600);

    /// 1994-11-06 08:49:37 UTC, the RFC 9110 example date.
    fn rfc_date() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(784_111_777)
    }

    fn secs(n: u64) -> Option<Duration> {
        Some(Duration::from_secs(n))
    }

    #[test]
    fn delta_seconds() {
        assert_eq!(retry_after("120", None, rfc_date(), MAX), secs(120));
        assert_eq!(retry_after("0", None, rfc_date(), MAX), secs(0));
        assert_eq!(retry_after("007", None, rfc_date(), MAX), secs(7));
    }

    #[test]
    fn delta_seconds_ignores_surrounding_whitespace_and_date() {
        assert_eq!(retry_after(" \t42 ", None, rfc_date(), MAX), secs(42));
        // The Date header only matters for HTTP-dates.
        let date = Some("Sun, 06 Nov 1994 07:00:00 GMT");
        assert_eq!(retry_after("42", date, rfc_date(), MAX), secs(42));
    }

    #[test]
    fn imf_fixdate_against_now() {
        let v = "Sun, 06 Nov 1994 08:50:07 GMT";
        assert_eq!(retry_after(v, None, rfc_date(), MAX), secs(30));
    }

    #[test]
    fn rfc850_date() {
        let v = "Sunday, 06-Nov-94 08:50:07 GMT";
        assert_eq!(retry_after(v, None, rfc_date(), MAX), secs(30));
    }

    #[test]
    fn asctime_date() {
        let v = "Sun Nov  6 08:50:07 1994";
        assert_eq!(retry_after(v, None, rfc_date(), MAX), secs(30));
    }

    #[test]
    fn date_header_in_any_form_is_the_reference() {
        let v = "Sun, 06 Nov 1994 08:50:07 GMT";
        for date in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            // `now` is a day off: only the Date header may count.
            let now = rfc_date() + Duration::from_secs(86_400);
            assert_eq!(retry_after(v, Some(date), now, MAX), secs(30), "{date}");
        }
    }

    #[test]
    fn skewed_date_header_wins_over_our_clock() {
        // The upstream's clock runs an hour behind ours. It says "retry 90 s after my
        // Date"; against our clock that date lies an hour in the past.
        let now = rfc_date() + Duration::from_secs(3600);
        let v = "Sun, 06 Nov 1994 08:51:07 GMT";
        let date = Some("Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(retry_after(v, date, now, MAX), secs(90));
        assert_eq!(retry_after(v, None, now, MAX), secs(0));

        // And an hour ahead: against our clock that would be an hour and 90 s.
        let now = rfc_date() - Duration::from_secs(3600);
        assert_eq!(retry_after(v, date, now, Duration::MAX), secs(90));
        assert_eq!(retry_after(v, None, now, Duration::MAX), secs(3690));
    }

    #[test]
    fn unparseable_date_header_falls_back_to_now() {
        let v = "Sun, 06 Nov 1994 08:50:07 GMT";
        let date = Some("yesterday");
        assert_eq!(retry_after(v, date, rfc_date(), MAX), secs(30));
    }

    #[test]
    fn past_date_means_now() {
        let v = "Sun, 06 Nov 1994 08:00:00 GMT";
        assert_eq!(retry_after(v, None, rfc_date(), MAX), secs(0));
        let date = Some("Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(retry_after(v, date, rfc_date(), MAX), secs(0));
        // Exactly now is zero too.
        let v = "Sun, 06 Nov 1994 08:49:37 GMT";
        assert_eq!(retry_after(v, None, rfc_date(), MAX), secs(0));
    }

    #[test]
    fn huge_values_are_capped() {
        assert_eq!(retry_after("86400", None, rfc_date(), MAX), Some(MAX));
        let huge = "99999999999999999999999999999999999999";
        assert_eq!(retry_after(huge, None, rfc_date(), MAX), Some(MAX));
        assert_eq!(
            retry_after(huge, None, rfc_date(), Duration::MAX),
            secs(u64::MAX)
        );
        let far = "Fri, 31 Dec 9999 23:59:59 GMT";
        assert_eq!(retry_after(far, None, rfc_date(), MAX), Some(MAX));
        assert_eq!(retry_after(far, None, UNIX_EPOCH, MAX), Some(MAX));
    }

    #[test]
    fn zero_cap_always_wins() {
        assert_eq!(retry_after("5", None, rfc_date(), Duration::ZERO), secs(0));
    }

    #[test]
    fn garbage_is_none() {
        for v in [
            "",
            "   ",
            "soon",
            "1.5",
            "-3",
            "+3",
            "1e3",
            "3 s",
            "3,4",
            "0x10",
            "１２", // full-width digits are not DIGIT
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Mon, 06 Nov 1994 08:49:37 GMT", // wrong weekday
            "Sun, 31 Nov 1994 08:49:37 GMT", // no such day
            "Sun, 06 Nov 1969 08:49:37 GMT", // before 1970
            "2024-01-01T00:00:00Z",
        ] {
            assert_eq!(retry_after(v, None, rfc_date(), MAX), None, "{v:?}");
        }
    }

    #[test]
    fn backoff_doubles_from_one_second() {
        for (attempt, step) in [(0, 1), (1, 2), (2, 4), (3, 8), (9, 512)] {
            let step = Duration::from_secs(step);
            assert_eq!(backoff(attempt, MAX, 0.0), step / 2, "attempt {attempt}");
            assert_eq!(
                backoff(attempt, MAX, 0.5),
                step * 3 / 4,
                "attempt {attempt}"
            );
            let top = backoff(attempt, MAX, 0.999_999);
            assert!(
                top < step && top > step * 99 / 100,
                "attempt {attempt}: {top:?}"
            );
        }
    }

    #[test]
    fn backoff_is_capped() {
        for attempt in [10, 20, 63, 64, 65, 1000, u32::MAX] {
            assert_eq!(backoff(attempt, MAX, 0.0), MAX / 2, "attempt {attempt}");
            assert!(backoff(attempt, MAX, 0.999) <= MAX, "attempt {attempt}");
        }
        assert_eq!(backoff(5, Duration::ZERO, 0.7), Duration::ZERO);
        assert_eq!(
            backoff(0, Duration::from_millis(100), 0.0),
            Duration::from_millis(50)
        );
    }

    #[test]
    fn backoff_survives_any_jitter_and_cap() {
        for jitter in [
            -1.0,
            1.0,
            2.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MIN_POSITIVE,
        ] {
            for attempt in [0, 1, 63, 64, u32::MAX] {
                for max in [Duration::ZERO, MAX, Duration::MAX] {
                    let d = backoff(attempt, max, jitter);
                    assert!(d <= max, "{attempt} {max:?} {jitter}: {d:?}");
                }
            }
        }
        assert_eq!(backoff(0, MAX, f64::NAN), Duration::from_millis(500));
        assert_eq!(backoff(0, MAX, -5.0), Duration::from_millis(500));
        assert_eq!(backoff(0, MAX, 5.0), Duration::from_secs(1));
        let top = backoff(u32::MAX, Duration::MAX, 1.0);
        assert!(top >= Duration::MAX - Duration::from_secs(1), "{top:?}");
    }
}
