//! The host's checks on a policy's decision. A decision that fails them is treated
//! like a trap: contained, logged and counted. The test kit's conformance suite uses
//! the same checks, so "conformant" and "accepted by the host" mean the same thing.

use std::time::Duration;

use outrigger_types::{
    BudgetDecision, BudgetRequest, CallContext, CallKind, Failure, FallbackRequest, RetryDecision,
};

/// Checks a retry decision: a delay within `max_delay`; a fall-back target among
/// `ctx.fallbacks`; no retry while the retry budget is unavailable; no re-send of a
/// tool call whose class forbids it once it may have been dispatched.
pub fn retry(
    ctx: &CallContext,
    failure: &Failure,
    decision: &RetryDecision,
    max_delay: Duration,
) -> Result<(), String> {
    match decision {
        RetryDecision::RetryAfter(delay) => {
            if *delay > max_delay {
                return Err(format!(
                    "retry delay {} ms exceeds the host maximum of {} ms",
                    delay.as_millis(),
                    max_delay.as_millis()
                ));
            }
            if !ctx.retry_budget.available {
                return Err("retry while the host's retry budget is exhausted".into());
            }
            let in_doubt = ctx.dispatched || failure.may_have_dispatched();
            if let (CallKind::Tool, Some(class), true) = (ctx.kind, ctx.tool_class, in_doubt)
                && !class.resend_in_doubt()
            {
                return Err(format!(
                    "re-send of a tool call of class {} that may have been dispatched",
                    class.as_str()
                ));
            }
            Ok(())
        }
        RetryDecision::FallBack(target) => {
            if ctx.fallbacks.iter().any(|f| f == target) {
                Ok(())
            } else {
                Err(format!(
                    "fall-back target {target:?} is not among the call's fallbacks"
                ))
            }
        }
        RetryDecision::GiveUp(_) => Ok(()),
    }
}

/// Checks a fallback order: duplicate-free indices into the candidates.
pub fn fallback(request: &FallbackRequest, order: &[usize]) -> Result<(), String> {
    let count = request.candidates.len();
    let mut seen = vec![false; count];
    for &i in order {
        let Some(slot) = seen.get_mut(i) else {
            return Err(format!(
                "index {i} is not a candidate (there are {count}, numbered from 0)"
            ));
        };
        if std::mem::replace(slot, true) {
            return Err(format!("candidate {i} appears twice in the order"));
        }
    }
    Ok(())
}

/// Checks a budget decision: a downgrade names a model the request offered.
pub fn budget(request: &BudgetRequest, decision: &BudgetDecision) -> Result<(), String> {
    match decision {
        BudgetDecision::Downgrade(model)
            if !request.downgrades.iter().any(|d| &d.model == model) =>
        {
            Err(format!("downgrade model {model:?} was not offered"))
        }
        BudgetDecision::Admit | BudgetDecision::Reject(_) | BudgetDecision::Downgrade(_) => Ok(()),
    }
}
