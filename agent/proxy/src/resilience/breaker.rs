//! Per-target circuit breakers: closed → open after consecutive failures → half-open
//! after a penalty (one probe at a time) → closed on a success, or open again with a
//! longer penalty. Penalties back off exponentially with jitter, as Linkerd's failure
//! accrual does (defaults 1 s doubling to 60 s).
//!
//! Only what a provider answers (or fails to) is recorded: a call the breaker itself
//! refuses, or one refused locally before it was sent, says nothing about the
//! provider. A call goes through with a [`Pass`], so a probe whose call ends without
//! an outcome (cancelled, refused locally) is released rather than holding the
//! circuit half-open for good.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outrigger_types::CircuitState;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub consecutive_failures: u32,
    pub min_penalty: Duration,
    pub max_penalty: Duration,
    /// Jitter as a share of the penalty (0.5 = ±50 %... applied downwards only).
    pub jitter: f64,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            min_penalty: Duration::from_secs(1),
            max_penalty: Duration::from_secs(60),
            jitter: 0.5,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Breaker {
    state: CircuitState,
    failures: u32,
    /// Consecutive trips (drives the backoff).
    trips: u32,
    open_until: Option<Instant>,
    /// The probe let through while half-open, until it is recorded or released.
    probe: Option<u64>,
}

impl Default for Breaker {
    fn default() -> Self {
        Self {
            state: CircuitState::Closed,
            failures: 0,
            trips: 0,
            open_until: None,
            probe: None,
        }
    }
}

/// Whether a call may go to the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Go ahead.
    Allowed,
    /// Go ahead: this call is the half-open probe.
    Probe,
    /// The circuit is open; retry after this long.
    Rejected { retry_after: Duration },
}

/// Breakers per target.
#[derive(Debug)]
pub struct Breakers {
    options: Options,
    targets: Mutex<HashMap<String, Breaker>>,
    /// Numbers probes, so a late release cannot free a newer probe.
    probes: AtomicU64,
}

/// A call the breaker let through. [`Pass::record`] says how it went; a pass dropped
/// without an outcome (its call was cancelled, or refused before it was sent) gives
/// its probe back, so the next call probes instead.
#[must_use = "a call let through should record how it went"]
#[derive(Debug)]
pub struct Pass<'a> {
    breakers: &'a Breakers,
    target: &'a str,
    probe: Option<u64>,
}

impl Pass<'_> {
    /// Whether this call is the half-open probe.
    pub fn is_probe(&self) -> bool {
        self.probe.is_some()
    }

    /// Records how the call went (see [`Breakers::record`]).
    pub fn record(mut self, success: bool, jitter: f64) -> CircuitState {
        self.probe = None;
        self.breakers.record(self.target, success, jitter)
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.probe.take() {
            self.breakers.release(self.target, id);
        }
    }
}

impl Breakers {
    pub fn new(options: Options) -> Self {
        Self {
            options,
            targets: Mutex::new(HashMap::new()),
            probes: AtomicU64::new(0),
        }
    }

    pub fn state(&self, target: &str) -> CircuitState {
        let now = Instant::now();
        self.targets
            .lock()
            .ok()
            .and_then(|t| t.get(target).map(|b| effective(b, now)))
            .unwrap_or(CircuitState::Closed)
    }

    /// Every target's state (for metrics and the admin API).
    pub fn states(&self) -> Vec<(String, CircuitState)> {
        let now = Instant::now();
        self.targets
            .lock()
            .map(|t| {
                t.iter()
                    .map(|(k, b)| (k.clone(), effective(b, now)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether a call may go to the target. A [`Admission::Probe`] taken here stays in
    /// flight until [`Breakers::record`]; calls should go through [`Breakers::pass`].
    pub fn admit(&self, target: &str) -> Admission {
        self.admit_probe(target).0
    }

    /// Lets a call through, or says how long the circuit stays open.
    pub fn pass<'a>(&'a self, target: &'a str) -> Result<Pass<'a>, Duration> {
        match self.admit_probe(target) {
            (Admission::Rejected { retry_after }, _) => Err(retry_after),
            (Admission::Allowed | Admission::Probe, probe) => Ok(Pass {
                breakers: self,
                target,
                probe,
            }),
        }
    }

    fn admit_probe(&self, target: &str) -> (Admission, Option<u64>) {
        let now = Instant::now();
        let Ok(mut targets) = self.targets.lock() else {
            return (Admission::Allowed, None);
        };
        let b = targets.entry(target.to_string()).or_default();
        match b.state {
            CircuitState::Closed => (Admission::Allowed, None),
            CircuitState::Open | CircuitState::HalfOpen => {
                let until = b.open_until.unwrap_or(now);
                if now < until {
                    let retry_after = until - now;
                    (Admission::Rejected { retry_after }, None)
                } else if b.probe.is_some() {
                    let retry_after = Duration::from_millis(100);
                    (Admission::Rejected { retry_after }, None)
                } else {
                    let id = self.probes.fetch_add(1, Ordering::Relaxed);
                    b.state = CircuitState::HalfOpen;
                    b.probe = Some(id);
                    (Admission::Probe, Some(id))
                }
            }
        }
    }

    /// Gives back a probe that ended without an outcome: the circuit stays half-open
    /// and the next call probes.
    fn release(&self, target: &str, id: u64) {
        if let Ok(mut targets) = self.targets.lock()
            && let Some(b) = targets.get_mut(target)
            && b.probe == Some(id)
        {
            b.probe = None;
        }
    }

    /// Records how a call went. `jitter` in [0, 1) comes from the caller (so tests
    /// can fix it).
    pub fn record(&self, target: &str, success: bool, jitter: f64) -> CircuitState {
        let now = Instant::now();
        let Ok(mut targets) = self.targets.lock() else {
            return CircuitState::Closed;
        };
        let o = self.options;
        let b = targets.entry(target.to_string()).or_default();
        if success {
            *b = Breaker::default();
            return CircuitState::Closed;
        }
        b.failures = b.failures.saturating_add(1);
        let trip = match b.state {
            CircuitState::HalfOpen => true,
            CircuitState::Closed => b.failures >= o.consecutive_failures,
            CircuitState::Open => false,
        };
        if trip {
            b.trips = b.trips.saturating_add(1);
            let base =
                o.min_penalty.as_secs_f64() * 2f64.powi(b.trips.saturating_sub(1).min(30) as i32);
            let capped = base.min(o.max_penalty.as_secs_f64());
            let penalty = capped * (1.0 - o.jitter * jitter.clamp(0.0, 1.0));
            b.state = CircuitState::Open;
            b.open_until = Some(now + Duration::from_secs_f64(penalty));
            b.probe = None;
        }
        effective(b, now)
    }
}

fn effective(b: &Breaker, now: Instant) -> CircuitState {
    match (b.state, b.open_until) {
        (CircuitState::Open, Some(until)) if now >= until => CircuitState::HalfOpen,
        (s, _) => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn opens_half_opens_and_closes() {
        let b = Breakers::new(Options::default());
        for _ in 0..4 {
            assert_eq!(b.record("p", false, 0.0), CircuitState::Closed);
        }
        assert_eq!(b.record("p", false, 0.0), CircuitState::Open);
        assert!(
            matches!(b.admit("p"), Admission::Rejected { retry_after } if retry_after == Duration::from_secs(1))
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(b.state("p"), CircuitState::HalfOpen);
        assert_eq!(b.admit("p"), Admission::Probe);
        assert!(
            matches!(b.admit("p"), Admission::Rejected { .. }),
            "one probe at a time"
        );
        // The probe fails: open again, for twice as long.
        assert_eq!(b.record("p", false, 0.0), CircuitState::Open);
        tokio::time::advance(Duration::from_millis(1999)).await;
        assert!(matches!(b.admit("p"), Admission::Rejected { .. }));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(b.admit("p"), Admission::Probe);
        assert_eq!(b.record("p", true, 0.0), CircuitState::Closed);
        assert_eq!(b.admit("p"), Admission::Allowed);
    }

    #[tokio::test(start_paused = true)]
    async fn penalty_is_capped_and_jittered_down() {
        let b = Breakers::new(Options {
            consecutive_failures: 1,
            ..Options::default()
        });
        for _ in 0..10 {
            b.record("p", false, 0.0);
            tokio::time::advance(Duration::from_secs(61)).await;
            b.admit("p");
        }
        b.record("p", false, 1.0);
        match b.admit("p") {
            Admission::Rejected { retry_after } => assert_eq!(retry_after, Duration::from_secs(30)),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_ends_without_an_outcome_is_given_back() {
        let b = Breakers::new(Options {
            consecutive_failures: 1,
            ..Options::default()
        });
        b.record("p", false, 0.0);
        tokio::time::advance(Duration::from_secs(1)).await;
        let probe = b.pass("p").expect("the probe goes through");
        assert!(probe.is_probe());
        assert!(b.pass("p").is_err(), "one probe at a time");
        drop(probe);
        assert_eq!(b.state("p"), CircuitState::HalfOpen);
        let again = b.pass("p").expect("the next call probes");
        assert!(again.is_probe());
        // A probe given back late frees nothing it does not hold.
        b.release("p", u64::MAX);
        assert!(b.pass("p").is_err());
        assert_eq!(again.record(true, 0.0), CircuitState::Closed);
        assert!(b.pass("p").is_ok_and(|p| !p.is_probe()));
    }

    #[tokio::test(start_paused = true)]
    async fn counters_saturate() {
        let b = Breakers::new(Options::default());
        if let Ok(mut t) = b.targets.lock() {
            t.insert(
                "p".into(),
                Breaker {
                    state: CircuitState::HalfOpen,
                    failures: u32::MAX,
                    trips: u32::MAX,
                    open_until: Some(Instant::now()),
                    probe: None,
                },
            );
        }
        assert_eq!(b.record("p", false, 0.0), CircuitState::Open);
        assert_eq!(b.record("p", false, 0.0), CircuitState::Open);
    }
}
