//! The conformance suite: what every policy must do, whatever it decides.
//!
//! For each hook the component implements: every decision passes the host's checks
//! (retry delay within the maximum, fall-back target among `ctx.fallbacks`, no retry
//! without budget, no re-send of an in-doubt unsafe tool call; fallback order a
//! duplicate-free subset of the candidates; downgrade among the offered models), no
//! trap, deadline or memory fault on edge inputs (huge attempt counts, empty lists,
//! missing retry-after, empty strings, zero and saturated figures), and the same
//! decision for the same input under a fixed seed.

use std::time::Duration;

use outrigger_policy::{Fault, Hook, Loaded, validate};
use outrigger_types::{
    AttemptRecord, BudgetRequest, CallContext, CallKind, Candidate, CircuitState, DowngradeOption,
    Failure, FallbackRequest, GpuState, Limits, Modalities, RetryBudget, ToolClass, Usage,
};
use serde::Serialize;

/// The suite's verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConformanceReport {
    pub outcomes: Vec<Outcome>,
}

/// One check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub hook: Hook,
    pub check: String,
    /// `None` when it passed; otherwise what went wrong.
    pub failure: Option<String>,
}

impl ConformanceReport {
    pub fn passed(&self) -> bool {
        self.outcomes.iter().all(|o| o.failure.is_none())
    }

    pub fn failures(&self) -> impl Iterator<Item = &Outcome> {
        self.outcomes.iter().filter(|o| o.failure.is_some())
    }
}

impl std::fmt::Display for ConformanceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let failed = self.failures().count();
        writeln!(
            f,
            "conformance {} checks, {} passed, {failed} failed",
            self.outcomes.len(),
            self.outcomes.len() - failed
        )?;
        for outcome in self.failures() {
            writeln!(
                f,
                "  FAIL {} / {}: {}",
                outcome.hook,
                outcome.check,
                outcome.failure.as_deref().unwrap_or_default()
            )?;
        }
        Ok(())
    }
}

pub(crate) fn run(loaded: &Loaded, max_delay: Duration) -> ConformanceReport {
    let mut outcomes = Vec::new();
    if loaded.implements(Hook::Retry) {
        for (name, ctx, failure) in retry_inputs() {
            let result = decide_twice(|| loaded.retry(&ctx, &failure))
                .and_then(|d| validate::retry(&ctx, &failure, &d, max_delay));
            outcomes.push(outcome(Hook::Retry, name, result));
        }
    }
    if loaded.implements(Hook::Fallback) {
        for (name, request) in fallback_inputs() {
            let result = decide_twice(|| loaded.fallback(&request))
                .and_then(|order| validate::fallback(&request, &order));
            outcomes.push(outcome(Hook::Fallback, name, result));
        }
    }
    if loaded.implements(Hook::Budget) {
        for (name, request) in budget_inputs() {
            let result = decide_twice(|| loaded.budget(&request))
                .and_then(|d| validate::budget(&request, &d));
            outcomes.push(outcome(Hook::Budget, name, result));
        }
    }
    ConformanceReport { outcomes }
}

fn outcome(hook: Hook, check: String, result: Result<(), String>) -> Outcome {
    Outcome {
        hook,
        check,
        failure: result.err(),
    }
}

/// Decides twice: both must succeed and agree (the kit's runtime is seeded).
fn decide_twice<T: PartialEq + std::fmt::Debug>(
    mut decide: impl FnMut() -> Result<T, Fault>,
) -> Result<T, String> {
    let first = decide().map_err(|f| f.to_string())?;
    let second = decide().map_err(|f| f.to_string())?;
    if first == second {
        Ok(first)
    } else {
        Err(format!(
            "not deterministic under a fixed seed: {first:?} then {second:?}"
        ))
    }
}

fn base_ctx() -> CallContext {
    CallContext {
        task_id: Some("conformance".into()),
        request_id: "conformance-1".into(),
        kind: CallKind::Model,
        target: "primary".into(),
        model: Some("model-a".into()),
        tool_class: None,
        attempt: 1,
        elapsed: Duration::from_millis(120),
        dispatched: true,
        history: Vec::new(),
        retry_budget: RetryBudget::default(),
        fallbacks: vec!["secondary".into(), "tertiary".into()],
    }
}

fn failures() -> Vec<Failure> {
    vec![
        Failure::RateLimited { retry_after: None },
        Failure::RateLimited {
            retry_after: Some(Duration::from_millis(1_500)),
        },
        Failure::RateLimited {
            retry_after: Some(Duration::from_millis(u64::MAX)),
        },
        Failure::ServerError { status: 503 },
        Failure::ServerError { status: 0 },
        Failure::Timeout,
        Failure::Connect { sent: false },
        Failure::Connect { sent: true },
        Failure::StreamInterrupted {
            events_delivered: u32::MAX,
            inside_tool_call: true,
        },
        Failure::ContextOverflow,
        Failure::ContentFiltered,
        Failure::ToolParseError,
    ]
}

fn retry_inputs() -> Vec<(String, CallContext, Failure)> {
    let mut inputs = Vec::new();
    let contexts: Vec<(&str, CallContext)> = vec![
        ("first attempt", base_ctx()),
        (
            "attempt u32::MAX",
            CallContext {
                attempt: u32::MAX,
                ..base_ctx()
            },
        ),
        (
            "attempt 0",
            CallContext {
                attempt: 0,
                ..base_ctx()
            },
        ),
        (
            "no fallbacks",
            CallContext {
                fallbacks: Vec::new(),
                ..base_ctx()
            },
        ),
        (
            "retry budget exhausted",
            CallContext {
                retry_budget: RetryBudget {
                    available: false,
                    retries_in_window: u32::MAX,
                    requests_in_window: 0,
                },
                ..base_ctx()
            },
        ),
        (
            "unsafe tool call, dispatched",
            CallContext {
                kind: CallKind::Tool,
                tool_class: Some(ToolClass::Unsafe),
                model: None,
                ..base_ctx()
            },
        ),
        (
            "probe tool call, not dispatched",
            CallContext {
                kind: CallKind::Tool,
                tool_class: Some(ToolClass::Probe),
                dispatched: false,
                ..base_ctx()
            },
        ),
        (
            "empty strings",
            CallContext {
                task_id: Some(String::new()),
                request_id: String::new(),
                target: String::new(),
                model: Some(String::new()),
                fallbacks: vec![String::new()],
                ..base_ctx()
            },
        ),
        (
            "long history",
            CallContext {
                attempt: 40,
                elapsed: Duration::from_millis(u64::MAX),
                history: (0..40)
                    .map(|i| AttemptRecord {
                        target: if i % 2 == 0 { "primary" } else { "secondary" }.into(),
                        failure: Failure::ServerError { status: 502 },
                        elapsed: Duration::from_millis(i * 100),
                    })
                    .collect(),
                ..base_ctx()
            },
        ),
    ];
    for (context_name, ctx) in contexts {
        for failure in failures() {
            inputs.push((format!("{context_name}, {failure:?}"), ctx.clone(), failure));
        }
    }
    inputs
}

fn candidate(name: &str) -> Candidate {
    Candidate {
        name: name.into(),
        supports_tools: true,
        supports_streaming: true,
        context_window: 128_000,
        modalities: Modalities::TEXT,
        circuit: CircuitState::Closed,
        local: false,
        gpu: None,
        cost_per_mtok_in: 3_000_000,
        cost_per_mtok_out: 15_000_000,
    }
}

fn base_fallback(candidates: Vec<Candidate>) -> FallbackRequest {
    FallbackRequest {
        task_id: Some("conformance".into()),
        request_id: "conformance-1".into(),
        model: "a-model".into(),
        needs_tools: false,
        streaming: false,
        estimated_tokens: 2_000,
        modalities: Modalities::TEXT,
        candidates,
    }
}

fn fallback_inputs() -> Vec<(String, FallbackRequest)> {
    let mixed = vec![
        Candidate {
            circuit: CircuitState::Open,
            ..candidate("open")
        },
        Candidate {
            circuit: CircuitState::HalfOpen,
            ..candidate("half-open")
        },
        Candidate {
            local: true,
            gpu: Some(GpuState::Unhealthy),
            ..candidate("sick-gpu")
        },
        Candidate {
            supports_tools: false,
            supports_streaming: false,
            ..candidate("plain")
        },
        Candidate {
            context_window: 0,
            modalities: Modalities::EMPTY,
            ..candidate("unknowns")
        },
        candidate("a"),
    ];
    vec![
        ("no candidates".into(), base_fallback(Vec::new())),
        ("one candidate".into(), base_fallback(vec![candidate("a")])),
        (
            "mixed health and capabilities".into(),
            base_fallback(mixed.clone()),
        ),
        (
            "needs tools and streaming".into(),
            FallbackRequest {
                needs_tools: true,
                streaming: true,
                ..base_fallback(mixed)
            },
        ),
        (
            "duplicate names".into(),
            base_fallback(vec![candidate("a"), candidate("a"), candidate("b")]),
        ),
        (
            "all circuits open".into(),
            base_fallback(vec![
                Candidate {
                    circuit: CircuitState::Open,
                    ..candidate("x")
                },
                Candidate {
                    circuit: CircuitState::Open,
                    ..candidate("y")
                },
            ]),
        ),
        (
            "empty strings and zero sizes".into(),
            FallbackRequest {
                task_id: None,
                request_id: String::new(),
                model: String::new(),
                estimated_tokens: u32::MAX,
                modalities: Modalities::from_bits_truncate(u8::MAX),
                ..base_fallback(vec![Candidate {
                    context_window: 0,
                    cost_per_mtok_in: u64::MAX,
                    cost_per_mtok_out: u64::MAX,
                    ..candidate("")
                }])
            },
        ),
        (
            "many candidates".into(),
            base_fallback(
                (0..100)
                    .map(|i| candidate(&format!("target-{i}")))
                    .collect(),
            ),
        ),
    ]
}

fn base_budget() -> BudgetRequest {
    BudgetRequest {
        task_id: Some("conformance".into()),
        request_id: "conformance-1".into(),
        model: "big".into(),
        estimated_tokens_in: 2_000,
        estimated_tokens_out: 500,
        estimated_cost_micros: 13_500,
        usage: Usage::default(),
        limits: Limits::default(),
        downgrades: vec![
            DowngradeOption {
                model: "medium".into(),
                cost_per_mtok_in: 1_000_000,
                cost_per_mtok_out: 4_000_000,
            },
            DowngradeOption {
                model: "small".into(),
                cost_per_mtok_in: 150_000,
                cost_per_mtok_out: 600_000,
            },
        ],
    }
}

fn budget_inputs() -> Vec<(String, BudgetRequest)> {
    let all = |n: u64| Limits {
        tokens_in: Some(n),
        tokens_out: Some(n),
        tokens_total: Some(n),
        cost_micros: Some(n),
        wall_clock_ms: Some(n),
        calls: Some(u32::try_from(n).unwrap_or(u32::MAX)),
        retries: Some(u32::try_from(n).unwrap_or(u32::MAX)),
    };
    let saturated = Usage {
        tokens_in: u64::MAX,
        tokens_out: u64::MAX,
        cost_micros: u64::MAX,
        wall_clock_ms: u64::MAX,
        calls: u32::MAX,
        retries: u32::MAX,
    };
    vec![
        ("unlimited".into(), base_budget()),
        (
            "zero limits".into(),
            BudgetRequest {
                limits: all(0),
                ..base_budget()
            },
        ),
        (
            "near the token limit".into(),
            BudgetRequest {
                usage: Usage {
                    tokens_in: 8_000,
                    ..Usage::default()
                },
                limits: Limits {
                    tokens_total: Some(10_000),
                    ..Limits::default()
                },
                ..base_budget()
            },
        ),
        (
            "over the cost limit".into(),
            BudgetRequest {
                usage: Usage {
                    cost_micros: 990_000,
                    ..Usage::default()
                },
                limits: Limits {
                    cost_micros: Some(1_000_000),
                    ..Limits::default()
                },
                ..base_budget()
            },
        ),
        (
            "no downgrades offered".into(),
            BudgetRequest {
                downgrades: Vec::new(),
                usage: Usage {
                    tokens_in: 9_000,
                    ..Usage::default()
                },
                limits: Limits {
                    tokens_total: Some(10_000),
                    ..Limits::default()
                },
                ..base_budget()
            },
        ),
        (
            "saturated usage".into(),
            BudgetRequest {
                usage: saturated,
                limits: all(u64::MAX),
                ..base_budget()
            },
        ),
        (
            "empty strings".into(),
            BudgetRequest {
                task_id: None,
                request_id: String::new(),
                model: String::new(),
                downgrades: vec![DowngradeOption {
                    model: String::new(),
                    cost_per_mtok_in: 0,
                    cost_per_mtok_out: 0,
                }],
                ..base_budget()
            },
        ),
    ]
}
