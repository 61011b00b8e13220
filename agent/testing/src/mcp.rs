//! A scripted MCP server (Streamable HTTP, `POST /mcp`) with two tools whose calls
//! are side effects recorded by idempotency key (from `params._meta` or the
//! `Idempotency-Key` header). Answers in JSON, or as an SSE stream with a progress
//! notification before the result when the behaviour says `sse` (and the stream kept
//! open after it with `keep_open`). Faults as for
//! [`crate::tool`] (`x-mock-tool` header or a queue).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::{Value, json};

use crate::http::{Body, Server, abort, full, json_response, read_body};
use crate::tool::{Effect, Fail, ToolBehaviour};

/// The `_meta` field carrying an idempotency key.
pub const META_KEY: &str = "outrigger/idempotency-key";

#[derive(Default)]
struct State {
    default: Mutex<(ToolBehaviour, bool)>,
    script: Mutex<VecDeque<ToolBehaviour>>,
    effects: Mutex<Vec<Effect>>,
    methods: Mutex<Vec<String>>,
    metas: Mutex<Vec<Value>>,
}

pub struct MockMcp {
    server: Server,
    state: Arc<State>,
}

impl MockMcp {
    /// `sse`: answer `tools/call` as an SSE stream instead of JSON.
    pub async fn start(default: ToolBehaviour, sse: bool) -> std::io::Result<Self> {
        let state = Arc::new(State {
            default: Mutex::new((default, sse)),
            ..State::default()
        });
        let s = state.clone();
        let server = Server::start(SocketAddr::from(([127, 0, 0, 1], 0)), move |req| {
            handle(s.clone(), req)
        })
        .await?;
        Ok(Self { server, state })
    }

    /// The MCP endpoint URL (`…/mcp`).
    pub fn url(&self) -> String {
        format!("{}/mcp", self.server.url())
    }

    pub fn push(&self, b: ToolBehaviour) {
        if let Ok(mut q) = self.state.script.lock() {
            q.push_back(b);
        }
    }

    pub fn effects(&self) -> Vec<Effect> {
        self.state
            .effects
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default()
    }

    /// Every JSON-RPC method received, in order.
    pub fn methods(&self) -> Vec<String> {
        self.state
            .methods
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default()
    }

    /// The `params._meta` of every `tools/call` received.
    pub fn metas(&self) -> Vec<Value> {
        self.state
            .metas
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default()
    }
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    if req.method() != hyper::Method::POST {
        return json_response(405, &json!({"error": "POST only"}));
    }
    let header_key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim_matches('"').to_string());
    let spec = req
        .headers()
        .get("x-mock-tool")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = read_body(req.into_body()).await;
    let Ok(msg) = serde_json::from_slice::<Value>(&body) else {
        return json_response(
            400,
            &json!({"jsonrpc": "2.0", "id": null,
            "error": {"code": -32700, "message": "parse error"}}),
        );
    };
    let method = msg["method"].as_str().unwrap_or_default().to_string();
    if let Ok(mut m) = state.methods.lock() {
        m.push(method.clone());
    }
    let id = msg.get("id").cloned();
    let Some(id) = id else {
        // A notification: accepted, no body.
        let mut resp = Response::new(full(Bytes::new()));
        *resp.status_mut() = hyper::StatusCode::ACCEPTED;
        return resp;
    };
    let (mut b, sse) = state.default.lock().map(|d| d.clone()).unwrap_or_default();
    if let Some(next) = state.script.lock().ok().and_then(|mut q| q.pop_front()) {
        b = next;
    }
    if let Some(spec) = spec
        && let Err(e) = b.apply_overrides(&spec)
    {
        return json_response(400, &json!({"error": e}));
    }
    let result = match method.as_str() {
        "initialize" => json!({"protocolVersion": "2025-06-18",
            "capabilities": {"tools": {"listChanged": false}},
            "serverInfo": {"name": "mock-mcp", "version": "0.1.0"}}),
        "tools/list" => json!({"tools": [
            {"name": "send_email", "description": "Sends an email (a side effect)",
             "inputSchema": {"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}}}},
            {"name": "get_weather", "description": "Reads the weather",
             "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}}}]}),
        "tools/call" => {
            let meta = msg["params"]["_meta"].clone();
            if let Ok(mut m) = state.metas.lock() {
                m.push(meta.clone());
            }
            if !b.delay.is_zero() {
                tokio::time::sleep(b.delay).await;
            }
            if b.fail == Some(Fail::Before) {
                return json_response(503, &json!({"error": "unavailable (no effect)"}));
            }
            let key = meta[META_KEY].as_str().map(str::to_owned).or(header_key);
            let name = msg["params"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let args = msg["params"]["arguments"].clone();
            let n = {
                let Ok(mut effects) = state.effects.lock() else {
                    return json_response(500, &json!({}));
                };
                let n = effects.len() as u64 + 1;
                effects.push(Effect {
                    n,
                    key,
                    method: "tools/call".into(),
                    path: name.clone(),
                    body: Bytes::from(args.to_string()),
                });
                n
            };
            match b.fail {
                Some(Fail::After) => {
                    return json_response(500, &json!({"error": "failed after the effect"}));
                }
                Some(Fail::Reset) => return abort(),
                Some(Fail::Hang) => {
                    std::future::pending::<()>().await;
                }
                Some(Fail::Before) | None => {}
            }
            json!({"content": [{"type": "text", "text": format!("{name} done (effect {n})")}],
                   "structuredContent": {"effect": n}, "isError": false})
        }
        other => {
            return json_response(
                200,
                &json!({"jsonrpc": "2.0", "id": id,
                "error": {"code": -32601, "message": format!("method not found: {other}")}}),
            );
        }
    };
    let response = json!({"jsonrpc": "2.0", "id": id, "result": result});
    if sse && method == "tools/call" {
        let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
            "params": {"progressToken": "p1", "progress": 1, "total": 1}});
        let body =
            format!("event: message\ndata: {progress}\n\nevent: message\ndata: {response}\n\n");
        let body = if b.keep_open {
            // The response, then nothing more, and the stream never closed.
            use futures_util::StreamExt;
            let frames =
                futures_util::stream::iter([Ok(hyper::body::Frame::data(Bytes::from(body)))])
                    .chain(futures_util::stream::pending());
            http_body_util::BodyExt::boxed_unsync(http_body_util::StreamBody::new(frames))
        } else {
            full(body)
        };
        let mut resp = Response::new(body);
        resp.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/event-stream"),
        );
        return resp;
    }
    let mut resp = json_response(200, &response);
    if method == "initialize" {
        resp.headers_mut().insert(
            "mcp-session-id",
            hyper::header::HeaderValue::from_static("mock-session-1"),
        );
    }
    resp
}
