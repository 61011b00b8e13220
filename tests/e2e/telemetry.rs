//! Tasks, telemetry and SLOs through the running binary: a task's calls tracked and
//! ended with a recovery verdict, spans exported to a loopback OTLP collector, the
//! Prometheus exposition with exemplars, `GET /v1/slo`, tasks surviving a restart,
//! and SLO declarations that miss a part refused.

use std::process::Command;
use std::time::Duration;

use http::StatusCode;
use outrigger_testing::otlp::{AttributeValue, Collector, attribute, text};
use outrigger_testing::provider::{Behaviour, MockProvider};
use outrigger_testing::tool::{MockTool, ToolBehaviour};
use serde_json::{Value, json};

use crate::support::*;

const SLOS: &str = r#"
[[slos]]
name = "llm-availability"
object = "model_calls"
metric = "availability"
target = 0.99
window = "1d"
exclusions = ["invalid_client", "client_cancelled"]
data_source = "prometheus:outrigger_slo_events_total"

[[slos]]
name = "tools"
object = "tool_calls"
metric = "tool_success"
target = 0.99
window = "1d"
exclusions = []
data_source = "prometheus:outrigger_slo_events_total"
"#;

fn config(model: &str, tool: &str, extra: &str) -> String {
    format!(
        r#"
[[providers]]
name = "mock"
kind = "openai"
base_url = "{model}"
models = ["*"]
price_in = 2.5
price_out = 10.0

[[tools]]
name = "payments"
kind = "http"
base_url = "{tool}"
class = "unsafe"
timeout = "2s"
{SLOS}
{extra}
"#
    )
}

fn chat(content: &str, stream: bool) -> Value {
    json!({"model": "gpt-mock", "stream": stream,
           "messages": [{"role": "user", "content": content}]})
}

async fn model_call(sidecar: &Sidecar, task: &str, content: &str, stream: bool) -> Reply {
    post_json(
        &sidecar.url("/v1/chat/completions"),
        &[("outrigger-task-id", task)],
        &chat(content, stream),
    )
    .await
}

async fn charge(sidecar: &Sidecar, task: &str, key: &str, amount: u32) -> Reply {
    post_json(
        &sidecar.url("/tools/payments/charge"),
        &[("outrigger-task-id", task), ("idempotency-key", key)],
        &json!({"amount": amount}),
    )
    .await
}

async fn end(sidecar: &Sidecar, task: &str, outcome: &str) -> Reply {
    post_json(
        &sidecar.admin_url(&format!("/v1/tasks/{task}/end")),
        &[],
        &json!({"outcome": outcome}),
    )
    .await
}

#[tokio::test]
async fn a_task_is_tracked_traced_and_counted() {
    let model = MockProvider::start(Behaviour::default())
        .await
        .expect("provider");
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let mut collector = Collector::start().await.expect("collector");
    let telemetry = format!(
        "[telemetry]\notlp_endpoint = {:?}\nservice_name = \"outrigger-e2e\"\n\
         [budget]\ncalls = 100\n",
        collector.endpoint
    );
    let mut sidecar =
        Sidecar::start(&config(&model.openai_base(), &tool.url(), &telemetry), &[]).await;
    let task = "t-obs";

    // Plan, act (streamed), charge, a retry of the charge (replayed), summarize.
    assert_eq!(
        model_call(&sidecar, task, "plan", false).await.status,
        StatusCode::OK
    );
    let streamed = model_call(&sidecar, task, "act", true).await;
    assert!(
        streamed.text().ends_with("data: [DONE]\n\n"),
        "{}",
        streamed.text()
    );
    let first = charge(&sidecar, task, "charge-1", 10).await;
    assert!(first.status.is_success(), "{}", first.text());
    let retry = charge(&sidecar, task, "charge-1", 10).await;
    assert_eq!(retry.header("outrigger-replayed"), Some("true"));
    assert_eq!(tool.effects().len(), 1);
    assert_eq!(
        model_call(&sidecar, task, "summarize", false).await.status,
        StatusCode::OK
    );

    // The task while it runs.
    let list = get(&sidecar.admin_url("/v1/tasks")).await.json();
    let summary = list["tasks"]
        .as_array()
        .and_then(|tasks| tasks.iter().find(|t| t["id"] == task))
        .unwrap_or_else(|| panic!("{task} not listed: {list}"))
        .clone();
    assert_eq!(summary["model_calls"], 3, "{summary}");
    assert_eq!(summary["tool_calls"], 2, "{summary}");
    assert_eq!(summary["replays"], 1, "{summary}");
    assert!(summary["ended_at"].is_null());
    assert!(summary["tokens_in"].as_u64().unwrap_or(0) > 0, "{summary}");
    assert!(
        summary["cost_micros"].as_u64().unwrap_or(0) > 0,
        "{summary}"
    );

    // Bad requests name what to fix; nothing changes.
    let bad = end(&sidecar, task, "done").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(bad.text().contains("success"), "{}", bad.text());
    assert_eq!(
        end(&sidecar, "t-unknown", "success").await.status,
        StatusCode::NOT_FOUND
    );

    // Ending it: the replay run was a fault (the agent repeated itself), the fresh
    // call after it was progress, and the journal shows each side effect once.
    let ended = end(&sidecar, task, "success").await;
    assert_eq!(ended.status, StatusCode::OK, "{}", ended.text());
    let report = ended.json();
    assert_eq!(report["outcome"], "success");
    // What the budget charged (kept for a restart): each model call once, at least
    // what the provider reported.
    assert_eq!(report["charged"]["calls"], 3, "{report}");
    assert!(
        report["charged"]["tokens_in"].as_u64() >= report["tokens_in"].as_u64(),
        "{report}"
    );
    assert_eq!(report["faults"]["agent_replays"], 1, "{report}");
    assert_eq!(report["recovery"]["succeeded"], true, "{report}");
    assert_eq!(
        report["recovery"]["side_effects"]["duplicated"],
        json!([]),
        "{report}"
    );
    let timeline = report["timeline"].as_array().expect("timeline");
    assert_eq!(
        timeline.first().map(|e| &e["event"]),
        Some(&json!("started")),
        "{report}"
    );
    assert!(
        timeline.iter().any(|e| e["event"] == "recovered"),
        "{report}"
    );
    assert_eq!(
        report["journal"].as_array().map(Vec::len),
        Some(1),
        "{report}"
    );

    // SLOs: every call so far was good.
    let slo = get(&sidecar.admin_url("/v1/slo")).await.json();
    let find = |name: &str| {
        slo["slos"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["name"] == name))
            .unwrap_or_else(|| panic!("no SLO {name}: {slo}"))
            .clone()
    };
    let availability = find("llm-availability");
    assert!(
        availability["good"].as_u64().unwrap_or(0) >= 3,
        "{availability}"
    );
    assert_eq!(availability["bad"], 0, "{availability}");
    assert_eq!(availability["budget_left_fraction"], 1.0, "{availability}");
    assert_eq!(find("tools")["good"], 2, "{slo}");

    // Prometheus: GenAI metrics with trace-id exemplars, journal states, the task.
    let metrics = get(&sidecar.admin_url("/metrics")).await;
    let text_metrics = metrics.text();
    assert!(
        metrics
            .header("content-type")
            .is_some_and(|c| c.starts_with("application/openmetrics-text")),
        "{:?}",
        metrics.headers
    );
    for needle in [
        "gen_ai_client_operation_duration_seconds_bucket{",
        "gen_ai_client_token_usage_bucket{",
        "gen_ai_execute_tool_duration_seconds_bucket{",
        "outrigger_journal_records{state=\"completed\"} 1",
        "outrigger_replays_total{kind=\"tool\"} 1",
        "outrigger_task_recoveries_total{result=\"success\"} 1",
        "outrigger_slo_objective{slo=\"llm-availability\"} 0.99",
        "# {trace_id=\"",
    ] {
        assert!(
            text_metrics.contains(needle),
            "no {needle} in:\n{text_metrics}"
        );
    }
    assert!(text_metrics.trim_end().ends_with("# EOF"));

    // Spans reach the collector (flushed at the latest on shutdown).
    sidecar.sigterm();
    assert!(sidecar.wait_exit(Duration::from_secs(30)).await.success());
    let spans = collector
        .spans_until(Duration::from_secs(20), |spans| {
            spans.iter().filter(|s| s.name == "chat gpt-mock").count() >= 3
                && spans.iter().any(|s| s.name == "execute_tool payments")
                && spans.iter().any(|s| s.name.starts_with("invoke_agent"))
        })
        .await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let chats: Vec<_> = spans.iter().filter(|s| s.name == "chat gpt-mock").collect();
    assert!(chats.len() >= 3, "{names:?}");
    for span in &chats {
        assert_eq!(
            attribute(&span.attributes, "outrigger.task.id"),
            Some(&text(task)),
            "{names:?}"
        );
        assert!(attribute(&span.attributes, "outrigger.request.id").is_some());
        assert_eq!(
            attribute(&span.attributes, "gen_ai.request.model"),
            Some(&text("gpt-mock"))
        );
    }
    // Retries are attempts: each logical call has at least one child attempt span.
    assert!(
        chats
            .iter()
            .all(|c| spans.iter().any(|s| s.parent_span_id == c.span_id)),
        "{names:?}"
    );
    let tools: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "execute_tool payments")
        .collect();
    assert_eq!(tools.len(), 2, "{names:?}");
    assert!(
        tools
            .iter()
            .any(|s| attribute(&s.attributes, "outrigger.replayed")
                == Some(&outrigger_testing::otlp::AttributeValue::BoolValue(true))),
        "{names:?}"
    );
    let agent = spans
        .iter()
        .find(|s| s.name.starts_with("invoke_agent"))
        .expect("invoke_agent span");
    assert_eq!(
        attribute(&agent.attributes, "outrigger.task.outcome"),
        Some(&text("success"))
    );
    // The task span names the policy versions that decided its calls (a budget is
    // set, so the budget policy admits each).
    let versions = attribute(&agent.attributes, "outrigger.policy.versions");
    assert!(
        matches!(versions, Some(AttributeValue::StringValue(v)) if v.contains("budget@")),
        "{versions:?}"
    );
}

#[tokio::test]
async fn tasks_survive_a_restart_and_recovery_is_judged_on_the_journal() {
    let model = MockProvider::start(Behaviour::default())
        .await
        .expect("provider");
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let mut sidecar = Sidecar::start(&config(&model.openai_base(), &tool.url(), ""), &[]).await;

    // Two tasks in flight when the sidecar restarts.
    assert_eq!(
        model_call(&sidecar, "t-clean", "one", false).await.status,
        StatusCode::OK
    );
    assert!(
        charge(&sidecar, "t-dup", "order-a", 25)
            .await
            .status
            .is_success()
    );
    sidecar.sigterm();
    assert!(sidecar.wait_exit(Duration::from_secs(30)).await.success());
    sidecar.spawn().await;

    // Both come back, each charged a sidecar_restart fault.
    for task in ["t-clean", "t-dup"] {
        let t = get(&sidecar.admin_url(&format!("/v1/tasks/{task}"))).await;
        assert_eq!(t.status, StatusCode::OK, "{}", t.text());
        assert_eq!(t.json()["faults"]["sidecar_restarts"], 1, "{}", t.text());
    }

    // t-clean goes on and finishes: recovered.
    assert_eq!(
        model_call(&sidecar, "t-clean", "two", false).await.status,
        StatusCode::OK
    );
    let clean = end(&sidecar, "t-clean", "success").await.json();
    assert_eq!(clean["recovery"]["succeeded"], true, "{clean}");
    assert_eq!(clean["model_calls"], 2, "{clean}");

    // t-dup charges the same order again under a new key: the effect happened twice.
    assert!(
        charge(&sidecar, "t-dup", "order-b", 25)
            .await
            .status
            .is_success()
    );
    assert_eq!(tool.effects().len(), 2);
    let dup = end(&sidecar, "t-dup", "success").await.json();
    assert_eq!(dup["recovery"]["succeeded"], false, "{dup}");
    let duplicated = &dup["recovery"]["side_effects"]["duplicated"];
    assert_eq!(duplicated.as_array().map(Vec::len), Some(1), "{dup}");
    assert!(
        dup["recovery"]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("duplicat"),
        "{dup}"
    );

    // Ended tasks are still there after another restart, ended.
    sidecar.sigterm();
    assert!(sidecar.wait_exit(Duration::from_secs(30)).await.success());
    sidecar.spawn().await;
    let t = get(&sidecar.admin_url("/v1/tasks/t-dup")).await.json();
    assert_eq!(t["outcome"], "success", "{t}");
    assert_eq!(t["faults"]["sidecar_restarts"], 1, "{t}");
    let metrics = get(&sidecar.admin_url("/metrics")).await.text();
    assert!(
        metrics.contains("outrigger_journal_records{state=\"completed\"} 2"),
        "{metrics}"
    );
}

/// A declared maintenance window (`POST /v1/slo/maintenance`) and synthetic calls
/// (`Outrigger-Synthetic: true`) are left out of the SLOs that exclude them; a window
/// is open until its end or until it is closed, and bad requests say what to send.
#[tokio::test]
async fn maintenance_windows_and_synthetic_calls_are_left_out_of_the_slos() {
    let model = MockProvider::start(Behaviour::default())
        .await
        .expect("provider");
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let extra = r#"
[[slos]]
name = "tools-declared"
object = "tool_calls"
metric = "availability"
target = 0.99
window = "1d"
exclusions = ["maintenance", "synthetic"]
data_source = "prometheus:outrigger_slo_events_total"
"#;
    let sidecar = Sidecar::start(&config(&model.openai_base(), &tool.url(), extra), &[]).await;
    let busy = async |key: &str, extra: &[(&str, &str)]| {
        let mut h = vec![("idempotency-key", key), ("x-mock-tool", "status=429")];
        h.extend_from_slice(extra);
        post_json(
            &sidecar.url("/tools/payments/charge"),
            &h,
            &json!({"n": key}),
        )
        .await
    };
    let maintenance =
        async |body: Value| post_json(&sidecar.admin_url("/v1/slo/maintenance"), &[], &body).await;

    let r = busy("s1", &[("outrigger-synthetic", "true")]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.text());
    let r = busy("s2", &[("outrigger-synthetic", "maybe")]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    assert!(r.text().contains("Outrigger-Synthetic"), "{}", r.text());

    let r = maintenance(json!({"open": true, "for": "1h"})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.json()["open"], true, "{}", r.text());
    assert!(r.json()["until"].is_string(), "{}", r.text());
    let slo = get(&sidecar.admin_url("/v1/slo")).await.json();
    assert_eq!(slo["maintenance"]["open"], true, "{slo}");
    assert_eq!(busy("m1", &[]).await.status, StatusCode::TOO_MANY_REQUESTS);

    for (bad, says) in [
        (json!({"open": true, "for": "soon"}), "not a duration"),
        (json!({"open": false, "for": "1h"}), "only goes with"),
        (json!({"open": "yes"}), "open"),
    ] {
        let r = maintenance(bad.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {}", r.text());
        assert!(r.text().contains(says), "{bad}: {}", r.text());
    }
    let r = get(&sidecar.admin_url("/v1/slo/maintenance")).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{}", r.text());

    let r = maintenance(json!({"open": false})).await;
    assert_eq!(
        r.json(),
        json!({"open": false, "until": null}),
        "{}",
        r.text()
    );
    assert_eq!(busy("b1", &[]).await.status, StatusCode::TOO_MANY_REQUESTS);

    let slo = get(&sidecar.admin_url("/v1/slo")).await.json();
    let declared = slo["slos"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["name"] == "tools-declared"))
        .unwrap_or_else(|| panic!("no SLO tools-declared: {slo}"));
    assert_eq!(declared["bad"], 1, "{declared}");
    assert_eq!(declared["excluded_by_reason"]["synthetic"], 1, "{declared}");
    assert_eq!(
        declared["excluded_by_reason"]["maintenance"], 1,
        "{declared}"
    );
}

#[test]
fn an_slo_missing_a_part_is_refused_naming_the_part() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("outrigger.toml");
    std::fs::write(
        &path,
        r#"
[[slos]]
name = "half-done"
object = "model_calls"
metric = "availability"
exclusions = []
data_source = "prometheus:outrigger_slo_events_total"

[[slos]]
name = "typo"
object = "model_calls"
metric = "availabilty"
target = 1.5
window = "28d"
exclusions = ["client_cancelled"]
data_source = "prometheus:outrigger_slo_events_total"
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
    for part in [
        "slos[0].target",
        "slos[0].window",
        "slos[1].metric",
        "slos[1].target",
    ] {
        assert!(stderr.contains(part), "no {part} in:\n{stderr}");
    }
    // The same config also refuses to serve.
    let serve = Command::new(outrigger_bin())
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .expect("runs");
    assert_eq!(serve.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&serve.stderr).contains("slos[0].target"));
}
