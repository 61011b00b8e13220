//! Scenarios: a scripted sequence of retry failures, fallback requests and budget
//! requests (a TOML file, documented in `sdk/README.md`), replayed against a policy
//! with each decision reported and, where the step says what to expect, checked.
//!
//! Retry steps that share a `request_id` form one call: unless a step sets
//! `attempt`, it is one more than the previous step of that call, and the earlier
//! steps' failures become its `history`, as the sidecar would report them.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use outrigger_policy::{Hook, Loaded, validate};
use outrigger_types::{
    AttemptRecord, BudgetDecision, BudgetRequest, CallContext, CallKind, Candidate, CircuitState,
    DowngradeOption, Failure, FallbackRequest, GpuState, Limits, Modalities, RetryBudget,
    RetryDecision, ToolClass, Usage,
};
use serde::{Deserialize, Serialize};

use crate::Error;

/// A parsed scenario file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// What it is about.
    #[serde(default)]
    pub description: String,
    /// The policy's parameters (answers of the `param` import).
    #[serde(default)]
    pub params: BTreeMap<String, String>,
    #[serde(default, rename = "step")]
    pub steps: Vec<Step>,
}

impl Scenario {
    /// Parses a scenario from TOML; errors name the offending key. A step must have
    /// exactly one hook, and its `expect` only keys (and a `decision`) that hook's
    /// decisions can meet: a key that cannot apply would otherwise never be checked
    /// and the step pass whatever the policy decides. Every such problem is reported.
    pub fn from_toml(text: &str) -> Result<Self, Error> {
        let scenario: Self = toml::from_str(text).map_err(|e| Error::Scenario(e.to_string()))?;
        let mut problems = Vec::new();
        for (index, step) in scenario.steps.iter().enumerate() {
            let which = format!("step {} ({:?})", index + 1, step.name);
            let hooks = [
                (Hook::Retry, step.retry.is_some()),
                (Hook::Fallback, step.fallback.is_some()),
                (Hook::Budget, step.budget.is_some()),
            ];
            let mut set = hooks.iter().filter(|(_, set)| *set).map(|(hook, _)| *hook);
            let (Some(hook), None) = (set.next(), set.next()) else {
                problems.push(format!(
                    "{which} must have exactly one of `retry`, `fallback`, `budget`"
                ));
                continue;
            };
            if let Some(expect) = &step.expect {
                problems.extend(
                    expect
                        .inapplicable(hook)
                        .into_iter()
                        .map(|problem| format!("{which}: {problem}")),
                );
            }
        }
        if problems.is_empty() {
            Ok(scenario)
        } else {
            Err(Error::Scenario(problems.join("; ")))
        }
    }
}

/// One step: exactly one of `retry`, `fallback`, `budget`, and optionally `expect`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    #[serde(default)]
    pub name: String,
    pub retry: Option<RetryStep>,
    pub fallback: Option<FallbackStep>,
    pub budget: Option<BudgetStep>,
    pub expect: Option<Expect>,
}

/// A failed attempt, and what the host knows about the call.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryStep {
    pub failure: ScenarioFailure,
    #[serde(default = "default_request_id")]
    pub request_id: String,
    pub task_id: Option<String>,
    #[serde(default)]
    pub kind: ScenarioCallKind,
    #[serde(default = "default_target")]
    pub target: String,
    pub model: Option<String>,
    pub tool_class: Option<ToolClass>,
    /// Defaults to one more than the previous step with the same `request_id`.
    pub attempt: Option<u32>,
    #[serde(default)]
    pub elapsed_ms: u64,
    #[serde(default = "yes")]
    pub dispatched: bool,
    #[serde(default = "yes")]
    pub retry_budget_available: bool,
    #[serde(default)]
    pub fallbacks: Vec<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScenarioCallKind {
    #[default]
    Model,
    Tool,
}

/// A failure, written `{ kind = "rate_limited", retry_after_ms = 2000 }` and so on.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ScenarioFailure {
    RateLimited {
        retry_after_ms: Option<u64>,
    },
    ServerError {
        status: u16,
    },
    Timeout,
    ConnectError {
        sent: bool,
    },
    StreamInterrupted {
        #[serde(default)]
        events_delivered: u32,
        #[serde(default)]
        inside_tool_call: bool,
    },
    ContextOverflow,
    ContentFiltered,
    ToolParseError,
}

impl ScenarioFailure {
    fn to_failure(&self) -> Failure {
        match self {
            Self::RateLimited { retry_after_ms } => Failure::RateLimited {
                retry_after: retry_after_ms.map(Duration::from_millis),
            },
            Self::ServerError { status } => Failure::ServerError { status: *status },
            Self::Timeout => Failure::Timeout,
            Self::ConnectError { sent } => Failure::Connect { sent: *sent },
            Self::StreamInterrupted {
                events_delivered,
                inside_tool_call,
            } => Failure::StreamInterrupted {
                events_delivered: *events_delivered,
                inside_tool_call: *inside_tool_call,
            },
            Self::ContextOverflow => Failure::ContextOverflow,
            Self::ContentFiltered => Failure::ContentFiltered,
            Self::ToolParseError => Failure::ToolParseError,
        }
    }
}

/// A request for an ordering of candidates.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FallbackStep {
    #[serde(default = "default_request_id")]
    pub request_id: String,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub needs_tools: bool,
    #[serde(default)]
    pub streaming: bool,
    #[serde(default)]
    pub estimated_tokens: u32,
    /// Modality names (`text`, `image`, `audio`, `document`).
    #[serde(default)]
    pub modalities: Modalities,
    pub candidates: Vec<ScenarioCandidate>,
}

/// A candidate; capabilities default to "supports everything", health to fine.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioCandidate {
    pub name: String,
    #[serde(default = "yes")]
    pub supports_tools: bool,
    #[serde(default = "yes")]
    pub supports_streaming: bool,
    #[serde(default)]
    pub context_window: u32,
    /// Modality names; empty means unknown (not filtered).
    #[serde(default)]
    pub modalities: Modalities,
    #[serde(default = "closed")]
    pub circuit: CircuitState,
    #[serde(default)]
    pub local: bool,
    /// GPU health of a local target (`healthy`, `unknown`, `degraded`, `unhealthy`).
    pub gpu: Option<GpuState>,
    #[serde(default)]
    pub cost_per_mtok_in: u64,
    #[serde(default)]
    pub cost_per_mtok_out: u64,
}

/// A call asking to be admitted.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetStep {
    #[serde(default = "default_request_id")]
    pub request_id: String,
    pub task_id: Option<String>,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub estimated_tokens_in: u64,
    #[serde(default)]
    pub estimated_tokens_out: u64,
    #[serde(default)]
    pub estimated_cost_micros: u64,
    /// Usage so far; figures left out are 0.
    #[serde(default)]
    pub usage: ScenarioUsage,
    /// Limits; those left out are unlimited.
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub downgrades: Vec<DowngradeOption>,
}

/// A task's usage so far; every figure defaults to 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScenarioUsage {
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_micros: u64,
    pub wall_clock_ms: u64,
    pub calls: u32,
    pub retries: u32,
}

impl From<ScenarioUsage> for Usage {
    fn from(u: ScenarioUsage) -> Self {
        Usage {
            tokens_in: u.tokens_in,
            tokens_out: u.tokens_out,
            cost_micros: u.cost_micros,
            wall_clock_ms: u.wall_clock_ms,
            calls: u.calls,
            retries: u.retries,
        }
    }
}

/// What a step should decide; every field given is checked. Which fields a step
/// may give depends on its hook ([`Expect::inapplicable`]): a retry step takes
/// `decision` (`retry_after`, `fall_back`, `give_up`), `delay_ms`, `max_delay_ms`,
/// `target` and `reason_contains`; a fallback step `order`; a budget step
/// `decision` (`admit`, `reject`, `downgrade`), `model` and `reason_contains`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// `retry_after`, `fall_back`, `give_up` (retry); `admit`, `reject`, `downgrade`
    /// (budget).
    pub decision: Option<String>,
    pub delay_ms: Option<u64>,
    pub max_delay_ms: Option<u64>,
    pub target: Option<String>,
    pub model: Option<String>,
    pub order: Option<Vec<String>>,
    /// A substring of a give-up or reject reason.
    pub reason_contains: Option<String>,
}

impl Expect {
    /// What in this expectation a step of `hook` can never meet: keys that do not
    /// apply to the hook's decisions, and a `decision` that is not one of them.
    pub fn inapplicable(&self, hook: Hook) -> Vec<String> {
        let (keys, decisions): (&[&str], &[&str]) = match hook {
            Hook::Retry => (
                &[
                    "decision",
                    "delay_ms",
                    "max_delay_ms",
                    "target",
                    "reason_contains",
                ],
                &["retry_after", "fall_back", "give_up"],
            ),
            Hook::Fallback => (&["order"], &[]),
            Hook::Budget => (
                &["decision", "model", "reason_contains"],
                &["admit", "reject", "downgrade"],
            ),
        };
        let given = [
            ("decision", self.decision.is_some()),
            ("delay_ms", self.delay_ms.is_some()),
            ("max_delay_ms", self.max_delay_ms.is_some()),
            ("target", self.target.is_some()),
            ("model", self.model.is_some()),
            ("order", self.order.is_some()),
            ("reason_contains", self.reason_contains.is_some()),
        ];
        let mut problems: Vec<String> = given
            .into_iter()
            .filter(|(key, set)| *set && !keys.contains(key))
            .map(|(key, _)| {
                format!(
                    "`expect.{key}` does not apply to a {hook} step (its expect takes {})",
                    keys.join(", ")
                )
            })
            .collect();
        if let Some(decision) = &self.decision
            && keys.contains(&"decision")
            && !decisions.contains(&decision.as_str())
        {
            problems.push(format!(
                "`expect.decision = {decision:?}` is not a {hook} decision (one of {})",
                decisions.join(", ")
            ));
        }
        problems
    }
}

/// The replay of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioReport {
    pub steps: Vec<StepReport>,
}

impl ScenarioReport {
    /// Every step decided without a fault, passed the host's checks and met its
    /// expectation.
    pub fn passed(&self) -> bool {
        self.steps.iter().all(|s| s.problem.is_none())
    }
}

impl std::fmt::Display for ScenarioReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (index, step) in self.steps.iter().enumerate() {
            let verdict = match &step.problem {
                None => "ok".to_string(),
                Some(problem) => format!("FAIL: {problem}"),
            };
            writeln!(
                f,
                "{:>3}. {:<8} {:<40} -> {}  [{verdict}]",
                index + 1,
                step.hook.as_str(),
                step.name,
                step.decision
            )?;
        }
        let failed = self.steps.iter().filter(|s| s.problem.is_some()).count();
        write!(f, "{} passed, {failed} failed", self.steps.len() - failed)
    }
}

/// One step's decision.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    pub name: String,
    pub hook: Hook,
    /// The decision, e.g. `retry_after 2000 ms`, `fall_back anthropic`, `[a, b]`.
    pub decision: String,
    /// A fault, a refused decision or an unmet expectation; `None` when all is well.
    pub problem: Option<String>,
}

pub(crate) fn run(loaded: &Loaded, scenario: &Scenario, max_delay: Duration) -> ScenarioReport {
    let mut calls: HashMap<String, Vec<AttemptRecord>> = HashMap::new();
    let steps = scenario
        .steps
        .iter()
        .map(|step| {
            if let Some(retry) = &step.retry {
                run_retry(loaded, step, retry, &mut calls, max_delay)
            } else if let Some(fallback) = &step.fallback {
                run_fallback(loaded, step, fallback)
            } else if let Some(budget) = &step.budget {
                run_budget(loaded, step, budget)
            } else {
                StepReport {
                    name: step.name.clone(),
                    hook: Hook::Retry,
                    decision: "-".into(),
                    problem: Some("the step has no retry, fallback or budget table".into()),
                }
            }
        })
        .collect();
    ScenarioReport { steps }
}

fn run_retry(
    loaded: &Loaded,
    step: &Step,
    retry: &RetryStep,
    calls: &mut HashMap<String, Vec<AttemptRecord>>,
    max_delay: Duration,
) -> StepReport {
    let history = calls.entry(retry.request_id.clone()).or_default();
    let failure = retry.failure.to_failure();
    let ctx = CallContext {
        task_id: retry.task_id.clone(),
        request_id: retry.request_id.clone(),
        kind: match retry.kind {
            ScenarioCallKind::Model => CallKind::Model,
            ScenarioCallKind::Tool => CallKind::Tool,
        },
        target: retry.target.clone(),
        model: retry.model.clone(),
        tool_class: retry.tool_class,
        attempt: retry.attempt.unwrap_or_else(|| {
            u32::try_from(history.len())
                .unwrap_or(u32::MAX)
                .saturating_add(1)
        }),
        elapsed: Duration::from_millis(retry.elapsed_ms),
        dispatched: retry.dispatched,
        history: history.clone(),
        retry_budget: RetryBudget {
            available: retry.retry_budget_available,
            ..RetryBudget::default()
        },
        fallbacks: retry.fallbacks.clone(),
    };
    history.push(AttemptRecord {
        target: retry.target.clone(),
        failure: failure.clone(),
        elapsed: Duration::from_millis(retry.elapsed_ms),
    });
    let (decision, problem) = match loaded.retry(&ctx, &failure) {
        Err(fault) => ("-".to_string(), Some(fault.to_string())),
        Ok(decision) => {
            let problem = validate::retry(&ctx, &failure, &decision, max_delay)
                .err()
                .map(|e| format!("the host would refuse this: {e}"))
                .or_else(|| {
                    step.expect
                        .as_ref()
                        .and_then(|e| expect_retry(e, &decision))
                });
            (describe_retry(&decision), problem)
        }
    };
    StepReport {
        name: step.name.clone(),
        hook: Hook::Retry,
        decision,
        problem,
    }
}

fn run_fallback(loaded: &Loaded, step: &Step, fallback: &FallbackStep) -> StepReport {
    let request = FallbackRequest {
        task_id: None,
        request_id: fallback.request_id.clone(),
        model: fallback.model.clone(),
        needs_tools: fallback.needs_tools,
        streaming: fallback.streaming,
        estimated_tokens: fallback.estimated_tokens,
        modalities: fallback.modalities,
        candidates: fallback
            .candidates
            .iter()
            .map(|c| Candidate {
                name: c.name.clone(),
                supports_tools: c.supports_tools,
                supports_streaming: c.supports_streaming,
                context_window: c.context_window,
                modalities: c.modalities,
                circuit: c.circuit,
                local: c.local,
                gpu: c.gpu,
                cost_per_mtok_in: c.cost_per_mtok_in,
                cost_per_mtok_out: c.cost_per_mtok_out,
            })
            .collect(),
    };
    let (decision, problem) = match loaded.fallback(&request) {
        Err(fault) => ("-".to_string(), Some(fault.to_string())),
        Ok(order) => match validate::fallback(&request, &order) {
            Err(e) => (
                format!("{order:?}"),
                Some(format!("the host would refuse this: {e}")),
            ),
            Ok(()) => {
                // Reported and compared by name: the indices point into `candidates`.
                let names: Vec<&str> = order
                    .iter()
                    .map(|&i| request.candidates[i].name.as_str())
                    .collect();
                let problem = step
                    .expect
                    .as_ref()
                    .and_then(|expect| expect.order.as_ref())
                    .filter(|wanted| **wanted != names)
                    .map(|wanted| format!("expected order {wanted:?}"));
                (format!("[{}]", names.join(", ")), problem)
            }
        },
    };
    StepReport {
        name: step.name.clone(),
        hook: Hook::Fallback,
        decision,
        problem,
    }
}

fn run_budget(loaded: &Loaded, step: &Step, budget: &BudgetStep) -> StepReport {
    let request = BudgetRequest {
        task_id: budget.task_id.clone(),
        request_id: budget.request_id.clone(),
        model: budget.model.clone(),
        estimated_tokens_in: budget.estimated_tokens_in,
        estimated_tokens_out: budget.estimated_tokens_out,
        estimated_cost_micros: budget.estimated_cost_micros,
        usage: budget.usage.into(),
        limits: budget.limits,
        downgrades: budget.downgrades.clone(),
    };
    let (decision, problem) = match loaded.budget(&request) {
        Err(fault) => ("-".to_string(), Some(fault.to_string())),
        Ok(decision) => {
            let problem = validate::budget(&request, &decision)
                .err()
                .map(|e| format!("the host would refuse this: {e}"))
                .or_else(|| {
                    step.expect
                        .as_ref()
                        .and_then(|e| expect_budget(e, &decision))
                });
            let described = match &decision {
                BudgetDecision::Admit => "admit".to_string(),
                BudgetDecision::Reject(reason) => format!("reject ({reason})"),
                BudgetDecision::Downgrade(model) => format!("downgrade {model}"),
            };
            (described, problem)
        }
    };
    StepReport {
        name: step.name.clone(),
        hook: Hook::Budget,
        decision,
        problem,
    }
}

fn describe_retry(decision: &RetryDecision) -> String {
    match decision {
        RetryDecision::RetryAfter(delay) => format!("retry_after {} ms", delay.as_millis()),
        RetryDecision::FallBack(target) => format!("fall_back {target}"),
        RetryDecision::GiveUp(reason) => format!("give_up ({reason})"),
    }
}

fn expect_retry(expect: &Expect, decision: &RetryDecision) -> Option<String> {
    let (kind, delay, target, reason) = match decision {
        RetryDecision::RetryAfter(d) => ("retry_after", Some(d.as_millis()), None, None),
        RetryDecision::FallBack(t) => ("fall_back", None, Some(t.as_str()), None),
        RetryDecision::GiveUp(r) => ("give_up", None, None, Some(r.as_str())),
    };
    let mut problems = Vec::new();
    if let Some(wanted) = &expect.decision
        && wanted != kind
    {
        problems.push(format!("expected {wanted}"));
    }
    if let Some(wanted) = expect.delay_ms
        && delay != Some(u128::from(wanted))
    {
        problems.push(format!("expected a delay of {wanted} ms"));
    }
    if let Some(max) = expect.max_delay_ms
        && delay.is_none_or(|d| d > u128::from(max))
    {
        problems.push(format!("expected a delay of at most {max} ms"));
    }
    if let Some(wanted) = &expect.target
        && target != Some(wanted.as_str())
    {
        problems.push(format!("expected a fall-back to {wanted}"));
    }
    if let Some(wanted) = &expect.reason_contains
        && !reason.is_some_and(|r| r.contains(wanted.as_str()))
    {
        problems.push(format!("expected a reason containing {wanted:?}"));
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

fn expect_budget(expect: &Expect, decision: &BudgetDecision) -> Option<String> {
    let (kind, model, reason) = match decision {
        BudgetDecision::Admit => ("admit", None, None),
        BudgetDecision::Reject(r) => ("reject", None, Some(r.as_str())),
        BudgetDecision::Downgrade(m) => ("downgrade", Some(m.as_str()), None),
    };
    let mut problems = Vec::new();
    if let Some(wanted) = &expect.decision
        && wanted != kind
    {
        problems.push(format!("expected {wanted}"));
    }
    if let Some(wanted) = &expect.model
        && model != Some(wanted.as_str())
    {
        problems.push(format!("expected a downgrade to {wanted}"));
    }
    if let Some(wanted) = &expect.reason_contains
        && !reason.is_some_and(|r| r.contains(wanted.as_str()))
    {
        problems.push(format!("expected a reason containing {wanted:?}"));
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

fn default_request_id() -> String {
    "scenario".into()
}

fn default_target() -> String {
    "primary".into()
}

fn yes() -> bool {
    true
}

fn closed() -> CircuitState {
    CircuitState::Closed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(text: &str) -> String {
        match Scenario::from_toml(text) {
            Ok(scenario) => panic!("parsed: {scenario:?}"),
            Err(e) => e.to_string(),
        }
    }

    const RETRY: &str = "retry = { failure = { kind = \"timeout\" } }";
    const FALLBACK: &str = "fallback = { candidates = [{ name = \"a\" }] }";
    const BUDGET: &str = "budget = { model = \"big\" }";

    #[test]
    fn expectations_that_cannot_apply_are_refused_naming_key_and_step() {
        let cases = [
            (
                BUDGET,
                "target = \"x\"",
                "`expect.target` does not apply to a budget step",
            ),
            (
                BUDGET,
                "order = [\"a\"]",
                "`expect.order` does not apply to a budget step",
            ),
            (
                BUDGET,
                "delay_ms = 5",
                "`expect.delay_ms` does not apply to a budget step",
            ),
            (
                FALLBACK,
                "reason_contains = \"x\"",
                "`expect.reason_contains` does not apply to a fallback step",
            ),
            (
                FALLBACK,
                "decision = \"admit\"",
                "`expect.decision` does not apply to a fallback step (its expect takes order)",
            ),
            (
                RETRY,
                "model = \"small\"",
                "`expect.model` does not apply to a retry step",
            ),
            (
                RETRY,
                "order = []",
                "`expect.order` does not apply to a retry step",
            ),
            (
                RETRY,
                "decision = \"admit\"",
                "`expect.decision = \"admit\"` is not a retry decision (one of retry_after, fall_back, give_up)",
            ),
            (
                BUDGET,
                "decision = \"give_up\"",
                "`expect.decision = \"give_up\"` is not a budget decision",
            ),
        ];
        for (hook, expect, wanted) in cases {
            let text = format!(
                "[[step]]\nname = \"first\"\n{RETRY}\n\n[[step]]\nname = \"second\"\n{hook}\nexpect = {{ {expect} }}\n"
            );
            let err = error(&text);
            assert!(
                err.contains("step 2 (\"second\"): ") && err.contains(wanted),
                "{expect}: {err}"
            );
        }
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let text = format!(
            "[[step]]\nname = \"a\"\n{BUDGET}\nexpect = {{ target = \"x\", order = [] }}\n\n\
             [[step]]\nname = \"b\"\n\n\
             [[step]]\nname = \"c\"\n{FALLBACK}\nexpect = {{ model = \"m\" }}\n"
        );
        let err = error(&text);
        for wanted in [
            "step 1 (\"a\"): `expect.target`",
            "step 1 (\"a\"): `expect.order`",
            "step 2 (\"b\") must have exactly one of",
            "step 3 (\"c\"): `expect.model`",
        ] {
            assert!(err.contains(wanted), "{wanted}: {err}");
        }
    }

    #[test]
    fn expectations_that_apply_are_accepted() {
        let text = format!(
            "[[step]]\n{RETRY}\nexpect = {{ decision = \"fall_back\", delay_ms = 1, max_delay_ms = 2, target = \"b\", reason_contains = \"r\" }}\n\n\
             [[step]]\n{FALLBACK}\nexpect = {{ order = [\"a\"] }}\n\n\
             [[step]]\n{BUDGET}\nexpect = {{ decision = \"downgrade\", model = \"small\", reason_contains = \"r\" }}\n"
        );
        let scenario = Scenario::from_toml(&text).expect("parses");
        assert_eq!(scenario.steps.len(), 3);
    }
}
