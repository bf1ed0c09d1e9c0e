//! The announced window, spent as a budget ("windowed" in docs/budget.md): a request
//! may leave while the group's own departures and the upstream's last word both leave
//! room in it.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::{Announcement, Params};

/// The most departures a group keeps: its quota's worth, within these bounds. A quota
/// above the cap is still kept to through the upstream's last word.
const LOG_MIN: usize = 64;
const LOG_MAX: usize = 10_000;

/// The group's last departures, oldest first.
#[derive(Debug, Default)]
pub(super) struct Log {
    times: VecDeque<Instant>,
    cap: usize,
}

impl Log {
    pub(super) fn push(&mut self, at: Instant) {
        if self.times.len() >= self.cap.max(LOG_MIN) {
            self.times.pop_front();
        }
        self.times.push_back(at);
    }

    /// Keeps at least `quota` departures from now on (within the bounds).
    fn keep(&mut self, quota: u64) {
        self.cap = usize::try_from(quota).unwrap_or(LOG_MAX).min(LOG_MAX);
    }

    /// Departures after `t`.
    pub(super) fn after(&self, t: Instant) -> u64 {
        (self.times.len() - self.times.partition_point(|at| *at <= t)) as u64
    }

    /// How many departures are kept.
    fn len(&self) -> u64 {
        self.times.len() as u64
    }

    /// The `n`-th most recent departure (1: the last), if kept.
    fn newest(&self, n: usize) -> Option<Instant> {
        let len = self.times.len();
        (n >= 1 && n <= len).then(|| self.times[len - n])
    }
}

/// What the upstream last said of its window, on the answer to the request that left
/// last among those answered.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Said {
    remaining: u64,
    /// When the request it answered left.
    sent: Instant,
    /// When it said the window resets.
    reset: Option<Instant>,
    /// The first request the group knows this window counted: the window ends at most
    /// its length after that one left.
    first: Instant,
}

/// An announced window.
#[derive(Debug)]
pub(super) struct Window {
    quota: Option<u64>,
    /// Its length: announced (`exact`), or read from resets.
    length: Option<Duration>,
    exact: bool,
    /// The resolution of the resets read: 1 s for whole seconds.
    resolution: Duration,
    /// The longest time from a request's departure to the reset its answer stated.
    longest: Duration,
    said: Option<Said>,
}

impl Window {
    pub(super) fn new() -> Window {
        Window {
            quota: None,
            length: None,
            exact: false,
            resolution: Duration::ZERO,
            longest: Duration::ZERO,
            said: None,
        }
    }

    /// The quota per window and the window's length, when both are known.
    pub(super) fn budget(&self) -> Option<(u64, Duration)> {
        Some((self.quota?, self.length?))
    }

    /// What the upstream said last: its remaining quota.
    pub(super) fn remaining(&self) -> Option<u64> {
        self.said.map(|s| s.remaining)
    }

    /// The time a window takes, lengthened by the margin: jitter between departures
    /// and arrivals must not put a request of one window into the previous one.
    fn span(&self, params: &Params) -> Option<Duration> {
        self.length.map(|w| w.div_f64(params.margin))
    }

    /// Until when the upstream's last word holds: its reset, or a span after the first
    /// request the window counted, whichever is sooner.
    fn said_until(&self, said: &Said, params: &Params) -> Option<Instant> {
        let by_departures = self.span(params).map(|span| said.first + span);
        match (said.reset, by_departures) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// When a request may leave, if not now: `own` says whether the group's own
    /// departures are counted here (not when a shared store counts them), `share` is
    /// this replica's part of what the upstream says remains.
    pub(super) fn opens(
        &self,
        log: &Log,
        now: Instant,
        params: &Params,
        own: bool,
        share: f64,
        trusted: bool,
    ) -> Option<Instant> {
        let mut at = now;
        if let (true, Some((quota, _)), Some(span)) = (own, self.budget(), self.span(params)) {
            let oldest = usize::try_from(quota).ok().and_then(|q| log.newest(q));
            if let Some(oldest) = oldest.filter(|_| quota as usize <= LOG_MAX) {
                at = at.max(oldest + span);
            }
        }
        let said = self
            .said
            .filter(|s| trusted && !(own && self.ours(s, log, params)));
        if let Some(said) = said {
            let until = self.said_until(&said, params);
            let left = (said.remaining as f64 * share).floor() as u64;
            if let Some(until) = until.filter(|u| *u > now && left <= log.after(said.sent)) {
                at = at.max(until);
            }
        }
        (at > now).then_some(at)
    }

    /// Whether the group's own departures explain what the upstream counted in its
    /// window when it said `said`: as many of them left within a span before it. Then
    /// the group's departures say when the window has room again, more finely than a
    /// reset in whole seconds, or than a sliding window's reset (when all of it is
    /// clear); else others spend the window too, and the upstream's word holds.
    fn ours(&self, said: &Said, log: &Log, params: &Params) -> bool {
        let (Some((quota, _)), Some(span)) = (self.budget(), self.span(params)) else {
            return false;
        };
        let counted = quota.saturating_sub(said.remaining);
        let since = said.sent.checked_sub(span);
        let ours = since.map_or(log.len(), |since| log.after(since)) - log.after(said.sent);
        ours >= counted
    }

    /// The rate of the window's budget, per second.
    pub(super) fn rate(&self) -> Option<f64> {
        let (quota, length) = self.budget()?;
        (!length.is_zero()).then(|| quota as f64 / length.as_secs_f64())
    }

    /// An answer to a request that left at `sent` announced `a` at `now`. Returns
    /// whether anything changed.
    pub(super) fn announced(
        &mut self,
        a: &Announcement,
        sent: Instant,
        now: Instant,
        log: &Log,
    ) -> bool {
        let before = (self.quota, self.length, self.said);
        if let Some(quota) = a.quota.filter(|q| *q > 0) {
            self.quota = Some(quota);
        }
        let reset = a.reset.map(|r| now + r.after);
        if let Some(r) = a.reset {
            self.resolution = self.resolution.max(r.resolution);
        }
        match (a.window.filter(|w| !w.is_zero()), a.reset) {
            (Some(w), _) => {
                self.length = Some(w);
                self.exact = true;
            }
            (None, Some(r)) if !self.exact => {
                self.longest = self.longest.max(now + r.after - sent);
                let read = read_length(self.longest, self.resolution);
                self.length = Some(self.length.map_or(read, |l| l.max(read)));
            }
            _ => {}
        }
        if let Some(remaining) = a.remaining {
            self.heard(remaining, sent, reset, log);
        }
        (self.quota, self.length, self.said) != before
    }

    /// The upstream said `remaining` on the answer to the request that left at `sent`.
    fn heard(&mut self, remaining: u64, sent: Instant, reset: Option<Instant>, log: &Log) {
        let said = Said {
            remaining,
            sent,
            reset,
            first: sent,
        };
        let Some(last) = self.said else {
            self.said = Some(said);
            return;
        };
        let tolerance = self.resolution.max(Duration::from_millis(1));
        let same_reset = match (reset, last.reset) {
            (Some(a), Some(b)) => a <= b + tolerance && b <= a + tolerance,
            _ => true,
        };
        if sent < last.sent {
            // An earlier request, answered late: it can only show the window began
            // sooner.
            if same_reset {
                self.said = Some(Said {
                    first: last.first.min(sent),
                    ..last
                });
            }
            return;
        }
        // The upstream's count only grows within a window: more left than the group's
        // departures since allow means the window reset in between.
        let expected = last
            .remaining
            .saturating_sub(log.after(last.sent) - log.after(sent));
        let refilled = remaining > expected
            || reset
                .zip(last.reset)
                .is_some_and(|(a, b)| a > b + tolerance);
        self.said = Some(Said {
            first: if refilled { sent } else { last.first },
            ..said
        });
    }

    /// A request that left at `sent` was refused. Returns whether that shows the window
    /// read from resets is too short: it left after the window was thought over, but
    /// before the reset the upstream stated. The window then grows by one resolution.
    pub(super) fn refused(&mut self, sent: Instant, params: &Params) -> bool {
        let Some(said) = self.said.filter(|s| !self.exact && s.sent < sent) else {
            return false;
        };
        let (Some(until), Some(reset), Some(length)) =
            (self.said_until(&said, params), said.reset, self.length)
        else {
            return false;
        };
        let early = until <= sent && sent < reset;
        if early {
            self.length = Some(length + self.resolution);
        }
        early
    }

    /// Keeps enough of the group's departures to count its quota.
    pub(super) fn size(&self, log: &mut Log) {
        if let Some(quota) = self.quota {
            log.keep(quota);
        }
    }
}

/// A window read from the longest time to a reset seen: the smallest whole multiple of
/// the resolution above `longest − resolution`, and one resolution at least.
fn read_length(longest: Duration, resolution: Duration) -> Duration {
    if resolution.is_zero() {
        return longest;
    }
    let whole = longest.saturating_sub(resolution).as_nanos() / resolution.as_nanos();
    resolution * (whole as u32 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ratelimit_headers::Reset;

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_window_is_read_as_the_whole_seconds_above_the_longest_reading_less_one() {
        // (longest time from departure to the stated reset, resolution, window)
        let cases = [
            // A reset rounded up to the next whole second, read right after the window
            // began 0.3 s into a second: 1.7 s, a window of 1 s (not 2).
            (MS * 1700, S, S),
            (MS * 1999, S, S),
            (S, S, S),
            // A clock-aligned window reached 0.4 s after it began.
            (MS * 600, S, S),
            (MS * 10_400, S, S * 10),
            (MS * 9_600, S, S * 9),
            (MS * 1000, MS, MS * 1000),
            (MS * 998, Duration::ZERO, MS * 998),
        ];
        for (longest, resolution, window) in cases {
            assert_eq!(
                read_length(longest, resolution),
                window,
                "{longest:?} {resolution:?}"
            );
        }
    }

    fn announce(quota: u64, remaining: u64, reset_ms: u64, resolution: Duration) -> Announcement {
        Announcement {
            quota: Some(quota),
            window: None,
            remaining: Some(remaining),
            reset: Some(Reset {
                after: MS * reset_ms as u32,
                resolution,
            }),
        }
    }

    #[test]
    fn a_burst_spends_what_remains_and_waits_for_the_window_its_departures_show() {
        let p = Params::default();
        let t0 = Instant::now();
        let (mut w, mut log) = (Window::new(), Log::default());
        // 5 per second, its reset rounded up: the first answer comes 0.3 s into a
        // second and says "resets at the next-but-one whole second" (1.7 s).
        log.push(t0);
        w.announced(&announce(5, 4, 1700, S), t0, t0, &log);
        w.size(&mut log);
        assert_eq!(w.budget(), Some((5, S)));
        // Four more may leave at once.
        for i in 1..=4 {
            assert_eq!(w.opens(&log, t0, &p, true, 1.0, true), None, "{i}");
            log.push(t0);
        }
        for r in (0..4).rev() {
            w.announced(&announce(5, r, 1700, S), t0, t0 + MS, &log);
        }
        // The sixth waits a window (and the margin) after the first, not 1.7 s.
        let opens = w.opens(&log, t0 + MS, &p, true, 1.0, true);
        assert_eq!(opens, Some(t0 + S.div_f64(p.margin)));
    }

    #[test]
    fn the_upstreams_last_word_holds_until_its_reset_when_others_spend_the_window() {
        let p = Params::default();
        let t0 = Instant::now();
        let (mut w, mut log) = (Window::new(), Log::default());
        // Policy: 10 per 60 s; the upstream says 0 remain, resetting in 20 s, after one
        // request of ours: others spent the rest.
        log.push(t0);
        let a = Announcement {
            quota: Some(10),
            window: Some(S * 60),
            remaining: Some(0),
            reset: Some(Reset {
                after: S * 20,
                resolution: S,
            }),
        };
        w.announced(&a, t0, t0, &log);
        assert_eq!(w.opens(&log, t0, &p, true, 1.0, true), Some(t0 + S * 20));
        // Told 3 remain: three may leave, the fourth waits.
        w.announced(
            &Announcement {
                remaining: Some(3),
                ..a
            },
            t0,
            t0,
            &log,
        );
        for _ in 0..3 {
            assert_eq!(w.opens(&log, t0, &p, true, 1.0, true), None);
            log.push(t0 + MS);
        }
        assert_eq!(
            w.opens(&log, t0 + MS, &p, true, 1.0, true),
            Some(t0 + S * 20)
        );
    }

    #[test]
    fn a_refill_starts_a_new_window_from_the_request_that_saw_it() {
        let p = Params::default();
        let t0 = Instant::now();
        let (mut w, mut log) = (Window::new(), Log::default());
        w.size(&mut log);
        log.push(t0);
        w.announced(&announce(5, 0, 1700, S), t0, t0, &log);
        // Sent 1.1 s later: 4 remain, so the window reset in between.
        let t1 = t0 + MS * 1100;
        log.push(t1);
        w.announced(&announce(5, 4, 1900, S), t1, t1, &log);
        assert_eq!(w.said.unwrap().first, t1);
        // A late answer from within the same window can only move its start earlier.
        w.announced(&announce(5, 3, 1900, S), t1 - MS, t1 + MS, &log);
        assert_eq!(w.said.unwrap().first, t1 - MS);
        assert_eq!(w.said.unwrap().remaining, 4);
        let _ = p;
    }

    #[test]
    fn a_window_read_too_short_grows_by_its_resolution_when_the_upstream_refuses() {
        let p = Params::default();
        let t0 = Instant::now();
        let (mut w, mut log) = (Window::new(), Log::default());
        // A reset truncated to whole seconds: read as 1 s, while the window is 2 s.
        log.push(t0);
        w.announced(&announce(5, 0, 1500, S), t0, t0, &log);
        assert_eq!(w.budget(), Some((5, S)));
        // Sent after the window was thought over, before the stated reset: refused.
        assert!(w.refused(t0 + MS * 1100, &p));
        assert_eq!(w.budget(), Some((5, S * 2)));
        // Sent after the stated reset: says nothing of the window's length.
        assert!(!w.refused(t0 + MS * 1600, &p));
    }
}
