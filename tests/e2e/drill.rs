//! `outrigger drill` end to end: the real binary drives its own sidecar child
//! against an in-process mock provider and mock tools, and writes one record per
//! scenario; a config with a remote upstream is refused before anything starts.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outrigger_testing::provider::{Behaviour, MockProvider};
use outrigger_testing::tool::{MockTool, ToolBehaviour};
use serde_json::Value;

use crate::support::outrigger_bin;

const SCENARIOS: [&str; 8] = [
    "rate_limit_storm",
    "stream_cut_text",
    "stream_cut_tool_call",
    "tool_reset_after_effect",
    "policy_hot_swap",
    "gpu_unhealthy",
    "journal_write_failure",
    "sidecar_restart",
];

/// The stub NVML library cargo built next to the test binary.
fn nvml_stub() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary");
    let deps = exe.parent().expect("deps dir");
    [deps.join("liboutrigger_nvml_stub.so")]
        .into_iter()
        .chain(deps.parent().map(|p| p.join("liboutrigger_nvml_stub.so")))
        .find(|p| p.exists())
        .expect("the stub library is built next to the test binary")
}

/// A provider and two HTTP tools of different classes: `payments` (unsafe: an
/// in-doubt call waits for an operator) and `ledger` (keyed: it deduplicates by
/// `Idempotency-Key`, so in-doubt calls are re-sent).
fn config(model: &str, payments: &str, ledger: &str) -> String {
    format!(
        r#"
[[providers]]
name = "mock"
kind = "openai"
base_url = "{model}"
models = ["gpt-mock"]

[[tools]]
name = "payments"
kind = "http"
base_url = "{payments}"
class = "unsafe"
timeout = "2s"

[[tools]]
name = "ledger"
kind = "http"
base_url = "{ledger}"
class = "keyed"
timeout = "2s"
"#
    )
}

/// Runs `outrigger drill` off the async runtime (the mocks live on it).
async fn drill(args: Vec<String>) -> std::process::Output {
    let bin = outrigger_bin().to_path_buf();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(bin)
            .arg("drill")
            .args(args)
            .env_remove("OPENAI_API_KEY")
            .env_remove("ANTHROPIC_API_KEY")
            .output()
            .expect("run outrigger drill")
    })
    .await
    .expect("join")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()))
}

/// The mocks a drill runs against: a model, an unsafe payments tool and a ledger
/// tool that dedupes by key.
async fn mocks() -> (MockProvider, MockTool, MockTool) {
    let model = MockProvider::start(Behaviour::default())
        .await
        .expect("provider");
    let payments = MockTool::start(ToolBehaviour::default())
        .await
        .expect("payments tool");
    let ledger = MockTool::start(ToolBehaviour {
        dedupe: true,
        ..ToolBehaviour::default()
    })
    .await
    .expect("ledger tool");
    (model, payments, ledger)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_scenario_passes_against_mocks_and_leaves_a_record() {
    let (model, payments, ledger) = mocks().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let config_path = dir.path().join("outrigger.toml");
    std::fs::write(
        &config_path,
        config(&model.openai_base(), &payments.url(), &ledger.url()),
    )
    .expect("write config");
    let out = dir.path().join("records");
    // Build the binary first: the time limit is the drill's, not cargo's.
    tokio::task::spawn_blocking(outrigger_bin)
        .await
        .expect("the outrigger binary");

    let started = Instant::now();
    let run = drill(vec![
        "--scenario".into(),
        "all".into(),
        "--config".into(),
        config_path.display().to_string(),
        "--out".into(),
        out.display().to_string(),
        "--nvml-stub".into(),
        nvml_stub().display().to_string(),
    ])
    .await;
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&run.stderr);
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap_or_default();
    assert_eq!(
        run.status.code(),
        Some(0),
        "drill failed:\n{stderr}\n{summary}"
    );
    // About 8 s on an idle 2-core machine; the bound catches a drill that hangs,
    // with room for a machine loaded by the rest of the suite.
    assert!(
        took < Duration::from_secs(120),
        "the whole drill took {took:?}"
    );

    for name in SCENARIOS {
        let record = read_json(&out.join(format!("{name}.json")));
        assert_eq!(record["scenario"], name);
        assert_eq!(record["verdict"], "pass", "{name}: {record:#}");
        assert_eq!(record["violations"], serde_json::json!([]), "{name}");
        assert!(record["drill_id"].as_str().is_some_and(|id| !id.is_empty()));
        assert!(record["build"]["service.version"].is_string(), "{name}");
        assert_eq!(
            record["build"]["config.hash"].as_str().map(str::len),
            Some(64),
            "{name}: {}",
            record["build"]
        );
        let consistency = &record["consistency"];
        assert_eq!(consistency["duplicated"], 0, "{name}: {consistency}");
        assert_eq!(consistency["lost"], 0, "{name}: {consistency}");
        let injected = record["t_fault_injected_ms"].as_u64().expect("injected");
        let detected = record["t_detected_ms"].as_u64().expect("detected");
        let recovered = record["t_recovered_ms"].as_u64().expect("recovered");
        assert!(injected <= detected, "{name}: {injected} > {detected}");
        assert!(detected <= recovered, "{name}: {detected} > {recovered}");
        // A policy swap is a change, not a fault: there is nothing to remove.
        if let Some(removed) = record["t_fault_removed_ms"].as_u64() {
            assert!(injected <= removed, "{name}: {injected} > {removed}");
            assert!(removed <= recovered, "{name}: {removed} > {recovered}");
        } else {
            assert_eq!(name, "policy_hot_swap", "{name}: no t_fault_removed_ms");
        }
        let recovery_s = record["derived"]["recovery_time_s"]
            .as_f64()
            .expect("recovery");
        assert!((0.0..30.0).contains(&recovery_s), "{name}: {recovery_s}");
        assert!(record["detection_source"].is_string(), "{name}");
        assert!(record["recovery_definition"].is_string(), "{name}");
        assert!(record["error_budget"]["slos"].is_array(), "{name}");
        // Every request in flight at the fault is accounted for.
        let at_fault: u64 = ["llm_streams", "llm_calls", "tool_calls"]
            .iter()
            .map(|k| record["inflight_at_fault"][k].as_u64().expect("count"))
            .sum();
        let outcomes = &record["inflight_outcomes"];
        let accounted: u64 = [
            "completed",
            "failed_to_client",
            "retried_safely",
            "resumed_after_restart",
            "in_doubt",
        ]
        .iter()
        .map(|k| outcomes[k].as_u64().expect("count"))
        .sum();
        assert_eq!(at_fault, accounted, "{name}: {outcomes}");
        // What each scenario must hold in flight when its fault strikes.
        let inflight = &record["inflight_at_fault"];
        match name {
            "sidecar_restart" => {
                assert_eq!(inflight["llm_streams"], 2, "{name}: {inflight}");
                assert_eq!(inflight["tool_calls"], 2, "{name}: {inflight}");
            }
            "journal_write_failure" => {
                assert!(
                    inflight["llm_streams"].as_u64() > Some(0),
                    "{name}: {inflight}"
                )
            }
            "stream_cut_text" | "stream_cut_tool_call" => {
                assert_eq!(inflight["llm_streams"], 4, "{name}: {inflight}")
            }
            _ => {}
        }
        assert_eq!(outcomes["duplicated_effects"], 0, "{name}");
        for check in record["negative_checks"].as_array().expect("checks") {
            if check["required"] == true {
                assert_eq!(check["observed"], check["expected"], "{name}: {check}");
            }
        }
        let md = std::fs::read_to_string(out.join(format!("{name}.md"))).expect("markdown");
        assert!(md.contains(name), "{name}.md:\n{md}");
        assert!(summary.contains(name), "summary:\n{summary}");
    }

    // Across the run, every effect the tools applied happened once per key.
    for (tool, effects) in [
        ("payments", payments.effects_by_key()),
        ("ledger", ledger.effects_by_key()),
    ] {
        for (key, n) in effects {
            assert_eq!(n, 1, "{tool}: key {key:?} took effect {n} times");
        }
    }
}

#[tokio::test]
async fn a_remote_upstream_is_refused_without_allow_remote() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config_path = dir.path().join("outrigger.toml");
    std::fs::write(
        &config_path,
        config(
            "https://api.openai.com/v1",
            "http://127.0.0.1:9",
            "http://10.1.2.3:8080",
        ),
    )
    .expect("write config");
    let out = dir.path().join("records");
    let run = drill(vec![
        "--scenario".into(),
        "stream_cut_text".into(),
        "--config".into(),
        config_path.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not loopback"), "{stderr}");
    assert!(stderr.contains("api.openai.com"), "{stderr}");
    assert!(stderr.contains("10.1.2.3"), "{stderr}");
    assert!(stderr.contains("--allow-remote"), "{stderr}");
    assert!(
        !out.join("stream_cut_text.json").exists(),
        "nothing may run against a refused config"
    );
}

#[tokio::test]
async fn a_config_without_a_tool_is_refused_with_what_is_missing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config_path = dir.path().join("outrigger.toml");
    std::fs::write(
        &config_path,
        "[[providers]]\nname = \"mock\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodels = [\"gpt-mock\"]\n",
    )
    .expect("write config");
    let run = drill(vec![
        "--config".into(),
        config_path.display().to_string(),
        "--out".into(),
        dir.path().join("records").display().to_string(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no HTTP tool"), "{stderr}");
}

#[tokio::test]
async fn an_unknown_scenario_is_a_usage_error() {
    let run = drill(vec!["--scenario".into(), "meteor_strike".into()]).await;
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("meteor_strike"), "{stderr}");
}

/// A tool declared `keyed` that ignores `Idempotency-Key` applies a re-sent call
/// twice: the drill must catch the second application and fail the scenario.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_tool_that_ignores_the_key_fails_the_tool_reset_drill() {
    let model = MockProvider::start(Behaviour::default())
        .await
        .expect("provider");
    let payments = MockTool::start(ToolBehaviour::default())
        .await
        .expect("payments tool");
    let careless = MockTool::start(ToolBehaviour::default())
        .await
        .expect("ledger tool without deduplication");
    let dir = tempfile::tempdir().expect("temp dir");
    let config_path = dir.path().join("outrigger.toml");
    std::fs::write(
        &config_path,
        config(&model.openai_base(), &payments.url(), &careless.url()),
    )
    .expect("write config");
    let out = dir.path().join("records");
    let run = drill(vec![
        "--scenario".into(),
        "tool_reset_after_effect".into(),
        "--config".into(),
        config_path.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    let record = read_json(&out.join("tool_reset_after_effect.json"));
    assert_eq!(record["verdict"], "fail", "{record:#}");
    let keyed = &record["consistency"]["by_class"]["keyed"];
    assert!(keyed["duplicated"].as_u64() > Some(0), "{keyed}");
    assert_eq!(record["consistency"]["by_class"]["unsafe"]["duplicated"], 0);
    let violations = record["violations"].to_string();
    assert!(violations.contains("applied again"), "{violations}");
    assert!(
        careless.effects_by_key().values().any(|n| *n > 1),
        "the mock tool itself saw a key applied twice"
    );
    let summary = std::fs::read_to_string(out.join("summary.md")).expect("summary");
    assert!(summary.contains("fail"), "{summary}");
}

/// A tool whose status endpoint cannot say whether a key took effect: the drill
/// still judges it from the journal, and says in the record which checks it could
/// not make rather than passing silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_that_cannot_report_its_effects_is_a_stated_skip() {
    let (model, payments, ledger) = mocks().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let config_path = dir.path().join("outrigger.toml");
    let text = config(&model.openai_base(), &payments.url(), &ledger.url()).replace(
        "class = \"keyed\"",
        "class = \"keyed\"\nprobe_path = \"/no-status-here/{key}\"",
    );
    std::fs::write(&config_path, text).expect("write config");
    let out = dir.path().join("records");
    let run = drill(vec![
        "--scenario".into(),
        "tool_reset_after_effect".into(),
        "--config".into(),
        config_path.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    let record = read_json(&out.join("tool_reset_after_effect.json"));
    assert_eq!(record["verdict"], "pass", "{record:#}");
    let skipped = record["skipped_checks"].to_string();
    assert!(
        skipped.contains("tool ledger") && skipped.contains("/no-status-here/{key}"),
        "{record:#}"
    );
    assert!(
        !skipped.contains("tool payments"),
        "payments reports its effects: {skipped}"
    );
    let md = std::fs::read_to_string(out.join("tool_reset_after_effect.md")).expect("markdown");
    assert!(md.contains("## Checks not made"), "{md}");
    let summary = std::fs::read_to_string(out.join("summary.md")).expect("summary");
    assert!(summary.contains("check(s) not made"), "{summary}");
}
