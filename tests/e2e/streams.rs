//! Journaled model streams: replay, resume after a client drop (detach, don't
//! cancel), interruptions at every event boundary and inside events in both dialects
//! (never a partial tool call; a typed error event), deterministic replay inside a
//! task, cancellation, the bounds of a detached generation (time and size), a stream
//! past its retention (expired, then forgotten), a SIGKILL of the sidecar mid-stream
//! in both dialects, and providers' oddities
//! (a byte order mark, a plain answer to a streamed request).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use outrigger_testing::provider::{Behaviour, MockProvider, StreamEnd};
use outrigger_testing::sse::{self as mock_sse, Generation};
use serde_json::json;

use crate::support::*;

/// The number of the closing error event the journal does not hold (`u64::MAX`).
const CLOSING: u64 = u64::MAX;

async fn setup(behaviour: Behaviour) -> (MockProvider, Sidecar) {
    setup_with(behaviour, "").await
}

/// [`setup`], with `extra` configuration before its sections.
async fn setup_with(behaviour: Behaviour, extra: &str) -> (MockProvider, Sidecar) {
    let mock = MockProvider::start(behaviour).await.expect("mock");
    let config = format!(
        r#"{extra}
# Retry budgets and breakers are tested elsewhere; here every cut before the first
# event must be retried invisibly, however many there are.
[resilience]
breaker_failures = 1000
retry_budget_min = 1000

[[providers]]
name = "oa"
kind = "openai"
base_url = "{}"
models = ["gpt-mock"]

[[providers]]
name = "an"
kind = "anthropic"
base_url = "{}"
models = ["claude-mock"]
"#,
        mock.openai_base(),
        mock.anthropic_base()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    (mock, sidecar)
}

#[derive(Clone, Copy, Debug)]
enum D {
    OpenAi,
    Anthropic,
}

impl D {
    fn path(self) -> &'static str {
        match self {
            D::OpenAi => "/v1/chat/completions",
            D::Anthropic => "/v1/messages",
        }
    }
    fn body(self, stream: bool) -> serde_json::Value {
        match self {
            D::OpenAi => {
                json!({"model": "gpt-mock", "stream": stream, "messages": [{"role": "user", "content": "go"}]})
            }
            D::Anthropic => json!({"model": "claude-mock", "stream": stream, "max_tokens": 99,
                                   "messages": [{"role": "user", "content": "go"}]}),
        }
    }
}

/// `GET /v1/streams/{key}` after the event `last_id`.
fn resume_by_key(
    sidecar: &Sidecar,
    key: &str,
    last_id: &str,
) -> impl std::future::Future<Output = Reply> + use<> {
    send(request(
        Method::GET,
        &sidecar.url(&format!("/v1/streams/{}", key.replace('/', "%2F"))),
        &[("last-event-id", last_id)],
        Bytes::new(),
    ))
}

/// `GET /v1/streams/{key}`: the key's latest attempt whole.
fn stream_by_key(sidecar: &Sidecar, key: &str) -> impl std::future::Future<Output = Reply> + use<> {
    send(request(
        Method::GET,
        &sidecar.url(&format!("/v1/streams/{}", key.replace('/', "%2F"))),
        &[],
        Bytes::new(),
    ))
}

/// Events of an SSE body (split on blank lines; the mock and the sidecar use LF).
fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split_inclusive("\n\n")
        .map(str::to_string)
        .collect()
}

fn strip_id(ev: &str) -> &str {
    match ev.strip_prefix("id: ") {
        Some(rest) => rest.split_once('\n').map(|(_, r)| r).unwrap_or(""),
        None => ev,
    }
}

/// Reads a streaming response until it holds `n` events, then drops it.
async fn read_events(
    req: http::Request<http_body_util::Full<Bytes>>,
    n: usize,
) -> (String, Vec<u8>) {
    let resp = open(req).await;
    let key = resp
        .headers()
        .get("outrigger-stream-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while events(&got).iter().filter(|e| e.ends_with("\n\n")).count() < n {
        match next_chunk(&mut body).await {
            Some(Ok(c)) => got.extend_from_slice(&c),
            _ => break,
        }
    }
    // Keep only whole events (a frame may hold several).
    let whole: Vec<String> = events(&got)
        .into_iter()
        .filter(|e| e.ends_with("\n\n"))
        .take(n)
        .collect();
    (key, whole.concat().into_bytes())
}

/// Sends `req` and gives up on it after `after`, before it is answered: its agent
/// goes away while the call waits.
async fn leave_waiting(req: http::Request<http_body_util::Full<Bytes>>, after: Duration) {
    let left = tokio::time::timeout(after, send(req)).await;
    assert!(left.is_err(), "the call should still have been waiting");
}

/// A plain (`"stream": false`) request in dialect `d` under the Idempotency-Key `key`.
fn post_plain(sidecar: &Sidecar, d: D, key: &str) -> http::Request<http_body_util::Full<Bytes>> {
    request(
        Method::POST,
        &sidecar.url(d.path()),
        &[
            ("content-type", "application/json"),
            ("idempotency-key", key),
        ],
        d.body(false).to_string(),
    )
}

fn post(
    sidecar: &Sidecar,
    d: D,
    key: Option<&str>,
    extra: &[(&str, &str)],
) -> http::Request<http_body_util::Full<Bytes>> {
    let mut h = vec![("content-type", "application/json")];
    if let Some(k) = key {
        h.push(("idempotency-key", k));
    }
    h.extend_from_slice(extra);
    request(
        Method::POST,
        &sidecar.url(d.path()),
        &h,
        d.body(true).to_string(),
    )
}

#[tokio::test]
async fn a_journaled_stream_replays_byte_identical() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 10,
        tool_calls: 2,
        ..Behaviour::default()
    })
    .await;
    for d in [D::OpenAi, D::Anthropic] {
        let key = format!("replay-{d:?}");
        let first = send(post(&sidecar, d, Some(&key), &[])).await;
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(first.header("outrigger-replayed"), None);
        let evs = events(&first.body);
        for (i, e) in evs.iter().enumerate() {
            assert!(has_id(e, 1, i as u64), "{e}");
        }
        // Without the ids, exactly what the provider sent.
        let upstream = mock.exchanges().last().unwrap().response_bytes();
        let stripped: String = evs.iter().map(|e| strip_id(e)).collect();
        assert_eq!(stripped.as_bytes(), upstream.as_slice());
        let generations = mock.generation_count();
        let again = send(post(&sidecar, d, Some(&key), &[])).await;
        assert_eq!(again.header("outrigger-replayed"), Some("true"));
        assert_eq!(again.body, first.body, "{d:?}: replay is byte-identical");
        assert_eq!(mock.generation_count(), generations, "not generated again");
    }
    // A key that ends in `cancel`, its slashes not encoded, is read by `GET`, not
    // taken for a cancel.
    let first = send(post(&sidecar, D::OpenAi, Some("cancel"), &[])).await;
    assert_eq!(first.status, StatusCode::OK);
    let read = get(&sidecar.url("/v1/streams/m/openai/cancel")).await;
    assert_eq!(read.status, StatusCode::OK, "{}", read.text());
    assert_eq!(read.body, first.body);
}

#[tokio::test]
async fn a_client_that_drops_at_any_event_boundary_resumes_byte_identical() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 6,
        tool_calls: 2,
        chunk_delay: Duration::from_millis(15),
        ..Behaviour::default()
    })
    .await;
    let mut resumed_first = None;
    for d in [D::OpenAi, D::Anthropic] {
        let reference = send(post(&sidecar, d, Some(&format!("ref-{d:?}")), &[]))
            .await
            .body;
        let total = events(&reference).len();
        for cut in 1..total {
            let key = format!("drop-{d:?}-{cut}");
            let (stream_key, prefix) = read_events(post(&sidecar, d, Some(&key), &[]), cut).await;
            assert_eq!(events(&prefix).len(), cut);
            if matches!(d, D::OpenAi) && cut == 1 {
                resumed_first = Some(generation_of(&events(&prefix)[0]));
            }
            let last_id = events(&prefix)
                .last()
                .unwrap()
                .lines()
                .next()
                .unwrap()
                .trim_start_matches("id: ")
                .to_string();
            // Resume through the resume endpoint, after the last event seen.
            let url = sidecar.url(&format!("/v1/streams/{}", stream_key.replace('/', "%2F")));
            let rest = send(request(
                Method::GET,
                &url,
                &[("last-event-id", &last_id)],
                Bytes::new(),
            ))
            .await;
            assert_eq!(
                rest.status,
                StatusCode::OK,
                "{d:?} cut {cut}: {}",
                rest.text()
            );
            let mut whole = prefix.clone();
            whole.extend_from_slice(&rest.body);
            // The same stream whole, as a re-POST with the key gets it.
            let replay = send(post(&sidecar, d, Some(&key), &[])).await.body;
            assert_eq!(whole, replay.to_vec(), "{d:?} cut {cut}");
            // …and with the ids stripped it is exactly what the provider generated.
            let stripped: String = events(&whole)
                .iter()
                .map(|e| strip_id(e).to_string())
                .collect();
            assert!(
                mock.exchanges()
                    .iter()
                    .any(|e| e.response_bytes() == stripped.as_bytes()),
                "{d:?} cut {cut}: the resumed stream is not the provider's"
            );
        }
    }
    // Every generation ran to its end although its first client went away.
    assert!(
        mock.exchanges()
            .iter()
            .all(|e| e.stream_end() == Some(StreamEnd::Completed))
    );
    // A repeat that resumes past a completed stream's end has nothing to get
    // (`204`): no replay, and no call to the provider.
    let past_the_end = send(post(
        &sidecar,
        D::OpenAi,
        Some("drop-OpenAi-1"),
        &[(
            "last-event-id",
            &format!("{}:999", resumed_first.expect("resumed")),
        )],
    ))
    .await;
    assert_eq!(past_the_end.status, StatusCode::NO_CONTENT);
    // Each resume, and each whole replay after it, is counted as what it was.
    let resumes = mock.generation_count() - 2;
    let metrics = get(&sidecar.admin_url("/metrics")).await.text();
    for needle in [
        format!("outrigger_replays_total{{kind=\"stream_resume\"}} {resumes}"),
        format!("outrigger_replays_total{{kind=\"model_turn\"}} {resumes}"),
    ] {
        assert!(metrics.contains(&needle), "{needle} in {metrics}");
    }
}

/// No client ever sees part of a tool call: for every cut, journaled or not, each
/// tool call the client saw is complete, what it saw is the provider's events in
/// order (none twice), the stream ends with a typed error event, and the tokens
/// metered are those the provider reported in what it sent, no more and no less.
#[tokio::test]
async fn an_upstream_cut_anywhere_never_forwards_a_partial_tool_call() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 3,
        tool_calls: 2,
        ..Behaviour::default()
    })
    .await;
    for d in [D::OpenAi, D::Anthropic] {
        let exchanges_before = mock.exchanges().len();
        let metered_before = metered(&sidecar).await;
        let g = Generation {
            n: 1,
            model: "m".into(),
            chunks: 3,
            tool_calls: 2,
            prompt_tokens: 1,
            // OpenAI reports usage only when asked (the requests below ask).
            include_usage: true,
            content_filtered: false,
        };
        let reference: Vec<String> = match d {
            D::OpenAi => mock_sse::openai_stream(&g),
            D::Anthropic => mock_sse::anthropic_stream(&g),
        };
        let total_bytes: usize = reference.iter().map(String::len).sum();
        // Every argument delta of both calls: a client that sees a call sees all of it.
        let call_deltas = reference
            .iter()
            .filter(|e| e.contains("\"tool_calls\":[") || e.contains("input_json_delta"))
            .count();
        assert!(
            call_deltas >= 4,
            "the reference holds two calls: {reference:?}"
        );
        // Cuts at every event boundary, and inside events (every 37 bytes).
        let mut cuts: Vec<usize> = Vec::new();
        let mut acc = 0;
        for e in &reference {
            acc += e.len();
            cuts.push(acc);
        }
        cuts.extend((1..total_bytes).step_by(37));
        cuts.retain(|c| *c < total_bytes && *c > 0);
        let mut body = d.body(true);
        if matches!(d, D::OpenAi) {
            body["stream_options"] = json!({"include_usage": true});
        }
        for (cut, journaled) in cuts.iter().flat_map(|c| [(c, false), (c, true)]) {
            mock.push(Behaviour {
                chunks: 3,
                tool_calls: 2,
                cut_bytes: Some(*cut),
                // Paced, so that each event the mock writes whole is on the wire
                // before the cut (unpaced, the connection's write buffer dies with
                // it), and what it sent is what the sidecar received.
                chunk_delay: Duration::from_millis(1),
                ..Behaviour::default()
            });
            let key = format!("cut-{d:?}-{cut}");
            let mut h = vec![("content-type", "application/json")];
            if journaled {
                h.push(("idempotency-key", key.as_str()));
            }
            let r = send(request(
                Method::POST,
                &sidecar.url(d.path()),
                &h,
                body.to_string(),
            ))
            .await;
            if r.status != StatusCode::OK {
                // Broke before the first event: retried invisibly (the next attempt gets
                // the default, uncut stream).
                let logs = sidecar.logs();
                let tail: Vec<&str> = logs.lines().rev().take(30).collect();
                panic!(
                    "{d:?} cut {cut}: status {}: {}\n{}",
                    r.status,
                    r.text(),
                    tail.join("\n")
                );
            }
            let evs: Vec<String> = events(&r.body)
                .iter()
                .map(|e| strip_id(e).to_string())
                .collect();
            assert_no_partial_tool_call(d, &evs, *cut, call_deltas);
            let last = evs.last().cloned().unwrap_or_default();
            let complete = last.contains("[DONE]") || last.contains("message_stop");
            // What the client saw before the error event is the provider's events
            // in order, none twice (withheld ones are the last): a prefix of what
            // the attempt that answered sent (a cut before the first event is
            // retried, and the retry is the last exchange).
            let sent = whole_events(
                &mock
                    .exchanges()
                    .last()
                    .expect("an exchange")
                    .response_bytes(),
            );
            let seen = &evs[..evs.len() - usize::from(!complete)];
            assert!(
                seen.len() <= sent.len() && seen == &sent[..seen.len()],
                "{d:?} cut {cut} journaled {journaled}: not a prefix of what was sent:\n{seen:?}\n{sent:?}"
            );
            if !complete {
                // The typed error event of the dialect, as the official SDKs parse it.
                let data = last
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .unwrap_or_default();
                let doc: serde_json::Value = serde_json::from_str(data)
                    .unwrap_or_else(|e| panic!("{d:?} cut {cut}: {e}: {last}"));
                match d {
                    D::OpenAi => {
                        assert_eq!(doc["error"]["type"], "stream_interrupted", "{last}");
                        assert_eq!(doc["error"]["code"], "outrigger_stream_interrupted");
                    }
                    D::Anthropic => {
                        assert!(
                            last.starts_with("event: error\n"),
                            "{d:?} cut {cut}: {last}"
                        );
                        assert_eq!(doc["type"], "error", "{last}");
                        assert_eq!(doc["error"]["type"], "api_error", "{last}");
                    }
                }
                let message = doc["error"]["message"].as_str().unwrap_or_default();
                assert!(
                    message.contains("was interrupted") && message.contains("no partial tool call"),
                    "{d:?} cut {cut}: {message}"
                );
                assert_eq!(
                    evs.iter()
                        .filter(|e| e.starts_with("event: error") || e.contains("{\"error\":"))
                        .count(),
                    1,
                    "{d:?} cut {cut}: one error event"
                );
                assert!(
                    !evs.iter()
                        .any(|e| e.contains("[DONE]") || e.contains("message_stop")),
                    "no faked terminal event"
                );
            }
        }
        // Metering: what the provider reported in the events it sent whole, over
        // every attempt of this dialect's calls, cut or not.
        let reported = mock.exchanges()[exchanges_before..]
            .iter()
            .map(|e| reported_usage(d, &e.response_bytes()))
            .fold((0, 0), |(i, o), (di, do_)| (i + di, o + do_));
        assert!(
            reported.0 > 0 && reported.1 > 0,
            "{d:?}: usage was reported"
        );
        let added = |now: (u64, u64)| (now.0 - metered_before.0, now.1 - metered_before.1);
        let now = metered_when(&sidecar, |now| added(now) == reported).await;
        assert_eq!(
            added(now),
            reported,
            "{d:?}: tokens metered (input, output) against those the provider reported"
        );
    }
}

/// The events of an SSE body that arrived whole.
fn whole_events(body: &[u8]) -> Vec<String> {
    events(body)
        .into_iter()
        .filter(|e| e.ends_with("\n\n"))
        .collect()
}

/// The tokens (input, output) a provider reported in the events of `sent` that
/// arrived whole: OpenAI's usage chunk; Anthropic's input at `message_start` and its
/// latest output count (`message_start`, then `message_delta`).
fn reported_usage(d: D, sent: &[u8]) -> (u64, u64) {
    let (mut input, mut output) = (0, 0);
    for e in whole_events(sent) {
        let Some(data) = e.lines().find_map(|l| l.strip_prefix("data: ")) else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            continue;
        };
        match d {
            D::OpenAi => {
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    input = u["prompt_tokens"].as_u64().unwrap_or(0);
                    output = u["completion_tokens"].as_u64().unwrap_or(0);
                }
            }
            D::Anthropic => {
                let u = if v["type"] == "message_start" {
                    &v["message"]["usage"]
                } else {
                    &v["usage"]
                };
                if let Some(i) = u["input_tokens"].as_u64() {
                    input = i;
                }
                if let Some(o) = u["output_tokens"].as_u64() {
                    output = o;
                }
            }
        }
    }
    (input, output)
}

/// The tokens (input, output) the sidecar has metered so far.
async fn metered(sidecar: &Sidecar) -> (u64, u64) {
    metered_when(sidecar, |_| true).await
}

/// The tokens metered once `check` holds of them (10 s at most; then as they are).
async fn metered_when(sidecar: &Sidecar, check: impl Fn((u64, u64)) -> bool) -> (u64, u64) {
    let text = crate::matrix::metrics_until(sidecar, |t| check(metered_in(t))).await;
    metered_in(&text)
}

/// The tokens (input, output) an exposition says were metered.
fn metered_in(text: &str) -> (u64, u64) {
    let sum =
        |t: &str| crate::matrix::series_sum(text, "gen_ai_client_token_usage_sum", &[t]) as u64;
    (
        sum("gen_ai_token_type=\"input\""),
        sum("gen_ai_token_type=\"output\""),
    )
}

/// Property: for any stream the provider sends (either dialect, any number of text
/// deltas and tool calls), any event a client drops after, and a resume while the
/// rest is still being generated (events 20 ms apart) or once the upstream has sent it
/// all, the prefix the client had plus what the resume gives is the original stream:
/// byte-identical to a whole replay, and with its ids stripped exactly the provider's
/// bytes.
#[test]
fn the_prefix_a_client_had_and_its_resumed_tail_make_the_original_stream() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let (mock, sidecar) = rt.block_on(setup(Behaviour::default()));
    let cases = AtomicUsize::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    });
    let shapes = (
        any::<bool>(),
        1usize..12,
        0usize..3,
        any::<prop::sample::Index>(),
        any::<bool>(),
    );
    let result = runner.run(
        &shapes,
        |(anthropic, chunks, tool_calls, drop_at, paced)| {
            let d = if anthropic { D::Anthropic } else { D::OpenAi };
            let g = Generation {
                n: 1,
                model: "m".into(),
                chunks,
                tool_calls,
                prompt_tokens: 1,
                include_usage: false,
                content_filtered: false,
            };
            let total = match d {
                D::OpenAi => mock_sse::openai_stream(&g),
                D::Anthropic => mock_sse::anthropic_stream(&g),
            }
            .len();
            // Dropped after 1 to total - 1 events: something is always left to resume.
            let kept = 1 + drop_at.index(total - 1);
            let key = format!("prop-{}", cases.fetch_add(1, Ordering::SeqCst));
            let case =
                format!("{d:?} chunks {chunks} tools {tool_calls} kept {kept} paced {paced}");
            rt.block_on(async {
                mock.push(Behaviour {
                    chunks,
                    tool_calls,
                    chunk_delay: if paced {
                        Duration::from_millis(20)
                    } else {
                        Duration::ZERO
                    },
                    ..Behaviour::default()
                });
                let (stream_key, prefix) =
                    read_events(post(&sidecar, d, Some(&key), &[]), kept).await;
                prop_assert_eq!(events(&prefix).len(), kept, "{}", case);
                let last_id = events(&prefix)
                    .last()
                    .and_then(|e| e.lines().next())
                    .unwrap_or_default()
                    .trim_start_matches("id: ")
                    .to_string();
                let rest = resume_by_key(&sidecar, &stream_key, &last_id).await;
                prop_assert_eq!(rest.status, StatusCode::OK, "{}: {}", case, rest.text());
                let mut whole = prefix;
                whole.extend_from_slice(&rest.body);
                let replay = send(post(&sidecar, d, Some(&key), &[])).await;
                prop_assert_eq!(
                    replay.header("outrigger-replayed"),
                    Some("true"),
                    "{}",
                    case
                );
                prop_assert_eq!(&whole, &replay.body.to_vec(), "{}", case);
                let stripped: String = events(&whole)
                    .iter()
                    .map(|e| strip_id(e).to_string())
                    .collect();
                prop_assert!(
                    mock.exchanges()
                        .iter()
                        .any(|e| e.response_bytes() == stripped.as_bytes()),
                    "{}: the resumed stream is not the provider's: {}",
                    case,
                    stripped
                );
                Ok::<(), TestCaseError>(())
            })
        },
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(cases.load(Ordering::SeqCst) >= 48, "every case ran");
}

/// An upstream that stalls mid-stream with its connection open is not waited on for
/// ever: at `[limits] stream_idle_timeout` the stream ends with the typed error event,
/// journaled as the attempt's last, and the key's next request generates afresh.
#[tokio::test]
async fn a_stalled_upstream_ends_with_a_typed_error_at_the_idle_limit() {
    let stall = Behaviour {
        chunks: 4,
        chunk_delay: Duration::from_secs(5),
        ..Behaviour::default()
    };
    let mock = MockProvider::start(stall).await.expect("mock");
    let config = format!(
        r#"
[limits]
stream_idle_timeout = "400ms"

[[providers]]
name = "oa"
kind = "openai"
base_url = "{}"
models = ["gpt-mock"]
"#,
        mock.openai_base()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    for (i, d) in [None, Some("stalled")].into_iter().enumerate() {
        let started = std::time::Instant::now();
        let r = send(post(&sidecar, D::OpenAi, d, &[])).await;
        let took = started.elapsed();
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_secs(4),
            "case {i}: ended after {took:?}"
        );
        let evs = events(&r.body);
        assert_eq!(
            evs.len(),
            2,
            "case {i}: the first event, then the error: {evs:?}"
        );
        let last = strip_id(&evs[1]);
        assert!(
            last.contains("\"type\":\"stream_interrupted\"")
                && last.contains("went quiet")
                && last.contains("stream_idle_timeout"),
            "case {i}: {last}"
        );
        assert!(!r.text().contains("[DONE]"));
        let Some(key) = d else { continue };
        // Journaled: the same bytes by key, the error event included.
        let stream_key = r.header("outrigger-stream-key").expect("a stream key");
        let journaled = send(request(
            Method::GET,
            &sidecar.url(&format!("/v1/streams/{}", stream_key.replace('/', "%2F"))),
            &[],
            Bytes::new(),
        ))
        .await;
        assert_eq!(journaled.body, r.body);
        // The attempt was abandoned, not left open: the key generates afresh.
        mock.push(Behaviour {
            chunks: 4,
            ..Behaviour::default()
        });
        let again = send(post(&sidecar, D::OpenAi, Some(key), &[])).await;
        let evs = events(&again.body);
        assert!(has_id(&evs[0], 2, 0), "attempt 2: {}", evs[0]);
        assert!(evs.last().unwrap().contains("[DONE]"));
    }
}

/// `call_deltas`: the events that grow the two calls in the uncut stream.
fn assert_no_partial_tool_call(d: D, evs: &[String], cut: usize, call_deltas: usize) {
    match d {
        D::OpenAi => {
            let tool_events = evs
                .iter()
                .filter(|e| e.contains("\"tool_calls\":["))
                .count();
            let finished = evs
                .iter()
                .any(|e| e.contains("\"finish_reason\":\"tool_calls\""));
            // All tool-call deltas arrive together with the finish that completes them.
            assert!(
                tool_events == 0 || finished,
                "cut {cut}: tool-call deltas without their finish: {evs:?}"
            );
            if finished {
                assert_eq!(
                    tool_events, call_deltas,
                    "cut {cut}: every delta of both calls"
                );
            }
        }
        D::Anthropic => {
            // A `tool_use` block is whole only at the `message_delta` whose stop
            // reason is `tool_use`: the client sees a call with all of its input
            // deltas, its stop and that reason, or sees nothing of it.
            let starts = evs
                .iter()
                .filter(|e| e.contains("\"type\":\"tool_use\""))
                .count();
            let deltas = evs
                .iter()
                .filter(|e| e.contains("input_json_delta"))
                .count();
            let stops: usize = evs
                .iter()
                .filter(|e| {
                    e.starts_with("event: content_block_stop") && !e.contains("\"index\":0")
                })
                .count();
            let confirmed = evs
                .iter()
                .any(|e| e.contains("\"stop_reason\":\"tool_use\""));
            if starts + deltas + stops == 0 {
                assert!(!confirmed, "cut {cut}: a stop reason for calls never sent");
            } else {
                assert!(
                    starts == 2 && stops == 2 && deltas == call_deltas && confirmed,
                    "cut {cut}: a tool_use block cut short ({starts} starts, {deltas} deltas, {stops} stops, confirmed {confirmed}): {evs:?}"
                );
            }
        }
    }
}

#[tokio::test]
async fn a_restarted_agent_gets_the_same_turn_from_the_journal_inside_a_task() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 4,
        tool_calls: 1,
        ..Behaviour::default()
    })
    .await;
    let task = [("outrigger-task-id", "agent-run-1")];
    for (d, stream) in [D::OpenAi, D::Anthropic]
        .into_iter()
        .flat_map(|d| [(d, false), (d, true)])
    {
        let mut body = d.body(stream);
        if stream && matches!(d, D::OpenAi) {
            body["stream_options"] = json!({"include_usage": true});
        }
        let url = sidecar.url(d.path());
        let before = metered(&sidecar).await;
        let a = post_json(&url, &task, &body).await;
        // The turn's tokens are metered once (a stream's at its end)…
        let grown = |now: (u64, u64)| now.0 > before.0 && now.1 > before.1;
        let after_a = metered_when(&sidecar, grown).await;
        assert!(grown(after_a), "{d:?} stream={stream}: metered");
        let b = post_json(&url, &task, &body).await;
        // …and its replay meters nothing.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            metered(&sidecar).await,
            after_a,
            "{d:?} stream={stream}: a replay is not usage"
        );
        assert_eq!(a.status, StatusCode::OK, "{d:?} stream={stream}");
        assert_eq!(
            b.header("outrigger-replayed"),
            Some("true"),
            "{d:?} stream={stream}"
        );
        assert_eq!(a.body, b.body, "{d:?}: the same tool call ids");
        // Asking for a fresh sample gets one.
        let mut h = task.to_vec();
        h.push(("cache-control", "no-cache"));
        let c = post_json(&url, &h, &body).await;
        assert_eq!(
            c.header("outrigger-replayed"),
            None,
            "{d:?} stream={stream}"
        );
        assert_ne!(c.body, a.body, "{d:?} stream={stream}");
    }
    // Another task does not see this task's turns.
    let other = post_json(
        &sidecar.url("/v1/chat/completions"),
        &[("outrigger-task-id", "other")],
        &D::OpenAi.body(false),
    )
    .await;
    assert_eq!(other.header("outrigger-replayed"), None);
    assert_eq!(mock.generation_count(), 9);
    // Replays are counted apart, one per turn answered from the journal.
    let metrics = get(&sidecar.admin_url("/metrics")).await.text();
    let needle = "outrigger_replays_total{kind=\"model_turn\"} 4";
    assert!(metrics.contains(needle), "{needle} in {metrics}");
}

/// A header that changes what the provider generates (a beta feature, an API
/// version) makes another request of the same body: inside a task it is generated
/// afresh, and under one `Idempotency-Key` it is the key reused.
#[tokio::test]
async fn a_turn_with_other_beta_headers_is_another_request() {
    let (mock, sidecar) = setup(Behaviour::default()).await;
    let url = sidecar.url("/v1/messages");
    let body = D::Anthropic.body(false);
    let task = |beta: &'static str| {
        [
            ("outrigger-task-id", "beta-run"),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", beta),
        ]
    };
    let first = post_json(
        &url,
        &task("files-api-2025-04-14,token-efficient-tools-2025-02-19"),
        &body,
    )
    .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    let reordered = post_json(
        &url,
        &task("token-efficient-tools-2025-02-19, files-api-2025-04-14"),
        &body,
    )
    .await;
    assert_eq!(
        reordered.header("outrigger-replayed"),
        Some("true"),
        "the same set of betas is the same request"
    );
    assert_eq!(reordered.body, first.body);
    let other = post_json(&url, &task("files-api-2025-04-14"), &body).await;
    assert_eq!(other.status, StatusCode::OK, "{}", other.text());
    assert_eq!(
        other.header("outrigger-replayed"),
        None,
        "another beta set generates afresh"
    );
    assert_ne!(other.body, first.body);
    assert_eq!(mock.generation_count(), 2);

    let keyed = |beta: &'static str| {
        [
            ("idempotency-key", "beta-key"),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", beta),
        ]
    };
    let a = post_json(&url, &keyed("files-api-2025-04-14"), &body).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let b = post_json(&url, &keyed("token-efficient-tools-2025-02-19"), &body).await;
    assert_eq!(b.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", b.text());
    assert_eq!(
        b.json()["type"].as_str(),
        Some("urn:outrigger:problem:key-reused"),
        "{}",
        b.text()
    );
    assert_eq!(mock.generation_count(), 3);
}

#[tokio::test]
async fn a_stream_can_be_cancelled_explicitly() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 200,
        chunk_delay: Duration::from_millis(20),
        ..Behaviour::default()
    })
    .await;
    let (key, _prefix) = read_events(post(&sidecar, D::Anthropic, Some("to-cancel"), &[]), 3).await;
    let url = sidecar.url(&format!("/v1/streams/{}/cancel", key.replace('/', "%2F")));
    let r = send(request(Method::POST, &url, &[], Bytes::new())).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text());
    let dropped = eventually(Duration::from_secs(5), || {
        mock.exchanges().last().and_then(|e| e.stream_end()) == Some(StreamEnd::Dropped)
    })
    .await;
    assert!(dropped, "the upstream was not released");
    // The journaled stream ends with a typed error naming the cancel.
    let whole = stream_by_key(&sidecar, &key).await;
    let last = events(&whole.body).last().cloned().unwrap_or_default();
    assert!(
        last.contains("event: error") && last.contains("cancelled"),
        "{last}"
    );
    // Unknown streams say so.
    let unknown = send(request(
        Method::GET,
        &sidecar.url("/v1/streams/m%2Fnope"),
        &[],
        Bytes::new(),
    ))
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
}

/// A stream past `[journal] stream_retention` (here 1 s; the sidecar applies retention
/// every quarter of it, at most once a second) has its events dropped: reading it by
/// key and resuming it with `Last-Event-ID` both get `410 stream-expired`, naming
/// the key, never a silent empty stream; a repeat of its request without an id
/// generates afresh, as the key's next attempt. As long again after the expiry the
/// stream is forgotten: `404 unknown-stream`.
#[tokio::test]
async fn a_stream_past_its_retention_says_it_expired_then_is_forgotten() {
    let (mock, sidecar) = setup_with(
        Behaviour::default(),
        "[journal]\nstream_retention = \"1s\"\n",
    )
    .await;
    let first = send(post(&sidecar, D::OpenAi, Some("short-lived"), &[])).await;
    assert_eq!(first.status, StatusCode::OK);
    let key = first
        .header("outrigger-stream-key")
        .expect("stream key")
        .to_string();
    let last_id = events(&first.body)
        .first()
        .and_then(|e| e.lines().next())
        .and_then(|l| l.strip_prefix("id: "))
        .expect("an event id")
        .to_string();
    let whole = stream_by_key(&sidecar, &key).await;
    assert_eq!(whole.status, StatusCode::OK, "kept for now");
    assert_eq!(whole.body, first.body);

    // Expired within 1 s and a sweep (1 s) of its end; 10 s is far more than enough.
    let until = |want: StatusCode, key: String| {
        let sidecar = &sidecar;
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let r = stream_by_key(sidecar, &key).await;
                if r.status == want || tokio::time::Instant::now() > deadline {
                    return r;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let expired = until(StatusCode::GONE, key.clone()).await;
    assert_eq!(expired.status, StatusCode::GONE, "{}", expired.text());
    let problem = expired.json();
    assert!(
        problem["type"]
            .as_str()
            .unwrap_or_default()
            .ends_with("stream-expired"),
        "{problem}"
    );
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains(&key) && detail.contains("stream_retention"),
        "names the key and the setting: {problem}"
    );
    let resumed = resume_by_key(&sidecar, &key, &last_id).await;
    assert_eq!(resumed.status, StatusCode::GONE, "{}", resumed.text());
    assert!(
        resumed.text().contains("stream-expired"),
        "{}",
        resumed.text()
    );

    // A repeat without an id is the key's next attempt, generated afresh.
    let generated = mock.generation_count();
    let again = send(post(&sidecar, D::OpenAi, Some("short-lived"), &[])).await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.header("outrigger-replayed"), None);
    assert_eq!(mock.generation_count(), generated + 1);
    let evs = events(&again.body);
    assert!(has_id(&evs[0], 2, 0), "{}", evs[0]);

    // Another stream, left to expire and then be forgotten.
    let other = send(post(&sidecar, D::Anthropic, Some("forgotten"), &[])).await;
    let other_key = other
        .header("outrigger-stream-key")
        .expect("stream key")
        .to_string();
    let forgotten = until(StatusCode::NOT_FOUND, other_key).await;
    assert_eq!(
        forgotten.status,
        StatusCode::NOT_FOUND,
        "{}",
        forgotten.text()
    );
    assert!(
        forgotten.text().contains("unknown-stream"),
        "{}",
        forgotten.text()
    );
}

/// Detach is bounded: a generation nobody reads for `[streams] detach_timeout` is
/// abandoned (its upstream released long before the provider would end it), and one
/// that passes `max_stream_bytes` is cut; either ends with the typed error event,
/// never a terminal one, and the key's next request generates afresh.
#[tokio::test]
async fn a_detached_generation_is_bounded_in_time_and_size() {
    let (mock, sidecar) = setup_with(
        Behaviour::default(),
        "[streams]\ndetach_timeout = \"300ms\"\nmax_stream_bytes = 65536\n",
    )
    .await;
    let ends_with_typed_error = |key: &str, body: &[u8], why: &str| {
        let last = events(body).last().cloned().unwrap_or_default();
        assert!(
            last.contains("stream_interrupted") && last.contains(why),
            "{key}: {last}"
        );
        assert!(!String::from_utf8_lossy(body).contains("[DONE]"), "{key}");
    };
    // 200 events 20 ms apart: four seconds of generation, left after two events.
    mock.push(Behaviour {
        chunks: 200,
        chunk_delay: Duration::from_millis(20),
        ..Behaviour::default()
    });
    let started = std::time::Instant::now();
    let (key, _prefix) = read_events(post(&sidecar, D::OpenAi, Some("unread"), &[]), 2).await;
    assert!(
        eventually(Duration::from_secs(3), || {
            mock.exchanges().last().and_then(|e| e.stream_end()) == Some(StreamEnd::Dropped)
        })
        .await,
        "the upstream of a generation nobody reads is released"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let whole = stream_by_key(&sidecar, &key).await;
    assert_eq!(whole.status, StatusCode::OK, "{}", whole.text());
    ends_with_typed_error("unread", &whole.body, "no client for");

    // About 700 events of about 150 bytes each (with the 64 counted for each id): past 64 KiB.
    mock.push(Behaviour {
        chunks: 700,
        ..Behaviour::default()
    });
    let long = send(post(&sidecar, D::OpenAi, Some("long"), &[])).await;
    assert_eq!(long.status, StatusCode::OK, "{}", long.text());
    ends_with_typed_error("long", &long.body, "passed 65536 bytes");

    let generated = mock.generation_count();
    for key in ["unread", "long"] {
        let again = send(post(&sidecar, D::OpenAi, Some(key), &[])).await;
        assert_eq!(again.status, StatusCode::OK, "{key}: {}", again.text());
        assert_eq!(
            again.header("outrigger-replayed"),
            None,
            "{key}: generated afresh"
        );
        assert!(
            again.text().ends_with("data: [DONE]\n\n"),
            "{key}: {}",
            again.text()
        );
    }
    assert_eq!(mock.generation_count(), generated + 2);
}

#[tokio::test]
async fn a_sidecar_killed_mid_stream_gives_a_fresh_generation_on_retry() {
    let (mock, mut sidecar) = setup(Behaviour {
        chunks: 100,
        tool_calls: 1,
        chunk_delay: Duration::from_millis(20),
        ..Behaviour::default()
    })
    .await;
    for (n, d) in [D::OpenAi, D::Anthropic].into_iter().enumerate() {
        let n = n as u64;
        let name = format!("killed-{d:?}");
        let terminal: &[u8] = match d {
            D::OpenAi => b"[DONE]",
            D::Anthropic => b"message_stop",
        };
        let (key, prefix) = read_events(post(&sidecar, d, Some(&name), &[]), 5).await;
        assert_eq!(events(&prefix).len(), 5);
        sidecar.kill();
        sidecar.spawn().await;
        // Resumed by key after the restart, the abandoned attempt ends with a typed
        // error numbered after its last journaled event, not with a silent end.
        let journaled = stream_by_key(&sidecar, &key).await;
        assert_eq!(journaled.status, StatusCode::OK, "{}", journaled.text());
        let whole = events(&journaled.body);
        let last = whole.last().cloned().unwrap_or_default();
        let typed = match d {
            D::OpenAi => last.contains("stream_interrupted"),
            D::Anthropic => strip_id(&last).starts_with("event: error\n"),
        };
        assert!(
            has_id(&last, 1, CLOSING) && typed && last.contains("restart"),
            "{d:?}: {last}"
        );
        assert!(
            !journaled
                .body
                .windows(terminal.len())
                .any(|w| w == terminal),
            "{d:?}: no terminal event"
        );
        // Resumed after its last journaled event, or after an event the journal lost
        // in the kill, a client gets the error event alone; after the error event
        // itself, nothing more (an event source reconnecting is not sent it again).
        let g = generation_of(&whole[0]);
        for after in [whole.len() - 2, whole.len() + 3] {
            let tail = resume_by_key(&sidecar, &key, &format!("{g}:{after}")).await;
            assert_eq!(tail.status, StatusCode::OK, "{}", tail.text());
            assert_eq!(
                events(&tail.body),
                std::slice::from_ref(&last),
                "{d:?}: after {g}:{after}"
            );
        }
        let nothing = resume_by_key(&sidecar, &key, &format!("{g}:{CLOSING}")).await;
        assert_eq!(nothing.status, StatusCode::NO_CONTENT, "{}", nothing.text());
        // The open attempt was abandoned at start-up; the same request generates
        // afresh.
        let r = send(post(&sidecar, d, Some(&name), &[])).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("outrigger-replayed"), None);
        let evs = events(&r.body);
        assert!(has_id(&evs[0], 2, 0), "{d:?}: attempt 2: {}", evs[0]);
        assert!(
            evs.last()
                .is_some_and(|e| e.as_bytes().windows(terminal.len()).any(|w| w == terminal)),
            "{d:?}: whole"
        );
        assert_eq!(mock.generation_count(), 2 * n + 2);
        // From now on it replays.
        let again = send(post(&sidecar, d, Some(&name), &[])).await;
        assert_eq!(again.body, r.body);
    }
}

#[tokio::test]
async fn a_call_before_its_first_byte_is_joined_by_a_repeat_and_goes_on_when_dropped() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 5,
        first_byte_delay: Duration::from_millis(700),
        ..Behaviour::default()
    })
    .await;
    // A repeat while the first waits for its first byte joins it.
    let first = tokio::spawn(send(post(&sidecar, D::OpenAi, Some("slow"), &[])));
    tokio::time::sleep(Duration::from_millis(250)).await;
    let repeat = send(post(&sidecar, D::OpenAi, Some("slow"), &[])).await;
    let first = first.await.expect("first call");
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert_eq!(repeat.status, StatusCode::OK, "{}", repeat.text());
    assert_eq!(repeat.header("outrigger-replayed"), Some("true"));
    assert_eq!(repeat.body, first.body);
    assert_eq!(mock.generation_count(), 1);

    // A call whose agent goes away before the first byte is not cancelled (detach):
    // the same request, sent again, is answered from that generation.
    leave_waiting(
        post(&sidecar, D::OpenAi, Some("dropped"), &[]),
        Duration::from_millis(250),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let again = send(post(&sidecar, D::OpenAi, Some("dropped"), &[])).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text());
    assert_eq!(again.header("outrigger-replayed"), Some("true"));
    let evs = events(&again.body);
    assert!(has_id(&evs[0], 1, 0), "attempt 1: {}", evs[0]);
    assert!(evs.last().unwrap().contains("[DONE]"));
    assert_eq!(mock.generation_count(), 2, "the dropped call's generation");
    // Once it is over, from the journal: the same bytes.
    let later = send(post(&sidecar, D::OpenAi, Some("dropped"), &[])).await;
    assert_eq!(later.header("outrigger-replayed"), Some("true"));
    assert_eq!(later.body, again.body);
    assert_eq!(mock.generation_count(), 2);

    // A resume point that is not ours is refused, not answered with the whole stream.
    let bad = send(post(
        &sidecar,
        D::OpenAi,
        Some("slow"),
        &[("last-event-id", "chatcmpl-7")],
    ))
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text());
    assert!(bad.text().contains("Last-Event-ID"), "{}", bad.text());
}

/// A plain (`"stream": false`) call is not cancelled by its agent going away
/// either: its answer is journaled whole, a repeat while it is generated waits
/// for it, and one after it replays it. Both dialects.
#[tokio::test]
async fn a_plain_call_whose_agent_goes_away_answers_its_repeat() {
    let (mock, sidecar) = setup(Behaviour {
        first_byte_delay: Duration::from_millis(600),
        ..Behaviour::default()
    })
    .await;
    for (n, d) in [D::OpenAi, D::Anthropic].into_iter().enumerate() {
        let key = format!("plain-left-{d:?}");
        leave_waiting(post_plain(&sidecar, d, &key), Duration::from_millis(200)).await;
        // Sent while the provider still works on the first call: it waits for its
        // answer (its own request reaches no provider).
        let waited = send(post_plain(&sidecar, d, &key)).await;
        assert_eq!(waited.status, StatusCode::OK, "{d:?}: {}", waited.text());
        assert_eq!(waited.header("outrigger-replayed"), Some("true"), "{d:?}");
        let answer = waited.json();
        let text = match d {
            D::OpenAi => answer["choices"][0]["message"]["content"].clone(),
            D::Anthropic => answer["content"][0]["text"].clone(),
        };
        assert!(
            text.as_str().is_some_and(|t| !t.is_empty()),
            "{d:?}: the answer whole: {answer}"
        );
        let later = send(post_plain(&sidecar, d, &key)).await;
        assert_eq!(later.header("outrigger-replayed"), Some("true"));
        assert_eq!(later.body, waited.body, "{d:?}: the same answer");
        assert_eq!(
            mock.generation_count(),
            n as u64 + 1,
            "{d:?}: generated once"
        );
    }
}

/// A plain call is cancelled like a stream (`POST /v1/streams/{key}/cancel`), while
/// it waits for the provider's answer and while the answer's body is on its way: its
/// agent, and a repeat that waited for it, get `409 cancelled` (which the SDKs are
/// told not to retry), and the key's next request generates afresh. Once the answer
/// is in, a cancel is too late.
#[tokio::test]
async fn a_plain_call_can_be_cancelled() {
    let (mock, sidecar) = setup(Behaviour::default()).await;
    let slow_head = Behaviour {
        first_byte_delay: Duration::from_secs(30),
        ..Behaviour::default()
    };
    let slow_body = Behaviour {
        body_delay: Duration::from_secs(30),
        ..Behaviour::default()
    };
    let cancel = |key: &str| {
        send(request(
            Method::POST,
            &sidecar.url(&format!("/v1/streams/m%2Fopenai%2F{key}/cancel")),
            &[],
            Bytes::new(),
        ))
    };
    for (n, (key, slow)) in [
        ("plain-cancel-head", slow_head),
        ("plain-cancel-body", slow_body),
    ]
    .into_iter()
    .enumerate()
    {
        let n = n as u64;
        mock.push(slow);
        let call = tokio::spawn(send(post_plain(&sidecar, D::OpenAi, key)));
        assert!(
            eventually(Duration::from_secs(10), || mock.received() == 2 * n + 1).await,
            "{key}: the call reached the provider"
        );
        // The repeat waits for the answer.
        let repeat = tokio::spawn(send(post_plain(&sidecar, D::OpenAi, key)));
        if n == 1 {
            // The provider's head is out, and then in: the body's read is cancelled.
            assert!(
                eventually(Duration::from_secs(10), || mock.answered() == 2).await,
                "{key}: the provider sent its head"
            );
        } else {
            assert_eq!(mock.answered(), 0, "{key}: no head yet");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let cancelled = cancel(key).await;
        assert_eq!(
            cancelled.status,
            StatusCode::ACCEPTED,
            "{key}: {}",
            cancelled.text()
        );
        for (who, call) in [("the call", call), ("its repeat", repeat)] {
            let answered = tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .unwrap_or_else(|_| panic!("{key}: {who} ends at the cancel"))
                .expect("the call");
            assert_eq!(
                answered.status,
                StatusCode::CONFLICT,
                "{key}: {who}: {}",
                answered.text()
            );
            assert_eq!(
                answered.json()["type"].as_str(),
                Some("urn:outrigger:problem:cancelled"),
                "{key}: {who}: {}",
                answered.text()
            );
            assert_eq!(
                answered.header("x-should-retry"),
                Some("false"),
                "{key}: {who}"
            );
        }
        let again = send(post_plain(&sidecar, D::OpenAi, key)).await;
        assert_eq!(again.status, StatusCode::OK, "{key}: {}", again.text());
        assert_eq!(
            again.header("outrigger-replayed"),
            None,
            "{key}: generated afresh"
        );
        assert_eq!(
            mock.received(),
            2 * n + 2,
            "{key}: the repeat reached no provider"
        );
        let late = cancel(key).await;
        assert_eq!(late.status, StatusCode::OK, "{key}: {}", late.text());
        assert_eq!(
            late.json()["cancelled"],
            false,
            "{key}: over, nothing to cancel"
        );
    }
}

/// With `[streams] cancel_on_disconnect`, a call whose agent goes away before its
/// answer is cancelled: the key's next request generates afresh, as attempt 2.
#[tokio::test]
async fn under_cancel_on_disconnect_a_call_left_before_its_answer_is_generated_afresh() {
    let (_mock, sidecar) = setup_with(
        Behaviour {
            chunks: 3,
            first_byte_delay: Duration::from_millis(500),
            ..Behaviour::default()
        },
        "[streams]\ncancel_on_disconnect = true\n",
    )
    .await;
    leave_waiting(
        post(&sidecar, D::OpenAi, Some("left"), &[]),
        Duration::from_millis(200),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let again = send(post(&sidecar, D::OpenAi, Some("left"), &[])).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text());
    assert_eq!(again.header("outrigger-replayed"), None);
    let evs = events(&again.body);
    assert!(has_id(&evs[0], 2, 0), "attempt 2: {}", evs[0]);

    leave_waiting(
        post_plain(&sidecar, D::OpenAi, "plain-left"),
        Duration::from_millis(200),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let again = send(post_plain(&sidecar, D::OpenAi, "plain-left")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text());
    assert_eq!(again.header("outrigger-replayed"), None, "generated afresh");
}

#[tokio::test]
async fn an_attempt_whose_events_the_journal_lost_ends_abandoned_and_its_key_generates_afresh() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 30,
        chunk_delay: Duration::from_millis(20),
        ..Behaviour::default()
    })
    .await;
    let faults = |v: serde_json::Value| {
        let url = sidecar.admin_url("/v1/faults");
        async move { post_json(&url, &[], &v).await }
    };
    let resp = open(post(&sidecar, D::OpenAi, Some("holed"), &[])).await;
    let key = resp.headers()["outrigger-stream-key"]
        .to_str()
        .unwrap()
        .to_string();
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while events(&got).len() < 3 {
        got.extend_from_slice(&next_chunk(&mut body).await.expect("a chunk").expect("data"));
    }
    // The journal fails long enough for the held text deltas' write to fail.
    assert_eq!(
        faults(json!({"journal": "fail_flush"})).await.status,
        StatusCode::OK
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(
        faults(json!({"journal": null})).await.status,
        StatusCode::OK
    );
    // The agent still gets the whole stream, unjournaled from the failure on.
    while let Some(chunk) = next_chunk(&mut body).await {
        got.extend_from_slice(&chunk.expect("data"));
    }
    assert!(events(&got).last().unwrap().contains("[DONE]"));
    let g = generation_of(&events(&got)[0]);
    let resume = |last: String| {
        let r = resume_by_key(&sidecar, &key, &last);
        async move {
            let r = r.await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.text());
            events(&r.body).last().cloned().unwrap_or_default()
        }
    };
    // Resumed from the journal, the attempt ends with a typed error, not a silent end.
    let last = resume(format!("{g}:1")).await;
    assert!(
        last.contains("stream_interrupted") && last.contains("journal lost events"),
        "{last}"
    );
    // A client that has the last event the stream's clients were sent has all there
    // was: nothing more (the journal lacks some, but no error is owed to it); one
    // that lacks some it was sent gets the typed error.
    let ids: Vec<String> = events(&got)
        .iter()
        .filter_map(|e| e.lines().next()?.strip_prefix("id: ").map(str::to_owned))
        .collect();
    let all = resume_by_key(&sidecar, &key, &ids[ids.len() - 1]).await;
    assert_eq!(all.status, StatusCode::NO_CONTENT, "{}", all.text());
    let short = resume_by_key(&sidecar, &key, &ids[ids.len() - 2]).await;
    assert_eq!(short.status, StatusCode::OK, "{}", short.text());
    assert!(
        events(&short.body)
            .last()
            .is_some_and(|e| e.contains("journal lost events")),
        "{}",
        short.text()
    );
    // It is not left open (and never completed with a hole): the same request
    // generates afresh.
    let again = send(post(&sidecar, D::OpenAi, Some("holed"), &[])).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text());
    assert_eq!(again.header("outrigger-replayed"), None);
    assert!(has_id(&events(&again.body)[0], 2, 0));
    assert_eq!(mock.generation_count(), 2);
    // Attempt 1 still ends the same way, now that attempt 2 has replaced it, by key
    // and by the repeated request.
    let last = resume(format!("{g}:1")).await;
    assert!(last.contains("did not complete"), "{last}");
    let repeated = send(post(
        &sidecar,
        D::OpenAi,
        Some("holed"),
        &[("last-event-id", &format!("{g}:1"))],
    ))
    .await;
    let last = events(&repeated.body).last().cloned().unwrap_or_default();
    assert!(last.contains("did not complete"), "{last}");
}

/// An OpenAI-dialect upstream that answers every request with `content_type` and
/// `body` (after `delay`), and counts the requests it received.
async fn scripted_upstream(
    content_type: &'static str,
    body: &'static [u8],
    delay: Duration,
) -> (outrigger_testing::http::Server, Arc<AtomicUsize>) {
    let requests = Arc::new(AtomicUsize::new(0));
    let count = requests.clone();
    let server = outrigger_testing::http::Server::start(
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        move |req| {
            count.fetch_add(1, Ordering::SeqCst);
            async move {
                let _ = outrigger_testing::http::read_body(req.into_body()).await;
                tokio::time::sleep(delay).await;
                let mut resp = http::Response::new(outrigger_testing::http::full(body));
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static(content_type),
                );
                resp
            }
        },
    )
    .await
    .expect("scripted upstream");
    (server, requests)
}

/// A sidecar whose one provider (`gpt-mock`, OpenAI dialect) is at `base`.
async fn sidecar_for(base: &str) -> Sidecar {
    let config = format!(
        r#"
[[providers]]
name = "oa"
kind = "openai"
base_url = "{base}/v1"
models = ["gpt-mock"]
"#
    );
    Sidecar::start(&config, &[]).await
}

/// The fields of the first event an SSE client dispatches from `body` (the WHATWG
/// rules that matter here: a leading BOM is dropped, lines split on LF, `field:
/// value`), or `None` when none is dispatched.
fn first_dispatched(body: &[u8]) -> Option<Vec<(String, String)>> {
    let text = String::from_utf8_lossy(body);
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let mut fields = Vec::new();
    for line in text.split('\n') {
        if line.is_empty() {
            if fields.iter().any(|(f, _): &(String, String)| f == "data") {
                return Some(fields);
            }
            fields.clear();
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (f, v) = line.split_once(':').unwrap_or((line, ""));
        fields.push((f.to_string(), v.trim_start_matches(' ').to_string()));
    }
    None
}

const BOM_STREAM: &[u8] = b"\xef\xbb\xbfdata: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"first\"},\"finish_reason\":null}]}\n\ndata: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";

/// A stream that opens with a byte order mark keeps its first event: journaled, the
/// mark is dropped (our `id:` line goes first, and behind it the mark would hide
/// the `data` field); relayed unjournaled, the bytes go as they came.
#[tokio::test]
async fn a_stream_that_opens_with_a_byte_order_mark_keeps_its_first_event() {
    let (upstream, _) = scripted_upstream("text/event-stream", BOM_STREAM, Duration::ZERO).await;
    let sidecar = sidecar_for(&upstream.url()).await;
    let journaled = send(post(&sidecar, D::OpenAi, Some("bom"), &[])).await;
    assert_eq!(journaled.status, StatusCode::OK, "{}", journaled.text());
    let text = journaled.text();
    assert!(
        has_id(&text, 1, 0)
            && text
                .split_once('\n')
                .is_some_and(|(_, r)| r.starts_with("data: {")),
        "{text:?}"
    );
    let first = first_dispatched(&journaled.body).expect("a first event");
    assert!(
        first.contains(&("id".into(), format!("{}:0", generation_of(&text))))
            && first
                .iter()
                .any(|(f, v)| f == "data" && v.contains("first")),
        "{first:?}"
    );
    let again = send(post(&sidecar, D::OpenAi, Some("bom"), &[])).await;
    assert_eq!(again.header("outrigger-replayed"), Some("true"));
    assert_eq!(again.body, journaled.body);
    let relayed = send(post(&sidecar, D::OpenAi, None, &[])).await;
    assert_eq!(relayed.body.as_ref(), BOM_STREAM);
    let first = first_dispatched(&relayed.body).expect("a first event");
    assert!(
        first
            .iter()
            .any(|(f, v)| f == "data" && v.contains("first"))
    );
}

/// A plain answer to a streamed request (here a 200 error document) is passed on as
/// it came and not journaled: the same request is answered afresh, never by a replay
/// dressed as a stream.
#[tokio::test]
async fn a_plain_answer_to_a_streamed_request_is_passed_on_not_journaled() {
    const ERROR: &[u8] = br#"{"error":{"message":"overloaded","type":"server_error"}}"#;
    let (upstream, requests) = scripted_upstream("application/json", ERROR, Duration::ZERO).await;
    let sidecar = sidecar_for(&upstream.url()).await;
    for n in 1..=2 {
        let r = send(post(&sidecar, D::OpenAi, Some("plain-to-stream"), &[])).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.header("outrigger-replayed"), None, "call {n}");
        assert_eq!(r.body.as_ref(), ERROR, "call {n}");
        assert_eq!(requests.load(Ordering::SeqCst), n, "call {n} went upstream");
    }
    // Resumed by key, the attempt ends with the typed error naming why.
    let resumed = get(&sidecar.url("/v1/streams/m%2Fopenai%2Fplain-to-stream")).await;
    assert_eq!(resumed.status, StatusCode::OK, "{}", resumed.text());
    assert!(
        resumed.text().contains("stream_interrupted")
            && resumed.text().contains("plain body")
            && !resumed.text().contains("overloaded"),
        "{}",
        resumed.text()
    );
}

/// A repeat that names where its client is (`Last-Event-ID`) gets the rest of that
/// attempt, whatever became of it, and never a fresh generation spliced after the
/// client's prefix: an attempt that broke is served from the journal, ending with
/// its error event; a generation the journal does not hold (an attempt the key never
/// had, another tag, no tag) is `410 generation-lost`; a key the journal does not
/// hold (unknown, or past retention) says so.
#[tokio::test]
async fn a_repeat_with_last_event_id_gets_the_rest_of_that_attempt_never_a_new_generation() {
    let (mock, sidecar) = setup(Behaviour {
        chunks: 6,
        ..Behaviour::default()
    })
    .await;
    mock.push(Behaviour {
        chunks: 6,
        cut_after: Some(4),
        // Apart, so that the stream starts before the cut.
        chunk_delay: Duration::from_millis(20),
        ..Behaviour::default()
    });
    let first = send(post(&sidecar, D::OpenAi, Some("leid"), &[])).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    let evs = events(&first.body);
    let n = evs.len();
    assert!(n >= 3, "some events and the error: {evs:?}");
    let g = generation_of(&evs[0]);
    let last_id = format!("{g}:{}", n - 1);
    assert!(
        evs[n - 1].starts_with(&format!("id: {last_id}\n"))
            && evs[n - 1].contains("stream_interrupted"),
        "{evs:?}"
    );
    let generations = mock.generation_count();
    // The client saw up to 1:1: it gets 1:2 to the end, from the journal.
    let rest = send(post(
        &sidecar,
        D::OpenAi,
        Some("leid"),
        &[("last-event-id", &format!("{g}:1"))],
    ))
    .await;
    assert_eq!(rest.status, StatusCode::OK, "{}", rest.text());
    assert_eq!(rest.header("outrigger-replayed"), Some("true"));
    assert_eq!(rest.body.as_ref(), evs[2..].concat().as_bytes());
    // Nothing after the last event.
    let r = send(post(
        &sidecar,
        D::OpenAi,
        Some("leid"),
        &[("last-event-id", &last_id)],
    ))
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{last_id}: {}", r.text());
    // A generation the journal does not hold: an attempt the key never had, one
    // with another tag (its start lost, its number taken again), an id without a
    // tag. Refused, never answered with another generation's events.
    let (attempt, tag) = g.split_once('.').expect("a tagged generation");
    let tag = u32::from_str_radix(tag, 16).expect("hex");
    let other = format!("{attempt}.{:08x}:1", tag ^ 1);
    for last in ["2:0", "1:1", other.as_str()] {
        let r = send(post(
            &sidecar,
            D::OpenAi,
            Some("leid"),
            &[("last-event-id", last)],
        ))
        .await;
        assert_eq!(r.status, StatusCode::GONE, "{last}: {}", r.text());
        assert!(r.text().contains("generation-lost"), "{last}: {}", r.text());
    }
    assert_eq!(mock.generation_count(), generations, "no new generation");
    // A key the journal does not hold.
    let unknown = send(post(
        &sidecar,
        D::OpenAi,
        Some("leid-never"),
        &[("last-event-id", "1:3")],
    ))
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{}", unknown.text());
    assert!(
        unknown.text().contains("unknown-stream") && unknown.text().contains("retention"),
        "{}",
        unknown.text()
    );
    assert_eq!(mock.generation_count(), generations, "no new generation");
    // Without the header, the same request is a fresh generation (attempt 2).
    let again = send(post(&sidecar, D::OpenAi, Some("leid"), &[])).await;
    assert!(has_id(&events(&again.body)[0], 2, 0));
}

/// `POST /v1/streams/{key}/cancel` reaches a generation still waiting for its first
/// event: the upstream request is dropped, and the stream ends, for the call and by
/// key, with the typed error event naming the cancel.
#[tokio::test]
async fn a_stream_cancelled_before_its_first_event_drops_its_upstream_request() {
    use tokio::io::AsyncReadExt;
    // An upstream that takes requests and never answers; it counts the connections
    // it has, and those the sidecar closed.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    let accepted = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(AtomicUsize::new(0));
    let (a, c) = (accepted.clone(), closed.clone());
    let upstream = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            let c = c.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = conn.read(&mut buf).await {
                    let _ = n;
                }
                c.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    let sidecar = sidecar_for(&format!("http://{addr}")).await;
    let call = tokio::spawn(send(post(&sidecar, D::OpenAi, Some("early-cancel"), &[])));
    assert!(
        eventually(Duration::from_secs(5), || accepted.load(Ordering::SeqCst)
            == 1)
        .await,
        "the request reached the upstream"
    );
    let cancel = send(request(
        Method::POST,
        &sidecar.url("/v1/streams/m%2Fopenai%2Fearly-cancel/cancel"),
        &[],
        Bytes::new(),
    ))
    .await;
    assert_eq!(cancel.status, StatusCode::ACCEPTED, "{}", cancel.text());
    assert_eq!(cancel.json()["cancelled"], true);
    let answered = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("the call ends at the cancel, not at the first-byte timeout")
        .expect("the call");
    assert_eq!(answered.status, StatusCode::OK, "{}", answered.text());
    let evs = events(&answered.body);
    assert_eq!(evs.len(), 1, "{evs:?}");
    assert!(
        has_id(&evs[0], 1, CLOSING)
            && evs[0].contains("stream_interrupted")
            && evs[0].contains("cancelled"),
        "{evs:?}"
    );
    assert!(
        eventually(Duration::from_secs(5), || closed.load(Ordering::SeqCst)
            == 1)
        .await,
        "the upstream request was not dropped"
    );
    // By key, the journal ends the attempt the same way.
    let by_key = get(&sidecar.url("/v1/streams/m%2Fopenai%2Fearly-cancel")).await;
    assert_eq!(by_key.status, StatusCode::OK, "{}", by_key.text());
    assert_eq!(by_key.body, answered.body);
    // A client that has that error event gets nothing more: not the event again.
    let closing = format!("{}:{CLOSING}", generation_of(&evs[0]));
    let after = send(request(
        Method::GET,
        &sidecar.url("/v1/streams/m%2Fopenai%2Fearly-cancel"),
        &[("last-event-id", closing.as_str())],
        Bytes::new(),
    ))
    .await;
    assert_eq!(after.status, StatusCode::NO_CONTENT, "{}", after.text());
    upstream.abort();
}

/// A key whose call was plain (`"stream": false`) is read back by
/// `GET /v1/streams/{key}` as the JSON document it journaled, not as broken SSE;
/// resumed after an untagged event id (it sent none), it has nothing more.
#[tokio::test]
async fn a_plain_answer_is_read_back_by_key_as_json() {
    let (_mock, sidecar) = setup(Behaviour::default()).await;
    let first = post_json(
        &sidecar.url(D::OpenAi.path()),
        &[("idempotency-key", "plain-by-key")],
        &D::OpenAi.body(false),
    )
    .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    let key = first
        .header("outrigger-stream-key")
        .expect("a stream key")
        .replace('/', "%2F");
    let read = get(&sidecar.url(&format!("/v1/streams/{key}"))).await;
    assert_eq!(read.status, StatusCode::OK, "{}", read.text());
    assert_eq!(read.header("content-type"), Some("application/json"));
    assert_eq!(read.header("outrigger-replayed"), Some("true"));
    assert_eq!(read.body, first.body, "the answer as the agent got it");
    let after = send(request(
        Method::GET,
        &sidecar.url(&format!("/v1/streams/{key}")),
        &[("last-event-id", "1:0")],
        Bytes::new(),
    ))
    .await;
    assert_eq!(after.status, StatusCode::NO_CONTENT, "{}", after.text());
}
