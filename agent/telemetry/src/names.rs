//! Every span, attribute and metric name the sidecar emits, in one place.
//!
//! `gen_ai.*` names follow the OpenTelemetry GenAI semantic conventions as of semconv
//! v1.41.0, the last core release that carried them (they have since moved to their
//! own repository and keep changing, so the set is pinned here and only here). The two
//! duration metrics that core v1.41.0 lacks, `gen_ai.execute_tool.duration` and
//! `gen_ai.invoke_agent.duration`, come from the GenAI conventions repository's
//! v0.1.0 tag. `http.*` and `error.type` are the stable HTTP conventions. Everything
//! without a convention is `outrigger.*` (attributes) or `outrigger_*` (metrics).
//!
//! Prometheus names are the standard OTLP→Prometheus translation of the convention
//! names: dots become underscores, the unit is appended (`_seconds`) by the registry
//! (`register_with_unit`), annotation units such as `{token}` are dropped, and the
//! encoder appends `_total` to counters — so the constants below are the names as
//! registered, and [`EXPOSED_METRICS`] lists them as they appear on `/metrics`.

/// The semantic-conventions version the GenAI names are pinned to.
pub const SEMCONV_VERSION: &str = "1.41.0";
/// Recorded as the instrumentation scope's schema URL.
pub const SCHEMA_URL: &str = "https://opentelemetry.io/schemas/1.41.0";
/// The instrumentation scope (tracer) name.
pub const SCOPE: &str = "outrigger";
/// `service.name` unless configured otherwise.
pub const SERVICE_NAME_DEFAULT: &str = "outrigger";
/// The `tracing` target of the spans built in [`crate::spans`]: the OpenTelemetry
/// layer exports spans of this target (and of nothing else), whatever the log filter.
pub const SPAN_TARGET: &str = "outrigger::otel";

// ---------------------------------------------------------------------------------
// Metric names, as registered (see the module docs for the exposed form).

/// `gen_ai.client.operation.duration` (Histogram, s). Semconv: required.
pub const GEN_AI_CLIENT_OPERATION_DURATION: &str = "gen_ai_client_operation_duration";
/// `gen_ai.client.token.usage` (Histogram, `{token}`).
pub const GEN_AI_CLIENT_TOKEN_USAGE: &str = "gen_ai_client_token_usage";
/// `gen_ai.client.operation.time_to_first_chunk` (Histogram, s). Streaming only.
pub const GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK: &str = "gen_ai_client_operation_time_to_first_chunk";
/// `gen_ai.client.operation.time_per_output_chunk` (Histogram, s). Streaming only.
pub const GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK: &str =
    "gen_ai_client_operation_time_per_output_chunk";
/// `gen_ai.execute_tool.duration` (Histogram, s).
pub const GEN_AI_EXECUTE_TOOL_DURATION: &str = "gen_ai_execute_tool_duration";

/// `http.server.request.duration` (Histogram, s), stable HTTP conventions.
pub const HTTP_SERVER_REQUEST_DURATION: &str = "http_server_request_duration";
pub const HTTP_REQUESTS: &str = "outrigger_http_requests";
pub const HTTP_INFLIGHT: &str = "outrigger_http_inflight";
pub const TOOL_UNPROTECTED: &str = "outrigger_tool_unprotected";
/// Tool calls by tool and the journal state they ended in.
pub const TOOL_CALLS: &str = "outrigger_tool_calls";
/// Journal records by state (gauge, set from the journal's stats).
pub const JOURNAL_RECORDS: &str = "outrigger_journal_records";
/// Calls whose outcome is unknown: in doubt, reconciling or waiting for an operator.
pub const JOURNAL_IN_DOUBT: &str = "outrigger_journal_in_doubt";
/// Failed journal flushes since the journal was opened.
pub const JOURNAL_FLUSH_ERRORS: &str = "outrigger_journal_flush_errors";
/// Journal size on disk (gauge, bytes).
pub const JOURNAL_SIZE: &str = "outrigger_journal_size";
/// Answers served from the journal instead of executed, by kind.
pub const REPLAYS: &str = "outrigger_replays";
/// Retries by target and failure reason.
pub const RETRIES: &str = "outrigger_retries";
/// Interrupted text-only streams continued at their provider, by result.
pub const STREAM_CONTINUATIONS: &str = "outrigger_stream_continuations";
/// Fallbacks from one target to another.
pub const FALLBACKS: &str = "outrigger_fallbacks";
/// Failed calls a spent retry budget kept from retrying, by target.
pub const RETRY_BUDGET_EXHAUSTED: &str = "outrigger_retry_budget_exhausted";
/// Circuit-breaker state by target: 0 closed, 1 half-open, 2 open.
pub const BREAKER_STATE: &str = "outrigger_breaker_state";
/// Calls the budget policy rejected, by reason.
pub const BUDGET_REJECTIONS: &str = "outrigger_budget_rejections";
/// Policy traps, deadline hits, invalid decisions, swaps and failed swaps.
pub const POLICY_EVENTS: &str = "outrigger_policy_events";
/// Task wall-clock from first call to end, downtime included (Histogram, s).
pub const TASK_DURATION: &str = "outrigger_task_duration";
/// Tasks that had a fault, by whether their recovery succeeded.
pub const TASK_RECOVERIES: &str = "outrigger_task_recoveries";
/// SLO events: the SLI and error-budget source.
pub const SLO_EVENTS: &str = "outrigger_slo_events";
/// Each configured SLO's target (gauge), for alert rules.
pub const SLO_OBJECTIVE: &str = "outrigger_slo_objective";
/// Telemetry the sidecar dropped rather than slow the request path.
pub const TELEMETRY_DROPPED: &str = "outrigger_telemetry_dropped";
/// Faults injected on purpose (`[[faults]]`, `/v1/faults`), by target and kind.
pub const FAULTS_INJECTED: &str = "outrigger_faults_injected";
/// 1 while any fault injection is configured: alert on it outside drills.
pub const FAULTS_ACTIVE: &str = "outrigger_faults_active";

/// Every metric family on `/metrics`, as exposed (OpenMetrics text, exemplars
/// included), with its type. A test diffs the exposition against this list, and the
/// docs' table is written from it.
pub const EXPOSED_METRICS: &[(&str, &str)] = &[
    ("gen_ai_client_operation_duration_seconds", "histogram"),
    ("gen_ai_client_token_usage", "histogram"),
    (
        "gen_ai_client_operation_time_to_first_chunk_seconds",
        "histogram",
    ),
    (
        "gen_ai_client_operation_time_per_output_chunk_seconds",
        "histogram",
    ),
    ("gen_ai_execute_tool_duration_seconds", "histogram"),
    ("http_server_request_duration_seconds", "histogram"),
    ("outrigger_http_requests", "counter"),
    ("outrigger_http_inflight", "gauge"),
    ("outrigger_tool_unprotected", "counter"),
    ("outrigger_tool_calls", "counter"),
    ("outrigger_journal_records", "gauge"),
    ("outrigger_journal_in_doubt", "gauge"),
    ("outrigger_journal_flush_errors", "gauge"),
    ("outrigger_journal_size_bytes", "gauge"),
    ("outrigger_replays", "counter"),
    ("outrigger_stream_continuations", "counter"),
    ("outrigger_retries", "counter"),
    ("outrigger_fallbacks", "counter"),
    ("outrigger_retry_budget_exhausted", "counter"),
    ("outrigger_breaker_state", "gauge"),
    ("outrigger_budget_rejections", "counter"),
    ("outrigger_policy_events", "counter"),
    ("outrigger_task_duration_seconds", "histogram"),
    ("outrigger_task_recoveries", "counter"),
    ("outrigger_slo_events", "counter"),
    ("outrigger_slo_objective", "gauge"),
    ("outrigger_telemetry_dropped", "counter"),
    ("outrigger_faults_injected", "counter"),
    ("outrigger_faults_active", "gauge"),
];

// ---------------------------------------------------------------------------------
// Buckets.

/// Advisory buckets of `gen_ai.client.operation.duration`, `…time_to_first_chunk` and
/// `…time_per_output_chunk` (semconv v1.41.0).
pub const GEN_AI_DURATION_BUCKETS: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];
/// Advisory buckets of `gen_ai.client.token.usage` (semconv v1.41.0).
pub const GEN_AI_TOKEN_BUCKETS: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];
/// Advisory buckets of `http.server.request.duration` (stable HTTP conventions).
pub const HTTP_DURATION_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
/// Task wall-clock buckets: tasks run from seconds to hours.
pub const TASK_DURATION_BUCKETS: [f64; 12] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0,
];

// ---------------------------------------------------------------------------------
// Metric label names (OTel attribute names with dots as underscores).

pub const LABEL_OPERATION: &str = "gen_ai_operation_name";
pub const LABEL_PROVIDER: &str = "gen_ai_provider_name";
pub const LABEL_REQUEST_MODEL: &str = "gen_ai_request_model";
pub const LABEL_RESPONSE_MODEL: &str = "gen_ai_response_model";
pub const LABEL_TOKEN_TYPE: &str = "gen_ai_token_type";
pub const LABEL_TOOL_NAME: &str = "gen_ai_tool_name";
pub const LABEL_ERROR_TYPE: &str = "error_type";
/// The exemplar label that carries the W3C trace id (32 lowercase hex digits).
pub const EXEMPLAR_TRACE_ID: &str = "trace_id";

/// The value a bounded label takes once its allow-list is full (the conventions'
/// fallback value).
pub const OTHER: &str = "_OTHER";

// ---------------------------------------------------------------------------------
// Span names and attribute keys.

/// `gen_ai.operation.name` values the sidecar emits.
pub const OPERATION_CHAT: &str = "chat";
pub const OPERATION_EXECUTE_TOOL: &str = "execute_tool";
pub const OPERATION_INVOKE_AGENT: &str = "invoke_agent";
/// `gen_ai.token.type` values.
pub const TOKEN_TYPE_INPUT: &str = "input";
pub const TOKEN_TYPE_OUTPUT: &str = "output";

/// The agent name on `invoke_agent` spans: the sidecar does not know the agent's own
/// name, only that calls arrived under one task id.
pub const AGENT_NAME: &str = "outrigger-task";

// Convention attributes (semconv v1.41.0).
pub const ATTR_OPERATION_NAME: &str = "gen_ai.operation.name";
pub const ATTR_PROVIDER_NAME: &str = "gen_ai.provider.name";
pub const ATTR_REQUEST_MODEL: &str = "gen_ai.request.model";
pub const ATTR_REQUEST_STREAM: &str = "gen_ai.request.stream";
pub const ATTR_RESPONSE_MODEL: &str = "gen_ai.response.model";
pub const ATTR_RESPONSE_ID: &str = "gen_ai.response.id";
pub const ATTR_RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
pub const ATTR_RESPONSE_TIME_TO_FIRST_CHUNK: &str = "gen_ai.response.time_to_first_chunk";
pub const ATTR_USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
pub const ATTR_USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
pub const ATTR_TOOL_NAME: &str = "gen_ai.tool.name";
pub const ATTR_TOOL_CALL_ID: &str = "gen_ai.tool.call.id";
pub const ATTR_TOOL_TYPE: &str = "gen_ai.tool.type";
pub const ATTR_AGENT_NAME: &str = "gen_ai.agent.name";
pub const ATTR_AGENT_ID: &str = "gen_ai.agent.id";
pub const ATTR_ERROR_TYPE: &str = "error.type";
pub const ATTR_HTTP_REQUEST_METHOD: &str = "http.request.method";
pub const ATTR_HTTP_RESEND_COUNT: &str = "http.request.resend_count";
pub const ATTR_HTTP_RESPONSE_STATUS_CODE: &str = "http.response.status_code";
pub const ATTR_SERVER_ADDRESS: &str = "server.address";
/// Opt-in content attributes; only set when content capture is configured.
pub const ATTR_INPUT_MESSAGES: &str = "gen_ai.input.messages";
pub const ATTR_OUTPUT_MESSAGES: &str = "gen_ai.output.messages";

// Resource attributes.
pub const RESOURCE_SERVICE_NAME: &str = "service.name";
pub const RESOURCE_SERVICE_VERSION: &str = "service.version";
pub const RESOURCE_SERVICE_INSTANCE_ID: &str = "service.instance.id";

// The sidecar's own join keys, on every span it emits.
pub const ATTR_REQUEST_ID: &str = "outrigger.request.id";
pub const ATTR_TASK_ID: &str = "outrigger.task.id";
/// The model revision the provider reported (`model` of the response, or a weights
/// revision header where the upstream sends one).
pub const ATTR_MODEL_REVISION: &str = "outrigger.model.revision";
/// The policy versions (binding@hash) that decided the call, comma-separated.
pub const ATTR_POLICY_VERSIONS: &str = "outrigger.policy.versions";
/// The local GPU(s) serving the call (UUIDs, comma-separated); empty when none.
pub const ATTR_GPU_ID: &str = "outrigger.gpu.id";
pub const ATTR_ATTEMPTS: &str = "outrigger.attempts";
pub const ATTR_TARGET: &str = "outrigger.target";
pub const ATTR_JOURNAL_STATE: &str = "outrigger.journal.state";
pub const ATTR_REPLAYED: &str = "outrigger.replayed";
pub const ATTR_SLO_OUTCOME: &str = "outrigger.slo.outcome";
pub const ATTR_SLO_CAUSE: &str = "outrigger.slo.cause";
pub const ATTR_TASK_OUTCOME: &str = "outrigger.task.outcome";
pub const ATTR_TASK_RECOVERED: &str = "outrigger.task.recovered";
pub const ATTR_TASK_FAULTS: &str = "outrigger.task.faults";
pub const ATTR_TASK_MODEL_CALLS: &str = "outrigger.task.model_calls";
pub const ATTR_TASK_TOOL_CALLS: &str = "outrigger.task.tool_calls";

/// tracing-opentelemetry's special fields: they set the span's name, kind and status
/// rather than becoming attributes.
pub const OTEL_NAME: &str = "otel.name";
pub const OTEL_KIND: &str = "otel.kind";
pub const OTEL_STATUS_CODE: &str = "otel.status_code";

/// The attributes every span the sidecar emits carries (join keys across layers).
pub const COMMON_SPAN_ATTRIBUTES: [&str; 5] = [
    ATTR_REQUEST_ID,
    ATTR_TASK_ID,
    ATTR_MODEL_REVISION,
    ATTR_POLICY_VERSIONS,
    ATTR_GPU_ID,
];

/// Attribute keys that must never appear on a span unless content capture is on.
pub const CONTENT_ATTRIBUTES: [&str; 2] = [ATTR_INPUT_MESSAGES, ATTR_OUTPUT_MESSAGES];
