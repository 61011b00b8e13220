//! A token-aware concurrency limiter per provider, with a fair queue across tasks.
//!
//! The concurrency limit adapts (AIMD): a success raises it by `1/limit`, a 429
//! halves it and pauses admission for the `Retry-After`. The provider's own
//! rate-limit headers (`x-ratelimit-remaining-requests|tokens` with their `reset`,
//! and Anthropic's `anthropic-ratelimit-*`) pause admission when the requests run
//! out and cap the tokens admitted until the reset. Waiting calls queue per task and
//! are admitted round robin, so one busy task cannot starve the others; a queue that
//! is full or a wait that outlives the queue timeout is refused fast (capacity).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::HeaderMap;
use tokio::sync::oneshot;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub max_concurrency: u32,
    pub min_concurrency: u32,
    /// Calls waiting, over all tasks, before new ones are refused.
    pub max_queue: usize,
    pub queue_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            max_concurrency: 64,
            min_concurrency: 1,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(30),
        }
    }
}

/// Why a call was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error("the provider's queue is full")]
    QueueFull,
    #[error("the call waited {0:?} in the provider's queue")]
    QueueTimeout(Duration),
}

struct Waiter {
    id: u64,
    tokens: u64,
    tx: oneshot::Sender<()>,
}

struct State {
    limit: f64,
    inflight: u32,
    queues: HashMap<String, VecDeque<Waiter>>,
    /// Tasks with waiters, in round-robin order.
    order: VecDeque<String>,
    queued: usize,
    paused_until: Option<Instant>,
    /// Tokens the provider says remain until `.1`.
    tokens: Option<(u64, Instant)>,
    next_id: u64,
}

/// One provider's limiter.
pub struct Limiter {
    options: Options,
    state: Mutex<State>,
    /// Wakes waiting calls when a pause or token window is set, so each waits for
    /// the new end of the pause instead of the one it saw when it went to sleep.
    changed: tokio::sync::Notify,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter").finish_non_exhaustive()
    }
}

/// A call waiting in the queue; dropped unsettled (the caller went away), it leaves
/// the queue, or gives back the slot it was admitted to but never took.
struct Queued<'a> {
    limiter: &'a Arc<Limiter>,
    task: &'a str,
    id: u64,
    rx: oneshot::Receiver<()>,
    settled: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let Ok(mut s) = self.limiter.state.lock() else {
            return;
        };
        remove(&mut s, self.task, self.id);
        if self.rx.try_recv().is_ok() {
            s.inflight = s.inflight.saturating_sub(1);
            self.limiter.dispatch(&mut s, Instant::now());
        }
    }
}

/// Admission to one call; dropping it frees the slot.
pub struct Permit {
    limiter: Arc<Limiter>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Ok(mut s) = self.limiter.state.lock() {
            s.inflight = s.inflight.saturating_sub(1);
            self.limiter.dispatch(&mut s, Instant::now());
        }
    }
}

impl Limiter {
    pub fn new(options: Options) -> Arc<Self> {
        Arc::new(Self {
            options,
            state: Mutex::new(State {
                limit: f64::from(options.max_concurrency.max(1)),
                inflight: 0,
                queues: HashMap::new(),
                order: VecDeque::new(),
                queued: 0,
                paused_until: None,
                tokens: None,
                next_id: 0,
            }),
            changed: tokio::sync::Notify::new(),
        })
    }

    /// Waits for a slot for a call of `task` estimated at `tokens`.
    pub async fn acquire(self: &Arc<Self>, task: &str, tokens: u64) -> Result<Permit, Rejected> {
        let started = Instant::now();
        let deadline = started + self.options.queue_timeout;
        let (id, rx) = {
            let Ok(mut s) = self.state.lock() else {
                return Ok(Permit {
                    limiter: self.clone(),
                });
            };
            let now = Instant::now();
            if s.queued == 0 && self.can_admit(&mut s, tokens, now) {
                self.admit(&mut s, tokens);
                return Ok(Permit {
                    limiter: self.clone(),
                });
            }
            if s.queued >= self.options.max_queue {
                return Err(Rejected::QueueFull);
            }
            let (tx, rx) = oneshot::channel();
            s.next_id += 1;
            let id = s.next_id;
            if !s.queues.contains_key(task) || s.queues.get(task).is_some_and(VecDeque::is_empty) {
                s.order.push_back(task.to_string());
            }
            s.queues
                .entry(task.to_string())
                .or_default()
                .push_back(Waiter { id, tokens, tx });
            s.queued += 1;
            (id, rx)
        };
        // If this call goes away while queued (its agent cancelled), its place must
        // not leak: the guard leaves the queue, or hands back a slot it was given.
        let mut queued = Queued {
            limiter: self,
            task,
            id,
            rx,
            settled: false,
        };
        loop {
            // Wake when admitted, when a pause or token window may have ended (or was
            // set since), or at the deadline.
            let changed = self.changed.notified();
            let wake = self.next_change().map_or(deadline, |t| t.min(deadline));
            tokio::select! {
                admitted = &mut queued.rx => {
                    queued.settled = true;
                    return match admitted {
                        Ok(()) => Ok(Permit { limiter: self.clone() }),
                        Err(_) => Err(Rejected::QueueTimeout(started.elapsed())),
                    };
                }
                () = changed => {}
                () = tokio::time::sleep_until(wake) => {
                    let Ok(mut s) = self.state.lock() else { continue };
                    let now = Instant::now();
                    self.dispatch(&mut s, now);
                    if now >= deadline {
                        queued.settled = true;
                        // Admitted in the same instant? Then take the slot.
                        if queued.rx.try_recv().is_ok() {
                            return Ok(Permit { limiter: self.clone() });
                        }
                        remove(&mut s, task, id);
                        return Err(Rejected::QueueTimeout(started.elapsed()));
                    }
                }
            }
        }
    }

    /// When admission may next change by itself. While paused, only the pause's end:
    /// a token window that resets inside the pause admits nothing, and waking for it
    /// would find the pause still on.
    fn next_change(&self) -> Option<Instant> {
        let s = self.state.lock().ok()?;
        let now = Instant::now();
        match (s.paused_until, s.tokens.map(|t| t.1)) {
            (Some(pause), _) if now < pause => Some(pause),
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn can_admit(&self, s: &mut State, tokens: u64, now: Instant) -> bool {
        // An expired token window goes first, pause or not: left in place, it would
        // stay the next change, already past, and wake every waiter at once.
        if let Some((_, reset)) = s.tokens
            && now >= reset
        {
            s.tokens = None;
        }
        if s.paused_until.is_some_and(|p| now < p) {
            return false;
        }
        s.paused_until = None;
        if s.tokens.is_some_and(|(remaining, _)| tokens > remaining) {
            return false;
        }
        f64::from(s.inflight) < s.limit.floor().max(1.0)
    }

    fn admit(&self, s: &mut State, tokens: u64) {
        s.inflight += 1;
        if let Some((remaining, _)) = &mut s.tokens {
            *remaining = remaining.saturating_sub(tokens);
        }
    }

    /// Admits waiters, one task at a time in turn, while there is room.
    fn dispatch(&self, s: &mut State, now: Instant) {
        while let Some(task) = s.order.pop_front() {
            let Some(queue) = s.queues.get_mut(&task) else {
                continue;
            };
            let Some(head_tokens) = queue.front().map(|w| w.tokens) else {
                s.queues.remove(&task);
                continue;
            };
            if !self.can_admit(s, head_tokens, now) {
                s.order.push_front(task);
                return;
            }
            let Some(queue) = s.queues.get_mut(&task) else {
                continue;
            };
            let Some(w) = queue.pop_front() else { continue };
            let more = !queue.is_empty();
            s.queued = s.queued.saturating_sub(1);
            if more {
                s.order.push_back(task);
            } else {
                s.queues.remove(&task);
            }
            if w.tx.send(()).is_ok() {
                self.admit(s, w.tokens);
            }
        }
    }

    /// Learns from a response: the status and the provider's rate-limit headers.
    pub fn observe(&self, status: u16, headers: &HeaderMap, retry_after: Option<Duration>) {
        let now = Instant::now();
        let Ok(mut s) = self.state.lock() else { return };
        let max = f64::from(self.options.max_concurrency.max(1));
        let min = f64::from(self.options.min_concurrency.max(1));
        if status == 429 {
            s.limit = (s.limit / 2.0).max(min);
            if let Some(d) = retry_after {
                let until = now + d;
                s.paused_until = Some(s.paused_until.map_or(until, |p| p.max(until)));
            }
        } else if (200..300).contains(&status) {
            s.limit = (s.limit + 1.0 / s.limit).min(max);
        }
        let h = |names: &[&str]| {
            names
                .iter()
                .find_map(|n| headers.get(*n).and_then(|v| v.to_str().ok()))
                .map(str::trim)
        };
        let requests_left = h(&[
            "x-ratelimit-remaining-requests",
            "anthropic-ratelimit-requests-remaining",
        ])
        .and_then(|v| v.parse::<u64>().ok());
        if requests_left == Some(0) {
            let reset = h(&[
                "x-ratelimit-reset-requests",
                "anthropic-ratelimit-requests-reset",
            ])
            .and_then(parse_reset)
            .unwrap_or(Duration::from_secs(1));
            let until = now + reset;
            s.paused_until = Some(s.paused_until.map_or(until, |p| p.max(until)));
        }
        if let Some(tokens) = h(&[
            "x-ratelimit-remaining-tokens",
            "anthropic-ratelimit-tokens-remaining",
        ])
        .and_then(|v| v.parse::<u64>().ok())
        {
            let reset = h(&[
                "x-ratelimit-reset-tokens",
                "anthropic-ratelimit-tokens-reset",
            ])
            .and_then(parse_reset)
            .unwrap_or(Duration::from_secs(60));
            s.tokens = Some((tokens, now + reset));
        }
        self.dispatch(&mut s, now);
        drop(s);
        // Waiting calls re-read when the (new) pause or token window ends.
        self.changed.notify_waiters();
    }

    /// The current concurrency limit (for metrics and tests).
    pub fn limit(&self) -> f64 {
        self.state.lock().map(|s| s.limit).unwrap_or(0.0)
    }

    pub fn inflight(&self) -> u32 {
        self.state.lock().map(|s| s.inflight).unwrap_or(0)
    }

    pub fn queued(&self) -> usize {
        self.state.lock().map(|s| s.queued).unwrap_or(0)
    }
}

fn remove(s: &mut State, task: &str, id: u64) {
    if let Some(q) = s.queues.get_mut(task) {
        let before = q.len();
        q.retain(|w| w.id != id);
        s.queued = s.queued.saturating_sub(before - q.len());
        if q.is_empty() {
            s.queues.remove(task);
            s.order.retain(|t| t != task);
        }
    }
}

/// The longest a provider's rate-limit header is taken to ask for: a longer wait (a
/// pause of weeks, `inf`, a number past what a clock can hold) is taken as this one.
pub const MAX_PROVIDER_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A wait of `secs` seconds as a provider header gives it, capped at
/// [`MAX_PROVIDER_WAIT`]; `None` for a negative or not-a-number value.
pub fn provider_wait(secs: f64) -> Option<Duration> {
    if secs.is_nan() || secs < 0.0 {
        return None;
    }
    let wait = Duration::try_from_secs_f64(secs).unwrap_or(MAX_PROVIDER_WAIT);
    Some(wait.min(MAX_PROVIDER_WAIT))
}

/// A reset in OpenAI's style (`6m0s`, `1s`, `20ms`, `1h2m3.5s`) or seconds, or an
/// RFC 3339 time (Anthropic), capped at [`MAX_PROVIDER_WAIT`].
fn parse_reset(v: &str) -> Option<Duration> {
    if let Ok(secs) = v.parse::<f64>() {
        return provider_wait(secs);
    }
    if let Ok(t) = humantime_rfc3339(v) {
        return Some(t.min(MAX_PROVIDER_WAIT));
    }
    let mut total = 0f64;
    let mut num = String::new();
    let mut chars = v.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() || c == '.' {
            num.push(c);
            continue;
        }
        let n: f64 = num.parse().ok()?;
        num.clear();
        let unit = match c {
            'h' => 3600.0,
            'm' if chars.peek() == Some(&'s') => {
                chars.next();
                0.001
            }
            'm' => 60.0,
            's' => 1.0,
            _ => return None,
        };
        total += n * unit;
    }
    if !num.is_empty() {
        return None;
    }
    provider_wait(total)
}

/// Time from now until an RFC 3339 time (zero when it is past).
fn humantime_rfc3339(v: &str) -> Result<Duration, humantime::TimestampError> {
    let t = humantime::parse_rfc3339_weak(v)?;
    Ok(t.duration_since(std::time::SystemTime::now())
        .unwrap_or_default())
}

/// Limiters per provider.
#[derive(Debug)]
pub struct Limiters {
    options: Options,
    by_target: Mutex<HashMap<String, Arc<Limiter>>>,
}

impl Limiters {
    pub fn new(options: Options) -> Self {
        Self {
            options,
            by_target: Mutex::new(HashMap::new()),
        }
    }

    pub fn get(&self, target: &str) -> Arc<Limiter> {
        match self.by_target.lock() {
            Ok(mut m) => m
                .entry(target.to_string())
                .or_insert_with(|| Limiter::new(self.options))
                .clone(),
            Err(_) => Limiter::new(self.options),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(max: u32) -> Options {
        Options {
            max_concurrency: max,
            min_concurrency: 1,
            max_queue: 100,
            queue_timeout: Duration::from_secs(30),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_queue_is_fair_across_tasks() {
        let l = Limiter::new(opts(1));
        let first = l.acquire("busy", 1).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut handles = Vec::new();
        for (i, task) in ["busy", "busy", "busy", "busy", "quiet"].iter().enumerate() {
            let l = l.clone();
            let order = order.clone();
            let task = task.to_string();
            handles.push(tokio::spawn(async move {
                let p = l.acquire(&task, 1).await.unwrap();
                order.lock().unwrap().push(format!("{task}{i}"));
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(p);
            }));
            tokio::task::yield_now().await;
        }
        drop(first);
        for h in handles {
            h.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        // The quiet task is served second, not after all of the busy task's calls.
        assert_eq!(order[1], "quiet4", "{order:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_halves_the_limit_and_pauses_for_retry_after() {
        let l = Limiter::new(opts(8));
        assert_eq!(l.limit(), 8.0);
        l.observe(429, &HeaderMap::new(), Some(Duration::from_secs(2)));
        assert_eq!(l.limit(), 4.0);
        let started = Instant::now();
        let _p = l.acquire("t", 1).await.unwrap();
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        for _ in 0..100 {
            l.observe(200, &HeaderMap::new(), None);
        }
        assert_eq!(l.limit(), 8.0, "additive increase back to the maximum");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_queued_before_a_pause_is_admitted_when_the_pause_ends() {
        let l = Limiter::new(opts(1));
        let held = l.acquire("t", 1).await.unwrap();
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let p = l.acquire("t", 1).await;
                (p.is_ok(), started.elapsed())
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.queued(), 1);
        // The held call comes back 429 with Retry-After 2 s, then frees its slot while
        // admission is paused: the queued call must wake at the pause's end, not at
        // the 30 s queue timeout.
        l.observe(429, &HeaderMap::new(), Some(Duration::from_secs(2)));
        drop(held);
        let (admitted, waited) = waiter.await.unwrap();
        assert!(admitted);
        assert_eq!(waited, Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_queued_call_that_goes_away_leaks_no_slot() {
        let l = Limiter::new(opts(1));
        let held = l.acquire("t", 1).await.unwrap();
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.acquire("t", 1).await.map(drop) })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.queued(), 1);
        // The slot is handed to the waiter and the waiter is cancelled before it runs
        // again: the slot must come back.
        drop(held);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(l.queued(), 0);
        assert_eq!(l.inflight(), 0, "the cancelled call's slot came back");
        let again = tokio::time::timeout(Duration::from_secs(1), l.acquire("t", 1)).await;
        assert!(again.is_ok_and(|p| p.is_ok()));

        // Cancelled while still queued: it leaves the queue.
        let held = l.acquire("t", 1).await.unwrap();
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.acquire("t", 1).await.map(drop) })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.queued(), 1);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(l.queued(), 0);
        drop(held);
        assert_eq!(l.inflight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limit_headers_cap_tokens_until_the_reset() {
        let l = Limiter::new(Options {
            queue_timeout: Duration::from_secs(120),
            ..opts(8)
        });
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-remaining-tokens", "100".parse().unwrap());
        h.insert("x-ratelimit-reset-tokens", "1m30s".parse().unwrap());
        l.observe(200, &h, None);
        let a = l.acquire("t", 80).await.unwrap();
        let started = Instant::now();
        let b = l.acquire("t", 80).await.unwrap();
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(90),
            "waited for the token window to reset"
        );
        drop((a, b));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_and_a_long_wait_are_refused() {
        let l = Limiter::new(Options {
            max_queue: 1,
            queue_timeout: Duration::from_secs(5),
            ..opts(1)
        });
        let _held = l.acquire("a", 1).await.unwrap();
        let l2 = l.clone();
        let waiting = tokio::spawn(async move { l2.acquire("b", 1).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(l.acquire("c", 1).await.err(), Some(Rejected::QueueFull));
        assert_eq!(
            waiting.await.unwrap().err(),
            Some(Rejected::QueueTimeout(Duration::from_secs(5)))
        );
        assert_eq!(l.queued(), 0);
    }

    #[test]
    fn reset_formats() {
        assert_eq!(parse_reset("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_reset("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(parse_reset("1.5"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_reset("1h2m3s"), Some(Duration::from_secs(3723)));
        assert_eq!(parse_reset("soon"), None);
        assert_eq!(
            parse_reset("1970-01-02T00:00:00Z"),
            Some(Duration::ZERO),
            "a past reset"
        );
        // Whatever a header says, the pause is one the clock can hold, and capped.
        for v in [
            "1e30",
            "inf",
            "99999999999999999999h",
            "9999-01-01T00:00:00Z",
        ] {
            assert_eq!(parse_reset(v), Some(MAX_PROVIDER_WAIT), "{v}");
        }
    }

    /// Counts how often the future inside is polled.
    struct Polls<F> {
        inner: std::pin::Pin<Box<F>>,
        count: Arc<std::sync::atomic::AtomicU32>,
    }

    impl<F: std::future::Future> std::future::Future for Polls<F> {
        type Output = F::Output;
        fn poll(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<F::Output> {
            self.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.inner.as_mut().poll(cx)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_reset_inside_a_pause_does_not_spin_the_queue() {
        let l = Limiter::new(opts(1));
        let held = l.acquire("t", 1).await.unwrap();
        let count = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let waiter = {
            let l = l.clone();
            tokio::spawn(Polls {
                inner: Box::pin(async move { l.acquire("t", 1).await.map(drop) }),
                count: count.clone(),
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.queued(), 1);
        // OpenAI's 429: retry after 10 s, while the token window resets in 1 s.
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-remaining-tokens", "0".parse().unwrap());
        h.insert("x-ratelimit-reset-tokens", "1s".parse().unwrap());
        l.observe(429, &h, Some(Duration::from_secs(10)));
        drop(held);
        tokio::time::advance(Duration::from_secs(2)).await;
        count.store(0, std::sync::atomic::Ordering::SeqCst);
        for _ in 0..1_000 {
            tokio::task::yield_now().await;
        }
        let polls = count.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            polls < 10,
            "the waiter was polled {polls} times while paused"
        );
        // It is admitted when the pause ends, not before.
        assert!(!waiter.is_finished());
        tokio::time::advance(Duration::from_secs(8)).await;
        assert!(waiter.await.unwrap().is_ok());
    }
}
