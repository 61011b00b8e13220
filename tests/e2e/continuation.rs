//! Continuing an interrupted text-only Anthropic stream (`continuation` on the
//! provider): the agent reads one message, stitched from the broken answer and its
//! continuation, with no second `message_start`; the continuation request carries
//! the text sent so far; a turn with a tool call is never continued; a continuation
//! that fails ends with the typed error event; usage is metered over both pieces;
//! the stitched stream replays byte-identical; and a cut after any event of a text
//! turn is continued until its stop reason came.

use std::time::Duration;

use http::{Method, StatusCode};
use outrigger_testing::provider::{Behaviour, MockProvider};
use serde_json::{Value, json};

use crate::support::*;

async fn setup(continuation: &str, default: Behaviour) -> (MockProvider, Sidecar) {
    let mock = MockProvider::start(default).await.expect("mock");
    let config = config("", &mock.anthropic_base(), continuation);
    let sidecar = Sidecar::start(&config, &[]).await;
    (mock, sidecar)
}

/// A configuration of `before`, then the Anthropic provider at `base` with
/// `continuation` set.
fn config(before: &str, base: &str, continuation: &str) -> String {
    provider_config(before, "anthropic", base, continuation)
}

/// A configuration of `before`, then one provider of `kind` (`an` serving
/// `claude-mock`, or `oa` serving `gpt-mock`) at `base` with `continuation` set.
fn provider_config(before: &str, kind: &str, base: &str, continuation: &str) -> String {
    let (name, model) = if kind == "openai" {
        ("oa", "gpt-mock")
    } else {
        ("an", "claude-mock")
    };
    format!(
        r#"{before}
[[providers]]
name = "{name}"
kind = "{kind}"
base_url = "{base}"
models = ["{model}"]
continuation = "{continuation}"
"#
    )
}

/// `b` cut after `events`, paced so that the first events reach the agent before the
/// cut (a cut before that is retried unseen instead).
fn cut(b: Behaviour, events: usize) -> Behaviour {
    Behaviour {
        cut_after: Some(events),
        chunk_delay: Duration::from_millis(20),
        ..b
    }
}

/// Two pieces of text, then a tool call.
fn with_tool() -> Behaviour {
    Behaviour {
        chunks: 2,
        tool_calls: 1,
        ..Behaviour::default()
    }
}

fn post(sidecar: &Sidecar, key: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    post_at(sidecar, "/v1/messages", "claude-mock", key)
}

/// A streamed request for `model` at `path`, under the `Idempotency-Key` `key`.
fn post_at(
    sidecar: &Sidecar,
    path: &str,
    model: &str,
    key: &str,
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    request(
        Method::POST,
        &sidecar.url(path),
        &[
            ("content-type", "application/json"),
            ("idempotency-key", key),
        ],
        json!({"model": model, "stream": true, "max_tokens": 99,
               "messages": [{"role": "user", "content": "go"}]})
        .to_string(),
    )
}

/// Each event's name and JSON data (ids and framing dropped).
fn parsed(body: &[u8]) -> Vec<(String, Value)> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let mut name = String::new();
            let mut data = Value::Null;
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(d).unwrap_or(Value::Null);
                }
            }
            (name, data)
        })
        .collect()
}

fn named<'a>(events: &'a [(String, Value)], name: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, d)| d)
        .collect()
}

/// The text the agent read.
fn text(events: &[(String, Value)]) -> String {
    named(events, "content_block_delta")
        .iter()
        .filter_map(|d| d["delta"]["text"].as_str())
        .collect()
}

/// The usage a provider's answer reported: its `message_start` input, and its
/// `message_delta` output (0 when it never came).
fn reported(body: &[u8]) -> (u64, u64) {
    let events = parsed(body);
    let input = named(&events, "message_start")
        .first()
        .and_then(|d| d["message"]["usage"]["input_tokens"].as_u64())
        .unwrap_or(0);
    let output = named(&events, "message_delta")
        .first()
        .and_then(|d| d["usage"]["output_tokens"].as_u64())
        .unwrap_or(0);
    (input, output)
}

/// The sum of a metric's series that carry `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> u64 {
    crate::matrix::series_sum(text, name, labels) as u64
}

#[tokio::test]
async fn a_text_only_stream_cut_mid_way_is_continued_into_one_message() {
    let (mock, mut sidecar) = setup("prefill", Behaviour::default()).await;
    // message_start, the text block's start, a ping and two deltas, then the
    // connection drops; the continuation is the mock's whole default answer.
    mock.push(cut(Behaviour::default(), 5));
    let first = send(post(&sidecar, "stitched")).await;
    assert_eq!(first.status, StatusCode::OK);
    let events = parsed(&first.body);
    let exchanges = mock.exchanges();
    assert_eq!(exchanges.len(), 2, "the broken answer and its continuation");

    // The continuation prefilled the text the agent had, less its trailing space,
    // and asked for what was left of max_tokens (12 bytes of text: 3 tokens).
    let sent: Value = serde_json::from_slice(&exchanges[1].body).unwrap();
    let messages = sent["messages"].as_array().unwrap();
    assert_eq!(
        messages.last().unwrap(),
        &json!({"role": "assistant", "content": "word0 word1"})
    );
    assert_eq!(sent["max_tokens"], 96);

    // One message: one start, one text block, one stop, no error.
    assert_eq!(named(&events, "message_start").len(), 1, "{}", first.text());
    assert_eq!(named(&events, "content_block_start").len(), 1);
    assert_eq!(named(&events, "message_stop").len(), 1);
    assert!(named(&events, "error").is_empty(), "{}", first.text());
    assert!(
        named(&events, "content_block_delta")
            .iter()
            .chain(named(&events, "content_block_stop").iter())
            .all(|d| d["index"] == 0),
        "the continuation goes on in the open block: {}",
        first.text()
    );
    // The first piece's text, then the continuation's (the mock does not really
    // continue: it answers its whole text again).
    let continuation: String = (0..8).map(|i| format!("word{i} ")).collect();
    assert_eq!(text(&events), format!("word0 word1 {continuation}"));
    // Ids run on without a gap.
    let body = first.text();
    for (i, e) in body.split_inclusive("\n\n").enumerate() {
        assert!(has_id(e, 1, i as u64), "{e}");
    }

    // Replayed by key: the same bytes.
    let again = send(post(&sidecar, "stitched")).await;
    assert_eq!(again.header("outrigger-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(mock.exchanges().len(), 2, "not generated again");

    // Metered over both pieces: both prompts, the first piece's text estimated (3
    // tokens) and what the continuation reported.
    let (in1, _) = reported(&exchanges[0].response_bytes());
    let (in2, out2) = reported(&exchanges[1].response_bytes());
    assert!(
        in1 > 0 && in2 > in1,
        "the continuation's prompt holds the prefill"
    );
    let text = get(&sidecar.admin_url("/metrics")).await.text();
    let sum = |t: &str| metric(&text, "gen_ai_client_token_usage_sum", &[t]);
    assert_eq!(sum("gen_ai_token_type=\"input\""), in1 + in2, "{text}");
    assert_eq!(sum("gen_ai_token_type=\"output\""), 3 + out2, "{text}");
    assert_eq!(
        metric(
            &text,
            "outrigger_stream_continuations_total",
            &["result=\"continued\""]
        ),
        1,
        "{text}"
    );

    // The journal's end record says so, and counts both pieces: through the admin
    // API while the sidecar runs, and from the directory once it is stopped.
    let key = first.header("outrigger-stream-key").unwrap().to_owned();
    let meta = get(&sidecar.admin_url(&format!(
        "/v1/journal?view=stream&key={}",
        key.replace('/', "%2F")
    )))
    .await
    .json();
    assert_eq!(meta["state"], "completed", "{meta}");
    assert_eq!(meta["end"]["continued"], 1, "{meta}");
    assert_eq!(meta["end"]["usage"]["input_tokens"], in1 + in2, "{meta}");
    assert_eq!(meta["end"]["usage"]["output_tokens"], 3 + out2, "{meta}");
    let cli = |sidecar: &Sidecar| {
        let out = std::process::Command::new(outrigger_bin())
            .args(["journal", "stream", &key, "--data-dir"])
            .arg(sidecar.dir.path().join("data"))
            .arg("--admin")
            .arg(format!("http://{}", sidecar.admin))
            .output()
            .expect("run the cli");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).expect("json")
    };
    assert_eq!(cli(&sidecar), meta);
    sidecar.kill();
    assert_eq!(cli(&sidecar)["end"], meta["end"]);
}

#[tokio::test]
async fn an_instruction_continuation_asks_in_a_user_message_and_starts_a_new_block_after_a_closed_one()
 {
    let (mock, sidecar) = setup("instruction", Behaviour::default()).await;
    // The whole text block (start, a ping, 2 deltas, stop) after message_start,
    // then the cut.
    let two = Behaviour {
        chunks: 2,
        ..Behaviour::default()
    };
    mock.push(cut(two, 6));
    let first = send(post(&sidecar, "asked")).await;
    let events = parsed(&first.body);
    let exchanges = mock.exchanges();
    assert_eq!(exchanges.len(), 2);
    let sent: Value = serde_json::from_slice(&exchanges[1].body).unwrap();
    let last = sent["messages"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["role"], "user");
    assert!(
        last["content"].as_str().unwrap().contains("word0 word1"),
        "{last}"
    );
    let starts: Vec<u64> = named(&events, "content_block_start")
        .iter()
        .map(|d| d["index"].as_u64().unwrap())
        .collect();
    assert_eq!(starts, [0, 1], "{}", first.text());
    assert_eq!(named(&events, "message_start").len(), 1);
    assert_eq!(named(&events, "message_stop").len(), 1);
}

#[tokio::test]
async fn a_turn_cut_inside_a_tool_call_is_not_continued() {
    let (mock, sidecar) = setup("prefill", Behaviour::default()).await;
    // message_start, the text block (5 events with a ping and 2 deltas), the tool
    // block's start and a part of its input, then the cut.
    mock.push(cut(with_tool(), 8));
    let first = send(post(&sidecar, "tool")).await;
    let events = parsed(&first.body);
    assert_eq!(mock.exchanges().len(), 1, "nothing was continued");
    let last = events.last().unwrap();
    assert_eq!(last.0, "error", "{}", first.text());
    assert!(named(&events, "message_stop").is_empty());
    assert!(
        !first.text().contains("tool_use"),
        "no part of the tool call: {}",
        first.text()
    );
}

#[tokio::test]
async fn a_continuation_the_provider_refuses_ends_with_the_typed_error() {
    let (mock, sidecar) = setup("prefill", Behaviour::default()).await;
    mock.push(cut(Behaviour::default(), 5));
    mock.push(Behaviour {
        status: Some(529),
        ..Behaviour::default()
    });
    let first = send(post(&sidecar, "refused")).await;
    let events = parsed(&first.body);
    assert_eq!(mock.exchanges().len(), 2);
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error", "{}", first.text());
    let message = data["error"]["message"].as_str().unwrap();
    assert!(message.contains("continuing it failed"), "{message}");
    assert!(message.contains("529"), "{message}");
    assert!(named(&events, "message_stop").is_empty());
    let text = get(&sidecar.admin_url("/metrics")).await.text();
    assert_eq!(
        metric(
            &text,
            "outrigger_stream_continuations_total",
            &["result=\"failed\""]
        ),
        1,
        "{text}"
    );
}

/// A text-only turn cut after each of its events in turn: up to its last text block's
/// stop it is continued into one message (one `message_start`, one `message_stop`,
/// the text the agent had and then the continuation's, in one block while the cut
/// left it open, in a second when it did not), and replays byte-identical; once its
/// stop reason came it is not continued: it ends with the typed error, and its
/// repeat generates afresh.
#[tokio::test]
async fn a_text_only_turn_cut_after_any_event_is_continued_until_its_stop_reason() {
    let (mock, sidecar) = setup("prefill", Behaviour::default()).await;
    // message_start, content_block_start, ping, 8 deltas, content_block_stop,
    // message_delta, message_stop.
    let deltas = 8;
    let whole: String = (0..deltas).map(|i| format!("word{i} ")).collect();
    for cut_at in 1..=13 {
        mock.push(cut(Behaviour::default(), cut_at));
        let before = mock.exchanges().len();
        let key = format!("sweep-{cut_at}");
        let first = send(post(&sidecar, &key)).await;
        let events = parsed(&first.body);
        let said = format!("cut after {cut_at}: {}", first.text());
        let sent = cut_at.saturating_sub(3).min(deltas);
        let prefix: String = (0..sent).map(|i| format!("word{i} ")).collect();
        if cut_at <= 12 {
            assert_eq!(mock.exchanges().len(), before + 2, "{said}");
            assert_eq!(named(&events, "message_start").len(), 1, "{said}");
            assert_eq!(named(&events, "message_stop").len(), 1, "{said}");
            assert!(named(&events, "error").is_empty(), "{said}");
            assert_eq!(text(&events), format!("{prefix}{whole}"), "{said}");
            let starts: Vec<u64> = named(&events, "content_block_start")
                .iter()
                .map(|d| d["index"].as_u64().unwrap())
                .collect();
            // Cut before the text block began (after message_start), or after it
            // stopped, the continuation's block is one of its own.
            let want: &[u64] = match cut_at {
                1 => &[0],
                12 => &[0, 1],
                _ => &[0],
            };
            assert_eq!(starts, want, "{said}");
        } else {
            assert_eq!(mock.exchanges().len(), before + 1, "{said}");
            assert_eq!(events.last().unwrap().0, "error", "{said}");
            assert!(named(&events, "message_stop").is_empty(), "{said}");
        }
        // A completed turn replays; an abandoned one generates afresh (attempt 2).
        let again = send(post(&sidecar, &key)).await;
        if cut_at <= 12 {
            assert_eq!(again.body, first.body, "{said}");
        } else {
            assert!(has_id(&again.text(), 2, 0), "{}", again.text());
        }
    }
}

/// A body fed through a channel: each item a chunk, or the error that breaks the
/// connection.
struct Fed(tokio::sync::mpsc::UnboundedReceiver<Result<bytes::Bytes, String>>);

impl hyper::body::Body for Fed {
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|item| item.map(|r| r.map(hyper::body::Frame::data).map_err(Into::into)))
    }
}

/// An Anthropic upstream whose first answer sends `message_start`, a text block's
/// start and one delta, then breaks; the second (the continuation) gets each chunk
/// of `second` written to it after its delay (in milliseconds), and is then held
/// open (its sender is kept).
async fn breaking_upstream(
    second: &'static [(u64, &'static str)],
) -> outrigger_testing::http::Server {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    let count = Arc::new(AtomicUsize::new(0));
    let held = Arc::new(Mutex::new(Vec::new()));
    outrigger_testing::http::Server::start(
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        move |req| {
            let n = count.fetch_add(1, Ordering::SeqCst);
            let held = held.clone();
            async move {
                let _ = outrigger_testing::http::read_body(req.into_body()).await;
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                if n == 0 {
                    tokio::spawn(async move {
                        for ev in [
                            r#"{"type":"message_start","message":{"id":"msg_1","model":"claude-mock","usage":{"input_tokens":9,"output_tokens":1}}}"#,
                            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
                            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
                        ] {
                            let name = serde_json::from_str::<Value>(ev).unwrap()["type"]
                                .as_str()
                                .unwrap()
                                .to_owned();
                            let _ = tx.send(Ok(format!("event: {name}\ndata: {ev}\n\n").into()));
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        let _ = tx.send(Err("cut".to_owned()));
                    });
                } else {
                    tokio::spawn(async move {
                        for (delay, chunk) in second {
                            tokio::time::sleep(Duration::from_millis(*delay)).await;
                            let _ = tx.send(Ok(bytes::Bytes::from_static(chunk.as_bytes())));
                        }
                        held.lock().unwrap().push(tx);
                    });
                }
                let mut resp = http::Response::new(
                    http_body_util::BodyExt::boxed_unsync(Fed(rx)),
                );
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("text/event-stream"),
                );
                resp
            }
        },
    )
    .await
    .expect("upstream")
}

/// A continuation is an attempt like any other before its first event: one that
/// says nothing within `first_byte_timeout`, or opens with the provider's error
/// event, ends the turn with the typed error that says so. A keep-alive comment is
/// no event, but as the answer's first bytes it ends the first-byte wait: from then
/// on the first event may take as long as any other (`stream_idle_timeout`).
#[tokio::test]
async fn a_continuation_that_stalls_or_opens_with_an_error_ends_with_the_typed_error() {
    const OVERLOADED: &str = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
    let cases: [(&[(u64, &str)], &str); 4] = [
        (&[], "no event within 300ms"),
        (
            &[(0, ": keep-alive\n\n")],
            "its answer broke before its first event",
        ),
        (
            &[(0, OVERLOADED)],
            "opened with an error event (overloaded_error)",
        ),
        (
            &[(0, ": keep-alive\n\n"), (0, OVERLOADED)],
            "opened with an error event (overloaded_error)",
        ),
    ];
    for (second, says) in cases {
        let upstream = breaking_upstream(second).await;
        let config = config(
            "[limits]\nfirst_byte_timeout = \"300ms\"\nstream_idle_timeout = \"1s\"\n",
            &upstream.url(),
            "prefill",
        );
        let sidecar = Sidecar::start(&config, &[]).await;
        let started = std::time::Instant::now();
        let first = send(post(&sidecar, "stalled")).await;
        let events = parsed(&first.body);
        assert_eq!(text(&events), "Hello", "{}", first.text());
        let (name, data) = events.last().unwrap();
        assert_eq!(name, "error", "{}", first.text());
        let message = data["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(
            !first
                .text()
                .contains("overloaded_error\",\"message\":\"Overloaded"),
            "the provider's error event is not passed on as the turn's: {}",
            first.text()
        );
    }
}

/// A continuation that sends a keep-alive comment at once and its first event only
/// after `first_byte_timeout` (a model thinking) is waited for, as a first attempt's
/// would be: the turn is continued.
#[tokio::test]
async fn a_continuation_that_keeps_alive_before_its_first_event_is_waited_for() {
    const REST: &[(u64, &str)] = &[
        (0, ": keep-alive\n\n"),
        (
            500,
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_2\",\"model\":\"claude-mock\",\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n\
             event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
             event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" world\"}}\n\n\
             event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
             event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":2}}\n\n\
             event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        ),
    ];
    let upstream = breaking_upstream(REST).await;
    let config = config(
        "[limits]\nfirst_byte_timeout = \"300ms\"\n",
        &upstream.url(),
        "prefill",
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    let first = send(post(&sidecar, "kept-alive")).await;
    let events = parsed(&first.body);
    assert!(named(&events, "error").is_empty(), "{}", first.text());
    assert_eq!(named(&events, "message_start").len(), 1, "{}", first.text());
    assert_eq!(named(&events, "message_stop").len(), 1, "{}", first.text());
    assert_eq!(text(&events), "Hello world", "{}", first.text());
}

/// A continuation answered with a rate limit is news to the provider's limiter, as
/// an attempt's would be: the turn ends with the typed error, and the limiter pauses
/// for the `Retry-After`, so the next call to that provider waits it out.
#[tokio::test]
async fn a_continuation_answered_with_a_rate_limit_pauses_the_providers_limiter() {
    let (mock, sidecar) = setup("prefill", Behaviour::default()).await;
    mock.push(cut(Behaviour::default(), 5));
    mock.push(Behaviour {
        status: Some(429),
        retry_after: Some(2),
        ..Behaviour::default()
    });
    let first = send(post(&sidecar, "rate-limited")).await;
    let events = parsed(&first.body);
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error", "{}", first.text());
    let message = data["error"]["message"].as_str().unwrap();
    assert!(message.contains("continuing it failed"), "{message}");
    assert!(message.contains("429"), "{message}");
    let started = std::time::Instant::now();
    let next = send(post(&sidecar, "after-the-rate-limit")).await;
    let waited = started.elapsed();
    assert_eq!(next.status, StatusCode::OK, "{}", next.text());
    assert_eq!(mock.exchanges().len(), 3);
    assert!(
        waited >= Duration::from_millis(1500),
        "the next call waited out the pause: {waited:?}"
    );
}

/// Reads a streamed message through the sidecar with the stock Anthropic SDK
/// (`messages.stream(...).get_final_message()`): its content blocks, stop reason
/// and output usage, or the class and message of what the SDK raised.
/// A turn of two text pieces and a tool call, cut after `events` (inside the tool
/// call), read by an SDK (`read`): it raises `class` on the typed error event, and
/// the turn is not continued.
fn raises_on_a_cut_tool_call(
    mock: &MockProvider,
    read: impl Fn(&str) -> Value,
    events: usize,
    key: &str,
    class: &str,
) {
    let before = mock.exchanges().len();
    mock.push(cut(with_tool(), events));
    let raised = tokio::task::block_in_place(|| read(key));
    assert_eq!(raised["raised"], class, "{raised}");
    let said = raised["message"].as_str().unwrap();
    assert!(
        said.contains("the upstream stream was interrupted"),
        "{said}"
    );
    assert_eq!(
        mock.exchanges().len(),
        before + 1,
        "the tool turn was not continued"
    );
}

/// Runs an SDK `script` against the sidecar under the `Idempotency-Key` `key`: what
/// it printed, as JSON.
fn sdk_read(python: &std::path::Path, script: &str, sidecar: &Sidecar, key: &str) -> Value {
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .env("BASE", format!("http://{}", sidecar.data))
        .env("KEY", key)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Value>(&out.stdout).expect("json")
}

const SDK_READER: &str = r#"
import json, os, sys
import anthropic
client = anthropic.Anthropic(base_url=os.environ["BASE"], api_key="unused", max_retries=0,
                             default_headers={"Idempotency-Key": os.environ["KEY"]})
try:
    with client.messages.stream(model="claude-mock", max_tokens=99,
                                messages=[{"role": "user", "content": "go"}]) as s:
        m = s.get_final_message()
    print(json.dumps({"content": [b.model_dump(mode="json") for b in m.content],
                      "stop_reason": m.stop_reason, "output_tokens": m.usage.output_tokens}))
except anthropic.APIError as e:
    print(json.dumps({"raised": type(e).__name__, "message": str(e)}))
"#;

/// The stock Anthropic SDK reads a continued turn as one message: one text block
/// holding both pieces' text, the continuation's stop reason. A turn cut inside a
/// tool call is not continued, and the SDK raises on its typed error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_sdk_reads_a_continued_turn_as_one_message() {
    let Some(python) = crate::example_agent::python() else {
        return;
    };
    let (mock, sidecar) = setup("prefill", Behaviour::default()).await;
    let read = |key: &str| sdk_read(&python, SDK_READER, &sidecar, key);

    mock.push(cut(Behaviour::default(), 5));
    let message = tokio::task::block_in_place(|| read("sdk-continued"));
    let continuation: String = (0..8).map(|i| format!("word{i} ")).collect();
    assert_eq!(
        message["content"],
        json!([{"type": "text", "text": format!("word0 word1 {continuation}"), "citations": null}]),
        "{message}"
    );
    assert_eq!(message["stop_reason"], "end_turn", "{message}");
    assert_eq!(mock.exchanges().len(), 2);

    raises_on_a_cut_tool_call(&mock, read, 8, "sdk-tool", "APIStatusError");
}

// === OpenAI chat completions (by instruction) ===

async fn setup_openai() -> (MockProvider, Sidecar) {
    let mock = MockProvider::start(Behaviour::default())
        .await
        .expect("mock");
    let config = provider_config("", "openai", &mock.openai_base(), "instruction");
    let sidecar = Sidecar::start(&config, &[]).await;
    (mock, sidecar)
}

fn post_openai(sidecar: &Sidecar, key: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    post_at(sidecar, "/v1/chat/completions", "gpt-mock", key)
}

/// Each chunk's JSON data (`Value::Null` for `[DONE]`), and whether `[DONE]` came.
fn chunks(body: &[u8]) -> (Vec<Value>, usize) {
    let mut out = Vec::new();
    let mut done = 0;
    for e in String::from_utf8_lossy(body)
        .split("\n\n")
        .filter(|e| !e.is_empty())
    {
        for line in e.lines() {
            match line.strip_prefix("data: ") {
                Some("[DONE]") => done += 1,
                Some(d) => out.push(serde_json::from_str(d).unwrap_or(Value::Null)),
                None => {}
            }
        }
    }
    (out, done)
}

fn chat_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect()
}

/// The usage an OpenAI answer reported in its usage chunk.
fn chat_reported(body: &[u8]) -> (u64, u64) {
    let (all, _) = chunks(body);
    all.iter()
        .find(|c| c["usage"].is_object())
        .map(|c| {
            let u = &c["usage"];
            (
                u["prompt_tokens"].as_u64().unwrap_or(0),
                u["completion_tokens"].as_u64().unwrap_or(0),
            )
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn an_openai_text_turn_cut_mid_way_is_continued_by_instruction_into_one_completion() {
    let (mock, sidecar) = setup_openai().await;
    // The role chunk and two pieces of text, then the connection drops.
    mock.push(cut(Behaviour::default(), 3));
    let first = send(post_openai(&sidecar, "chat-stitched")).await;
    assert_eq!(first.status, StatusCode::OK);
    let exchanges = mock.exchanges();
    assert_eq!(exchanges.len(), 2, "the broken answer and its continuation");

    // The continuation quotes the text in a user message, asks for what is left of
    // max_tokens (12 bytes: 3 tokens), and asks for its usage.
    let sent: Value = serde_json::from_slice(&exchanges[1].body).unwrap();
    let last = sent["messages"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["role"], "user");
    assert!(
        last["content"]
            .as_str()
            .unwrap()
            .contains("\n\nword0 word1\n\n"),
        "{last}"
    );
    assert_eq!(sent["max_tokens"], 96);
    assert_eq!(sent["stream_options"]["include_usage"], true);

    // One completion: one id, one role, one finish reason, one [DONE], no error, and
    // no usage chunk (the agent did not ask for one).
    let (all, done) = chunks(&first.body);
    let said = first.text();
    assert_eq!(done, 1, "{said}");
    assert!(all.iter().all(|c| c["id"] == "chatcmpl-mock-1"), "{said}");
    assert!(
        all.iter()
            .all(|c| c.get("error").is_none() && c.get("usage").is_none()),
        "{said}"
    );
    let roles = all
        .iter()
        .filter(|c| !c["choices"][0]["delta"]["role"].is_null())
        .count();
    assert_eq!(roles, 1, "{said}");
    let finishes: Vec<&Value> = all
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, [&json!("stop")], "{said}");
    let continuation: String = (0..8).map(|i| format!("word{i} ")).collect();
    assert_eq!(chat_text(&all), format!("word0 word1 {continuation}"));
    for (i, e) in said.split_inclusive("\n\n").enumerate() {
        assert!(has_id(e, 1, i as u64), "{e}");
    }

    // Replayed by key: the same bytes.
    let again = send(post_openai(&sidecar, "chat-stitched")).await;
    assert_eq!(again.header("outrigger-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(mock.exchanges().len(), 2, "not generated again");

    // Metered over both pieces: the broken piece's prompt and text estimated (4
    // bytes a token: OpenAI reports nothing before the end), the continuation's
    // usage as it reported it.
    let in1 = (exchanges[0].body.len() / 4) as u64;
    let (in2, out2) = chat_reported(&exchanges[1].response_bytes());
    assert!(in2 > in1, "the continuation's prompt quotes the text");
    let text = get(&sidecar.admin_url("/metrics")).await.text();
    let sum = |t: &str| metric(&text, "gen_ai_client_token_usage_sum", &[t]);
    assert_eq!(sum("gen_ai_token_type=\"input\""), in1 + in2, "{text}");
    assert_eq!(sum("gen_ai_token_type=\"output\""), 3 + out2, "{text}");
    let key = first.header("outrigger-stream-key").unwrap().to_owned();
    let meta = get(&sidecar.admin_url(&format!(
        "/v1/journal?view=stream&key={}",
        key.replace('/', "%2F")
    )))
    .await
    .json();
    assert_eq!(meta["end"]["continued"], 1, "{meta}");
    assert_eq!(meta["end"]["usage"]["input_tokens"], in1 + in2, "{meta}");
}

/// An OpenAI text turn (the role chunk, 8 pieces, the finish chunk, `[DONE]`) cut
/// after each of its events: continued into one completion until its finish reason
/// came; after that it ends with the typed error event, never a faked `[DONE]`.
#[tokio::test]
async fn an_openai_text_turn_cut_after_any_event_is_continued_until_its_finish_reason() {
    let (mock, sidecar) = setup_openai().await;
    let whole: String = (0..8).map(|i| format!("word{i} ")).collect();
    for cut_at in 1..=10 {
        mock.push(cut(Behaviour::default(), cut_at));
        let before = mock.exchanges().len();
        let first = send(post_openai(&sidecar, &format!("chat-sweep-{cut_at}"))).await;
        let (all, done) = chunks(&first.body);
        let said = format!("cut after {cut_at}: {}", first.text());
        if cut_at <= 9 {
            let prefix: String = (0..cut_at - 1).map(|i| format!("word{i} ")).collect();
            assert_eq!(mock.exchanges().len(), before + 2, "{said}");
            assert_eq!(done, 1, "{said}");
            assert!(all.iter().all(|c| c.get("error").is_none()), "{said}");
            assert_eq!(chat_text(&all), format!("{prefix}{whole}"), "{said}");
        } else {
            assert_eq!(mock.exchanges().len(), before + 1, "{said}");
            assert_eq!(done, 0, "{said}");
            let last = all.last().unwrap();
            assert_eq!(last["error"]["type"], "stream_interrupted", "{said}");
        }
        let again = send(post_openai(&sidecar, &format!("chat-sweep-{cut_at}"))).await;
        if cut_at <= 9 {
            assert_eq!(again.body, first.body, "{said}");
        }
    }
}

#[tokio::test]
async fn an_openai_turn_cut_inside_a_tool_call_is_not_continued() {
    let (mock, sidecar) = setup_openai().await;
    // The role chunk, two pieces of text, the tool call's head, then the cut.
    mock.push(cut(with_tool(), 4));
    let first = send(post_openai(&sidecar, "chat-tool")).await;
    let (all, done) = chunks(&first.body);
    let said = first.text();
    assert_eq!(mock.exchanges().len(), 1, "nothing was continued: {said}");
    assert_eq!(done, 0, "{said}");
    assert_eq!(
        all.last().unwrap()["error"]["type"],
        "stream_interrupted",
        "{said}"
    );
    assert!(
        !said.contains("tool_calls"),
        "no part of the tool call: {said}"
    );
}

const OPENAI_SDK_READER: &str = r#"
import json, os
import openai
client = openai.OpenAI(base_url=os.environ["BASE"] + "/v1", api_key="unused", max_retries=0,
                       default_headers={"Idempotency-Key": os.environ["KEY"]})
try:
    with client.chat.completions.stream(model="gpt-mock", max_tokens=99,
                                        messages=[{"role": "user", "content": "go"}]) as s:
        c = s.get_final_completion()
    choice = c.choices[0]
    print(json.dumps({"id": c.id, "content": choice.message.content, "role": choice.message.role,
                      "finish_reason": choice.finish_reason, "choices": len(c.choices)}))
except openai.APIError as e:
    print(json.dumps({"raised": type(e).__name__, "message": str(e)}))
"#;

/// The stock OpenAI SDK reads a continued turn as one completion: one choice whose
/// message holds both pieces' text, under the first piece's id, with the
/// continuation's finish reason. A turn cut inside a tool call is not continued, and
/// the SDK raises on its typed error chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_reads_a_continued_turn_as_one_completion() {
    let Some(python) = crate::example_agent::python() else {
        return;
    };
    let (mock, sidecar) = setup_openai().await;
    let read = |key: &str| sdk_read(&python, OPENAI_SDK_READER, &sidecar, key);

    mock.push(cut(Behaviour::default(), 3));
    let completion = tokio::task::block_in_place(|| read("sdk-chat-continued"));
    let continuation: String = (0..8).map(|i| format!("word{i} ")).collect();
    assert_eq!(
        completion,
        json!({"id": "chatcmpl-mock-1", "content": format!("word0 word1 {continuation}"),
               "role": "assistant", "finish_reason": "stop", "choices": 1}),
    );
    assert_eq!(mock.exchanges().len(), 2);

    raises_on_a_cut_tool_call(&mock, read, 4, "sdk-chat-tool", "APIError");
}

/// A continuation goes through its provider's breaker: while another call's
/// failure has opened the circuit, the broken turn is not continued (the provider
/// is not asked) and ends with the typed error naming the open circuit.
#[tokio::test]
async fn a_continuation_is_not_sent_to_a_provider_whose_circuit_is_open() {
    let mock = MockProvider::start(Behaviour::default())
        .await
        .expect("mock");
    let config = config(
        "[resilience]\nbreaker_failures = 1\nbreaker_min_penalty = \"30s\"\n\
         breaker_max_penalty = \"60s\"\n",
        &mock.anthropic_base(),
        "prefill",
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    // The turn is cut after its fifth event, 100 ms in; meanwhile another call is
    // answered 500 and opens the circuit.
    mock.push(cut(Behaviour::default(), 5));
    mock.push(Behaviour {
        status: Some(500),
        ..Behaviour::default()
    });
    let turn = tokio::spawn(send(post(&sidecar, "open-circuit")));
    tokio::time::sleep(Duration::from_millis(30)).await;
    let failing = send(post(&sidecar, "failing")).await;
    assert_eq!(failing.status.as_u16() / 100, 5, "{}", failing.text());
    let turn = turn.await.expect("the turn");
    let events = parsed(&turn.body);
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error", "{}", turn.text());
    let message = data["error"]["message"].as_str().unwrap();
    assert!(message.contains("continuing it failed"), "{message}");
    assert!(message.contains("circuit is open"), "{message}");
    assert_eq!(
        mock.exchanges().len(),
        2,
        "the provider was not asked again"
    );
}
