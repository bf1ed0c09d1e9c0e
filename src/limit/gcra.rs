//! GCRA (generic cell rate algorithm): the whole rate decision as two pure functions.
//!
//! A rate of `limit` per `period` has an emission interval `T = period / limit`; a burst
//! of `b` gives a tolerance `tau = T·(b−1)`. The state is one *theoretical arrival time*
//! (TAT): when the budget would be back to empty if everything sent so far had been sent
//! exactly at the pace. Times are offsets from an epoch chosen by the store (the memory
//! store's start, or Redis's own clock), so the same arithmetic serves both.
//!
//! tollgate waits instead of refusing, so the functions answer "when may this request
//! leave?" rather than "may it leave now?". A request of cost `n` leaves as soon as the
//! pace allows one cell (`TAT − tau`) and then advances the TAT by `n·T`, so the requests
//! behind it wait for its weight. A request heavier than the burst therefore never waits
//! for its own weight on an idle upstream; the most any window sees is
//! `rate·window + burst + (n − 1)`.
//!
//! The answer is stable: asked again at the time it gave, [`Gcra::earliest`] answers that
//! same time, which lets the head of a queue re-check after sleeping (a pause may have
//! begun meanwhile) without ever pushing itself back.

use std::time::Duration;

/// One rate in GCRA terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    /// Emission interval T: the pace, one cell every `interval`.
    pub interval: Duration,
    /// Tolerance tau = T·(burst−1): how far ahead of the pace requests may run.
    pub tolerance: Duration,
}

impl Gcra {
    /// The GCRA of `limit` requests per `period` with `burst` back-to-back after idle.
    pub fn new(limit: u64, period: Duration, burst: u32) -> Gcra {
        let interval = period / limit.clamp(1, u32::MAX as u64) as u32;
        Gcra {
            interval,
            tolerance: interval * burst.saturating_sub(1),
        }
    }

    /// Requests per second.
    pub fn per_second(&self) -> f64 {
        1.0 / self.interval.as_secs_f64().max(1e-9)
    }

    /// This rate slowed down by `factor` (0 < factor ≤ 1), same burst.
    pub fn scaled(&self, factor: f64) -> Gcra {
        let burst_cells = self.tolerance.as_secs_f64() / self.interval.as_secs_f64();
        let interval = self.interval.div_f64(factor.clamp(1e-6, 1.0));
        Gcra {
            interval,
            tolerance: interval.mul_f64(burst_cells),
        }
    }

    /// The earliest time a request may leave, given the `tat` and `now`.
    pub fn earliest(&self, tat: Duration, now: Duration) -> Duration {
        now.max(tat.saturating_sub(self.tolerance))
    }

    /// The TAT after a request of `cost` cells leaves at `depart` (≥ its `earliest`).
    ///
    /// When another rate held the request back, `depart` is later than this rate asked
    /// for; the cells are then counted from `depart`, so this rate never sees a burst
    /// bigger than its own tolerance after another rate's wait.
    pub fn advance(&self, tat: Duration, depart: Duration, cost: u32) -> Duration {
        tat.max(depart) + self.interval * cost
    }
}

/// When a request may leave under *all* of `rates`, whose TATs are `tats`.
pub fn earliest_all(rates: &[Gcra], tats: &[Duration], now: Duration) -> Duration {
    rates
        .iter()
        .zip(tats)
        .map(|(rate, tat)| rate.earliest(*tat, now))
        .fold(now, Duration::max)
}

/// Records a departure at `depart` in every rate's TAT.
pub fn advance_all(rates: &[Gcra], tats: &mut [Duration], depart: Duration, cost: u32) {
    for (rate, tat) in rates.iter().zip(tats) {
        *tat = rate.advance(*tat, depart, cost);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Sends `count` requests of `cost`, all offered at time 0, one after the other as
    /// soon as allowed; returns their departure times in ms.
    fn schedule(rates: &[Gcra], count: usize, cost: u32) -> Vec<u128> {
        let mut tats = vec![Duration::ZERO; rates.len()];
        let mut now = Duration::ZERO;
        (0..count)
            .map(|_| {
                let depart = earliest_all(rates, &tats, now);
                advance_all(rates, &mut tats, depart, cost);
                now = depart;
                depart.as_millis()
            })
            .collect()
    }

    #[test]
    fn burst_one_paces_every_interval() {
        let r = Gcra::new(10, Duration::from_secs(1), 1);
        assert_eq!(r.interval, 100 * MS);
        assert_eq!(schedule(&[r], 4, 1), [0, 100, 200, 300]);
    }

    #[test]
    fn burst_lets_that_many_leave_at_once_then_paces() {
        let r = Gcra::new(10, Duration::from_secs(1), 3);
        assert_eq!(schedule(&[r], 6, 1), [0, 0, 0, 100, 200, 300]);
    }

    #[test]
    fn idle_time_refills_the_burst_but_no_more() {
        let r = Gcra::new(10, Duration::from_secs(1), 3);
        let mut tat = Duration::ZERO;
        for _ in 0..3 {
            tat = r.advance(tat, Duration::ZERO, 1);
        }
        // 10 s idle: the burst is back, but only the burst.
        let now = Duration::from_secs(10);
        let mut departs = vec![];
        let mut t = now;
        for _ in 0..4 {
            let d = r.earliest(tat, t);
            tat = r.advance(tat, d, 1);
            t = d;
            departs.push((d - now).as_millis());
        }
        assert_eq!(departs, [0, 0, 0, 100]);
    }

    #[test]
    fn cost_advances_n_intervals() {
        let r = Gcra::new(10, Duration::from_secs(1), 5);
        // Each cost-5 request moves the TAT 500 ms; the burst (tau = 400 ms) lets the
        // next one leave once the TAT is within 400 ms of now.
        assert_eq!(schedule(&[r], 4, 5), [0, 100, 600, 1100]);
    }

    #[test]
    fn cost_above_burst_leaves_and_pushes_the_next_back() {
        let r = Gcra::new(10, Duration::from_secs(1), 1);
        // Cost 3 with no burst: leaves at once on an idle rate, then one every 300 ms.
        assert_eq!(schedule(&[r], 3, 3), [0, 300, 600]);
    }

    #[test]
    fn the_answer_is_stable_when_asked_again_at_that_time() {
        for burst in [1, 3] {
            let r = Gcra::new(10, Duration::from_secs(1), burst);
            for tat_ms in [0u64, 50, 250, 1000] {
                let tat = Duration::from_millis(tat_ms);
                let d = r.earliest(tat, Duration::from_millis(100));
                assert_eq!(r.earliest(tat, d), d);
            }
        }
    }

    #[test]
    fn several_rates_all_must_allow() {
        let per_s = Gcra::new(10, Duration::from_secs(1), 5);
        let per_2s = Gcra::new(4, Duration::from_secs(2), 1);
        let d = schedule(&[per_s, per_2s], 4, 1);
        assert_eq!(d, [0, 500, 1000, 1500]);
    }

    #[test]
    fn no_window_exceeds_rate_plus_burst() {
        // Property over many shapes: in any window of length W, at most
        // W/T + burst cells leave, plus the extra cells of one heavy request.
        for burst in [1u32, 2, 5] {
            for cost in [1u32, 2, 7] {
                let r = Gcra::new(50, Duration::from_secs(1), burst);
                let departs = schedule(&[r], 200, cost);
                let window = 1000u128;
                for (i, start) in departs.iter().enumerate() {
                    let cells: u128 = departs[i..]
                        .iter()
                        .take_while(|d| **d < start + window)
                        .count() as u128
                        * cost as u128;
                    let allowed = 50 + burst as u128 + cost as u128 - 1;
                    assert!(
                        cells <= allowed,
                        "burst {burst} cost {cost}: {cells} > {allowed}"
                    );
                }
            }
        }
    }

    #[test]
    fn slow_arrivals_leave_immediately() {
        let r = Gcra::new(10, Duration::from_secs(1), 1);
        let mut tat = Duration::ZERO;
        for i in 0..5u64 {
            let now = Duration::from_millis(150 * i);
            let d = r.earliest(tat, now);
            assert_eq!(d, now);
            tat = r.advance(tat, d, 1);
        }
    }
}
