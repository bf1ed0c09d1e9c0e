//! A sleep that usually ends within tens of microseconds after its deadline, for the
//! request at the head of a group's queue waiting for its slot.
//!
//! tokio's timer counts whole milliseconds: a sleep is due at the first tick at or after
//! its deadline, and the runtime parks for a whole number of milliseconds counted from
//! the tick it is in, so a sleep ends up to 2 ms after its deadline. A request's time in
//! the queue is its departure minus the departure of the request before it, so that
//! lateness, varying from one departure to the next, is the whole spread of queueing
//! latency at rates near one request per millisecond. It also sends some requests closer
//! together than the rate: a head woken 1 ms late is counted at its slot
//! (`limit::rate::SLOT_CREDIT`), and when the next wakes on time the upstream sees the
//! two less than one interval apart, which a strict upstream limiter refuses (the
//! figures, with and without this sleep: BENCHMARKS.md).
//!
//! Here the deadline is also armed on a Linux `timerfd` (a kernel high-resolution timer)
//! watched by the runtime's reactor, and the sleep ends when either fires. Neither ends
//! it before the deadline: the timer is armed on the same monotonic clock as [`Instant`],
//! and the clock is read again when it fires. tokio's sleep races it, so that a paused
//! test clock, which only tokio's sleep follows, still ends the wait, and so that a timer
//! that cannot be made (another OS, no file descriptor left) costs precision, not the
//! wait. The runtime must have I/O enabled (tokio panics otherwise when the timer is
//! registered), as every runtime tollgate starts does.
//!
//! A busy or descheduled thread still wakes late: the kernel timer bounds the timer's
//! own rounding, not the scheduler's.
//!
//! A timer that has fired is kept for the thread's next sleep, so a sleep usually costs
//! one system call to arm it. A precise wake-up is still a wake-up of its own, where
//! tokio's late one often served several departures: that is why the queue only uses
//! this sleep for slots far enough apart ([`PRECISE_WAKE`]).

use std::time::Duration;

use tokio::time::Instant;

/// Sleeps until `deadline`, ending usually within tens of microseconds after it where
/// the OS has `timerfd` (Linux), and within tokio's timer's 2 ms otherwise. Never before
/// it.
pub async fn sleep_until(deadline: Instant) {
    let coarse = tokio::time::sleep_until(deadline);
    match timerfd::Armed::at(deadline) {
        Some(mut precise) => {
            tokio::select! {
                biased;
                () = coarse => {}
                () = precise.fired() => {}
            }
        }
        None => coarse.await,
    }
}

/// A head whose slot is at least this far off sleeps on a kernel timer; a nearer slot
/// (rates above ~2 000/s) is left to tokio's millisecond timer, where a late wake-up
/// releases several due requests in one step (`Group::depart`) instead of waking the
/// head once per slot.
pub const PRECISE_WAKE: Duration = Duration::from_micros(500);

/// Sleeps until the slot `at` of the head of a group's queue: precisely when it is at
/// least [`PRECISE_WAKE`] away.
pub async fn sleep_until_slot(at: Instant) {
    if at.saturating_duration_since(Instant::now()) >= PRECISE_WAKE {
        sleep_until(at).await;
    } else {
        tokio::time::sleep_until(at).await;
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
mod timerfd {
    use std::cell::Cell;
    use std::os::fd::OwnedFd;

    use rustix::time::{
        timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags,
        TimerfdTimerFlags, Timespec,
    };
    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;
    use tokio::time::Instant;

    thread_local! {
        /// A timer that has fired, kept for the thread's next sleep: re-arming it is one
        /// system call where a new one is five (create, register, arm, deregister,
        /// close). Per thread, because a registration belongs to the reactor of the
        /// runtime that made it, and each serving thread runs one runtime.
        static SPARE: Cell<Option<AsyncFd<OwnedFd>>> = const { Cell::new(None) };
    }

    /// A one-shot `timerfd` armed for a deadline, registered with the runtime's reactor.
    pub struct Armed {
        fd: Option<AsyncFd<OwnedFd>>,
        deadline: Instant,
        /// It fired and its readiness was taken: idle, fit to be the thread's spare.
        fired: bool,
    }

    impl Armed {
        /// A timer that fires at `deadline`; `None` when the deadline has passed or the
        /// timer cannot be made (then tokio's sleep alone waits).
        pub fn at(deadline: Instant) -> Option<Armed> {
            // Relative to now, on CLOCK_MONOTONIC like `Instant`: the time between this
            // read and the arming only makes it fire later, never before the deadline.
            let wait = deadline.checked_duration_since(Instant::now())?;
            if wait.is_zero() {
                return None;
            }
            let fd = match SPARE.take() {
                Some(spare) => spare,
                None => new_timer()?,
            };
            let zero = Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            let spec = Itimerspec {
                it_interval: zero,
                it_value: Timespec::try_from(wait).ok()?,
            };
            // Arming also resets the count of earlier expirations (timerfd_settime(2)):
            // a spare turns readable again only when this deadline comes.
            timerfd_settime(fd.get_ref(), TimerfdTimerFlags::empty(), &spec).ok()?;
            Some(Armed {
                fd: Some(fd),
                deadline,
                fired: false,
            })
        }

        /// Ends when the timer has fired. On an error from the reactor (its runtime is
        /// gone) it never ends, and tokio's sleep beside it ends the wait.
        pub async fn fired(&mut self) {
            let Some(fd) = &self.fd else {
                return std::future::pending().await;
            };
            loop {
                let Ok(mut ready) = fd.readable().await else {
                    return std::future::pending().await;
                };
                ready.clear_ready();
                // Readiness left from before the spare was re-armed would end the wait
                // early; the clock says whether this is the deadline's.
                if Instant::now() >= self.deadline {
                    self.fired = true;
                    return;
                }
            }
        }
    }

    impl Drop for Armed {
        fn drop(&mut self) {
            // One that has not fired (the sleep was cancelled, or tokio's ended it first)
            // is still armed: closed rather than kept.
            if self.fired {
                SPARE.set(self.fd.take());
            }
        }
    }

    /// Whether this thread holds a spare timer (for the tests).
    #[cfg(test)]
    pub fn has_spare() -> bool {
        let spare = SPARE.take();
        let has = spare.is_some();
        SPARE.set(spare);
        has
    }

    fn new_timer() -> Option<AsyncFd<OwnedFd>> {
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )
        .ok()?;
        // tokio deprecated this safe constructor (tokio#8587) because for an arbitrary
        // `T: AsRawFd` nothing promises that the descriptor stays open and the same while
        // registered; its replacement is `unsafe`, which this crate forbids. An `OwnedFd`
        // moved in here is that promise: it is closed only when the `AsyncFd` drops it,
        // after deregistering, and this module never reaches the descriptor through
        // `get_mut` to replace it.
        #[allow(deprecated)]
        let registered = AsyncFd::with_interest(fd, Interest::READABLE);
        registered.ok()
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
mod timerfd {
    use tokio::time::Instant;

    /// No `timerfd` here: tokio's sleep alone waits.
    pub struct Armed;

    impl Armed {
        /// Always `None`: see the module above.
        pub fn at(_deadline: Instant) -> Option<Armed> {
            None
        }

        /// Never called.
        pub async fn fired(&mut self) {}
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn ends_no_earlier_than_its_deadline() {
        // One thread: the second and third sleeps re-arm the first one's timer, whose
        // readiness from its own expiry must not end them early.
        for micros in [1, 300, 2_500] {
            let deadline = Instant::now() + Duration::from_micros(micros);
            sleep_until(deadline).await;
            assert!(
                Instant::now() >= deadline,
                "woke before a {micros} µs deadline"
            );
        }
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[tokio::test]
    async fn the_timerfd_fires_and_is_kept_for_the_next_sleep() {
        let deadline = Instant::now() + Duration::from_millis(3);
        let mut armed = timerfd::Armed::at(deadline).expect("a timerfd on Linux");
        assert!(!timerfd::has_spare());
        // Bounded: a timer that never fired would otherwise hang the test.
        tokio::time::timeout(Duration::from_secs(10), armed.fired())
            .await
            .expect("the timerfd fired");
        assert!(Instant::now() >= deadline);
        drop(armed);
        assert!(timerfd::has_spare(), "a fired timer is kept");
        // The next one re-arms the spare rather than making a new timer.
        let armed = timerfd::Armed::at(Instant::now() + Duration::from_millis(50));
        assert!(armed.is_some() && !timerfd::has_spare());
        // Dropped before it fired: still armed, so closed rather than kept.
        drop(armed);
        assert!(!timerfd::has_spare());
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[tokio::test(start_paused = true)]
    async fn a_fired_timer_does_not_end_the_wait_before_the_clock_says_so() {
        // The kernel timer runs on the real clock; on a paused one its firing must not
        // count until the clock has reached the deadline.
        let mut armed = timerfd::Armed::at(Instant::now() + Duration::from_millis(5))
            .expect("a timerfd on Linux");
        std::thread::sleep(std::time::Duration::from_millis(20)); // it fires meanwhile
        let waited = tokio::time::timeout(Duration::from_millis(2), armed.fired()).await;
        assert!(waited.is_err(), "ended 3 ms before its deadline");
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_clock_still_ends_the_sleep() {
        // An hour on the paused clock passes at once through tokio's sleep; the timerfd
        // beside it, on the real clock, is dropped unfired.
        let started = std::time::Instant::now();
        let deadline = Instant::now() + Duration::from_secs(3600);
        sleep_until(deadline).await;
        assert!(Instant::now() >= deadline);
        assert!(started.elapsed() < Duration::from_secs(60));
    }

    #[test]
    fn a_passed_deadline_needs_no_timer() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let passed = Instant::now() - Duration::from_millis(1);
            assert!(timerfd::Armed::at(passed).is_none());
        });
    }
}
