//! A group's FIFO queue and its *turn*.
//!
//! Requests leave in arrival order. Only the request at the head holds the turn: it
//! alone looks at the clock, waits for a pause to end, for its slot and for a permit
//! ([`super::Group`]). Everyone else waits on a one-shot channel, so a group with
//! 10 000 waiting requests has one timer, not 10 000, and a waiter that goes away
//! (client gone, `max_wait` reached) just leaves the map.
//!
//! A request the upstream refused is retried ahead of everyone else: its key ranks
//! before every first attempt. A head that finds one ahead of it steps aside.
//!
//! In a group with `fair_by`, first attempts are ordered by their flow's tag
//! ([`super::fair`]) before their arrival: the same map, the same head.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::fair::{Flow, Flows};
use super::permits::Held;
use super::{Group, Refusal};

/// A place in the queue: `(rank, fair tag, arrival order)`; a smaller key goes first.
/// The tag is 0 in a group without `fair_by`, so that queue is FIFO.
pub type Key = (i8, u64, u64);

/// The rank of requests retried after a push-back: ahead of everyone else.
const RETRY: i8 = -1;
/// The rank of requests on their first attempt.
const FIRST: i8 = 0;

/// The requests of one group that have not left yet.
#[derive(Default)]
pub struct Queue {
    waiting: BTreeMap<Key, Waiter>,
    next_seq: u64,
    turn_taken: bool,
    /// Requests in the queue: waiting, plus the head.
    len: usize,
    /// Their total cost, for the `Retry-After` estimate.
    cost: u64,
    /// The cost of the request holding the turn (0 when none does).
    head_cost: u64,
    /// The flows waiting, in a group with `fair_by`.
    flows: Flows,
}

/// A request waiting for the turn, as the head sees it.
struct Waiter {
    tx: oneshot::Sender<Turn>,
    cost: u32,
    /// When it joined: it is not counted as leaving before that.
    joined: Instant,
    /// When its `max_wait` runs out, if it does.
    deadline: Option<Instant>,
}

/// What a waiting request receives when the requests ahead of it have gone.
pub enum Turn {
    /// The turn: it is the head now, and waits for its own slot.
    Take,
    /// Its slot had come when the head before it left: that head counted its
    /// departure and sends the permit it holds in flight.
    Leave(Held),
    /// The wait ahead of it (a pause that began meanwhile) outlasts its `max_wait`:
    /// it is refused now, with this estimate of when a request could leave.
    Refuse(std::time::Duration),
}

impl Queue {
    /// Requests in the queue (waiting, and the head).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no request is in the queue.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The cost queued ahead of a request of `cost` in `flow` that joins now: the
    /// whole queue's, or in a fair queue about what leaves before its tag.
    pub fn cost_ahead(&self, flow: Option<Flow>, cost: u32) -> u64 {
        match flow {
            // The head's cost is its flow's until it leaves.
            Some(flow) => self.flows.cost_ahead(flow, cost),
            None => self.cost,
        }
    }

    /// The flows with the most requests waiting (`(id, waiting, weight)`), at most `n`.
    pub fn busiest_flows(&self, n: usize) -> Vec<(u64, u32, u32)> {
        self.flows.busiest(n)
    }

    /// The cost and joining time of the first request waiting behind the head.
    pub fn front(&self) -> Option<(u32, Instant)> {
        let (_, waiter) = self.waiting.first_key_value()?;
        Some((waiter.cost, waiter.joined))
    }

    /// Sends the first waiting request on its way with `held`. `Err` gives the permit
    /// back when that request is already gone (it removes itself from the map before
    /// dropping its receiver, so this does not happen while the lock is held).
    pub fn release_front(&mut self, held: Held) -> Result<(), Held> {
        let Some((key, waiter)) = self.waiting.pop_first() else {
            return Err(held);
        };
        self.flows.started(key.1);
        waiter
            .tx
            .send(Turn::Leave(held))
            .map_err(|turn| match turn {
                Turn::Leave(held) => held,
                Turn::Take | Turn::Refuse(_) => unreachable!("sent a release"),
            })
    }

    /// Refuses, in queue order, the waiting requests whose departure `eta` (given the
    /// cost queued ahead of each, the head's included) estimates after their
    /// deadline: they would only wait to be refused. Returns how many.
    pub fn refuse_hopeless(&mut self, eta: impl Fn(u64) -> Instant) -> u64 {
        let mut ahead = self.head_cost;
        let mut hopeless = Vec::new();
        for (key, waiter) in &self.waiting {
            ahead += u64::from(waiter.cost);
            let at = eta(ahead - u64::from(waiter.cost));
            if waiter.deadline.is_some_and(|deadline| at > deadline) {
                hopeless.push((*key, at));
            }
        }
        let now = Instant::now();
        let mut refused = 0;
        for (key, at) in hopeless {
            if let Some(waiter) = self.waiting.remove(&key) {
                // Gone already: it removes itself, and was counted then.
                if waiter.tx.send(Turn::Refuse(at - now)).is_ok() {
                    refused += 1;
                }
            }
        }
        refused
    }

    /// Whether a retried request waits ahead of `key`.
    pub fn retry_ahead_of(&self, key: Key) -> bool {
        self.waiting.keys().next().is_some_and(|first| *first < key)
    }

    /// Takes the next key of a rank, with its fair `tag`.
    fn key(&mut self, front: bool, tag: u64) -> Key {
        let seq = self.next_seq;
        self.next_seq += 1;
        (if front { RETRY } else { FIRST }, tag, seq)
    }

    fn wait(&mut self, key: Key, cost: u32, joined: Instant, deadline: Option<Instant>) -> Stage {
        let (tx, rx) = oneshot::channel();
        let waiter = Waiter {
            tx,
            cost,
            joined,
            deadline,
        };
        self.waiting.insert(key, waiter);
        Stage::Waiting(rx)
    }

    /// Passes the turn to the first waiter still there, or frees it.
    fn pass_turn(&mut self) {
        while let Some((key, next)) = self.waiting.pop_first() {
            if next.tx.send(Turn::Take).is_ok() {
                self.flows.started(key.1);
                return;
            }
        }
        self.turn_taken = false;
    }
}

/// Where one request is in its group's queue. Dropping it leaves the queue (the
/// client went, or `max_wait` passed) and keeps the queue consistent.
pub struct Place {
    group: Arc<Group>,
    /// The request's cost.
    pub cost: u32,
    /// Its tokens, in a group that counts them.
    pub tokens: Option<crate::llm::Tokens>,
    /// Its flow, in a group with `fair_by`.
    flow: Option<Flow>,
    /// When it joined: from then on only the group held it back.
    pub joined: Instant,
    /// Its position.
    pub key: Key,
    /// When its `max_wait` runs out, if it does.
    pub deadline: Option<Instant>,
    stage: Stage,
}

enum Stage {
    /// Waiting under `key` until the turn, or its release, arrives.
    Waiting(oneshot::Receiver<Turn>),
    /// Holding the turn.
    HasTurn,
    /// Released by the head before it: its departure is counted, the turn is not its.
    Released,
    /// Out of the queue.
    Gone,
}

impl Place {
    /// Joins `group`'s queue (at the front for a retry, which the `queue` bound does not
    /// refuse: it was admitted before), taking the turn when nobody is ahead.
    pub fn join(
        group: &Arc<Group>,
        cost: super::tokens::Cost,
        front: bool,
        deadline: Option<Instant>,
    ) -> Result<Place, Refusal> {
        let joined = Instant::now();
        let (tokens, flow, cost) = (cost.tokens, cost.flow, cost.requests);
        let mut state = group.lock();
        let queue = &mut state.queue;
        let settings = group.settings();
        let flow_full = flow.filter(|_| !front).is_some_and(|flow| {
            let bound = settings.keys.flow_queue.unwrap_or(settings.queue);
            queue.flows.waiting(flow.id) as usize >= bound
        });
        if flow_full || (!front && queue.len >= settings.queue) {
            drop(state);
            group.metrics.queue_full.inc();
            let retry_after = group.estimate_wait(true, flow);
            return Err(match flow_full {
                true => Refusal::FlowQueueFull { retry_after },
                false => Refusal::QueueFull { retry_after },
            });
        }
        queue.len += 1;
        queue.cost += u64::from(cost);
        group.metrics.queue_depth.inc();
        let tag = match flow {
            Some(flow) => queue.flows.join(flow, cost, front),
            None => queue.flows.unflowed(),
        };
        let key = queue.key(front, tag);
        let stage = if !queue.turn_taken && queue.waiting.is_empty() {
            queue.turn_taken = true;
            queue.flows.started(tag);
            queue.head_cost = u64::from(cost);
            Stage::HasTurn
        } else {
            queue.wait(key, cost, joined, deadline)
        };
        Ok(Place {
            group: group.clone(),
            cost,
            tokens,
            flow,
            joined,
            key,
            deadline,
            stage,
        })
    }

    /// Waits until the requests ahead have gone: `Some` with the permit when the head
    /// before it released it (it may leave now), `None` when it holds the turn; the
    /// refusal when the wait ahead outlasts its `max_wait`.
    pub async fn wait_for_turn(&mut self) -> Result<Option<Held>, std::time::Duration> {
        let Stage::Waiting(rx) = &mut self.stage else {
            return Ok(None);
        };
        // The sender is dropped only after a send, or by this place's own `leave`.
        match rx.await {
            Ok(Turn::Leave(held)) => {
                self.stage = Stage::Released;
                Ok(Some(held))
            }
            Ok(Turn::Refuse(eta)) => {
                // Out of the map already, and not holding the turn.
                self.stage = Stage::Released;
                Err(eta)
            }
            Ok(Turn::Take) | Err(_) => {
                self.stage = Stage::HasTurn;
                self.group.lock().queue.head_cost = u64::from(self.cost);
                Ok(None)
            }
        }
    }

    /// Hands the turn to the retried request ahead and waits right behind it: ahead of
    /// every first attempt, as the head it was.
    pub fn step_aside(&mut self) {
        let mut state = self.group.lock();
        let queue = &mut state.queue;
        self.key = queue.key(true, 0);
        self.stage = queue.wait(self.key, self.cost, self.joined, self.deadline);
        queue.head_cost = 0;
        queue.pass_turn();
    }

    /// Leaves the queue: the request departed, or was refused.
    pub fn leave(&mut self) {
        let mut state = self.group.lock();
        let queue = &mut state.queue;
        match std::mem::replace(&mut self.stage, Stage::Gone) {
            Stage::Gone => return,
            Stage::Waiting(mut rx) => {
                // Still in the map: it never got the turn. Gone from it: the turn was
                // sent just now and must be passed on; or it was released, and its
                // slot is spent with its permit, as for any request that goes after
                // leaving the queue.
                if queue.waiting.remove(&self.key).is_none() {
                    match rx.try_recv() {
                        Ok(Turn::Leave(_) | Turn::Refuse(_)) => {}
                        Ok(Turn::Take) | Err(_) => queue.pass_turn(),
                    }
                }
            }
            Stage::HasTurn => {
                queue.head_cost = 0;
                queue.pass_turn();
            }
            Stage::Released => {}
        }
        queue.len -= 1;
        queue.cost -= u64::from(self.cost);
        if let Some(flow) = self.flow {
            queue.flows.left(flow.id, self.cost);
        }
        if queue.len == 0 {
            queue.flows.restart();
        }
        self.group.metrics.queue_depth.dec();
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if !matches!(self.stage, Stage::Gone) {
            self.group.metrics.cancelled.inc();
            self.leave();
        }
    }
}
