//! The OTLP/HTTP round trip: spans the sidecar emits reach a loopback collector with
//! the names, attributes and resource the constants promise.

use std::time::Duration;

use opentelemetry_proto::tonic::common::v1::any_value::Value;
use outrigger_telemetry::spans::{self, Join, ModelCallEnd, ToolCallEnd};
use outrigger_telemetry::{Metrics, OtlpOptions, TelemetryOptions, names};
use outrigger_testing::otlp::{Collector, attribute as value, text};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_loopback_collector() -> Result<(), Box<dyn std::error::Error>> {
    let mut collector = Collector::start().await?;
    let endpoint = collector.endpoint.clone();
    let metrics = Metrics::new();
    let options = TelemetryOptions {
        service_name: "outrigger-test".to_owned(),
        instance_id: "instance-1".to_owned(),
        otlp: Some(OtlpOptions {
            schedule_delay: Duration::from_millis(20),
            timeout: Duration::from_secs(5),
            ..OtlpOptions::new(endpoint)
        }),
        // Opted in here (and only in this test binary: the switch is process-wide).
        content: true,
        ..TelemetryOptions::default()
    };
    let (dispatch, guard) = outrigger_telemetry::dispatch(&options, &metrics)?;
    let join = Join {
        request_id: "01JREQ",
        task_id: Some("task-9"),
        policy_versions: Some("retry@4f1c2a"),
        gpu_id: Some("GPU-1"),
    };
    tracing::dispatcher::with_default(&dispatch, || {
        let call = spans::model_call(&join, names::OPERATION_CHAT, "anthropic", "claude-x", true);
        let attempt = spans::attempt(&call, &join, 1, "POST", "anthropic");
        spans::finish_attempt(&attempt, Some(200), None);
        drop(attempt);
        spans::record_content(&call, Some("hello"), Some("hi"));
        spans::finish_model_call(
            &call,
            &ModelCallEnd {
                response_model: Some("claude-x-2026"),
                tokens_in: Some(5),
                tokens_out: Some(7),
                attempts: 1,
                ..ModelCallEnd::default()
            },
        );
        drop(call);
        let tool = spans::tool_call(&join, "payments", None, "http");
        spans::finish_tool_call(
            &tool,
            &ToolCallEnd {
                journal_state: Some("completed"),
                attempts: 1,
                ..ToolCallEnd::default()
            },
        );
    });
    let flushing = tokio::task::spawn_blocking(move || {
        let flushed = guard.flush();
        (flushed, guard)
    });
    let (flushed, guard) = flushing.await?;
    flushed?;

    let mut spans = Vec::new();
    let mut resource_attributes = Vec::new();
    let mut scopes = Vec::new();
    while spans.len() < 3 {
        let (path, request) = collector
            .next(Duration::from_secs(10))
            .await
            .ok_or("no export within 10 s")?;
        assert_eq!(path, "/v1/traces");
        for rs in request.resource_spans {
            if let Some(r) = rs.resource {
                resource_attributes.extend(r.attributes);
            }
            for ss in rs.scope_spans {
                scopes.push((ss.scope.map(|s| s.name).unwrap_or_default(), ss.schema_url));
                spans.extend(ss.spans);
            }
        }
    }
    assert_eq!(
        value(&resource_attributes, names::RESOURCE_SERVICE_NAME),
        Some(&text("outrigger-test"))
    );
    assert_eq!(
        value(&resource_attributes, names::RESOURCE_SERVICE_INSTANCE_ID),
        Some(&text("instance-1"))
    );
    assert!(value(&resource_attributes, names::RESOURCE_SERVICE_VERSION).is_some());
    assert!(
        scopes
            .iter()
            .all(|(name, url)| name == names::SCOPE && url == names::SCHEMA_URL),
        "{scopes:?}"
    );

    let find = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .ok_or(format!("no span {name}"))
    };
    let call = find("chat claude-x")?;
    let attempt = find("POST")?;
    let tool = find("execute_tool payments")?;
    assert_eq!(attempt.parent_span_id, call.span_id);
    assert_eq!(
        value(&call.attributes, names::ATTR_PROVIDER_NAME),
        Some(&text("anthropic"))
    );
    assert_eq!(
        value(&call.attributes, names::ATTR_RESPONSE_MODEL),
        Some(&text("claude-x-2026"))
    );
    assert_eq!(
        value(&call.attributes, names::ATTR_USAGE_OUTPUT_TOKENS),
        Some(&Value::IntValue(7))
    );
    assert_eq!(
        value(&call.attributes, names::ATTR_INPUT_MESSAGES),
        Some(&text("hello"))
    );
    assert_eq!(
        value(&tool.attributes, names::ATTR_JOURNAL_STATE),
        Some(&text("completed"))
    );
    for span in [call, attempt, tool] {
        assert_eq!(
            value(&span.attributes, names::ATTR_REQUEST_ID),
            Some(&text("01JREQ")),
            "{}",
            span.name
        );
        assert_eq!(
            value(&span.attributes, names::ATTR_TASK_ID),
            Some(&text("task-9")),
            "{}",
            span.name
        );
        assert_eq!(
            value(&span.attributes, names::ATTR_GPU_ID),
            Some(&text("GPU-1")),
            "{}",
            span.name
        );
    }
    tokio::task::spawn_blocking(move || guard.shutdown()).await??;
    Ok(())
}
