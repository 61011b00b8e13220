//! Policies written in Python and JavaScript, deciding inside the running sidecar:
//! the Python budget policy downgrades and then refuses a task's calls, and the
//! JavaScript retry policy moves a context overflow to the long-context provider.
//!
//! The components are built by `examples/policies/build-all.sh DIR` (CI does, and sets
//! `OUTRIGGER_EXAMPLE_POLICIES=DIR`); without that variable these tests say they were
//! skipped and pass, unless `OUTRIGGER_REQUIRE_EXAMPLES=1` makes that a failure.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::StatusCode;
use outrigger_testing::provider::{Behaviour, MockProvider};
use serde_json::json;

use crate::support::*;

/// Compiling an 18 MB Python or 12 MB JavaScript component takes tens of seconds on
/// a loaded machine: both tests share one compiled-component cache, and start-up may
/// take this long the first time.
const COLD_START: Duration = Duration::from_secs(300);

fn cache(examples: &Path) -> String {
    let dir = examples.parent().unwrap_or(examples).join("compiled-cache");
    format!("[policies]\ncache_dir = {:?}\n", dir.display().to_string())
}

fn example(file: &str) -> Option<PathBuf> {
    let Some(dir) = std::env::var_os("OUTRIGGER_EXAMPLE_POLICIES").filter(|d| !d.is_empty()) else {
        assert!(
            std::env::var("OUTRIGGER_REQUIRE_EXAMPLES").as_deref() != Ok("1"),
            "OUTRIGGER_REQUIRE_EXAMPLES=1 but OUTRIGGER_EXAMPLE_POLICIES is not set"
        );
        let _ = writeln!(
            std::io::stderr(),
            "skipped: OUTRIGGER_EXAMPLE_POLICIES is not set (examples/policies/build-all.sh DIR builds them)"
        );
        return None;
    };
    let path = PathBuf::from(dir).join(file);
    assert!(path.exists(), "{} was not built", path.display());
    Some(path)
}

/// The binding's entry in `GET /v1/policies`.
async fn binding(sidecar: &Sidecar, hook: &str) -> serde_json::Value {
    let doc = get(&sidecar.admin_url("/v1/policies")).await.json();
    doc["bindings"]
        .as_array()
        .and_then(|b| b.iter().find(|b| b["hook"] == hook))
        .cloned()
        .unwrap_or_else(|| panic!("no {hook} binding: {doc}"))
}

#[tokio::test]
async fn the_python_budget_policy_downgrades_then_refuses_in_the_sidecar() {
    let Some(policy) = example("budget_py.wasm") else {
        return;
    };
    let mock = MockProvider::start(Behaviour::default())
        .await
        .expect("mock");
    let config = format!(
        r#"{}
[budget]
calls = 4
downgrade_models = ["cheap-model"]

[[providers]]
name = "mock"
kind = "openai"
base_url = "{base}"
models = ["gpt-mock"]
price_in = 10.0
price_out = 30.0

# A downgrade goes to a model that costs less than the one asked for.
[[providers]]
name = "mock-cheap"
kind = "openai"
base_url = "{base}"
models = ["cheap-model"]
price_in = 1.0
price_out = 3.0

[[policies.bindings]]
hook = "budget"
policy = {:?}
"#,
        cache(&policy),
        policy.display().to_string(),
        base = mock.openai_base(),
    );
    let sidecar = Sidecar::start_within(&config, &[], COLD_START).await;
    let bound = binding(&sidecar, "budget").await;
    assert!(
        bound["source"]
            .as_str()
            .is_some_and(|s| s.ends_with("budget_py.wasm")),
        "{bound}"
    );
    assert!(bound["version"].is_string(), "{bound}");

    let mut outcomes = Vec::new();
    for turn in 1..=5 {
        let r = post_json(
            &sidecar.url("/v1/chat/completions"),
            &[("outrigger-task-id", "py-budget")],
            &json!({"model": "gpt-mock", "messages": [{"role": "user", "content": format!("turn {turn}")}]}),
        )
        .await;
        let what = if r.status == StatusCode::OK {
            r.json()["model"].as_str().unwrap_or_default().to_string()
        } else {
            r.json()["detail"].as_str().unwrap_or_default().to_string()
        };
        outcomes.push((r.status.as_u16(), what));
    }
    // 1–3 are within 80 % of 4 calls; the 4th (100 %) is past 80 %, so it runs on the
    // cheaper model; the 5th is past 100 %: refused with the Python policy's reason.
    let statuses: Vec<u16> = outcomes.iter().map(|o| o.0).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 429], "{outcomes:?}");
    assert_eq!(outcomes[2].1, "gpt-mock");
    assert_eq!(outcomes[3].1, "cheap-model");
    assert!(
        outcomes[4].1.contains("5 of 4") && outcomes[4].1.contains("(125 %)"),
        "{outcomes:?}"
    );
    let bound = binding(&sidecar, "budget").await;
    assert!(bound["calls"].as_u64().unwrap_or(0) >= 5, "{bound}");
    assert_eq!(bound["traps"], 0, "{bound}");
}

#[tokio::test]
async fn the_javascript_retry_policy_moves_a_context_overflow_to_the_long_model() {
    let Some(policy) = example("retry_js.wasm") else {
        return;
    };
    let small = MockProvider::start(Behaviour {
        context_overflow: true,
        ..Behaviour::default()
    })
    .await
    .expect("small");
    let long = MockProvider::start(Behaviour::default())
        .await
        .expect("long");
    let config = format!(
        r#"{}
[[providers]]
name = "small"
kind = "openai"
base_url = "{}"
models = ["gpt-mock"]
fallbacks = ["long"]

[[providers]]
name = "long"
kind = "openai"
base_url = "{}"
models = ["long-model"]
default_model = "long-model"

[[policies.bindings]]
hook = "retry"
policy = {:?}
params = {{ long_context_target = "long" }}
"#,
        cache(&policy),
        small.openai_base(),
        long.openai_base(),
        policy.display().to_string()
    );
    let sidecar = Sidecar::start_within(&config, &[], COLD_START).await;
    let r = post_json(
        &sidecar.url("/v1/chat/completions"),
        &[],
        &json!({"model": "gpt-mock", "messages": [{"role": "user", "content": "a very long prompt"}]}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.header("outrigger-attempts"), Some("2"));
    assert_eq!(r.json()["model"], "long-model", "{}", r.text());
    assert_eq!(small.exchanges().len(), 1);
    assert_eq!(long.exchanges().len(), 1);
    let bound = binding(&sidecar, "retry").await;
    assert!(
        bound["source"]
            .as_str()
            .is_some_and(|s| s.ends_with("retry_js.wasm")),
        "{bound}"
    );
    assert!(bound["calls"].as_u64().unwrap_or(0) >= 1, "{bound}");
    assert_eq!(bound["contained"], 0, "{bound}");
}
