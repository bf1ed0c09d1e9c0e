//! A group's token budgets (docs/tokens.md): buckets of tokens that refill at a
//! steady rate, as OpenAI and Anthropic describe their own limits.
//!
//! A bucket of `capacity` tokens refilling one token every `per_token` is kept in GCRA
//! form: one time, `tat`, when it would be full again; the tokens in use at `now` are
//! `(tat − now) / per_token`. A request reserves its estimate when it leaves; it may
//! leave once the estimate fits in what is left (an estimate above the capacity waits
//! for a full bucket); its answer's usage then replaces the estimate, the difference
//! given back or charged. The configured rates (`tokens = "30000/m"`: 30 000 when full,
//! 500 a second) and the limits the upstream announces must all allow; an announced
//! limit holds a request both by this process's account and by the upstream's last
//! word (what its last answer said was in use, with what was taken since).

use std::time::Duration;

use tokio::time::Instant;

use super::group::State;
use super::Store;
use crate::config::{GroupSettings, Rate, TokenSettings};
use crate::llm::headers::{Announced, TokenLimits};
use crate::llm::Tokens;

/// The share of a refill learned from answers that is spent.
const LEARNED_MARGIN: f64 = crate::limit::budget::Params::DEFAULT.margin;

/// The period of an announced token limit until its answers show their refill.
const MINUTE: Duration = Duration::from_secs(60);

/// The kinds of token a bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Input and output together.
    Total,
    /// Input (prompt) tokens.
    Input,
    /// Output (completion) tokens.
    Output,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Total, Kind::Input, Kind::Output];

    /// The tokens of this kind in `t`.
    pub fn of(self, t: Tokens) -> u64 {
        match self {
            Kind::Total => t.total(),
            Kind::Input => u64::from(t.input),
            Kind::Output => u64::from(t.output),
        }
    }

    /// Its name in `/status` and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Total => "total",
            Kind::Input => "input",
            Kind::Output => "output",
        }
    }
}

/// One bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bucket {
    kind: Kind,
    /// The limit as configured or announced: tokens when full, for all replicas.
    limit: u64,
    /// This process's share of it: `limit × share`, refilled at the share of the rate,
    /// so that a full bucket takes as long to refill as the whole one.
    capacity: u64,
    per_token: Duration,
    /// From empty to full, whatever the share.
    period: Duration,
    /// This process's account: what its requests took, and what their answers gave
    /// back.
    tat: Instant,
    /// The upstream's account, for a limit it announces: its last answer's, with what
    /// this process took since. Replaced by each answer, never kept as the larger of
    /// the two: an answer's head is older than the usage given back meanwhile, and
    /// keeping it would charge every request's unused output once more.
    seen: Option<Instant>,
}

impl Bucket {
    fn new(kind: Kind, limit: u64, period: Duration, share: f64, now: Instant) -> Bucket {
        let limit = limit.max(1);
        let share = share.clamp(1e-6, 1.0);
        Bucket {
            kind,
            limit,
            capacity: ((limit as f64 * share).round() as u64).max(1),
            per_token: period.div_f64(limit as f64 * share),
            period,
            tat: now,
            seen: None,
        }
    }

    fn span(&self, tokens: u64) -> Duration {
        self.per_token
            .saturating_mul(u32::try_from(tokens).unwrap_or(u32::MAX))
    }

    /// When `tokens` fit (at most the whole bucket), asked at `now`.
    fn earliest(&self, tokens: u64, now: Instant) -> Instant {
        let need = self.span(tokens.min(self.capacity));
        let room = self.span(self.capacity);
        let fits = |tat: Instant| (tat + need).checked_sub(room).map_or(now, |t| t.max(now));
        fits(self.tat).max(self.seen.map_or(now, fits))
    }

    /// Takes `tokens` at `at`.
    fn take(&mut self, tokens: u64, at: Instant) {
        self.tat = self.tat.max(at) + self.span(tokens);
        self.seen = self.seen.map(|seen| seen.max(at) + self.span(tokens));
    }

    /// Gives `tokens` back at `now`: never more than the bucket has in use.
    fn give_back(&mut self, tokens: u64, now: Instant) {
        self.tat = self
            .tat
            .checked_sub(self.span(tokens))
            .unwrap_or(now)
            .max(now);
    }

    /// Keeps `share` of the limit from now on. When the bucket is full again does not
    /// change: its capacity and its refill both scale.
    fn share(&mut self, share: f64) {
        let scaled = Bucket::new(self.kind, self.limit, self.period, share, self.tat);
        (self.capacity, self.per_token) = (scaled.capacity, scaled.per_token);
    }

    /// Refills from empty to full in `period` from `now` on, with as many in use.
    fn refill_at(&mut self, period: Duration, share: f64, now: Instant) {
        let per_token = Bucket::new(self.kind, self.limit, period, share, now).per_token;
        self.period = period;
        let factor = per_token.as_secs_f64() / self.per_token.as_secs_f64().max(1e-12);
        let rescale = move |tat: Instant| now + tat.saturating_duration_since(now).mul_f64(factor);
        self.seen = self.seen.map(rescale);
        self.tat = rescale(self.tat);
        self.per_token = per_token;
    }

    /// The tokens in use at `now`.
    fn in_use(&self, now: Instant) -> u64 {
        let used = self.tat.saturating_duration_since(now).as_secs_f64();
        (used / self.per_token.as_secs_f64().max(1e-12)).round() as u64
    }
}

/// What `/status` shows of one bucket.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BucketStatus {
    /// `total`, `input` or `output`.
    pub kind: &'static str,
    /// Configured, or announced by the upstream.
    pub source: &'static str,
    /// Tokens when full.
    pub capacity: u64,
    /// Tokens refilled per second (this replica's share).
    pub per_second: f64,
    /// Tokens in use now (reserved or spent, not yet refilled).
    pub in_use: u64,
}

/// What `/status` shows of a group's tokens.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TokenStatus {
    /// Estimates of the requests in flight, not yet replaced by their usage.
    pub reserved: u64,
    /// Input tokens the upstream reported, since the group began.
    pub used_input: u64,
    /// Output tokens the upstream reported, since the group began.
    pub used_output: u64,
    /// Every bucket that holds the group.
    pub buckets: Vec<BucketStatus>,
}

/// A group's token buckets.
#[derive(Debug)]
pub struct TokenBudget {
    configured: Vec<Bucket>,
    /// What the upstream announced, by kind (`Kind::ALL`'s order).
    announced: [Option<Bucket>; 3],
    /// The share of each refill this process spends (1 / replicas with a shared store).
    share: f64,
    reserved: u64,
    used: Tokens64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Tokens64 {
    input: u64,
    output: u64,
}

impl TokenBudget {
    /// The buckets `settings` configure, full at `now`.
    pub fn new(settings: &TokenSettings, share: f64, now: Instant) -> TokenBudget {
        let mut budget = TokenBudget {
            configured: Vec::new(),
            announced: [None; 3],
            share,
            reserved: 0,
            used: Tokens64::default(),
        };
        budget.reconfigure(settings, now);
        budget
    }

    /// Takes new settings (a reload), keeping what is in use of each bucket kept.
    pub fn reconfigure(&mut self, settings: &TokenSettings, now: Instant) {
        let rates: [(Kind, &Vec<Rate>); 3] = [
            (Kind::Total, &settings.total),
            (Kind::Input, &settings.input),
            (Kind::Output, &settings.output),
        ];
        let old = std::mem::take(&mut self.configured);
        for (kind, list) in rates {
            for rate in list {
                let mut bucket = Bucket::new(kind, rate.limit, rate.period, self.share, now);
                if let Some(kept) = old.iter().find(|b| b.kind == kind) {
                    bucket.take(kept.in_use(now), now);
                }
                self.configured.push(bucket);
            }
        }
    }

    fn buckets(&self) -> impl Iterator<Item = &Bucket> {
        self.configured
            .iter()
            .chain(self.announced.iter().flatten())
    }

    /// Keeps `share` of each limit from now on (1 / the replicas sharing the store,
    /// which a replica learns as it sees the others).
    pub fn set_share(&mut self, share: f64) {
        if share == self.share {
            return;
        }
        self.share = share;
        let all = self
            .configured
            .iter_mut()
            .chain(self.announced.iter_mut().flatten());
        for bucket in all {
            bucket.share(share);
        }
    }

    /// The buckets this process keeps: the announced ones, and the configured ones
    /// unless the shared store keeps those (`shared`).
    fn kept(&mut self, shared: bool) -> impl Iterator<Item = &mut Bucket> {
        let configured: &mut [Bucket] = if shared {
            &mut []
        } else {
            &mut self.configured
        };
        configured
            .iter_mut()
            .chain(self.announced.iter_mut().flatten())
    }

    /// When a request estimated at `estimate` may leave, asked at `now`, by the buckets
    /// this process keeps (`shared`: the configured ones are the shared store's).
    pub fn earliest(&self, estimate: Tokens, now: Instant, shared: bool) -> Instant {
        let configured = self.configured.iter().filter(|_| !shared);
        configured
            .chain(self.announced.iter().flatten())
            .map(|b| b.earliest(b.kind.of(estimate), now))
            .fold(now, Instant::max)
    }

    /// A request estimated at `estimate` leaves at `at`.
    pub fn take(&mut self, estimate: Tokens, at: Instant, shared: bool) {
        self.reserved += estimate.total();
        for bucket in self.kept(shared) {
            bucket.take(bucket.kind.of(estimate), at);
        }
    }

    /// The configured buckets as the shared store takes them, `tokens(kind)` of each
    /// (signed when settling), at the whole refill: the store counts every replica's
    /// requests.
    pub fn shared(&self, tokens: impl Fn(Kind) -> i64) -> Vec<(i64, f64, u64)> {
        let per_token_us = |b: &Bucket| b.per_token.mul_f64(self.share).as_secs_f64() * 1e6;
        let each = |b: &Bucket| (tokens(b.kind), per_token_us(b), b.limit);
        self.configured.iter().map(each).collect()
    }

    /// The answer to a request that reserved `estimate` reported `used` (what it did not
    /// report counts as estimated): the difference is given back or charged, in the
    /// buckets this process keeps (`shared`: the caller settles the configured ones in
    /// the shared store). Whether any tokens came back (a waiting request may fit now).
    pub fn settle(&mut self, estimate: Tokens, used: Tokens, now: Instant, shared: bool) -> bool {
        self.reserved = self.reserved.saturating_sub(estimate.total());
        self.used.input += u64::from(used.input);
        self.used.output += u64::from(used.output);
        let mut gave = false;
        for bucket in self.kept(shared) {
            let (reserved, spent) = (bucket.kind.of(estimate), bucket.kind.of(used));
            if spent > reserved {
                bucket.take(spent - reserved, now);
            } else if spent < reserved {
                bucket.give_back(reserved - spent, now);
                gave = true;
            }
        }
        gave
    }

    /// What an answer's headers announced at `now`: each bucket is full again no earlier
    /// than the upstream says.
    pub fn announced(&mut self, limits: &TokenLimits, now: Instant) {
        let by_kind = [limits.total, limits.input, limits.output];
        for ((kind, slot), said) in Kind::ALL.iter().zip(&mut self.announced).zip(by_kind) {
            let Some(Announced {
                limit,
                remaining,
                reset,
            }) = said
            else {
                continue;
            };
            // Both providers document their token limits per minute; the refill the
            // answer shows (`reset` for what is in use) says better, when enough is
            // in use that a reset rounded to the second misleads little.
            // A learned refill is spent at the budget model's margin, as a learned
            // rate is (docs/budget.md): resets are rounded, and the upstream's clock
            // is not ours.
            let in_use = limit - remaining;
            let period = (in_use >= limit / 4 && !reset.is_zero())
                .then(|| reset.mul_f64(limit as f64 / in_use as f64 / LEARNED_MARGIN));
            let fresh = !matches!(slot, Some(b) if b.limit == limit);
            if fresh {
                *slot = Some(Bucket::new(*kind, limit, MINUTE, self.share, now));
            }
            let Some(bucket) = slot else { continue };
            if let Some(period) = period {
                bucket.refill_at(period, self.share, now);
            }
            // What is in use, counted in tokens (this replica's share of them), so
            // that a refill still to be learned does not misread it.
            let mine = ((in_use as f64) * self.share).round() as u64;
            let full_at = now + bucket.span(mine);
            if fresh {
                bucket.tat = full_at;
            }
            bucket.seen = Some(full_at);
        }
    }

    /// A snapshot for `/status`.
    pub fn status(&self, now: Instant) -> TokenStatus {
        let configured = self.configured.iter().map(|b| (b, "configured"));
        let announced = self.announced.iter().flatten().map(|b| (b, "announced"));
        TokenStatus {
            reserved: self.reserved,
            used_input: self.used.input,
            used_output: self.used.output,
            buckets: configured
                .chain(announced)
                .map(|(b, source)| BucketStatus {
                    kind: b.kind.as_str(),
                    source,
                    capacity: b.capacity,
                    per_second: 1.0 / b.per_token.as_secs_f64().max(1e-12),
                    in_use: b.in_use(now),
                })
                .collect(),
        }
    }

    /// Whether nothing is reserved and every bucket is full: the group holds no token
    /// state worth keeping.
    pub fn is_idle(&self, now: Instant) -> bool {
        self.reserved == 0
            && self
                .buckets()
                .all(|b| b.tat <= now && b.seen.is_none_or(|seen| seen <= now))
    }
}

/// What a request spends of its group's budget: cost units of the request rates, the
/// tokens it is estimated at when the group counts tokens, and the flow whose share of
/// the queue it spends when the group queues fairly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    /// Units of the request rates (`costs`, else 1).
    pub requests: u32,
    /// Its estimate, in a group that counts tokens and a request that reads as one of
    /// an LLM API's.
    pub tokens: Option<Tokens>,
    /// Its flow, in a group with `fair_by` (docs/keys.md).
    pub flow: Option<super::fair::Flow>,
}

impl From<u32> for Cost {
    fn from(requests: u32) -> Cost {
        Cost {
            requests,
            ..Cost::default()
        }
    }
}

/// The token buckets of a group whose settings count tokens.
pub(super) fn token_budget(
    settings: &GroupSettings,
    store: &Store,
    now: Instant,
) -> Option<Box<TokenBudget>> {
    let share = 1.0 / f64::from(store.replicas());
    let counted = settings.tokens.counted();
    counted.then(|| Box::new(TokenBudget::new(&settings.tokens, share, now)))
}

impl State {
    /// Until when the tokens of a request estimated at `estimate` do not fit.
    pub(super) fn tokens_hold(
        &self,
        estimate: Option<Tokens>,
        now: Instant,
        shared: bool,
    ) -> Option<Instant> {
        let at = self.tokens.as_ref()?.earliest(estimate?, now, shared);
        (at > now).then_some(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(total: &str, input: &str, output: &str) -> TokenSettings {
        let rates = |s: &str| s.split_whitespace().map(|r| r.parse().unwrap()).collect();
        TokenSettings {
            total: rates(total),
            input: rates(input),
            output: rates(output),
            llm: Some(crate::llm::Dialect::Auto),
            max_output: 4096,
        }
    }

    fn t(input: u32, output: u32) -> Tokens {
        Tokens { input, output }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_full_bucket_lets_its_capacity_go_then_waits_for_the_refill() {
        let now = Instant::now();
        // 6 000 a minute: 100 a second, 6 000 when full.
        let mut b = TokenBudget::new(&settings("6000/m", "", ""), 1.0, now);
        assert_eq!(b.earliest(t(4000, 1000), now, false), now);
        b.take(t(4000, 1000), now, false);
        assert_eq!(b.earliest(t(1000, 0), now, false), now);
        // 5 000 in use: 1 500 more need 500 refilled, 5 s.
        assert_eq!(b.earliest(t(1000, 500), now, false), now + ms(5000));
        // More than the whole bucket waits for a full one, not forever.
        assert_eq!(b.earliest(t(9000, 0), now, false), now + ms(50_000));
    }

    #[test]
    fn usage_below_the_estimate_comes_back_above_it_is_charged() {
        let now = Instant::now();
        let mut b = TokenBudget::new(&settings("6000/m", "", ""), 1.0, now);
        b.take(t(1000, 4000), now, false);
        assert!(b.settle(t(1000, 4000), t(900, 100), now, false));
        assert_eq!(b.status(now).buckets[0].in_use, 1000);
        assert_eq!(b.status(now).reserved, 0);
        b.take(t(100, 100), now, false);
        assert!(!b.settle(t(100, 100), t(150, 450), now, false));
        assert_eq!(b.status(now).buckets[0].in_use, 1600);
        // Never more back than is in use.
        b.settle(t(0, 0), t(0, 0), now, false);
        b.take(t(10, 10), now, false);
        b.settle(t(10, 5000), t(0, 0), now, false);
        assert!(b.is_idle(now));
    }

    #[test]
    fn input_and_output_buckets_each_count_their_kind() {
        let now = Instant::now();
        let mut b = TokenBudget::new(&settings("", "600/m", "60/m"), 1.0, now);
        b.take(t(600, 30), now, false);
        // Input is spent: 10 more wait 1 s; output has 30 left.
        assert_eq!(b.earliest(t(10, 30), now, false), now + ms(1000));
        assert_eq!(b.earliest(t(0, 40), now, false), now + ms(10_000));
    }

    #[test]
    fn announced_limits_hold_no_earlier_than_the_upstream_says() {
        let now = Instant::now();
        let mut b = TokenBudget::new(&settings("", "", ""), 1.0, now);
        assert_eq!(b.earliest(t(5000, 5000), now, false), now);
        let said = |remaining, reset| TokenLimits {
            total: Some(Announced {
                limit: 6000,
                remaining,
                reset: ms(reset),
            }),
            ..TokenLimits::default()
        };
        // 6 000 a minute, full again in 30 s: 3 000 in use, 100 more refilled in a
        // second (at the margin, 1.02 s).
        b.announced(&said(3000, 30_000), now);
        assert_eq!(b.earliest(t(3000, 0), now, false), now);
        let wait = b.earliest(t(3000, 100), now, false) - now;
        assert_eq!(wait.as_millis(), 1020, "{wait:?}");
        // A later answer that says less is in use does not undo what we took.
        b.take(t(3000, 0), now, false);
        b.announced(&said(3000, 30_000), now);
        assert_eq!(b.status(now).buckets[0].in_use, 6000);
        assert_eq!(b.status(now).buckets[0].source, "announced");
    }

    #[test]
    fn the_refill_is_learned_from_what_is_in_use_and_its_reset() {
        let now = Instant::now();
        let mut b = TokenBudget::new(&settings("", "", ""), 1.0, now);
        let said = |remaining, reset| TokenLimits {
            total: Some(Announced {
                limit: 3000,
                remaining,
                reset: ms(reset),
            }),
            ..TokenLimits::default()
        };
        // Little in use: a minute's refill is assumed.
        b.announced(&said(2900, 2000), now);
        assert_eq!(b.status(now).buckets[0].per_second.round(), 50.0);
        b.take(t(100, 0), now, false);
        assert_eq!(b.status(now).buckets[0].in_use, 200);
        // 1 500 in use, full in 3 s: 500 a second, spent at 98 %; what is in use
        // stays in use.
        b.announced(&said(1500, 3000), now);
        assert_eq!(b.status(now).buckets[0].per_second.round(), 490.0);
        assert_eq!(b.status(now).buckets[0].in_use, 200);
    }

    #[test]
    fn what_an_answer_says_is_in_use_counts_in_tokens_before_the_refill_is_known() {
        let now = Instant::now();
        let mut b = TokenBudget::new(&settings("", "", ""), 1.0, now);
        // 1 000 of 8 000 in use, full in 0.25 s: too little to learn the refill from,
        // yet 1 000 are in use, whatever the refill assumed.
        let said = TokenLimits {
            total: Some(Announced {
                limit: 8000,
                remaining: 7000,
                reset: ms(250),
            }),
            ..TokenLimits::default()
        };
        b.announced(&said, now);
        assert_eq!(b.status(now).buckets[0].in_use, 1000);
        assert_eq!(b.earliest(t(7000, 0), now, false), now);
        assert!(b.earliest(t(7001, 0), now, false) > now);
    }

    #[test]
    fn a_shared_store_spends_this_replicas_share_of_each_refill() {
        let now = Instant::now();
        let mut b = TokenBudget::new(&settings("6000/m", "", ""), 0.5, now);
        // Half of the bucket, refilled at half the rate: 50 a second.
        assert_eq!(b.earliest(t(3000, 0), now, false), now);
        b.take(t(3000, 0), now, false);
        assert_eq!(b.earliest(t(100, 0), now, false), now + ms(2000));
        // What the upstream says remains is this replica's share of it.
        let said = TokenLimits {
            total: Some(Announced {
                limit: 1000,
                remaining: 1000,
                reset: Duration::ZERO,
            }),
            ..TokenLimits::default()
        };
        b.announced(&said, now);
        let announced = &b.status(now).buckets[1];
        assert_eq!((announced.capacity, announced.in_use), (500, 0));
        assert_eq!(b.shared(|_| 7), [(7, 10_000.0, 6000)]);
    }

    #[test]
    fn a_reload_keeps_what_is_in_use() {
        let now = Instant::now();
        let mut b = TokenBudget::new(&settings("6000/m", "", ""), 1.0, now);
        b.take(t(3000, 0), now, false);
        b.reconfigure(&settings("12000/m", "", ""), now);
        assert_eq!(b.status(now).buckets[0].in_use, 3000);
        assert_eq!(b.earliest(t(9000, 0), now, false), now);
    }
}
