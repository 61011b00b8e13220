//! Example 1: parameters from config, logging and jitter.
//!
//! The sidecar's config passes parameters to the binding as strings:
//!
//! ```toml
//! [[policies.bindings]]
//! hook = "retry"
//! policy = "policies/jittered.wasm"   # or the stem of a .wasm in [policies] dir
//! params = { base_ms = "100", max_attempts = "5", max_delay_ms = "30000" }
//! ```
//!
//! `host::param_or` reads and parses one, falling back to a default. `host::random`
//! is seeded by the host in tests, so the same input gets the same jitter there.
//!
//! Every delay stays within `max_delay_ms`: the host refuses a delay beyond its own
//! maximum (`[policies] max_retry_delay`, 60 s by default) as a policy failure, so a
//! `Retry-After` longer than that is not waited for, and the backoff is capped.

use std::time::Duration;

use outrigger_policy_sdk::{CallContext, Failure, RetryDecision, RetryPolicy, host};

/// What the policy reads from config.
pub struct Params {
    /// Base delay in milliseconds.
    pub base_ms: u64,
    /// Attempts after which to give up.
    pub max_attempts: u32,
    /// The longest delay, in milliseconds: a longer `Retry-After` is not waited for,
    /// and the backoff stops growing there. Keep it within the sidecar's
    /// `[policies] max_retry_delay`.
    pub max_delay_ms: u64,
}

/// A jittered linear backoff driven by parameters.
pub struct JitteredRetry;

impl RetryPolicy for JitteredRetry {
    fn decide(ctx: CallContext, failure: Failure) -> RetryDecision {
        let params = Params {
            base_ms: host::param_or("base_ms", 100),
            max_attempts: host::param_or("max_attempts", 5),
            max_delay_ms: host::param_or("max_delay_ms", 30_000),
        };
        let decision = decide(&params, &ctx, &failure, host::random());
        if let RetryDecision::GiveUp(reason) = &decision {
            // The host tags every log line with the call's task and request ids;
            // `host::task_id()` and `host::request_id()` return them too.
            host::info(&format!("giving up: {reason}"));
        }
        decision
    }
}

/// The decision as a plain function of its inputs, including the random draw.
pub fn decide(params: &Params, ctx: &CallContext, failure: &Failure, random: u64) -> RetryDecision {
    if ctx.resend_forbidden(failure) || !ctx.retry_budget.available {
        return RetryDecision::give_up("retry not allowed");
    }
    if ctx.attempt >= params.max_attempts {
        return RetryDecision::give_up(format!("gave up after {} attempts", ctx.attempt));
    }
    let max_delay = Duration::from_millis(params.max_delay_ms);
    if let Some(delay) = failure.retry_after() {
        if delay > max_delay {
            return RetryDecision::give_up(format!(
                "Retry-After {} ms is longer than the {} ms this policy waits",
                delay.as_millis(),
                params.max_delay_ms
            ));
        }
        return RetryDecision::retry_after(delay);
    }
    let step = params.base_ms.saturating_mul(u64::from(ctx.attempt));
    let jitter = outrigger_policy_sdk::uniform_up_to(random, step / 2);
    RetryDecision::RetryAfter(step.saturating_add(jitter).min(params.max_delay_ms))
}

outrigger_policy_sdk::export_retry!(JitteredRetry);
