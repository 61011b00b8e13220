//! Journaled tool calls: replay, concurrency, key misuse, fail-closed journal,
//! in-doubt handling per tool class, probes, MCP, derived keys and the audit CLI.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use outrigger_testing::checker::{self, Outcome};
use outrigger_testing::mcp::{META_KEY, MockMcp};
use outrigger_testing::provider::{Behaviour, MockProvider};
use outrigger_testing::tool::{Fail, MockTool, ToolBehaviour};
use serde_json::json;

use crate::support::*;

struct Env {
    tool: MockTool,
    keyed: MockTool,
    probe: MockTool,
    mcp: MockMcp,
    model: MockProvider,
    sidecar: Sidecar,
}

async fn env() -> Env {
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let keyed = MockTool::start(ToolBehaviour {
        dedupe: true,
        ..ToolBehaviour::default()
    })
    .await
    .expect("keyed tool");
    let probe = MockTool::start(ToolBehaviour::default())
        .await
        .expect("probe tool");
    let mcp = MockMcp::start(ToolBehaviour::default(), false)
        .await
        .expect("mcp");
    let model = MockProvider::start(Behaviour {
        tool_calls: 2,
        ..Behaviour::default()
    })
    .await
    .expect("provider");
    let config = format!(
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

[[tools]]
name = "ledger"
kind = "http"
base_url = "{keyed}"
class = "keyed"
timeout = "2s"

[[tools]]
name = "orders"
kind = "http"
base_url = "{probe}"
class = "probe"
probe_path = "/status/{{key}}"
timeout = "2s"

[[tools]]
name = "strict"
kind = "http"
base_url = "{tool}"
class = "unsafe"
key_required = true

[[tools]]
name = "mail"
kind = "mcp"
base_url = "{mcp}"
class = "unsafe"
"#,
        model = model.openai_base(),
        tool = tool.url(),
        keyed = keyed.url(),
        probe = probe.url(),
        mcp = mcp.url(),
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    Env {
        tool,
        keyed,
        probe,
        mcp,
        model,
        sidecar,
    }
}

async fn call(
    s: &Sidecar,
    path: &str,
    key: Option<&str>,
    body: &serde_json::Value,
    extra: &[(&str, &str)],
) -> Reply {
    let mut h: Vec<(&str, &str)> = extra.to_vec();
    if let Some(k) = key {
        h.push(("idempotency-key", k));
    }
    post_json(&s.url(path), &h, body).await
}

#[tokio::test]
async fn a_completed_call_is_replayed_not_repeated() {
    let e = env().await;
    let body = json!({"amount": 42, "to": "acct-1"});
    let first = call(
        &e.sidecar,
        "/tools/payments/charge",
        Some("\"pay-1\""),
        &body,
        &[],
    )
    .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert_eq!(first.header("outrigger-replayed"), None);
    assert_eq!(first.json()["echo"]["amount"], 42);
    for _ in 0..3 {
        let again = call(
            &e.sidecar,
            "/tools/payments/charge",
            Some("pay-1"),
            &body,
            &[],
        )
        .await;
        assert_eq!(again.status, StatusCode::OK);
        assert_eq!(again.header("outrigger-replayed"), Some("true"));
        assert_eq!(again.body, first.body, "the replay is the stored response");
    }
    assert_eq!(e.tool.effects().len(), 1, "executed exactly once");
    assert_eq!(
        e.tool.effects()[0].key.as_deref(),
        Some("pay-1"),
        "the key is forwarded downstream"
    );
    assert_eq!(e.tool.effects()[0].path, "/charge");

    // The record names the policy versions in force when it was journaled.
    let key = first.header("outrigger-journal-key").expect("journal key");
    let encoded: String = key
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let record = get(&e.sidecar.admin_url(&format!("/v1/journal/{encoded}"))).await;
    assert_eq!(record.status, StatusCode::OK, "{}", record.text());
    let versions = record.json()["policy_versions"].clone();
    let versions = versions.as_array().expect("policy_versions array").clone();
    assert!(
        versions
            .iter()
            .any(|v| v.as_str().is_some_and(|v| v.starts_with("retry@"))),
        "{versions:?}"
    );
}

#[tokio::test]
async fn twenty_concurrent_requests_with_one_key_execute_once() {
    let e = env().await;
    e.tool.set_default(ToolBehaviour {
        delay: Duration::from_millis(300),
        ..ToolBehaviour::default()
    });
    let body = json!({"amount": 7});
    let mut tasks = Vec::new();
    for i in 0..20 {
        let url = e.sidecar.url("/tools/payments/charge");
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let wait = if i % 2 == 0 {
                vec![("prefer", "wait=10")]
            } else {
                vec![]
            };
            let mut h = wait;
            h.push(("idempotency-key", "same-key"));
            post_json(&url, &h, &body).await
        }));
    }
    let mut ok = 0;
    let mut conflict = 0;
    for t in tasks {
        let r = t.await.expect("task");
        match r.status {
            StatusCode::OK => ok += 1,
            StatusCode::CONFLICT => {
                assert_eq!(
                    r.json()["type"],
                    "urn:outrigger:problem:request-in-progress"
                );
                assert_eq!(r.header("retry-after"), Some("1"));
                conflict += 1;
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert_eq!(ok + conflict, 20);
    assert!(ok >= 10, "every waiting request gets the result (got {ok})");
    assert_eq!(e.tool.effects().len(), 1, "exactly one execution");
}

#[tokio::test]
async fn a_key_reused_with_another_request_is_refused() {
    let e = env().await;
    let a = call(
        &e.sidecar,
        "/tools/payments/charge",
        Some("k-reuse"),
        &json!({"amount": 1}),
        &[],
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    let b = call(
        &e.sidecar,
        "/tools/payments/charge",
        Some("k-reuse"),
        &json!({"amount": 2}),
        &[],
    )
    .await;
    assert_eq!(b.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", b.text());
    assert_eq!(b.json()["type"], "urn:outrigger:problem:key-reused");
    // Key order and whitespace are not a different request.
    let c = send(request(
        Method::POST,
        &e.sidecar.url("/tools/payments/charge"),
        &[
            ("idempotency-key", "k-reuse"),
            ("content-type", "application/json"),
        ],
        "{ \"amount\" : 1 }",
    ))
    .await;
    assert_eq!(c.status, StatusCode::OK);
    assert_eq!(c.header("outrigger-replayed"), Some("true"));
    assert_eq!(e.tool.effects().len(), 1);
}

#[tokio::test]
async fn a_journal_that_cannot_write_fails_closed() {
    let e = env().await;
    let on = post_json(
        &e.sidecar.admin_url("/v1/faults"),
        &[],
        &json!({"journal": "fail_flush"}),
    )
    .await;
    assert_eq!(on.status, StatusCode::OK, "{}", on.text());
    let r = call(
        &e.sidecar,
        "/tools/payments/charge",
        Some("k-fault"),
        &json!({"amount": 1}),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(
        r.json()["type"],
        "urn:outrigger:problem:journal-unavailable"
    );
    assert_eq!(e.tool.received(), 0, "nothing reached the tool");
    let off = post_json(
        &e.sidecar.admin_url("/v1/faults"),
        &[],
        &json!({"journal": null}),
    )
    .await;
    assert_eq!(off.status, StatusCode::OK);
    let r = call(
        &e.sidecar,
        "/tools/payments/charge",
        Some("k-fault"),
        &json!({"amount": 1}),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(e.tool.effects().len(), 1);

    // The journal fails while a call is at the tool: the tool acted, its answer
    // cannot be recorded, and the agent is told the call may have executed (not that
    // it was refused), without the unrecorded answer.
    let faults = e.sidecar.admin_url("/v1/faults");
    let amount = json!({"amount": 2});
    let (late, on) = tokio::join!(
        call(
            &e.sidecar,
            "/tools/payments/charge",
            Some("k-late"),
            &amount,
            &[("x-mock-tool", "delay_ms=400")],
        ),
        async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            post_json(&faults, &[], &json!({"journal": "fail_flush"})).await
        }
    );
    assert_eq!(on.status, StatusCode::OK, "{}", on.text());
    assert_eq!(late.status, StatusCode::BAD_GATEWAY, "{}", late.text());
    assert_eq!(late.json()["type"], "urn:outrigger:problem:outcome-unknown");
    assert!(
        late.text().contains("could not be journaled"),
        "{}",
        late.text()
    );
    // What it says a retry gets is what a retry gets: in progress until a restart.
    assert!(
        late.text().contains("until the sidecar restarts") && !late.text().contains("is safe"),
        "{}",
        late.text()
    );
    assert_eq!(late.json()["attempt"], 1, "{}", late.text());
    assert_eq!(e.tool.effects().len(), 2, "the tool did act");
    let off = post_json(&faults, &[], &json!({"journal": null})).await;
    assert_eq!(off.status, StatusCode::OK);
    let retry = call(
        &e.sidecar,
        "/tools/payments/charge",
        Some("k-late"),
        &amount,
        &[],
    )
    .await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{}", retry.text());
}

#[tokio::test]
async fn missing_keys_are_refused_or_counted_per_tool() {
    let e = env().await;
    let strict = call(&e.sidecar, "/tools/strict/x", None, &json!({}), &[]).await;
    assert_eq!(strict.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        strict.json()["type"],
        "urn:outrigger:problem:missing-idempotency-key"
    );
    for _ in 0..3 {
        let loose = call(&e.sidecar, "/tools/payments/x", None, &json!({}), &[]).await;
        assert_eq!(loose.status, StatusCode::OK);
    }
    let metrics = get(&e.sidecar.admin_url("/metrics")).await.text();
    assert!(
        metrics.contains("outrigger_tool_unprotected_total{tool=\"payments\"} 3"),
        "{metrics}"
    );
    // Warned about once, not once per call: an agent without keys must not flood the log.
    let warned = e
        .sidecar
        .logs()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("passed through unprotected"))
        .count();
    assert_eq!(warned, 1, "{}", e.sidecar.logs());
    // GET passes through unjournaled.
    let read = get(&e.sidecar.url("/tools/payments/lookup?id=1")).await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(read.json()["read"], "/lookup");
    assert!(read.json()["key"].is_null());
    // The agent's own key travels with an unjournaled call: it is the tool's only guard.
    let keyed_read = send(
        Request::get(e.sidecar.url("/tools/payments/lookup?id=2"))
            .header("idempotency-key", "agent-read-1")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(keyed_read.status, StatusCode::OK);
    assert_eq!(keyed_read.json()["key"], "agent-read-1");
    let unknown = call(&e.sidecar, "/tools/nope/x", Some("k"), &json!({}), &[]).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert!(unknown.text().contains("payments"));
}

#[tokio::test]
async fn an_unsafe_tool_in_doubt_is_held_for_an_operator() {
    let e = env().await;
    e.tool.push(ToolBehaviour {
        fail: Some(Fail::Reset),
        ..ToolBehaviour::default()
    });
    let body = json!({"amount": 5});
    let first = call(
        &e.sidecar,
        "/tools/payments/charge",
        Some("k-doubt"),
        &body,
        &[],
    )
    .await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{}", first.text());
    assert_eq!(
        first.json()["type"],
        "urn:outrigger:problem:outcome-unknown"
    );
    let again = call(
        &e.sidecar,
        "/tools/payments/charge",
        Some("k-doubt"),
        &body,
        &[],
    )
    .await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.text());
    let doc = again.json();
    assert_eq!(doc["type"], "urn:outrigger:problem:outcome-unknown");
    assert_eq!(doc["state"], "needs_operator");
    let resolve_url = doc["resolve_url"]
        .as_str()
        .expect("resolve url")
        .to_string();
    assert_eq!(e.tool.effects().len(), 1, "never re-sent");

    // The operator checks the tool and records the outcome; the journal keeps who and why.
    let resolved = post_json(
        &e.sidecar.admin_url(&resolve_url),
        &[],
        &json!({
        "action": "mark_succeeded", "status": 200, "body": {"ok": true, "effect": 1},
        "actor": "oncall@example", "reason": "charge found in the payment provider's dashboard"}),
    )
    .await;
    assert_eq!(resolved.status, StatusCode::OK, "{}", resolved.text());
    assert_eq!(resolved.json()["resolutions"][0]["actor"], "oncall@example");
    let after = call(
        &e.sidecar,
        "/tools/payments/charge",
        Some("k-doubt"),
        &body,
        &[],
    )
    .await;
    assert_eq!(after.status, StatusCode::OK);
    assert_eq!(after.header("outrigger-replayed"), Some("true"));
    assert_eq!(after.json()["effect"], 1);
    assert_eq!(e.tool.effects().len(), 1);
}

/// A call recorded while its tool was `unsafe` keeps the unsafe class's second
/// durable write after an operator reclassifies the tool (`keyed`) and restarts:
/// a crash while its next attempt is at the tool leaves it in doubt (held for an
/// operator, as its record's class says), never "not sent" and executed again.
#[tokio::test]
async fn a_call_recorded_as_unsafe_keeps_its_dispatch_write_after_the_tool_is_reclassified() {
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let config = |class: &str| {
        format!(
            "[[tools]]\nname = \"payments\"\nkind = \"http\"\nbase_url = \"{}\"\nclass = \"{class}\"\ntimeout = \"20s\"\n",
            tool.url()
        )
    };
    let mut sidecar = Sidecar::start(&config("unsafe"), &[]).await;
    let body = json!({"amount": 3});
    let path = "/tools/payments/charge";
    // A 429: not applied, so the key's next request executes again.
    let refused = call(
        &sidecar,
        path,
        Some("reclassified"),
        &body,
        &[("x-mock-tool", "status=429")],
    )
    .await;
    assert_eq!(
        refused.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        refused.text()
    );

    // The operator declares the tool keyed and restarts the sidecar.
    sidecar.kill();
    let file = sidecar.dir.path().join("outrigger.toml");
    let text = std::fs::read_to_string(&file).expect("config");
    std::fs::write(&file, text.replace(&config("unsafe"), &config("keyed"))).expect("config");
    sidecar.spawn().await;

    // The next attempt reaches the tool, which hangs; the sidecar dies meanwhile.
    let url = sidecar.url(path);
    let hung = tokio::spawn(async move {
        let h = [
            ("content-type", "application/json"),
            ("idempotency-key", "reclassified"),
            ("x-mock-tool", "hang=after"),
        ];
        let req = request(Method::POST, &url, &h, json!({"amount": 3}).to_string());
        let _ = tokio::time::timeout(Duration::from_secs(20), client().request(req)).await;
    });
    assert!(
        eventually(Duration::from_secs(10), || tool.effects().len() == 2).await,
        "the second attempt reached the tool"
    );
    sidecar.kill();
    hung.abort();
    sidecar.spawn().await;

    let again = call(&sidecar, path, Some("reclassified"), &body, &[]).await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.text());
    assert_eq!(again.json()["state"], "needs_operator", "{}", again.text());
    assert_eq!(tool.effects().len(), 2, "not executed again");
}

#[tokio::test]
async fn a_keyed_tool_in_doubt_is_resent_with_the_same_key() {
    let e = env().await;
    e.keyed.push(ToolBehaviour {
        fail: Some(Fail::Reset),
        dedupe: true,
        ..ToolBehaviour::default()
    });
    let body = json!({"entry": "debit"});
    let first = call(
        &e.sidecar,
        "/tools/ledger/post",
        Some("k-keyed"),
        &body,
        &[],
    )
    .await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{}", first.text());
    let again = call(
        &e.sidecar,
        "/tools/ledger/post",
        Some("k-keyed"),
        &body,
        &[],
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text());
    assert_eq!(e.keyed.received(), 2, "re-sent once");
    assert_eq!(
        e.keyed.effects().len(),
        1,
        "the tool deduplicated by the forwarded key"
    );
    let third = call(
        &e.sidecar,
        "/tools/ledger/post",
        Some("k-keyed"),
        &body,
        &[],
    )
    .await;
    assert_eq!(third.header("outrigger-replayed"), Some("true"));
    assert_eq!(e.keyed.received(), 2);
}

/// A keyed call in doubt whose re-send cannot reach the tool (it is down) stays in
/// doubt, and the agent is told so (`502 outcome-unknown`), not that nothing was
/// sent: the first attempt may have executed.
#[tokio::test]
async fn a_resend_that_cannot_reach_the_tool_says_the_call_is_still_in_doubt() {
    let Env { keyed, sidecar, .. } = env().await;
    keyed.push(ToolBehaviour {
        fail: Some(Fail::Reset),
        dedupe: true,
        ..ToolBehaviour::default()
    });
    let body = json!({"entry": "debit"});
    let first = call(&sidecar, "/tools/ledger/post", Some("k-gone"), &body, &[]).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{}", first.text());
    assert_eq!(keyed.effects().len(), 1);
    drop(keyed);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let again = call(&sidecar, "/tools/ledger/post", Some("k-gone"), &body, &[]).await;
    assert_eq!(again.status, StatusCode::BAD_GATEWAY, "{}", again.text());
    assert_eq!(
        again.json()["type"],
        "urn:outrigger:problem:outcome-unknown",
        "{}",
        again.text()
    );
    // It names the attempt that may have executed (the first), and why this one
    // could not tell.
    assert_eq!(again.json()["attempt"], 1, "{}", again.text());
    assert!(
        again
            .text()
            .contains("its re-send, attempt 2, could not reach the tool"),
        "{}",
        again.text()
    );
    let record = get(&sidecar.admin_url("/v1/journal/ledger%2Fk-gone")).await;
    assert_eq!(record.json()["state"], "in_doubt", "{}", record.text());
}

#[tokio::test]
async fn a_probe_tool_in_doubt_is_checked_before_anything_is_resent() {
    let e = env().await;
    e.probe.push(ToolBehaviour {
        fail: Some(Fail::Reset),
        ..ToolBehaviour::default()
    });
    let body = json!({"sku": "X1"});
    let first = call(
        &e.sidecar,
        "/tools/orders/place",
        Some("k-probe"),
        &body,
        &[],
    )
    .await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    let again = call(
        &e.sidecar,
        "/tools/orders/place",
        Some("k-probe"),
        &body,
        &[
            ("x-tenant", "acme"),
            ("content-encoding", "identity"),
            ("if-none-match", "*"),
        ],
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text());
    assert_eq!(
        again.header("outrigger-replayed"),
        Some("true"),
        "answered from the probe, not re-executed"
    );
    assert_eq!(
        again.json()["tenant"],
        "acme",
        "the probe goes with the agent's headers: {}",
        again.text()
    );
    assert!(
        again.json()["content_encoding"].is_null() && again.json()["if_none_match"].is_null(),
        "but not those that described the call's body or its conditions: {}",
        again.text()
    );
    assert_eq!(e.probe.effects().len(), 1);

    // A call that never happened is probed (404) and then executed.
    e.probe.push(ToolBehaviour {
        fail: Some(Fail::Before),
        ..ToolBehaviour::default()
    });
    let lost = call(
        &e.sidecar,
        "/tools/orders/place",
        Some("k-probe-2"),
        &json!({"sku": "Y"}),
        &[],
    )
    .await;
    assert_eq!(
        lost.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "a 5xx is ambiguous: {}",
        lost.text()
    );
    let retry = call(
        &e.sidecar,
        "/tools/orders/place",
        Some("k-probe-2"),
        &json!({"sku": "Y"}),
        &[],
    )
    .await;
    assert_eq!(retry.status, StatusCode::OK, "{}", retry.text());
    assert_eq!(retry.header("outrigger-replayed"), None);
    assert_eq!(e.probe.effects().len(), 2);
}

/// A probe that cannot tell, whose return to in doubt the journal then fails to
/// write, answers that the outcome is unknown: never that the call was not executed
/// (its first attempt may well have been).
#[tokio::test]
async fn a_failed_probe_the_journal_cannot_record_is_answered_in_doubt() {
    let e = env().await;
    e.probe.push(ToolBehaviour {
        fail: Some(Fail::Reset),
        ..ToolBehaviour::default()
    });
    let body = json!({"sku": "Z"});
    let path = "/tools/orders/place";
    let first = call(&e.sidecar, path, Some("k-probe-3"), &body, &[]).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{}", first.text());
    // The probe outlasts the tool's 2 s timeout; the journal fails meanwhile.
    let retry = tokio::spawn({
        let (url, body) = (e.sidecar.url(path), body.to_string());
        async move {
            let h = [
                ("content-type", "application/json"),
                ("idempotency-key", "k-probe-3"),
                ("x-mock-tool", "delay_ms=2500"),
            ];
            send(request(Method::POST, &url, &h, body)).await
        }
    });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let faults = e.sidecar.admin_url("/v1/faults");
    let on = post_json(&faults, &[], &json!({"journal": "fail_flush"})).await;
    assert_eq!(on.status, StatusCode::OK, "{}", on.text());
    let answered = retry.await.expect("the retry");
    let off = post_json(&faults, &[], &json!({"journal": null})).await;
    assert_eq!(off.status, StatusCode::OK, "{}", off.text());
    assert_eq!(
        answered.json()["type"],
        "urn:outrigger:problem:outcome-unknown",
        "{}",
        answered.text()
    );
    assert_eq!(e.probe.effects().len(), 1, "never re-sent");
}

/// A probe whose agent goes away (here: gives up after 200 ms of a probe that takes
/// 800) is not cut short: what it finds is journaled, so the key's next request gets
/// the answer it found, or (it found nothing) executes, instead of `409` until a
/// restart.
#[tokio::test]
async fn a_probe_whose_agent_goes_away_still_journals_what_it_found() {
    let e = env().await;
    let path = "/tools/orders/place";
    let give_up = |key: &'static str, body: serde_json::Value| {
        let url = e.sidecar.url(path);
        async move {
            let h = [
                ("content-type", "application/json"),
                ("idempotency-key", key),
                ("x-mock-tool", "delay_ms=800"),
            ];
            let req = request(Method::POST, &url, &h, body.to_string());
            let gave_up =
                tokio::time::timeout(Duration::from_millis(200), client().request(req)).await;
            assert!(
                gave_up.is_err(),
                "the probe answered before the agent gave up"
            );
        }
    };
    let wait = [("prefer", "wait=10")];

    // The call happened: the probe finds it.
    e.probe.push(ToolBehaviour {
        fail: Some(Fail::Reset),
        ..ToolBehaviour::default()
    });
    let body = json!({"sku": "gone-1"});
    let first = call(&e.sidecar, path, Some("probe-gone-1"), &body, &[]).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{}", first.text());
    give_up("probe-gone-1", body.clone()).await;
    let after = call(&e.sidecar, path, Some("probe-gone-1"), &body, &wait).await;
    assert_eq!(after.status, StatusCode::OK, "{}", after.text());
    assert_eq!(after.header("outrigger-replayed"), Some("true"));
    assert_eq!(after.json()["effect"], 1, "{}", after.text());

    // It did not: the probe finds nothing, and the next request executes it.
    e.probe.push(ToolBehaviour {
        fail: Some(Fail::Before),
        ..ToolBehaviour::default()
    });
    let body = json!({"sku": "gone-2"});
    let lost = call(&e.sidecar, path, Some("probe-gone-2"), &body, &[]).await;
    assert_eq!(
        lost.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        lost.text()
    );
    give_up("probe-gone-2", body.clone()).await;
    let ran = call(&e.sidecar, path, Some("probe-gone-2"), &body, &wait).await;
    assert_eq!(ran.status, StatusCode::OK, "{}", ran.text());
    assert_eq!(ran.header("outrigger-replayed"), None);
    assert_eq!(e.probe.effects().len(), 2, "each call took effect once");
}

/// A probe that finds the call while the journal cannot record it: the call did
/// execute, so the agent is told its outcome could not be journaled (in doubt), not
/// that it was refused and not executed.
#[tokio::test]
async fn a_probe_that_finds_the_call_but_cannot_record_it_says_it_may_have_executed() {
    let e = env().await;
    let path = "/tools/orders/place";
    e.probe.push(ToolBehaviour {
        fail: Some(Fail::Reset),
        ..ToolBehaviour::default()
    });
    let body = json!({"sku": "unrecorded-1"});
    let first = call(&e.sidecar, path, Some("probe-unrecorded"), &body, &[]).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{}", first.text());
    // The retry probes for 800 ms; the journal stops writing meanwhile.
    let retry = {
        let url = e.sidecar.url(path);
        let body = body.clone();
        tokio::spawn(async move {
            let h = [
                ("content-type", "application/json"),
                ("idempotency-key", "probe-unrecorded"),
                ("x-mock-tool", "delay_ms=800"),
            ];
            send(request(Method::POST, &url, &h, body.to_string())).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let on = post_json(
        &e.sidecar.admin_url("/v1/faults"),
        &[],
        &json!({"journal": "fail_flush"}),
    )
    .await;
    assert_eq!(on.status, StatusCode::OK, "{}", on.text());
    let r = retry.await.expect("the retry");
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
    assert_eq!(
        r.json()["type"],
        "urn:outrigger:problem:outcome-unknown",
        "{}",
        r.text()
    );
    assert!(r.text().contains("could not be journaled"), "{}", r.text());
    let off = post_json(
        &e.sidecar.admin_url("/v1/faults"),
        &[],
        &json!({"journal": null}),
    )
    .await;
    assert_eq!(off.status, StatusCode::OK);
    assert_eq!(e.probe.effects().len(), 1, "executed once, never re-sent");
}

#[tokio::test]
async fn mcp_tool_calls_are_journaled_and_everything_else_passes_through() {
    let e = env().await;
    let url = e.sidecar.url("/mcp/mail");
    let init = post_json(&url, &[], &json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})).await;
    assert_eq!(init.status, StatusCode::OK);
    assert_eq!(init.header("mcp-session-id"), Some("mock-session-1"));
    let notified = post_json(
        &url,
        &[],
        &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    )
    .await;
    assert_eq!(notified.status, StatusCode::ACCEPTED);
    let listed = post_json(
        &url,
        &[],
        &json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
    )
    .await;
    assert_eq!(listed.json()["result"]["tools"][0]["name"], "send_email");

    let tool_call = |id: u64, to: &str| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": to, "body": "hi"}, "_meta": {META_KEY: "mail-1"}}})
    };
    let first = post_json(&url, &[], &tool_call(3, "amy")).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert_eq!(first.json()["id"], 3);
    assert_eq!(first.json()["result"]["isError"], false);
    // A retry carries a new JSON-RPC id: same result, the new id, not re-executed.
    let again = post_json(&url, &[], &tool_call(9, "amy")).await;
    assert_eq!(again.header("outrigger-replayed"), Some("true"));
    assert_eq!(again.json()["id"], 9);
    assert_eq!(again.json()["result"], first.json()["result"]);
    let misuse = post_json(&url, &[], &tool_call(10, "bob")).await;
    assert_eq!(misuse.json()["error"]["code"], -32011);
    assert_eq!(e.mcp.effects().len(), 1);
    assert_eq!(
        e.mcp.metas()[0][META_KEY],
        "mail-1",
        "the key is forwarded in _meta"
    );

    // An unknown outcome is a tool result the model can read.
    e.mcp.push(ToolBehaviour {
        fail: Some(Fail::Reset),
        ..ToolBehaviour::default()
    });
    let call2 = json!({"jsonrpc": "2.0", "id": 11, "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": "cy"}, "_meta": {META_KEY: "mail-2"}}});
    let doubt = post_json(&url, &[], &call2).await;
    assert_eq!(doubt.json()["result"]["isError"], true, "{}", doubt.text());
    assert_eq!(
        doubt.json()["result"]["_meta"]["outrigger/outcome"]["attempt"],
        1,
        "{}",
        doubt.text()
    );
    assert!(
        doubt.json()["result"]["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .contains("may have executed")
    );
    let doubt_again = post_json(&url, &[], &call2).await;
    assert_eq!(
        doubt_again.json()["result"]["_meta"]["outrigger/outcome"]["state"],
        "needs_operator"
    );
    assert_eq!(e.mcp.effects().len(), 2);
    assert!(
        e.mcp
            .methods()
            .contains(&"notifications/initialized".to_string())
    );

    // A refusal at the transport (a 4xx that is no JSON-RPC answer, here for a bad
    // mock setting) was not applied: the same key runs once the client fixed it.
    let call3 = json!({"jsonrpc": "2.0", "id": 12, "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": "di"}, "_meta": {META_KEY: "mail-3"}}});
    let refused = post_json(&url, &[("x-mock-tool", "bogus")], &call3).await;
    assert_eq!(
        refused.status,
        StatusCode::BAD_REQUEST,
        "{}",
        refused.text()
    );
    let ran = post_json(&url, &[], &call3).await;
    assert_eq!(ran.json()["result"]["isError"], false, "{}", ran.text());
    assert_eq!(ran.header("outrigger-replayed"), None);
    assert_eq!(e.mcp.effects().len(), 3);
    // A JSON-RPC batch holding a tools/call is refused, not passed on unjournaled:
    // each request in it gets its error, so the client can match every id.
    let list = json!({"jsonrpc": "2.0", "id": 13, "method": "tools/list"});
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let batch = post_json(&url, &[], &json!([call3, list, note])).await;
    assert_eq!(batch.status, StatusCode::OK, "{}", batch.text());
    let answers = batch.json();
    let ids: Vec<&serde_json::Value> = answers
        .as_array()
        .map(|a| a.iter().map(|m| &m["id"]).collect())
        .unwrap_or_default();
    assert_eq!(ids, [&json!(12), &json!(13)], "{answers}");
    assert!(
        answers
            .as_array()
            .is_some_and(|a| a.iter().all(|m| m["error"]["code"] == -32600)),
        "{answers}"
    );
    assert_eq!(e.mcp.effects().len(), 3);
}

/// A `tools/call` whose params the sidecar cannot forward (not an object, no tool
/// name) is refused with `-32602` before anything is journaled: the server sees
/// nothing, and the key runs as new once the call is fixed.
#[tokio::test]
async fn mcp_tool_calls_with_unusable_params_are_refused_before_the_journal() {
    let e = env().await;
    let url = e.sidecar.url("/mcp/mail");
    let key = [("idempotency-key", "mail-params")];
    for params in [
        json!(["x"]),
        json!("send_email"),
        json!({"arguments": {"to": "x"}}),
    ] {
        let bad = post_json(
            &url,
            &key,
            &json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": params}),
        )
        .await;
        assert_eq!(bad.status, StatusCode::OK, "{params}: {}", bad.text());
        assert_eq!(bad.json()["id"], 5);
        assert_eq!(bad.json()["error"]["code"], -32602, "{}", bad.text());
        assert!(
            bad.json()["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("params"),
            "{}",
            bad.text()
        );
    }
    // A member named twice: the server might read either.
    let twice = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"send_email","arguments":{"to":"x","to":"y"}}}"#;
    let req = Request::builder()
        .method(Method::POST)
        .uri(&url)
        .header("content-type", "application/json")
        .header("idempotency-key", "mail-params")
        .body(Full::new(Bytes::from_static(twice)))
        .expect("request");
    let bad = send(req).await;
    assert_eq!(bad.json()["id"], 7, "{}", bad.text());
    assert_eq!(bad.json()["error"]["code"], -32600, "{}", bad.text());
    assert!(bad.text().contains("appears twice"), "{}", bad.text());
    // So is any message naming a member twice: a second `method` could hide a
    // `tools/call` from the journal from a server that reads the first.
    let hidden = br#"{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"send_email","arguments":{"to":"x"}},"method":"ping"}"#;
    let req = Request::builder()
        .method(Method::POST)
        .uri(&url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(hidden)))
        .expect("request");
    let bad = send(req).await;
    assert_eq!(bad.json()["error"]["code"], -32600, "{}", bad.text());
    assert!(e.mcp.methods().is_empty(), "nothing reached the server");
    let good = post_json(
        &url,
        &key,
        &json!({"jsonrpc": "2.0", "id": 6, "method": "tools/call",
                "params": {"name": "send_email", "arguments": {"to": "x"}}}),
    )
    .await;
    assert_eq!(good.json()["result"]["isError"], false, "{}", good.text());
    assert_eq!(good.header("outrigger-replayed"), None);
    assert_eq!(e.mcp.effects().len(), 1);
}

/// A `_meta` key that is no valid key (a number, an empty string) is refused with
/// `-32602`, not taken for no key: the call would run unprotected.
#[tokio::test]
async fn mcp_meta_keys_that_are_not_valid_strings_are_refused() {
    let e = env().await;
    let url = e.sidecar.url("/mcp/mail");
    for key in [json!(1042), json!(""), json!({"k": 1})] {
        let call = json!({"jsonrpc": "2.0", "id": 8, "method": "tools/call",
            "params": {"name": "send_email", "arguments": {"to": "x"}, "_meta": {META_KEY: key}}});
        let refused = post_json(&url, &[], &call).await;
        assert_eq!(refused.json()["id"], 8, "{}", refused.text());
        assert_eq!(
            refused.json()["error"]["code"],
            -32602,
            "{key}: {}",
            refused.text()
        );
    }
    assert!(e.mcp.methods().is_empty(), "nothing reached the server");
}

/// Whatever goes wrong with a `tools/call` comes back as a JSON-RPC error with the
/// call's id (here: the server cannot be reached, so nothing was sent), keeping
/// the HTTP status a problem document would have had.
#[tokio::test]
async fn mcp_tool_call_errors_are_json_rpc_errors() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        l.local_addr().expect("an address")
    };
    let config = format!(
        "[[tools]]\nname = \"m\"\nkind = \"mcp\"\nbase_url = \"http://{closed}/mcp\"\nclass = \"unsafe\"\n"
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    let call = json!({"jsonrpc": "2.0", "id": "c-1", "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": "z"}}});
    let failed = post_json(
        &sidecar.url("/mcp/m"),
        &[("idempotency-key", "gone-1")],
        &call,
    )
    .await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY, "{}", failed.text());
    assert_eq!(
        failed.header("content-type"),
        Some("application/json"),
        "{}",
        failed.text()
    );
    let doc = failed.json();
    assert_eq!(doc["id"], "c-1");
    assert_eq!(doc["error"]["code"], -32603, "{doc}");
    assert_eq!(
        doc["error"]["data"]["type"],
        "urn:outrigger:problem:upstream-unreachable"
    );
}

/// An MCP answer over SSE (a progress notification, then the response) is
/// journaled and replayed; a server that keeps its stream open after the response
/// (it SHOULD close it) has answered all the same: the call completes at once,
/// not in doubt at the tool's timeout.
#[tokio::test]
async fn mcp_answers_over_sse_are_journaled() {
    for keep_open in [false, true] {
        let mcp = MockMcp::start(
            ToolBehaviour {
                keep_open,
                ..ToolBehaviour::default()
            },
            true,
        )
        .await
        .expect("mcp");
        let config = format!(
            "[[tools]]\nname = \"m\"\nkind = \"mcp\"\nbase_url = \"{}\"\nclass = \"unsafe\"\n\
             timeout = \"20s\"\n",
            mcp.url()
        );
        let sidecar = Sidecar::start(&config, &[]).await;
        let msg = |id: u64| {
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "send_email", "arguments": {"to": "z"}}})
        };
        let started = std::time::Instant::now();
        let first = post_json(
            &sidecar.url("/mcp/m"),
            &[("idempotency-key", "sse-1")],
            &msg(1),
        )
        .await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "keep_open {keep_open}: {:?}",
            started.elapsed()
        );
        assert_eq!(
            first.json()["result"]["structuredContent"]["effect"],
            1,
            "keep_open {keep_open}: {}",
            first.text()
        );
        let again = post_json(
            &sidecar.url("/mcp/m"),
            &[("idempotency-key", "sse-1")],
            &msg(2),
        )
        .await;
        assert_eq!(again.json()["id"], 2);
        assert_eq!(again.json()["result"]["structuredContent"]["effect"], 1);
        assert_eq!(again.header("outrigger-replayed"), Some("true"));
        assert_eq!(mcp.effects().len(), 1);
    }
}

#[tokio::test]
async fn keys_are_derived_from_the_models_tool_call_ids() {
    let e = env().await;
    let task = [("outrigger-task-id", "task-derive")];
    let model = post_json(
        &e.sidecar.url("/v1/chat/completions"),
        &task,
        &json!({"model": "m", "messages": [{"role": "user", "content": "weather?"}]}),
    )
    .await;
    assert_eq!(model.status, StatusCode::OK);
    let calls = model.json()["choices"][0]["message"]["tool_calls"].clone();
    let args: serde_json::Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    // No Idempotency-Key: the sidecar matches the call to the model's tool call.
    let a = call(&e.sidecar, "/tools/payments/weather", None, &args, &task).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let key = a
        .header("outrigger-journal-key")
        .expect("journaled")
        .to_string();
    assert!(key.starts_with("tc-"), "{key}");
    // The agent restarts and repeats the call: deduplicated.
    let b = call(&e.sidecar, "/tools/payments/weather", None, &args, &task).await;
    assert_eq!(b.header("outrigger-replayed"), Some("true"));
    assert_eq!(e.tool.effects().len(), 1);
    // The explicit header names the tool call directly.
    let id = calls[1]["id"].as_str().unwrap().to_string();
    let mut h = task.to_vec();
    h.push(("outrigger-tool-call-id", &id));
    let c = call(
        &e.sidecar,
        "/tools/payments/other",
        None,
        &json!({"x": 1}),
        &h,
    )
    .await;
    assert!(
        c.header("outrigger-journal-key")
            .is_some_and(|k| k.starts_with("tc-"))
    );
    assert_eq!(e.tool.effects().len(), 2);
    assert_eq!(e.model.generation_count(), 1);
    // One that is there but empty is refused, not taken for no id (which would match
    // the call to another, or leave it unprotected).
    let mut h = task.to_vec();
    h.push(("outrigger-tool-call-id", " "));
    let d = call(&e.sidecar, "/tools/payments/weather", None, &args, &h).await;
    assert_eq!(d.status, StatusCode::BAD_REQUEST, "{}", d.text());
    assert!(d.text().contains("Outrigger-Tool-Call-Id"), "{}", d.text());
    // So is one without a task id, which would leave the call unprotected.
    let orphan = call(
        &e.sidecar,
        "/tools/payments/weather",
        None,
        &args,
        &[("outrigger-tool-call-id", "call_1")],
    )
    .await;
    assert_eq!(orphan.status, StatusCode::BAD_REQUEST, "{}", orphan.text());
    assert!(
        orphan.text().contains("Outrigger-Task-Id"),
        "{}",
        orphan.text()
    );
    assert_eq!(e.tool.effects().len(), 2);
}

#[tokio::test]
async fn the_audit_cli_reads_directly_or_through_the_admin_api() {
    let mut e = env().await;
    let task = [("outrigger-task-id", "audit-task")];
    for i in 0..3 {
        call(
            &e.sidecar,
            "/tools/payments/charge",
            Some(&format!("audit-{i}")),
            &json!({"n": i}),
            &task,
        )
        .await;
    }
    let data_dir = e.sidecar.dir.path().join("data");
    let admin = format!("http://{}", e.sidecar.admin);
    let run = |args: &[&str]| {
        let out = std::process::Command::new(outrigger_bin())
            .arg("journal")
            .args(args)
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--admin")
            .arg(&admin)
            .output()
            .expect("run the cli");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // While the sidecar runs: through the admin API.
    let (ok, out, err) = run(&["list", "--task", "audit-task"]);
    assert!(ok, "{err}");
    assert!(err.contains("through its admin API"), "{err}");
    assert!(
        out.contains("payments/audit-2") && out.contains("3 record(s)"),
        "{out}"
    );
    let (ok, out, _) = run(&["list", "--limit", "2"]);
    assert!(ok && out.contains("2 record(s)"), "{out}");
    let (ok, out, err) = run(&["export", "--task", "audit-task"]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 3, "{out}");
    let (ok, out, _) = run(&["timeline", "--task", "audit-task"]);
    assert!(ok && out.contains("3 call(s)"), "{out}");
    let (ok, out, _) = run(&["verify"]);
    assert!(ok && out.contains("intact"), "{out}");

    // The admin API answers a page at a time; a full page says where the next starts.
    let mut keys = Vec::new();
    let mut after = String::new();
    loop {
        let page = get(&e
            .sidecar
            .admin_url(&format!("/v1/journal?task=audit-task&limit=2{after}")))
        .await
        .json();
        let records = page["records"].as_array().cloned().unwrap_or_default();
        assert!(records.len() <= 2, "{page}");
        keys.extend(records.iter().map(|r| r["key"].to_string()));
        match page["next"].as_str() {
            Some(next) => after = format!("&after={next}"),
            None => break,
        }
    }
    let unique: std::collections::HashSet<&String> = keys.iter().collect();
    assert_eq!((keys.len(), unique.len()), (3, 3), "{keys:?}");
    let too_big = get(&e.sidecar.admin_url("/v1/journal?limit=1001")).await;
    assert_eq!(too_big.status, 400, "{}", too_big.text());

    // Stopped: directly from the directory.
    e.sidecar.kill();
    let (ok, out, err) = run(&["show", "payments/audit-1"]);
    assert!(ok, "{err}");
    assert!(err.contains("directly"), "{err}");
    let record: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(record["state"], "completed");
    assert_eq!(record["task_id"], "audit-task");
    let (ok, out, _) = run(&["export", "--tool", "payments"]);
    assert!(ok);
    assert_eq!(out.lines().count(), 3);
    for line in out.lines() {
        let r: serde_json::Value = serde_json::from_str(line).expect("JSON Lines");
        assert_eq!(r["v"], 1);
    }
    let (ok, out, _) = run(&["verify"]);
    assert!(ok && out.contains("intact"), "{out}");
    let (ok, _, err) = run(&["list", "--state", "sideways"]);
    assert!(!ok && err.contains("unknown state"), "{err}");
    // An export to a file that fails leaves the file an earlier one wrote as it was.
    let file = e.sidecar.dir.path().join("export.jsonl");
    let file_arg = file.to_string_lossy().into_owned();
    let (ok, _, err) = run(&["export", "--tool", "payments", "--out", &file_arg]);
    assert!(ok, "{err}");
    let before = std::fs::read_to_string(&file).expect("the export");
    assert_eq!(before.lines().count(), 3, "{before}");
    let (ok, _, err) = run(&["export", "--state", "sideways", "--out", &file_arg]);
    assert!(!ok && err.contains("unknown state"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).expect("kept"), before);
    assert!(!e.sidecar.dir.path().join("export.jsonl.partial").exists());
}

/// Randomized concurrent workload with duplicate keys: the checker finds nothing
/// lost, duplicated or unexpected.
#[tokio::test]
async fn randomized_concurrent_workload_with_duplicate_keys() {
    let e = env().await;
    e.tool.set_default(ToolBehaviour {
        delay: Duration::from_millis(5),
        ..ToolBehaviour::default()
    });
    let mut tasks = Vec::new();
    // 32 workers, 200 calls over 40 keys: every key is sent ~5 times, often at once.
    for w in 0..32u64 {
        let url = e.sidecar.url("/tools/payments/charge");
        tasks.push(tokio::spawn(async move {
            let mut history = Vec::new();
            let mut x = w.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            for _ in 0..6 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let k = format!("rk-{}", x % 40);
                let body = json!({"key": k});
                let r = post_json(
                    &url,
                    &[("idempotency-key", &k), ("prefer", "wait=5")],
                    &body,
                )
                .await;
                let outcome = match r.status {
                    StatusCode::OK => Outcome::Ok,
                    StatusCode::CONFLICT => Outcome::Info,
                    s => panic!("unexpected {s}: {}", r.text()),
                };
                history.push((k, outcome));
            }
            history
        }));
    }
    let mut history = Vec::new();
    for t in tasks {
        history.extend(t.await.expect("worker"));
    }
    let verdict = checker::check(&history, &e.tool.effects_by_key());
    assert!(verdict.is_clean(), "{verdict:?}");
    assert!(verdict.keys > 30);
}
