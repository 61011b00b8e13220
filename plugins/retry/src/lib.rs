//! The built-in retry policy: exponential backoff with full jitter, bounded attempts
//! per target, `Retry-After` honoured up to a maximum, and no re-send of a tool call
//! whose side effect cannot be deduplicated.
//!
//! Attempts are counted on the target that failed ([`CallContext::attempt_on_target`]),
//! not over the whole call: "retry up to `max_attempts` times, then fall back" gives
//! the target fallen back to its own retries and backoff from the start, where a
//! count over the call would give up on the first failure there. The host still
//! bounds the call as a whole (`[resilience] max_attempts`).
//!
//! Invariants: it never retries while the host's retry budget is unavailable; it never
//! re-sends a tool call of class `unsafe` or `probe` that may have been dispatched; a
//! delay never exceeds `max(cap_ms, max_retry_after_ms)`, nor the host's longest retry
//! delay (`max_retry_delay_ms`, which the host sets from `[policies] max_retry_delay`:
//! a `Retry-After` beyond it is treated like one beyond `max_retry_after_ms`, and the
//! backoff is capped by it), so the host never refuses one of its decisions; a
//! fall-back target is always one of `ctx.fallbacks` not tried yet. The decision is a pure function of the
//! parameters, the inputs and one random draw ([`decide`]) so it is unit-tested
//! natively; the component shell only reads parameters and the random import.
//!
//! Parameters (strings in config): `base_ms` (200), `cap_ms` (20000), `max_attempts`
//! (4), `max_retry_after_ms` (30000); and `max_retry_delay_ms`, set by the host (none
//! outside the sidecar, as in the test kit: no bound beyond the other two).

use std::sync::OnceLock;

use outrigger_policy_sdk::{CallContext, Failure, RetryDecision, RetryPolicy, host};

// Decisions allocate a few small blocks each; recycle them (see the SDK's `alloc`).
#[cfg(target_family = "wasm")]
#[global_allocator]
static ALLOCATOR: outrigger_policy_sdk::alloc::SmallBlockCache =
    outrigger_policy_sdk::alloc::SmallBlockCache::new();

/// The policy's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Backoff before the first retry grows from this, in milliseconds.
    pub base_ms: u64,
    /// Backoff ceiling in milliseconds.
    pub cap_ms: u64,
    /// Attempts on one target (the first included) after which the call falls back
    /// or gives up.
    pub max_attempts: u32,
    /// The longest `Retry-After` honoured; beyond it, fall back or give up.
    pub max_retry_after_ms: u64,
    /// The longest delay the host accepts (its `max_retry_delay`); no delay exceeds it.
    pub host_max_delay_ms: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            base_ms: 200,
            cap_ms: 20_000,
            max_attempts: 4,
            max_retry_after_ms: 30_000,
            host_max_delay_ms: u64::MAX,
        }
    }
}

impl Params {
    /// Reads the parameters through the host, defaulting each one.
    pub fn from_host() -> Self {
        let default = Self::default();
        Self {
            base_ms: host::param_or("base_ms", default.base_ms),
            cap_ms: host::param_or("cap_ms", default.cap_ms),
            max_attempts: host::param_or("max_attempts", default.max_attempts),
            max_retry_after_ms: host::param_or("max_retry_after_ms", default.max_retry_after_ms),
            host_max_delay_ms: host::param_or("max_retry_delay_ms", default.host_max_delay_ms),
        }
    }
}

impl Params {
    /// The longest `Retry-After` waited for: this policy's maximum, or the host's
    /// when that is shorter.
    pub fn longest_retry_after(&self) -> u64 {
        self.max_retry_after_ms.min(self.host_max_delay_ms)
    }
}

/// The built-in retry policy.
pub struct BuiltinRetry;

impl RetryPolicy for BuiltinRetry {
    fn decide(ctx: CallContext, failure: Failure) -> RetryDecision {
        // Parameters are fixed for an instance's life (a change of config is a new
        // version), so read them through the host once rather than on every call.
        static PARAMS: OnceLock<Params> = OnceLock::new();
        decide(
            PARAMS.get_or_init(Params::from_host),
            &ctx,
            &failure,
            host::random,
        )
    }
}

outrigger_policy_sdk::export_retry!(BuiltinRetry);

/// Decides what to do after `failure` ended attempt `ctx.attempt` (attempt
/// `ctx.attempt_on_target()` on its target). `random` is called at most once, only
/// when a jittered delay is needed.
pub fn decide(
    params: &Params,
    ctx: &CallContext,
    failure: &Failure,
    random: impl FnOnce() -> u64,
) -> RetryDecision {
    if ctx.resend_forbidden(failure) {
        let class = ctx.tool_class.map_or("unknown", |c| match c {
            outrigger_policy_sdk::ToolClass::Keyed => "keyed",
            outrigger_policy_sdk::ToolClass::Idempotent => "idempotent",
            outrigger_policy_sdk::ToolClass::Probe => "probe",
            outrigger_policy_sdk::ToolClass::Unsafe => "unsafe",
        });
        return RetryDecision::give_up(format!(
            "tool call of class {class} may have been dispatched ({}); not re-sending",
            failure.reason()
        ));
    }
    match failure {
        Failure::ContentFiltered | Failure::ToolParseError => {
            return RetryDecision::give_up(format!("{} is not retryable", failure.reason()));
        }
        Failure::ContextOverflow => {
            return fall_back_or_give_up(ctx, "context overflow");
        }
        Failure::RateLimited(Some(retry_after_ms))
            if *retry_after_ms > params.longest_retry_after() =>
        {
            return fall_back_or_give_up(
                ctx,
                &format!(
                    "Retry-After {retry_after_ms} ms exceeds the {} ms maximum",
                    params.longest_retry_after()
                ),
            );
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
    match failure {
        Failure::RateLimited(Some(retry_after_ms)) => RetryDecision::RetryAfter(*retry_after_ms),
        _ => RetryDecision::RetryAfter(full_jitter(params, attempt, random)),
    }
}

/// "Full jitter" backoff: uniform in `0..=min(cap, host maximum, base * 2^(attempt-1))`.
pub fn full_jitter(params: &Params, attempt: u32, random: impl FnOnce() -> u64) -> u64 {
    let doublings = attempt.saturating_sub(1).min(63);
    let ceiling = params
        .base_ms
        .saturating_mul(1u64 << doublings)
        .min(params.cap_ms)
        .min(params.host_max_delay_ms);
    outrigger_policy_sdk::uniform_up_to(random(), ceiling)
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

    fn ctx(attempt: u32) -> CallContext {
        CallContext {
            kind: CallKind::Model,
            target: "openai".into(),
            model: Some("gpt".into()),
            tool_class: None,
            attempt,
            elapsed_ms: 10,
            dispatched: true,
            history: Vec::new(),
            retry_budget: RetryBudget {
                available: true,
                retries_in_window: 0,
                requests_in_window: 10,
            },
            fallbacks: Vec::new(),
        }
    }

    fn with_fallbacks(mut c: CallContext, names: &[&str]) -> CallContext {
        c.fallbacks = names.iter().map(|n| (*n).to_string()).collect();
        c
    }

    /// Attempt `history.len() + 1` of a call, on `target`, after failures on
    /// `history` (oldest first), as the host reports it.
    fn after(history: &[&str], target: &str, fallbacks: &[&str]) -> CallContext {
        let mut c = with_fallbacks(ctx(0), fallbacks);
        c.target = target.into();
        c.history = history
            .iter()
            .map(|t| Attempt {
                target: (*t).into(),
                failure: Failure::RateLimited(None),
                elapsed_ms: 5,
            })
            .collect();
        c.attempt = u32::try_from(history.len()).unwrap_or(u32::MAX) + 1;
        c
    }

    fn tool(class: ToolClass, dispatched: bool) -> CallContext {
        CallContext {
            kind: CallKind::Tool,
            tool_class: Some(class),
            dispatched,
            ..ctx(1)
        }
    }

    fn give_up(d: &RetryDecision) -> bool {
        matches!(d, RetryDecision::GiveUp(_))
    }

    #[test]
    fn table() {
        let p = Params::default();
        let max = || u64::MAX;
        let cases: Vec<(&str, CallContext, Failure, RetryDecision)> = vec![
            (
                "429 with Retry-After 2 s",
                ctx(1),
                Failure::RateLimited(Some(2000)),
                RetryDecision::RetryAfter(2000),
            ),
            (
                "Retry-After at the maximum",
                ctx(1),
                Failure::RateLimited(Some(30_000)),
                RetryDecision::RetryAfter(30_000),
            ),
            (
                "Retry-After beyond the maximum falls back",
                with_fallbacks(ctx(1), &["openai", "anthropic"]),
                Failure::RateLimited(Some(30_001)),
                RetryDecision::FallBack("anthropic".into()),
            ),
            (
                "503, attempt 1, top draw",
                ctx(1),
                Failure::ServerError(503),
                RetryDecision::RetryAfter(200),
            ),
            (
                "503, attempt 3, top draw",
                ctx(3),
                Failure::ServerError(503),
                RetryDecision::RetryAfter(800),
            ),
            (
                "connect error before send",
                ctx(1),
                Failure::ConnectError(false),
                RetryDecision::RetryAfter(200),
            ),
            (
                "context overflow falls back",
                with_fallbacks(ctx(1), &["big-context"]),
                Failure::ContextOverflow,
                RetryDecision::FallBack("big-context".into()),
            ),
            (
                "attempts exhausted fall back",
                with_fallbacks(ctx(4), &["local"]),
                Failure::Timeout,
                RetryDecision::FallBack("local".into()),
            ),
            // Attempts count per target: the backup fallen back to after four
            // attempts on the primary gets its own retries, from the first backoff.
            (
                "429 on the backup after 4 on the primary",
                after(&["primary"; 4], "backup", &["backup", "local"]),
                Failure::RateLimited(None),
                RetryDecision::RetryAfter(200),
            ),
            (
                "third attempt on the backup",
                after(
                    &["primary", "primary", "backup", "backup"],
                    "backup",
                    &["backup", "local"],
                ),
                Failure::ServerError(503),
                RetryDecision::RetryAfter(800),
            ),
            (
                "fourth attempt on the backup falls back",
                after(
                    &["primary", "backup", "backup", "backup"],
                    "backup",
                    &["backup", "local"],
                ),
                Failure::ServerError(503),
                RetryDecision::FallBack("local".into()),
            ),
        ];
        for (name, c, failure, want) in cases {
            assert_eq!(decide(&p, &c, &failure, max), want, "{name}");
        }
    }

    #[test]
    fn gives_up_where_a_retry_cannot_help() {
        let p = Params::default();
        let never = || -> u64 { panic!("no jitter expected") };
        for (c, failure) in [
            (ctx(1), Failure::ContentFiltered),
            (ctx(1), Failure::ToolParseError),
            (ctx(1), Failure::ContextOverflow),
            (ctx(4), Failure::ServerError(500)),
            (ctx(u32::MAX), Failure::Timeout),
            (ctx(1), Failure::RateLimited(Some(u64::MAX))),
        ] {
            assert!(
                give_up(&decide(&p, &c, &failure, never)),
                "{failure:?} attempt {}",
                c.attempt
            );
        }
    }

    #[test]
    fn unsafe_and_probe_tools_are_never_resent_once_dispatched() {
        let p = Params::default();
        let top = || u64::MAX;
        for class in [ToolClass::Unsafe, ToolClass::Probe] {
            assert!(give_up(&decide(
                &p,
                &tool(class, true),
                &Failure::ServerError(502),
                top
            )));
            // A timeout may have reached the tool even if ctx.dispatched is false.
            assert!(give_up(&decide(
                &p,
                &tool(class, false),
                &Failure::Timeout,
                top
            )));
            // A connection refused before sending is safe to retry.
            assert_eq!(
                decide(&p, &tool(class, false), &Failure::ConnectError(false), top),
                RetryDecision::RetryAfter(200)
            );
        }
        for class in [ToolClass::Keyed, ToolClass::Idempotent] {
            assert!(!give_up(&decide(
                &p,
                &tool(class, true),
                &Failure::ServerError(502),
                top
            )));
        }
    }

    #[test]
    fn exhausted_budget_never_retries() {
        let p = Params::default();
        let mut c = ctx(1);
        c.retry_budget.available = false;
        assert!(give_up(&decide(
            &p,
            &c,
            &Failure::RateLimited(Some(10)),
            || 0
        )));
        let c = with_fallbacks(c, &["openai", "other"]);
        assert_eq!(
            decide(&p, &c, &Failure::ServerError(503), || 0),
            RetryDecision::FallBack("other".into())
        );
    }

    #[test]
    fn fallback_skips_targets_already_tried() {
        // Four attempts on openai, after one on anthropic.
        let c = after(
            &["anthropic", "openai", "openai", "openai"],
            "openai",
            &["openai", "anthropic", "local"],
        );
        assert_eq!(
            decide(&Params::default(), &c, &Failure::Timeout, || 0),
            RetryDecision::FallBack("local".into())
        );
    }

    /// With `[policies] max_retry_delay = "10s"`, a `Retry-After` of 15 s is too long
    /// to wait for: the host would refuse the delay, so the call falls back.
    #[test]
    fn the_hosts_longest_delay_bounds_every_delay() {
        let p = Params {
            host_max_delay_ms: 10_000,
            ..Params::default()
        };
        let c = with_fallbacks(ctx(1), &["openai", "backup"]);
        assert_eq!(
            decide(&p, &c, &Failure::RateLimited(Some(15_000)), || 0),
            RetryDecision::FallBack("backup".into())
        );
        assert!(matches!(
            decide(&p, &ctx(1), &Failure::RateLimited(Some(15_000)), || 0),
            RetryDecision::GiveUp(reason) if reason.contains("exceeds the 10000 ms maximum")
        ));
        assert_eq!(
            decide(&p, &c, &Failure::RateLimited(Some(10_000)), || 0),
            RetryDecision::RetryAfter(10_000)
        );
        // The backoff is capped too: below the host's maximum it is untouched; by
        // the ninth attempt 200 ms doubled is past the host's 10 s (and the 20 s cap).
        assert_eq!(
            decide(&p, &ctx(3), &Failure::ServerError(503), || u64::MAX),
            RetryDecision::RetryAfter(800)
        );
        let long = Params {
            max_attempts: 10,
            ..p
        };
        assert_eq!(
            decide(&long, &ctx(9), &Failure::Timeout, || u64::MAX),
            RetryDecision::RetryAfter(10_000)
        );
    }

    #[test]
    fn jitter_is_bounded_by_the_cap_for_any_attempt() {
        let p = Params::default();
        for attempt in [0, 1, 2, 7, 8, 40, 64, 65, u32::MAX] {
            let d = full_jitter(&p, attempt, || u64::MAX);
            assert!(d <= p.cap_ms, "attempt {attempt}: {d}");
        }
        assert_eq!(full_jitter(&p, 200, || u64::MAX), p.cap_ms);
        assert_eq!(full_jitter(&p, 1, || 0), 0);
    }
}
