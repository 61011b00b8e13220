//! The drill as the agent: model calls (streamed or not, in a task or not) and tool
//! calls on the data plane, each read to its end and judged from the agent's side —
//! did a stream end with its terminal event, with the sidecar's typed interruption
//! event, or silently; did a tool call arrive whole; what `usage` the provider
//! reported. Every call is tallied, so a scenario can account for all of its traffic.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::Method;
use outrigger_proxy::options::Dialect;
use serde_json::{Value, json};

use super::http::{Call, Http, Reply};
use super::setup::{ProviderPlan, ToolPlan};

/// How one model call is made.
#[derive(Debug, Clone, Default)]
pub struct ModelAsk {
    pub stream: bool,
    /// `Outrigger-Task-Id`.
    pub task: Option<String>,
    /// Makes the request body unique (a repeated body in a task may be replayed).
    pub prompt: String,
    /// Offer a tool and require the model to call it.
    pub tools: bool,
    /// Forwarded to the provider as `x-mock` (the mock provider's script; a real
    /// provider ignores it).
    pub mock: Option<String>,
    /// Counts body frames as they arrive.
    pub frames: Option<Arc<AtomicUsize>>,
    /// How long the whole answer may take (the HTTP client's default otherwise).
    pub timeout: Option<Duration>,
}

/// What the agent saw of a model call.
#[derive(Debug, Clone, Default)]
pub struct ModelSeen {
    /// `None`: no response head (connection refused or reset).
    pub status: Option<u16>,
    pub error: Option<String>,
    pub elapsed: Duration,
    /// `outrigger-attempts`.
    pub attempts: Option<u32>,
    pub replayed: bool,
    pub fault_injected: bool,
    pub retry_after: Option<String>,
    /// The problem document's type slug, on an error the sidecar produced.
    pub problem: Option<String>,
    pub stream: StreamView,
}

impl ModelSeen {
    /// 2xx, read to its end, ended by the dialect's terminal event (streams), with
    /// no interruption and no half tool call.
    pub fn completed(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
            && self.error.is_none()
            && self.stream.terminal
            && !self.stream.interrupted
            && self.stream.half_tool_calls == 0
    }

    /// A stream that stopped with neither its terminal event nor an error event.
    pub fn silently_truncated(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
            && self.error.is_none()
            && !self.stream.terminal
            && !self.stream.interrupted
            && !self.stream.upstream_error
    }

    /// The outcome bucket for traffic accounting.
    pub fn bucket(&self) -> &'static str {
        match self.status {
            None => "model: no answer (connection failed)",
            Some(_) if self.completed() && self.replayed => "model: replayed from the journal",
            Some(_) if self.completed() => "model: completed",
            Some(_) if self.stream.interrupted => "model: typed stream_interrupted event",
            Some(_) if self.silently_truncated() => "model: SILENTLY TRUNCATED",
            Some(s) if s < 300 && self.error.is_some() => "model: connection broke mid-answer",
            Some(429) => "model: 429 to the agent",
            Some(s) if s >= 500 => "model: 5xx to the agent",
            Some(_) => "model: other error",
        }
    }
}

/// A response body judged event by event (a plain JSON body is one "event").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamView {
    pub events: usize,
    /// Ended properly: `[DONE]`/a finish reason (OpenAI) or `message_stop`
    /// (Anthropic); always true for a complete non-streamed body.
    pub terminal: bool,
    /// The sidecar's typed interruption event.
    pub interrupted: bool,
    /// Another error event (the provider's).
    pub upstream_error: bool,
    pub complete_tool_calls: usize,
    /// Tool calls that arrived in part (arguments that do not parse, no name…).
    pub half_tool_calls: usize,
    /// Indexes of the events that carried tool-call parts.
    pub tool_events: Vec<usize>,
    /// `(input, output)` tokens the provider reported.
    pub usage: Option<(u64, u64)>,
}

/// Splits an SSE body into events' `data` (joined) and `event` name.
fn sse_events(body: &[u8]) -> Vec<(Option<String>, String)> {
    let text = String::from_utf8_lossy(body).replace("\r\n", "\n");
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = None;
            let mut data = Vec::new();
            for line in e.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    name = Some(v.trim().to_owned());
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v).to_owned());
                }
            }
            (name, data.join("\n"))
        })
        .collect()
}

/// Judges a streamed body.
pub fn view_stream(dialect: Dialect, body: &[u8]) -> StreamView {
    let mut v = StreamView::default();
    // Tool calls by index: (id, name, arguments, closed).
    let mut calls: BTreeMap<u64, (String, String, String, bool)> = BTreeMap::new();
    let events = sse_events(body);
    v.events = events.len();
    for (i, (name, data)) in events.iter().enumerate() {
        if data == "[DONE]" {
            v.terminal = true;
            continue;
        }
        let doc: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        match dialect {
            Dialect::OpenAi => {
                if !doc["error"].is_null() {
                    if doc["error"]["type"] == "stream_interrupted" {
                        v.interrupted = true;
                    } else {
                        v.upstream_error = true;
                    }
                    continue;
                }
                if let Some(u) = doc.get("usage").filter(|u| u.is_object()) {
                    v.usage = Some((
                        u["prompt_tokens"].as_u64().unwrap_or(0),
                        u["completion_tokens"].as_u64().unwrap_or(0),
                    ));
                }
                let choice = &doc["choices"][0];
                if let Some(parts) = choice["delta"]["tool_calls"].as_array() {
                    v.tool_events.push(i);
                    for p in parts {
                        let entry = calls.entry(p["index"].as_u64().unwrap_or(0)).or_default();
                        if let Some(id) = p["id"].as_str() {
                            entry.0 = id.to_owned();
                        }
                        if let Some(n) = p["function"]["name"].as_str() {
                            entry.1.push_str(n);
                        }
                        if let Some(a) = p["function"]["arguments"].as_str() {
                            entry.2.push_str(a);
                        }
                    }
                }
                if choice["finish_reason"].is_string() {
                    for c in calls.values_mut() {
                        c.3 = true;
                    }
                }
            }
            Dialect::Anthropic => {
                let kind = name.as_deref().or(doc["type"].as_str()).unwrap_or_default();
                match kind {
                    "error" => {
                        let message = doc["error"]["message"].as_str().unwrap_or_default();
                        if message.starts_with("outrigger:") {
                            v.interrupted = true;
                        } else {
                            v.upstream_error = true;
                        }
                    }
                    "message_start" => {
                        let u = &doc["message"]["usage"];
                        v.usage = Some((
                            u["input_tokens"].as_u64().unwrap_or(0),
                            u["output_tokens"].as_u64().unwrap_or(0),
                        ));
                    }
                    "message_delta" => {
                        if let Some(out) = doc["usage"]["output_tokens"].as_u64() {
                            let input = v.usage.map_or(0, |u| u.0);
                            v.usage = Some((input, out));
                        }
                    }
                    "message_stop" => v.terminal = true,
                    "content_block_start" if doc["content_block"]["type"] == "tool_use" => {
                        v.tool_events.push(i);
                        let idx = doc["index"].as_u64().unwrap_or(0);
                        let b = &doc["content_block"];
                        calls.insert(
                            idx,
                            (
                                b["id"].as_str().unwrap_or_default().to_owned(),
                                b["name"].as_str().unwrap_or_default().to_owned(),
                                String::new(),
                                false,
                            ),
                        );
                    }
                    "content_block_delta" if doc["delta"]["type"] == "input_json_delta" => {
                        v.tool_events.push(i);
                        if let Some(c) = calls.get_mut(&doc["index"].as_u64().unwrap_or(0)) {
                            c.2.push_str(doc["delta"]["partial_json"].as_str().unwrap_or_default());
                        }
                    }
                    "content_block_stop" => {
                        if let Some(c) = calls.get_mut(&doc["index"].as_u64().unwrap_or(0)) {
                            v.tool_events.push(i);
                            c.3 = true;
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    for (id, name, args, closed) in calls.values() {
        let args_ok = (args.is_empty() && dialect == Dialect::Anthropic)
            || serde_json::from_str::<Value>(args).is_ok();
        if *closed && !id.is_empty() && !name.is_empty() && args_ok {
            v.complete_tool_calls += 1;
        } else {
            v.half_tool_calls += 1;
        }
    }
    v
}

/// Judges a plain (non-streamed) JSON body.
pub fn view_body(dialect: Dialect, body: &[u8]) -> StreamView {
    let doc: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let mut v = StreamView {
        events: 1,
        terminal: !doc.is_null() && doc["error"].is_null(),
        upstream_error: !doc["error"].is_null(),
        ..StreamView::default()
    };
    let u = &doc["usage"];
    match dialect {
        Dialect::OpenAi => {
            if u.is_object() {
                v.usage = Some((
                    u["prompt_tokens"].as_u64().unwrap_or(0),
                    u["completion_tokens"].as_u64().unwrap_or(0),
                ));
            }
            for c in doc["choices"][0]["message"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let args = c["function"]["arguments"].as_str().unwrap_or_default();
                if serde_json::from_str::<Value>(args).is_ok() {
                    v.complete_tool_calls += 1;
                } else {
                    v.half_tool_calls += 1;
                }
            }
        }
        Dialect::Anthropic => {
            if u.is_object() {
                v.usage = Some((
                    u["input_tokens"].as_u64().unwrap_or(0),
                    u["output_tokens"].as_u64().unwrap_or(0),
                ));
            }
            v.complete_tool_calls = doc["content"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|b| b["type"] == "tool_use")
                .count();
        }
    }
    v
}

/// What the agent saw of a tool call.
#[derive(Debug, Clone, Default)]
pub struct ToolSeen {
    pub tool: String,
    pub key: String,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub body: Value,
    pub replayed: bool,
    /// The problem document's type slug (`journal-unavailable`, `outcome-unknown`…).
    pub problem: Option<String>,
    /// The problem document's `state` (the journal state the key rests in).
    pub state: Option<String>,
}

/// How the agent reads a tool call's answer (Jepsen's ok / fail / info).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Told {
    /// 2xx: the effect happened and this is its result.
    Done,
    /// Definitely not executed (the sidecar refused before sending, or the tool
    /// refused without effect).
    NotDone,
    /// Unknown: the call may or may not have taken effect, or is still running
    /// (`409 request-in-progress`: another request with the key has not finished).
    Unknown,
}

impl ToolSeen {
    pub fn told(&self) -> Told {
        match (self.status, self.problem.as_deref()) {
            (Some(s), _) if (200..300).contains(&s) => Told::Done,
            // Refusals the sidecar answers before anything is sent (the slugs of
            // `outrigger_proxy::error`). Not `request-in-progress`: that call is
            // running, and its effect may already have happened.
            (
                Some(_),
                Some(
                    "journal-unavailable"
                    | "journal-error"
                    | "key-reused"
                    | "invalid-request"
                    | "malformed-json"
                    | "bad-header"
                    | "missing-idempotency-key",
                ),
            ) => Told::NotDone,
            _ => Told::Unknown,
        }
    }

    pub fn bucket(&self) -> &'static str {
        match (self.told(), self.replayed) {
            (Told::Done, true) => "tool: replayed from the journal",
            (Told::Done, false) => "tool: completed",
            (Told::NotDone, _) => "tool: refused, not executed",
            (Told::Unknown, _) if self.status.is_none() => "tool: no answer (connection failed)",
            (Told::Unknown, _) => "tool: outcome unknown to the agent",
        }
    }
}

/// Everything the agent did, for accounting.
#[derive(Debug, Default)]
pub struct Tally {
    pub by_bucket: BTreeMap<String, u64>,
    /// Provider usage on generated (not replayed) calls, by task (`""`: none).
    pub usage_by_task: BTreeMap<String, u64>,
    /// Calls that ended without usage.
    pub incomplete: u64,
    pub tasks: BTreeSet<String>,
    pub tool_calls: Vec<ToolSeen>,
    /// By task: streams ended by the typed interruption event, and the tool-call
    /// keys answered "outcome unknown" (what the task tracker should charge as faults).
    pub faults_seen: BTreeMap<String, (u64, BTreeSet<String>)>,
}

/// The agent: the data plane of one sidecar, and the books of what it asked.
#[derive(Clone)]
pub struct Agent {
    http: Http,
    base: Arc<Mutex<String>>,
    pub provider: ProviderPlan,
    tally: Arc<Mutex<Tally>>,
}

impl Agent {
    pub fn new(http: Http, data: std::net::SocketAddr, provider: ProviderPlan) -> Self {
        Self {
            http,
            base: Arc::new(Mutex::new(format!("http://{data}"))),
            provider,
            tally: Arc::new(Mutex::new(Tally::default())),
        }
    }

    /// Points the agent (and its clones) at a restarted sidecar.
    pub fn moved_to(&self, data: std::net::SocketAddr) {
        if let Ok(mut b) = self.base.lock() {
            *b = format!("http://{data}");
        }
    }

    fn url(&self, path: &str) -> String {
        let base = self.base.lock().map(|b| b.clone()).unwrap_or_default();
        format!("{base}{path}")
    }

    pub fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The request body of a model call in the provider's dialect.
    pub fn model_body(&self, ask: &ModelAsk) -> Value {
        let model = &self.provider.model;
        let messages = json!([{"role": "user", "content": ask.prompt}]);
        let mut body = match self.provider.dialect {
            Dialect::OpenAi => json!({"model": model, "messages": messages, "stream": ask.stream}),
            Dialect::Anthropic => {
                json!({"model": model, "messages": messages, "stream": ask.stream, "max_tokens": 256})
            }
        };
        if ask.stream && self.provider.dialect == Dialect::OpenAi {
            body["stream_options"] = json!({"include_usage": true});
        }
        if ask.tools {
            let schema = json!({"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]});
            match self.provider.dialect {
                Dialect::OpenAi => {
                    body["tools"] = json!([{"type": "function", "function": {
                        "name": "get_weather", "description": "Weather for a city",
                        "parameters": schema}}]);
                    body["tool_choice"] = json!("required");
                }
                Dialect::Anthropic => {
                    body["tools"] = json!([{"name": "get_weather",
                        "description": "Weather for a city", "input_schema": schema}]);
                    body["tool_choice"] = json!({"type": "any"});
                }
            }
        }
        body
    }

    pub async fn model(&self, ask: &ModelAsk) -> ModelSeen {
        let path = match self.provider.dialect {
            Dialect::OpenAi => "/v1/chat/completions",
            Dialect::Anthropic => "/v1/messages",
        };
        let mut call = Call::new(Method::POST, self.url(path)).json(&self.model_body(ask));
        if let Some(task) = &ask.task {
            call = call.header("outrigger-task-id", task.clone());
        }
        if let Some(mock) = &ask.mock {
            call = call.header("x-mock", mock.clone());
        }
        call.frames = ask.frames.clone();
        if let Some(timeout) = ask.timeout {
            call.timeout = timeout;
        }
        let seen = match self.http.send(call).await {
            Ok(reply) => self.model_seen(ask.stream, &reply),
            Err(e) => ModelSeen {
                error: Some(e.detail),
                elapsed: e.after,
                ..ModelSeen::default()
            },
        };
        let mut tally = self.tally();
        *tally.by_bucket.entry(seen.bucket().to_owned()).or_default() += 1;
        if let Some(task) = &ask.task {
            tally.tasks.insert(task.clone());
            if seen.stream.interrupted {
                tally.faults_seen.entry(task.clone()).or_default().0 += 1;
            }
        }
        match (seen.stream.usage, seen.replayed) {
            (Some((i, o)), false) if seen.completed() => {
                *tally
                    .usage_by_task
                    .entry(ask.task.clone().unwrap_or_default())
                    .or_default() += i + o;
            }
            (_, true) if seen.completed() => {}
            _ => tally.incomplete += 1,
        }
        seen
    }

    fn model_seen(&self, stream: bool, reply: &Reply) -> ModelSeen {
        let dialect = self.provider.dialect;
        let ok = reply.status.is_success();
        let view = if !ok {
            StreamView::default()
        } else if stream && outrigger_proxy::headers::is_event_stream(&reply.headers) {
            view_stream(dialect, &reply.body)
        } else {
            view_body(dialect, &reply.body)
        };
        ModelSeen {
            status: Some(reply.status.as_u16()),
            error: reply.body_error.clone(),
            elapsed: reply.elapsed,
            attempts: reply
                .header(outrigger_proxy::headers::ATTEMPTS)
                .and_then(|v| v.parse().ok()),
            replayed: reply.header(outrigger_proxy::headers::REPLAYED) == Some("true"),
            fault_injected: reply.header(outrigger_proxy::headers::FAULT_INJECTED) == Some("true"),
            retry_after: reply.header("retry-after").map(str::to_owned),
            problem: (!ok)
                .then(|| reply.json()["type"].as_str().map(str::to_owned))
                .flatten()
                .and_then(|t| t.strip_prefix("urn:outrigger:problem:").map(str::to_owned)),
            stream: view,
        }
    }

    /// A side-effecting tool call (`POST /tools/{tool}/outrigger-drill`) under `key`.
    pub async fn tool(
        &self,
        tool: &ToolPlan,
        key: &str,
        task: &str,
        payload: &Value,
        wait: Option<u64>,
    ) -> ToolSeen {
        let mut call = Call::new(
            Method::POST,
            self.url(&format!("/tools/{}/outrigger-drill", tool.name)),
        )
        .json(payload)
        .header("idempotency-key", key)
        .header("outrigger-task-id", task);
        if let Some(w) = wait {
            call = call.header("prefer", format!("wait={w}"));
        }
        let seen = match self.http.send(call).await {
            Ok(reply) => {
                let body: Value = serde_json::from_slice(&reply.body).unwrap_or(Value::Null);
                let problem = body["type"]
                    .as_str()
                    .and_then(|t| t.strip_prefix("urn:outrigger:problem:"))
                    .map(str::to_owned);
                ToolSeen {
                    tool: tool.name.clone(),
                    key: key.to_owned(),
                    status: Some(reply.status.as_u16()),
                    error: reply.body_error.clone(),
                    state: problem
                        .as_ref()
                        .and(body["state"].as_str().map(str::to_owned)),
                    problem,
                    replayed: reply.header(outrigger_proxy::headers::REPLAYED) == Some("true"),
                    body,
                }
            }
            Err(e) => ToolSeen {
                tool: tool.name.clone(),
                key: key.to_owned(),
                error: Some(e.detail),
                ..ToolSeen::default()
            },
        };
        let mut tally = self.tally();
        *tally.by_bucket.entry(seen.bucket().to_owned()).or_default() += 1;
        tally.tasks.insert(task.to_owned());
        if seen.told() == Told::Unknown && seen.status.is_some() {
            tally
                .faults_seen
                .entry(task.to_owned())
                .or_default()
                .1
                .insert(format!("{}/{key}", tool.name));
        }
        tally.tool_calls.push(seen.clone());
        seen
    }

    /// Asks the tool itself (not through the sidecar) whether `key`'s effect
    /// happened: `Some(body)` yes, `None` no; `Err` when it did not say.
    pub async fn tool_status(
        &self,
        tool: &ToolPlan,
        key: &str,
    ) -> Result<Option<Value>, StatusError> {
        let url = format!(
            "{}{}",
            tool.base_url,
            tool.status_path.replace("{key}", key)
        );
        let mut call = Call::new(Method::GET, url.clone());
        call.timeout = Duration::from_secs(5);
        let reply = self.http.send(call).await.map_err(|e| StatusError {
            status: None,
            detail: format!("GET {url}: {e}"),
        })?;
        match reply.status.as_u16() {
            200..=299 => Ok(Some(reply.json())),
            404 => Ok(None),
            other => Err(StatusError {
                status: Some(other),
                detail: format!("GET {url} answered {other}"),
            }),
        }
    }
}

/// A tool's status endpoint that did not answer yes (2xx) or no (404).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusError {
    /// `None`: no answer (connection refused, timeout).
    pub status: Option<u16>,
    pub detail: String,
}

impl StatusError {
    /// The tool has no such endpoint (another 4xx, or 501): it cannot say, which is
    /// not a failure to ask it. Anything else (no answer, a 5xx) is.
    pub fn unsupported(&self) -> bool {
        self.status
            .is_some_and(|s| (400..500).contains(&s) || s == 501)
    }
}

impl std::fmt::Display for StatusError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn openai(events: &[Value]) -> Vec<u8> {
        events
            .iter()
            .map(|e| format!("id: 1:{}\ndata: {e}\n\n", e["n"]))
            .collect::<String>()
            .into_bytes()
    }

    #[test]
    fn openai_streams_are_judged_whole_cut_or_silent() {
        let text =
            json!({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}]});
        let call = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1",
            "function": {"name": "f", "arguments": "{\"a\":"}}]}, "finish_reason": null}]});
        let rest = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
            "function": {"arguments": "1}"}}]}, "finish_reason": null}]});
        let finish = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]});
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}});
        let mut whole = openai(&[text.clone(), call.clone(), rest, finish, usage]);
        whole.extend_from_slice(b"data: [DONE]\n\n");
        let v = view_stream(Dialect::OpenAi, &whole);
        assert!(v.terminal && !v.interrupted);
        assert_eq!((v.complete_tool_calls, v.half_tool_calls), (1, 0));
        assert_eq!(v.usage, Some((3, 4)));
        assert_eq!(v.tool_events, vec![1, 2]);

        let cut_event = json!({"error": {"type": "stream_interrupted", "message": "x"}});
        let cut = openai(&[text.clone(), cut_event]);
        let v = view_stream(Dialect::OpenAi, &cut);
        assert!(v.interrupted && !v.terminal);
        assert_eq!(v.half_tool_calls, 0);

        let half = openai(&[text.clone(), call]);
        let v = view_stream(Dialect::OpenAi, &half);
        assert_eq!(
            v.half_tool_calls, 1,
            "a call with no finish and broken arguments"
        );
        let seen = ModelSeen {
            status: Some(200),
            stream: v,
            ..ModelSeen::default()
        };
        assert!(seen.silently_truncated());
        assert!(!seen.completed());
    }

    #[test]
    fn anthropic_streams_track_blocks_usage_and_the_typed_error() {
        let ev = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
        let mut body = ev(
            "message_start",
            json!({"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}}),
        );
        body += &ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}}),
        );
        body += &ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"a\":1}"}}),
        );
        let open = body.clone();
        body += &ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        );
        body += &ev(
            "message_delta",
            json!({"type": "message_delta", "usage": {"output_tokens": 12}}),
        );
        body += &ev("message_stop", json!({"type": "message_stop"}));
        let v = view_stream(Dialect::Anthropic, body.as_bytes());
        assert!(v.terminal);
        assert_eq!(v.usage, Some((9, 12)));
        assert_eq!((v.complete_tool_calls, v.half_tool_calls), (1, 0));

        let cut = open
            + &ev(
                "error",
                json!({"type": "error", "error": {"type": "api_error", "message": "outrigger: the upstream stream was interrupted"}}),
            );
        let v = view_stream(Dialect::Anthropic, cut.as_bytes());
        assert!(v.interrupted && !v.terminal);
        assert_eq!(v.half_tool_calls, 1);
    }

    #[test]
    fn tool_answers_map_to_jepsen_outcomes() {
        let seen = |status: Option<u16>, problem: Option<&str>| ToolSeen {
            status,
            problem: problem.map(str::to_owned),
            ..ToolSeen::default()
        };
        assert_eq!(seen(Some(201), None).told(), Told::Done);
        assert_eq!(
            seen(Some(503), Some("journal-unavailable")).told(),
            Told::NotDone
        );
        assert_eq!(
            seen(Some(502), Some("outcome-unknown")).told(),
            Told::Unknown
        );
        assert_eq!(seen(None, None).told(), Told::Unknown);
        assert_eq!(seen(Some(500), None).told(), Told::Unknown);
        assert_eq!(
            seen(Some(400), Some("missing-idempotency-key")).told(),
            Told::NotDone
        );
        // The call with the key is still running: it may take effect yet.
        assert_eq!(
            seen(Some(409), Some("request-in-progress")).told(),
            Told::Unknown
        );
    }
}
