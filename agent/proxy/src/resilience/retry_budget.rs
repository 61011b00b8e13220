//! Retries as a share of requests over a sliding window, with a floor — Envoy's
//! retry budget (20 %, at least 3). Under a total outage the retries stay bounded
//! instead of multiplying the load.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use outrigger_types::RetryBudget;
use tokio::time::Instant;

const BUCKETS: usize = 10;

#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Retries allowed as a share of requests in the window.
    pub ratio: f64,
    /// Retries always allowed per window, however few requests there were.
    pub min_retries: u32,
    pub window: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            min_retries: 3,
            window: Duration::from_secs(10),
        }
    }
}

#[derive(Debug)]
struct Window {
    started: Instant,
    /// (requests, retries) per bucket; the window slides a bucket at a time.
    buckets: [(u32, u32); BUCKETS],
    current: usize,
}

impl Window {
    fn new(now: Instant) -> Self {
        Self {
            started: now,
            buckets: [(0, 0); BUCKETS],
            current: 0,
        }
    }

    fn advance(&mut self, now: Instant, window: Duration) {
        let bucket = window / BUCKETS as u32;
        if bucket.is_zero() {
            return;
        }
        let elapsed = now.saturating_duration_since(self.started);
        let steps = (elapsed.as_nanos() / bucket.as_nanos()) as usize;
        if steps == 0 {
            return;
        }
        for _ in 0..steps.min(BUCKETS) {
            self.current = (self.current + 1) % BUCKETS;
            self.buckets[self.current] = (0, 0);
        }
        self.started += bucket * steps as u32;
    }

    fn totals(&self) -> (u32, u32) {
        self.buckets
            .iter()
            .fold((0, 0), |(q, r), (bq, br)| (q + bq, r + br))
    }
}

/// Retry budgets per target (provider or tool).
#[derive(Debug)]
pub struct RetryBudgets {
    options: Options,
    windows: Mutex<HashMap<String, Window>>,
}

impl RetryBudgets {
    pub fn new(options: Options) -> Self {
        Self {
            options,
            windows: Mutex::new(HashMap::new()),
        }
    }

    fn with<T>(&self, target: &str, f: impl FnOnce(&mut Window, &Options) -> T) -> Option<T> {
        let now = Instant::now();
        let mut windows = self.windows.lock().ok()?;
        let w = windows
            .entry(target.to_string())
            .or_insert_with(|| Window::new(now));
        w.advance(now, self.options.window);
        Some(f(w, &self.options))
    }

    /// Counts an original request (not a retry).
    pub fn record_request(&self, target: &str) {
        self.with(target, |w, _| w.buckets[w.current].0 += 1);
    }

    /// Takes one retry from the budget if there is one left; returns whether it did.
    pub fn try_retry(&self, target: &str) -> bool {
        self.with(target, |w, o| {
            let (requests, retries) = w.totals();
            let allowed = allowed(o, requests);
            if retries < allowed {
                w.buckets[w.current].1 += 1;
                true
            } else {
                false
            }
        })
        .unwrap_or(false)
    }

    /// The budget as a policy sees it.
    pub fn view(&self, target: &str) -> RetryBudget {
        self.with(target, |w, o| {
            let (requests, retries) = w.totals();
            RetryBudget {
                available: retries < allowed(o, requests),
                retries_in_window: retries,
                requests_in_window: requests,
            }
        })
        .unwrap_or_default()
    }
}

fn allowed(o: &Options, requests: u32) -> u32 {
    ((f64::from(requests) * o.ratio) as u32).max(o.min_retries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn retries_are_a_share_of_requests_with_a_floor() {
        let b = RetryBudgets::new(Options::default());
        // No traffic: the floor of 3 applies.
        assert!(b.try_retry("p") && b.try_retry("p") && b.try_retry("p"));
        assert!(!b.try_retry("p"));
        for _ in 0..100 {
            b.record_request("p");
        }
        // 20 % of 100 = 20 retries in the window, 3 already spent.
        let granted = (0..50).filter(|_| b.try_retry("p")).count();
        assert_eq!(granted, 17);
        assert!(!b.view("p").available);
        assert!(b.view("other").available, "budgets are per target");
        // The window slides: after 10 s everything has aged out.
        tokio::time::advance(Duration::from_secs(11)).await;
        let v = b.view("p");
        assert_eq!((v.requests_in_window, v.retries_in_window), (0, 0));
        assert!(v.available);
    }
}
