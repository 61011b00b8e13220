//! Spans for model calls, their attempts, tool calls and tasks, named and attributed
//! per the pinned GenAI conventions ([`crate::names`]).
//!
//! Model and tool spans are `tracing` spans of target [`names::SPAN_TARGET`]; the
//! OpenTelemetry layer installed by [`crate::init`] turns them into OTLP spans (their
//! OpenTelemetry name, kind and status come from the `otel.*` fields). Without that
//! layer they cost what a disabled `tracing` span costs. The task span
//! (`invoke_agent`) is emitted once, when the task ends, straight through the
//! OpenTelemetry API with its real start time, so it survives sidecar restarts that a
//! long-lived in-memory span would not.
//!
//! Every span carries the join keys of [`Join`]; prompt and completion content is
//! only recorded when content capture was switched on at [`crate::init`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};
use outrigger_types::Outcome;
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::labels::TraceId;
use crate::names;

static CONTENT_CAPTURE: AtomicBool = AtomicBool::new(false);

pub(crate) fn set_content_capture(on: bool) {
    CONTENT_CAPTURE.store(on, Ordering::Relaxed);
}

/// The ids that join a span to the other layers: logs, journal records, metrics
/// exemplars, GPU health.
#[derive(Debug, Clone, Copy, Default)]
pub struct Join<'a> {
    pub request_id: &'a str,
    pub task_id: Option<&'a str>,
    /// The policy versions (`binding@hash`) that decided the call, comma-separated;
    /// may be recorded later with [`record_policy_versions`].
    pub policy_versions: Option<&'a str>,
    /// The local GPU(s) serving the call, when it is served locally.
    pub gpu_id: Option<&'a str>,
}

fn record_join(span: &Span, join: &Join<'_>) {
    span.record(names::ATTR_REQUEST_ID, join.request_id);
    if let Some(task) = join.task_id {
        span.record(names::ATTR_TASK_ID, task);
    }
    if let Some(versions) = join.policy_versions {
        span.record(names::ATTR_POLICY_VERSIONS, versions);
    }
    if let Some(gpu) = join.gpu_id {
        span.record(names::ATTR_GPU_ID, gpu);
    }
}

/// Records the policy versions once the decisions are made.
pub fn record_policy_versions(span: &Span, versions: &str) {
    span.record(names::ATTR_POLICY_VERSIONS, versions);
}

/// The logical model call, `{operation} {request_model}` (e.g. `chat gpt-4o`), kind
/// CLIENT. Its attempts are children ([`attempt`]).
pub fn model_call(
    join: &Join<'_>,
    operation: &str,
    provider: &str,
    request_model: &str,
    stream: bool,
) -> Span {
    let span = tracing::info_span!(
        target: names::SPAN_TARGET,
        "gen_ai.model_call",
        { names::OTEL_NAME } = format!("{operation} {request_model}"),
        { names::OTEL_KIND } = "client",
        { names::OTEL_STATUS_CODE } = Empty,
        { names::ATTR_OPERATION_NAME } = operation,
        { names::ATTR_PROVIDER_NAME } = provider,
        { names::ATTR_REQUEST_MODEL } = request_model,
        { names::ATTR_REQUEST_STREAM } = stream,
        { names::ATTR_RESPONSE_MODEL } = Empty,
        { names::ATTR_RESPONSE_ID } = Empty,
        { names::ATTR_RESPONSE_FINISH_REASONS } = Empty,
        { names::ATTR_RESPONSE_TIME_TO_FIRST_CHUNK } = Empty,
        { names::ATTR_USAGE_INPUT_TOKENS } = Empty,
        { names::ATTR_USAGE_OUTPUT_TOKENS } = Empty,
        { names::ATTR_ERROR_TYPE } = Empty,
        { names::ATTR_REQUEST_ID } = Empty,
        { names::ATTR_TASK_ID } = Empty,
        { names::ATTR_MODEL_REVISION } = Empty,
        { names::ATTR_POLICY_VERSIONS } = Empty,
        { names::ATTR_GPU_ID } = Empty,
        { names::ATTR_ATTEMPTS } = Empty,
        { names::ATTR_TARGET } = Empty,
        { names::ATTR_REPLAYED } = Empty,
        { names::ATTR_SLO_OUTCOME } = Empty,
        { names::ATTR_SLO_CAUSE } = Empty,
        { names::ATTR_INPUT_MESSAGES } = Empty,
        { names::ATTR_OUTPUT_MESSAGES } = Empty,
    );
    record_join(&span, join);
    span
}

/// One attempt of a call (a child of the logical span): `{method}`, kind CLIENT, with
/// `http.request.resend_count` from the second attempt on.
pub fn attempt(parent: &Span, join: &Join<'_>, n: u32, method: &str, target: &str) -> Span {
    let span = tracing::info_span!(
        target: names::SPAN_TARGET,
        parent: parent,
        "gen_ai.attempt",
        { names::OTEL_NAME } = method.to_owned(),
        { names::OTEL_KIND } = "client",
        { names::OTEL_STATUS_CODE } = Empty,
        { names::ATTR_HTTP_REQUEST_METHOD } = method,
        { names::ATTR_HTTP_RESEND_COUNT } = Empty,
        { names::ATTR_HTTP_RESPONSE_STATUS_CODE } = Empty,
        { names::ATTR_TARGET } = target,
        { names::ATTR_ERROR_TYPE } = Empty,
        { names::ATTR_REQUEST_ID } = Empty,
        { names::ATTR_TASK_ID } = Empty,
        { names::ATTR_MODEL_REVISION } = Empty,
        { names::ATTR_POLICY_VERSIONS } = Empty,
        { names::ATTR_GPU_ID } = Empty,
    );
    if n > 1 {
        span.record(names::ATTR_HTTP_RESEND_COUNT, i64::from(n - 1));
    }
    record_join(&span, join);
    span
}

/// How an attempt ended.
pub fn finish_attempt(span: &Span, status: Option<u16>, error_type: Option<&str>) {
    if let Some(status) = status {
        span.record(names::ATTR_HTTP_RESPONSE_STATUS_CODE, i64::from(status));
    }
    if let Some(error) = error_type {
        span.record(names::ATTR_ERROR_TYPE, error);
        span.record(names::OTEL_STATUS_CODE, "error");
    }
}

/// How a model call ended, as far as the span is concerned.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelCallEnd<'a> {
    /// The provider (target) that finally served the call.
    pub target: Option<&'a str>,
    pub response_model: Option<&'a str>,
    pub response_id: Option<&'a str>,
    pub finish_reason: Option<&'a str>,
    /// What the provider reports about the model that served the call (a weights
    /// revision where the upstream exposes one, else the response model).
    pub model_revision: Option<&'a str>,
    pub ttft: Option<Duration>,
    pub tokens_in: Option<u64>,
    pub tokens_out: Option<u64>,
    pub attempts: u32,
    pub replayed: bool,
    pub error_type: Option<&'a str>,
    /// The SLO classification of the call, so traces and metrics agree.
    pub slo: Option<Outcome>,
}

pub fn finish_model_call(span: &Span, end: &ModelCallEnd<'_>) {
    if let Some(v) = end.target {
        span.record(names::ATTR_TARGET, v);
    }
    if let Some(v) = end.response_model {
        span.record(names::ATTR_RESPONSE_MODEL, v);
    }
    if let Some(v) = end.response_id {
        span.record(names::ATTR_RESPONSE_ID, v);
    }
    if let Some(v) = end.finish_reason {
        // The convention's type is string[]; one finish reason per (single-choice) call.
        span.record(names::ATTR_RESPONSE_FINISH_REASONS, v);
    }
    if let Some(v) = end.model_revision.or(end.response_model) {
        span.record(names::ATTR_MODEL_REVISION, v);
    }
    if let Some(v) = end.ttft {
        span.record(names::ATTR_RESPONSE_TIME_TO_FIRST_CHUNK, v.as_secs_f64());
    }
    // OpenTelemetry integers are i64; a u64 would be exported as a string.
    if let Some(v) = end.tokens_in {
        span.record(
            names::ATTR_USAGE_INPUT_TOKENS,
            i64::try_from(v).unwrap_or(i64::MAX),
        );
    }
    if let Some(v) = end.tokens_out {
        span.record(
            names::ATTR_USAGE_OUTPUT_TOKENS,
            i64::try_from(v).unwrap_or(i64::MAX),
        );
    }
    span.record(names::ATTR_ATTEMPTS, i64::from(end.attempts));
    span.record(names::ATTR_REPLAYED, end.replayed);
    if let Some(error) = end.error_type {
        span.record(names::ATTR_ERROR_TYPE, error);
        span.record(names::OTEL_STATUS_CODE, "error");
    }
    record_slo(span, end.slo);
}

fn record_slo(span: &Span, slo: Option<Outcome>) {
    match slo {
        None => {}
        Some(Outcome::Good) => {
            span.record(names::ATTR_SLO_OUTCOME, "good");
        }
        Some(Outcome::Bad(cause)) => {
            span.record(names::ATTR_SLO_OUTCOME, "bad");
            span.record(names::ATTR_SLO_CAUSE, cause.as_str());
        }
        Some(Outcome::Excluded(why)) => {
            span.record(names::ATTR_SLO_OUTCOME, "excluded");
            span.record(names::ATTR_SLO_CAUSE, why.as_str());
        }
    }
}

/// Records prompt and completion content, only when content capture is on (it is
/// off by default: the conventions make these attributes opt-in).
pub fn record_content(span: &Span, input: Option<&str>, output: Option<&str>) {
    if !CONTENT_CAPTURE.load(Ordering::Relaxed) {
        return;
    }
    if let Some(v) = input {
        span.record(names::ATTR_INPUT_MESSAGES, v);
    }
    if let Some(v) = output {
        span.record(names::ATTR_OUTPUT_MESSAGES, v);
    }
}

/// A tool call, `execute_tool {tool}`, kind INTERNAL.
pub fn tool_call(join: &Join<'_>, tool: &str, call_id: Option<&str>, protocol: &str) -> Span {
    let span = tracing::info_span!(
        target: names::SPAN_TARGET,
        "execute_tool",
        { names::OTEL_NAME } = format!("{} {tool}", names::OPERATION_EXECUTE_TOOL),
        { names::OTEL_KIND } = "internal",
        { names::OTEL_STATUS_CODE } = Empty,
        { names::ATTR_OPERATION_NAME } = names::OPERATION_EXECUTE_TOOL,
        { names::ATTR_TOOL_NAME } = tool,
        { names::ATTR_TOOL_CALL_ID } = Empty,
        { names::ATTR_TOOL_TYPE } = "extension",
        { names::ATTR_TARGET } = protocol,
        { names::ATTR_ERROR_TYPE } = Empty,
        { names::ATTR_JOURNAL_STATE } = Empty,
        { names::ATTR_REPLAYED } = Empty,
        { names::ATTR_ATTEMPTS } = Empty,
        { names::ATTR_REQUEST_ID } = Empty,
        { names::ATTR_TASK_ID } = Empty,
        { names::ATTR_MODEL_REVISION } = Empty,
        { names::ATTR_POLICY_VERSIONS } = Empty,
        { names::ATTR_GPU_ID } = Empty,
        { names::ATTR_SLO_OUTCOME } = Empty,
        { names::ATTR_SLO_CAUSE } = Empty,
    );
    if let Some(id) = call_id {
        span.record(names::ATTR_TOOL_CALL_ID, id);
    }
    record_join(&span, join);
    span
}

/// How a tool call ended.
#[derive(Debug, Clone, Copy, Default)]
pub struct ToolCallEnd<'a> {
    /// The journal state the call ended in (`completed`, `in_doubt`, …).
    pub journal_state: Option<&'a str>,
    pub replayed: bool,
    pub attempts: u32,
    /// The model revision recorded with the call's journal record, when known.
    pub model_revision: Option<&'a str>,
    pub error_type: Option<&'a str>,
    pub slo: Option<Outcome>,
}

pub fn finish_tool_call(span: &Span, end: &ToolCallEnd<'_>) {
    if let Some(v) = end.journal_state {
        span.record(names::ATTR_JOURNAL_STATE, v);
    }
    if let Some(v) = end.model_revision {
        span.record(names::ATTR_MODEL_REVISION, v);
    }
    span.record(names::ATTR_REPLAYED, end.replayed);
    span.record(names::ATTR_ATTEMPTS, i64::from(end.attempts));
    if let Some(error) = end.error_type {
        span.record(names::ATTR_ERROR_TYPE, error);
        span.record(names::OTEL_STATUS_CODE, "error");
    }
    record_slo(span, end.slo);
}

/// Makes the W3C `traceparent` the agent sent the parent of `span` (so the sidecar's
/// spans join the agent's trace). Returns false when the header is not valid.
pub fn set_remote_parent(span: &Span, traceparent: &str) -> bool {
    use opentelemetry::propagation::TextMapPropagator;
    struct One<'a>(&'a str);
    impl opentelemetry::propagation::Extractor for One<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            (key == "traceparent").then_some(self.0)
        }
        fn keys(&self) -> Vec<&str> {
            vec!["traceparent"]
        }
    }
    let cx = opentelemetry_sdk::propagation::TraceContextPropagator::new()
        .extract_with_context(&Context::new(), &One(traceparent));
    if !cx.span().span_context().is_valid() {
        return false;
    }
    span.set_parent(cx).is_ok()
}

/// The trace id of `span`, for exemplars; `None` without an OpenTelemetry layer.
pub fn trace_id(span: &Span) -> Option<TraceId> {
    let cx = span.context();
    let span_ref = cx.span();
    let sc = span_ref.span_context();
    if !sc.is_valid() {
        return None;
    }
    TraceId::new(sc.trace_id().to_bytes())
}

/// The W3C `traceparent` naming the current span as the parent, for calls the
/// sidecar makes on the agent's behalf (tool headers, MCP `params._meta`); `None`
/// without an OpenTelemetry layer.
pub fn current_traceparent() -> Option<String> {
    let cx = Span::current().context();
    let span_ref = cx.span();
    let sc = span_ref.span_context();
    if !sc.is_valid() {
        return None;
    }
    Some(format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    ))
}

/// The trace id of the current span (see [`trace_id`]).
pub fn current_trace_id() -> Option<TraceId> {
    trace_id(&Span::current())
}

/// What a finished task looks like as an `invoke_agent` span.
#[derive(Debug, Clone, Copy)]
pub struct TaskSpan<'a> {
    pub task_id: &'a str,
    /// The request that opened the task.
    pub request_id: &'a str,
    pub started_at: SystemTime,
    pub ended_at: SystemTime,
    pub outcome: &'a str,
    /// `None` when the task had no fault.
    pub recovered: Option<bool>,
    pub faults: u32,
    pub model_calls: u32,
    pub tool_calls: u32,
    pub tokens_in: u64,
    pub tokens_out: u64,
    /// The last model revision the task saw and the policy versions it ran under.
    pub model_revision: Option<&'a str>,
    pub policy_versions: Option<&'a str>,
    pub gpu_id: Option<&'a str>,
}

/// Emits the task's `invoke_agent` span through the global tracer provider.
pub fn emit_task(task: &TaskSpan<'_>) {
    let tracer = opentelemetry::global::tracer_with_scope(crate::pipeline::scope());
    emit_task_with(&tracer, task);
}

/// Emits the task's `invoke_agent` span through `tracer`.
pub fn emit_task_with<T: Tracer>(tracer: &T, task: &TaskSpan<'_>) {
    let mut attributes = vec![
        KeyValue::new(names::ATTR_OPERATION_NAME, names::OPERATION_INVOKE_AGENT),
        KeyValue::new(names::ATTR_AGENT_NAME, names::AGENT_NAME),
        KeyValue::new(names::ATTR_AGENT_ID, task.task_id.to_owned()),
        KeyValue::new(names::ATTR_TASK_ID, task.task_id.to_owned()),
        KeyValue::new(names::ATTR_REQUEST_ID, task.request_id.to_owned()),
        KeyValue::new(names::ATTR_TASK_OUTCOME, task.outcome.to_owned()),
        KeyValue::new(names::ATTR_TASK_FAULTS, i64::from(task.faults)),
        KeyValue::new(names::ATTR_TASK_MODEL_CALLS, i64::from(task.model_calls)),
        KeyValue::new(names::ATTR_TASK_TOOL_CALLS, i64::from(task.tool_calls)),
        KeyValue::new(
            names::ATTR_USAGE_INPUT_TOKENS,
            i64::try_from(task.tokens_in).unwrap_or(i64::MAX),
        ),
        KeyValue::new(
            names::ATTR_USAGE_OUTPUT_TOKENS,
            i64::try_from(task.tokens_out).unwrap_or(i64::MAX),
        ),
    ];
    if let Some(recovered) = task.recovered {
        attributes.push(KeyValue::new(names::ATTR_TASK_RECOVERED, recovered));
    }
    for (key, value) in [
        (names::ATTR_MODEL_REVISION, task.model_revision),
        (names::ATTR_POLICY_VERSIONS, task.policy_versions),
        (names::ATTR_GPU_ID, task.gpu_id),
    ] {
        if let Some(v) = value {
            attributes.push(KeyValue::new(key, v.to_owned()));
        }
    }
    let mut span = tracer
        .span_builder(format!(
            "{} {}",
            names::OPERATION_INVOKE_AGENT,
            names::AGENT_NAME
        ))
        .with_kind(SpanKind::Internal)
        .with_start_time(task.started_at)
        .with_attributes(attributes)
        .start(tracer);
    if task.recovered == Some(false) || task.outcome != "success" {
        span.set_status(Status::error(task.outcome.to_owned()));
    }
    span.end_with_timestamp(task.ended_at);
}

#[cfg(test)]
mod tests;
