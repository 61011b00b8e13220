//! A deadline-aware retry policy for Outrigger, written against the Rust SDK only.
//!
//! Every call gets a total time budget, `deadline_ms` from its first attempt. A retry
//! is scheduled only when its delay ends early enough to leave `min_attempt_ms` for
//! the attempt itself; when it would not, the call moves to its next fallback target
//! at once (no wait), and when even an attempt no longer fits, it gives up. So an
//! agent waiting on a call hears back within its deadline, instead of after a chain
//! of backoffs that each looked reasonable alone.
//!
//! Backoff is "equal jitter" (half fixed, half random) from `base_ms`, doubling per
//! attempt up to `cap_ms`; a `Retry-After` from the upstream is used as sent, when it
//! fits. Attempts are counted per target (`ctx.attempt_on_target()`): a target fallen
//! back to gets its own `max_attempts` and starts its backoff over, while the
//! deadline keeps counting from the call's first attempt. Content the provider filtered is never sent again; a context overflow or an
//! unparsable tool call moves to a fallback (another model may fit or parse it). Like
//! every policy it never re-sends an `unsafe` or `probe` tool call that may have been
//! dispatched, and never retries once the host's retry budget is spent.
//!
//! Parameters (strings in the sidecar's config): `deadline_ms` (10000),
//! `min_attempt_ms` (1000), `base_ms` (100), `cap_ms` (5000), `max_attempts` (6).
//! Keep `deadline_ms` within the sidecar's maximum retry delay (60 s by default).
//!
//! [`decide`] is a plain function of the parameters, the inputs and one random draw,
//! so `cargo test` checks it natively; the exported type only reads the parameters
//! and the random number through the host.

use std::sync::OnceLock;

use outrigger_policy_sdk::{CallContext, Failure, RetryDecision, RetryPolicy, host};

// Recycle the few small blocks each decision allocates instead of calling the C
// allocator for every one (optional; see the SDK's `alloc` module).
#[cfg(target_family = "wasm")]
#[global_allocator]
static ALLOCATOR: outrigger_policy_sdk::alloc::SmallBlockCache =
    outrigger_policy_sdk::alloc::SmallBlockCache::new();

/// The policy's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Total time a call may take, from its first attempt, in milliseconds.
    pub deadline_ms: u64,
    /// Time an attempt needs, at least, to be worth starting.
    pub min_attempt_ms: u64,
    /// Backoff ceiling of the first retry.
    pub base_ms: u64,
    /// Backoff ceiling of any retry.
    pub cap_ms: u64,
    /// Attempts on one target (the first included) after which the call falls back
    /// or gives up.
    pub max_attempts: u32,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            deadline_ms: 10_000,
            min_attempt_ms: 1_000,
            base_ms: 100,
            cap_ms: 5_000,
            max_attempts: 6,
        }
    }
}

impl Params {
    /// Reads every parameter through the host, each with its default.
    pub fn from_host() -> Self {
        let default = Self::default();
        Self {
            deadline_ms: host::param_or("deadline_ms", default.deadline_ms),
            min_attempt_ms: host::param_or("min_attempt_ms", default.min_attempt_ms),
            base_ms: host::param_or("base_ms", default.base_ms),
            cap_ms: host::param_or("cap_ms", default.cap_ms),
            max_attempts: host::param_or("max_attempts", default.max_attempts),
        }
    }
}

/// The exported retry hook.
pub struct DeadlineRetry;

impl RetryPolicy for DeadlineRetry {
    fn decide(ctx: CallContext, failure: Failure) -> RetryDecision {
        // Parameters are fixed for an instance's life (new params are a new version).
        static PARAMS: OnceLock<Params> = OnceLock::new();
        decide(
            PARAMS.get_or_init(Params::from_host),
            &ctx,
            &failure,
            host::random,
        )
    }
}

outrigger_policy_sdk::export_retry!(DeadlineRetry);

/// Decides what to do after `failure` ended attempt `ctx.attempt`. `random` is drawn
/// at most once, for the jittered half of a backoff.
pub fn decide(
    params: &Params,
    ctx: &CallContext,
    failure: &Failure,
    random: impl FnOnce() -> u64,
) -> RetryDecision {
    if ctx.resend_forbidden(failure) {
        return RetryDecision::give_up(format!(
            "{} on a tool call that may have been dispatched; not re-sending",
            failure.reason()
        ));
    }
    let left_ms = params.deadline_ms.saturating_sub(ctx.elapsed_ms);
    if left_ms < params.min_attempt_ms {
        return RetryDecision::give_up(format!(
            "{} with {left_ms} ms left of the {} ms deadline; no time for another attempt",
            failure.reason(),
            params.deadline_ms
        ));
    }
    match failure {
        Failure::ContentFiltered => {
            return RetryDecision::give_up("content filtered by the provider");
        }
        Failure::ContextOverflow | Failure::ToolParseError => {
            return fall_back_or_give_up(ctx, failure.reason());
        }
        _ => {}
    }
    let attempt = ctx.attempt_on_target();
    if attempt >= params.max_attempts {
        return fall_back_or_give_up(
            ctx,
            &format!(
                "{} after {attempt} attempts on {}",
                failure.reason(),
                ctx.target
            ),
        );
    }
    if !ctx.retry_budget.available {
        return fall_back_or_give_up(ctx, "retry budget exhausted");
    }
    let delay_ms = match failure.retry_after() {
        Some(retry_after) => u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
        None => backoff(params, attempt, random),
    };
    if delay_ms.saturating_add(params.min_attempt_ms) > left_ms {
        return fall_back_or_give_up(
            ctx,
            &format!("waiting {delay_ms} ms would leave too little of the {left_ms} ms left"),
        );
    }
    RetryDecision::RetryAfter(delay_ms)
}

/// "Equal jitter": half of `min(cap, base * 2^(attempt-1))` fixed, the other half
/// uniformly random, so retries spread out but never come back at once.
pub fn backoff(params: &Params, attempt: u32, random: impl FnOnce() -> u64) -> u64 {
    let doublings = attempt.saturating_sub(1).min(63);
    let ceiling = params
        .base_ms
        .saturating_mul(1u64 << doublings)
        .min(params.cap_ms);
    let fixed = ceiling / 2;
    fixed + outrigger_policy_sdk::uniform_up_to(random(), ceiling - fixed)
}

fn fall_back_or_give_up(ctx: &CallContext, why: &str) -> RetryDecision {
    match ctx.next_fallback() {
        Some(target) => RetryDecision::fall_back(target),
        None => RetryDecision::give_up(format!("{why}; no fallback left")),
    }
}

#[cfg(test)]
mod tests {
    use outrigger_policy_sdk::{Attempt, CallKind, RetryBudget, ToolClass};

    use super::*;

    fn ctx(attempt: u32, elapsed_ms: u64, fallbacks: &[&str]) -> CallContext {
        CallContext {
            kind: CallKind::Model,
            target: "primary".into(),
            model: Some("model".into()),
            tool_class: None,
            attempt,
            elapsed_ms,
            dispatched: true,
            history: Vec::new(),
            retry_budget: RetryBudget {
                available: true,
                retries_in_window: 0,
                requests_in_window: 10,
            },
            fallbacks: fallbacks.iter().map(|f| (*f).to_string()).collect(),
        }
    }

    /// The next attempt of a call that failed on `history` (oldest first), now on
    /// `target`, as the host reports it.
    fn after(history: &[&str], target: &str, elapsed_ms: u64, fallbacks: &[&str]) -> CallContext {
        let mut c = ctx(0, elapsed_ms, fallbacks);
        c.target = target.into();
        c.history = history
            .iter()
            .map(|t| Attempt {
                target: (*t).into(),
                failure: Failure::ServerError(503),
                elapsed_ms,
            })
            .collect();
        c.attempt = u32::try_from(history.len()).unwrap_or(u32::MAX) + 1;
        c
    }

    fn no_draw() -> u64 {
        panic!("no random draw expected")
    }

    #[test]
    fn table() {
        let p = Params::default();
        let top = || u64::MAX;
        let cases: Vec<(&str, CallContext, Failure, RetryDecision)> = vec![
            (
                "503 early: ceiling 100 ms, top draw",
                ctx(1, 200, &[]),
                Failure::ServerError(503),
                RetryDecision::RetryAfter(100),
            ),
            (
                "503 on attempt 4: ceiling 800 ms",
                ctx(4, 2_000, &[]),
                Failure::ServerError(503),
                RetryDecision::RetryAfter(800),
            ),
            (
                "Retry-After that fits is used as sent",
                ctx(1, 0, &["backup"]),
                Failure::RateLimited(Some(3_000)),
                RetryDecision::RetryAfter(3_000),
            ),
            (
                "Retry-After past the deadline falls back at once",
                ctx(1, 0, &["backup"]),
                Failure::RateLimited(Some(9_500)),
                RetryDecision::FallBack("backup".into()),
            ),
            (
                "backoff that would not leave room for the attempt falls back",
                ctx(5, 8_500, &["backup"]),
                Failure::Timeout,
                RetryDecision::FallBack("backup".into()),
            ),
            (
                "context overflow falls back",
                ctx(1, 0, &["primary", "long"]),
                Failure::ContextOverflow,
                RetryDecision::FallBack("long".into()),
            ),
            // Attempts count per target: the backup, fallen back to after six
            // attempts on the primary, is retried from the first backoff.
            (
                "503 on the backup after 6 on the primary",
                after(&["primary"; 6], "backup", 3_000, &["backup"]),
                Failure::ServerError(503),
                RetryDecision::RetryAfter(100),
            ),
            (
                "sixth attempt on the backup: nothing left to fall back to",
                after(&["backup"; 5], "backup", 3_000, &["backup"]),
                Failure::ServerError(503),
                RetryDecision::GiveUp(
                    "server_error after 6 attempts on backup; no fallback left".into(),
                ),
            ),
        ];
        for (name, c, failure, want) in cases {
            assert_eq!(decide(&p, &c, &failure, top), want, "{name}");
        }
    }

    #[test]
    fn gives_up_when_no_attempt_fits_or_nothing_helps() {
        let p = Params::default();
        let cases = [
            (ctx(1, 9_001, &["backup"]), Failure::ServerError(502)),
            (ctx(1, u64::MAX, &["backup"]), Failure::Timeout),
            (ctx(1, 0, &["backup"]), Failure::ContentFiltered),
            (ctx(6, 0, &[]), Failure::ServerError(500)),
            (ctx(1, 0, &[]), Failure::RateLimited(Some(u64::MAX))),
        ];
        for (c, failure) in cases {
            let decision = decide(&p, &c, &failure, || 0);
            assert!(
                matches!(decision, RetryDecision::GiveUp(_)),
                "{failure:?} at {} ms: {decision:?}",
                c.elapsed_ms
            );
        }
    }

    #[test]
    fn never_resends_an_unsafe_tool_call_in_doubt() {
        let c = CallContext {
            kind: CallKind::Tool,
            tool_class: Some(ToolClass::Unsafe),
            ..ctx(1, 0, &["backup"])
        };
        let decision = decide(&Params::default(), &c, &Failure::Timeout, no_draw);
        assert!(matches!(decision, RetryDecision::GiveUp(r) if r.contains("not re-sending")));
    }

    #[test]
    fn no_retry_without_budget() {
        let mut c = ctx(1, 0, &["backup"]);
        c.retry_budget.available = false;
        assert_eq!(
            decide(&Params::default(), &c, &Failure::ServerError(503), no_draw),
            RetryDecision::FallBack("backup".into())
        );
    }

    #[test]
    fn backoff_stays_within_half_and_all_of_the_ceiling() {
        let p = Params::default();
        for attempt in [0, 1, 2, 6, 7, 64, u32::MAX] {
            let ceiling = p
                .base_ms
                .saturating_mul(1 << attempt.saturating_sub(1).min(63))
                .min(p.cap_ms);
            assert_eq!(backoff(&p, attempt, || 0), ceiling / 2, "attempt {attempt}");
            assert_eq!(
                backoff(&p, attempt, || u64::MAX),
                ceiling,
                "attempt {attempt}"
            );
        }
    }
}
