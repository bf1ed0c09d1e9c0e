//! A group's pause: the upstream said "not before then", so nothing leaves until then.
//!
//! A later pause extends an earlier one; an earlier one never shortens it. The pause
//! also counts the push-back episodes since the upstream last answered normally, which
//! sets the fallback backoff of a refusal that does not say when to come back.

use tokio::time::Instant;

/// The pause in force, and the push-backs in a row.
#[derive(Debug, Default)]
pub struct Pause {
    until: Option<Instant>,
    in_row: u32,
}

impl Pause {
    /// Nothing leaves before `until` (or before the end of a longer pause in force).
    pub fn extend(&mut self, until: Instant) {
        self.until = Some(self.until.map_or(until, |p| p.max(until)));
    }

    /// When the pause in force at `now` ends, if one is.
    pub fn until(&self, now: Instant) -> Option<Instant> {
        self.until.filter(|p| *p > now)
    }

    /// The upstream pushed back once more at `now`. A push-back while the pause of an
    /// earlier one holds is part of that episode (one overload refuses every request
    /// in flight at once) and is not counted again.
    pub fn pushed_back(&mut self, now: Instant) {
        if self.until(now).is_none() {
            self.in_row = self.in_row.saturating_add(1);
        }
    }

    /// The upstream answered normally: the fallback backoff starts over.
    pub fn calm(&mut self) {
        self.in_row = 0;
    }

    /// Push-back episodes since the last normal answer, not counting the one whose
    /// pause holds at `now`: what the next refusal's fallback backoff starts from.
    pub fn in_row(&self, now: Instant) -> u32 {
        match self.until(now) {
            Some(_) => self.in_row.saturating_sub(1),
            None => self.in_row,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_pause_only_grows_and_ends_on_time() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut p = Pause::default();
        assert_eq!(p.until(t0), None);
        p.extend(t0 + 5 * s);
        p.extend(t0 + 2 * s);
        assert_eq!(
            p.until(t0),
            Some(t0 + 5 * s),
            "a shorter pause does not shorten it"
        );
        p.extend(t0 + 7 * s);
        assert_eq!(p.until(t0 + 6 * s), Some(t0 + 7 * s));
        assert_eq!(p.until(t0 + 7 * s), None, "over at its end");
    }

    #[test]
    fn push_back_episodes_in_a_row_start_over_when_calm() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut p = Pause::default();
        // A burst refused at once: one episode, whose pause the backoff does not count.
        for _ in 0..5 {
            p.pushed_back(t0);
            p.extend(t0 + s);
            assert_eq!(p.in_row(t0), 0);
        }
        // Refused again after that pause: the second episode.
        p.pushed_back(t0 + 2 * s);
        p.extend(t0 + 3 * s);
        assert_eq!(p.in_row(t0 + 2 * s), 1);
        assert_eq!(p.in_row(t0 + 4 * s), 2);
        p.calm();
        assert_eq!(p.in_row(t0 + 4 * s), 0);
    }
}
