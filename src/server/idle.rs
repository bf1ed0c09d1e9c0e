//! How long a client connection has gone without a request: `client_header_timeout`
//! for both HTTP versions.
//!
//! A connection's [`Idle`] counts its open requests and records when the last one
//! closed; [`Idle::for_at_least`] ends once none has been open for the timeout. Its
//! one sleep looks at the record when it fires and sleeps again until the deadline the
//! record gives if a request came since, so a busy connection wakes it once per
//! timeout, not once per request.
//!
//! * **HTTP/1**: a request is open from its head's arrival until its response body
//!   ends or is dropped, which is when hyper has written the last of it into its
//!   buffer and starts reading the next head. So the timeout runs while the connection
//!   waits for a head, stalled half-way through one or idle between requests, as
//!   hyper's own `header_read_timeout` did. That one starts a new sleep for every
//!   request head, boxed, put on the timer's list and taken off again when the head
//!   arrives, and asks for one more read after each response: ≈ 1k of the ≈ 31k
//!   instructions of a forwarded request (callgrind, BENCHMARKS.md "Eleventh session");
//!   this costs two uncontended locks and a clock read.
//! * **HTTP/2**: hyper has no header timeout; a request is open until its response body
//!   has been sent (a tunnel until it closes).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

/// How many requests are open on one client connection, and since when none has been.
pub(super) struct Idle(Mutex<(usize, Instant)>);

/// One open request of an [`Idle`]-watched connection; closing it is dropping it.
pub(super) struct OpenStream(Arc<Idle>);

impl Idle {
    /// A connection with no request open, since now.
    pub(super) fn new() -> Arc<Idle> {
        Arc::new(Idle(Mutex::new((0, Instant::now()))))
    }

    fn lock(&self) -> MutexGuard<'_, (usize, Instant)> {
        // Two plain numbers: valid after any panic of a holder.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A request opened on the connection.
    pub(super) fn opened(this: &Arc<Idle>) -> OpenStream {
        this.lock().0 += 1;
        OpenStream(this.clone())
    }

    /// Resolves once no request has been open for `limit`.
    pub(super) async fn for_at_least(&self, limit: Duration) {
        loop {
            let (open, since) = *self.lock();
            let wake = match open {
                0 if since.elapsed() >= limit => return,
                0 => since + limit,
                // Busy: look again later (it cannot go idle for `limit` sooner).
                _ => Instant::now() + limit,
            };
            tokio::time::sleep_until(wake).await;
        }
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.0 -= 1;
        if state.0 == 0 {
            state.1 = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(10);

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_requests_is_idle_a_limit_after_it_opened() {
        let idle = Idle::new();
        let start = Instant::now();
        idle.for_at_least(LIMIT).await;
        assert_eq!(start.elapsed(), LIMIT);
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_request_holds_off_the_end_until_it_closes() {
        let idle = Idle::new();
        let open = Idle::opened(&idle);
        let watch = idle.for_at_least(LIMIT);
        tokio::pin!(watch);
        // Three limits with the request open: the watch looks at each and sleeps on.
        assert!(tokio::time::timeout(LIMIT * 3, &mut watch).await.is_err());
        drop(open);
        let closed = Instant::now();
        watch.await;
        assert_eq!(closed.elapsed(), LIMIT);
    }

    #[tokio::test(start_paused = true)]
    async fn each_closed_request_moves_the_end() {
        let idle = Idle::new();
        let watch = idle.for_at_least(LIMIT);
        tokio::pin!(watch);
        // A request every 6 s, each answered at once: never 10 s without one.
        for _ in 0..5 {
            assert!(
                tokio::time::timeout(Duration::from_secs(6), &mut watch)
                    .await
                    .is_err(),
                "ended while requests kept coming"
            );
            drop(Idle::opened(&idle));
        }
        let last = Instant::now();
        watch.await;
        assert_eq!(last.elapsed(), LIMIT);
    }

    #[tokio::test(start_paused = true)]
    async fn two_open_requests_keep_it_busy_until_both_close() {
        let idle = Idle::new();
        let (a, b) = (Idle::opened(&idle), Idle::opened(&idle));
        let watch = idle.for_at_least(LIMIT);
        tokio::pin!(watch);
        drop(a);
        assert!(tokio::time::timeout(LIMIT * 2, &mut watch).await.is_err());
        drop(b);
        let closed = Instant::now();
        watch.await;
        assert_eq!(closed.elapsed(), LIMIT);
    }
}
