//! The controller: the one law that moves a group's pace on refusals and calm rounds
//! (docs/budget.md, "The controller").

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
#[derive(Debug, Clone, PartialEq)]
pub struct Pace {
    /// The pace, per second; `None` until a refusal asks for one.
    pub rate: Option<f64>,
    /// A pace the upstream refused, per second; `None`: none known (the pace grows).
    pub ceiling: Option<f64>,
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
    /// after `1 / (1 − margin)` of them.
    since_refusal: f64,
}

impl Pace {
    /// No pace yet; never below `floor` (per second) once there is one.
    pub fn new(floor: f64) -> Pace {
        Pace {
            rate: None,
            ceiling: None,
            floor,
            stepped: None,
            changed: None,
            calm: 0.0,
            since_refusal: 0.0,
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
        match held {
            Held::Paced { pace, delivered } => {
                let ceiling = delivered.map_or(pace, |d| d.min(pace));
                self.ceiling = Some(ceiling);
                self.set(p.decrease * ceiling, now);
            }
            Held::Unpaced { delivered, said } => {
                self.ceiling = said.then_some(delivered);
                let factor = if said { p.margin } else { 1.0 };
                self.set(factor * delivered, now);
            }
        }
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
        if self.calm < f64::from(p.calm) {
            return false;
        }
        let next = match self.ceiling {
            None => p.growth * rate,
            Some(ceiling) if rate < p.margin * ceiling => p.margin * ceiling,
            Some(ceiling) if self.since_refusal >= 1.0 / (1.0 - p.margin) => {
                // Held at the ceiling long enough: explore above it, at most once per
                // that many answers, so that at most 1 − margin of them are refused.
                self.ceiling = Some(ceiling / p.margin);
                self.since_refusal = 0.0;
                rate / p.margin
            }
            Some(_) => {
                self.calm = 0.0;
                return false;
            }
        };
        self.set(next, now);
        true
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
        self.rate = rate;
        self.ceiling = ceiling;
        self.changed = Some(now);
        self.calm = 0.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
    fn a_paced_refusal_steps_down_once_per_episode_and_a_calm_round_returns_under_it() {
        let p = Params::default();
        let t0 = Instant::now();
        let mut pace = Pace::new(0.0);
        // Held to 5/s by the configured rate; refused a millisecond after it left.
        let step = t0 + MS;
        assert!(pace.refused(
            &p,
            t0,
            step,
            Held::Paced {
                pace: 5.0,
                delivered: None
            }
        ));
        assert_eq!(round(pace.rate), Some(4.5));
        // The other refusals of requests sent before the step change nothing, and their
        // answers do not count towards calm.
        assert!(!pace.refused(
            &p,
            t0,
            step + MS,
            Held::Paced {
                pace: 5.0,
                delivered: None
            }
        ));
        accept(&mut pace, &p, t0, 10);
        assert_eq!(round(pace.rate), Some(4.5));
        // A calm round: a margin under the pace refused.
        accept(&mut pace, &p, t0 + MS * 10, p.calm);
        assert_eq!(round(pace.rate), Some(4.9));
        // It stays there until 50 answers since the refusal, then explores 2 % above.
        accept(&mut pace, &p, t0 + MS * 20, 30);
        assert_eq!(round(pace.rate), Some(4.9));
        accept(&mut pace, &p, t0 + MS * 20, 8);
        assert_eq!(round(pace.rate), Some(5.0));
        assert_eq!(round(pace.ceiling), Some(5.102));
    }

    #[test]
    fn an_unpaced_refusal_reads_what_the_upstream_delivered() {
        let p = Params::default();
        let t0 = Instant::now();
        // (delivered, said, pace, ceiling)
        let cases = [(10.0, true, 9.8, Some(10.0)), (2.0, false, 2.0, None)];
        for (delivered, said, rate, ceiling) in cases {
            let mut pace = Pace::new(0.0);
            pace.refused(&p, t0, t0, Held::Unpaced { delivered, said });
            assert_eq!(round(pace.rate), Some(rate));
            assert_eq!(pace.ceiling, ceiling);
        }
    }

    #[test]
    fn with_no_ceiling_a_calm_round_grows_the_pace_until_a_refusal() {
        let p = Params::default();
        let t0 = Instant::now();
        let mut pace = Pace::new(0.0);
        pace.refused(
            &p,
            t0,
            t0,
            Held::Unpaced {
                delivered: 2.0,
                said: false,
            },
        );
        for round in 1..=3 {
            accept(&mut pace, &p, t0 + MS * round, p.calm);
        }
        assert_eq!(round(pace.rate), Some(6.75));
        pace.refused(
            &p,
            t0 + MS * 5,
            t0 + MS * 6,
            Held::Paced {
                pace: 6.75,
                delivered: None,
            },
        );
        assert_eq!(round(pace.rate), Some(6.075));
        assert_eq!(pace.ceiling, Some(6.75));
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
