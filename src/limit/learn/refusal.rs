//! What one refusal teaches, past the bookkeeping of [`Learner::refused`]: of an
//! unpaced burst, a first estimate of the upstream's rate; of a paced request, the
//! upstream's rate when it let clearly less through than the pace, else a step down.

use std::time::Duration;

use tokio::time::Instant;

use super::{Learner, ABOVE_SEEN, CALM, MARGIN, MIN_PACED_REFUSALS, REFUSED_SHARE, STEP_DOWN};

impl Learner {
    /// A refusal of an unpaced request: whatever the upstream let through is the first
    /// estimate. Returns whether later refusals of the episode refine it.
    pub(super) fn refused_unpaced(
        &mut self,
        now: Instant,
        pause: Duration,
        said: bool,
        announced: bool,
    ) -> bool {
        // A guessed pause is a backoff with jitter, half to all of its step:
        // read over at least a calm interval, a floor does not vary twofold
        // with it (above the upstream's rate, it costs refusals and steps).
        let over = if said { pause } else { pause.max(CALM) };
        let seen = self.seen(now, over);
        // Nothing accepted yet and nothing said: one request per guessed pause
        // (per replica) is the floor, and the group is paced from now on.
        let floor = || {
            let per_pause = f64::from(self.replicas) / over.as_secs_f64().max(1e-3);
            (!said).then_some(per_pause)
        };
        if let (false, Some(seen)) = (announced, seen.map(|(s, _)| s).or_else(floor)) {
            self.learn(seen, now);
        }
        // Refusals of an unpaced burst say nothing of a pace to come.
        self.refusals.clear();
        // Learned now or later in the episode, a rate guessed from refusals
        // that said nothing is only a floor.
        self.slow_start = !announced && !said;
        !announced
    }

    /// A refusal of a paced request (not probing upwards, no announced budget). When
    /// the upstream let through clearly less than the pace, that is its rate: a limiter
    /// that said when to come back shows it in the answers since its last refusal, a
    /// bare one in the last seconds' answers once its refusals are a fair share of
    /// them. One of several replicas sees its share of the answers, too few to read:
    /// the shared store counts the group's. Else the rate steps down.
    pub(super) fn refused_paced(
        &mut self,
        now: Instant,
        sent: Instant,
        pause: Duration,
        said: bool,
        pace: f64,
        isolated: bool,
    ) {
        let seen = self.seen(now, pause);
        let (refused, accepted) = (self.refusals.len(), self.accepted.len());
        let answered = refused as f64 + accepted as f64;
        let fair = refused >= MIN_PACED_REFUSALS && refused as f64 >= REFUSED_SHARE * answered;
        let bare = match self.replicas {
            1 => seen.filter(|_| fair).map(|(s, _)| s),
            _ => self.group_let_through(sent, pace),
        };
        // A token bucket refills during the pause it asks for and lets a burst
        // through after it, which reads as a rate above its own within one
        // window: over the last seconds, pauses included, it shows less.
        let horizon = seen.filter(|_| self.replicas == 1).map(|(s, _)| s);
        // The window since the last refusal needs two answers accepted in it; a
        // limiter that refuses every other request (a strict one paced at twice
        // its rate) never shows that, and the last seconds' answers tell instead.
        let let_through = match said {
            true => match (self.window_seen(now, sent, pause), horizon) {
                (Some(window), Some(h)) => Some(h.min(window)),
                (window, h) => window.or(h),
            },
            false => bare,
        }
        .filter(|seen| seen.is_finite() && *seen > 0.0);
        // What a bare limiter let through one replica, spaced by the refusals
        // in between, can be well below its rate: the rate climbs back when
        // calm, to at most [`ABOVE_SEEN`] times that and a step under the gap
        // since the last answer accepted (the upstream's interval is longer
        // than that, no more). The group's count over a second it was busy
        // for is what the upstream let through: no climb above it, where a
        // strict limiter refuses.
        let gap = (self.accepted.back())
            .filter(|_| self.replicas == 1)
            .map(|last| (now - *last).as_secs_f64());
        let below_gap = gap
            .filter(|g| *g > 0.0)
            .map_or(f64::INFINITY, |g| STEP_DOWN / g);
        let ceiling = (let_through)
            .filter(|_| !said && self.replicas == 1)
            .map(|seen| below_gap.min(seen * ABOVE_SEEN));
        // Once a pace has held a calm interval, a bare refusal is not read as
        // a rate any more: a strict limiter paced a little too fast refuses
        // every other request, which reads as half of it. A pace climbed well
        // above the calm one went too far: back to that, under a ceiling
        // halfway to the pace refused and at least two steps below it (the
        // upstream's rate lies in between). At about the calm pace, it steps
        // down.
        let calm = self.calm_pace.filter(|_| !said);
        match (let_through.filter(|s| *s < pace * STEP_DOWN), calm) {
            (_, Some(calm)) if calm < pace * STEP_DOWN => {
                let ceiling = ((calm + pace) / 2.0).min(pace * STEP_DOWN * STEP_DOWN);
                self.learn_below(calm / MARGIN, Some(ceiling / MARGIN), now);
            }
            (_, Some(_)) => {
                self.calm_pace = None;
                self.step_down(now, pace, isolated);
            }
            (Some(seen), None) => self.learn_below(seen, ceiling, now),
            (None, None) => self.step_down(now, pace, isolated),
        }
    }
}
