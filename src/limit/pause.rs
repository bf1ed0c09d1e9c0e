//! A group's pause: the upstream said "not before then", so nothing leaves until then.
//!
//! A later pause extends an earlier one; an earlier one never shortens it. The pause
//! also counts the push-backs since the upstream last answered normally, which sets
//! the fallback backoff of a refusal that does not say when to come back.

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

    /// The upstream pushed back once more.
    pub fn pushed_back(&mut self) {
        self.in_row = self.in_row.saturating_add(1);
    }

    /// The upstream answered normally: the fallback backoff starts over.
    pub fn calm(&mut self) {
        self.in_row = 0;
    }

    /// Push-backs since the last normal answer.
    pub fn in_row(&self) -> u32 {
        self.in_row
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
    fn push_backs_in_a_row_start_over_when_calm() {
        let mut p = Pause::default();
        p.pushed_back();
        p.pushed_back();
        assert_eq!(p.in_row(), 2);
        p.calm();
        assert_eq!(p.in_row(), 0);
    }
}
