//! The model-call proxy: byte-identical relay in both dialects, credential
//! handling, bad input, client disconnects and the SIGTERM drain.

use std::time::Duration;

use http::{Method, StatusCode};
use outrigger_testing::provider::{Behaviour, MockProvider, StreamEnd};
use serde_json::json;

use crate::support::*;

const AGENT_KEY: &str = "sk-agent-canary-4b1d";
const PROVIDER_KEY: &str = "pk-provider-canary-77e2";

async fn setup(behaviour: Behaviour) -> (MockProvider, Sidecar) {
    let mock = MockProvider::start(behaviour).await.expect("mock");
    let config = format!(
        r#"
[limits]
max_body_bytes = 65536

[[providers]]
name = "mock-openai"
kind = "openai"
base_url = "{}"
api_key_env = "E2E_PROVIDER_KEY"
models = ["gpt-mock", "gpt-4o*"]

[[providers]]
name = "mock-anthropic"
kind = "anthropic"
base_url = "{}"
api_key_env = "E2E_PROVIDER_KEY"
models = ["claude-mock"]
"#,
        mock.openai_base(),
        mock.anthropic_base()
    );
    let sidecar = Sidecar::start(&config, &[("E2E_PROVIDER_KEY", PROVIDER_KEY)]).await;
    (mock, sidecar)
}

fn chat(model: &str, stream: bool) -> serde_json::Value {
    json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
}

fn messages(model: &str, stream: bool) -> serde_json::Value {
    json!({"model": model, "stream": stream, "max_tokens": 64,
           "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test]
async fn plain_and_streamed_bodies_arrive_byte_identical_in_both_dialects() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 12,
        tool_calls: 2,
        chunk_delay: Duration::from_millis(2),
        ..Behaviour::default()
    })
    .await;
    let cases = [
        ("/v1/chat/completions", chat("gpt-mock", false)),
        ("/v1/chat/completions", chat("gpt-4o-mini", true)),
        ("/v1/messages", messages("claude-mock", false)),
        ("/v1/messages", messages("claude-mock", true)),
    ];
    for (i, (path, body)) in cases.iter().enumerate() {
        let reply = post_json(&sidecar.url(path), &[], body).await;
        assert_eq!(reply.status, StatusCode::OK, "{path}: {}", reply.text());
        let exchange = &mock.exchanges()[i];
        assert_eq!(
            exchange.path.trim_start_matches("/v1"),
            path.trim_start_matches("/v1")
        );
        let sent = exchange.response_bytes();
        assert!(!sent.is_empty());
        assert_eq!(
            reply.body.as_ref(),
            sent.as_slice(),
            "{path} stream={}",
            body["stream"]
        );
        if body["stream"] == true {
            assert_eq!(reply.header("content-type"), Some("text/event-stream"));
        }
        assert!(reply.header("outrigger-request-id").is_some());
    }
}

#[tokio::test]
async fn streams_are_relayed_as_events_arrive() {
    let (_mock, sidecar) = setup(Behaviour {
        chunks: 6,
        chunk_delay: Duration::from_millis(300),
        ..Behaviour::default()
    })
    .await;
    let req = request(
        Method::POST,
        &sidecar.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        chat("gpt-mock", true).to_string(),
    );
    let started = std::time::Instant::now();
    let resp = open(req).await;
    let mut body = resp.into_body();
    let first = next_chunk(&mut body)
        .await
        .expect("a first chunk")
        .expect("ok");
    // The whole stream takes ≥ 1.8 s upstream; the first event must not wait for it.
    assert!(
        started.elapsed() < Duration::from_millis(1200),
        "first event after {:?}",
        started.elapsed()
    );
    assert!(first.starts_with(b"data: "));
}

#[tokio::test]
async fn agent_credentials_are_dropped_and_the_provider_key_is_injected() {
    let (mock, sidecar) = setup(Behaviour::default()).await;
    let auth = format!("Bearer {AGENT_KEY}");
    let reply = post_json(
        &sidecar.url("/v1/chat/completions"),
        &[
            ("authorization", &auth),
            ("x-custom", "kept"),
            ("accept-encoding", "gzip, deflate, br"),
        ],
        &chat("gpt-mock", false),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let reply = post_json(
        &sidecar.url("/v1/messages"),
        &[
            ("x-api-key", AGENT_KEY),
            ("anthropic-version", "2023-06-01"),
        ],
        &messages("claude-mock", false),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let ex = mock.exchanges();
    assert_eq!(
        ex[0].header("authorization"),
        Some(format!("Bearer {PROVIDER_KEY}").as_str())
    );
    assert_eq!(ex[0].header("x-custom"), Some("kept"));
    // The sidecar reads (and journals) what the provider answers: never compressed.
    assert_eq!(ex[0].header("accept-encoding"), Some("identity"));
    assert_eq!(ex[1].header("accept-encoding"), Some("identity"));
    assert_eq!(ex[1].header("x-api-key"), Some(PROVIDER_KEY));
    assert_eq!(ex[1].header("authorization"), None);
    for e in &ex {
        assert!(
            e.headers.iter().all(|(_, v)| !v.contains(AGENT_KEY)),
            "agent key forwarded: {:?}",
            e.headers
        );
    }
    assert!(
        !sidecar.logs().contains(PROVIDER_KEY),
        "provider key in the log"
    );
    assert!(!sidecar.logs().contains(AGENT_KEY), "agent key in the log");
}

#[tokio::test]
async fn bad_input_gets_a_problem_document_that_says_what_to_fix() {
    let (mock, sidecar) = setup(Behaviour::default()).await;
    let big =
        json!({"model": "gpt-mock", "messages": [{"role": "user", "content": "x".repeat(70_000)}]});
    let cases: Vec<(Reply, StatusCode, &str, &str)> = vec![
        (
            send(request(
                Method::POST,
                &sidecar.url("/v1/chat/completions"),
                &[("content-type", "application/json")],
                "{\"model\": ",
            ))
            .await,
            StatusCode::BAD_REQUEST,
            "malformed-json",
            "not valid JSON",
        ),
        (
            post_json(
                &sidecar.url("/v1/chat/completions"),
                &[],
                &chat("no-such-model", false),
            )
            .await,
            StatusCode::NOT_FOUND,
            "unknown-model",
            "gpt-mock",
        ),
        (
            post_json(&sidecar.url("/v1/chat/completions"), &[], &big).await,
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            "65536",
        ),
        (
            get(&sidecar.url("/v1/chat/completions")).await,
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "use POST",
        ),
        (
            post_json(
                &sidecar.url("/v1/chat/completions"),
                &[],
                &json!({"messages": []}),
            )
            .await,
            StatusCode::BAD_REQUEST,
            "invalid-request",
            "no \"model\"",
        ),
        (
            post_json(
                &sidecar.url("/v1/chat/completions"),
                &[("outrigger-task-id", "bad id!")],
                &chat("gpt-mock", false),
            )
            .await,
            StatusCode::BAD_REQUEST,
            "bad-header",
            "Outrigger-Task-Id",
        ),
        (
            get(&sidecar.url("/nowhere")).await,
            StatusCode::NOT_FOUND,
            "no-route",
            "/v1/chat/completions",
        ),
    ];
    for (reply, status, slug, hint) in cases {
        assert_eq!(reply.status, status, "{}", reply.text());
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        let doc = reply.json();
        assert_eq!(doc["type"], format!("urn:outrigger:problem:{slug}"));
        assert_eq!(doc["status"], status.as_u16());
        assert!(
            doc["detail"].as_str().unwrap_or_default().contains(hint),
            "{doc}"
        );
    }
    let reply = get(&sidecar.url("/v1/chat/completions")).await;
    assert_eq!(reply.header("allow"), Some("POST"));
    assert!(
        mock.exchanges().is_empty(),
        "bad input reached the provider"
    );
}

#[tokio::test]
async fn upstream_errors_pass_through_faithfully() {
    let (mock, sidecar) = setup(Behaviour::default()).await;
    // A client error is not retried: it arrives as the provider sent it.
    mock.push(Behaviour {
        status: Some(400),
        ..Behaviour::default()
    });
    let reply = post_json(
        &sidecar.url("/v1/messages"),
        &[],
        &messages("claude-mock", false),
    )
    .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        reply.body.as_ref(),
        mock.exchanges()[0].response_bytes().as_slice()
    );
    assert_eq!(mock.exchanges().len(), 1);
}

#[tokio::test]
async fn models_lists_the_configured_models() {
    let (_mock, sidecar) = setup(Behaviour::default()).await;
    let reply = get(&sidecar.url("/v1/models")).await;
    assert_eq!(reply.status, StatusCode::OK);
    let ids: Vec<String> = reply.json()["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(ids, ["gpt-mock", "claude-mock"]);
}

#[tokio::test]
async fn a_client_that_goes_away_releases_the_upstream_stream() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 50,
        chunk_delay: Duration::from_millis(50),
        ..Behaviour::default()
    })
    .await;
    let req = request(
        Method::POST,
        &sidecar.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        chat("gpt-mock", true).to_string(),
    );
    let resp = open(req).await;
    let mut body = resp.into_body();
    for _ in 0..2 {
        next_chunk(&mut body).await.expect("chunk").expect("ok");
    }
    drop(body);
    let released = eventually(Duration::from_secs(5), || {
        mock.exchanges().first().and_then(|e| e.stream_end()) == Some(StreamEnd::Dropped)
    })
    .await;
    assert!(
        released,
        "the upstream stream was not released: {:?}",
        mock.exchanges().first().map(|e| e.stream_end())
    );
}

#[tokio::test]
async fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let (mock, mut sidecar) = setup(Behaviour {
        chunks: 20,
        chunk_delay: Duration::from_millis(50),
        ..Behaviour::default()
    })
    .await;
    assert_eq!(
        get(&sidecar.admin_url("/readyz")).await.status,
        StatusCode::OK
    );
    let req = request(
        Method::POST,
        &sidecar.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        chat("gpt-mock", true).to_string(),
    );
    let resp = open(req).await;
    let mut body = resp.into_body();
    let mut received = next_chunk(&mut body)
        .await
        .expect("chunk")
        .expect("ok")
        .to_vec();
    sidecar.sigterm();
    // Readiness flips while the stream is still running (the signal is handled
    // asynchronously, so give it a moment on a loaded machine).
    let mut ready = get(&sidecar.admin_url("/readyz")).await;
    for _ in 0..100 {
        if ready.status != StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        ready = get(&sidecar.admin_url("/readyz")).await;
    }
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        ready.text()
    );
    assert!(ready.text().contains("draining"));
    while let Some(chunk) = next_chunk(&mut body).await {
        received.extend_from_slice(&chunk.expect("the in-flight stream completes"));
    }
    assert_eq!(received, mock.exchanges()[0].response_bytes());
    assert!(received.ends_with(b"data: [DONE]\n\n"));
    let status = sidecar.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "exit status {status}");
    assert!(sidecar.logs().contains("drained"));
}

#[tokio::test]
async fn admin_plane_serves_health_and_metrics() {
    let (_mock, sidecar) = setup(Behaviour::default()).await;
    post_json(
        &sidecar.url("/v1/chat/completions"),
        &[],
        &chat("gpt-mock", false),
    )
    .await;
    post_json(
        &sidecar.url("/v1/chat/completions"),
        &[],
        &chat("nope", false),
    )
    .await;
    assert_eq!(
        get(&sidecar.admin_url("/healthz")).await.status,
        StatusCode::OK
    );
    let metrics = get(&sidecar.admin_url("/metrics")).await;
    assert_eq!(metrics.status, StatusCode::OK);
    let text = metrics.text();
    assert!(text.contains("outrigger_http_requests_total{route=\"chat_completions\",target=\"mock-openai\",status=\"200\"} 1"), "{text}");
    assert!(text.contains("outrigger_http_requests_total{route=\"chat_completions\",target=\"-\",status=\"404\"} 1"), "{text}");
    assert!(text.contains("http_server_request_duration_seconds_bucket"));
    assert!(text.contains("outrigger_http_inflight"));
    // The data plane never serves admin routes.
    assert_eq!(
        get(&sidecar.url("/metrics")).await.status,
        StatusCode::NOT_FOUND
    );
}

/// Kills a child process when dropped, so a failed assertion leaves none behind.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The admin plane answers from the moment its port is bound. A second sidecar on a
/// journal the first one holds waits for the lock (`[journal] lock_wait`): meanwhile
/// `/healthz` is up, `/readyz` says what it waits for, and the other routes say it
/// is starting. Once the first exits, the second opens the journal and serves.
#[tokio::test]
async fn the_admin_plane_answers_while_start_up_waits_for_the_journal_lock() {
    let mut first = Sidecar::start("", &[]).await;
    let data_dir = first.dir.path().join("data");
    let admin_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("outrigger.toml");
    std::fs::write(
        &config,
        format!(
            "[listen]\ndata = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:{admin_port}\"\n\
             [journal]\ndir = {:?}\nlock_wait = \"60s\"\n",
            data_dir.display().to_string()
        ),
    )
    .expect("write config");
    let ready_file = dir.path().join("ready.json");
    let log = dir.path().join("outrigger.log");
    let second = Reaped(
        std::process::Command::new(outrigger_bin())
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .arg("--ready-file")
            .arg(&ready_file)
            .env_remove("OPENAI_API_KEY")
            .env_remove("ANTHROPIC_API_KEY")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn outrigger"),
    );
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    let admin = |path: &str| format!("http://127.0.0.1:{admin_port}{path}");

    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let ready = loop {
        if let Some(r) = try_get(&admin("/readyz")).await
            && r.text().contains("locked by another process")
        {
            break r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the waiting sidecar's readiness never named the lock:\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready.json()["ready"], false);
    assert!(
        ready.json()["reasons"][0].as_str().is_some_and(|r| r
            .starts_with("starting: opening the journal")
            && r.contains("lock_wait")),
        "{}",
        ready.text()
    );
    let health = get(&admin("/healthz")).await;
    assert_eq!(health.status, StatusCode::OK, "{}", health.text());
    let journal = get(&admin("/v1/journal")).await;
    assert_eq!(journal.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(journal.json()["type"], "urn:outrigger:problem:starting");
    assert_eq!(journal.header("retry-after"), Some("1"));
    assert!(
        !ready_file.exists(),
        "not started while the journal is held"
    );

    first.sigterm();
    assert!(first.wait_exit(Duration::from_secs(30)).await.success());
    assert!(
        eventually(Duration::from_secs(30), || ready_file.exists()).await,
        "started once the lock was let go:\n{}",
        logs()
    );
    let ready = get(&admin("/readyz")).await;
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.text());
    let journal = get(&admin("/v1/journal?view=stats")).await;
    assert_eq!(journal.status, StatusCode::OK, "{}", journal.text());
    drop(second);
}
