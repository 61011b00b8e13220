//! What a finished call tells the side channels: metrics, the SLO accounting, the
//! task it belongs to, and its span. The data plane records a call in one place —
//! [`ModelCall::finish`] or [`ToolCall::finish`] — at its real end (the last byte of
//! a stream, not its first), so every channel agrees on what happened.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use outrigger_telemetry::slo::{Failed, ObjectKind, Signals, SloEvent, classify};
use outrigger_telemetry::spans::{self, Join};
use outrigger_telemetry::{ChunkGaps, ModelCallRecord, ToolCallRecord, names};
use outrigger_types::{GpuState, PolicyVersion, TaskId};
use tracing::Span;

use crate::error::Error;
use crate::model::attempts::Trail;
use crate::options::Dialect;
use crate::tasks::{ModelCallSummary, ToolCallOutcome, ToolCallSummary};
use crate::{RequestContext, Shared};

/// A model call being observed.
pub(crate) struct ModelCall {
    shared: Arc<Shared>,
    pub span: Span,
    started: Instant,
    request_id: String,
    task: Option<TaskId>,
    pub provider: String,
    model: String,
    pub stream: bool,
    first_chunk: Option<Instant>,
    last_chunk: Option<Instant>,
    gaps: ChunkGaps,
    attempts: u32,
    retries: u32,
    fallbacks: u32,
    policy_versions: Vec<PolicyVersion>,
    replayed: bool,
    /// Answered with nothing (a resume past the end): no provider's call, no replay.
    answered_here: bool,
    gpu_unhealthy: bool,
    /// [`Shared::gpu_unhealthy_spells`] when the call started.
    gpu_spells: u64,
    local: bool,
    synthetic: bool,
    done: bool,
}

impl Drop for ModelCall {
    /// A call dropped before it was finished: the agent went away (its body was
    /// dropped) before the end.
    fn drop(&mut self) {
        if !self.done {
            let aborted = self.stream;
            self.record(ModelEnd {
                client_cancelled: true,
                aborted,
                ..ModelEnd::default()
            });
        }
    }
}

/// How a model call ended.
#[derive(Debug, Default)]
pub(crate) struct ModelEnd {
    /// The failure, when it did not complete.
    pub failed: Option<Failed>,
    pub error_type: Option<String>,
    pub response_model: Option<String>,
    pub response_id: Option<String>,
    pub finish_reason: Option<String>,
    pub tokens: Option<(u64, u64)>,
    /// A stream that ended without its terminal event.
    pub aborted: bool,
    pub client_cancelled: bool,
}

impl ModelCall {
    pub fn start(
        shared: &Arc<Shared>,
        ctx: &RequestContext,
        dialect: Dialect,
        headers: &http::HeaderMap,
        model: &str,
    ) -> Self {
        let join = Join {
            request_id: ctx.request_id.as_str(),
            task_id: ctx.task_id.as_ref().map(TaskId::as_str),
            policy_versions: None,
            gpu_id: None,
        };
        let span = spans::model_call(&join, names::OPERATION_CHAT, dialect.as_str(), model, false);
        if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
            spans::set_remote_parent(&span, tp);
        }
        let gpu = shared.gpu.load();
        Self {
            shared: shared.clone(),
            span,
            started: Instant::now(),
            request_id: ctx.request_id.to_string(),
            task: ctx.task_id.clone(),
            provider: "-".into(),
            model: String::new(),
            stream: false,
            first_chunk: None,
            last_chunk: None,
            gaps: ChunkGaps::default(),
            attempts: 0,
            retries: 0,
            fallbacks: 0,
            policy_versions: Vec::new(),
            replayed: false,
            answered_here: false,
            gpu_unhealthy: gpu.state == GpuState::Unhealthy,
            gpu_spells: shared.gpu_unhealthy_spells.load(Ordering::Acquire),
            local: false,
            synthetic: ctx.synthetic,
            done: false,
        }
    }

    pub fn routed(&mut self, provider: &str, local: bool, model: &str, stream: bool) {
        self.provider = provider.to_string();
        self.local = local;
        self.model = model.to_string();
        self.stream = stream;
        self.span.record(names::ATTR_REQUEST_MODEL, model);
        self.span.record(names::ATTR_REQUEST_STREAM, stream);
        if local {
            let gpu = self.shared.gpu.load();
            if !gpu.ids.is_empty() {
                self.span
                    .record(names::ATTR_GPU_ID, gpu.ids.join(",").as_str());
            }
        }
    }

    pub fn trail(&mut self, trail: &Trail) {
        self.attempts = trail.attempts;
        self.retries = trail.retries;
        self.fallbacks = trail.fallbacks;
        if !trail.policy_versions.is_empty() {
            let versions: Vec<&str> = trail.policy_versions.iter().map(|v| v.as_str()).collect();
            spans::record_policy_versions(&self.span, &versions.join(","));
        }
        self.policy_versions.clone_from(&trail.policy_versions);
    }

    /// The call was answered from the journal: a whole turn (`ModelTurn`) or the
    /// rest of a stream after `Last-Event-ID` (`StreamResume`).
    pub fn replayed(&mut self, kind: outrigger_telemetry::ReplayKind) {
        self.replayed = true;
        self.shared.metrics.replay(kind);
    }

    /// Answered by the sidecar with nothing from the journal or a provider (a
    /// resume with nothing after the client's id): counted as neither a provider's
    /// call nor a replay, in the metrics, the SLOs or the task (as `GET
    /// /v1/streams/{key}` is not); only its span is kept.
    pub fn answered_here(&mut self) {
        self.answered_here = true;
    }

    pub fn chunk(&mut self, at: Instant) {
        match self.last_chunk {
            None => self.first_chunk = Some(at),
            Some(prev) => self.gaps.push(at.saturating_duration_since(prev)),
        }
        self.last_chunk = Some(at);
    }

    /// Finishes a call that failed in the sidecar (refused, unreachable upstream…).
    pub fn finish_error(self, e: &Error) {
        let failed = failed_of(e);
        self.finish(ModelEnd {
            failed: Some(failed),
            error_type: Some(error_type_of(e).to_string()),
            ..ModelEnd::default()
        });
    }

    pub fn finish(mut self, end: ModelEnd) {
        self.record(end);
        self.done = true;
    }

    fn record(&mut self, end: ModelEnd) {
        let now = SystemTime::now();
        let duration = self.started.elapsed();
        let ttft = self
            .first_chunk
            .map(|t| t.saturating_duration_since(self.started));
        // Unhealthy when it started, when it ended, or at any time between.
        let spells = self.shared.gpu_unhealthy_spells.load(Ordering::Acquire);
        let gpu_unhealthy = self.local
            && (self.gpu_unhealthy
                || spells != self.gpu_spells
                || self.shared.gpu.load().state == GpuState::Unhealthy);
        let signals = Signals {
            failure: end.failed.or(end.aborted.then_some(Failed::Transport)),
            gpu_unhealthy,
            client_cancelled: end.client_cancelled,
            synthetic: self.synthetic,
            maintenance: self.shared.slos.maintenance_active(),
        };
        let outcome = classify(&signals);
        let trace_id = spans::trace_id(&self.span);
        let error_type = end.error_type.as_deref();
        let metrics = &self.shared.metrics;
        if !self.replayed && !self.answered_here {
            metrics.model_call(&ModelCallRecord {
                provider: &self.provider,
                request_model: &self.model,
                response_model: end.response_model.as_deref(),
                operation: names::OPERATION_CHAT,
                stream: self.stream,
                duration,
                ttft,
                chunk_gaps: &self.gaps,
                tokens_in: end.tokens.map(|t| t.0),
                tokens_out: end.tokens.map(|t| t.1),
                error_type,
                trace_id,
            });
        }
        let inter_token = self.gaps.mean();
        let mut event = SloEvent::new(ObjectKind::ModelCalls, outcome, now);
        event.provider = Some(&self.provider);
        event.model = Some(&self.model);
        event.latency_cause = signals.latency_cause();
        event.stream = self.stream;
        event.ttft = ttft;
        event.inter_token = inter_token;
        event.aborted = end.aborted;
        event.trace_id = trace_id;
        if !self.answered_here {
            self.shared.slos.record(&event);
        }
        if let (Some(tasks), Some(task)) = (&self.shared.tasks, &self.task)
            && !self.answered_here
        {
            let (tokens_in, tokens_out) = if self.replayed {
                (0, 0)
            } else {
                end.tokens.unwrap_or((0, 0))
            };
            tasks.model_call(
                task,
                &ModelCallSummary {
                    at: now,
                    request_id: &self.request_id,
                    provider: &self.provider,
                    model: &self.model,
                    response_model: end.response_model.as_deref(),
                    tokens_in,
                    tokens_out,
                    retries: self.retries,
                    fallbacks: self.fallbacks,
                    policy_versions: &self.policy_versions,
                    replayed: self.replayed,
                    // A call its agent gave up on never completed, stream or not.
                    ok: end.failed.is_none() && !end.aborted && !end.client_cancelled,
                    // The agent's own cancel ends its stream early too, but nothing
                    // went wrong upstream: not a `stream_interrupted` fault (the SLOs
                    // count it as a client cancel).
                    interrupted: end.aborted && !end.client_cancelled,
                    // Settled before the call is finished (or dropped), so this
                    // call's charge is in it.
                    charged: self.shared.ledger.charged(task.as_str()),
                },
            );
        }
        spans::finish_model_call(
            &self.span,
            &spans::ModelCallEnd {
                target: Some(&self.provider),
                response_model: end.response_model.as_deref(),
                response_id: end.response_id.as_deref(),
                finish_reason: end.finish_reason.as_deref(),
                model_revision: end.response_model.as_deref(),
                ttft,
                tokens_in: end.tokens.map(|t| t.0),
                tokens_out: end.tokens.map(|t| t.1),
                attempts: self.attempts.max(1),
                replayed: self.replayed,
                error_type,
                slo: Some(outcome),
            },
        );
    }
}

/// The SLO failure class of a sidecar error.
pub(crate) fn failed_of(e: &Error) -> Failed {
    match e {
        Error::MalformedJson(_)
        | Error::InvalidRequest(_)
        | Error::BadHeader { .. }
        | Error::UnknownModel { .. }
        | Error::BodyTooLarge { .. }
        | Error::MethodNotAllowed { .. }
        | Error::NotFound { .. }
        | Error::UnknownTool { .. }
        | Error::ReadBody(_)
        | Error::BodyTimeout { .. }
        | Error::MissingKey { .. }
        | Error::StreamKeyReused { .. }
        | Error::UnknownStream { .. }
        | Error::StreamExpired { .. }
        | Error::GenerationLost { .. }
        | Error::Cancelled { .. } => Failed::InvalidRequest,
        Error::BudgetExceeded { .. } => Failed::PolicyDenied,
        Error::Upstream { source, .. } => failed_of_upstream(source),
        Error::StreamBroke { .. } => Failed::Transport,
        Error::NoCandidate { .. }
        | Error::CircuitOpen { .. }
        | Error::Overloaded { .. }
        | Error::StreamInProgress { .. } => Failed::Admission,
        Error::BuildRequest(_) | Error::Journal(_) => Failed::Internal,
    }
}

/// The SLO failure class of an upstream exchange that got no answer: no response
/// head in time is a deadline with the connection up; the rest is the network.
pub(crate) fn failed_of_upstream(e: &crate::upstream::Error) -> Failed {
    match e {
        crate::upstream::Error::Timeout { .. } => Failed::Timeout,
        crate::upstream::Error::Connect { .. } | crate::upstream::Error::AfterSend { .. } => {
            Failed::Transport
        }
    }
}

/// `error.type` for a sidecar error: its problem slug.
pub(crate) fn error_type_of(e: &Error) -> &'static str {
    e.to_problem().slug
}

/// A tool call being observed.
pub(crate) struct ToolCall {
    shared: Arc<Shared>,
    pub span: Span,
    started: Instant,
    request_id: String,
    task: Option<TaskId>,
    tool: String,
    protocol: &'static str,
    synthetic: bool,
}

/// How a tool call ended.
pub(crate) struct ToolEnd<'a> {
    pub outcome: ToolCallOutcome,
    /// The journal state, or `unjournaled`.
    pub journal_state: &'static str,
    pub key: Option<&'a str>,
    pub replayed: bool,
    pub error_type: Option<&'a str>,
    /// What went wrong, for the SLOs (`None`: the tool did what it was asked). The
    /// outcome says what became of the call, this whose failure it was.
    pub failed: Option<Failed>,
}

/// A tool call's observer, shared with the task that finishes the call if its agent
/// goes away (see `journaled`): whichever ends the call records it, once.
#[derive(Clone)]
pub(crate) struct PendingTool(Arc<std::sync::Mutex<Option<ToolCall>>>);

impl PendingTool {
    pub fn new(rec: ToolCall) -> Self {
        Self(Arc::new(std::sync::Mutex::new(Some(rec))))
    }

    /// The observer, unless the call was recorded already.
    pub fn take(&self) -> Option<ToolCall> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

impl ToolCall {
    pub fn start(
        shared: &Arc<Shared>,
        ctx: &RequestContext,
        tool: &str,
        protocol: &'static str,
        headers: &http::HeaderMap,
    ) -> Self {
        // No policy decides a tool call; the span names the versions in force, as the
        // journal record does.
        let versions = shared
            .decider
            .versions()
            .iter()
            .map(PolicyVersion::as_str)
            .collect::<Vec<_>>()
            .join(",");
        let join = Join {
            request_id: ctx.request_id.as_str(),
            task_id: ctx.task_id.as_ref().map(TaskId::as_str),
            policy_versions: (!versions.is_empty()).then_some(versions.as_str()),
            gpu_id: None,
        };
        let span = spans::tool_call(&join, tool, None, protocol);
        if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
            spans::set_remote_parent(&span, tp);
        }
        Self {
            shared: shared.clone(),
            span,
            started: Instant::now(),
            request_id: ctx.request_id.to_string(),
            task: ctx.task_id.clone(),
            tool: tool.to_string(),
            protocol,
            synthetic: ctx.synthetic,
        }
    }

    pub fn finish(self, end: ToolEnd<'_>) {
        let now = SystemTime::now();
        let outcome = classify(&Signals {
            failure: end.failed,
            gpu_unhealthy: false,
            client_cancelled: false,
            synthetic: self.synthetic,
            maintenance: self.shared.slos.maintenance_active(),
        });
        let trace_id = spans::trace_id(&self.span);
        self.shared.metrics.tool_call(&ToolCallRecord {
            tool: &self.tool,
            protocol: self.protocol,
            duration: self.started.elapsed(),
            journal_state: end.journal_state,
            error_type: end.error_type,
            trace_id,
        });
        if end.replayed {
            self.shared
                .metrics
                .replay(outrigger_telemetry::ReplayKind::Tool);
        }
        let mut event = SloEvent::new(ObjectKind::ToolCalls, outcome, now);
        event.tool = Some(&self.tool);
        event.definitive = matches!(end.outcome, ToolCallOutcome::Completed);
        event.trace_id = trace_id;
        self.shared.slos.record(&event);
        if let (Some(tasks), Some(task)) = (&self.shared.tasks, &self.task) {
            tasks.tool_call(
                task,
                &ToolCallSummary {
                    at: now,
                    request_id: &self.request_id,
                    tool: &self.tool,
                    key: end.key,
                    outcome: end.outcome,
                    replayed: end.replayed,
                    retries: 0,
                },
            );
        }
        spans::finish_tool_call(
            &self.span,
            &spans::ToolCallEnd {
                journal_state: Some(end.journal_state),
                replayed: end.replayed,
                attempts: 1,
                model_revision: None,
                error_type: end.error_type,
                slo: Some(outcome),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use outrigger_telemetry::Metrics;
    use outrigger_types::RequestId;

    use super::*;
    use crate::tasks::{FaultKind, Tasks, TasksOptions, TimelineEvent};
    use crate::{Components, Options, Proxy};

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// Starts a model call of `task` (after `before` ran on the tracker), routes it
    /// (`streamed` or not) and drops it unfinished, as when its agent goes away;
    /// returns the task's report then.
    fn dropped_call(
        task: &TaskId,
        streamed: bool,
        before: impl FnOnce(&Tasks),
    ) -> Result<crate::tasks::TaskReport, Box<dyn std::error::Error>> {
        let metrics = Metrics::new();
        let tasks = Tasks::open(
            TasksOptions::default(),
            None,
            metrics.clone(),
            None,
            SystemTime::now(),
        )?;
        let proxy = Proxy::new(
            Options::default(),
            Components {
                tasks: Some(tasks.clone()),
                ..Components::new(metrics, None)
            },
        );
        before(&tasks);
        let ctx = RequestContext {
            request_id: RequestId::from_generated("r1".into()),
            task_id: Some(task.clone()),
            peer: SocketAddr::from(([127, 0, 0, 1], 1)),
            synthetic: false,
        };
        let mut call = ModelCall::start(
            &proxy.shared,
            &ctx,
            Dialect::OpenAi,
            &http::HeaderMap::new(),
            "m",
        );
        call.routed("p", false, "m", streamed);
        drop(call);
        let report = tasks.get(task, SystemTime::now()).ok_or("no task")?;
        assert!(
            matches!(
                report.task.timeline.last(),
                Some(TimelineEvent::ModelCall { ok: false, .. })
            ),
            "{:?}",
            report.task.timeline
        );
        Ok(report)
    }

    /// A plain (not streamed) call its agent gave up on never completed: it is no
    /// progress for its task and clears none of the task's faults.
    #[test]
    fn a_call_its_agent_gave_up_on_is_no_progress() -> TestResult {
        let task = TaskId::new("gave-up")?;
        let report = dropped_call(&task, false, |tasks| {
            tasks.fault(&task, "r0", FaultKind::StreamInterrupted, SystemTime::now());
        })?;
        assert_eq!((report.task.recoveries, report.task.open_faults), (0, 1));
        Ok(())
    }

    /// A stream its agent went away from half-way broke for the agent's own
    /// reasons: no `stream_interrupted` fault is charged to its task.
    #[test]
    fn a_stream_its_agent_cancelled_is_no_fault() -> TestResult {
        let task = TaskId::new("cancelled-stream")?;
        let report = dropped_call(&task, true, |_| {})?;
        assert_eq!(report.task.faults.total(), 0, "{:?}", report.task.faults);
        assert_eq!(report.task.open_faults, 0);
        Ok(())
    }
}
