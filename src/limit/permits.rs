//! Concurrency: how many of a group's requests may be in flight at once.
//!
//! A request takes a permit when it leaves the queue and holds it until its response
//! body ends (or its tunnel closes). Permits are local (tokio's FIFO semaphore), or
//! with `shared_concurrency` leases in Redis counted across every replica; while Redis
//! is down a replica keeps to its share by taking `replicas` local permits a request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::redis::{Lease, Redis};
use super::{Group, Refusal};
use crate::config::OnBackendError;

/// Waiting for a shared lease: the first and the longest pause between looks.
const LEASE_POLL_MIN: Duration = Duration::from_millis(5);
const LEASE_POLL_MAX: Duration = Duration::from_millis(100);

/// A group's concurrency permits.
pub struct Permits {
    local: Arc<Semaphore>,
    concurrency: AtomicUsize,
    /// Where leases are taken, with `shared_concurrency` on the Redis store.
    leases: Option<Arc<Redis>>,
}

/// What a request in flight holds.
pub enum Held {
    /// Local permits (one, or a replica's share while Redis is down).
    Local(#[allow(dead_code)] OwnedSemaphorePermit),
    /// A lease in Redis, given back when dropped.
    Lease(#[allow(dead_code)] Lease),
}

impl Permits {
    /// `concurrency` permits, as leases in `leases` when given.
    pub fn new(concurrency: usize, leases: Option<Arc<Redis>>) -> Permits {
        Permits {
            local: Arc::new(Semaphore::new(concurrency)),
            concurrency: AtomicUsize::new(concurrency),
            leases,
        }
    }

    /// Changes the number of permits (a reload). More are free at once; fewer are
    /// taken out of use as requests in flight give theirs back.
    pub fn resize(&self, concurrency: usize) {
        let old = self.concurrency.swap(concurrency, Ordering::Relaxed);
        if concurrency > old {
            self.local.add_permits(concurrency - old);
        } else if old > concurrency {
            let surplus = (old - concurrency) as u32;
            let local = self.local.clone();
            tokio::spawn(async move {
                if let Ok(taken) = local.acquire_many_owned(surplus).await {
                    taken.forget();
                }
            });
        }
    }

    /// A local permit if one is free right now; `None` when leases are shared (taking
    /// one is a round trip).
    pub fn try_now(&self) -> Option<Held> {
        if self.leases.is_some() {
            return None;
        }
        self.local.clone().try_acquire_owned().ok().map(Held::Local)
    }

    /// Waits for a permit of `group`: a local one, or a lease.
    pub async fn acquire(&self, group: &str) -> Result<Held, Refusal> {
        let Some(redis) = &self.leases else {
            return Ok(self.local(1).await);
        };
        let mut poll = LEASE_POLL_MIN;
        loop {
            // Boxed, as the booking in `Store::book`.
            let concurrency = self.concurrency.load(Ordering::Relaxed);
            match Box::pin(redis.try_lease(group, concurrency)).await {
                Some(Some(lease)) => return Ok(Held::Lease(lease)),
                // Every lease is taken, on some replica: look again shortly.
                Some(None) => {
                    tokio::time::sleep(poll).await;
                    poll = (poll * 2).min(LEASE_POLL_MAX);
                }
                None if redis.on_error == OnBackendError::Deny => return Err(Refusal::BackendDown),
                None => {
                    let share = redis.replicas().min(concurrency as u32);
                    return Ok(self.local(share).await);
                }
            }
        }
    }

    async fn local(&self, count: u32) -> Held {
        let acquired = self.local.clone().acquire_many_owned(count).await;
        Held::Local(acquired.expect("the semaphore is never closed"))
    }
}

/// A request in flight: dropping it gives its permit back (when the response body
/// ends, or the tunnel closes).
pub struct Permit {
    _held: Held,
    group: Arc<Group>,
}

impl Permit {
    pub(super) fn new(held: Held, group: Arc<Group>) -> Permit {
        group.took_permit();
        Permit { _held: held, group }
    }

    /// The group this permit belongs to.
    pub fn group(&self) -> &Arc<Group> {
        &self.group
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.group.gave_permit_back();
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Permit({})", self.group.name)
    }
}

#[cfg(test)]
impl Permits {
    /// Local permits free now.
    pub fn available(&self) -> usize {
        self.local.available_permits()
    }
}
