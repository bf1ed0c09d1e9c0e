//! Fair queueing within one budget (docs/keys.md): weighted fair queueing by virtual
//! finish times, pure.
//!
//! A group with `fair_by` sorts its queue by a *tag* instead of arrival alone. Each
//! flow (a value of `fair_by`) has a finish time, in virtual time; a request that
//! joins starts at the later of the flow's finish and the group's virtual time (the
//! tag of the request that last took the turn), and finishes `cost / weight` after
//! that. Requests leave in tag order, arrival order breaking ties. So:
//!
//! * one flow's requests keep their arrival order (its tags only grow);
//! * while several flows wait, each leaves `weight` requests per round of virtual
//!   time: a flow of weight 3 leaves three for each of a weight-1 flow's;
//! * a flow that arrives behind a flood starts at the virtual time, not behind the
//!   flood's last tag, and a flow that was idle banks no credit (its start is never
//!   earlier than the virtual time).
//!
//! Virtual finish times rather than deficit round robin: the queue already is one
//! ordered map with one head that alone waits for the slot, and a tag is one more
//! number in the map's key, so the head, the release of the requests right behind it,
//! the refusal of hopeless waiters and `max_wait` all work unchanged. Deficit round
//! robin would need a queue per flow and a ring of flows beside it.

use std::collections::HashMap;

/// Virtual time per unit of cost at weight 1: fine enough that weights up to 1000
/// stay distinct.
const UNIT: u64 = 1 << 20;

/// The flow a request is queued in, by its `fair_by` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// The first 8 bytes of the value's SHA-256.
    pub id: u64,
    /// Its share of departures while other flows wait too.
    pub weight: u32,
}

/// The flows of one group's queue.
#[derive(Debug, Default)]
pub struct Flows {
    /// The tag of the request that last took the turn, or left right behind it.
    now: u64,
    /// The highest tag given since the queue was last empty: a request without a flow
    /// (its group's `fair_by` removed by a reload) is tagged so, behind those before it.
    highest: u64,
    /// The flows with requests in the queue; a flow leaves the map with its last.
    flows: HashMap<u64, FlowState>,
    /// The cost and the weight of all flows together, for [`Flows::cost_ahead`].
    cost: u64,
    weight: u64,
}

#[derive(Debug)]
struct FlowState {
    /// The tag of its last request to join.
    finish: u64,
    /// Its requests in the queue.
    waiting: u32,
    /// Their cost.
    cost: u64,
    weight: u32,
}

impl Flows {
    /// A request of `flow` costing `cost` joins: its tag. A retry (`front`) is charged
    /// nothing again: it goes ahead of every flow, by rank, and is only counted.
    pub fn join(&mut self, flow: Flow, cost: u32, front: bool) -> u64 {
        let now = self.now;
        let state = self.flows.entry(flow.id).or_insert(FlowState {
            finish: now,
            waiting: 0,
            cost: 0,
            weight: flow.weight,
        });
        if state.waiting == 0 {
            self.weight += u64::from(flow.weight);
        }
        state.waiting += 1;
        state.cost += u64::from(cost);
        self.cost += u64::from(cost);
        if front {
            return 0;
        }
        let step = u64::from(cost) * UNIT / u64::from(state.weight);
        state.finish = state.finish.max(now).saturating_add(step);
        self.highest = self.highest.max(state.finish);
        state.finish
    }

    /// The tag of a first attempt without a flow: behind every tag given so far, and 0
    /// in a group that never had flows, so that its queue is FIFO.
    pub fn unflowed(&self) -> u64 {
        self.highest
    }

    /// A request of flow `id` left the queue.
    pub fn left(&mut self, id: u64, cost: u32) {
        if let Some(state) = self.flows.get_mut(&id) {
            state.waiting -= 1;
            state.cost -= u64::from(cost);
            self.cost -= u64::from(cost);
            if state.waiting == 0 {
                self.weight -= u64::from(state.weight);
                self.flows.remove(&id);
            }
        }
    }

    /// The queue is empty: virtual time starts again from 0, so it never runs out.
    pub fn restart(&mut self) {
        debug_assert!(self.flows.is_empty());
        self.now = 0;
        self.highest = 0;
    }

    /// The request tagged `tag` took the turn (or left behind the head): virtual time
    /// moves on to it.
    pub fn started(&mut self, tag: u64) {
        self.now = self.now.max(tag);
    }

    /// Requests of flow `id` in the queue.
    pub fn waiting(&self, id: u64) -> u32 {
        self.flows.get(&id).map_or(0, |s| s.waiting)
    }

    /// About the cost that leaves before a request of `flow` costing `cost` that
    /// joins now: all of its own flow's, and of the other flows what their weight
    /// leaves in the virtual time until this one's tag. In O(1), under the group's
    /// lock: the other flows are taken together.
    pub fn cost_ahead(&self, flow: Flow, cost: u32) -> u64 {
        let own = self.flows.get(&flow.id);
        let (own_cost, own_weight) = own.map_or((0, 0), |s| (s.cost, u64::from(s.weight)));
        let start = own.map_or(self.now, |s| s.finish.max(self.now));
        let tag = start.saturating_add(u64::from(cost) * UNIT / u64::from(flow.weight));
        let span = u128::from(tag.saturating_sub(self.now));
        let (others_cost, others_weight) = (self.cost - own_cost, self.weight - own_weight);
        let share = span * u128::from(others_weight) / u128::from(UNIT);
        own_cost + others_cost.min(u64::try_from(share).unwrap_or(u64::MAX))
    }

    /// The flows with the most requests waiting, at most `n`: `(id, waiting, weight)`.
    pub fn busiest(&self, n: usize) -> Vec<(u64, u32, u32)> {
        let mut all: Vec<_> = (self.flows.iter())
            .map(|(id, s)| (*id, s.waiting, s.weight))
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        all.truncate(n);
        all
    }

    /// How many flows have requests in the queue.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.flows.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, VecDeque};

    fn flow(id: u64, weight: u32) -> Flow {
        Flow { id, weight }
    }

    /// A queue of `(flow, cost)` arrivals run through the tags: the order of departure.
    /// Each arrival is `(at departure number, flow, weight, cost)`: it joins once that
    /// many requests have left.
    fn schedule(arrivals: &[(usize, u64, u32, u32)]) -> Vec<(u64, usize)> {
        let mut flows = Flows::default();
        let mut queue: BTreeMap<(u64, u64), (u64, usize, u32)> = BTreeMap::new();
        let mut pending: VecDeque<_> = arrivals.iter().enumerate().collect();
        let mut order = Vec::new();
        let mut seq = 0;
        loop {
            while let Some((i, &(at, id, weight, cost))) = pending.front().copied() {
                if at > order.len() {
                    break;
                }
                pending.pop_front();
                let tag = flows.join(flow(id, weight), cost, false);
                queue.insert((tag, seq), (id, i, cost));
                seq += 1;
            }
            let Some(((tag, _), (id, i, cost))) = queue.pop_first() else {
                if pending.is_empty() {
                    return order;
                }
                order.push((u64::MAX, usize::MAX));
                continue;
            };
            flows.started(tag);
            flows.left(id, cost);
            order.push((id, i));
        }
    }

    #[test]
    fn a_late_flow_does_not_wait_behind_a_flood() {
        // Flow 1 queues 300; flow 2 sends 10 once 10 have left.
        let mut arrivals: Vec<_> = (0..300).map(|_| (0, 1, 1, 1)).collect();
        arrivals.extend((0..10).map(|_| (10, 2, 1, 1)));
        let order = schedule(&arrivals);
        let last_of_2 = order.iter().rposition(|(id, _)| *id == 2).unwrap();
        // Alternating from the 11th departure: the 10th of flow 2 leaves 20 later.
        assert!(last_of_2 <= 10 + 20, "{last_of_2}");
        assert_eq!(order.iter().filter(|(id, _)| *id == 1).count(), 300);
    }

    #[test]
    fn weights_are_honoured_within_one_round() {
        let mut arrivals: Vec<_> = (0..40).map(|_| (0, 1, 1, 1)).collect();
        arrivals.extend((0..40).map(|_| (0, 2, 3, 1)));
        let order = schedule(&arrivals);
        // In every window of 4 departures while both wait: 3 of flow 2, 1 of flow 1.
        for window in order[..52].chunks(4) {
            let twos = window.iter().filter(|(id, _)| *id == 2).count();
            assert_eq!(twos, 3, "{window:?}");
        }
    }

    #[test]
    fn costs_count_against_the_flow() {
        // Flow 1 sends requests of cost 3, flow 2 of cost 1: flow 2 leaves three for
        // each of flow 1's.
        let mut arrivals: Vec<_> = (0..10).map(|_| (0, 1, 1, 3)).collect();
        arrivals.extend((0..30).map(|_| (0, 2, 1, 1)));
        let order = schedule(&arrivals);
        let ones: Vec<usize> = (order.iter().enumerate())
            .filter(|(_, (id, _))| *id == 1)
            .map(|(at, _)| at)
            .collect();
        for pair in ones.windows(2) {
            assert_eq!(pair[1] - pair[0], 4, "{ones:?}");
        }
    }

    /// A small deterministic generator, so the property runs are reproducible.
    fn next(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    fn no_flow_starves_and_each_keeps_its_order() {
        let mut seed = 0x2545_f491_4f6c_dd1d;
        for _ in 0..200 {
            let n = 20 + next(&mut seed) % 200;
            let arrivals: Vec<_> = (0..n)
                .map(|i| {
                    let id = next(&mut seed) % 5;
                    let at = (i as usize).saturating_sub((next(&mut seed) % 30) as usize);
                    (
                        at.min(i as usize / 2),
                        id,
                        1 + (id as u32 % 3),
                        1 + (next(&mut seed) % 3) as u32,
                    )
                })
                .collect();
            let order = schedule(&arrivals);
            let left: Vec<_> = order.iter().filter(|(id, _)| *id != u64::MAX).collect();
            assert_eq!(left.len(), arrivals.len(), "everyone leaves");
            for id in 0..5 {
                let mine: Vec<usize> = left
                    .iter()
                    .filter(|(f, _)| *f == id)
                    .map(|(_, i)| *i)
                    .collect();
                assert!(mine.windows(2).all(|w| w[0] < w[1]), "flow {id}: {mine:?}");
            }
            // While a flow waits, at most (sum of weights / its weight) × its cost of
            // others leave between two of its departures (here at most 3 × 3 × 5).
            for id in 0..5 {
                let at: Vec<usize> = (order.iter().enumerate())
                    .filter(|(_, (f, _))| *f == id)
                    .map(|(k, _)| k)
                    .collect();
                for w in at.windows(2) {
                    assert!(w[1] - w[0] <= 45, "flow {id} starved: {at:?}");
                }
            }
        }
    }

    #[test]
    fn the_estimate_counts_the_flows_share() {
        let mut flows = Flows::default();
        for _ in 0..300 {
            flows.join(flow(1, 1), 1, false);
        }
        // A new flow of weight 1: about one of flow 1's before it.
        assert_eq!(flows.cost_ahead(flow(2, 1), 1), 1);
        // Of weight 3: none of flow 1's for its first (1/3 of a round).
        assert_eq!(flows.cost_ahead(flow(2, 3), 1), 0);
        // Flow 1 itself waits behind all of its own.
        assert_eq!(flows.cost_ahead(flow(1, 1), 1), 300);
        for _ in 0..10 {
            flows.join(flow(2, 1), 1, false);
        }
        // Its 11th: its own 10, and 11 of flow 1's.
        assert_eq!(flows.cost_ahead(flow(2, 1), 1), 21);
    }

    #[test]
    fn a_flow_leaves_the_map_with_its_last_request() {
        let mut flows = Flows::default();
        let tag = flows.join(flow(7, 1), 2, false);
        flows.join(flow(7, 1), 1, true);
        assert_eq!((flows.waiting(7), flows.len()), (2, 1));
        flows.started(tag);
        flows.left(7, 2);
        flows.left(7, 1);
        assert_eq!(flows.len(), 0);
    }
}
