//! Reading an upstream's rate-limit headers (`X-RateLimit-*`, IETF `RateLimit`).
//!
//! Many upstreams announce their budget on every response. When a response says the
//! budget is spent, tollgate pauses the group until the budget resets instead of
//! sending one more request only to be told 429. [`pause_hint`] reads three families:
//!
//! ```text
//! (a) X-RateLimit-Remaining: 0           RateLimit-Remaining: 0
//!     X-RateLimit-Reset: 30              RateLimit-Reset: 1700000000
//!
//! (b) RateLimit: "default";r=0;t=30      (draft-ietf-httpapi-ratelimit-headers-08 and
//!     RateLimit-Policy: "default";q=100;w=60                                   later)
//!
//! (c) RateLimit: limit=100, remaining=0, reset=30          (draft 07 and earlier)
//! ```
//!
//! # Rules
//!
//! * Only a budget of exactly 0 pauses. Remaining above 0, or a remaining that does
//!   not parse, gives `None`.
//! * Remaining 0 without a usable reset also gives `None`: we do not know how long to
//!   wait, and guessing is the caller's business (it will see the 429 and its
//!   `Retry-After` soon enough).
//! * Remaining 0 with a reset that has already passed (or is 0) gives
//!   `Some(Duration::ZERO)`: the budget is spent but refills now.
//! * When several families or policies are present, the longest pause wins; every
//!   answer is capped at `max_pause`.
//!
//! # `*-Reset` in family (a): delta or epoch?
//!
//! Upstreams disagree: GitHub and GitLab send a Unix timestamp, most others (and the
//! early IETF drafts) seconds from now. The value is read as a decimal number
//! (`1*DIGIT ["." 1*DIGIT]`, since some APIs send fractions) and classified by size,
//! without looking at any clock:
//!
//! * up to one year of seconds (31 536 000) it is **delta seconds**: no rate-limit
//!   window is longer, and no timestamp is that small (it would be in 1970);
//! * from 10^12 it is a Unix timestamp in **milliseconds**: as seconds it would lie
//!   31 000 years ahead, as milliseconds it is any date after September 2001;
//! * in between it is a Unix timestamp in **seconds**.
//!
//! A timestamp is measured against the upstream's clock: its `Date` header when our
//! clock disagrees with it, else our own clock, which has the fraction of the second
//! that `Date` lacks (see `retry_after::upstream_now`), so neither a skew nor `Date`'s
//! resolution stretches or shrinks the pause. An HTTP-date in `*-Reset` is accepted and measured the
//! same way. `X-RateLimit-Remaining` pairs only with `X-RateLimit-Reset`, and
//! `RateLimit-Remaining` only with `RateLimit-Reset`. A header repeated on several
//! lines counts by its first line.
//!
//! # The IETF `RateLimit` field
//!
//! The field is an RFC 8941 structured field and this module carries a small parser for
//! the subset it needs: lists and dictionaries of items with parameters, where an item
//! is an integer, decimal, string, token, byte sequence or boolean. Inner lists, or
//! anything else that is not well formed, make the whole field count as absent.
//! Several lines of one field are read as one list, as RFC 9110 §5.3 allows.
//!
//! * The current form (draft 08 on) is a list of policies: a name (string, or token
//!   for lenience) with `r` = remaining quota units and `t` = seconds until the quota
//!   resets. A policy with `r=0` pauses for `t`; when it has no `t`, the window `w` of
//!   the `RateLimit-Policy` entry with the same name stands in, since the quota
//!   refills within one window at the latest. Among several policies at 0, the longest
//!   wait wins. A policy without `r` says nothing and is skipped; an `r` or `t` that
//!   is not a non-negative integer makes the field malformed.
//! * The older form (draft 07 and before) is a dictionary with `remaining` and
//!   `reset` (delta seconds). It is recognised by having `key=value` members.
//!
//! `t`, `w` and `reset` are always delta seconds there, as the drafts define them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{HeaderMap, HeaderName, DATE};

use crate::retry_after::{is_ows, until, upstream_now};

mod sf;

/// What one answer announced of the upstream's budget.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Announcement {
    /// Requests per window (`*-Limit`, `q`).
    pub quota: Option<u64>,
    /// The window, when the upstream says it (`w` of `RateLimit-Policy`).
    pub window: Option<Duration>,
    /// Requests left in the current window (`*-Remaining`, `r`).
    pub remaining: Option<u64>,
    /// When the window resets.
    pub reset: Option<Reset>,
}

/// A window's reset as an answer states it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reset {
    /// From the answer to the reset, on the upstream's clock.
    pub after: Duration,
    /// How finely it is stated: 1 s for whole seconds, less for milliseconds or
    /// fractions.
    pub resolution: Duration,
}

const X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
const REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
const RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
const X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// Seconds in a year: the largest `*-Reset` value read as delta seconds.
const DELTA_MAX: u64 = 365 * 24 * 60 * 60;
/// The smallest `*-Reset` value read as a Unix timestamp in milliseconds.
const EPOCH_MILLIS_MIN: u64 = 1_000_000_000_000;

/// Whether any header of `headers` is one of the rate-limit headers [`pause_hint`]
/// reads (`RateLimit*`, `X-RateLimit-*`).
///
/// Every response is asked and nearly none has them, so this is one pass over the
/// names the response has.
pub fn names_a_rate_limit(headers: &HeaderMap) -> bool {
    headers.keys().any(|name| {
        let name = name.as_str();
        name.starts_with("ratelimit") || name.starts_with("x-ratelimit-")
    })
}

/// How long to pause the group when these response headers say its budget is spent.
///
/// `now` is our wall clock when the response arrived; it only matters for a reset
/// given as a timestamp when the response has no usable `Date` header. Returns `None`
/// when no header family says "remaining 0", or none that does says when the budget
/// resets; otherwise the longest announced wait, at most `max_pause`. The rules are in
/// the module documentation.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use http::HeaderMap;
/// use tollgate::parts::pause_hint;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("ratelimit", r#""default";r=0;t=30"#.parse().unwrap());
/// let max = Duration::from_secs(600);
/// assert_eq!(
///     pause_hint(&headers, SystemTime::now(), max),
///     Some(Duration::from_secs(30))
/// );
/// ```
pub fn pause_hint(headers: &HeaderMap, now: SystemTime, max_pause: Duration) -> Option<Duration> {
    if !names_a_rate_limit(headers) {
        return None;
    }
    // `Date` matters only when a reset is an absolute time: parsed then, once.
    let date = std::cell::OnceCell::new();
    let reference = || {
        *date.get_or_init(|| {
            let date = headers
                .get(DATE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| httpdate::parse_http_date(v).ok());
            upstream_now(date, now)
        })
    };
    [
        legacy(headers, &X_REMAINING, &X_RESET, reference),
        legacy(headers, &REMAINING, &RESET, reference),
        structured(headers),
    ]
    .into_iter()
    .flatten()
    .max()
    .map(|d| d.min(max_pause))
}

/// The budget these response headers announce, for the group's window
/// (docs/budget.md): the quota and window of the slowest `RateLimit-Policy`
/// policy (`q` per `w`), and the remaining quota and reset of the first family that
/// says them: `X-RateLimit-*` (GitHub's among them), `RateLimit-Limit`/`-Remaining`/
/// `-Reset`, or the `RateLimit` field (either draft form). `now` is our wall clock at
/// the response, for a reset given as a timestamp. `None` when nothing is announced.
pub fn announced(headers: &HeaderMap, now: SystemTime) -> Option<Announcement> {
    if !names_a_rate_limit(headers) {
        return None;
    }
    let date = headers
        .get(DATE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| httpdate::parse_http_date(v).ok());
    let reference = || upstream_now(date, now);
    let policy = policy_budget(headers);
    let said = [
        (&X_LIMIT, &X_REMAINING, &X_RESET),
        (&LIMIT, &REMAINING, &RESET),
    ]
    .into_iter()
    .map(|(limit, remaining, reset)| {
        let text = |name: &HeaderName| headers.get(name)?.to_str().ok();
        Announcement {
            quota: text(limit).and_then(leading_integer).filter(|q| *q > 0),
            remaining: text(remaining).and_then(|r| r.trim_matches(is_ows).parse().ok()),
            reset: text(reset).and_then(|r| legacy_reset(r.trim_matches(is_ows), reference)),
            window: None,
        }
    })
    .chain(structured_said(
        headers,
        policy.as_ref().and_then(|p| p.0.as_deref()),
    ))
    .find(|a| a.quota.is_some() || a.remaining.is_some());
    let mut a = said.unwrap_or_default();
    // The policy says its quota and window outright.
    if let Some((_, quota, window)) = policy {
        a.window = Some(window);
        a.quota = Some(quota);
    }
    (a != Announcement::default()).then_some(a)
}

/// `RateLimit-Policy`: the policy with the slowest `q` / `w`, with its name.
fn policy_budget(headers: &HeaderMap) -> Option<(Option<String>, u64, Duration)> {
    let policies = sf::parse(&joined(headers, &RATELIMIT_POLICY)?)?;
    policies
        .iter()
        .filter_map(|p| {
            let quota = p.param("q")?.non_negative()?;
            let window = p.param("w")?.non_negative()?;
            (quota > 0 && window > 0).then(|| (p.name().map(str::to_string), quota, window))
        })
        .min_by(|a, b| (a.1 as f64 / a.2 as f64).total_cmp(&(b.1 as f64 / b.2 as f64)))
        .map(|(name, quota, window)| (name, quota, Duration::from_secs(window)))
}

/// What the `RateLimit` field says remains: in the current form, the member named
/// like the policy read (else the one with the least left), `r` and `t`; in the older
/// dictionary form, `limit`, `remaining` and `reset`.
fn structured_said(headers: &HeaderMap, policy: Option<&str>) -> Option<Announcement> {
    let members = sf::parse(&joined(headers, &RATELIMIT)?)?;
    let whole = |secs: u64| Reset {
        after: Duration::from_secs(secs),
        resolution: Duration::from_secs(1),
    };
    if members.iter().any(|m| m.key.is_some() && m.item.is_some()) {
        let value = |key: &str| {
            let member = members.iter().rev().find(|m| {
                m.key
                    .as_deref()
                    .is_some_and(|k| k.eq_ignore_ascii_case(key))
            })?;
            member.item.as_ref()?.non_negative()
        };
        return Some(Announcement {
            quota: value("limit").filter(|q| *q > 0),
            remaining: value("remaining"),
            reset: value("reset").map(whole),
            window: None,
        });
    }
    let left = |m: &&sf::Member| m.param("r").and_then(sf::Bare::non_negative);
    let member = match policy {
        Some(name) => members.iter().find(|m| m.name() == Some(name)),
        None => members
            .iter()
            .filter(|m| left(m).is_some())
            .min_by_key(left),
    }?;
    Some(Announcement {
        quota: None,
        remaining: left(&member),
        reset: member
            .param("t")
            .and_then(sf::Bare::non_negative)
            .map(whole),
        window: None,
    })
}

/// The integer a `*-Limit` value starts with (`100`, or `100, 100;w=60` as some send).
fn leading_integer(value: &str) -> Option<u64> {
    let value = value.trim_matches(is_ows);
    let digits = value.bytes().take_while(u8::is_ascii_digit).count();
    value[..digits].parse().ok()
}

/// Family (a): a `*-Remaining` / `*-Reset` pair.
fn legacy(
    headers: &HeaderMap,
    remaining: &HeaderName,
    reset: &HeaderName,
    reference: impl Fn() -> SystemTime,
) -> Option<Duration> {
    let remaining = headers.get(remaining)?.to_str().ok()?.trim_matches(is_ows);
    if remaining.is_empty() || !remaining.bytes().all(|b| b == b'0') {
        return None;
    }
    let reset = headers.get(reset)?.to_str().ok()?.trim_matches(is_ows);
    legacy_reset(reset, reference).map(|r| r.after)
}

/// A `*-Reset` value: delta seconds, Unix seconds, Unix milliseconds or HTTP-date;
/// `reference` (the upstream's clock) is asked only for the absolute forms. Whole
/// seconds (and dates) have a resolution of a second, fractions and milliseconds of a
/// millisecond.
fn legacy_reset(value: &str, reference: impl Fn() -> SystemTime) -> Option<Reset> {
    let second = Duration::from_secs(1);
    let Some((whole, frac)) = decimal(value) else {
        let at = httpdate::parse_http_date(value).ok()?;
        return Some(Reset {
            after: until(at, reference()),
            resolution: second,
        });
    };
    let fine = value.contains('.') || whole >= EPOCH_MILLIS_MIN;
    let resolution = if fine {
        Duration::from_millis(1)
    } else {
        second
    };
    if whole <= DELTA_MAX {
        let after = Duration::new(whole, frac);
        return Some(Reset { after, resolution });
    }
    let since_epoch = if whole >= EPOCH_MILLIS_MIN {
        Duration::from_millis(whole)
    } else {
        Duration::new(whole, frac)
    };
    // A timestamp past what SystemTime can hold is "very far in the future".
    let at = UNIX_EPOCH.checked_add(since_epoch);
    let after = at.map_or(Duration::MAX, |at| until(at, reference()));
    Some(Reset { after, resolution })
}

/// `1*DIGIT ["." 1*DIGIT]` as whole units (saturating) and nanoseconds (truncated).
fn decimal(s: &str) -> Option<(u64, u32)> {
    let (whole, frac) = match s.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (s, None),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || frac.is_some_and(|f| !digits(f)) {
        return None;
    }
    let whole = whole.bytes().fold(0u64, |acc, b| {
        acc.saturating_mul(10).saturating_add(u64::from(b - b'0'))
    });
    // Nine digits of fraction are nanoseconds; pad shorter ones, drop the rest.
    let nanos = frac
        .unwrap_or("")
        .bytes()
        .chain(std::iter::repeat(b'0'))
        .take(9)
        .fold(0u32, |acc, b| acc * 10 + u32::from(b - b'0'));
    Some((whole, nanos))
}

/// Families (b) and (c): the IETF `RateLimit` field, either draft form.
fn structured(headers: &HeaderMap) -> Option<Duration> {
    let members = sf::parse(&joined(headers, &RATELIMIT)?)?;
    if members.iter().any(|m| m.key.is_some() && m.item.is_some()) {
        return dictionary_form(&members);
    }
    // Parsed only when needed, and only to fill in a missing `t`.
    let policies = joined(headers, &RATELIMIT_POLICY).and_then(|p| sf::parse(&p));
    let window = |name: &str| {
        policies
            .as_deref()?
            .iter()
            .find(|p| p.name() == Some(name))?
            .param("w")
            .and_then(sf::Bare::non_negative)
    };
    let mut longest = None;
    for member in &members {
        let Some(r) = member.param("r") else { continue };
        let r = r.non_negative()?;
        let t = match member.param("t") {
            Some(t) => Some(t.non_negative()?),
            None => member.name().and_then(window),
        };
        if r == 0 {
            if let Some(t) = t {
                longest = longest.max(Some(t));
            }
        }
    }
    longest.map(Duration::from_secs)
}

/// Draft 07 and before: `RateLimit: limit=100, remaining=0, reset=30`.
fn dictionary_form(members: &[sf::Member]) -> Option<Duration> {
    // A dictionary key that appears twice counts by its last value (RFC 8941 §4.2.2).
    let value = |key: &str| {
        members
            .iter()
            .rev()
            .find(|m| {
                m.key
                    .as_deref()
                    .is_some_and(|k| k.eq_ignore_ascii_case(key))
            })?
            .item
            .as_ref()
    };
    if value("remaining")?.non_negative()? != 0 {
        return None;
    }
    value("reset")?.non_negative().map(Duration::from_secs)
}

/// All lines of a field joined as one list, as RFC 9110 §5.3 allows for list fields.
fn joined(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    let mut lines = headers.get_all(name).iter().peekable();
    lines.peek()?;
    let lines: Option<Vec<&str>> = lines.map(|v| v.to_str().ok()).collect();
    Some(lines?.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    const MAX: Duration = Duration::from_secs(600);

    /// 2023-11-14 22:13:20 UTC.
    const EPOCH: u64 = 1_700_000_000;
    const EPOCH_DATE: &str = "Tue, 14 Nov 2023 22:13:20 GMT";

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for &(name, value) in pairs {
            map.append(name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    fn hint(pairs: &[(&'static str, &str)]) -> Option<Duration> {
        pause_hint(&headers(pairs), at(EPOCH), MAX)
    }

    fn secs(n: u64) -> Option<Duration> {
        Some(Duration::from_secs(n))
    }

    #[test]
    fn no_headers_no_pause() {
        assert_eq!(hint(&[]), None);
        assert_eq!(hint(&[("date", EPOCH_DATE), ("retry-after", "5")]), None);
        assert_eq!(hint(&[("x-ratelimit-limit", "100")]), None);
    }

    #[test]
    fn names_are_found_whatever_their_case_on_the_wire() {
        let mut map = HeaderMap::new();
        for (name, value) in [("X-RateLimit-Remaining", "0"), ("X-RateLimit-Reset", "30")] {
            let name = HeaderName::from_bytes(name.as_bytes()).unwrap();
            map.append(name, HeaderValue::from_static(value));
        }
        assert_eq!(pause_hint(&map, at(EPOCH), MAX), secs(30));
        let mut map = HeaderMap::new();
        let name = HeaderName::from_bytes(b"RateLimit").unwrap();
        map.append(name, HeaderValue::from_static("\"default\";r=0;t=4"));
        assert_eq!(pause_hint(&map, at(EPOCH), MAX), secs(4));
    }

    #[test]
    fn x_ratelimit_delta_seconds() {
        let h = [("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "30")];
        assert_eq!(hint(&h), secs(30));
        let h = [
            ("x-ratelimit-remaining", " 0 "),
            ("x-ratelimit-reset", "\t45"),
        ];
        assert_eq!(hint(&h), secs(45));
    }

    #[test]
    fn remaining_above_zero_does_not_pause() {
        let h = [("x-ratelimit-remaining", "1"), ("x-ratelimit-reset", "30")];
        assert_eq!(hint(&h), None);
        let h = [("ratelimit-remaining", "10"), ("ratelimit-reset", "30")];
        assert_eq!(hint(&h), None);
    }

    #[test]
    fn remaining_zero_without_reset_is_for_the_caller() {
        assert_eq!(hint(&[("x-ratelimit-remaining", "0")]), None);
        let h = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "later"),
        ];
        assert_eq!(hint(&h), None);
        // The two spellings do not pair with each other.
        let h = [("x-ratelimit-remaining", "0"), ("ratelimit-reset", "30")];
        assert_eq!(hint(&h), None);
    }

    #[test]
    fn remaining_zero_reset_zero_is_a_zero_pause() {
        let h = [("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "0")];
        assert_eq!(hint(&h), secs(0));
        let h = [("ratelimit", "limit=10, remaining=0, reset=0")];
        assert_eq!(hint(&h), secs(0));
        assert_eq!(hint(&[("ratelimit", r#""p";r=0;t=0"#)]), secs(0));
    }

    #[test]
    fn announced_budgets() {
        let unix = (EPOCH + 1).to_string();
        let ms = Duration::from_millis;
        let whole = |after: Duration| Reset {
            after,
            resolution: Duration::from_secs(1),
        };
        let said = |q: Option<u64>, r: Option<u64>, reset: Option<Reset>| Announcement {
            quota: q,
            window: None,
            remaining: r,
            reset,
        };
        let policy = |q: u64, w: u64, r: Option<u64>, t: Option<u64>| Announcement {
            quota: Some(q),
            window: Some(Duration::from_secs(w)),
            remaining: r,
            reset: t.map(|t| whole(Duration::from_secs(t))),
        };
        // Our clock is 0.3 s into the second the Date header names.
        let now = at(EPOCH) + ms(300);
        type Pairs<'a> = &'a [(&'static str, &'a str)];
        let cases: &[(Pairs, Option<Announcement>)] = &[
            (&[("date", EPOCH_DATE)], None),
            // A Unix reset in whole seconds: 0.7 s away, to a second.
            (
                &[("x-ratelimit-limit", "5"), ("x-ratelimit-reset", &unix)],
                Some(said(Some(5), None, Some(whole(ms(700))))),
            ),
            // GitHub's: used and resource are not needed.
            (
                &[
                    ("x-ratelimit-limit", "5000"),
                    ("x-ratelimit-remaining", "4999"),
                    ("x-ratelimit-used", "1"),
                    ("x-ratelimit-resource", "core"),
                    ("x-ratelimit-reset", &unix),
                ],
                Some(said(Some(5000), Some(4999), Some(whole(ms(700))))),
            ),
            (
                &[
                    ("date", EPOCH_DATE),
                    ("x-ratelimit-limit", "100, 100;w=60"),
                    ("x-ratelimit-remaining", "0"),
                    ("x-ratelimit-reset", "60"),
                ],
                Some(said(
                    Some(100),
                    Some(0),
                    Some(whole(Duration::from_secs(60))),
                )),
            ),
            // Milliseconds are read to the millisecond.
            (
                &[
                    ("x-ratelimit-remaining", "3"),
                    ("x-ratelimit-reset", "1700000000750"),
                ],
                Some(said(
                    None,
                    Some(3),
                    Some(Reset {
                        after: ms(450),
                        resolution: ms(1),
                    }),
                )),
            ),
            (
                &[("ratelimit-limit", "10"), ("ratelimit-reset", "3")],
                Some(said(Some(10), None, Some(whole(Duration::from_secs(3))))),
            ),
            (
                &[("x-ratelimit-limit", "5")],
                Some(said(Some(5), None, None)),
            ),
            (
                &[("x-ratelimit-limit", "many"), ("x-ratelimit-reset", "1")],
                None,
            ),
            (
                &[(
                    "ratelimit-policy",
                    r#""burst";q=100;w=60, "day";q=1000;w=86400"#,
                )],
                Some(policy(1000, 86400, None, None)),
            ),
            // The current IETF form: the policy's own member of RateLimit.
            (
                &[
                    ("ratelimit-policy", r#""default";q=5;w=1"#),
                    ("ratelimit", r#""other";r=0;t=9, "default";r=3;t=1"#),
                ],
                Some(policy(5, 1, Some(3), Some(1))),
            ),
            // The older dictionary form.
            (
                &[("ratelimit", "limit=10, remaining=4, reset=7")],
                Some(said(Some(10), Some(4), Some(whole(Duration::from_secs(7))))),
            ),
            (
                &[
                    ("ratelimit-policy", r#""default";q=5;w=1"#),
                    ("x-ratelimit-limit", "100"),
                    ("x-ratelimit-reset", "1"),
                ],
                Some(Announcement {
                    quota: Some(5),
                    window: Some(Duration::from_secs(1)),
                    remaining: None,
                    reset: Some(whole(Duration::from_secs(1))),
                }),
            ),
            (&[("ratelimit-policy", r#""default";q=0;w=1"#)], None),
        ];
        for (pairs, want) in cases {
            assert_eq!(announced(&headers(pairs), now), *want, "{pairs:?}");
        }
    }

    #[test]
    fn a_unix_reset_is_read_to_the_fraction_when_the_clocks_agree() {
        // The window reopens at EPOCH + 1; the Date header says EPOCH, and our clock is
        // 0.8 s into that second: 0.2 s, not a whole second.
        let reset = (EPOCH + 1).to_string();
        let h = headers(&[
            ("date", EPOCH_DATE),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &reset),
        ]);
        let now = at(EPOCH) + Duration::from_millis(800);
        assert_eq!(pause_hint(&h, now, MAX), Some(Duration::from_millis(200)));
    }

    #[test]
    fn reset_as_epoch_seconds_reads_against_date_header() {
        // GitHub style. Our clock is an hour fast; the upstream's Date header is the
        // reference, so the pause is the 45 s the upstream meant.
        let reset = (EPOCH + 45).to_string();
        let h = headers(&[
            ("date", EPOCH_DATE),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &reset),
        ]);
        assert_eq!(pause_hint(&h, at(EPOCH + 3600), MAX), secs(45));
        assert_eq!(pause_hint(&h, at(EPOCH - 3600), MAX), secs(45));
    }

    #[test]
    fn reset_as_epoch_seconds_without_date_reads_against_now() {
        let reset = (EPOCH + 45).to_string();
        let h = headers(&[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &reset),
        ]);
        assert_eq!(pause_hint(&h, at(EPOCH), MAX), secs(45));
        assert_eq!(pause_hint(&h, at(EPOCH + 40), MAX), secs(5));
        // An unparseable Date header is ignored too.
        let h = headers(&[
            ("date", "now"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &reset),
        ]);
        assert_eq!(pause_hint(&h, at(EPOCH), MAX), secs(45));
    }

    #[test]
    fn reset_as_epoch_in_the_past_is_zero() {
        let reset = (EPOCH - 10).to_string();
        let h = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &reset),
        ];
        assert_eq!(hint(&h), secs(0));
    }

    #[test]
    fn reset_as_epoch_milliseconds() {
        let reset = ((EPOCH + 20) * 1000 + 500).to_string();
        let h = [
            ("date", EPOCH_DATE),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &reset),
        ];
        assert_eq!(hint(&h), Some(Duration::from_millis(20_500)));
    }

    #[test]
    fn large_epochs_are_capped_never_overflow() {
        for reset in [
            "99999999999",          // year 5138, seconds
            "999999999999",         // year 33658, the largest read as seconds
            "18446744073709551615", // u64::MAX, milliseconds
            "99999999999999999999999999999999",
        ] {
            let h = [("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", reset)];
            assert_eq!(hint(&h), Some(MAX), "{reset}");
            let h = headers(&h);
            assert!(
                pause_hint(&h, at(EPOCH), Duration::MAX).is_some(),
                "{reset}"
            );
        }
    }

    #[test]
    fn one_year_is_the_delta_epoch_boundary() {
        let h = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "31536000"),
        ];
        let h = headers(&h);
        assert_eq!(pause_hint(&h, at(EPOCH), Duration::MAX), secs(DELTA_MAX));
        // One more and it is a timestamp in January 1971: long past.
        let h = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "31536001"),
        ];
        let h = headers(&h);
        assert_eq!(pause_hint(&h, at(EPOCH), Duration::MAX), secs(0));
    }

    #[test]
    fn fractional_reset() {
        let h = [("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1.5")];
        assert_eq!(hint(&h), Some(Duration::from_millis(1500)));
        let reset = format!("{}.25", EPOCH + 2);
        let h = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &reset),
        ];
        assert_eq!(hint(&h), Some(Duration::from_millis(2250)));
        let h = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "0.1234567891234"),
        ];
        assert_eq!(hint(&h), Some(Duration::from_nanos(123_456_789)));
    }

    #[test]
    fn reset_as_http_date() {
        let h = [
            ("date", EPOCH_DATE),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "Tue, 14 Nov 2023 22:14:00 GMT"),
        ];
        assert_eq!(hint(&h), secs(40));
    }

    #[test]
    fn unprefixed_spelling() {
        // Early IETF drafts: delta seconds. GitLab: epoch seconds.
        let h = [("ratelimit-remaining", "0"), ("ratelimit-reset", "12")];
        assert_eq!(hint(&h), secs(12));
        let reset = (EPOCH + 60).to_string();
        let h = [("ratelimit-remaining", "0"), ("ratelimit-reset", &reset)];
        assert_eq!(hint(&h), secs(60));
    }

    #[test]
    fn everything_is_capped() {
        let h = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "3600"),
        ];
        assert_eq!(hint(&h), Some(MAX));
        assert_eq!(hint(&[("ratelimit", r#""p";r=0;t=86400"#)]), Some(MAX));
        let h = [("ratelimit", "limit=1, remaining=0, reset=86400")];
        assert_eq!(hint(&h), Some(MAX));
        let h = headers(&[("ratelimit", r#""p";r=0;t=5"#)]);
        assert_eq!(pause_hint(&h, at(EPOCH), Duration::ZERO), secs(0));
    }

    #[test]
    fn legacy_garbage() {
        for (remaining, reset) in [
            ("", "30"),
            ("none", "30"),
            ("-1", "30"),
            ("0.0", "30"),
            ("0, 0", "30"),
            ("0", ""),
            ("0", "-30"),
            ("0", "30s"),
            ("0", "1."),
            ("0", ".5"),
            ("0", "1.2.3"),
            ("0", "1e3"),
        ] {
            let h = [
                ("x-ratelimit-remaining", remaining),
                ("x-ratelimit-reset", reset),
            ];
            assert_eq!(hint(&h), None, "{remaining:?} {reset:?}");
        }
        // Bytes that are not visible ASCII (obs-text) cannot be read at all.
        let mut h = headers(&[("x-ratelimit-remaining", "0")]);
        h.insert(
            "x-ratelimit-reset",
            HeaderValue::from_bytes(b"3\xff").unwrap(),
        );
        assert_eq!(pause_hint(&h, at(EPOCH), MAX), None);
    }

    #[test]
    fn ietf_current_form() {
        let h = [
            ("ratelimit", r#""default";r=0;t=30"#),
            ("ratelimit-policy", r#""default";q=100;w=60"#),
        ];
        assert_eq!(hint(&h), secs(30));
        let h = [
            ("ratelimit", r#""default";r=50;t=30"#),
            ("ratelimit-policy", r#""default";q=100;w=60"#),
        ];
        assert_eq!(hint(&h), None);
        // Spaces where RFC 8941 allows them, and where it does not but no harm is done.
        assert_eq!(
            hint(&[("ratelimit", r#"  "default"; r=0; t=30  "#)]),
            secs(30)
        );
        assert_eq!(hint(&[("ratelimit", r#""default" ;r=0 ;t=30"#)]), secs(30));
        // A token name instead of a string, and other parameters, are fine.
        let h = [(
            "ratelimit",
            r#"default;r=0;t=7;pk=:cHsdsRa894==:;x="y";z=?1"#,
        )];
        assert_eq!(hint(&h), secs(7));
    }

    #[test]
    fn ietf_multiple_policies() {
        let both = r#""burst";r=0;t=10, "daily";r=0;t=100"#;
        assert_eq!(hint(&[("ratelimit", both)]), secs(100));
        // Only spent policies count, however long the others' resets are.
        let one = r#""burst";r=0;t=10, "daily";r=500;t=50000"#;
        assert_eq!(hint(&[("ratelimit", one)]), secs(10));
        let none = r#""burst";r=3;t=10, "daily";r=500;t=50000"#;
        assert_eq!(hint(&[("ratelimit", none)]), None);
        // Several field lines are one list.
        let h = [
            ("ratelimit", r#""burst";r=0;t=10"#),
            ("ratelimit", r#""daily";r=0;t=20"#),
        ];
        assert_eq!(hint(&h), secs(20));
        // A member without `r` says nothing.
        let h = [("ratelimit", r#""other";q=5, "burst";r=0;t=10"#)];
        assert_eq!(hint(&h), secs(10));
    }

    #[test]
    fn ietf_missing_t_uses_the_policy_window() {
        let policy = r#""burst";q=10;w=1, "daily";q=1000;w=86400"#;
        let h = [
            ("ratelimit", r#""burst";r=0"#),
            ("ratelimit-policy", policy),
        ];
        assert_eq!(hint(&h), secs(1));
        let h = [
            ("ratelimit", r#""daily";r=0"#),
            ("ratelimit-policy", policy),
        ];
        assert_eq!(hint(&h), Some(MAX));
        // No policy of that name, no policy field, or a malformed one: no reset known.
        let h = [
            ("ratelimit", r#""hourly";r=0"#),
            ("ratelimit-policy", policy),
        ];
        assert_eq!(hint(&h), None);
        assert_eq!(hint(&[("ratelimit", r#""burst";r=0"#)]), None);
        let h = [
            ("ratelimit", r#""burst";r=0"#),
            ("ratelimit-policy", "\"burst"),
        ];
        assert_eq!(hint(&h), None);
    }

    #[test]
    fn ietf_names_may_hold_separators() {
        let h = [
            ("ratelimit", r#""a, b;c \"d\" \\";r=0"#),
            ("ratelimit-policy", r#""x", "a, b;c \"d\" \\";q=5;w=9"#),
        ];
        assert_eq!(hint(&h), secs(9));
    }

    #[test]
    fn ietf_older_dictionary_form() {
        let h = [("ratelimit", "limit=100, remaining=0, reset=30")];
        assert_eq!(hint(&h), secs(30));
        let h = [("ratelimit", "limit=100;w=60, remaining=0, reset=30")];
        assert_eq!(hint(&h), secs(30));
        let h = [("ratelimit", "limit=100, remaining=1, reset=30")];
        assert_eq!(hint(&h), None);
        let h = [("ratelimit", "limit=100, remaining=0")];
        assert_eq!(hint(&h), None);
        // The last of a repeated key counts.
        let h = [("ratelimit", "remaining=5, reset=30, remaining=0")];
        assert_eq!(hint(&h), secs(30));
    }

    #[test]
    fn ietf_malformed() {
        for value in [
            "",
            " ",
            ",",
            r#""default";r=0;t=30,"#,
            r#""default";r=0;t=-5"#,
            r#""default";r=-1;t=5"#,
            r#""default";r=0;t=1.5"#,
            r#""default";r=0.0;t=5"#,
            r#""default";r=0;t="5""#,
            r#""default";r=0;t="#,
            r#""default";r=0;t=1234567890123456"#,
            r#""default";r=0;=5"#,
            r#""default;r=0;t=5"#,
            r#""default";r=0;t=5 "x""#,
            r#""bad\escape";r=0;t=5"#,
            "(\"a\" \"b\");r=0;t=5",
            r#""default";r=0;t=5;pk=:abc"#,
            r#""default";r=0;t=5;flag=?2"#,
            "remaining=0, reset=-3",
            "remaining=0, reset=3.0",
            "remaining=0 reset=3",
            "\u{7f}",
        ] {
            let mut h = HeaderMap::new();
            let Ok(v) = HeaderValue::from_str(value) else {
                continue;
            };
            h.insert(RATELIMIT, v);
            assert_eq!(pause_hint(&h, at(EPOCH), MAX), None, "{value:?}");
        }
    }

    #[test]
    fn longest_family_wins() {
        let h = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "10"),
            ("ratelimit-remaining", "0"),
            ("ratelimit-reset", "5"),
            ("ratelimit", r#""p";r=0;t=20"#),
        ];
        assert_eq!(hint(&h), secs(20));
        // A malformed family does not hide a good one.
        let h = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "10"),
            ("ratelimit", r#""p";r=0;t=-1"#),
        ];
        assert_eq!(hint(&h), secs(10));
    }

    #[test]
    fn every_prefix_of_valid_fields_is_safe() {
        // A poor man's fuzz run inside the unit tests: truncation is the most common
        // way a real header goes wrong.
        for full in [
            r#""burst";r=0;t=10;pk=:cHsdsRa894==:, "daily";r=0;t=100;x=?1;y=1.5;z=tok/en"#,
            "limit=100;w=60, remaining=0, reset=30",
        ] {
            for end in 0..=full.len() {
                let h = headers(&[
                    ("ratelimit", &full[..end]),
                    ("ratelimit-policy", &full[..end]),
                    ("x-ratelimit-remaining", "0"),
                    ("x-ratelimit-reset", &full[..end]),
                ]);
                if let Some(d) = pause_hint(&h, at(EPOCH), MAX) {
                    assert!(d <= MAX);
                }
            }
        }
    }
}
