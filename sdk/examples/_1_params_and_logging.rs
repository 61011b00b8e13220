//! Example 1: parameters from config, logging and jitter.
//!
//! The sidecar's config passes parameters to the binding as strings:
//!
//! ```toml
//! [policies.retry]
//! path = "policies/jittered.wasm"
//! params = { base_ms = "100", max_attempts = "5" }
//! ```
//!
//! `host::param_or` reads and parses one, falling back to a default. `host::random`
//! is seeded by the host in tests, so the same input gets the same jitter there.

use outrigger_policy_sdk::{CallContext, Failure, RetryDecision, RetryPolicy, host};

/// What the policy reads from config.
pub struct Params {
    /// Base delay in milliseconds.
    pub base_ms: u64,
    /// Attempts after which to give up.
    pub max_attempts: u32,
}

/// A jittered linear backoff driven by parameters.
pub struct JitteredRetry;

impl RetryPolicy for JitteredRetry {
    fn decide(ctx: CallContext, failure: Failure) -> RetryDecision {
        let params = Params {
            base_ms: host::param_or("base_ms", 100),
            max_attempts: host::param_or("max_attempts", 5),
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
    if let Some(delay) = failure.retry_after() {
        return RetryDecision::retry_after(delay);
    }
    let step = params.base_ms.saturating_mul(u64::from(ctx.attempt));
    let jitter = outrigger_policy_sdk::uniform_up_to(random, step / 2);
    RetryDecision::RetryAfter(step.saturating_add(jitter))
}

outrigger_policy_sdk::export_retry!(JitteredRetry);
