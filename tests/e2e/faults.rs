//! The sidecar's own fault injector: `[[faults]]` in config and `/v1/faults` at run
//! time, loud when on, and injected faults going through the real recovery paths.

use std::process::Command;

use http::StatusCode;
use outrigger_testing::provider::{Behaviour, MockProvider};
use outrigger_testing::tool::{MockTool, ToolBehaviour};
use serde_json::json;

use crate::support::*;

fn config(model: &str, tool: &str, faults: &str) -> String {
    format!(
        r#"
[[providers]]
name = "mock"
kind = "openai"
base_url = "{model}"
models = ["*"]

[[tools]]
name = "payments"
kind = "http"
base_url = "{tool}"
class = "unsafe"
timeout = "2s"

[policies]
seed = 7

[[policies.bindings]]
hook = "retry"
policy = "builtin:retry"
params = {{ max_attempts = "2", cap_ms = "50" }}
{faults}
"#
    )
}

fn chat(content: &str, stream: bool) -> serde_json::Value {
    json!({"model": "gpt-mock", "stream": stream,
           "messages": [{"role": "user", "content": content}]})
}

async fn set_faults(sidecar: &Sidecar, body: serde_json::Value) -> Reply {
    post_json(&sidecar.admin_url("/v1/faults"), &[], &body).await
}

#[tokio::test]
async fn configured_faults_are_loud_and_take_the_real_retry_path() {
    let model = MockProvider::start(Behaviour::default())
        .await
        .expect("provider");
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let faults = r#"
[[faults]]
provider = "mock"
kind = "rate_limit"
percent = 100
retry_after = "1s"
"#;
    let sidecar = Sidecar::start(&config(&model.openai_base(), &tool.url(), faults), &[]).await;
    assert!(
        sidecar.logs().contains("FAULT INJECTION ON"),
        "{}",
        sidecar.logs()
    );

    let r = post_json(
        &sidecar.url("/v1/chat/completions"),
        &[],
        &chat("hi", false),
    )
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.text());
    assert_eq!(r.header("outrigger-fault-injected"), Some("true"));
    assert!(r.header("retry-after").is_some());
    // Nothing reached the provider: the injector answered every attempt.
    assert!(model.exchanges().is_empty());

    let status = get(&sidecar.admin_url("/v1/faults")).await.json();
    let injected = status["faults"][0]["injected"].as_u64().unwrap_or(0);
    assert!(injected >= 1, "{status}");
    assert_eq!(status["faults"][0]["target"], "provider:mock");
    let metrics = get(&sidecar.admin_url("/metrics")).await.text();
    assert!(metrics.contains("outrigger_faults_active 1"), "{metrics}");
    assert!(
        metrics.contains(&format!(
            "outrigger_faults_injected_total{{target=\"provider:mock\",kind=\"rate_limit\"}} {injected}"
        )),
        "{metrics}"
    );

    // Turned off at run time: calls go through again.
    let off = set_faults(&sidecar, json!({"faults": []})).await;
    assert_eq!(off.status, StatusCode::OK, "{}", off.text());
    let r = post_json(
        &sidecar.url("/v1/chat/completions"),
        &[],
        &chat("again", false),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert!(
        get(&sidecar.admin_url("/metrics"))
            .await
            .text()
            .contains("outrigger_faults_active 0")
    );
}

#[tokio::test]
async fn runtime_faults_cut_streams_and_lose_tool_answers() {
    let model = MockProvider::start(Behaviour {
        chunks: 8,
        ..Behaviour::default()
    })
    .await
    .expect("provider");
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let sidecar = Sidecar::start(&config(&model.openai_base(), &tool.url(), ""), &[]).await;

    // A bad body changes nothing and names what to fix.
    let bad = set_faults(
        &sidecar,
        json!({"faults": [{"provider": "nope", "kind": "stream_cut", "percent": 100}]}),
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(bad.text().contains("faults[0].provider"), "{}", bad.text());
    assert!(
        bad.text().contains("faults[0].after_events"),
        "{}",
        bad.text()
    );
    assert_eq!(
        get(&sidecar.admin_url("/v1/faults")).await.json()["faults"],
        json!([])
    );

    // Stream cut after 2 events: the agent gets them and a typed error event, never
    // a silent truncation or a [DONE].
    let on = set_faults(
        &sidecar,
        json!({"faults": [{"provider": "mock", "kind": "stream_cut", "percent": 100, "after_events": 2}]}),
    )
    .await;
    assert_eq!(on.status, StatusCode::OK, "{}", on.text());
    let r = post_json(
        &sidecar.url("/v1/chat/completions"),
        &[],
        &chat("cut", true),
    )
    .await;
    let text = r.text();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    assert!(events.len() >= 2, "{text}");
    let last = events.last().copied().unwrap_or_default();
    assert!(last.contains("\"type\":\"stream_interrupted\""), "{text}");
    assert!(last.contains("fault injected"), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");

    // A tool's answer lost after its effect: the unsafe tool's call is in doubt and
    // parked for an operator; the retry with the same key does not run it again.
    let on = set_faults(
        &sidecar,
        json!({"faults": [{"tool": "payments", "kind": "tool_reset_after_effect", "percent": 100}]}),
    )
    .await;
    assert_eq!(on.status, StatusCode::OK, "{}", on.text());
    let call = || async {
        post_json(
            &sidecar.url("/tools/payments/charge"),
            &[("idempotency-key", "pay-1")],
            &json!({"amount": 5}),
        )
        .await
    };
    let first = call().await;
    assert!(
        first.status.is_server_error(),
        "{} {}",
        first.status,
        first.text()
    );
    assert_eq!(tool.effects().len(), 1);
    set_faults(&sidecar, json!({"faults": []})).await;
    let retry = call().await;
    assert!(!retry.status.is_success(), "{}", retry.text());
    assert_eq!(
        tool.effects().len(),
        1,
        "the retry must not repeat the effect"
    );
    let record = get(&sidecar.admin_url("/v1/journal")).await.json();
    assert!(record.to_string().contains("needs_operator"), "{record}");
}

#[test]
fn a_bad_fault_in_config_is_refused_with_its_path() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("outrigger.toml");
    std::fs::write(
        &path,
        r#"
[[providers]]
name = "mock"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
models = ["*"]

[[faults]]
provider = "mock"
kind = "tool_timeout"
percent = 150
"#,
    )
    .expect("write");
    let out = Command::new(outrigger_bin())
        .args(["config", "check", "--config"])
        .arg(&path)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("faults[0].kind"), "{stderr}");
    assert!(stderr.contains("faults[0].percent"), "{stderr}");
}
