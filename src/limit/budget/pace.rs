//! The controller: the one law that moves a group's pace on refusals and calm rounds
//! (docs/budget.md, "The controller").

use std::time::Duration;

use tokio::time::Instant;

use super::Params;

/// The fastest pace the controller climbs to, per second: far above any upstream's,
/// and far from overflowing.
const FASTEST: f64 = 1e6;

/// What a refusal found the group held to when its request left.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Held {
    /// A pace (the slowest of the configured rates, the learned pace and the window's
    /// rate), per second, and what the upstream delivered when that is a reading of
    /// its limit (see [`super::Budget::refused`]).
    Paced {
        /// The pace, per second.
        pace: f64,
        /// What the upstream delivered, per second.
        delivered: Option<f64>,
    },
    /// Nothing.
    Unpaced {
        /// What the upstream delivered, per second.
        delivered: f64,
        /// Whether it said how long to wait: then `delivered` is a rate, else only a
        /// floor.
        said: bool,
    },
}

/// The pace learned from refusals, and what moves it.
///
/// The upstream's limit lies between the fastest pace that held a calm round (`held`)
/// and the slowest one it refused (`ceiling`): a refusal returns to the one, a calm round
/// goes halfway to the other, until they are within the margin of each other.
#[derive(Debug, Clone, PartialEq)]
pub struct Pace {
    /// The pace, per second; `None` until a refusal asks for one.
    pub rate: Option<f64>,
    /// The slowest pace the upstream refused since it last held one, per second;
    /// `None`: none known (the pace grows).
    pub ceiling: Option<f64>,
    /// The fastest pace that held a calm round since, per second.
    held: Option<f64>,
    /// The pace never drops below this (`min_rate`), per second.
    floor: f64,
    /// Refusals of requests that left before then count for nothing: they were sent at
    /// an older pace, whose step was already taken.
    stepped: Option<Instant>,
    /// Answers to requests that left before then do not count towards a calm round.
    changed: Option<Instant>,
    /// Accepted answers (scaled by the replicas) in the current calm round.
    calm: f64,
    /// Accepted answers since the last refusal: the pace explores above the ceiling
    /// after `cost / (1 − margin)` of them.
    since_refusal: f64,
    /// What the last refusal cost, in requests: itself, and those its pause held back
    /// at the pace. Exploring costs at most `1 − margin` of the answers.
    cost: f64,
}

impl Pace {
    /// No pace yet; never below `floor` (per second) once there is one.
    pub fn new(floor: f64) -> Pace {
        Pace {
            rate: None,
            ceiling: None,
            held: None,
            floor,
            stepped: None,
            changed: None,
            calm: 0.0,
            since_refusal: 0.0,
            cost: 1.0,
        }
    }

    /// Sets the floor (a reload).
    pub fn set_floor(&mut self, floor: f64) {
        self.floor = floor;
        if let Some(rate) = &mut self.rate {
            *rate = rate.max(floor);
        }
    }

    /// Whether a refusal of a request that left at `sent` counts: it left under the
    /// pace in force, not before its last step.
    pub fn counts(&self, sent: Instant) -> bool {
        self.stepped.is_none_or(|at| sent >= at)
    }

    /// A request that left at `sent` was refused at `now`, the group `held` to what it
    /// was then. Returns whether the pace moved.
    pub fn refused(&mut self, p: &Params, sent: Instant, now: Instant, held: Held) -> bool {
        if !self.counts(sent) {
            return false;
        }
        let before = self.rate;
        let next = match held {
            Held::Paced { pace, delivered } => {
                let ceiling = delivered.map_or(pace, |d| d.min(pace));
                self.ceiling = Some(ceiling);
                // A pace that held calm and is refused now: the limit moved under it.
                self.held = self.held.filter(|h| *h < ceiling);
                self.held.unwrap_or(p.decrease * ceiling)
            }
            Held::Unpaced {
                delivered,
                said: true,
            } => {
                self.ceiling = Some(delivered);
                self.held = None;
                p.decrease * delivered
            }
            // A bare refusal of an unpaced burst shows only a floor to grow from.
            Held::Unpaced { delivered, .. } => {
                self.ceiling = None;
                self.held = None;
                delivered
            }
        };
        self.set(next, now);
        self.stepped = Some(now);
        self.since_refusal = 0.0;
        self.rate != before
    }

    /// The upstream accepted a request that left at `sent`, answered at `now`; the
    /// answer stands for `weight` of the group's (replicas seeing a share of them).
    /// Returns whether the pace moved.
    pub fn accepted(&mut self, p: &Params, sent: Instant, now: Instant, weight: f64) -> bool {
        let Some(rate) = self.rate else {
            return false;
        };
        self.since_refusal += weight;
        if self.changed.is_some_and(|at| sent < at) {
            return false;
        }
        self.calm += weight;
        // With no ceiling every answer is a round: the pace grows as a TCP window does,
        // once per round trip.
        let round = if self.ceiling.is_some() {
            f64::from(p.calm)
        } else {
            1.0
        };
        if self.calm < round {
            return false;
        }
        self.calm = 0.0;
        let held = self.held.map_or(rate, |h| h.max(rate));
        self.held = Some(held);
        let next = match self.ceiling {
            None => p.growth * rate,
            // Halfway to the pace refused, until the two are within the margin.
            Some(ceiling) if ceiling - held > (1.0 - p.margin) * ceiling => (held + ceiling) / 2.0,
            // Close enough: explore above it, at most once per `cost / (1 − margin)`
            // answers, so that what its refusals cost is at most `1 − margin` of them.
            Some(ceiling) if self.since_refusal >= self.cost / (1.0 - p.margin) => {
                self.since_refusal = 0.0;
                let above = ceiling / p.margin;
                self.ceiling = Some(above);
                (held + above) / 2.0
            }
            Some(_) => held,
        };
        if next == rate {
            return false;
        }
        self.set(next, now);
        true
    }

    /// The last refusal paused the group for `pause`: what it cost in requests.
    pub fn paused(&mut self, pause: Duration) {
        self.cost = 1.0 + pause.as_secs_f64() * self.rate.unwrap_or(0.0);
    }

    fn set(&mut self, rate: f64, now: Instant) {
        let rate = if rate.is_finite() { rate } else { FASTEST };
        self.rate = Some(rate.clamp(self.floor.max(1e-6), FASTEST));
        self.changed = Some(now);
        self.calm = 0.0;
    }

    /// Takes a pace another replica set (`rate`, `ceiling`), learned of at `now`: the
    /// requests this one sent before were sent at the old pace.
    pub fn adopt(&mut self, rate: Option<f64>, ceiling: Option<f64>, now: Instant) {
        let lower = match (rate, self.rate) {
            (Some(new), Some(old)) => new < old,
            (Some(_), None) => true,
            _ => false,
        };
        if lower {
            self.stepped = Some(now);
            self.since_refusal = 0.0;
        }
        if let Some(ceiling) = ceiling {
            self.held = self.held.filter(|h| *h < ceiling);
        }
        self.rate = rate;
        self.ceiling = ceiling;
        self.changed = Some(now);
        self.calm = 0.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn round(x: Option<f64>) -> Option<f64> {
        x.map(|x| (x * 1000.0).round() / 1000.0)
    }

    /// `n` accepted answers to requests sent at `at` and answered right after.
    fn accept(pace: &mut Pace, p: &Params, at: Instant, n: u32) {
        for _ in 0..n {
            pace.accepted(p, at, at, 1.0);
        }
    }

    #[test]
    fn a_paced_refusal_steps_down_once_per_episode_and_calm_rounds_bisect_to_the_limit() {
        let p = Params::default();
        let t0 = Instant::now();
        let mut pace = Pace::new(0.0);
        let paced = |pace| Held::Paced {
            pace,
            delivered: None,
        };
        // Held to 5/s by the configured rate; refused a millisecond after it left.
        let step = t0 + MS;
        assert!(pace.refused(&p, t0, step, paced(5.0)));
        assert_eq!(round(pace.rate), Some(4.5));
        // The other refusals of requests sent before the step change nothing, and their
        // answers do not count towards calm.
        assert!(!pace.refused(&p, t0, step + MS, paced(5.0)));
        accept(&mut pace, &p, t0, 10);
        assert_eq!(round(pace.rate), Some(4.5));
        // Calm rounds go halfway to the pace refused, until within 2 % of it.
        let mut rates = Vec::new();
        for k in 1..=4 {
            accept(&mut pace, &p, t0 + MS * (10 * k), p.calm);
            rates.push(round(pace.rate).unwrap());
        }
        assert_eq!(rates, [4.75, 4.875, 4.938, 4.938]);
        // Refused there at last, at a pace that had held (the limit is a little under,
        // or the noise of arrival times): a step under it, and halfway back again.
        let at = t0 + MS * 100;
        pace.refused(&p, at, at, paced(4.9375));
        assert_eq!(round(pace.rate), Some(4.444));
        assert_eq!(round(pace.ceiling), Some(4.938));
        let mut rates = Vec::new();
        for _ in 0..4 {
            accept(&mut pace, &p, at + MS, p.calm);
            rates.push(round(pace.rate).unwrap());
        }
        assert_eq!(rates, [4.691, 4.814, 4.876, 4.876]);
        // 50 answers since the refusal: it explores above the ceiling once.
        accept(&mut pace, &p, at + MS, 32);
        assert_eq!(round(pace.rate), Some(4.876));
        accept(&mut pace, &p, at + MS, 4);
        assert_eq!(round(pace.ceiling), Some(5.038));
        assert_eq!(round(pace.rate), Some(4.957));
    }

    #[test]
    fn a_refusal_far_above_the_limit_returns_to_the_pace_that_held() {
        let p = Params::default();
        let t0 = Instant::now();
        let mut pace = Pace::new(0.0);
        // Growing from a floor of 2/s: every answer a round, × 1.5.
        let floor = Held::Unpaced {
            delivered: 2.0,
            said: false,
        };
        pace.refused(&p, t0, t0, floor);
        for k in 1..=3 {
            accept(&mut pace, &p, t0 + MS * k, 1);
        }
        assert_eq!(round(pace.rate), Some(6.75));
        // Refused at 6.75: back to 4.5, which held, and halfway from there.
        let refused = Held::Paced {
            pace: 6.75,
            delivered: None,
        };
        pace.refused(&p, t0 + MS * 5, t0 + MS * 6, refused);
        assert_eq!(round(pace.rate), Some(4.5));
        accept(&mut pace, &p, t0 + MS * 7, p.calm);
        assert_eq!(round(pace.rate), Some(5.625));
    }

    #[test]
    fn an_unpaced_refusal_reads_what_the_upstream_delivered() {
        let p = Params::default();
        let t0 = Instant::now();
        // (delivered, said, pace, ceiling)
        let cases = [(10.0, true, 9.0, Some(10.0)), (2.0, false, 2.0, None)];
        for (delivered, said, rate, ceiling) in cases {
            let mut pace = Pace::new(0.0);
            pace.refused(&p, t0, t0, Held::Unpaced { delivered, said });
            assert_eq!(round(pace.rate), Some(rate));
            assert_eq!(pace.ceiling, ceiling);
        }
    }

    #[test]
    fn a_paced_refusal_that_read_the_upstreams_limit_steps_under_it() {
        let p = Params::default();
        let t0 = Instant::now();
        let mut pace = Pace::new(0.0);
        // Paced at 16/s; a window let 10 through per pause it asked for.
        let held = Held::Paced {
            pace: 16.0,
            delivered: Some(10.0),
        };
        pace.refused(&p, t0, t0, held);
        assert_eq!((round(pace.rate), pace.ceiling), (Some(9.0), Some(10.0)));
    }

    #[test]
    fn the_floor_holds() {
        let p = Params::default();
        let t0 = Instant::now();
        let mut pace = Pace::new(4.8);
        pace.refused(
            &p,
            t0,
            t0,
            Held::Paced {
                pace: 5.0,
                delivered: None,
            },
        );
        assert_eq!(pace.rate, Some(4.8));
    }

    #[test]
    fn a_lower_pace_adopted_from_another_replica_is_this_episodes_step() {
        let p = Params::default();
        let t0 = Instant::now();
        let mut pace = Pace::new(0.0);
        pace.adopt(Some(4.5), Some(5.0), t0 + MS * 10);
        assert!(!pace.refused(
            &p,
            t0 + MS * 5,
            t0 + MS * 20,
            Held::Paced {
                pace: 5.0,
                delivered: None
            }
        ));
        assert!(pace.refused(
            &p,
            t0 + MS * 15,
            t0 + MS * 20,
            Held::Paced {
                pace: 4.5,
                delivered: None
            }
        ));
    }
}
