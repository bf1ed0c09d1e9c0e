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
//!   requests it accepted in the last seconds ([`HORIZON`]), over the time since the
//!   first of them (or the pause its refusal asks for, when longer: a burst answered
//!   at once), is the rate it let through. When it did not even say how long to pause
//!   (a bare `429`), that rate is only a floor, and it is probed upwards ("slow start":
//!   × [`SLOW_START`] each half calm interval, each calm interval when replicas share
//!   the budget) until a paced request is refused;
//! * a refusal of a request that was already **paced** means "slightly too fast"
//!   (AIMD): the rate steps down to [`STEP_DOWN`] of the pace, at most once per two
//!   intervals, and each calm second climbs half the way back (at least [`CLIMB`])
//!   to a ceiling: the announced rate, else [`MARGIN`] under the pace refused. A
//!   refusal after [`ISOLATED`] accepted answers or more is a request that came a
//!   little early: [`NOISE_STEP`], and back to the pace itself.
//!
//! Every learned rate is spent at [`MARGIN`] of itself: a window that allows exactly
//! `q` requests, paced at exactly `q / w` with a millisecond of jitter, would see
//! `q + 1` now and then. The decisions are pure; the caller passes the time in.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

mod refusal;
mod shared;
mod spent;
mod step;

use shared::Booking;
pub use shared::{Counted, Precedence, Shared};
pub use spent::{spent_budget_pauses, OURS_SHARE};
pub use step::{CLIMB, ISOLATED, NOISE_STEP, STEP_DOWN};

/// The share of a learned rate that is spent: enough room that jitter of a few
/// milliseconds never puts one request too many in a window.
pub const MARGIN: f64 = 0.98;
/// A step down and a climb are this far apart at least; two step-downs are two of the
/// pace's intervals apart, or this when that is shorter (one overload answers several
/// requests in flight at once).
pub const CALM: Duration = Duration::from_secs(1);

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
    /// The last budget announced: quota per window.
    budget: Option<(u64, Duration)>,
    /// The fraction of `base` in force: below 1 after step-downs; above 1 while a rate
    /// learned from bare refusals is still being probed upwards (`slow_start`).
    factor: f64,
    /// The base is only a floor (the upstream said nothing, and let through what it
    /// was offered): the rate climbs fast until the first refusal of a paced request.
    slow_start: bool,
    changed: Instant,
    stepped_at: Option<Instant>,
    /// Since when the learned rate has been in force: a refusal of a request sent
    /// before says nothing about it (the burst that taught it, typically).
    since: Option<Instant>,
    /// How many replicas share the upstream's budget: this one sees that fraction of
    /// the traffic, and what the upstream let through is this many times its sample.
    replicas: u32,
    /// This replica probes for the group ([`crate::limit::redis::Probing`]): the answers
    /// it sees are all of the group's, not its share.
    sole: bool,
    /// When the upstream accepted the last requests, within [`HORIZON`] (at most
    /// [`SAMPLE`] of them).
    accepted: VecDeque<Instant>,
    /// When it refused the last ones, alike.
    refusals: VecDeque<Instant>,
    /// Accepted answers since the last refusal (or since the start).
    since_refusal: u32,
    /// Accepted answers since the last refusal episode ended, and the first of them.
    since_episode: (u32, Option<Instant>),
    /// The refusal episode in force: until its pause ends, and whether its sample set
    /// the learned rate (then later refusals of the same episode refine it).
    episode: Option<(Instant, bool)>,
    /// The fastest rate that held a calm interval before a climb, per second.
    calm_pace: Option<f64>,
    /// The pace of the last step down, per second.
    refused_pace: Option<f64>,
    /// The pause the last refusal that said one asked for: the window of a limiter
    /// that announces nothing else.
    said_window: Option<Duration>,
    /// How the last change ranks against another replica's.
    precedence: Precedence,
    /// This replica's last bookings in the shared store: each one's slot, when it was
    /// booked, and the group's bookings within a window before it (that one included)
    /// with the window, when counted.
    booked: VecDeque<Booking>,
}

/// Bookings are counted in a shared store over windows of up to this many requests
/// (one entry each); a count that reaches it says nothing.
pub const COUNTED: u64 = 1_000;

/// How many of this replica's last bookings keep the shared store's count.
const BOOKINGS: usize = 16;
/// How far back the accepted answers count for what the upstream lets through.
pub const HORIZON: Duration = Duration::from_secs(5);
/// The most accepted answers kept for that (at high rates the horizon is shorter).
const SAMPLE: usize = 256;
/// A paced group learns what its upstream let through only when it refused at least
/// this many requests within [`HORIZON`], and at least [`REFUSED_SHARE`] of those it
/// answered there: else the refusals are too few for the answers to show the upstream's
/// limit rather than the group's own demand, and the rate only steps down.
const MIN_PACED_REFUSALS: usize = 2;
/// See [`MIN_PACED_REFUSALS`].
const REFUSED_SHARE: f64 = 0.2;
/// A rate learned from bare refusals climbs back to at most this many times what the
/// upstream let through.
const ABOVE_SEEN: f64 = 1.25;
/// While probing upwards (`slow_start`), each half calm interval multiplies the rate
/// by this.
pub const SLOW_START: f64 = 1.5;

impl Learner {
    /// Nothing learned yet, as of `now`.
    pub fn new(now: Instant) -> Learner {
        Learner {
            base: None,
            window: Duration::ZERO,
            budget: None,
            factor: 1.0,
            slow_start: false,
            changed: now,
            stepped_at: None,
            since: None,
            replicas: 1,
            sole: false,
            accepted: VecDeque::new(),
            refusals: VecDeque::new(),
            since_refusal: 0,
            since_episode: (0, None),
            episode: None,
            said_window: None,
            calm_pace: None,
            refused_pace: None,
            booked: VecDeque::new(),
            precedence: Precedence::Replaces,
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

    /// The budget the upstream announced last: its quota per window.
    pub fn announced_budget(&self) -> Option<(u64, Duration)> {
        self.budget
    }

    /// A response announced a budget. Returns whether the learned rate moved.
    pub fn announced(&mut self, budget: Announced, now: Instant) -> bool {
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
        self.budget = Some((budget.quota, window));
        // An announced budget outranks one guessed from refusals, and is replaced by a
        // newer announcement (the upstream may change its plan); step-downs stay.
        let moved = self.base != Some((rate, budget.source));
        if moved {
            self.precedence = Precedence::Replaces;
            if self.base.is_none_or(|(_, s)| s == Source::Refusals) {
                self.factor = 1.0;
            }
            self.base = Some((rate, budget.source));
            self.slow_start = false;
            self.since.get_or_insert(now);
        }
        moved
    }

    /// The upstream answered normally at `now`. Returns whether the learned rate moved.
    pub fn accepted(&mut self, now: Instant) -> bool {
        keep(&mut self.accepted, now);
        self.since_refusal = self.since_refusal.saturating_add(1);
        // Answers after an episode's pause belong to the next window's sample; those
        // before it (in flight when the refusal came) to this one.
        if self.episode.is_some_and(|(end, _)| now >= end) {
            self.since_episode = (0, None);
            self.episode = None;
        }
        let (n, first) = &mut self.since_episode;
        *n += 1;
        first.get_or_insert(now);
        // An accepted answer of the burst whose refusal set the learned rate, come
        // after that refusal, is read into it too: the reading does not depend on
        // whether the refusals or the accepted answers came back first.
        let Some((end, true)) = self.episode else {
            return false;
        };
        let before = self.rate();
        if let Some((seen, _)) = self.seen(now, end - now) {
            self.learn(seen, now);
        }
        self.rate() != before
    }

    /// What a limiter that said when to come back let through since its last refusal:
    /// the answers accepted since then, over the time since the first of them or the
    /// pause it asks for, whichever is longer (it refills within that pause).
    ///
    /// One of several replicas sees its share of those answers only: the shared store's
    /// count of the group's bookings within that pause before the request refused (less
    /// that one) is the group's when it has one.
    fn window_seen(&self, now: Instant, sent: Instant, pause: Duration) -> Option<f64> {
        if let (true, Some(booked)) = (self.replicas > 1, self.booked_within(sent, pause)) {
            return Some((booked.saturating_sub(1)) as f64 / pause.as_secs_f64());
        }
        let (n, first) = self.since_episode;
        let span = (now - first?).max(pause).as_secs_f64();
        (n >= 2 && span > 0.0).then(|| f64::from(n) * self.scale() / span)
    }

    /// Drops the answers older than [`HORIZON`].
    fn forget_past_horizon(&mut self, now: Instant) {
        for times in [&mut self.accepted, &mut self.refusals] {
            while times.front().is_some_and(|at| now - *at > HORIZON) {
                times.pop_front();
            }
        }
    }

    /// What the upstream let through: the requests it accepted within [`HORIZON`], over
    /// the time since the first of them, or over `pause` when that is longer (a burst
    /// answered at once); with their count.
    fn seen(&mut self, now: Instant, pause: Duration) -> Option<(f64, u32)> {
        self.forget_past_horizon(now);
        let first = *self.accepted.front()?;
        let n = self.accepted.len() as u32;
        let span = (now - first).max(pause).as_secs_f64();
        let rate = f64::from(n) * self.scale() / span;
        (span > 0.0).then_some((rate, n))
    }

    /// `replicas` share the upstream's budget (1 unless the store is shared).
    pub fn set_replicas(&mut self, replicas: u32) {
        self.replicas = replicas.max(1);
    }

    /// Whether this replica probes for the group, as its last booking in the shared
    /// store said (no when the store did not answer).
    pub fn probes_for_group(&mut self, sole: bool) {
        // The answers seen while probing for the group are the group's: read later as
        // this replica's share, they would count once per replica.
        if self.sole && !sole {
            self.accepted.clear();
        }
        self.sole = sole;
    }

    /// What the group's answers are to the ones this replica sees.
    fn scale(&self) -> f64 {
        match self.sole {
            true => 1.0,
            false => f64::from(self.replicas),
        }
    }

    /// The upstream refused a request sent at `sent` at `now` and asks for `pause`;
    /// `said`: it said how long (else `pause` is a guess); `pace` is the rate the
    /// group was held to (per second), if any. Returns whether the learned rate moved.
    ///
    /// One overload answers a burst with a refusal each, and the accepted answers of
    /// that burst may come after the first refusal: the refusals until the pause ends
    /// are one episode, and its sample is read again at each, so the estimate does not
    /// depend on the order of the answers.
    pub fn refused(
        &mut self,
        now: Instant,
        sent: Instant,
        pause: Duration,
        said: bool,
        pace: Option<f64>,
    ) -> bool {
        let before = self.rate();
        let isolated = self.refusal_isolated();
        // A bare refusal's reading is only a floor to climb from, a calm interval a
        // step: read as one replica's share, as though each had probed, it starts from
        // where the replicas' own probes would.
        self.sole &= said;
        if said && !pause.is_zero() && pause <= HORIZON {
            self.said_window = Some(pause);
        }
        // Sent, or booked in the shared store, before the learned rate held: not paced
        // by it.
        // An announced window's worth of requests paced faster before it says nothing
        // either: the window still held them.
        let paced_from = self.booking(sent).map_or(sent, |(_, at, _)| *at);
        let settle = self.budget.map_or(Duration::ZERO, |(_, window)| window);
        let stale = self.since.is_some_and(|since| paced_from < since + settle);
        let pace = pace.filter(|_| !stale);
        if let Some((end, refine)) = self.episode.filter(|(end, _)| now < *end) {
            let end = end.max(now + pause);
            if let (true, Some((seen, _))) = (refine, self.seen(now, end - now)) {
                self.learn(seen, now);
            }
            self.episode = Some((end, refine));
            return self.rate() != before;
        }
        // A refusal of a request sent before the rate in force was learned (or adopted
        // from another replica) says nothing about that rate.
        if stale && self.base.is_some() {
            return false;
        }
        let announced = self.announced_rate().is_some();
        self.forget_past_horizon(now);
        keep(&mut self.refusals, now);
        let refine = match pace {
            None => self.refused_unpaced(now, pause, said, announced),
            // Paced: what the upstream let through, when clearly less; else a step.
            Some(pace) if !announced && !self.slow_start => {
                self.refused_paced(now, sent, pause, said, pace, isolated);
                false
            }
            // Paced under an announced budget, or probing upwards: "slightly too fast".
            Some(pace) => {
                self.step_down(now, pace, isolated);
                false
            }
        };
        self.episode = Some((now + pause, refine));
        let moved = self.rate() != before;
        if moved {
            self.precedence = match (pace, self.replicas) {
                (Some(_), _) => Precedence::Slower,
                (None, 1) => Precedence::Replaces,
                (None, _) => Precedence::Faster,
            };
        }
        moved
    }

    fn learn(&mut self, seen: f64, now: Instant) {
        self.learn_below(seen, None, now);
    }

    /// Learns `seen` as what the upstream lets through, to climb back from when calm
    /// up to `ceiling` (a rate known to be refused only above it), if higher.
    fn learn_below(&mut self, seen: f64, ceiling: Option<f64>, now: Instant) {
        if !(seen.is_finite() && seen > 0.0) {
            return;
        }
        self.since.get_or_insert(now);
        let ceiling = ceiling
            .filter(|c| c.is_finite() && *c > seen)
            .unwrap_or(seen);
        self.base = Some((ceiling, Source::Refusals));
        self.factor = seen / ceiling;
        self.changed = now;
        self.stepped_at = Some(now);
    }
}

/// Records `now` in a sample of at most [`SAMPLE`] times.
fn keep(times: &mut VecDeque<Instant>, now: Instant) {
    if times.len() >= SAMPLE {
        times.pop_front();
    }
    times.push_back(now);
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

    /// A request departs at each whole second of `seconds` after `t0`.
    fn depart_each_second(l: &mut Learner, t0: Instant, seconds: std::ops::RangeInclusive<u32>) {
        for s in seconds {
            l.departed(t0 + S * s);
        }
    }

    #[test]
    fn a_spent_budget_pauses_unless_the_pace_already_keeps_to_it() {
        let ms = |n| Some(MS * n);
        let five = Some((5, S));
        // (the group's pace, the announced budget, ours in its window, pauses)
        let cases = [
            (ms(200), five, 5, false),
            (ms(204), five, 6, false),
            (ms(204), five, 4, false),
            // Others spent it too: only 3 of the 5 are ours.
            (ms(200), five, 3, true),
            // Faster than announced: the pace does not keep to it.
            (ms(125), five, 8, true),
            (ms(200), None, 5, true),
            (None, five, 5, true),
            (None, None, 0, true),
        ];
        for (pace, announced, ours, want) in cases {
            assert_eq!(
                spent_budget_pauses(pace, announced, ours),
                want,
                "{pace:?} {announced:?} {ours}"
            );
        }
    }

    #[test]
    fn a_window_full_of_the_groups_own_requests_frees_when_the_oldest_leaves_it() {
        let t0 = Instant::now();
        let ietf = |l: &mut Learner| {
            l.announced(
                Announced {
                    quota: 5,
                    window: Some(S),
                    reset: None,
                    source: Source::RatelimitPolicy,
                },
                t0,
            )
        };
        // (accepted at these ms, refused at, replicas, frees in ms)
        let cases: &[(&[u64], u64, u32, Option<u64>)] = &[
            // Five of ours within the window: the first leaves it at 1050 ms.
            (&[50, 250, 450, 650, 850], 990, 1, Some(60)),
            (&[0, 50, 250, 450, 650, 850], 990, 1, Some(60)),
            // Only four of ours: someone else spent the fifth.
            (&[250, 450, 650, 850], 990, 1, None),
            // Ours span more than the window: it is not ours that filled it.
            (&[0, 250, 450, 650, 850], 1100, 1, None),
            // One of three replicas sees a third of the group's answers.
            (&[50, 250, 450, 650, 850], 990, 3, None),
        ];
        for (accepted, refused, replicas, frees) in cases {
            let mut l = Learner::new(t0);
            ietf(&mut l);
            l.set_replicas(*replicas);
            for at in *accepted {
                l.accepted(t0 + MS * *at as u32);
            }
            let got = l.window_frees(t0 + MS * *refused as u32);
            assert_eq!(got, frees.map(|ms| MS * ms as u32), "{accepted:?}");
        }
        // Nothing announced: nothing known of the window.
        let mut l = Learner::new(t0);
        for at in [50, 250, 450, 650, 850] {
            l.accepted(t0 + MS * at);
        }
        assert_eq!(l.window_frees(t0 + MS * 990), None);
    }

    #[test]
    fn the_groups_bookings_counted_in_the_shared_store_read_a_said_window() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        l.set_replicas(3);
        // Told 8/s; a sliding window of 5 a second refuses with Retry-After: 1. This
        // replica saw two of the five accepted: alone, that reads as 6/s.
        l.accepted(t0 + MS * 300);
        l.accepted(t0 + MS * 700);
        let first = t0 + MS * 800;
        assert!(l.refused(first, first, S, true, Some(7.8)));
        // Counted over the pause it said; not at all at 10 000/s, nor unpaced.
        assert_eq!(l.count_window(Some(MS * 204)), Some(S));
        assert_eq!(l.count_window(Some(MS / 10)), None);
        assert_eq!(l.count_window(None), None);
        // The shared store counted six bookings of the group in the second before this
        // replica's next request, that one included: five were let through.
        let next = t0 + MS * 2900;
        l.accepted(next - MS * 500);
        l.accepted(next - MS * 100);
        // Its slot at 2.89 s counted six; the next head's, booked before the refusal
        // came back, seven.
        l.booked(next - MS * 10, next - MS * 100, Some(counted(6, 0)));
        l.booked(next + MS * 160, next, Some(counted(7, 0)));
        assert_eq!(l.booked_within(next - MS * 5, S), Some(6));
        assert_eq!(l.booked_within(next - MS * 5, S * 2), None);
        assert_eq!(l.booked_within(next - MS * 20, S), None);
        let pace = l.rate().unwrap().0 + 1.0;
        l.refused(next, next - MS * 5, S, true, Some(pace));
        assert_eq!(rate(&l), Some(4.9));
    }

    #[test]
    fn a_limiter_that_refuses_every_other_paced_request_is_read_from_the_last_seconds() {
        // Told 2/s; the upstream allows one a second and says Retry-After: 1. Paced at
        // 2/s, each refusal comes after a single answer accepted since the last one, so
        // only the last seconds' answers show its rate: one over the pause it said.
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        l.accepted(t0);
        let refused = t0 + MS * 500;
        l.refused(refused, refused, S, true, Some(2.0));
        assert_eq!(rate(&l), Some(0.98));
    }

    #[test]
    fn answers_within_a_window_count_with_the_replicas() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        for i in 0..10 {
            l.accepted(t0 + MS * (200 * i));
        }
        assert_eq!(l.accepted_within(t0 + MS * 1800, S), 5);
        // One of three replicas: its 10 answers of the last 5 s are 6 a window in all.
        l.set_replicas(3);
        assert_eq!(l.accepted_within(t0 + MS * 1800, S), 6);
        // A window longer than what is kept: nothing can be said.
        assert_eq!(l.accepted_within(t0 + MS * 1800, S * 60), 0);
    }

    #[test]
    fn the_accepted_answers_of_a_burst_count_whatever_their_order() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        // 30 sent at once: one refusal comes back first, then the five accepted, then
        // the other refusals. The sample is read again within the episode.
        l.refused(t0 + MS, t0 + MS, S, true, None);
        assert_eq!(l.rate(), None);
        for _ in 0..5 {
            l.accepted(t0 + MS * 2);
        }
        for _ in 0..24 {
            l.refused(t0 + MS * 3, t0 + MS * 3, S, true, None);
        }
        assert_eq!(rate(&l), Some(4.9));
        // The refusals first, then the accepted answers: the same reading.
        let mut l = Learner::new(t0);
        for _ in 0..25 {
            l.refused(t0 + MS, t0 + MS, S, true, None);
        }
        assert_eq!(l.rate(), None);
        let moved: Vec<bool> = (0..5).map(|_| l.accepted(t0 + MS)).collect();
        assert_eq!(moved, [true; 5]);
        assert_eq!(rate(&l), Some(4.9));
        // Answers older than the horizon are forgotten.
        l.accepted(t0 + S * 6);
        assert_eq!(l.seen(t0 + S * 6, S), Some((1.0, 1)));
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
                l.announced(*a, Instant::now());
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
        assert!(l.refused(t0 + MS, t0 + MS, S, true, None));
        assert_eq!(l.rate().unwrap().1, Source::Refusals);
        assert_eq!(rate(&l), Some(4.9));
        // The other refusals of that burst come with no new acceptance: about the same.
        l.refused(t0 + MS * 2, t0 + MS * 2, S, true, None);
        assert_eq!(rate(&l), Some(4.9));
        // Nothing accepted yet: nothing learned from a refusal that said when to come
        // back; a bare one paces at one request per guessed pause, a second at least
        // (the guess is a backoff with jitter).
        let mut l = Learner::new(t0);
        assert!(!l.refused(t0, t0, S, true, None));
        assert_eq!(l.rate(), None);
        assert!(l.refused(t0 + S * 2, t0 + S * 2, MS * 500, false, None));
        assert_eq!(rate(&l), Some(0.98));
        let mut l = Learner::new(t0);
        assert!(l.refused(t0 + S * 2, t0 + S * 2, S * 2, false, None));
        assert_eq!(rate(&l), Some(0.49));
    }

    #[test]
    fn a_rate_learned_from_bare_refusals_climbs_fast_until_a_paced_refusal() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        // One accepted, the rest refused with nothing said, and a guessed 750 ms pause:
        // one a second at least.
        l.accepted(t0);
        assert!(l.refused(t0, t0, MS * 750, false, None));
        assert_eq!(rate(&l), Some(0.98));
        // Each calm half second multiplies it by 1.5: the upstream may allow much more.
        assert!(!l.departed(t0 + MS * 400));
        for half in 1..=4 {
            assert!(l.departed(t0 + MS * (500 * half)));
        }
        assert_eq!(rate(&l), Some(4.961));
        // A paced request refused: halfway back between 3.308 and 4.961, and no more
        // probing upwards.
        assert!(l.refused(t0 + S * 2, t0 + S * 2, MS * 66, false, Some(4.961)));
        assert_eq!(rate(&l), Some(4.134));
        assert!(!l.departed(t0 + S * 3));
        // Accepted at about that pace meanwhile: few refusals among many answers.
        for i in 0..20 {
            l.accepted(t0 + S * 2 + MS * (50 * i));
        }
        // Refused again, a while later: 5 % under that pace, then half the way back
        // each calm second to 2 % under the pace refused (once, it may have been a
        // request sent a little early).
        assert!(l.refused(t0 + S * 4, t0 + S * 4, MS * 18, false, Some(4.134)));
        assert_eq!(rate(&l), Some(3.927));
        let climbed: Vec<_> = (5..=8)
            .map(|s| {
                l.departed(t0 + S * s);
                rate(&l).unwrap()
            })
            .collect();
        assert_eq!(climbed, [3.989, 4.03, 4.051, 4.051]);
    }

    #[test]
    fn a_paced_refusal_steps_down_once_per_episode_and_climbs_back_when_calm() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        // Paced at 10/s by the operator, accepted at that pace for 4 s: the pace was
        // not too far off, so only a step.
        for i in 60..100 {
            l.accepted(t0 + MS * (100 * i));
        }
        assert!(l.refused(t0 + S * 10, t0 + S * 10, Duration::ZERO, false, Some(10.0)));
        assert_eq!(rate(&l), Some(9.5));
        for i in 1..=4 {
            l.accepted(t0 + S * 10 + MS * (100 * i));
        }
        // Within two intervals of the step: the same episode.
        assert!(!l.refused(
            t0 + S * 10 + MS * 100,
            t0 + S * 10 + MS * 100,
            Duration::ZERO,
            false,
            Some(9.5)
        ));
        // The next episode, right after: still well too fast, a double step.
        assert!(l.refused(
            t0 + S * 10 + MS * 500,
            t0 + S * 10 + MS * 500,
            Duration::ZERO,
            false,
            Some(9.5)
        ));
        assert_eq!(rate(&l), Some(8.574));
        // Calm seconds climb back to 2 % under the last pace refused.
        depart_each_second(&mut l, t0, 11..=40);
        assert_eq!(rate(&l), Some(9.31));
        // Refused again at about that pace: it was no accident, and the ceiling is a
        // step under it now.
        assert!(l.refused(t0 + S * 41, t0 + S * 41, Duration::ZERO, false, Some(9.31)));
        depart_each_second(&mut l, t0, 42..=80);
        assert_eq!(rate(&l), Some(8.845));
    }

    #[test]
    fn an_isolated_refusal_steps_a_little_and_climbs_back_to_the_pace() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        let accept = |l: &mut Learner, from: u32, n: u32| {
            for k in 0..n {
                l.accepted(t0 + MS * (from + 100 * k));
            }
        };
        // Paced at 10/s by the operator, 60 accepted, then one refused: a request that
        // came a little early, a small step.
        accept(&mut l, 0, 60);
        assert!(l.refused(t0 + S * 6, t0 + S * 6, Duration::ZERO, false, Some(10.0)));
        assert_eq!(rate(&l), Some(9.8));
        // Calm seconds climb back to the pace itself, not a margin under it.
        accept(&mut l, 6_100, 60);
        depart_each_second(&mut l, t0, 7..=20);
        assert_eq!(rate(&l), Some(10.0));
        // Isolated again at that pace: still a small step, and back to it.
        assert!(l.refused(t0 + S * 21, t0 + S * 21, Duration::ZERO, false, Some(10.0)));
        assert_eq!(rate(&l), Some(9.8));
        depart_each_second(&mut l, t0, 22..=35);
        assert_eq!(rate(&l), Some(10.0));
        // Refused again after a few answers: the pace is too fast, a full step, and
        // the ceiling a step under the pace refused before.
        accept(&mut l, 35_100, 10);
        assert!(l.refused(t0 + S * 37, t0 + S * 37, Duration::ZERO, false, Some(10.0)));
        assert_eq!(rate(&l), Some(9.5));
        depart_each_second(&mut l, t0, 38..=80);
        assert_eq!(rate(&l), Some(9.5));
    }

    #[test]
    fn the_replica_that_probes_for_the_group_reads_its_answers_as_the_groups() {
        let t0 = Instant::now();
        // (probes for the group, the refusal said its pause, rate learned)
        let cases = [
            // Its five accepted answers are all the group's: 5 a second.
            (true, true, 4.9),
            // One replica's share of the group's, were it not the prober.
            (false, true, 14.7),
            // A bare refusal's reading is a floor to climb from: read as a share.
            (true, false, 14.7),
        ];
        for (sole, said, learned) in cases {
            let mut l = Learner::new(t0);
            l.set_replicas(3);
            l.probes_for_group(sole);
            for i in 0..5 {
                l.accepted(t0 + MS * i);
            }
            assert!(l.refused(t0 + MS * 5, t0 + MS * 5, S, said, None));
            assert_eq!(rate(&l), Some(learned), "sole {sole}, said {said}");
        }
        // The probe over, its answers are not read as this replica's share, times three.
        let mut l = Learner::new(t0);
        l.set_replicas(3);
        l.probes_for_group(true);
        for i in 0..5 {
            l.accepted(t0 + MS * i);
        }
        assert_eq!(l.accepted_within(t0 + S, S * 2), 5);
        l.probes_for_group(false);
        assert_eq!(l.accepted_within(t0 + S, S * 2), 0);
    }

    #[test]
    fn a_shared_budget_counts_what_the_other_replicas_sent_and_probes_once_a_calm_interval() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        l.set_replicas(3);
        l.accepted(t0);
        assert!(l.refused(t0, t0, MS * 750, false, None));
        // One accepted here, about three in all (a second's worth: the pause is a
        // guess).
        assert_eq!(rate(&l), Some(2.94));
        // A bare refusal's reading is a floor, probed upwards; by replicas once a calm
        // interval (the store keeps a slower state published less than that before),
        // where one replica would climb after half of one.
        assert!(!l.departed(t0 + S / 2));
        assert!(l.departed(t0 + S));
        assert_eq!(rate(&l), Some(4.41));
        // The state reached the store later than the climb: the next counts from there.
        l.published(t0 + S * 3 / 2);
        assert!(!l.departed(t0 + S * 2));
        assert!(l.departed(t0 + S * 5 / 2));
    }

    #[test]
    fn a_bare_refusal_of_a_pace_climbed_far_above_a_calm_one_returns_to_it() {
        let t0 = Instant::now();
        let shared = |rate: f64| Shared {
            base: rate / MARGIN,
            factor: 1.0,
            source: Source::Refusals,
        };
        // (calm pace, pace refused, where it climbs back to): halfway to the pace
        // refused when that is far (a slow start's step), else two steps under it,
        // unless that is below the calm pace.
        let table: [(f64, f64, f64); 3] = [(4.0, 6.0, 5.0), (5.0, 6.0, 5.415), (4.0, 4.3, 4.0)];
        for (calm, refused, ceiling) in table {
            let mut l = Learner::new(t0);
            l.set_replicas(3);
            assert!(l.adopt(shared(calm), t0));
            // Another replica climbed: the pace before held calm.
            assert!(l.adopt(shared(refused), t0 + S));
            l.refused(t0 + S * 2, t0 + S * 2, MS * 10, false, Some(refused));
            assert_eq!(rate(&l), Some(calm), "{calm} → {refused}");
            depart_each_second(&mut l, t0, 3..=30);
            assert_eq!(rate(&l), Some(ceiling), "{calm} → {refused}");
        }
    }

    #[test]
    fn a_paced_refusal_learns_what_the_upstream_let_through_when_far_below_the_pace() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        // Told 8/s; a strict 5/s upstream accepts every other request for 2 s. The first
        // refusal only steps down; once refusals are a good share of the answers, what
        // it let through is the rate.
        for k in 0..16u32 {
            let at = t0 + MS * (125 * k);
            match k % 2 {
                0 => _ = l.accepted(at),
                _ => {
                    let pace = l.rate().map_or(8.0, |(r, _)| r);
                    l.refused(at, at, MS * 12, false, Some(pace));
                }
            }
        }
        let (r, source) = l.rate().unwrap();
        assert_eq!(source, Source::Refusals);
        assert!((3.9..=5.3).contains(&r), "{r}");
        // Calm, it climbs back a little: the refusals spaced what it let through.
        depart_each_second(&mut l, t0, 3..=10);
        let climbed = l.rate().unwrap().0;
        assert!(climbed > r && climbed <= 5.3, "{r} {climbed}");
    }

    fn counted(booked: u64, refused: u64) -> Counted {
        let window = S;
        Counted {
            booked,
            refused,
            window,
        }
    }

    #[test]
    fn one_of_three_replicas_reads_the_groups_refusals_counted_in_the_shared_store() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        l.set_replicas(3);
        // Three replicas told 8/s share slots; a strict 5/s upstream refuses a slot
        // less than 200 ms after the last it accepted. This replica holds every third
        // slot: its own answers are too few to read (stepping down 5-10 % an episode
        // would take many), the store's count of the group's bookings and refusals
        // within the last second is not. Paced perfectly at 8/s, the limiter accepts
        // every other request: 4/s is read, what a 4/s limiter would accept too.
        let (mut at, mut last_ok, mut at_two_seconds) = (t0, None, None);
        let (mut slots, mut refusals) = (Vec::new(), Vec::new());
        for slot in 0u32.. {
            if at - t0 > S * 10 {
                break;
            }
            if at - t0 > S * 2 {
                at_two_seconds.get_or_insert(l.rate());
            }
            let pace = l.rate().map_or(8.0, |(r, _)| r.min(8.0));
            slots.push(at);
            let within = |times: &[Instant]| times.iter().filter(|t| at - **t < S).count();
            let count = counted(within(&slots) as u64, within(&refusals) as u64);
            let ok = last_ok.is_none_or(|last| at - last >= MS * 200);
            match ok {
                true => last_ok = Some(at),
                false => refusals.push(at),
            }
            if slot % 3 == 0 {
                l.booked(at, at, Some(count));
                match ok {
                    true => _ = l.accepted(at),
                    false => _ = l.refused(at, at, MS * 12, false, Some(pace)),
                }
                l.departed(at);
            }
            at += Duration::from_secs_f64(1.0 / pace);
        }
        let read = at_two_seconds.flatten().map(|(r, _)| r);
        assert!(read.is_some_and(|r| (3.9..=5.0).contains(&r)), "{read:?}");
        let (r, source) = l.rate().unwrap();
        assert_eq!(source, Source::Refusals);
        assert!((3.9..=5.0).contains(&r), "{r}");
        assert!(refusals.len() <= 6, "{}", refusals.len());
    }

    #[test]
    fn a_token_bucket_is_read_over_the_last_seconds_pauses_included() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        // Told 8/s; a bucket of 5/s with a burst of 5 lets 14 through in 1.8 s, then
        // refuses with Retry-After: 1: not clearly below the pace, a step.
        let accept = |l: &mut Learner, from: u32, n: u32, every: u32| {
            for k in 0..n {
                l.accepted(t0 + MS * (from + k * every));
            }
        };
        accept(&mut l, 0, 14, 130);
        let first = t0 + MS * 1820;
        l.refused(first, first, S, true, Some(7.84));
        assert_eq!(rate(&l), Some(7.448));
        // After the pause, full again: 16 more in 2.2 s at the lower pace. Since the
        // last refusal that reads as 7.3/s; over the last five seconds, 5.9/s.
        accept(&mut l, 2820, 16, 137);
        let second = t0 + MS * 5020;
        let pace = l.rate().unwrap().0;
        l.refused(second, second, S, true, Some(pace));
        assert_eq!(rate(&l), Some(5.812));
    }

    #[test]
    fn a_window_that_said_when_to_come_back_is_read_since_its_last_refusal() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        // Told 8/s; a 5-per-second window accepts five, then refuses with
        // Retry-After: 1.
        for k in 0..5 {
            l.accepted(t0 + MS * (125 * k));
        }
        let at = t0 + MS * 625;
        assert!(l.refused(at, at, S, true, Some(8.0)));
        assert_eq!(rate(&l), Some(4.9));
        // The next window's answers start a new sample.
        l.accepted(t0 + MS * 1700);
        assert_eq!(l.since_episode.0, 1);
    }

    #[test]
    fn a_refusal_of_a_request_sent_before_the_rate_was_learned_changes_nothing() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        // The burst left at t0; the first answer taught 5/s; its refusals follow.
        l.announced(x(5, 1000), t0 + MS * 5);
        l.accepted(t0 + MS * 5);
        assert!(!l.refused(t0 + MS * 6, t0, S, true, Some(4.9)));
        assert_eq!(rate(&l), Some(4.9));
    }

    #[test]
    fn replicas_adopt_the_shared_state_and_step_down_once_per_episode() {
        let t0 = Instant::now();
        let shared = |base, factor| Shared {
            base,
            factor,
            source: Source::Refusals,
        };
        // (the state here, the one shared, adopted, stepped down: no second step now)
        let cases = [
            (None, shared(5.0, 1.0), true, true),
            (Some(shared(5.0, 1.0)), shared(5.0, 1.0), false, false),
            (Some(shared(5.0, 1.0)), shared(5.0, 0.95), true, true),
            // A climb adopted is no step.
            (Some(shared(5.0, 0.9)), shared(5.0, 0.95), true, false),
            (Some(shared(5.0, 1.0)), shared(f64::NAN, 1.0), false, false),
        ];
        for (here, there, adopted, stepped) in cases {
            let mut l = Learner::new(t0);
            l.set_replicas(3);
            if let Some(here) = here {
                l.adopt(here, t0);
            }
            let at = t0 + S * 5;
            assert_eq!(l.adopt(there, at), adopted, "{here:?} {there:?}");
            if !adopted {
                continue;
            }
            assert_eq!(l.shared(), Some(there));
            // Another replica's step already answered this episode: a refusal of a
            // request paced by the adopted rate right after it steps no further.
            let pace = there.rate();
            l.refused(at + MS * 10, at + MS * 5, MS * 20, false, Some(pace));
            let moved = l.shared() != Some(there);
            assert_eq!(moved, !stepped, "{here:?} {there:?}");
        }
    }

    #[test]
    fn a_refusal_of_a_request_booked_before_the_rate_was_learned_changes_nothing() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        l.set_replicas(3);
        // Booked at 5 ms for a slot at 380 ms; the first answer taught 5/s at 10 ms.
        l.booked(t0 + MS * 380, t0 + MS * 5, None);
        l.announced(x(5, 1000), t0 + MS * 10);
        let before = l.shared();
        assert!(!l.refused(t0 + MS * 390, t0 + MS * 381, S, true, Some(4.9)));
        assert_eq!(l.shared(), before);
        // Booked after it, but within the window that still held the faster ones:
        // nothing either. Booked a window later: a step down.
        l.booked(t0 + MS * 600, t0 + MS * 385, None);
        assert!(!l.refused(t0 + MS * 610, t0 + MS * 601, S, true, Some(4.9)));
        l.booked(t0 + MS * 1400, t0 + MS * 1020, None);
        assert!(l.refused(t0 + MS * 1410, t0 + MS * 1401, S, true, Some(4.9)));
    }

    #[test]
    fn a_refusal_of_a_request_sent_before_the_rate_was_adopted_changes_nothing() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        l.set_replicas(3);
        for i in 0..10 {
            l.accepted(t0 + MS * (100 * i));
        }
        let five = Shared {
            base: 5.0,
            factor: 1.0,
            source: Source::Refusals,
        };
        l.adopt(five, t0 + S * 2);
        // Sent at 1.9 s, before the adoption: neither a step nor a new estimate.
        assert!(!l.refused(t0 + S * 3, t0 + MS * 1900, S, true, Some(8.0)));
        assert!(!l.refused(t0 + S * 3, t0 + MS * 1900, S, true, None));
        assert_eq!(l.shared(), Some(five));
    }

    #[test]
    fn an_announced_budget_is_not_replaced_by_refusals_but_steps_down() {
        let t0 = Instant::now();
        let mut l = Learner::new(t0);
        l.announced(x(5, 1000), t0);
        for _ in 0..3 {
            l.accepted(t0);
        }
        // Within the first window, the requests before the rate held may be the cause.
        assert!(!l.refused(t0 + MS * 900, t0 + MS * 900, S, true, Some(4.9)));
        l.refused(t0 + S * 2, t0 + S * 2, S, true, Some(4.9));
        let (r, source) = l.rate().unwrap();
        assert_eq!(source, Source::LimitAndReset);
        assert!((r - 4.9 * STEP_DOWN).abs() < 1e-9, "{r}");
    }
}
