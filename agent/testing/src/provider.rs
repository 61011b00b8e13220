//! A scripted model provider speaking the OpenAI chat-completions and Anthropic
//! messages dialects.
//!
//! Behaviour comes, in order of precedence, from an `x-mock` request header
//! (`chunks=20,delay_ms=2,tools=2,status=429,retry_after=2,cut_after=5`), from a
//! queue of scripted behaviours (`push`), or from the provider's default. Every
//! request and the exact bytes sent back are recorded.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use serde_json::json;

use crate::http::{Body, BoxError, Server, full, json_response, read_body};
use crate::sse::{self, Dialect, Generation};

/// How the provider answers one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Behaviour {
    /// Text deltas per response.
    pub chunks: usize,
    /// Tool calls per response.
    pub tool_calls: usize,
    /// Pause between stream events.
    pub chunk_delay: Duration,
    /// Pause before the response head is sent.
    pub first_byte_delay: Duration,
    /// Answer with this error status instead (429, 500, 503, 529, ...).
    pub status: Option<u16>,
    /// `Retry-After` seconds on an error status.
    pub retry_after: Option<u64>,
    /// Abort the connection after this many stream events (no terminator); paced by
    /// `chunk_delay`, the abort comes that long after the last event.
    pub cut_after: Option<usize>,
    /// Abort the connection after this many body bytes, mid-event if it falls there.
    pub cut_bytes: Option<usize>,
    /// Answer 400 "context length exceeded" in the dialect's shape.
    pub context_overflow: bool,
    /// Finish with the dialect's content-filter reason.
    pub content_filtered: bool,
    /// Answer 200 with the request's headers as JSON (to test credential handling);
    /// a streamed request gets them as its first event, then a whole turn.
    pub echo_headers: bool,
    /// Act like an agent's model for a task of this many tool steps: one tool call
    /// per turn until the conversation holds that many tool results, then a final
    /// text answer (`tool_calls` is ignored).
    pub agent_steps: Option<usize>,
    /// Pause between a plain (not streamed) answer's head and its body.
    pub body_delay: Duration,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            chunks: 8,
            tool_calls: 0,
            chunk_delay: Duration::ZERO,
            first_byte_delay: Duration::ZERO,
            status: None,
            retry_after: None,
            cut_after: None,
            cut_bytes: None,
            context_overflow: false,
            content_filtered: false,
            echo_headers: false,
            agent_steps: None,
            body_delay: Duration::ZERO,
        }
    }
}

impl Behaviour {
    /// Applies `k=v,k=v` overrides (the `x-mock` header syntax).
    pub fn apply_overrides(&mut self, spec: &str) -> Result<(), String> {
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').unwrap_or((part, "true"));
            let num = || {
                v.parse::<u64>()
                    .map_err(|_| format!("x-mock: {k} needs a number, got {v:?}"))
            };
            match k {
                "chunks" => self.chunks = num()? as usize,
                "tools" => self.tool_calls = num()? as usize,
                "delay_ms" => self.chunk_delay = Duration::from_millis(num()?),
                "first_byte_ms" => self.first_byte_delay = Duration::from_millis(num()?),
                "status" => self.status = Some(num()? as u16),
                "retry_after" => self.retry_after = Some(num()?),
                "cut_after" => self.cut_after = Some(num()? as usize),
                "cut_bytes" => self.cut_bytes = Some(num()? as usize),
                "context_overflow" => self.context_overflow = v == "true",
                "content_filter" => self.content_filtered = v == "true",
                "echo" => self.echo_headers = v == "true",
                "agent_steps" => self.agent_steps = Some(num()? as usize),
                "body_delay_ms" => self.body_delay = Duration::from_millis(num()?),
                other => return Err(format!("x-mock: unknown key {other:?}")),
            }
        }
        Ok(())
    }
}

/// One request the provider received, and what it sent back.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    pub status: u16,
    /// The response body bytes as sent (for streams: every event written before the
    /// end or the cut).
    pub response: Arc<Mutex<Vec<u8>>>,
    /// How a streamed response ended (`None` while it is still being written, or for
    /// plain responses).
    pub stream_end: Arc<Mutex<Option<StreamEnd>>>,
}

/// How a streamed response ended, as seen by the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// Every event was written.
    Completed,
    /// The provider cut the stream on purpose (`cut_after`).
    Cut,
    /// The reader went away before the end (the body was dropped).
    Dropped,
}

impl Exchange {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn stream_end(&self) -> Option<StreamEnd> {
        self.stream_end.lock().ok().and_then(|e| *e)
    }

    pub fn response_bytes(&self) -> Vec<u8> {
        self.response.lock().map(|b| b.clone()).unwrap_or_default()
    }
}

#[derive(Default)]
struct State {
    default: Mutex<Behaviour>,
    script: Mutex<VecDeque<Behaviour>>,
    log: Mutex<Vec<Exchange>>,
    /// Exchanges are not kept (the binary, which nobody asks for them).
    unlogged: bool,
    generations: AtomicU64,
    /// Requests read whole, counted before any `first_byte_delay`.
    received: AtomicU64,
    /// Responses whose head was handed to the connection to send.
    answered: AtomicU64,
}

/// A running mock provider.
pub struct MockProvider {
    server: Server,
    state: Arc<State>,
}

impl MockProvider {
    pub async fn start(default: Behaviour) -> std::io::Result<Self> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), default).await
    }

    pub async fn start_on(addr: SocketAddr, default: Behaviour) -> std::io::Result<Self> {
        Self::start_with(addr, default, false).await
    }

    /// A provider that keeps no log of its exchanges ([`Self::exchanges`] stays
    /// empty), so that it runs in constant memory under any load (benchmarks, demo).
    pub async fn start_unlogged(addr: SocketAddr, default: Behaviour) -> std::io::Result<Self> {
        Self::start_with(addr, default, true).await
    }

    async fn start_with(
        addr: SocketAddr,
        default: Behaviour,
        unlogged: bool,
    ) -> std::io::Result<Self> {
        let state = Arc::new(State {
            default: Mutex::new(default),
            unlogged,
            ..State::default()
        });
        let s = state.clone();
        let server = Server::start(addr, move |req| {
            let s = s.clone();
            async move {
                let resp = handle(s.clone(), req).await;
                s.answered.fetch_add(1, Ordering::SeqCst);
                resp
            }
        })
        .await?;
        Ok(Self { server, state })
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// Base URL in the OpenAI SDK convention (`…/v1`).
    pub fn openai_base(&self) -> String {
        format!("{}/v1", self.server.url())
    }

    /// Base URL in the Anthropic SDK convention (no `/v1`).
    pub fn anthropic_base(&self) -> String {
        self.server.url()
    }

    /// Queues behaviours for the next requests, in order.
    pub fn push(&self, b: Behaviour) {
        if let Ok(mut q) = self.state.script.lock() {
            q.push_back(b);
        }
    }

    pub fn set_default(&self, b: Behaviour) {
        if let Ok(mut d) = self.state.default.lock() {
            *d = b;
        }
    }

    pub fn exchanges(&self) -> Vec<Exchange> {
        self.state.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Requests received on model endpoints (not `/v1/models`).
    pub fn generation_count(&self) -> u64 {
        self.state.generations.load(Ordering::SeqCst)
    }

    /// Requests read whole, on any path, including those still waiting out their
    /// `first_byte_delay` (which [`MockProvider::exchanges`] does not list yet).
    pub fn received(&self) -> u64 {
        self.state.received.load(Ordering::SeqCst)
    }

    /// Responses whose head was handed to the connection (after any
    /// `first_byte_delay`; a plain answer's body may still wait out `body_delay`).
    pub fn answered(&self) -> u64 {
        self.state.answered.load(Ordering::SeqCst)
    }
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let mock_header = req
        .headers()
        .get("x-mock")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = read_body(req.into_body()).await;
    state.received.fetch_add(1, Ordering::SeqCst);
    let response = Arc::new(Mutex::new(Vec::new()));
    let stream_end = Arc::new(Mutex::new(None));
    let record = |status: u16| Exchange {
        method: method.clone(),
        path: path.clone(),
        headers: headers.clone(),
        body: body.clone(),
        status,
        response: response.clone(),
        stream_end: stream_end.clone(),
    };

    let dialect = match (method.as_str(), path.as_str()) {
        ("POST", "/v1/chat/completions" | "/chat/completions") => Dialect::OpenAi,
        ("POST", "/v1/messages") => Dialect::Anthropic,
        ("GET", "/v1/models" | "/models") => {
            let resp = json!({"object": "list", "data": [
                {"id": "mock-model", "object": "model", "owned_by": "mock"}]});
            push_log(&state, record(200));
            return json_response(200, &resp);
        }
        _ => {
            push_log(&state, record(404));
            return json_response(404, &json!({"error": {"message": "no such mock route"}}));
        }
    };

    let mut behaviour = state
        .script
        .lock()
        .ok()
        .and_then(|mut q| q.pop_front())
        .unwrap_or_else(|| state.default.lock().map(|d| d.clone()).unwrap_or_default());
    if let Some(spec) = mock_header
        && let Err(e) = behaviour.apply_overrides(&spec)
    {
        push_log(&state, record(400));
        return json_response(400, &json!({"error": {"message": e}}));
    }
    if !behaviour.first_byte_delay.is_zero() {
        tokio::time::sleep(behaviour.first_byte_delay).await;
    }

    let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let n = state.generations.fetch_add(1, Ordering::SeqCst) + 1;

    let streaming = parsed["stream"].as_bool() == Some(true);
    if behaviour.echo_headers {
        let echoed: serde_json::Map<String, serde_json::Value> =
            headers.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
        let value = json!({"received_headers": echoed});
        if streaming {
            // The first event quotes the headers; a whole turn follows.
            let generation = Generation {
                n,
                model: "mock-model".into(),
                chunks: behaviour.chunks,
                tool_calls: 0,
                prompt_tokens: 1,
                include_usage: false,
                content_filtered: false,
            };
            let mut events = vec![format!("data: {value}\n\n")];
            events.extend(match dialect {
                Dialect::OpenAi => sse::openai_stream(&generation),
                Dialect::Anthropic => sse::anthropic_stream(&generation),
            });
            push_log(&state, record(200));
            return stream_response(events, behaviour, response, stream_end);
        }
        if let Ok(mut r) = response.lock() {
            r.extend_from_slice(value.to_string().as_bytes());
        }
        push_log(&state, record(200));
        return json_response(200, &value);
    }

    if let Some(status) = behaviour.status {
        let value = error_body(dialect, status);
        if let Ok(mut r) = response.lock() {
            r.extend_from_slice(value.to_string().as_bytes());
        }
        push_log(&state, record(status));
        let mut resp = json_response(status, &value);
        if let Some(secs) = behaviour.retry_after {
            resp.headers_mut()
                .insert("retry-after", hyper::header::HeaderValue::from(secs));
        }
        return resp;
    }
    if behaviour.context_overflow {
        let value = match dialect {
            Dialect::OpenAi => {
                json!({"error": {"message": "This model's maximum context length is 8192 tokens.",
                "type": "invalid_request_error", "code": "context_length_exceeded"}})
            }
            Dialect::Anthropic => {
                json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": "prompt is too long: 250000 tokens > 200000 maximum"}})
            }
        };
        push_log(&state, record(400));
        return json_response(400, &value);
    }

    let generation = Generation {
        n,
        model: parsed["model"].as_str().unwrap_or("mock-model").to_string(),
        chunks: behaviour.chunks,
        tool_calls: match behaviour.agent_steps {
            Some(steps) => usize::from(tool_results(&parsed) < steps),
            None => behaviour.tool_calls,
        },
        prompt_tokens: (body.len() as u64 / 4).max(1),
        include_usage: parsed["stream_options"]["include_usage"].as_bool() == Some(true),
        content_filtered: behaviour.content_filtered,
    };
    push_log(&state, record(200));

    if !streaming {
        let value = match dialect {
            Dialect::OpenAi => sse::openai_body(&generation),
            Dialect::Anthropic => sse::anthropic_body(&generation),
        };
        let bytes = Bytes::from(value.to_string());
        if let Ok(mut r) = response.lock() {
            r.extend_from_slice(&bytes);
        }
        let body = if behaviour.body_delay.is_zero() {
            full(bytes)
        } else {
            let delay = behaviour.body_delay;
            let later = futures_util::stream::once(async move {
                tokio::time::sleep(delay).await;
                Ok::<_, BoxError>(Frame::data(bytes))
            });
            StreamBody::new(later).boxed_unsync()
        };
        let mut resp = Response::new(body);
        resp.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        return resp;
    }

    let events = match dialect {
        Dialect::OpenAi => sse::openai_stream(&generation),
        Dialect::Anthropic => sse::anthropic_stream(&generation),
    };
    stream_response(events, behaviour, response, stream_end)
}

fn stream_response(
    events: Vec<String>,
    behaviour: Behaviour,
    sent: Arc<Mutex<Vec<u8>>>,
    end: Arc<Mutex<Option<StreamEnd>>>,
) -> Response<Body> {
    struct St {
        events: std::vec::IntoIter<String>,
        index: usize,
        written: usize,
        behaviour: Behaviour,
        sent: Arc<Mutex<Vec<u8>>>,
        end: Arc<Mutex<Option<StreamEnd>>>,
    }
    impl St {
        fn mark(&self, how: StreamEnd) {
            if let Ok(mut e) = self.end.lock() {
                e.get_or_insert(how);
            }
        }
    }
    impl Drop for St {
        fn drop(&mut self) {
            self.mark(StreamEnd::Dropped);
        }
    }
    let st = St {
        events: events.into_iter(),
        index: 0,
        written: 0,
        behaviour,
        sent,
        end,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        if st.behaviour.cut_after == Some(st.index) {
            // Paced, the break comes a pause after the last event, as a connection
            // that dies mid-stream does: the events before it have reached the reader
            // (an abort right behind a write can overtake it).
            if st.index > 0 && !st.behaviour.chunk_delay.is_zero() {
                tokio::time::sleep(st.behaviour.chunk_delay).await;
            }
            let err: BoxError = "mock provider cut the stream".into();
            // Yield the error once, then end: hyper aborts the connection.
            st.index = usize::MAX;
            st.mark(StreamEnd::Cut);
            return Some((Err(err), st));
        }
        if st.index == usize::MAX {
            return None;
        }
        let Some(event) = st.events.next() else {
            st.mark(StreamEnd::Completed);
            return None;
        };
        if st.index > 0 && !st.behaviour.chunk_delay.is_zero() {
            tokio::time::sleep(st.behaviour.chunk_delay).await;
        }
        st.index += 1;
        let mut bytes = Bytes::from(event);
        if let Some(limit) = st.behaviour.cut_bytes
            && st.written + bytes.len() > limit
        {
            // Send what fits, then break the connection on the next poll.
            bytes.truncate(limit - st.written);
            st.behaviour.cut_after = Some(st.index);
        }
        st.written += bytes.len();
        if let Ok(mut s) = st.sent.lock() {
            s.extend_from_slice(&bytes);
        }
        Some((Ok(Frame::data(bytes)), st))
    });
    let mut resp = Response::new(StreamBody::new(stream).boxed_unsync());
    let h = resp.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        hyper::header::CACHE_CONTROL,
        hyper::header::HeaderValue::from_static("no-cache"),
    );
    resp
}

/// Tool results in a conversation (OpenAI `role: tool` messages, Anthropic
/// `tool_result` blocks).
fn tool_results(request: &serde_json::Value) -> usize {
    request["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            if m["role"] == "tool" {
                1
            } else {
                m["content"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|b| b["type"] == "tool_result")
                    .count()
            }
        })
        .sum()
}

fn error_body(dialect: Dialect, status: u16) -> serde_json::Value {
    let (kind, message) = match status {
        429 => ("rate_limit_error", "Rate limit reached (mock)"),
        529 => ("overloaded_error", "Overloaded (mock)"),
        400..=499 => ("invalid_request_error", "Bad request (mock)"),
        _ => ("api_error", "Internal server error (mock)"),
    };
    match dialect {
        Dialect::OpenAi => json!({"error": {"message": message, "type": kind, "code": null}}),
        Dialect::Anthropic => json!({"type": "error", "error": {"type": kind, "message": message}}),
    }
}

fn push_log(state: &State, exchange: Exchange) {
    if state.unlogged {
        return;
    }
    if let Ok(mut log) = state.log.lock() {
        log.push(exchange);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::raw_post;

    #[tokio::test]
    async fn an_unlogged_provider_answers_without_keeping_exchanges() {
        let addr = SocketAddr::from(([127, 0, 0, 1], 0));
        let kept = MockProvider::start_on(addr, Behaviour::default())
            .await
            .expect("start");
        let unlogged = MockProvider::start_unlogged(addr, Behaviour::default())
            .await
            .expect("start");
        for mock in [&kept, &unlogged] {
            let body = r#"{"model":"gpt-mock","messages":[{"role":"user","content":"hi"}]}"#;
            let out = raw_post(mock.addr(), "/v1/chat/completions", &[], body).await;
            assert!(out.starts_with("HTTP/1.1 200"), "{out}");
            assert_eq!(mock.generation_count(), 1);
        }
        assert_eq!(kept.exchanges().len(), 1);
        assert!(unlogged.exchanges().is_empty());
    }

    #[test]
    fn overrides_parse() {
        let mut b = Behaviour::default();
        b.apply_overrides("chunks=3, tools=2,delay_ms=5,status=429,retry_after=2,echo")
            .unwrap();
        assert_eq!(b.chunks, 3);
        assert_eq!(b.tool_calls, 2);
        assert_eq!(b.chunk_delay, Duration::from_millis(5));
        assert_eq!(b.status, Some(429));
        assert_eq!(b.retry_after, Some(2));
        assert!(b.echo_headers);
        assert!(b.apply_overrides("bogus=1").is_err());
        assert!(b.apply_overrides("chunks=x").is_err());
    }
}
