//! The port through which the data plane asks for decisions. The proxy enforces;
//! whatever implements [`Decider`] decides. The binary plugs in the WebAssembly policy
//! registry; tests plug in scripted deciders, so the proxy never compiles wasmtime.

use std::time::Duration;

use outrigger_types::{
    BudgetDecision, BudgetRequest, CallContext, Decided, DecisionSource, Failure, FallbackRequest,
    PolicyVersion, RetryDecision,
};

pub trait Decider: Send + Sync + 'static {
    /// What to do after `failure` ended attempt `ctx.attempt`.
    fn retry(&self, ctx: &CallContext, failure: &Failure) -> Decided<RetryDecision>;
    /// The candidates to try, in order, as indices into `req.candidates`.
    fn fallback(&self, req: &FallbackRequest) -> Decided<Vec<usize>>;
    /// Admit, reject or downgrade a call before it is sent.
    fn budget(&self, req: &BudgetRequest) -> Decided<BudgetDecision>;
    /// The policy versions in force now, which journal records name. Empty when
    /// no component is bound (host defaults decide).
    fn versions(&self) -> Vec<PolicyVersion> {
        Vec::new()
    }
}

/// Decides without any policy: never retries, keeps the configured order, admits
/// everything. What the data plane does when no decider is installed.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoPolicy;

impl Decider for NoPolicy {
    fn retry(&self, _: &CallContext, _: &Failure) -> Decided<RetryDecision> {
        host_default(
            "retry",
            RetryDecision::GiveUp("no retry policy is installed".into()),
        )
    }

    fn fallback(&self, req: &FallbackRequest) -> Decided<Vec<usize>> {
        host_default("fallback", (0..req.candidates.len()).collect())
    }

    fn budget(&self, _: &BudgetRequest) -> Decided<BudgetDecision> {
        host_default("budget", BudgetDecision::Admit)
    }
}

fn host_default<T>(binding: &str, value: T) -> Decided<T> {
    Decided {
        value,
        version: PolicyVersion::host_default(binding),
        source: DecisionSource::HostDefault,
    }
}

/// The longest delay the data plane will honour from any retry decision; a policy
/// asking for more is clamped (and the policy host counts it as invalid).
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(60);
