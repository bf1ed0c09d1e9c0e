//! The budget a group learns from its upstream: what the upstream announces, what its
//! refusals reveal, and a small AIMD step when it refuses a request that was paced.
//!
//! The learned rate joins the group's rates ([`super::rate::Rates::set_learned`]) like
//! one more configured rate, so it only matters when it is the slowest: when the
//! operator gave no rate, or a higher one than the upstream allows. Three sources, the
//! best known wins:
//!
//! * **announced** — `RateLimit-Policy: "p";q=100;w=60` says the quota and window
//!   outright; `X-RateLimit-Limit` (or `RateLimit-Limit`) gives the quota, and the
//!   window is the longest time to `Reset` seen so far, rounded up to a whole second
//!   (a window starts with a full time to reset, and windows are whole seconds);
//! * **refusals** — an upstream that says nothing about its budget still shows it: the
//!   requests it accepted since the last pause, over the time from the first of them
//!   to the end of the pause its refusal asks for, is the rate it let through;
//! * a refusal of a request that was already **paced** means "slightly too fast": the
//!   rate steps down by [`STEP_DOWN`] once per episode and climbs back by [`CLIMB`] of
//!   the learned rate per calm second, never above it.
//!
//! Every learned rate is spent at [`MARGIN`] of itself: a window that allows exactly
//! `q` requests, paced at exactly `q / w` with a millisecond of jitter, would see
//! `q + 1` now and then. The decisions are pure; the caller passes the time in.

use std::time::Duration;

use tokio::time::Instant;

/// The share of a learned rate that is spent: enough room that jitter of a few
/// milliseconds never puts one request too many in a window.
pub const MARGIN: f64 = 0.98;
/// A refusal of a paced request lowers the learned rate to this fraction of the pace.
pub const STEP_DOWN: f64 = 0.95;
/// Each calm interval without a refusal climbs back by this fraction of the rate
/// learned before the step-downs.
pub const CLIMB: f64 = 0.01;
/// A step down and a climb are this far apart at least; so are two step-downs (one
/// overload answers several requests in flight at once).
pub const CALM: Duration = Duration::from_secs(1);
/// Fewer accepted answers than this before a refusal say too little to learn from.
const MIN_SAMPLE: u32 = 2;

/// Where the learned rate comes from, as shown in `/status` and the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// `RateLimit-Policy` (IETF): quota and window.
    RatelimitPolicy,
    /// `X-RateLimit-Limit` or `RateLimit-Limit` with the time to `Reset`.
    LimitAndReset,
    /// What the upstream accepted before it refused.
    Refusals,
}

impl Source {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::RatelimitPolicy => "ratelimit-policy",
            Source::LimitAndReset => "limit-and-reset",
            Source::Refusals => "refusals",
        }
    }
}

/// A budget an upstream announced on one response.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Announced {
    /// Requests per window.
    pub quota: u64,
    /// The window, when the upstream says it (`w`).
    pub window: Option<Duration>,
    /// The time until the window resets, when it says that instead.
    pub reset: Option<Duration>,
    /// Which headers said it.
    pub source: Source,
}

/// What a group has learned about its upstream's budget.
#[derive(Debug, Clone)]
pub struct Learner {
    /// The learned rate before margin and steps, per second, and where it comes from.
    base: Option<(f64, Source)>,
    /// The longest time to reset seen with a quota but no window.
    window: Duration,
    /// The fraction of `base` in force after step-downs.
    factor: f64,
    changed: Instant,
    stepped_at: Option<Instant>,
    /// Accepted answers since the last refusal episode ended, and when the first of
    /// them came.
    accepted: u32,
    first_accepted: Option<Instant>,
    /// The refusal episode in force: until its pause ends, and whether its sample set
    /// the learned rate (then later refusals of the same episode refine it).
    episode: Option<(Instant, bool)>,
}

impl Learner {
    /// Nothing learned yet, as of `now`.
    pub fn new(now: Instant) -> Learner {
        Learner {
            base: None,
            window: Duration::ZERO,
            factor: 1.0,
            changed: now,
            stepped_at: None,
            accepted: 0,
            first_accepted: None,
            episode: None,
        }
    }

    /// The rate to pace at, per second, and its source; `None` until something is
    /// learned.
    pub fn rate(&self) -> Option<(f64, Source)> {
        self.base
            .map(|(rate, source)| (rate * self.factor * MARGIN, source))
    }

    /// The rate the upstream announced (quota / window), if it did.
    pub fn announced_rate(&self) -> Option<f64> {
        self.base
            .filter(|(_, source)| *source != Source::Refusals)
            .map(|(rate, _)| rate)
    }

    /// A response announced a budget. Returns whether the learned rate moved.
    pub fn announced(&mut self, budget: Announced) -> bool {
        let window = match (budget.window, budget.reset) {
            (Some(w), _) if !w.is_zero() => w,
            (_, Some(reset)) => {
                let whole =
                    Duration::from_secs(reset.as_secs() + u64::from(reset.subsec_nanos() > 0));
                self.window = self.window.max(whole);
                self.window
            }
            _ => return false,
        };
        if window.is_zero() || budget.quota == 0 {
            return false;
        }
        let rate = budget.quota as f64 / window.as_secs_f64();
        // An announced budget outranks one guessed from refusals, and is replaced by a
        // newer announcement (the upstream may change its plan).
        let moved = self.base != Some((rate, budget.source));
        if moved {
            self.base = Some((rate, budget.source));
            self.factor = 1.0;
        }
        moved
    }

    /// The upstream answered normally at `now`.
    pub fn accepted(&mut self, now: Instant) {
        // Answers after an episode's pause belong to the next sample; those before it
        // (in flight when the refusal came) to this one.
        if self.episode.is_some_and(|(end, _)| now >= end) {
            self.episode = None;
            self.accepted = 0;
            self.first_accepted = None;
        }
        self.accepted = self.accepted.saturating_add(1);
        self.first_accepted.get_or_insert(now);
    }

    /// The upstream refused a request at `now` and asks for `pause`; `pace` is the
    /// rate the group was held to (per second), if any. Returns whether the learned
    /// rate moved.
    ///
    /// One overload answers a burst with a refusal each, and the accepted answers of
    /// that burst may come after the first refusal: the refusals until the pause ends
    /// are one episode, and its sample (the accepted answers before and during it) is
    /// read again at each, so the estimate does not depend on the order of answers.
    pub fn refused(&mut self, now: Instant, pause: Duration, pace: Option<f64>) -> bool {
        let before = self.rate();
        let (end, may_learn, new) = match self.episode {
            Some((end, may_learn)) if now < end => ((now + pause).max(end), may_learn, false),
            _ => {
                let announced = self.base.is_some_and(|(_, s)| s != Source::Refusals);
                (now + pause, !announced, true)
            }
        };
        let seen = match (self.accepted, self.first_accepted) {
            (n, Some(first)) if n >= MIN_SAMPLE => {
                let span = (end - first).as_secs_f64();
                (span > 0.0).then(|| f64::from(n) / span)
            }
            _ => None,
        };
        // What it let through says nothing new when it announced its budget.
        let too_fast = |pace: f64| !may_learn || seen.is_none_or(|seen| seen >= pace * STEP_DOWN);
        let may_learn = match pace {
            // Refused while paced at about what it let through: "slightly too fast".
            Some(pace) if new && too_fast(pace) => {
                self.step_down(now, pace);
                false
            }
            _ => may_learn,
        };
        if let (Some(seen), true) = (seen, may_learn) {
            self.base = Some((seen / MARGIN, Source::Refusals));
            self.factor = 1.0;
            self.changed = now;
            self.stepped_at = Some(now);
        }
        self.episode = Some((end, may_learn));
        self.rate() != before
    }

    /// Lowers the rate in force to [`STEP_DOWN`] of `pace`, once per episode.
    fn step_down(&mut self, now: Instant, pace: f64) {
        if self.stepped_at.is_some_and(|at| now - at < CALM) {
            return;
        }
        self.stepped_at = Some(now);
        self.changed = now;
        let target = pace * STEP_DOWN;
        match self.base {
            Some((base, _)) if base > 0.0 => {
                self.factor = (target / (base * MARGIN)).min(self.factor * STEP_DOWN);
            }
            _ => {
                self.base = Some((pace / MARGIN, Source::Refusals));
                self.factor = STEP_DOWN;
            }
        }
        self.factor = self.factor.clamp(0.01, 1.0);
    }

    /// A request departs at `now`: after a calm interval the rate climbs one step.
    /// Returns whether the learned rate moved.
    pub fn departed(&mut self, now: Instant) -> bool {
        if self.factor >= 1.0 || now - self.changed < CALM {
            return false;
        }
        self.factor = (self.factor + CLIMB).min(1.0);
        self.changed = now;
        true
    }
}

/// Whether a spent budget (`Remaining: 0`, reset in `pause`) should pause a group
/// whose slowest rate paces it one request per `pace`, under an `announced` budget of
/// that many requests per second.
///
/// The last request of a window sees `Remaining: 0`. When the group's pace keeps it
/// inside the announced budget and the window reopens before its next slot, the pause
/// would hold nobody, or, read a little late, stall the group past the window it is
/// entitled to: it does not pause. Any other spent budget (another client shares it,
/// a burst spent it early, or nothing says the pace fits) pauses.
pub fn spent_budget_pauses(
    pause: Duration,
    pace: Option<Duration>,
    announced: Option<f64>,
) -> bool {
    let fits =
        |pace: Duration, announced: f64| 1.0 / pace.as_secs_f64() <= announced * (1.0 + 1e-9);
    match (pace, announced) {
        (Some(pace), Some(announced)) => !(pause <= pace && fits(pace, announced)),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);

    fn x(quota: u64, reset_ms: u64) -> Announced {
        Announced {
            quota,
            window: None,
            reset: Some(MS * reset_ms as u32),
            source: Source::LimitAndReset,
        }
    }

    fn rate(l: &Learner) -> Option<f64> {
        l.rate().map(|(r, _)| (r * 1000.0).round() / 1000.0)
    }

    #[test]
    fn a_spent_budget_pauses_unless_the_pace_already_keeps_to_it() {
        let ms = |n| Some(MS * n);
        // (pause, the group's pace, the announced rate per second, pauses)
        let cases = [
            (MS * 150, ms(200), Some(5.0), false),
            (MS * 200, ms(200), Some(5.0), false),
            (MS * 250, ms(200), Some(5.0), true),
            (MS * 150, ms(125), Some(5.0), true),
            (MS * 150, ms(200), None, true),
            (MS * 150, None, Some(5.0), true),
            (Duration::ZERO, None, None, true),
        ];
        for (pause, pace, announced, want) in cases {
            assert_eq!(
                spent_budget_pauses(pause, pace, announced),
                want,
                "{pause:?} {pace:?} {announced:?}"
            );
        }
    }

    #[test]
    fn the_accepted_answers_of_a_burst_count_whatever_their_order() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        // 30 sent at once: one refusal comes back first, then the five accepted, then
        // the other refusals. The sample is read again within the episode.
        l.refused(t0 + MS, S, None);
        assert_eq!(l.rate(), None);
        for _ in 0..5 {
            l.accepted(t0 + MS * 2);
        }
        for _ in 0..24 {
            l.refused(t0 + MS * 3, S, None);
        }
        assert_eq!(rate(&l), Some(4.995));
        // After the pause, accepted answers start a new sample.
        l.accepted(t0 + S * 2);
        assert_eq!(l.accepted, 1);
    }

    #[test]
    fn announced_budgets() {
        // (announcements in order, the rate in force after them)
        let policy = |q, w| Announced {
            quota: q,
            window: Some(S * w),
            reset: None,
            source: Source::RatelimitPolicy,
        };
        let cases: &[(&[Announced], Option<f64>)] = &[
            (&[], None),
            (&[policy(100, 60)], Some(100.0 / 60.0 * MARGIN)),
            // A Unix reset 0.3 s away: a window of one whole second.
            (&[x(5, 300)], Some(5.0 * MARGIN)),
            // The longest time to reset seen is the window.
            (&[x(60, 20_000), x(60, 59_100), x(60, 3_000)], Some(MARGIN)),
            (&[x(0, 1000)], None),
            (
                &[Announced {
                    reset: None,
                    ..x(5, 0)
                }],
                None,
            ),
        ];
        for (seen, want) in cases {
            let mut l = Learner::new(Instant::now());
            for a in *seen {
                l.announced(*a);
            }
            assert_eq!(
                rate(&l),
                want.map(|w| (w * 1000.0).round() / 1000.0),
                "{seen:?}"
            );
        }
    }

    #[test]
    fn refusals_reveal_what_the_upstream_let_through() {
        let t0 = Instant::now();
        // 5 accepted at once, then 25 refused with Retry-After: 1 — 5 per second.
        let mut l = Learner::new(t0);
        for _ in 0..5 {
            l.accepted(t0);
        }
        assert!(l.refused(t0 + MS, S, None));
        assert_eq!(l.rate().unwrap().1, Source::Refusals);
        assert_eq!(rate(&l), Some(4.995));
        // The other refusals of that burst come with no new acceptance: the same.
        l.refused(t0 + MS * 2, S, None);
        assert_eq!(rate(&l), Some(4.99));
        // One acceptance says too little.
        let mut l = Learner::new(t0);
        l.accepted(t0);
        assert!(!l.refused(t0, S, None));
        assert_eq!(l.rate(), None);
    }

    #[test]
    fn a_paced_refusal_steps_down_once_per_episode_and_climbs_back_when_calm() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        // Paced at 10/s by the operator, accepted at that pace for 10 s: the pace was
        // not too far off, so only a step.
        for i in 0..100 {
            l.accepted(t0 + MS * (100 * i));
        }
        assert!(l.refused(t0 + S * 10, Duration::ZERO, Some(10.0)));
        assert_eq!(rate(&l), Some(9.5));
        assert!(!l.refused(t0 + S * 10 + MS * 500, Duration::ZERO, Some(9.5)));
        assert!(l.refused(t0 + S * 11, Duration::ZERO, Some(9.5)));
        assert_eq!(rate(&l), Some(9.025));
        // Calm seconds with traffic climb back 1 % of the base each, up to the base.
        for s in 12..=200 {
            l.departed(t0 + S * s);
        }
        assert_eq!(rate(&l), Some(10.0));
    }

    #[test]
    fn an_announced_budget_is_not_replaced_by_refusals_but_steps_down() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        l.announced(x(5, 1000));
        for _ in 0..3 {
            l.accepted(t0);
        }
        l.refused(t0, S, Some(4.9));
        let (r, source) = l.rate().unwrap();
        assert_eq!(source, Source::LimitAndReset);
        assert!((r - 4.9 * STEP_DOWN).abs() < 1e-9, "{r}");
    }
}
