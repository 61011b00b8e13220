//! Time as the monitor sees it. The classifier never reads a clock; the monitor's
//! threads ask a [`Clock`], which tests replace with a [`ManualClock`] so that
//! "three samples at 5 s, then five quiet minutes" runs in milliseconds and the same
//! way every time (the std-thread equivalent of paused tokio time).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

/// A point in time on both clocks: monotonic for durations, wall for reporting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moment {
    pub mono: Instant,
    pub wall: SystemTime,
}

impl Moment {
    /// Now, on the real clocks.
    pub fn now() -> Self {
        Self {
            mono: Instant::now(),
            wall: SystemTime::now(),
        }
    }

    /// The moment `elapsed` after this one.
    pub fn after(self, elapsed: Duration) -> Self {
        Self {
            mono: self.mono + elapsed,
            wall: self.wall + elapsed,
        }
    }
}

/// A stop flag the monitor's threads check on every wait cycle; raising it wakes a
/// thread that waits on it at once.
#[derive(Debug, Default)]
pub struct Stop {
    raised: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Stop {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn raise(&self) {
        let _guard = lock(&self.lock);
        self.raised.store(true, Ordering::SeqCst);
        self.wake.notify_all();
    }

    pub fn is_raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }

    /// Blocks up to `timeout` of real time; returns early (and false) once raised.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let guard = lock(&self.lock);
        let (_guard, _) = self
            .wake
            .wait_timeout_while(guard, timeout, |()| !self.is_raised())
            .unwrap_or_else(PoisonError::into_inner);
        !self.is_raised()
    }
}

/// The time source of the monitor's threads.
pub trait Clock: Send + Sync {
    fn now(&self) -> Moment;

    /// Blocks until this clock reaches `deadline` or `stop` is raised; false when stopped.
    fn wait_until(&self, deadline: Instant, stop: &Stop) -> bool;
}

/// The real clocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Moment {
        Moment::now()
    }

    fn wait_until(&self, deadline: Instant, stop: &Stop) -> bool {
        loop {
            if stop.is_raised() {
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                return true;
            }
            if !stop.wait_timeout(deadline - now) {
                return false;
            }
        }
    }
}

/// A clock that only moves when told to. Cloning gives another handle to the same
/// clock, so a test keeps one and hands one to the monitor.
#[derive(Debug, Clone)]
pub struct ManualClock {
    inner: Arc<ManualInner>,
}

#[derive(Debug)]
struct ManualInner {
    start: Moment,
    elapsed: Mutex<Duration>,
    moved: Condvar,
}

/// How often a thread parked on a manual clock re-checks its stop flag: the clock
/// cannot be woken by a [`Stop`] it does not know about.
const MANUAL_STOP_POLL: Duration = Duration::from_millis(5);

impl ManualClock {
    /// A clock standing at the current real time.
    pub fn new() -> Self {
        Self::starting_at(Moment::now())
    }

    pub fn starting_at(start: Moment) -> Self {
        Self {
            inner: Arc::new(ManualInner {
                start,
                elapsed: Mutex::new(Duration::ZERO),
                moved: Condvar::new(),
            }),
        }
    }

    /// Moves the clock forward and wakes every thread waiting on it.
    pub fn advance(&self, by: Duration) {
        let mut elapsed = lock(&self.inner.elapsed);
        *elapsed += by;
        self.inner.moved.notify_all();
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Moment {
        self.inner.start.after(*lock(&self.inner.elapsed))
    }

    fn wait_until(&self, deadline: Instant, stop: &Stop) -> bool {
        let mut elapsed = lock(&self.inner.elapsed);
        loop {
            if stop.is_raised() {
                return false;
            }
            if self.inner.start.mono + *elapsed >= deadline {
                return true;
            }
            elapsed = self
                .inner
                .moved
                .wait_timeout(elapsed, MANUAL_STOP_POLL)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// Locks a mutex whose data stays consistent even if a holder panicked (plain values
/// written in one assignment), so poisoning is not an error here.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let clock = ManualClock::new();
        let start = clock.now();
        assert_eq!(clock.now(), start);
        clock.advance(Duration::from_secs(7));
        let later = clock.now();
        assert_eq!(later.mono - start.mono, Duration::from_secs(7));
        assert_eq!(
            later.wall.duration_since(start.wall).ok(),
            Some(Duration::from_secs(7))
        );
    }

    #[test]
    fn manual_wait_returns_when_the_deadline_is_reached_or_stop_is_raised() {
        let clock = ManualClock::new();
        let stop = Arc::new(Stop::new());
        let deadline = clock.now().mono + Duration::from_secs(5);
        let waiter = {
            let (clock, stop) = (clock.clone(), Arc::clone(&stop));
            std::thread::spawn(move || clock.wait_until(deadline, &stop))
        };
        clock.advance(Duration::from_secs(5));
        assert_eq!(waiter.join().ok(), Some(true));

        let deadline = clock.now().mono + Duration::from_secs(5);
        let waiter = {
            let (clock, stop) = (clock.clone(), Arc::clone(&stop));
            std::thread::spawn(move || clock.wait_until(deadline, &stop))
        };
        stop.raise();
        assert_eq!(waiter.join().ok(), Some(false));
    }

    #[test]
    fn system_wait_is_cut_short_by_stop() {
        let stop = Arc::new(Stop::new());
        let started = Instant::now();
        let waiter = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                SystemClock.wait_until(Instant::now() + Duration::from_secs(60), &stop)
            })
        };
        stop.raise();
        assert_eq!(waiter.join().ok(), Some(false));
        assert!(started.elapsed() < Duration::from_secs(30));
    }
}
