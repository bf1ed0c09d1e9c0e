//! The adaptive rate (`adaptive = true`): additive increase, multiplicative decrease.
//!
//! An upstream that pushes back although tollgate keeps to the configured rate has a
//! lower limit than the operator believed (or shares its budget with other callers).
//! Each push-back episode halves the rate in force, never below the floor (`min_rate`,
//! or 5 % of the configured rate); each calm second with traffic climbs back by 5 % of
//! the configured rate. The decisions are pure: the caller passes the time in.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::GroupSettings;

/// After each calm interval of this length the rate climbs by [`STEP`].
pub const CALM: Duration = Duration::from_secs(1);
/// The climb per calm interval, as a fraction of the configured rate.
pub const STEP: f64 = 0.05;
/// Without `min_rate`: the floor, as a fraction of the configured rate.
pub const FLOOR: f64 = 0.05;

/// The rate in force as a fraction of the configured one, and when it last moved.
#[derive(Debug, Clone)]
pub struct Adaptive {
    enabled: bool,
    floor: f64,
    factor: f64,
    changed: Instant,
    halved_at: Option<Instant>,
}

impl Adaptive {
    /// At the configured rate, as of `now`.
    pub fn new(settings: &GroupSettings, now: Instant) -> Adaptive {
        let floor = match (settings.min_rate, settings.rates.first()) {
            (Some(min), Some(rate)) => (min.per_second() / rate.per_second()).clamp(1e-6, 1.0),
            _ => FLOOR,
        };
        Adaptive {
            enabled: settings.adaptive,
            floor,
            factor: 1.0,
            changed: now,
            halved_at: None,
        }
    }

    /// The fraction of the configured rate in force (1 unless adaptive and backing off).
    pub fn factor(&self) -> f64 {
        self.factor
    }

    /// The upstream pushed back at `now`: halve, once per episode (one overload answers
    /// several requests in flight with 429 at once). Returns whether the factor moved.
    pub fn pushed_back(&mut self, now: Instant) -> bool {
        let recently = self.halved_at.is_some_and(|at| now - at < CALM);
        if !self.enabled || recently {
            return false;
        }
        self.halved_at = Some(now);
        self.set((self.factor / 2.0).max(self.floor), now)
    }

    /// A request departs at `now`: after a calm interval the rate climbs one step.
    /// Returns whether the factor moved.
    pub fn departed(&mut self, now: Instant) -> bool {
        if self.factor >= 1.0 || now - self.changed < CALM {
            return false;
        }
        self.set((self.factor + STEP).min(1.0), now)
    }

    fn set(&mut self, factor: f64, now: Instant) -> bool {
        let moved = factor != self.factor;
        self.factor = factor;
        self.changed = now;
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rate;

    fn adaptive(rate: &str, min_rate: Option<&str>, enabled: bool) -> (Adaptive, Instant) {
        let settings = GroupSettings {
            rates: vec![rate.parse::<Rate>().unwrap()],
            min_rate: min_rate.map(|r| r.parse().unwrap()),
            adaptive: enabled,
            ..GroupSettings::default()
        };
        let now = Instant::now();
        (Adaptive::new(&settings, now), now)
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn each_episode_halves_once_down_to_the_floor() {
        // (push-backs at these ms, the factor after them)
        let cases: &[(&[u64], Option<&str>, f64)] = &[
            (&[0], None, 0.5),
            (&[0, 10, 900], None, 0.5),
            (&[0, 1000], None, 0.25),
            (&[0, 1000, 2000, 3000, 4000, 5000], None, FLOOR),
            (&[0, 1000, 2000], Some("30/s"), 0.3),
        ];
        for (at, min, want) in cases {
            let (mut a, start) = adaptive("100/s", *min, true);
            for ms in *at {
                a.pushed_back(start + MS * *ms as u32);
            }
            assert!(
                (a.factor() - want).abs() < 1e-9,
                "{at:?} {min:?}: {}",
                a.factor()
            );
        }
    }

    #[test]
    fn it_climbs_a_step_per_calm_second_with_traffic() {
        let (mut a, start) = adaptive("100/s", None, true);
        a.pushed_back(start);
        assert!(!a.departed(start + MS * 500), "not calm yet");
        for s in 1..=5u32 {
            assert!(a.departed(start + Duration::from_secs(s.into())));
        }
        assert!((a.factor() - 0.75).abs() < 1e-9, "{}", a.factor());
        for s in 6..=20u32 {
            a.departed(start + Duration::from_secs(s.into()));
        }
        assert_eq!(a.factor(), 1.0, "never above the configured rate");
    }

    #[test]
    fn off_unless_asked_for() {
        let (mut a, start) = adaptive("100/s", None, false);
        assert!(!a.pushed_back(start));
        assert_eq!(a.factor(), 1.0);
    }
}
