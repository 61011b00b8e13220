//! Example 3: one component implementing all three hooks.
//!
//! `export_policy!` exports a type as the retry, fallback and budget hook at once;
//! the single-hook macros can also be combined (for example `export_retry!` and
//! `export_budget!` for a component with two hooks). The sidecar detects which hooks
//! a component implements, so the same file can be bound to several hooks.

use outrigger_policy_sdk::{
    BudgetDecision, BudgetPolicy, BudgetRequest, CallContext, Failure, FallbackPolicy,
    FallbackRequest, RetryDecision, RetryPolicy,
};

/// A deliberately simple policy: retry server errors twice, keep the configured
/// order, and admit while no limit would be exceeded.
pub struct Conservative;

impl RetryPolicy for Conservative {
    fn decide(ctx: CallContext, failure: Failure) -> RetryDecision {
        match failure {
            Failure::ServerError(_) | Failure::Timeout
                if ctx.attempt < 3
                    && ctx.retry_budget.available
                    && !ctx.resend_forbidden(&failure) =>
            {
                RetryDecision::RetryAfter(500)
            }
            _ => RetryDecision::give_up(format!("{} not retried", failure.reason())),
        }
    }
}

impl FallbackPolicy for Conservative {
    fn order(request: FallbackRequest) -> Vec<u32> {
        // Every candidate, in the configured order.
        let count = u32::try_from(request.candidates.len()).unwrap_or(u32::MAX);
        (0..count).collect()
    }
}

impl BudgetPolicy for Conservative {
    fn admit(request: BudgetRequest) -> BudgetDecision {
        let call = outrigger_policy_sdk::Usage {
            tokens_in: request.estimated_tokens_in,
            tokens_out: request.estimated_tokens_out,
            cost_micros: request.estimated_cost_micros,
            wall_clock_ms: 0,
            calls: 1,
            retries: 0,
        };
        match request.limits.exceeded_by(&request.usage.plus(&call)) {
            Some((limit, used, max)) => {
                BudgetDecision::reject(format!("{limit} limit: {used} would exceed {max}"))
            }
            None => BudgetDecision::Admit,
        }
    }
}

outrigger_policy_sdk::export_policy!(Conservative);
