//! A scripted HTTP tool whose every call is a side effect, recorded by the
//! idempotency key it arrived with, so tests can count effects per key.
//!
//! Any `POST|PUT|PATCH|DELETE` applies an effect and answers
//! `{"ok":true,"effect":<n>,"key":…,"echo":<body>}`. `GET /status/{key}` is a probe:
//! 200 with the effect if one was applied under that key, 404 otherwise (after
//! `delay_ms` when its `x-mock-tool` header says so).
//! Behaviour comes from an `x-mock-tool` header (`delay_ms=50,fail=after`), a queue,
//! or the default:
//!
//! - `fail=before`: answer 503 without applying the effect;
//! - `fail=after`: apply the effect, then answer 500;
//! - `reset=after`: apply the effect, then drop the connection without an answer;
//! - `hang=after`: apply the effect, then never answer;
//! - `status=N`: apply the effect and answer N;
//! - `dedupe=true`: honour `Idempotency-Key` (a keyed tool): a repeated key returns
//!   the first answer and applies nothing.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::json;

use crate::http::{Body, Server, abort, json_response, read_body};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolBehaviour {
    pub delay: Duration,
    pub fail: Option<Fail>,
    pub status: Option<u16>,
    pub dedupe: bool,
    /// An MCP server answering as an event stream keeps it open after the response
    /// (which a server SHOULD close).
    pub keep_open: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fail {
    Before,
    After,
    Reset,
    Hang,
}

impl ToolBehaviour {
    pub fn apply_overrides(&mut self, spec: &str) -> Result<(), String> {
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').unwrap_or((part, "true"));
            match (k, v) {
                ("delay_ms", v) => {
                    self.delay =
                        Duration::from_millis(v.parse().map_err(|_| format!("bad delay_ms {v:?}"))?)
                }
                ("fail", "before") => self.fail = Some(Fail::Before),
                ("fail", "after") => self.fail = Some(Fail::After),
                ("reset", "after") => self.fail = Some(Fail::Reset),
                ("hang", "after") => self.fail = Some(Fail::Hang),
                ("status", v) => {
                    self.status = Some(v.parse().map_err(|_| format!("bad status {v:?}"))?)
                }
                ("dedupe", v) => self.dedupe = v == "true",
                ("keep_open", v) => self.keep_open = v == "true",
                _ => return Err(format!("x-mock-tool: unknown setting {part:?}")),
            }
        }
        Ok(())
    }
}

/// One applied side effect.
#[derive(Debug, Clone)]
pub struct Effect {
    pub n: u64,
    pub key: Option<String>,
    pub method: String,
    pub path: String,
    pub body: Bytes,
}

#[derive(Default)]
struct State {
    default: Mutex<ToolBehaviour>,
    script: Mutex<VecDeque<ToolBehaviour>>,
    effects: Mutex<Vec<Effect>>,
    /// Requests received (effect or not), for counting dispatches.
    received: Mutex<u64>,
    /// First answers by key, for `dedupe`.
    answers: Mutex<HashMap<String, serde_json::Value>>,
    /// Effects are counted but not kept (the binary, which nobody asks for them).
    unlogged: bool,
    /// Effects applied (kept or not).
    applied: Mutex<u64>,
}

pub struct MockTool {
    server: Server,
    state: Arc<State>,
}

impl MockTool {
    pub async fn start(default: ToolBehaviour) -> std::io::Result<Self> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), default).await
    }

    pub async fn start_on(addr: SocketAddr, default: ToolBehaviour) -> std::io::Result<Self> {
        Self::start_with(addr, default, false).await
    }

    /// A tool that counts its effects without keeping them ([`Self::effects`] stays
    /// empty), so that it runs in constant memory under any load (benchmarks, demo).
    /// `dedupe` still keeps each key's first answer.
    pub async fn start_unlogged(addr: SocketAddr, default: ToolBehaviour) -> std::io::Result<Self> {
        Self::start_with(addr, default, true).await
    }

    async fn start_with(
        addr: SocketAddr,
        default: ToolBehaviour,
        unlogged: bool,
    ) -> std::io::Result<Self> {
        let state = Arc::new(State {
            default: Mutex::new(default),
            unlogged,
            ..State::default()
        });
        let s = state.clone();
        let server = Server::start(addr, move |req| handle(s.clone(), req)).await?;
        Ok(Self { server, state })
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    pub fn push(&self, b: ToolBehaviour) {
        if let Ok(mut q) = self.state.script.lock() {
            q.push_back(b);
        }
    }

    pub fn set_default(&self, b: ToolBehaviour) {
        if let Ok(mut d) = self.state.default.lock() {
            *d = b;
        }
    }

    pub fn effects(&self) -> Vec<Effect> {
        self.state
            .effects
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default()
    }

    /// Requests that reached the tool (each may or may not have applied an effect).
    pub fn received(&self) -> u64 {
        self.state.received.lock().map(|r| *r).unwrap_or(0)
    }

    /// Effects applied per idempotency key (`None` for calls without one).
    pub fn effects_by_key(&self) -> HashMap<Option<String>, usize> {
        let mut out = HashMap::new();
        for e in self.effects() {
            *out.entry(e.key).or_insert(0) += 1;
        }
        out
    }
}

fn header(req: &Request<Incoming>, name: &str) -> Option<String> {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim_matches('"').to_string())
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    if let Ok(mut r) = state.received.lock() {
        *r += 1;
    }
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    if method == "GET" {
        if let Some(key) = path.strip_prefix("/status/") {
            // A probe can be slowed down too (`x-mock-tool: delay_ms=N`).
            let mut probe = ToolBehaviour::default();
            if let Some(spec) = header(&req, "x-mock-tool")
                && probe.apply_overrides(&spec).is_ok()
                && !probe.delay.is_zero()
            {
                tokio::time::sleep(probe.delay).await;
            }
            let found = state
                .effects
                .lock()
                .ok()
                .and_then(|e| e.iter().find(|e| e.key.as_deref() == Some(key)).cloned());
            return match found {
                // `tenant` echoes the caller's `x-tenant`: which of the agent's headers
                // reached the probe (and `content_encoding` and `if_none_match`, ones
                // that must not).
                Some(e) => json_response(
                    200,
                    &json!({"ok": true, "effect": e.n, "key": key,
                            "tenant": header(&req, "x-tenant"),
                            "content_encoding": header(&req, "content-encoding"),
                            "if_none_match": header(&req, "if-none-match")}),
                ),
                None => json_response(404, &json!({"ok": false, "key": key})),
            };
        }
        let key = header(&req, "idempotency-key");
        return json_response(200, &json!({"ok": true, "read": path, "key": key}));
    }
    let key = header(&req, "idempotency-key");
    let spec = header(&req, "x-mock-tool");
    let body = read_body(req.into_body()).await;
    let mut b = state
        .script
        .lock()
        .ok()
        .and_then(|mut q| q.pop_front())
        .unwrap_or_else(|| state.default.lock().map(|d| d.clone()).unwrap_or_default());
    if let Some(spec) = spec
        && let Err(e) = b.apply_overrides(&spec)
    {
        return json_response(400, &json!({"error": e}));
    }
    if !b.delay.is_zero() {
        tokio::time::sleep(b.delay).await;
    }
    if b.fail == Some(Fail::Before) {
        return json_response(
            503,
            &json!({"ok": false, "error": "unavailable (no effect)"}),
        );
    }
    if b.dedupe
        && let Some(k) = &key
        && let Some(first) = state.answers.lock().ok().and_then(|a| a.get(k).cloned())
    {
        return json_response(200, &first);
    }
    let echo: serde_json::Value = serde_json::from_slice(&body).unwrap_or(json!(null));
    let n = {
        let (Ok(mut applied), Ok(mut effects)) = (state.applied.lock(), state.effects.lock())
        else {
            return json_response(500, &json!({"error": "poisoned"}));
        };
        *applied += 1;
        if !state.unlogged {
            effects.push(Effect {
                n: *applied,
                key: key.clone(),
                method,
                path: path.clone(),
                body,
            });
        }
        *applied
    };
    let answer = json!({"ok": true, "effect": n, "key": key, "path": path, "echo": echo});
    if b.dedupe
        && let (Some(k), Ok(mut a)) = (&key, state.answers.lock())
    {
        a.insert(k.clone(), answer.clone());
    }
    match b.fail {
        Some(Fail::After) => json_response(
            500,
            &json!({"ok": false, "error": "failed after the effect"}),
        ),
        Some(Fail::Reset) => abort(),
        Some(Fail::Hang) => {
            std::future::pending::<()>().await;
            json_response(500, &json!({}))
        }
        Some(Fail::Before) | None => json_response(b.status.unwrap_or(200), &answer),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::raw_post;

    async fn post(addr: SocketAddr, key: &str) -> String {
        let key = format!("idempotency-key: {key}");
        raw_post(addr, "/op", &[&key], r#"{"amount":1}"#).await
    }

    #[tokio::test]
    async fn an_unlogged_tool_counts_effects_without_keeping_them() {
        let addr = SocketAddr::from(([127, 0, 0, 1], 0));
        let kept = MockTool::start_on(addr, ToolBehaviour::default())
            .await
            .expect("start");
        let unlogged = MockTool::start_unlogged(addr, ToolBehaviour::default())
            .await
            .expect("start");
        for tool in [&kept, &unlogged] {
            assert!(post(tool.addr(), "a").await.contains(r#""effect":1"#));
            assert!(post(tool.addr(), "b").await.contains(r#""effect":2"#));
        }
        assert_eq!(kept.effects().len(), 2);
        assert!(unlogged.effects().is_empty());
    }
}
