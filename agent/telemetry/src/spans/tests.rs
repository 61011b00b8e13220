use std::time::{Duration, SystemTime};

use opentelemetry::trace::{SpanKind, Status, TracerProvider as _};
use opentelemetry::{Key, Value};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outrigger_types::{Cause, Outcome};

use super::*;
use crate::pipeline::{TelemetryOptions, scope, subscriber};

struct Capture {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    dispatch: tracing::Dispatch,
}

fn capture() -> Result<Capture, crate::Error> {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let dispatch = subscriber(
        &TelemetryOptions::default(),
        Some(provider.tracer_with_scope(scope())),
    )?;
    Ok(Capture {
        exporter,
        provider,
        dispatch,
    })
}

impl Capture {
    fn spans(&self) -> Vec<SpanData> {
        self.exporter.get_finished_spans().unwrap_or_default()
    }
}

fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == Key::from(key.to_owned()))
        .map(|kv| &kv.value)
}

fn find<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    match spans.iter().find(|s| s.name == name) {
        Some(s) => s,
        None => panic!(
            "no span {name:?} in {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        ),
    }
}

const JOIN: Join<'static> = Join {
    request_id: "01JREQ",
    task_id: Some("task-7"),
    policy_versions: Some("retry@4f1c2a,budget@99aa00"),
    gpu_id: Some("GPU-1234"),
};

#[test]
fn model_call_spans_follow_the_conventions() -> Result<(), crate::Error> {
    let c = capture()?;
    let mut exemplar = None;
    tracing::dispatcher::with_default(&c.dispatch, || {
        let call = model_call(&JOIN, names::OPERATION_CHAT, "openai", "gpt-4o", true);
        exemplar = trace_id(&call);
        for n in 1..=2 {
            let a = attempt(&call, &JOIN, n, "POST", "openai");
            finish_attempt(
                &a,
                Some(if n == 1 { 503 } else { 200 }),
                (n == 1).then_some("503"),
            );
        }
        record_content(&call, Some("the prompt"), Some("the answer"));
        finish_model_call(
            &call,
            &ModelCallEnd {
                target: Some("openai"),
                response_model: Some("gpt-4o-2024-08-06"),
                response_id: Some("chatcmpl-1"),
                finish_reason: Some("stop"),
                ttft: Some(Duration::from_millis(250)),
                tokens_in: Some(12),
                tokens_out: Some(34),
                attempts: 2,
                slo: Some(Outcome::Good),
                ..ModelCallEnd::default()
            },
        );
    });
    let spans = c.spans();
    let call = find(&spans, "chat gpt-4o");
    assert_eq!(call.span_kind, SpanKind::Client);
    assert_eq!(call.instrumentation_scope.name(), names::SCOPE);
    assert_eq!(
        call.instrumentation_scope.schema_url(),
        Some(names::SCHEMA_URL)
    );
    let expect = [
        (names::ATTR_OPERATION_NAME, Value::from("chat")),
        (names::ATTR_PROVIDER_NAME, Value::from("openai")),
        (names::ATTR_REQUEST_MODEL, Value::from("gpt-4o")),
        (names::ATTR_REQUEST_STREAM, Value::from(true)),
        (names::ATTR_RESPONSE_MODEL, Value::from("gpt-4o-2024-08-06")),
        (names::ATTR_RESPONSE_ID, Value::from("chatcmpl-1")),
        (names::ATTR_RESPONSE_FINISH_REASONS, Value::from("stop")),
        (names::ATTR_RESPONSE_TIME_TO_FIRST_CHUNK, Value::from(0.25)),
        (names::ATTR_USAGE_INPUT_TOKENS, Value::from(12_i64)),
        (names::ATTR_USAGE_OUTPUT_TOKENS, Value::from(34_i64)),
        (names::ATTR_MODEL_REVISION, Value::from("gpt-4o-2024-08-06")),
        (names::ATTR_ATTEMPTS, Value::from(2_i64)),
        (names::ATTR_SLO_OUTCOME, Value::from("good")),
    ];
    for (key, value) in expect {
        assert_eq!(attr(call, key), Some(&value), "{key}");
    }
    // Content capture is off by default.
    for key in names::CONTENT_ATTRIBUTES {
        assert_eq!(attr(call, key), None, "{key} recorded without opt-in");
    }
    assert_eq!(call.status, Status::Unset);

    let attempts: Vec<&SpanData> = spans.iter().filter(|s| s.name == "POST").collect();
    assert_eq!(attempts.len(), 2);
    for a in &attempts {
        assert_eq!(
            a.parent_span_id,
            call.span_context.span_id(),
            "attempts are children of the call"
        );
        assert_eq!(a.span_kind, SpanKind::Client);
    }
    let first = attempts
        .iter()
        .find(|a| attr(a, names::ATTR_HTTP_RESEND_COUNT).is_none());
    let second = attempts
        .iter()
        .find(|a| attr(a, names::ATTR_HTTP_RESEND_COUNT) == Some(&Value::from(1_i64)));
    assert!(
        first.is_some_and(|a| matches!(a.status, Status::Error { .. })
            && attr(a, names::ATTR_HTTP_RESPONSE_STATUS_CODE) == Some(&Value::from(503_i64)))
    );
    assert!(second.is_some_and(|a| a.status == Status::Unset));

    for span in &spans {
        for key in names::COMMON_SPAN_ATTRIBUTES {
            if key == names::ATTR_MODEL_REVISION && span.name == "POST" {
                continue; // known only once the response arrived, on the call span
            }
            assert!(attr(span, key).is_some(), "{key} missing on {}", span.name);
        }
    }
    assert_eq!(
        exemplar.map(|t| t.0),
        Some(call.span_context.trace_id().to_bytes()),
        "the exemplar helper returns the exported trace id"
    );
    drop(c.provider);
    Ok(())
}

#[test]
fn tool_spans_and_remote_parents() -> Result<(), crate::Error> {
    let c = capture()?;
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    tracing::dispatcher::with_default(&c.dispatch, || {
        let span = tool_call(&JOIN, "payments", Some("call_1"), "http");
        assert!(set_remote_parent(&span, parent));
        assert!(!set_remote_parent(&span, "garbage"));
        finish_tool_call(
            &span,
            &ToolCallEnd {
                journal_state: Some("in_doubt"),
                attempts: 1,
                error_type: Some("timeout"),
                slo: Some(Outcome::Bad(Cause::Network)),
                ..ToolCallEnd::default()
            },
        );
    });
    let spans = c.spans();
    let tool = find(&spans, "execute_tool payments");
    assert_eq!(tool.span_kind, SpanKind::Internal);
    assert_eq!(
        tool.span_context.trace_id().to_string(),
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
    assert_eq!(tool.parent_span_id.to_string(), "00f067aa0ba902b7");
    assert_eq!(
        attr(tool, names::ATTR_OPERATION_NAME),
        Some(&Value::from("execute_tool"))
    );
    assert_eq!(
        attr(tool, names::ATTR_TOOL_NAME),
        Some(&Value::from("payments"))
    );
    assert_eq!(
        attr(tool, names::ATTR_TOOL_CALL_ID),
        Some(&Value::from("call_1"))
    );
    assert_eq!(
        attr(tool, names::ATTR_JOURNAL_STATE),
        Some(&Value::from("in_doubt"))
    );
    assert_eq!(
        attr(tool, names::ATTR_ERROR_TYPE),
        Some(&Value::from("timeout"))
    );
    assert_eq!(
        attr(tool, names::ATTR_SLO_CAUSE),
        Some(&Value::from("network"))
    );
    assert!(matches!(tool.status, Status::Error { .. }));
    Ok(())
}

#[test]
fn task_spans_keep_their_real_start_and_end() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let tracer = provider.tracer_with_scope(scope());
    let started = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let ended = started + Duration::from_secs(5400);
    emit_task_with(
        &tracer,
        &TaskSpan {
            task_id: "task-7",
            request_id: "01JREQ",
            started_at: started,
            ended_at: ended,
            outcome: "success",
            recovered: Some(true),
            faults: 1,
            model_calls: 4,
            tool_calls: 2,
            tokens_in: 100,
            tokens_out: 50,
            model_revision: Some("gpt-4o-2024-08-06"),
            policy_versions: Some("retry@4f1c2a"),
            gpu_id: None,
        },
    );
    let spans = exporter.get_finished_spans().unwrap_or_default();
    assert_eq!(spans.len(), 1);
    let task = &spans[0];
    assert_eq!(task.name, "invoke_agent outrigger-task");
    assert_eq!((task.start_time, task.end_time), (started, ended));
    assert_eq!(
        attr(task, names::ATTR_OPERATION_NAME),
        Some(&Value::from("invoke_agent"))
    );
    assert_eq!(
        attr(task, names::ATTR_TASK_ID),
        Some(&Value::from("task-7"))
    );
    assert_eq!(
        attr(task, names::ATTR_TASK_RECOVERED),
        Some(&Value::from(true))
    );
    assert_eq!(task.status, Status::Unset);
}

#[test]
fn without_an_otel_layer_there_is_no_trace_id() {
    let span = model_call(&JOIN, "chat", "openai", "gpt-4o", false);
    assert_eq!(trace_id(&span), None);
    assert_eq!(current_trace_id(), None);
}
