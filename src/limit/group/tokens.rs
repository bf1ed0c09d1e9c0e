//! A request's tokens at the head of its group's queue (docs/tokens.md): the buckets
//! this process keeps, then the configured ones in the shared store, where the
//! estimate is taken at once.

use std::pin::Pin;

use tokio::sync::futures::Notified;
use tokio::time::Instant;

use super::{Group, Refusal};
use crate::limit::queue::Place;
use crate::limit::store::Store;

impl Group {
    /// Waits, if need be, until the tokens of the request at `place` fit, or `wake`
    /// (an answer gave tokens back, a reload). `Ok(true)`: it waited, and the head
    /// looks at everything again (a pause may have begun); `Ok(false)`: they fit. With
    /// the shared store up, they are then taken there (`*taken`), as the store books
    /// a request's slot; a head that then yields to a retry keeps them spent.
    pub(super) async fn wait_for_tokens(
        &self,
        place: &Place,
        wake: Pin<&mut Notified<'_>>,
        taken: &mut bool,
    ) -> Result<bool, Refusal> {
        let Some(estimate) = place.tokens else {
            return Ok(false);
        };
        let now = Instant::now();
        let shared = self.shares_tokens();
        let (until, buckets) = {
            let mut state = self.lock();
            let share = 1.0 / f64::from(self.store.replicas());
            if let Some(tokens) = &mut state.tokens {
                tokens.set_share(share);
            }
            let until = state.tokens_hold(Some(estimate), now, shared);
            let buckets = state
                .tokens
                .as_ref()
                .map(|t| t.shared(|k| k.of(estimate) as i64));
            (until, buckets.unwrap_or_default())
        };
        let until = match (until, &self.store) {
            (Some(until), _) => until,
            (None, Store::Redis(redis)) if shared && !*taken && !buckets.is_empty() => {
                match redis.take_tokens(&self.name, &buckets).await {
                    Some(wait) if wait.is_zero() => {
                        *taken = true;
                        return Ok(false);
                    }
                    Some(wait) => Instant::now() + wait,
                    // Redis did not answer: this process's buckets, at its share.
                    None => return Ok(true),
                }
            }
            (None, _) => return Ok(false),
        };
        if place.deadline.is_some_and(|deadline| until > deadline) {
            return Err(Refusal::WaitTooLong { ahead: until - now });
        }
        let _woken = tokio::time::timeout_at(until, wake).await;
        Ok(true)
    }

    /// Whether the shared store keeps the configured token buckets now.
    pub(super) fn shares_tokens(&self) -> bool {
        matches!(&self.store, Store::Redis(redis) if redis.is_up())
    }
}
