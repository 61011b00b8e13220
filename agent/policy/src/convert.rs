//! Conversions between `outrigger_types` (what the sidecar speaks) and the generated
//! WIT bindings (what crosses into a component). Durations cross as whole
//! milliseconds, saturating.
//!
//! What goes into a hook borrows from the sidecar's own values (the bindings are
//! generated borrowing): no string is copied on the host side. A WIT list becomes a
//! slice, so the lists are gathered first (`*Lists`, `candidates`), one allocation
//! per list, and the request is then built borrowing them.

use std::time::Duration;

use outrigger_types as ot;

use crate::bindings::types as wit;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn failure(f: &ot::Failure) -> wit::Failure {
    match f {
        ot::Failure::RateLimited { retry_after } => {
            wit::Failure::RateLimited(retry_after.map(millis))
        }
        ot::Failure::ServerError { status } => wit::Failure::ServerError(*status),
        ot::Failure::Timeout => wit::Failure::Timeout,
        ot::Failure::Connect { sent } => wit::Failure::ConnectError(*sent),
        ot::Failure::StreamInterrupted {
            events_delivered,
            inside_tool_call,
        } => wit::Failure::StreamInterrupted(wit::StreamInterruption {
            events_delivered: *events_delivered,
            inside_tool_call: *inside_tool_call,
        }),
        ot::Failure::ContextOverflow => wit::Failure::ContextOverflow,
        ot::Failure::ContentFiltered => wit::Failure::ContentFiltered,
        ot::Failure::ToolParseError => wit::Failure::ToolParseError,
    }
}

fn tool_class(c: ot::ToolClass) -> wit::ToolClass {
    match c {
        ot::ToolClass::Keyed => wit::ToolClass::Keyed,
        ot::ToolClass::Idempotent => wit::ToolClass::Idempotent,
        ot::ToolClass::Probe => wit::ToolClass::Probe,
        ot::ToolClass::Unsafe => wit::ToolClass::Unsafe,
    }
}

/// The lists a [`wit::CallContext`] borrows.
pub(crate) struct CallContextLists<'a> {
    ctx: &'a ot::CallContext,
    history: Vec<wit::Attempt<'a>>,
    fallbacks: Vec<&'a str>,
}

impl<'a> CallContextLists<'a> {
    pub(crate) fn new(ctx: &'a ot::CallContext) -> Self {
        Self {
            ctx,
            history: ctx
                .history
                .iter()
                .map(|a| wit::Attempt {
                    target: &a.target,
                    failure: failure(&a.failure),
                    elapsed_ms: millis(a.elapsed),
                })
                .collect(),
            fallbacks: ctx.fallbacks.iter().map(String::as_str).collect(),
        }
    }

    pub(crate) fn wit(&self) -> wit::CallContext<'_> {
        let c = self.ctx;
        wit::CallContext {
            kind: match c.kind {
                ot::CallKind::Model => wit::CallKind::Model,
                ot::CallKind::Tool => wit::CallKind::Tool,
            },
            target: &c.target,
            model: c.model.as_deref(),
            tool_class: c.tool_class.map(tool_class),
            attempt: c.attempt,
            elapsed_ms: millis(c.elapsed),
            dispatched: c.dispatched,
            history: &self.history,
            retry_budget: wit::RetryBudget {
                available: c.retry_budget.available,
                retries_in_window: c.retry_budget.retries_in_window,
                requests_in_window: c.retry_budget.requests_in_window,
            },
            fallbacks: &self.fallbacks,
        }
    }
}

pub(crate) fn retry_decision(d: wit::RetryDecision) -> ot::RetryDecision {
    match d {
        wit::RetryDecision::RetryAfter(ms) => {
            ot::RetryDecision::RetryAfter(Duration::from_millis(ms))
        }
        wit::RetryDecision::FallBack(target) => ot::RetryDecision::FallBack(target),
        wit::RetryDecision::GiveUp(reason) => ot::RetryDecision::GiveUp(reason),
    }
}

fn modalities(m: ot::Modalities) -> wit::Modalities {
    const BOTH: [(ot::Modalities, wit::Modalities); 4] = [
        (ot::Modalities::TEXT, wit::Modalities::TEXT),
        (ot::Modalities::IMAGE, wit::Modalities::IMAGE),
        (ot::Modalities::AUDIO, wit::Modalities::AUDIO),
        (ot::Modalities::DOCUMENT, wit::Modalities::DOCUMENT),
    ];
    BOTH.iter()
        .filter(|(ours, _)| m.contains(*ours))
        .fold(wit::Modalities::empty(), |set, (_, theirs)| set | *theirs)
}

fn candidate(c: &ot::Candidate) -> wit::Candidate<'_> {
    wit::Candidate {
        name: &c.name,
        supports_tools: c.supports_tools,
        supports_streaming: c.supports_streaming,
        context_window: c.context_window,
        modalities: modalities(c.modalities),
        circuit: match c.circuit {
            ot::CircuitState::Closed => wit::CircuitState::Closed,
            ot::CircuitState::Open => wit::CircuitState::Open,
            ot::CircuitState::HalfOpen => wit::CircuitState::HalfOpen,
        },
        local: c.local,
        gpu: match c.gpu {
            None => wit::GpuHealth::NotApplicable,
            Some(ot::GpuState::Healthy) => wit::GpuHealth::Healthy,
            Some(ot::GpuState::Unknown) => wit::GpuHealth::Unknown,
            Some(ot::GpuState::Degraded) => wit::GpuHealth::Degraded,
            Some(ot::GpuState::Unhealthy) => wit::GpuHealth::Unhealthy,
        },
        cost_per_mtok_in: c.cost_per_mtok_in,
        cost_per_mtok_out: c.cost_per_mtok_out,
    }
}

/// The candidates of a [`wit::FallbackRequest`], gathered into the slice it borrows.
pub(crate) fn candidates(request: &ot::FallbackRequest) -> Vec<wit::Candidate<'_>> {
    request.candidates.iter().map(candidate).collect()
}

pub(crate) fn fallback_request<'a>(
    r: &'a ot::FallbackRequest,
    candidates: &'a [wit::Candidate<'a>],
) -> wit::FallbackRequest<'a> {
    wit::FallbackRequest {
        model: &r.model,
        needs_tools: r.needs_tools,
        streaming: r.streaming,
        estimated_tokens: r.estimated_tokens,
        modalities: modalities(r.modalities),
        candidates,
    }
}

fn usage(u: &ot::Usage) -> wit::Usage {
    wit::Usage {
        tokens_in: u.tokens_in,
        tokens_out: u.tokens_out,
        cost_micros: u.cost_micros,
        wall_clock_ms: u.wall_clock_ms,
        calls: u.calls,
        retries: u.retries,
    }
}

fn limits(l: &ot::Limits) -> wit::Limits {
    wit::Limits {
        tokens_in: l.tokens_in,
        tokens_out: l.tokens_out,
        tokens_total: l.tokens_total,
        cost_micros: l.cost_micros,
        wall_clock_ms: l.wall_clock_ms,
        calls: l.calls,
        retries: l.retries,
    }
}

/// The list a [`wit::BudgetRequest`] borrows.
pub(crate) struct BudgetLists<'a> {
    request: &'a ot::BudgetRequest,
    downgrades: Vec<wit::DowngradeOption<'a>>,
}

impl<'a> BudgetLists<'a> {
    pub(crate) fn new(request: &'a ot::BudgetRequest) -> Self {
        Self {
            request,
            downgrades: request
                .downgrades
                .iter()
                .map(|d| wit::DowngradeOption {
                    model: &d.model,
                    cost_per_mtok_in: d.cost_per_mtok_in,
                    cost_per_mtok_out: d.cost_per_mtok_out,
                })
                .collect(),
        }
    }

    pub(crate) fn wit(&self) -> wit::BudgetRequest<'_> {
        let r = self.request;
        wit::BudgetRequest {
            model: &r.model,
            estimated_tokens_in: r.estimated_tokens_in,
            estimated_tokens_out: r.estimated_tokens_out,
            estimated_cost_micros: r.estimated_cost_micros,
            usage: usage(&r.usage),
            limits: limits(&r.limits),
            downgrades: &self.downgrades,
        }
    }
}

pub(crate) fn budget_decision(d: wit::BudgetDecision) -> ot::BudgetDecision {
    match d {
        wit::BudgetDecision::Admit => ot::BudgetDecision::Admit,
        wit::BudgetDecision::Reject(reason) => ot::BudgetDecision::Reject(reason),
        wit::BudgetDecision::Downgrade(model) => ot::BudgetDecision::Downgrade(model),
    }
}
