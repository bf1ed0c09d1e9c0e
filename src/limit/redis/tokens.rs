//! A group's configured token buckets shared in Redis (`tokens.lua`): one script call
//! takes a request's estimate from every bucket, or tells how long until it fits; one
//! more settles the answer's usage. The buckets the upstream announces stay in each
//! replica, which reads every replica's use in the upstream's own headers.

use std::sync::Arc;
use std::time::Duration;

use super::connect::arg;
use super::Redis;

/// One bucket as the script takes it: tokens (signed when settling), µs per token,
/// capacity.
pub type Bucket = (i64, f64, u64);

impl Redis {
    /// Takes each bucket's tokens if all have room: `Some(ZERO)`; else `Some(wait)`,
    /// taking nothing. `None` when Redis does not answer.
    pub async fn take_tokens(&self, group: &str, buckets: &[Bucket]) -> Option<Duration> {
        if !self.is_up() || buckets.is_empty() {
            return None;
        }
        let (keys, args) = self.token_call(group, "take", buckets);
        let wait: u64 = self.run(&self.scripts.tokens, &keys, &args).await?;
        Some(Duration::from_micros(wait))
    }

    /// Gives back or charges each bucket's tokens (the usage minus the estimate), in
    /// the background.
    pub fn settle_tokens(self: &Arc<Self>, group: &str, buckets: Vec<Bucket>) {
        if buckets.iter().all(|(n, _, _)| *n == 0) {
            return;
        }
        let (keys, args) = self.token_call(group, "settle", &buckets);
        let redis = self.clone();
        tokio::spawn(async move {
            let _: Option<u64> = redis.run(&redis.scripts.tokens, &keys, &args).await;
        });
    }

    fn token_call(&self, group: &str, op: &str, buckets: &[Bucket]) -> (Vec<String>, Vec<Vec<u8>>) {
        let keys = (0..buckets.len())
            .map(|i| self.key(group, &format!("tokens:{i}")))
            .collect();
        let mut args = vec![arg(op)];
        for (n, per_us, capacity) in buckets {
            args.extend([arg(*n), arg(*per_us), arg(*capacity)]);
        }
        (keys, args)
    }
}
