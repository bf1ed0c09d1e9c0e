//! Departures per second over the last minute, per group, for the dashboard's chart.
//!
//! The admin listener samples each group's `admitted` counter once a second and keeps
//! the differences here, so a page opened now draws the last minute at once and the
//! request path pays nothing (it only bumps the counter it bumps anyway).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Seconds of history kept per group.
pub const SECONDS: usize = 60;

/// Groups followed at most: unlisted hosts each make a group, and a dashboard of
/// thousands of charts helps nobody; the rest still show their counters.
pub const MAX_GROUPS: usize = 1000;

/// One group's last counter value and the departures of each second since.
#[derive(Debug, Default)]
struct Ring {
    last: u64,
    per_second: VecDeque<u64>,
}

/// The rings of all followed groups.
#[derive(Debug, Default)]
pub struct History {
    rings: Mutex<HashMap<Arc<str>, Ring>>,
}

impl History {
    /// Records one second: `counts` are the groups' `admitted` counters now. A group
    /// seen for the first time starts with no history; a group no longer listed is
    /// forgotten.
    pub fn record(&self, counts: impl IntoIterator<Item = (Arc<str>, u64)>) {
        let mut rings = self.lock();
        let mut next = HashMap::with_capacity(rings.len());
        for (name, count) in counts.into_iter().take(MAX_GROUPS) {
            let ring = match rings.remove(&name) {
                Some(mut ring) => {
                    // A counter that went back (a group evicted and rebuilt) counts
                    // from zero again.
                    let departed = count.checked_sub(ring.last).unwrap_or(count);
                    if ring.per_second.len() == SECONDS {
                        ring.per_second.pop_front();
                    }
                    ring.per_second.push_back(departed);
                    ring.last = count;
                    ring
                }
                None => Ring {
                    last: count,
                    per_second: VecDeque::with_capacity(SECONDS),
                },
            };
            next.insert(name, ring);
        }
        *rings = next;
    }

    /// Departures in each of the last seconds of `group`, oldest first (empty for a
    /// group not followed yet).
    pub fn per_second(&self, group: &str) -> Vec<u64> {
        self.lock()
            .get(group)
            .map(|r| r.per_second.iter().copied().collect())
            .unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Ring>> {
        // Plain numbers: valid after any panic of a holder.
        self.rings.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(history: &History, counts: &[(&str, u64)]) {
        history.record(counts.iter().map(|(n, c)| (Arc::from(*n), *c)));
    }

    #[test]
    fn differences_per_second() {
        let h = History::default();
        at(&h, &[("a", 10)]);
        assert_eq!(h.per_second("a"), Vec::<u64>::new());
        at(&h, &[("a", 15), ("b", 0)]);
        at(&h, &[("a", 15), ("b", 3)]);
        at(&h, &[("a", 22), ("b", 3)]);
        assert_eq!(h.per_second("a"), vec![5, 0, 7]);
        assert_eq!(h.per_second("b"), vec![3, 0]);
        assert_eq!(h.per_second("unknown"), Vec::<u64>::new());
    }

    #[test]
    fn keeps_the_last_minute_only() {
        let h = History::default();
        for second in 0..=(SECONDS as u64 + 10) {
            at(&h, &[("a", second * second)]);
        }
        let kept = h.per_second("a");
        assert_eq!(kept.len(), SECONDS);
        // The newest second: n² - (n-1)² = 2n - 1.
        let n = SECONDS as u64 + 10;
        assert_eq!(kept.last(), Some(&(2 * n - 1)));
    }

    #[test]
    fn forgets_removed_groups_and_restarts_reset_counters() {
        let h = History::default();
        at(&h, &[("a", 5), ("b", 5)]);
        at(&h, &[("a", 8)]);
        assert_eq!(h.per_second("b"), Vec::<u64>::new());
        // "b" comes back as a new group: no history until its second sample.
        at(&h, &[("a", 2), ("b", 1)]);
        assert_eq!(h.per_second("a"), vec![3, 2]);
        assert_eq!(h.per_second("b"), Vec::<u64>::new());
    }

    #[test]
    fn follows_a_bounded_number_of_groups() {
        let h = History::default();
        let names: Vec<String> = (0..MAX_GROUPS + 5).map(|i| format!("g{i}")).collect();
        for _ in 0..2 {
            h.record(names.iter().map(|n| (Arc::from(n.as_str()), 1)));
        }
        assert_eq!(h.lock().len(), MAX_GROUPS);
        assert_eq!(h.per_second("g0"), vec![0]);
        assert_eq!(h.per_second(&names[MAX_GROUPS]), Vec::<u64>::new());
    }
}
