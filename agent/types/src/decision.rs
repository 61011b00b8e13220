//! The inputs and outputs of the three policy hooks (retry, fallback, budget),
//! mirroring `wit/policy.wit`, plus the record of who decided.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Failure, GpuState, Limits, Modalities, PolicyVersion, ToolClass, Usage};

/// Which kind of call a decision is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallKind {
    Model,
    Tool,
}

/// One earlier failed attempt of the same call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub target: String,
    pub failure: Failure,
    pub elapsed: Duration,
}

/// The host's retry budget as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryBudget {
    pub available: bool,
    pub retries_in_window: u32,
    pub requests_in_window: u32,
}

impl Default for RetryBudget {
    fn default() -> Self {
        Self {
            available: true,
            retries_in_window: 0,
            requests_in_window: 0,
        }
    }
}

/// What the host knows about a call that just failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallContext {
    pub task_id: Option<String>,
    pub request_id: String,
    pub kind: CallKind,
    pub target: String,
    pub model: Option<String>,
    pub tool_class: Option<ToolClass>,
    /// 1-based number of the attempt that just failed.
    pub attempt: u32,
    pub elapsed: Duration,
    /// Whether the failed attempt may have reached the upstream.
    pub dispatched: bool,
    pub history: Vec<AttemptRecord>,
    pub retry_budget: RetryBudget,
    /// The targets the call may still fall back to, in the fallback hook's order:
    /// those not tried yet, never `target` itself.
    pub fallbacks: Vec<String>,
}

/// What to do after a failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", content = "value", rename_all = "snake_case")]
pub enum RetryDecision {
    RetryAfter(Duration),
    FallBack(String),
    GiveUp(String),
}

/// Circuit-breaker state of a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CircuitState {
    Closed,
    Open,
    HalfOpen,
}

impl CircuitState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

/// A target a model call could go to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    /// The target's configured name (a provider's name).
    pub name: String,
    pub supports_tools: bool,
    pub supports_streaming: bool,
    /// Context window in tokens; 0 when unknown.
    pub context_window: u32,
    /// Input modalities it accepts; empty when unknown.
    pub modalities: Modalities,
    pub circuit: CircuitState,
    pub local: bool,
    /// `None` when the target does not run on a local GPU.
    pub gpu: Option<GpuState>,
    pub cost_per_mtok_in: u64,
    pub cost_per_mtok_out: u64,
}

/// A request for an ordering of candidates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FallbackRequest {
    pub task_id: Option<String>,
    pub request_id: String,
    pub model: String,
    pub needs_tools: bool,
    pub streaming: bool,
    pub estimated_tokens: u32,
    pub modalities: Modalities,
    pub candidates: Vec<Candidate>,
}

/// A cheaper model a call may be downgraded to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DowngradeOption {
    pub model: String,
    pub cost_per_mtok_in: u64,
    pub cost_per_mtok_out: u64,
}

/// A call asking to be admitted under its task's budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetRequest {
    pub task_id: Option<String>,
    pub request_id: String,
    pub model: String,
    pub estimated_tokens_in: u64,
    pub estimated_tokens_out: u64,
    pub estimated_cost_micros: u64,
    /// Usage so far, including reservations of calls still in flight.
    pub usage: Usage,
    pub limits: Limits,
    pub downgrades: Vec<DowngradeOption>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", content = "value", rename_all = "snake_case")]
pub enum BudgetDecision {
    Admit,
    Reject(String),
    Downgrade(String),
}

/// Who produced a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionSource {
    /// The bound policy, as configured.
    Policy,
    /// The bound policy failed (trap, deadline, invalid decision); the last good
    /// version, or the built-in, decided instead.
    Contained,
    /// No policy was consulted (none bound, or the binding fails open).
    HostDefault,
}

/// A decision together with the version of the policy that made it, so the journal
/// can say what decided each call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decided<T> {
    pub value: T,
    pub version: PolicyVersion,
    pub source: DecisionSource,
}

impl<T> Decided<T> {
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Decided<U> {
        Decided {
            value: f(self.value),
            version: self.version,
            source: self.source,
        }
    }
}
