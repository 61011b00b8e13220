//! Example 0: the smallest useful policy — a retry hook with a fixed schedule.
//!
//! Build it as a component and check it with the sidecar:
//!
//! ```sh
//! cargo build -p outrigger-policy-sdk --example _0_minimal_retry --target wasm32-wasip2 --release
//! outrigger policy check target/wasm32-wasip2/release/examples/_0_minimal_retry.wasm
//! ```

use outrigger_policy_sdk::{CallContext, Failure, RetryDecision, RetryPolicy};

/// Retries twice, 100 ms then 400 ms apart, and gives up on failures that a retry
/// cannot fix.
pub struct MinimalRetry;

impl RetryPolicy for MinimalRetry {
    fn decide(ctx: CallContext, failure: Failure) -> RetryDecision {
        decide(&ctx, &failure)
    }
}

/// The decision as a plain function, so it can be unit-tested natively.
pub fn decide(ctx: &CallContext, failure: &Failure) -> RetryDecision {
    if ctx.resend_forbidden(failure) {
        return RetryDecision::give_up("an unsafe tool call may have been dispatched");
    }
    if !ctx.retry_budget.available {
        return RetryDecision::give_up("retry budget exhausted");
    }
    match failure {
        Failure::ContentFiltered | Failure::ToolParseError | Failure::ContextOverflow => {
            RetryDecision::give_up(format!("{} is not retryable", failure.reason()))
        }
        _ => match ctx.attempt {
            1 => RetryDecision::RetryAfter(100),
            2 => RetryDecision::RetryAfter(400),
            n => RetryDecision::give_up(format!("gave up after {n} attempts")),
        },
    }
}

outrigger_policy_sdk::export_retry!(MinimalRetry);
