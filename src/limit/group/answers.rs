//! What the upstream's answers do to a group: a refusal pauses it, and every answer
//! teaches its budget ([`crate::limit::budget`]); a pace that moved reaches the group's
//! rates, its metric and (with the next booking) the shared store.

use std::time::Duration;

use tokio::time::Instant;

use super::{Group, State};
use crate::limit::store::Store;
use crate::llm::headers::TokenLimits;
use crate::llm::Tokens;
use crate::ratelimit_headers::Announcement;

impl Group {
    /// Holds every request of the group for `pause`, on every replica when the store is
    /// shared. Waiting requests that the pause (and the queue ahead of them after it)
    /// would keep past their `max_wait` are refused now.
    pub fn pause_for(&self, pause: Duration) {
        self.hold(pause, false);
    }

    /// [`Group::pause_for`]; `refusal`: the upstream refused a request.
    fn hold(&self, pause: Duration, refusal: bool) {
        let mut state = self.lock();
        state.pause.extend(Instant::now() + pause);
        if let Some(until) = state.pause.until(Instant::now()) {
            let State { queue, rates, .. } = &mut *state;
            queue.refuse_hopeless(|ahead| until + rates.backlog(until, ahead));
        }
        let publication = state.publication();
        drop(state);
        self.store.pause(&self.name, pause, refusal, publication);
    }

    /// The upstream refused the request that left at `sent`: pause the group for
    /// `pause` (`said`: the upstream said so, else it is a guess), and the refusal
    /// teaches the budget.
    pub fn push_back(&self, pause: Duration, said: bool, sent: Instant) {
        {
            let mut state = self.lock();
            let now = Instant::now();
            state.pause.pushed_back(now);
            state.budget.set_replicas(self.store.replicas());
            let configured = state.rates.configured_pace();
            let before = state.budget.pace();
            if state.budget.refused(sent, now, pause, said, configured) {
                let moved = state.budget.pace() != before;
                self.learned(&mut state, moved);
            }
        }
        self.hold(pause, true);
    }

    /// The upstream accepted the request that left at `sent`: the fallback backoff
    /// starts over, and the answer counts for the budget.
    pub fn accepted(&self, sent: Instant) {
        let mut state = self.lock();
        state.pause.calm();
        state.budget.set_replicas(self.store.replicas());
        let before = state.budget.pace();
        if state.budget.accepted(sent, Instant::now()) {
            let moved = state.budget.pace() != before;
            self.learned(&mut state, moved);
        }
    }

    /// The request that left at `sent` got no answer from the upstream (DNS, a refused
    /// connection, a timeout): it teaches nothing, and the probe does not wait for it.
    pub fn unanswered(&self) {
        if self.lock().budget.unanswered() {
            self.wake.notify_waiters();
        }
    }

    /// The answer to the request that left at `sent` announced the upstream's budget.
    pub fn announced(&self, announcement: &Announcement, sent: Instant) {
        let mut state = self.lock();
        if state.budget.announced(announcement, sent, Instant::now()) {
            self.learned(&mut state, false);
        }
    }

    /// The budget changed: the rates and the metric follow, a waiting head looks
    /// again, and a pace that `moved` here is published with the next booking.
    pub(in crate::limit) fn learned(&self, state: &mut State, moved: bool) {
        let pace = state.budget.pace();
        state.publish |= moved;
        state.rates.set_learned(pace);
        self.metrics.learned_pace.set(pace);
        self.wake.notify_waiters();
    }

    /// What judging a refusal needs of the group, under one lock: its push-back
    /// episodes since the last normal answer (0 for the first), not counting the one
    /// whose pause holds now, and its emission interval when it is paced.
    pub fn pushback_context(&self) -> (u32, Option<Duration>) {
        let state = self.lock();
        (state.pause.in_row(Instant::now()), state.rates.pace())
    }
}

impl Group {
    /// The answer to a request that reserved `estimate` tokens reported `used`: the
    /// difference goes back to the buckets, or is charged. A head waiting for tokens
    /// looks again when some came back.
    pub fn settle_tokens(&self, estimate: Tokens, used: Tokens) {
        let shared = self.shares_tokens();
        let mut state = self.lock();
        let Some(tokens) = &mut state.tokens else {
            return;
        };
        let mut gave = tokens.settle(estimate, used, Instant::now(), shared);
        let buckets = tokens.shared(|k| k.of(used) as i64 - k.of(estimate) as i64);
        drop(state);
        if let (true, Store::Redis(redis)) = (shared, &self.store) {
            gave |= buckets.iter().any(|(n, _, _)| *n < 0);
            redis.settle_tokens(&self.name, buckets);
        }
        self.metrics
            .tokens
            .used(u64::from(used.input), u64::from(used.output));
        if gave {
            self.wake.notify_waiters();
        }
    }

    /// An answer's headers announced the upstream's token `limits`.
    pub fn tokens_announced(&self, limits: &TokenLimits) {
        if let Some(tokens) = &mut self.lock().tokens {
            tokens.set_share(1.0 / f64::from(self.store.replicas()));
            tokens.announced(limits, Instant::now());
        }
    }
}
