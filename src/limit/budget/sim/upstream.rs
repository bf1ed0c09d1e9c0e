//! The simulator's upstreams: limiter families, the header dialects they answer in,
//! and the jitter of the way there and back.

use std::collections::VecDeque;
use std::time::Duration;

use http::Response;

/// The limiter families an upstream may use, at `r` requests per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Family {
    /// `r` per second in windows on the Unix second.
    FixedAligned,
    /// `r` per second in windows that start at the first request after the last ended.
    FixedFirstHit,
    /// At most `r` in any second.
    SlidingLog,
    /// Windows on the Unix second; the previous window's count weighs what is left of it.
    SlidingCounter,
    /// `r` per second with a burst of `r`.
    TokenBucket,
    /// One request per `1/r`, no burst.
    Strict,
    /// At most 3 requests in flight; no rate.
    Concurrency,
}

/// How the upstream says what it knows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Dialect {
    /// `X-RateLimit-*`, `Reset` in Unix seconds rounded up (express-rate-limit).
    UnixCeil,
    /// GitHub's: `x-ratelimit-*` with `-used` and `-resource`, `Reset` in Unix seconds
    /// rounded down.
    GitHub,
    /// `X-RateLimit-*`, `Reset` in seconds from now, rounded up.
    Delta,
    /// `X-RateLimit-*`, `Reset` in Unix milliseconds.
    Millis,
    /// `RateLimit-Policy` and `RateLimit` (draft 8 and later).
    Ietf,
    /// `RateLimit: limit=, remaining=, reset=` (draft 7).
    IetfDictionary,
    /// Only `Retry-After` on a refusal, in whole seconds rounded up.
    RetryAfter,
    /// A bare 429.
    Nothing,
}

/// What the group was told.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Told {
    Nothing,
    Exact,
    High,
}

/// A limiter's state.
pub(super) struct Limiter {
    family: Family,
    r: f64,
    /// Window families: the current window's index or start, and its count.
    window: (f64, u32),
    /// The previous aligned window's count (sliding counter).
    previous: u32,
    accepted: VecDeque<f64>,
    tokens: f64,
    refilled: f64,
    last: Option<f64>,
    in_flight: u32,
}

/// One decision: accepted, what remains, seconds until the window is whole again, and
/// until a request would be accepted.
pub(super) struct Decision {
    pub(super) ok: bool,
    remaining: u32,
    reset_in: f64,
    retry_in: f64,
}

impl Limiter {
    pub(super) fn new(family: Family, r: f64) -> Limiter {
        Limiter {
            family,
            r,
            window: (f64::NEG_INFINITY, 0),
            previous: 0,
            accepted: VecDeque::new(),
            tokens: r,
            refilled: 0.0,
            last: None,
            in_flight: 0,
        }
    }

    /// What its headers call the limit: the window's quota, the bucket's burst.
    pub(super) fn quota(&self) -> u32 {
        match self.family {
            Family::Concurrency => 3,
            Family::Strict => 1,
            _ => self.r as u32,
        }
    }

    /// What it allows per second, sustained: the budget's denominator. A sliding-window
    /// counter counts the request asking too, so paced evenly it admits `q − 1` a
    /// window (and every other window at `q = 1`).
    pub(super) fn allows(&self) -> f64 {
        match self.family {
            Family::SlidingCounter => (self.r - 1.0).max(self.r / 2.0),
            _ => self.r,
        }
    }

    /// The request arriving at `t` (seconds of the run; `unix` the Unix time).
    pub(super) fn decide(&mut self, t: f64, unix: f64) -> Decision {
        let q = self.quota();
        match self.family {
            Family::FixedAligned | Family::FixedFirstHit => {
                let (start, end) = match self.family {
                    Family::FixedAligned => (unix.floor(), unix.floor() + 1.0),
                    _ if t >= self.window.0 + 1.0 => (t, t + 1.0),
                    _ => (self.window.0, self.window.0 + 1.0),
                };
                if start != self.window.0 {
                    self.window = (start, 0);
                }
                let ok = self.window.1 < q;
                self.window.1 += u32::from(ok);
                let now = if self.family == Family::FixedAligned {
                    unix
                } else {
                    t
                };
                let reset_in = end - now;
                Decision {
                    ok,
                    remaining: q - self.window.1,
                    reset_in,
                    retry_in: reset_in,
                }
            }
            Family::SlidingLog => {
                while self.accepted.front().is_some_and(|a| *a <= t - 1.0) {
                    self.accepted.pop_front();
                }
                let ok = (self.accepted.len() as u32) < q;
                if ok {
                    self.accepted.push_back(t);
                }
                let oldest = self.accepted.front().copied().unwrap_or(t);
                let newest = self.accepted.back().copied().unwrap_or(t);
                Decision {
                    ok,
                    remaining: q - self.accepted.len() as u32,
                    reset_in: newest + 1.0 - t,
                    retry_in: if ok { 0.0 } else { oldest + 1.0 - t },
                }
            }
            Family::SlidingCounter => {
                let index = unix.floor();
                if index != self.window.0 {
                    self.previous = if index == self.window.0 + 1.0 {
                        self.window.1
                    } else {
                        0
                    };
                    self.window = (index, 0);
                }
                let elapsed = unix - index;
                let weighted = f64::from(self.previous) * (1.0 - elapsed);
                let ok = weighted + f64::from(self.window.1) + 1.0 <= f64::from(q);
                self.window.1 += u32::from(ok);
                let estimate = weighted + f64::from(self.window.1);
                let retry_in = match self.previous {
                    0 => 1.0 - elapsed,
                    p => ((estimate + 1.0 - f64::from(q)) / f64::from(p)).clamp(0.0, 1.0 - elapsed),
                };
                Decision {
                    ok,
                    remaining: (f64::from(q) - estimate).max(0.0) as u32,
                    reset_in: 1.0 - elapsed,
                    retry_in,
                }
            }
            Family::TokenBucket => {
                self.tokens = (self.tokens + (t - self.refilled) * self.r).min(self.r);
                self.refilled = t;
                let ok = self.tokens >= 1.0;
                if ok {
                    self.tokens -= 1.0;
                }
                Decision {
                    ok,
                    remaining: self.tokens as u32,
                    reset_in: (self.r - self.tokens) / self.r,
                    retry_in: ((1.0 - self.tokens) / self.r).max(0.0),
                }
            }
            Family::Strict => {
                let interval = 1.0 / self.r;
                let ok = self.last.is_none_or(|last| t - last >= interval);
                if ok {
                    self.last = Some(t);
                }
                let wait = self.last.map_or(0.0, |last| last + interval - t).max(0.0);
                Decision {
                    ok,
                    remaining: u32::from(wait <= 0.0),
                    reset_in: wait,
                    retry_in: wait,
                }
            }
            Family::Concurrency => {
                let ok = self.in_flight < q;
                self.in_flight += u32::from(ok);
                Decision {
                    ok,
                    remaining: q - self.in_flight,
                    reset_in: 1.0,
                    retry_in: 1.0,
                }
            }
        }
    }

    /// The answer to an accepted request left (concurrency).
    pub(super) fn answered(&mut self, ok: bool) {
        if ok && self.family == Family::Concurrency {
            self.in_flight -= 1;
        }
    }
}

/// The answer's status and headers in `dialect`.
pub(super) fn answer(
    dialect: Dialect,
    d: &Decision,
    quota: u32,
    unix: f64,
) -> Response<crate::body::Body> {
    let mut b = Response::builder().status(if d.ok { 200 } else { 429 });
    // Rounded up as a server counting in milliseconds would: 1.000 000 1 s is 1 s.
    let up = |x: f64| (x - 1e-6).max(0.0).ceil() as u64;
    let (q, r) = (quota.to_string(), d.remaining.to_string());
    let reset_at = unix + d.reset_in;
    let x = |b: http::response::Builder, reset: String| {
        b.header("x-ratelimit-limit", &q)
            .header("x-ratelimit-remaining", &r)
            .header("x-ratelimit-reset", reset)
    };
    b = match dialect {
        Dialect::UnixCeil => x(b, up(reset_at).to_string()),
        Dialect::GitHub => x(b, (reset_at.floor() as u64).to_string())
            .header(
                "x-ratelimit-used",
                (quota - d.remaining.min(quota)).to_string(),
            )
            .header("x-ratelimit-resource", "core"),
        Dialect::Delta => x(b, up(d.reset_in).to_string()),
        Dialect::Millis => x(b, ((reset_at * 1000.0).round() as u64).to_string()),
        Dialect::Ietf => b
            .header("ratelimit-policy", format!("\"default\";q={q};w=1"))
            .header(
                "ratelimit",
                format!("\"default\";r={r};t={}", up(d.reset_in)),
            ),
        Dialect::IetfDictionary => b.header(
            "ratelimit",
            format!("limit={q}, remaining={r}, reset={}", up(d.reset_in)),
        ),
        Dialect::RetryAfter | Dialect::Nothing => b,
    };
    if !d.ok && dialect != Dialect::Nothing {
        b = b.header("retry-after", up(d.retry_in).max(1).to_string());
    }
    b.body(crate::body::empty()).unwrap()
}

/// A small deterministic generator (xorshift), for jitter.
pub(super) struct Jitter(pub(super) u64);

impl Jitter {
    /// Up to 2 ms.
    pub(super) fn next(&mut self) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        Duration::from_micros(self.0 % 2001)
    }
}
