//! Policies in the running sidecar: the built-ins steer retries and fallbacks, a
//! budget cuts a task off, a policy in the policy directory is hot-swapped without
//! losing a request, a bad version never replaces a good one, and the CLI checks and
//! tests components.

use std::time::{Duration, Instant};

use http::StatusCode;
use outrigger_testing::provider::{Behaviour, MockProvider};
use serde_json::json;

use crate::support::*;

fn chat(model: &str) -> serde_json::Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
}

/// A copy of a component with a custom section appended: the same behaviour under a
/// different content hash (so a new version).
fn variant(bytes: &[u8], tag: &str) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        }
    }
    let name = b"outrigger-test";
    let mut payload = Vec::new();
    leb(name.len(), &mut payload);
    payload.extend_from_slice(name);
    payload.extend_from_slice(tag.as_bytes());
    let mut out = bytes.to_vec();
    out.push(0);
    leb(payload.len(), &mut out);
    out.extend_from_slice(&payload);
    out
}

/// A sidecar whose provider `primary` (model `gpt-mock`) falls back to `backup`
/// (its own model, `gpt-backup`), each a mock; `head` is the configuration before
/// them, `primary` and `backup` more lines for each.
async fn with_a_backup(
    head: &str,
    primary: &str,
    backup: &str,
) -> (MockProvider, MockProvider, Sidecar) {
    let primary_mock = MockProvider::start(Behaviour::default())
        .await
        .expect("mock");
    let backup_mock = MockProvider::start(Behaviour::default())
        .await
        .expect("mock");
    let config = format!(
        r#"
{head}

[[providers]]
name = "primary"
kind = "openai"
base_url = "{}"
models = ["gpt-mock"]
fallbacks = ["backup"]
{primary}

[[providers]]
name = "backup"
kind = "openai"
base_url = "{}"
models = ["gpt-backup"]
default_model = "gpt-backup"
{backup}
"#,
        primary_mock.openai_base(),
        backup_mock.openai_base()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    (primary_mock, backup_mock, sidecar)
}

#[tokio::test]
async fn retries_and_fallbacks_are_invisible_to_the_agent() {
    let (primary, backup, sidecar) = with_a_backup("[policies]\nseed = 7", "", "").await;

    // 503 then 200: retried, the agent sees only the success.
    primary.push(Behaviour {
        status: Some(503),
        ..Behaviour::default()
    });
    let r = post_json(&sidecar.url("/v1/chat/completions"), &[], &chat("gpt-mock")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(primary.exchanges().len(), 2);

    // 429 with Retry-After: 1 is honoured.
    primary.push(Behaviour {
        status: Some(429),
        retry_after: Some(1),
        ..Behaviour::default()
    });
    let started = Instant::now();
    let r = post_json(&sidecar.url("/v1/chat/completions"), &[], &chat("gpt-mock")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        started.elapsed() >= Duration::from_millis(950),
        "waited {:?}",
        started.elapsed()
    );

    // A context overflow falls back to the backup with its own model.
    primary.push(Behaviour {
        context_overflow: true,
        ..Behaviour::default()
    });
    let r = post_json(&sidecar.url("/v1/chat/completions"), &[], &chat("gpt-mock")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.json()["model"], "gpt-backup");
    let sent: serde_json::Value = serde_json::from_slice(&backup.exchanges()[0].body).unwrap();
    assert_eq!(
        sent["model"], "gpt-backup",
        "the fallback gets its default model"
    );

    // A streamed call whose first attempt breaks before any event is retried invisibly.
    primary.push(Behaviour {
        cut_after: Some(0),
        ..Behaviour::default()
    });
    let r = post_json(
        &sidecar.url("/v1/chat/completions"),
        &[],
        &json!({"model": "gpt-mock", "stream": true, "messages": []}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());

    // Every decision is visible per binding.
    let policies = get(&sidecar.admin_url("/v1/policies")).await.json();
    let bindings = policies["bindings"].as_array().expect("bindings");
    assert_eq!(bindings.len(), 3);
    let retry = bindings
        .iter()
        .find(|b| b["hook"] == "retry")
        .expect("retry binding");
    assert!(
        retry["version"]
            .as_str()
            .unwrap_or_default()
            .starts_with("retry@")
    );
    assert!(retry["calls"].as_u64().unwrap_or(0) >= 3);
}

#[tokio::test]
async fn a_task_budget_downgrades_then_rejects() {
    let mock = MockProvider::start(Behaviour::default())
        .await
        .expect("mock");
    let config = format!(
        r#"
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
"#,
        base = mock.openai_base()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    let task = [("outrigger-task-id", "budget-task")];
    let mut models = Vec::new();
    let mut statuses = Vec::new();
    for turn in 0..6 {
        // Each turn asks something new: an identical request in a task would be
        // answered from the journal, at no cost to the budget.
        let r = post_json(
            &sidecar.url("/v1/chat/completions"),
            &task,
            &json!({"model": "gpt-mock", "messages": [{"role": "user", "content": format!("turn {turn}")}]}),
        )
        .await;
        statuses.push(r.status.as_u16());
        if r.status == StatusCode::OK {
            models.push(r.json()["model"].as_str().unwrap_or_default().to_string());
        } else {
            assert_eq!(
                r.json()["type"],
                "urn:outrigger:problem:budget-exceeded",
                "{}",
                r.text()
            );
        }
    }
    // Calls 1–3 run as asked; past 80 % of 4 calls the 4th is downgraded; then rejected.
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429], "{models:?}");
    assert_eq!(models, ["gpt-mock", "gpt-mock", "gpt-mock", "cheap-model"]);
    // Another task has its own budget; calls without a task are not budgeted.
    let other = post_json(
        &sidecar.url("/v1/chat/completions"),
        &[("outrigger-task-id", "t2")],
        &chat("gpt-mock"),
    )
    .await;
    assert_eq!(other.status, StatusCode::OK);
    assert_eq!(
        post_json(&sidecar.url("/v1/chat/completions"), &[], &chat("gpt-mock"))
            .await
            .status,
        StatusCode::OK
    );
}

/// `[budget] retries` bounds a task's retries across its calls: once they are spent,
/// a failing attempt is the call's last.
#[tokio::test]
async fn a_task_retry_budget_stops_retries_once_spent() {
    let mock = MockProvider::start(Behaviour::default())
        .await
        .expect("mock");
    let config = format!(
        r#"
[budget]
retries = 2

[[providers]]
name = "mock"
kind = "openai"
base_url = "{}"
models = ["gpt-mock"]
"#,
        mock.openai_base()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    let task = [("outrigger-task-id", "retry-budget-task")];
    let failing = || Behaviour {
        status: Some(503),
        ..Behaviour::default()
    };
    let turn = |n: u32| json!({"model": "gpt-mock", "messages": [{"role": "user", "content": format!("turn {n}")}]});
    for _ in 0..3 {
        mock.push(failing());
    }
    let r = post_json(&sidecar.url("/v1/chat/completions"), &task, &turn(1)).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert_eq!(mock.exchanges().len(), 3, "two retries, then none left");
    // The next call is admitted, but a failure is no longer retried.
    mock.push(failing());
    let r = post_json(&sidecar.url("/v1/chat/completions"), &task, &turn(2)).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert_eq!(mock.exchanges().len(), 4);
    let r = post_json(&sidecar.url("/v1/chat/completions"), &task, &turn(3)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    // Another task has its own.
    mock.push(failing());
    let r = post_json(
        &sidecar.url("/v1/chat/completions"),
        &[("outrigger-task-id", "other-task")],
        &turn(4),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(mock.exchanges().len(), 7);
}

#[tokio::test]
async fn a_policy_in_the_directory_is_hot_swapped_without_losing_a_request() {
    let mock = std::sync::Arc::new(
        MockProvider::start(Behaviour::default())
            .await
            .expect("mock"),
    );
    let dir = tempfile::tempdir().expect("policy dir");
    std::fs::write(
        dir.path().join("custom.wasm"),
        variant(outrigger_builtins::RETRY, "v1"),
    )
    .unwrap();
    let config = format!(
        r#"
[policies]
dir = {:?}

[[policies.bindings]]
hook = "retry"
policy = "custom"
params = {{ max_attempts = 3 }}

[[providers]]
name = "mock"
kind = "openai"
base_url = "{}"
models = ["*"]
"#,
        dir.path().display().to_string(),
        mock.openai_base()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    let version = |s: &serde_json::Value| {
        s["bindings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["hook"] == "retry")
            .unwrap()["version"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let v1 = version(&get(&sidecar.admin_url("/v1/policies")).await.json());
    assert!(v1.starts_with("retry@"), "{v1}");

    // Traffic keeps flowing while the file changes under it (every 8th call meets a
    // 503 once and is retried by whichever version is current; 8 retries in 64 calls
    // stay inside the 20 % retry budget).
    let url = sidecar.url("/v1/chat/completions");
    let m = mock.clone();
    let load = tokio::spawn(async move {
        let mut statuses = Vec::new();
        for i in 0..64 {
            if i % 8 == 0 {
                m.push(Behaviour {
                    status: Some(503),
                    ..Behaviour::default()
                });
            }
            let r = post_json(&url, &[], &chat("m")).await;
            statuses.push(r.status.as_u16());
        }
        statuses
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let tmp = dir.path().join("custom.wasm.tmp");
    std::fs::write(&tmp, variant(outrigger_builtins::RETRY, "v2")).unwrap();
    std::fs::rename(&tmp, dir.path().join("custom.wasm")).unwrap();
    let mut swapped = false;
    for _ in 0..200 {
        if version(&get(&sidecar.admin_url("/v1/policies")).await.json()) != v1 {
            swapped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let statuses = load.await.expect("load");
    // Every call either succeeded or was retried to success; none was lost.
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert!(swapped, "the new version was not picked up");
    let after = get(&sidecar.admin_url("/v1/policies")).await.json();
    let retry = after["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["hook"] == "retry")
        .unwrap()
        .clone();
    assert_eq!(retry["previous_version"], v1);

    // A broken file never replaces the good version.
    std::fs::write(dir.path().join("custom.wasm"), b"not wasm at all").unwrap();
    let report = post_json(&sidecar.admin_url("/v1/policies/reload"), &[], &json!({})).await;
    assert_eq!(
        report.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        report.text()
    );
    let after = report.json();
    let retry = after["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["hook"] == "retry")
        .unwrap()
        .clone();
    assert_eq!(
        retry["version"],
        version(&get(&sidecar.admin_url("/v1/policies")).await.json())
    );
    assert!(
        retry["last_error"]
            .as_str()
            .unwrap_or_default()
            .contains("WebAssembly"),
        "{retry}"
    );
    assert_eq!(
        post_json(&sidecar.url("/v1/chat/completions"), &[], &chat("m"))
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        get(&sidecar.admin_url("/readyz")).await.status,
        StatusCode::OK
    );
}

/// A binding whose file is not there yet keeps the sidecar not ready; the file
/// dropped into the directory later is loaded by the watcher, and readiness follows
/// without any reload call.
#[tokio::test]
async fn readiness_follows_a_policy_the_watcher_loads() {
    let dir = tempfile::tempdir().expect("policy dir");
    let config = format!(
        "[policies]\ndir = {:?}\n[[policies.bindings]]\nhook = \"retry\"\npolicy = \"late\"\n",
        dir.path().display().to_string()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    let ready = get(&sidecar.admin_url("/readyz")).await;
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        ready.text()
    );
    assert!(ready.text().contains("policies"), "{}", ready.text());
    // Written whole, then renamed in, as an operator should.
    let tmp = dir.path().join("late.wasm.tmp");
    std::fs::write(&tmp, variant(outrigger_builtins::RETRY, "late")).unwrap();
    std::fs::rename(&tmp, dir.path().join("late.wasm")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = get(&sidecar.admin_url("/readyz")).await.status;
        if status == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not ready 60 s after the file arrived; bindings: {}",
            get(&sidecar.admin_url("/v1/policies")).await.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn sighup_reloads_the_policies() {
    let dir = tempfile::tempdir().expect("policy dir");
    std::fs::write(
        dir.path().join("b.wasm"),
        variant(outrigger_builtins::BUDGET, "a"),
    )
    .unwrap();
    let config = format!(
        "[policies]\ndir = {:?}\n[[policies.bindings]]\nhook = \"budget\"\npolicy = \"b\"\n",
        dir.path().display().to_string()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    let version = || async {
        get(&sidecar.admin_url("/v1/policies")).await.json()["bindings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["hook"] == "budget")
            .unwrap()["version"]
            .clone()
    };
    let before = version().await;
    // Change the file without a watcher event reaching us first: SIGHUP must pick it up.
    std::fs::write(
        dir.path().join("b.wasm"),
        variant(outrigger_builtins::BUDGET, "b"),
    )
    .unwrap();
    sidecar.sighup();
    let mut changed = false;
    for _ in 0..100 {
        if version().await != before {
            changed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(changed, "the budget binding was not reloaded");
    assert!(sidecar.logs().contains("policy reload"));
}

#[tokio::test]
async fn the_cli_checks_and_tests_components() {
    let dir = tempfile::tempdir().expect("dir");
    let retry = dir.path().join("retry.wasm");
    std::fs::write(&retry, outrigger_builtins::RETRY).unwrap();
    let out = std::process::Command::new(outrigger_bin())
        .args(["policy", "check"])
        .arg(&retry)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("retry") && text.contains("PASS"), "{text}");

    let scenario = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/policies/scenarios/builtins.toml");
    let out = std::process::Command::new(outrigger_bin())
        .args(["policy", "test"])
        .arg(&retry)
        .arg("--scenario")
        .arg(&scenario)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("429 with Retry-After: 2 s"), "{text}");
    assert!(
        text.contains("retry_after") || text.contains("retry after"),
        "{text}"
    );

    let junk = dir.path().join("junk.wasm");
    std::fs::write(&junk, b"\0asm junk").unwrap();
    let out = std::process::Command::new(outrigger_bin())
        .args(["policy", "check"])
        .arg(&junk)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("FAIL"));
}

/// A journaled plain answer that cannot be read whole (it is over `max_body_bytes`)
/// was still answered, and billed, by the provider: the task is charged the call's
/// estimate, so with `[budget] calls = 1` its next call is refused.
#[tokio::test]
async fn a_journaled_answer_that_cannot_be_read_still_costs_its_task() {
    let mock = MockProvider::start(Behaviour {
        chunks: 400,
        ..Behaviour::default()
    })
    .await
    .expect("mock");
    let config = format!(
        r#"
[limits]
max_body_bytes = 2048

[budget]
calls = 1

[[providers]]
name = "mock"
kind = "openai"
base_url = "{}"
models = ["gpt-mock"]
"#,
        mock.openai_base()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    let turn = |n: u32| json!({"model": "gpt-mock", "messages": [{"role": "user", "content": format!("turn {n}")}]});
    let headers = |key: &'static str| {
        [
            ("outrigger-task-id", "unread-answer"),
            ("idempotency-key", key),
        ]
    };
    let r = post_json(
        &sidecar.url("/v1/chat/completions"),
        &headers("k1"),
        &turn(1),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
    assert_eq!(mock.exchanges().len(), 1);
    let r = post_json(
        &sidecar.url("/v1/chat/completions"),
        &headers("k2"),
        &turn(2),
    )
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.text());
    assert!(r.text().contains("budget"), "{}", r.text());
    assert_eq!(mock.exchanges().len(), 1, "the refused call was not sent");
}

/// A mock whose turns are one tool call each, behind a sidecar with a token budget
/// (so that every task's charges are kept).
async fn budgeted_tool_caller() -> (MockProvider, Sidecar) {
    budgeted_tool_caller_with("").await
}

/// [`budgeted_tool_caller`], with `extra` configuration before its sections.
async fn budgeted_tool_caller_with(extra: &str) -> (MockProvider, Sidecar) {
    let mock = MockProvider::start(Behaviour {
        chunks: 0,
        tool_calls: 1,
        ..Behaviour::default()
    })
    .await
    .expect("mock");
    let config = format!(
        r#"{extra}
[budget]
tokens_total = 10000000

[[providers]]
name = "mock"
kind = "openai"
base_url = "{}"
models = ["gpt-mock"]
"#,
        mock.openai_base()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    (mock, sidecar)
}

/// The role event, the tool call's head and one piece of its arguments; then a cut.
fn broken_inside_a_tool_call() -> Behaviour {
    Behaviour {
        chunks: 0,
        tool_calls: 1,
        cut_after: Some(3),
        // Apart, so that the events arrive before the cut resets the connection.
        chunk_delay: Duration::from_millis(20),
        ..Behaviour::default()
    }
}

/// An attempt that broke inside a tool call it had streamed is held back from the
/// agent and retried, but the provider generated, and bills, its tokens: the task is
/// charged them on top of the retry's usage, though the agent made one call.
#[tokio::test]
async fn a_retried_attempt_that_broke_inside_a_tool_call_is_charged_too() {
    let (mock, sidecar) = budgeted_tool_caller().await;
    let body = json!({"model": "gpt-mock", "stream": true,
                      "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "weather?"}]});
    let call = |task: &'static str| {
        let body = body.clone();
        let url = sidecar.url("/v1/chat/completions");
        async move { post_json(&url, &[("outrigger-task-id", task)], &body).await }
    };
    mock.push(broken_inside_a_tool_call());
    let r = call("broke-then-ok").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert!(
        r.text().contains("[DONE]"),
        "the retry's whole stream: {}",
        r.text()
    );
    assert_eq!(mock.exchanges().len(), 2, "retried once");
    let r = call("ok-at-once").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(mock.exchanges().len(), 3);

    let charged = |task: &str| {
        let url = sidecar.admin_url(&format!("/v1/tasks/{task}"));
        async move { get(&url).await.json()["charged"].clone() }
    };
    let broke = charged("broke-then-ok").await;
    let once = charged("ok-at-once").await;
    assert_eq!(broke["calls"], 1, "{broke}");
    assert_eq!(once["calls"], 1, "{once}");
    let tokens = |c: &serde_json::Value| {
        c["tokens_in"].as_u64().unwrap_or(0) + c["tokens_out"].as_u64().unwrap_or(0)
    };
    assert!(tokens(&once) > 0, "{once}");
    assert!(
        tokens(&broke) > tokens(&once),
        "the broken attempt's tokens are charged: {broke} against {once}"
    );
}

/// A call cancelled (`POST /v1/streams/{key}/cancel`), or whose agent went away
/// under `cancel_on_disconnect`, while its retry waits for a first byte is charged
/// its estimate once for the attempt cut short and once more for the attempt before
/// it that broke inside a tool call: the provider generated both.
#[tokio::test]
async fn a_call_cut_short_is_charged_for_the_attempt_that_broke_before_it() {
    let (mock, sidecar) =
        budgeted_tool_caller_with("[streams]\ncancel_on_disconnect = true\n").await;
    let body = json!({"model": "gpt-mock", "stream": true,
                      "messages": [{"role": "user", "content": "weather?"}]});
    // Sends the call under `key` and, once the mock has had `attempts` requests
    // (the last one waits far longer than the test for its first byte), cancels
    // it or, with `leave`, drops the agent's connection.
    let cut_short = |key: &'static str, task: &'static str, attempts: u64, leave: bool| {
        let (body, sidecar, mock) = (body.clone(), &sidecar, &mock);
        async move {
            let url = sidecar.url("/v1/chat/completions");
            let call = tokio::spawn(async move {
                post_json(
                    &url,
                    &[("idempotency-key", key), ("outrigger-task-id", task)],
                    &body,
                )
                .await
            });
            assert!(
                eventually(Duration::from_secs(10), || mock.received() == attempts).await,
                "{} requests reached the mock, not {attempts}",
                mock.received()
            );
            if leave {
                call.abort();
                return;
            }
            let cancel = send(request(
                http::Method::POST,
                &sidecar.url(&format!("/v1/streams/m%2Fopenai%2F{key}/cancel")),
                &[],
                bytes::Bytes::new(),
            ))
            .await;
            assert_eq!(cancel.status, StatusCode::ACCEPTED, "{}", cancel.text());
            let answered = tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .expect("the call ends at the cancel")
                .expect("the call");
            assert!(
                answered.text().contains("cancelled") && !answered.text().contains("[DONE]"),
                "{}",
                answered.text()
            );
        }
    };
    let tokens = |task: &'static str| {
        let url = sidecar.admin_url(&format!("/v1/tasks/{task}"));
        async move {
            let c = get(&url).await.json()["charged"].clone();
            c["tokens_in"].as_u64().unwrap_or(0) + c["tokens_out"].as_u64().unwrap_or(0)
        }
    };
    let waits = Behaviour {
        chunks: 0,
        tool_calls: 1,
        first_byte_delay: Duration::from_secs(60),
        ..Behaviour::default()
    };
    mock.push(waits.clone());
    cut_short("once", "cancelled-once", 1, false).await;
    let once = tokens("cancelled-once").await;
    assert!(
        once > 0,
        "a cancelled call that was sent costs its estimate"
    );

    mock.push(broken_inside_a_tool_call());
    mock.push(waits.clone());
    cut_short("broke-first", "broke-then-cancelled", 3, false).await;
    assert_eq!(
        tokens("broke-then-cancelled").await,
        2 * once,
        "the attempt that broke inside a tool call is charged on top"
    );

    mock.push(waits.clone());
    cut_short("left", "left-once", 4, true).await;
    mock.push(broken_inside_a_tool_call());
    mock.push(waits);
    cut_short("broke-then-left", "broke-then-left", 6, true).await;
    // The sidecar notices the agent's leaving when it next reads the connection.
    let left = |task: &'static str, expected: u64| {
        let tokens = &tokens;
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let charged = tokens(task).await;
                if charged == expected || Instant::now() > deadline {
                    return charged;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(
        left("left-once", once).await,
        once,
        "an agent that left while its attempt was out is charged its estimate"
    );
    assert_eq!(
        left("broke-then-left", 2 * once).await,
        2 * once,
        "and the attempt before it that broke inside a tool call on top"
    );
}

/// An estimate is charged at the prices of the provider the attempt went to, not
/// those of the model the call asked for: a call cancelled while its fallback's
/// attempt waits for a first byte costs the estimate at the fallback's prices.
#[tokio::test]
async fn an_estimate_charged_for_a_fallback_attempt_is_priced_at_the_fallback() {
    let (primary, backup, sidecar) = with_a_backup(
        "[budget]\ntokens_total = 10000000",
        "price_in = 1\nprice_out = 2",
        "price_in = 10\nprice_out = 30",
    )
    .await;
    primary.push(Behaviour {
        context_overflow: true,
        ..Behaviour::default()
    });
    backup.push(Behaviour {
        first_byte_delay: Duration::from_secs(60),
        ..Behaviour::default()
    });
    let body = json!({"model": "gpt-mock", "stream": true,
                      "messages": [{"role": "user", "content": "long story"}]});
    let url = sidecar.url("/v1/chat/completions");
    let call = tokio::spawn(async move {
        post_json(
            &url,
            &[
                ("idempotency-key", "priced"),
                ("outrigger-task-id", "priced"),
            ],
            &body,
        )
        .await
    });
    assert!(
        eventually(Duration::from_secs(10), || backup.received() == 1).await,
        "the call fell back: {} and {} requests",
        primary.received(),
        backup.received()
    );
    let cancel = send(request(
        http::Method::POST,
        &sidecar.url("/v1/streams/m%2Fopenai%2Fpriced/cancel"),
        &[],
        bytes::Bytes::new(),
    ))
    .await;
    assert_eq!(cancel.status, StatusCode::ACCEPTED, "{}", cancel.text());
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the call ends at the cancel")
        .expect("the call");
    let charged = get(&sidecar.admin_url("/v1/tasks/priced")).await.json()["charged"].clone();
    let (tokens_in, tokens_out) = (
        charged["tokens_in"].as_u64().unwrap_or(0),
        charged["tokens_out"].as_u64().unwrap_or(0),
    );
    assert!(tokens_in > 0 && tokens_out > 0, "{charged}");
    // $10 and $30 per million tokens: 10 and 30 micro-dollars a token (at the
    // primary's prices it would have been 1 and 2).
    assert_eq!(
        charged["cost_micros"].as_u64(),
        Some(tokens_in * 10 + tokens_out * 30),
        "{charged}"
    );
}
