//! The AIMD half of learning: a refusal of a paced request steps the rate down, a
//! calm interval climbs it back. How far it steps depends on how rare the refusal is:
//! one among many accepted answers is a request that reached the upstream a little
//! early (its clock, the network, another replica's late request just before it), and
//! costs a small step the group climbs back from in full; refusals close together say
//! the pace itself is too fast.

use std::time::Duration;

use tokio::time::Instant;

use super::{Learner, Precedence, Source, CALM, MARGIN, SLOW_START};

/// A refusal of a paced request lowers the learned rate to this fraction of the pace.
pub const STEP_DOWN: f64 = 0.95;
/// An isolated refusal (see [`ISOLATED`]) lowers it to this fraction instead.
pub const NOISE_STEP: f64 = 0.98;
/// A refusal is isolated when the group's upstream accepted at least this many
/// answers since the one before (or since the start): one refusal in this many is
/// within the 2 % a group told its rate may see, and the pace held.
pub const ISOLATED: f64 = 50.0;
/// The least a calm interval climbs back, as a fraction of the ceiling.
pub const CLIMB: f64 = 0.01;

impl Learner {
    /// Whether a refusal now is isolated ([`ISOLATED`]), and counts it: the answers
    /// since the last refusal start again.
    pub(super) fn refusal_isolated(&mut self) -> bool {
        let scale = self.scale();
        f64::from(std::mem::take(&mut self.since_refusal)) * scale >= ISOLATED
    }

    /// Lowers the rate in force to [`STEP_DOWN`] of `pace` ([`NOISE_STEP`] when the
    /// refusal is `isolated`), at most once per two of its intervals (or per [`CALM`]
    /// when that is shorter): the requests in flight when it stepped were sent at the
    /// old pace, and their refusals say nothing new.
    ///
    /// A step that follows the last one within [`CALM`] of the end of its episode is
    /// the square of [`STEP_DOWN`]: refusals episode after episode say the pace is
    /// still well above the upstream's, and small steps would take many more of them.
    pub(super) fn step_down(&mut self, now: Instant, pace: f64, isolated: bool) {
        let episode = CALM.min(Duration::from_secs_f64(2.0 / pace.max(1e-6)));
        if self.stepped_at.is_some_and(|at| now - at < episode) {
            return;
        }
        let step = match self.stepped_at {
            _ if isolated => NOISE_STEP,
            Some(at) if now - at < episode + CALM => STEP_DOWN * STEP_DOWN,
            _ => STEP_DOWN,
        };
        self.stepped_at = Some(now);
        self.changed = now;
        match self.base {
            // Below what the upstream announced, which stays the ceiling.
            Some((base, source)) if source != Source::Refusals && base > 0.0 => {
                let target = pace * step / (base * MARGIN);
                self.factor = target.min(self.factor * step).max(0.01);
            }
            // Probing upwards, it went too far in the last step: back to halfway
            // between that step's start and the pace refused. The answers so far were
            // at slower paces, and the refusals of the first burst: a fresh sample.
            _ if self.slow_start => {
                let halfway = (pace / SLOW_START + pace) / 2.0;
                self.base = Some((halfway / MARGIN, Source::Refusals));
                self.factor = 1.0;
                self.accepted.clear();
                self.refusals.clear();
            }
            // Below the pace refused, and the margin under it is the ceiling to climb
            // back to: once, a refusal may be a request sent a little early. Refused
            // again at about a pace refused before, a step under it is. An isolated
            // refusal says the pace held: the ceiling stays where it was, the pace
            // itself at least.
            _ => {
                let again = !isolated
                    && self
                        .refused_pace
                        .is_some_and(|p| pace >= p * MARGIN * MARGIN);
                let ceiling = match self.base {
                    _ if again => pace * STEP_DOWN / MARGIN,
                    Some((base, _)) if isolated => base.max(pace / MARGIN),
                    None if isolated => pace / MARGIN,
                    _ => pace,
                };
                self.base = Some((ceiling, Source::Refusals));
                self.factor = pace * step / (ceiling * MARGIN);
            }
        }
        self.slow_start = false;
        self.refused_pace = Some(pace);
    }

    /// A request departs at `now`: after a calm interval the rate climbs one step
    /// (fast while probing upwards). Returns whether the learned rate moved.
    pub fn departed(&mut self, now: Instant) -> bool {
        if self.base.is_none() {
            return false;
        }
        // Replicas climb as one through the shared store, which keeps a slower state
        // published less than a calm interval before a faster one.
        let slow_step = match self.replicas {
            1 => CALM / 2,
            _ => CALM,
        };
        if self.slow_start && now - self.changed >= slow_step {
            self.factor *= SLOW_START;
        } else if !self.slow_start && self.factor < 1.0 && now - self.changed >= CALM {
            self.held_calm();
            // Half the way back to the ceiling each calm interval, at least a step.
            self.factor = (self.factor + ((1.0 - self.factor) / 2.0).max(CLIMB)).min(1.0);
        } else {
            return false;
        }
        self.changed = now;
        self.precedence = Precedence::Slower;
        true
    }

    /// The rate in force held a calm interval.
    pub(super) fn held_calm(&mut self) {
        if let Some((rate, _)) = self.rate() {
            self.calm_pace = Some(self.calm_pace.map_or(rate, |c| c.max(rate)));
        }
    }
}
