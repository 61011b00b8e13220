//! MCP over Streamable HTTP: `POST|GET|DELETE /mcp/{server}` proxied to the server's
//! endpoint. `initialize`, `tools/list`, notifications, batches and the GET stream
//! pass through untouched (JSON or SSE); a `tools/call` request is journaled like an
//! HTTP tool call.
//!
//! A journaled `tools/call` stores the JSON-RPC `result` (or `error`) without its
//! id, because a retry arrives with a new JSON-RPC id; a replay re-wraps it with the
//! id of the request being answered. The idempotency key comes from the
//! `Idempotency-Key` header, `params._meta["outrigger/idempotency-key"]`, or is
//! derived from the task and the model's tool-call id (matched by tool name and
//! arguments). The downstream key is forwarded in both the header and `_meta`.
//! Refusals and errors of a `tools/call` are JSON-RPC errors, never problem
//! documents (`-32010` in progress, `-32011` key reused, `-32012` expired, `-32013`
//! the journal cannot take the call, `-32602` params that are no `CallToolRequest`,
//! an invalid or missing key, `-32603` anything else) or, for an outcome the model
//! should reason about, a `CallToolResult` with `isError: true`.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use outrigger_journal::{
    self as journal, Headers, Intent, Record, RedactedRequest, StoredResponse,
};
use outrigger_types::IdempotencyKey;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tracing::Instrument;

use crate::body::{self, Body};
use crate::canonical;
use crate::error::Error;
use crate::journaled::{self, Answered, DetachedEnd, Protocol, Settled};
use crate::observe::{PendingTool, ToolCall};
use crate::options::{Tool, ToolKind};
use crate::tools::{self, KeyChoice};
use crate::{RequestContext, Shared, headers, keys, redact, sse};

/// The `params._meta` field that carries an idempotency key.
pub const META_KEY: &str = "outrigger/idempotency-key";

pub async fn call(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    ctx: &RequestContext,
    target: &mut String,
) -> Result<Response<Body>, Error> {
    let name = req
        .uri()
        .path()
        .strip_prefix("/mcp/")
        .unwrap_or_default()
        .to_string();
    let server = shared
        .options
        .tool(&name)
        .filter(|t| t.kind == ToolKind::Mcp)
        .ok_or_else(|| Error::UnknownTool {
            tool: name.clone(),
            known: shared
                .options
                .tools
                .iter()
                .filter(|t| t.kind == ToolKind::Mcp)
                .map(|t| t.name.clone())
                .collect(),
        })?;
    *target = server.name.clone();
    let method = req.method().clone();
    if !matches!(method, Method::POST | Method::GET | Method::DELETE) {
        return Err(Error::MethodNotAllowed {
            method: method.to_string(),
            allowed: "POST, GET, DELETE",
        });
    }
    let (parts, body) = req.into_parts();
    let limits = &shared.options.limits;
    let bytes = body::read_request(body, limits.max_body_bytes, limits.client_read_timeout).await?;
    let message: Option<Value> = if method == Method::POST {
        Some(match canonical::parse_unique(&bytes) {
            Ok(message) => message,
            Err(twice) if twice.classify() == serde_json::error::Category::Data => {
                // A member named twice: which copy the server reads is its parser's
                // choice (a second `method` could hide a `tools/call` from the
                // journal), so the message is refused whatever it is.
                let id = serde_json::from_slice::<Value>(&bytes)
                    .ok()
                    .and_then(|m| m.get("id").cloned())
                    .unwrap_or(Value::Null);
                return Ok(rpc_error(
                    &id,
                    -32600,
                    &format!("{twice}: send each member once"),
                    None,
                ));
            }
            Err(e) => return Err(Error::MalformedJson(e.to_string())),
        })
    } else {
        None
    };
    // A JSON-RPC batch (protocol versions before 2025-06-18) would take its
    // `tools/call`s past the journal.
    if let Some(Value::Array(batch)) = &message
        && batch.iter().any(|m| m["method"] == "tools/call")
    {
        return Ok(batch_refused(batch));
    }
    let is_tool_call = message
        .as_ref()
        .is_some_and(|m| m["method"] == "tools/call" && m.get("id").is_some());
    let Some(message) = message.filter(|_| is_tool_call) else {
        return pass_through(shared, server, method, &parts.headers, bytes).await;
    };
    let rec = ToolCall::start(shared, ctx, &server.name, "mcp", &parts.headers);
    let span = rec.span.clone();
    let pending = PendingTool::new(rec);
    let result = tool_call(
        shared,
        ctx,
        server,
        &parts.headers,
        bytes,
        &message,
        &pending,
    )
    .instrument(span)
    .await;
    if let Some(rec) = pending.take() {
        tools::finish(rec, &result);
    }
    // An MCP client reads JSON-RPC: whatever went wrong with its call is answered
    // as a JSON-RPC error with the call's id, not as a problem document.
    Ok(match result {
        Ok((resp, _, _)) => resp,
        Err(e) => rpc_failure(&message["id"], &e),
    })
}

/// A `tools/call`: journaled when it has (or can be given) a key.
async fn tool_call(
    shared: &Shared,
    ctx: &RequestContext,
    server: &Tool,
    agent: &HeaderMap,
    bytes: Bytes,
    message: &Value,
    pending: &PendingTool,
) -> Result<(Response<Body>, Settled, Option<String>), Error> {
    let refused = |resp| Ok((resp, Settled::REFUSED, None));
    let id = message["id"].clone();
    // Checked before any key is chosen: a call the sidecar could not forward must
    // never be journaled (its key would stay in flight with nothing sent).
    let params = match CallParams::of(message) {
        Ok(p) => p,
        Err(detail) => return refused(rpc_error(&id, -32602, &detail, None)),
    };
    let CallParams {
        name: tool_name,
        arguments,
        meta_key,
    } = params;
    let choice = match tools::choose_key(
        shared,
        agent,
        ctx,
        server,
        Some((meta_key, &tool_name, &arguments)),
        &bytes,
    ) {
        Ok(c) => c,
        Err(Error::BadHeader { header, detail }) => {
            return refused(rpc_error(&id, -32602, &format!("{header}: {detail}"), None));
        }
        Err(e) => return Err(e),
    };
    let KeyChoice::Found {
        journal_key,
        downstream,
        source,
    } = choice
    else {
        if server.key_required {
            return refused(rpc_error(
                &id,
                -32602,
                &format!(
                    "MCP server {} requires an idempotency key for tools/call: set params._meta[\"{META_KEY}\"] \
                     or the Idempotency-Key header",
                    server.name
                ),
                None,
            ));
        }
        let before = shared.metrics.unprotected_tool_call(&server.name);
        tools::unprotected(
            before,
            format_args!("{}/{tool_name}", server.name),
            ctx.request_id.as_ref(),
        );
        let resp = pass_through(shared, server, Method::POST, agent, bytes).await?;
        let settled = tools::unjournaled(resp.status());
        return Ok((resp, settled, None));
    };
    let unavailable = |resp| Ok((resp, Settled::UNAVAILABLE, None));
    let Some(journal) = shared.journal.as_ref() else {
        return unavailable(journal_unavailable(&id, "the journal is not open"));
    };
    let intent = Intent {
        key: journal_key,
        fingerprint: keys::mcp_fingerprint(&server.name, &tool_name, &arguments),
        tool: server.name.clone(),
        class: server.class,
        method: format!("tools/call {tool_name}"),
        target: server.base_url.to_string(),
        task_id: ctx.task_id.clone(),
        request_id: ctx.request_id.clone(),
        downstream_key: downstream,
        request: RedactedRequest::new(
            redact::request_headers(agent, &server.redact),
            redact::request_body(&bytes, &server.redact),
        ),
        policy_versions: shared.decider.versions(),
        model_revision: None,
        derived_from: source,
    };
    let journal_key = intent.key.to_string();
    let proto = McpCall {
        server,
        agent,
        bytes: &bytes,
        id: &id,
        pending,
        journal_key: &journal_key,
    };
    let wait = journaled::prefer_wait(agent);
    match journaled::run(shared, journal, server, intent, wait, &proto).await {
        Ok((resp, settled)) => Ok((resp, settled, Some(journal_key))),
        Err(Error::Journal(journal::Error::Unavailable(detail))) => {
            unavailable(journal_unavailable(&id, &detail))
        }
        Err(e) => Err(e),
    }
}

async fn pass_through(
    shared: &Shared,
    server: &Tool,
    method: Method,
    agent: &HeaderMap,
    bytes: Bytes,
) -> Result<Response<Body>, Error> {
    let req = build(server, method, agent, bytes);
    let resp = shared
        .upstream
        .send(req, server.timeout)
        .await
        .map_err(|source| Error::Upstream {
            target: server.name.clone(),
            source,
        })?;
    let (mut p, b) = resp.into_parts();
    headers::strip_hop_by_hop(&mut p.headers);
    Ok(Response::from_parts(p, body::stream(b)))
}

fn build(server: &Tool, method: Method, agent: &HeaderMap, bytes: Bytes) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(bytes));
    *req.method_mut() = method;
    *req.uri_mut() = server.base_url.clone();
    *req.headers_mut() = headers::end_to_end(agent);
    req
}

struct McpCall<'a> {
    server: &'a Tool,
    agent: &'a HeaderMap,
    /// The agent's message as it sent it.
    bytes: &'a Bytes,
    id: &'a Value,
    pending: &'a PendingTool,
    journal_key: &'a str,
}

impl Protocol for McpCall<'_> {
    fn on_detached(&self) -> DetachedEnd {
        tools::finish_detached(self.pending, self.journal_key.to_owned())
    }

    fn agent_headers(&self) -> &HeaderMap {
        self.agent
    }

    fn build(&self, downstream: &str) -> Result<Request<Full<Bytes>>, Error> {
        let message = forwarded(self.bytes, downstream)?;
        let mut req = build(self.server, Method::POST, self.agent, message);
        // The answer is searched for the call's response and journaled.
        headers::ask_identity(req.headers_mut());
        if let Ok(v) = HeaderValue::from_str(downstream) {
            req.headers_mut().insert(headers::IDEMPOTENCY_KEY, v);
        }
        req.headers_mut().remove(header::CONTENT_LENGTH);
        Ok(req)
    }

    fn answerer(&self) -> impl FnOnce(StatusCode, &HeaderMap, Bytes) -> Answered + Send + 'static {
        let id = self.id.clone();
        move |status, h, body| answer(&id, status, h, body)
    }

    /// A server SHOULD close its event stream once it has sent the response; one
    /// that keeps it open has answered all the same: its response is the outcome.
    fn answered_early(&self) -> Option<journaled::AnsweredEarly> {
        let id = self.id.clone();
        Some(Box::new(move |status, h, read, new| {
            // Only a success is cut short (an error answer is passed on as it came),
            // and only a part that may hold a message with an id is looked at, so
            // that a long run of notifications (which have none) is not parsed
            // again and again.
            status.is_success()
                && crate::headers::is_event_stream(h)
                && memchr::memmem::find(&read[new.saturating_sub(8)..], b"\"id\"").is_some()
                && find_response(h, read, &id).is_some()
        }))
    }

    fn replay(&self, record: &Record) -> Response<Body> {
        let resolved = record
            .resolutions
            .last()
            .is_some_and(|r| matches!(r.action.as_str(), "mark_succeeded" | "mark_failed"));
        match &record.response {
            Some(stored) if resolved && stored.headers.get(OUTCOME_MARK).is_none() => {
                rpc_response(self.id, &operator_outcome(stored), true)
            }
            stored => replay(self.id, stored.as_ref()),
        }
    }

    fn in_flight(&self, record: &Record) -> Response<Body> {
        rpc_error(
            self.id,
            -32010,
            &format!(
                "request in progress: key {} is {}",
                record.key,
                record.state.as_str()
            ),
            Some(json!({"retryAfterMs": 1000, "key": record.key.as_str()})),
        )
    }

    fn mismatch(&self, record: &Record) -> Response<Body> {
        rpc_error(
            self.id,
            -32011,
            &format!(
                "idempotency key {} was first used with different arguments; use a new key",
                record.key
            ),
            Some(json!({"key": record.key.as_str()})),
        )
    }

    fn outcome_unknown(&self, record: &Record) -> Response<Body> {
        unknown_result(self.id, &record.key, record.state.as_str(), record.attempt)
    }

    fn tombstoned(&self, record: &Record) -> Response<Body> {
        rpc_error(
            self.id,
            -32012,
            &match record.final_status {
                Some(_) => format!(
                    "the stored result for key {} has expired; use a new key",
                    record.key
                ),
                None => format!(
                    "key {} has expired; no attempt of its call took effect; use a new key",
                    record.key
                ),
            },
            Some(json!({"key": record.key.as_str(), "finalStatus": record.final_status})),
        )
    }

    fn in_doubt(
        &self,
        key: &IdempotencyKey,
        attempt: u32,
        cause: &str,
        state: &str,
    ) -> Response<Body> {
        tracing::warn!(%key, attempt, %cause, "MCP tools/call in doubt");
        unknown_result(self.id, key, state, attempt)
    }
}

/// A JSON object's members, their values as the agent wrote them, in its order.
type Members = indexmap::IndexMap<String, Box<RawValue>>;

/// The `tools/call` as it goes to the server: the agent's message with the downstream
/// key (and the trace context) added to `params._meta`. Every value the sidecar does not
/// touch keeps the agent's bytes (an integer past 64 bits keeps its digits), and
/// members keep their order. It takes `params` apart without indexing, so that nothing
/// the agent sent can make it panic.
fn forwarded(message: &[u8], downstream: &str) -> Result<Bytes, Error> {
    let unusable = || Error::BuildRequest("the tools/call has no params object".into());
    let mut message: Members = serde_json::from_slice(message).map_err(|_| unusable())?;
    let params = message.get("params").ok_or_else(unusable)?;
    let mut params: Members = serde_json::from_str(params.get()).map_err(|_| unusable())?;
    // A `_meta` of `null` (the only other one `CallParams::of` lets through) is
    // replaced.
    let mut meta: Members = params
        .get("_meta")
        .and_then(|m| serde_json::from_str(m.get()).ok())
        .unwrap_or_default();
    meta.insert(META_KEY.to_owned(), raw(downstream)?);
    // The server's spans join the sidecar's `execute_tool` span (MCP carries trace
    // context in `_meta`, not in HTTP headers).
    if let Some(tp) = outrigger_telemetry::spans::current_traceparent() {
        meta.insert("traceparent".to_owned(), raw(tp.as_str())?);
    }
    params.insert("_meta".to_owned(), raw(&meta)?);
    message.insert("params".to_owned(), raw(&params)?);
    serde_json::to_vec(&message)
        .map(Bytes::from)
        .map_err(|e| Error::BuildRequest(e.to_string()))
}

fn raw<T: serde::Serialize + ?Sized>(value: &T) -> Result<Box<RawValue>, Error> {
    serde_json::value::to_raw_value(value).map_err(|e| Error::BuildRequest(e.to_string()))
}

/// What the sidecar reads of a `tools/call`, checked as MCP's `CallToolRequest`
/// defines it: `params` an object naming the tool, `arguments` and `_meta` objects
/// when given.
#[derive(Debug, PartialEq)]
struct CallParams {
    name: String,
    /// `null` when not given.
    arguments: Value,
    meta_key: Option<IdempotencyKey>,
}

impl CallParams {
    /// The call's parts, or what to fix (a JSON-RPC `-32602` message).
    fn of(message: &Value) -> Result<Self, String> {
        let Some(params) = message.get("params").and_then(Value::as_object) else {
            return Err(format!(
                "invalid params: a tools/call needs `params` as an object holding the tool's \
                 `name` and its `arguments`, not {}",
                kind(message.get("params"))
            ));
        };
        let name = match params.get("name") {
            Some(Value::String(name)) if !name.is_empty() => name.clone(),
            other => {
                return Err(format!(
                    "invalid params: `params.name` must be the name of the tool to call (a \
                     non-empty string), not {}",
                    kind(other)
                ));
            }
        };
        let arguments = match params.get("arguments") {
            None => Value::Null,
            Some(a @ (Value::Object(_) | Value::Null)) => a.clone(),
            other => {
                return Err(format!(
                    "invalid params: `params.arguments` must be an object of the tool's \
                     arguments, not {}",
                    kind(other)
                ));
            }
        };
        let meta = match params.get("_meta") {
            None | Some(Value::Null) => None,
            Some(Value::Object(meta)) => Some(meta),
            other => {
                return Err(format!(
                    "invalid params: `params._meta` must be an object, not {}",
                    kind(other)
                ));
            }
        };
        // A key the agent meant to send but cannot be read is refused, never taken
        // for no key: the call would run unprotected.
        let meta_key = match meta.and_then(|m| m.get(META_KEY)) {
            None | Some(Value::Null) => None,
            Some(Value::String(k)) => Some(
                IdempotencyKey::new(k.as_str())
                    .map_err(|e| format!("params._meta[\"{META_KEY}\"]: {e}"))?,
            ),
            other => {
                return Err(format!(
                    "params._meta[\"{META_KEY}\"] must be a string of 1 to 255 visible ASCII \
                     characters, not {}",
                    kind(other)
                ));
            }
        };
        Ok(Self {
            name,
            arguments,
            meta_key,
        })
    }
}

/// A JSON value's kind, for messages that say what was sent instead.
fn kind(v: Option<&Value>) -> &'static str {
    match v {
        None => "nothing",
        Some(Value::Null) => "null",
        Some(Value::Bool(_)) => "a boolean",
        Some(Value::Number(_)) => "a number",
        Some(Value::String(_)) => "a string",
        Some(Value::Array(_)) => "an array",
        Some(Value::Object(_)) => "an object",
    }
}

/// A completed call's stored answer for the request with JSON-RPC `id`. Only what
/// `answer` stored as a JSON-RPC outcome is re-wrapped with the new request's id;
/// anything else is replayed as it came (status, end-to-end headers, bytes), as an
/// HTTP tool's answer is.
fn replay(id: &Value, stored: Option<&StoredResponse>) -> Response<Body> {
    let Some(stored) = stored else {
        // A JSON-RPC error with the call's id, as every error of a `tools/call` is
        // (an HTTP tool's replay answers `500 journal-inconsistent`).
        let mut resp = rpc_error(
            id,
            -32603,
            "the journal says this call completed but holds no response (journal-inconsistent)",
            Some(json!({"type": "urn:outrigger:problem:journal-inconsistent", "status": 500})),
        );
        *resp.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        resp.headers_mut()
            .insert(headers::REPLAYED, HeaderValue::from_static("true"));
        return resp;
    };
    let outcome = Some(stored)
        .filter(|r| r.status == 200 && r.headers.get(OUTCOME_MARK).is_some())
        .and_then(|r| serde_json::from_slice::<Value>(r.body.bytes()).ok());
    match outcome {
        Some(outcome) => rpc_response(id, &outcome, true),
        None => tools::replay_stored(stored),
    }
}

/// An operator's resolution of a call (`mark_succeeded`, `mark_failed`) as its
/// JSON-RPC outcome, so that the client can match it to its request: a `tools/call`
/// result, `isError` unless its status is 2xx. A body that is already a result (an
/// object with `content`) is the result; any other body is its text content.
fn operator_outcome(stored: &StoredResponse) -> Value {
    let failed = !(200..300).contains(&stored.status);
    let body = stored.body.bytes();
    if let Ok(mut result @ Value::Object(_)) = serde_json::from_slice::<Value>(body)
        && result.get("content").is_some()
    {
        if failed {
            result["isError"] = Value::Bool(true);
        }
        return json!({ "result": result });
    }
    let text = String::from_utf8_lossy(body);
    json!({"result": {"content": [{"type": "text", "text": text}], "isError": failed}})
}

/// What a tool server's answer to the call with JSON-RPC `id` means.
fn answer(id: &Value, status: StatusCode, h: &HeaderMap, body: Bytes) -> Answered {
    if status.is_success() {
        return match find_response(h, &body, id) {
            Some(outcome) => {
                let stored =
                    StoredResponse::new(200, json_headers(), Bytes::from(outcome.to_string()));
                Answered::Outcome(stored, rpc_response(id, &outcome, false))
            }
            // The stream closed before the call's response (a server may, and
            // expect the client to poll for it), or the body held none.
            None => Answered::Unknown(format!(
                "the server answered {status} without a JSON-RPC response to this call"
            )),
        };
    }
    if status.is_informational() {
        // No final answer at all (a 101 to a POST): the server may have acted.
        return Answered::Unknown(format!(
            "the server answered {status}, which is no answer to a tools/call"
        ));
    }
    // Not a JSON-RPC answer: passed on as it came, with the end-to-end headers the
    // client needs to act on it (`WWW-Authenticate`, `Retry-After`, `Location`), as
    // an HTTP tool's answer is.
    let (stored, resp) = tools::relayed(status, h, body);
    if status.is_redirection() || status.is_client_error() {
        // The transport moved or refused the message (an endpoint that moved, an
        // unknown or expired session, a missing token, a malformed request): an MCP
        // server answers a call it applied with a JSON-RPC response, so the call
        // was not applied, and once the client has followed or fixed that, the
        // same key must run it. (An HTTP tool's 3xx is its answer, and stored: a
        // 303 after a POST is how a REST API says where the result is.)
        let what = if status.is_redirection() {
            "redirected"
        } else {
            "refused"
        };
        return Answered::NotApplied(resp, format!("the server {what} the message with {status}"));
    }
    // A 5xx: the journal's rules make it in doubt.
    Answered::Outcome(stored, resp)
}

/// Where an in-doubt result names its state for programs: `result._meta`, not
/// `structuredContent`, which a client validates against the tool's `outputSchema`
/// even on an error result (the TypeScript SDK throws `-32602` on a mismatch, so the
/// model would never read the text).
pub const OUTCOME_META: &str = "outrigger/outcome";

/// A `CallToolResult` the model can read: the call may have happened.
fn unknown_result(id: &Value, key: &IdempotencyKey, state: &str, attempt: u32) -> Response<Body> {
    let mut text = format!(
        "Attempt {attempt} of this tool call may have executed, and its outcome is unknown \
         (state={state}). Check whether it took effect before acting on it. {}",
        journaled::next_step(state)
    );
    if state == "needs_operator" {
        text.push_str(&format!(
            " An operator can resolve it at {}.",
            tools::resolve_url(key)
        ));
    }
    rpc_response(
        id,
        &json!({"result": {
            "content": [{"type": "text", "text": text}],
            "isError": true,
            "_meta": {OUTCOME_META: {"state": state, "key": key.as_str(), "attempt": attempt,
                                     "resolveUrl": tools::resolve_url(key)}},
        }}),
        false,
    )
}

/// The JSON-RPC response for `id` in a JSON or SSE answer, as `{"result": …}` or
/// `{"error": …}`.
fn find_response(h: &HeaderMap, body: &[u8], id: &Value) -> Option<Value> {
    let pick = |msg: &Value| -> Option<Value> {
        if msg.get("id") != Some(id) {
            return None;
        }
        if let Some(r) = msg.get("result") {
            Some(json!({"result": r}))
        } else {
            msg.get("error").map(|e| json!({"error": e}))
        }
    };
    let pick_any = |v: Value| -> Option<Value> {
        match v {
            Value::Array(items) => items.iter().find_map(pick),
            other => pick(&other),
        }
    };
    if headers::is_event_stream(h) {
        let mut framer = sse::Framer::default();
        let mut blocks = Vec::new();
        framer.push(body, &mut blocks).ok()?;
        framer.finish(&mut blocks);
        blocks
            .iter()
            .filter_map(|b| sse::parse(b).data)
            .filter_map(|d| serde_json::from_str::<Value>(&d).ok())
            .find_map(pick_any)
    } else {
        serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(pick_any)
    }
}

/// Marks a stored answer as a JSON-RPC outcome (`{"result"}` or `{"error"}` without
/// its id), which a replay re-wraps with the id of the request it answers.
const OUTCOME_MARK: &str = "outrigger-jsonrpc-outcome";

fn json_headers() -> Headers {
    Headers::redacted([
        ("content-type".to_string(), "application/json".to_string()),
        (OUTCOME_MARK.to_string(), "1".to_string()),
    ])
}

/// `{"jsonrpc":"2.0","id":…}` plus the stored `result` or `error`.
fn rpc_response(id: &Value, outcome: &Value, replayed: bool) -> Response<Body> {
    let mut doc = json!({"jsonrpc": "2.0", "id": id});
    if let (Some(obj), Some(src)) = (doc.as_object_mut(), outcome.as_object()) {
        for (k, v) in src {
            obj.insert(k.clone(), v.clone());
        }
    }
    let mut resp = Response::new(body::full(doc.to_string()));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if replayed {
        resp.headers_mut()
            .insert(headers::REPLAYED, HeaderValue::from_static("true"));
    }
    resp
}

/// A batch holding a `tools/call`, refused whole: a batch's answer is an array
/// with an error for each request in it (JSON-RPC 2.0 §6), so that the client can
/// match every id it waits on. A batch of nothing but notifications gets `400`.
fn batch_refused(batch: &[Value]) -> Response<Body> {
    let message = "a JSON-RPC batch holding tools/call is not accepted: send each tools/call \
                   as a message of its own, so that it is journaled";
    let answers: Vec<Value> = batch
        .iter()
        .filter(|m| m.get("method").is_some())
        .filter_map(|m| m.get("id"))
        .map(
            |id| json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32600, "message": message}}),
        )
        .collect();
    let (status, doc) = if answers.is_empty() {
        (
            StatusCode::BAD_REQUEST,
            json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32600, "message": message}}),
        )
    } else {
        (StatusCode::OK, Value::Array(answers))
    };
    let mut resp = Response::new(body::full(doc.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn rpc_error(id: &Value, code: i64, message: &str, data: Option<Value>) -> Response<Body> {
    let mut error = json!({"code": code, "message": message});
    if let Some(d) = data {
        error["data"] = d;
    }
    rpc_response(id, &json!({"error": error}), false)
}

/// A sidecar error on a `tools/call` as a JSON-RPC error: the problem document's
/// detail as the message, its type, status and members in `data`, and its HTTP
/// status and headers (`Retry-After`) kept. The code says what the client may do:
/// `-32013` the journal could not take the call (not executed), `-32010` the call
/// moved on to a newer attempt, `-32603` anything else (the server could not be
/// reached, nothing was sent; the request could not be built).
fn rpc_failure(id: &Value, e: &Error) -> Response<Body> {
    let code = match e {
        Error::Journal(journal::Error::Stale { .. }) => -32010,
        Error::Journal(_) => -32013,
        Error::MalformedJson(_)
        | Error::InvalidRequest(_)
        | Error::BadHeader { .. }
        | Error::UnknownModel { .. }
        | Error::BodyTooLarge { .. }
        | Error::MethodNotAllowed { .. }
        | Error::NotFound { .. }
        | Error::UnknownTool { .. }
        | Error::ReadBody(_)
        | Error::BodyTimeout { .. }
        | Error::Upstream { .. }
        | Error::BuildRequest(_)
        | Error::MissingKey { .. }
        | Error::NoCandidate { .. }
        | Error::CircuitOpen { .. }
        | Error::Overloaded { .. }
        | Error::StreamBroke { .. }
        | Error::BudgetExceeded { .. }
        | Error::StreamKeyReused { .. }
        | Error::StreamInProgress { .. }
        | Error::UnknownStream { .. }
        | Error::StreamExpired { .. }
        | Error::GenerationLost { .. }
        | Error::Cancelled { .. } => -32603,
    };
    let problem = e.to_problem();
    let mut data = problem.to_json();
    if let Some(obj) = data.as_object_mut() {
        obj.remove("detail");
        obj.remove("title");
        let retry_after = problem
            .headers
            .iter()
            .find(|(name, _)| name == header::RETRY_AFTER)
            .and_then(|(_, v)| v.to_str().ok()?.parse::<u64>().ok());
        if let Some(secs) = retry_after {
            obj.insert("retryAfterMs".to_owned(), json!(secs.saturating_mul(1000)));
        }
    }
    let mut resp = rpc_error(id, code, &problem.detail, Some(data));
    *resp.status_mut() = problem.status;
    for (name, value) in problem.headers {
        resp.headers_mut().append(name, value);
    }
    resp
}

fn journal_unavailable(id: &Value, detail: &str) -> Response<Body> {
    let mut resp = rpc_error(
        id,
        -32013,
        &format!("the side-effect journal cannot record this call ({detail}); it was not executed"),
        Some(json!({"retryAfterMs": 1000})),
    );
    *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An operator's body becomes a `tools/call` result: text content, or the body
    /// itself when it is already a result; an error unless the status is 2xx.
    #[test]
    fn an_operators_resolution_is_a_tool_result() {
        let stored = |status, body: &'static [u8]| {
            StoredResponse::new(status, json_headers(), Bytes::from_static(body))
        };
        assert_eq!(
            operator_outcome(&stored(200, b"sent")),
            json!({"result": {"content": [{"type": "text", "text": "sent"}], "isError": false}})
        );
        assert_eq!(
            operator_outcome(&stored(500, br#"{"why":"bounced"}"#)),
            json!({"result": {"content": [{"type": "text", "text": "{\"why\":\"bounced\"}"}],
                   "isError": true}})
        );
        let result = br#"{"content":[{"type":"text","text":"ok"}],"structuredContent":{"n":1}}"#;
        assert_eq!(
            operator_outcome(&stored(200, result))["result"]["structuredContent"]["n"],
            1
        );
        assert_eq!(
            operator_outcome(&stored(502, result))["result"]["isError"],
            true
        );
    }

    /// A completed record that holds no response (a damaged journal) is replayed as
    /// a JSON-RPC error with the retry's id, not as an empty HTTP 500.
    #[tokio::test]
    async fn a_completed_call_with_no_stored_response_replays_as_a_json_rpc_error() {
        let resp = replay(&json!(7), None);
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            resp.headers().get(headers::REPLAYED).map(|v| v.as_bytes()),
            Some(&b"true"[..])
        );
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("a body")
            .to_bytes();
        let doc: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(doc["id"], 7, "{doc}");
        assert_eq!(doc["error"]["code"], -32603, "{doc}");
        assert_eq!(
            doc["error"]["data"]["type"],
            "urn:outrigger:problem:journal-inconsistent"
        );
    }

    /// A `tools/call` whose params the sidecar could not forward is refused before
    /// any key is chosen; a valid one yields its name, arguments and `_meta` key.
    #[test]
    fn call_params_are_checked_before_anything_is_journaled() {
        let check = |params: Value, expect: Result<(&str, Value, Option<&str>), &str>| {
            let mut message = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call"});
            if !params.is_null() {
                message["params"] = params.clone();
            }
            let got = CallParams::of(&message);
            match expect {
                Ok((name, arguments, key)) => assert_eq!(
                    got,
                    Ok(CallParams {
                        name: name.to_owned(),
                        arguments,
                        meta_key: key.map(|k| IdempotencyKey::new(k).expect("a key")),
                    }),
                    "{params}"
                ),
                Err(says) => {
                    let e = got.expect_err(&params.to_string());
                    assert!(e.contains(says), "{params}: {e}");
                }
            }
        };
        check(
            json!({"name": "send", "arguments": {"to": "a"}, "_meta": {META_KEY: "k-1"}}),
            Ok(("send", json!({"to": "a"}), Some("k-1"))),
        );
        check(json!({"name": "send"}), Ok(("send", Value::Null, None)));
        check(
            json!({"name": "send", "arguments": null, "_meta": null}),
            Ok(("send", Value::Null, None)),
        );
        check(Value::Null, Err("`params` as an object"));
        check(json!(["x"]), Err("not an array"));
        check(json!("x"), Err("not a string"));
        check(json!({"arguments": {}}), Err("`params.name`"));
        check(json!({"name": 7}), Err("not a number"));
        check(json!({"name": ""}), Err("`params.name`"));
        check(
            json!({"name": "send", "arguments": [1]}),
            Err("`params.arguments`"),
        );
        check(json!({"name": "send", "_meta": "k"}), Err("`params._meta`"));
        check(
            json!({"name": "send", "_meta": {META_KEY: "has space"}}),
            Err(META_KEY),
        );
        check(
            json!({"name": "send", "_meta": {META_KEY: 1042}}),
            Err("must be a string"),
        );
        check(
            json!({"name": "send", "_meta": {META_KEY: ""}}),
            Err(META_KEY),
        );
        check(
            json!({"name": "send", "_meta": {META_KEY: null}}),
            Ok(("send", Value::Null, None)),
        );
    }

    /// The forwarded message carries the downstream key in `_meta`, keeps every
    /// other byte the agent wrote (an integer past 64 bits, a float's spelling, the
    /// members' order), and building it never indexes into something that is not an
    /// object.
    #[test]
    fn the_forwarded_call_carries_the_downstream_key_in_meta() {
        let sent = |message: &str| -> Value {
            let sent = forwarded(message.as_bytes(), "k").expect("built");
            serde_json::from_slice(&sent).expect("JSON")
        };
        for params in [json!({"name": "send"}), json!({"name": "send", "_meta": 5})] {
            let message =
                json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params});
            assert_eq!(sent(&message.to_string())["params"]["_meta"][META_KEY], "k");
        }
        let message = r#"{"jsonrpc":"2.0","method":"tools/call","id":7,"params":{"name":"pay","arguments":{"amount":123456789012345678901234567890,"rate":1.10,"z":1,"a":2},"_meta":{"progressToken":"t"}}}"#;
        let got = forwarded(message.as_bytes(), "k").expect("built");
        assert_eq!(
            std::str::from_utf8(&got).expect("UTF-8"),
            r#"{"jsonrpc":"2.0","method":"tools/call","id":7,"params":{"name":"pay","arguments":{"amount":123456789012345678901234567890,"rate":1.10,"z":1,"a":2},"_meta":{"progressToken":"t","outrigger/idempotency-key":"k"}}}"#
        );
        for params in ["[\"x\"]", "\"x\"", "null"] {
            let message =
                format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{params}}}"#);
            assert!(matches!(
                forwarded(message.as_bytes(), "k"),
                Err(Error::BuildRequest(_))
            ));
        }
    }

    /// Whatever goes wrong with a `tools/call` is a JSON-RPC error with the call's
    /// id, keeping the HTTP status and `Retry-After` the problem document has.
    #[tokio::test]
    async fn errors_on_a_tool_call_are_json_rpc_errors() {
        let id = json!("call-3");
        let check = async |e: Error, code: i64, status: StatusCode, kind: &str| {
            let resp = rpc_failure(&id, &e);
            assert_eq!(resp.status(), status, "{e}");
            assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
            let retry_after = resp.headers().get(header::RETRY_AFTER).cloned();
            let body = resp.into_body();
            let bytes = http_body_util::BodyExt::collect(body)
                .await
                .expect("a body")
                .to_bytes();
            let doc: Value = serde_json::from_slice(&bytes).expect("JSON");
            assert_eq!(doc["jsonrpc"], "2.0");
            assert_eq!(doc["id"], "call-3");
            assert_eq!(doc["error"]["code"], code, "{doc}");
            assert_eq!(
                doc["error"]["data"]["type"],
                format!("urn:outrigger:problem:{kind}"),
                "{doc}"
            );
            assert!(
                doc["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty())
            );
            (retry_after, doc)
        };
        let (retry_after, doc) = check(
            Error::Journal(journal::Error::Storage("disk gone".into())),
            -32013,
            StatusCode::SERVICE_UNAVAILABLE,
            "journal-error",
        )
        .await;
        assert_eq!(retry_after.as_ref().map(|v| v.as_bytes()), Some(&b"1"[..]));
        assert_eq!(doc["error"]["data"]["retryAfterMs"], 1000);
        check(
            Error::Journal(journal::Error::Stale {
                key: IdempotencyKey::new("mail/k").expect("a key"),
                attempt: 1,
                state: journal::State::InDoubt,
                current: 2,
            }),
            -32010,
            StatusCode::CONFLICT,
            "request-in-progress",
        )
        .await;
        check(
            Error::Upstream {
                target: "mail".into(),
                source: crate::upstream::Error::Connect {
                    authority: "127.0.0.1:9".into(),
                    detail: "refused".into(),
                },
            },
            -32603,
            StatusCode::BAD_GATEWAY,
            "upstream-unreachable",
        )
        .await;
    }

    #[test]
    fn finds_the_response_in_json_and_sse() {
        let id = json!(7);
        let mut h = HeaderMap::new();
        let body = br#"{"jsonrpc":"2.0","id":7,"result":{"isError":false}}"#;
        assert_eq!(
            find_response(&h, body, &id),
            Some(json!({"result": {"isError": false}}))
        );
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        let body = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n\
                     event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"error\":{\"code\":-1}}\n\n";
        assert_eq!(
            find_response(&h, body, &id),
            Some(json!({"error": {"code": -1}}))
        );
        assert_eq!(find_response(&h, body, &json!(8)), None);
    }

    #[test]
    fn a_success_without_the_calls_response_is_no_outcome() {
        let message = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call"});
        let id = &message["id"];
        let mut sse = HeaderMap::new();
        sse.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        // The stream closed after a progress notification, before the response.
        let progress = Bytes::from_static(
            b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n",
        );
        assert!(matches!(
            answer(id, StatusCode::OK, &sse, progress),
            Answered::Unknown(_)
        ));
        assert!(matches!(
            answer(id, StatusCode::ACCEPTED, &HeaderMap::new(), Bytes::new()),
            Answered::Unknown(_)
        ));
        // A transport refusal was not applied; a 5xx goes to the journal's rules.
        assert!(matches!(
            answer(id, StatusCode::NOT_FOUND, &HeaderMap::new(), Bytes::new()),
            Answered::NotApplied(..)
        ));
        assert!(matches!(
            answer(id, StatusCode::BAD_GATEWAY, &HeaderMap::new(), Bytes::new()),
            Answered::Outcome(..)
        ));
        // No final answer: the server may have acted.
        assert!(matches!(
            answer(
                id,
                StatusCode::SWITCHING_PROTOCOLS,
                &HeaderMap::new(),
                Bytes::new()
            ),
            Answered::Unknown(_)
        ));
    }

    /// An answer that is no JSON-RPC response keeps the end-to-end headers the
    /// client acts on, fresh and replayed; a redirect is not the call's outcome.
    #[test]
    fn transport_answers_keep_their_headers_and_a_redirect_is_not_stored() {
        let id = json!(7);
        let with = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(
                    http::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                );
            }
            h
        };
        let moved = with(&[
            ("location", "http://tool.internal/mcp2"),
            ("connection", "close"),
        ]);
        let Answered::NotApplied(resp, why) =
            answer(&id, StatusCode::TEMPORARY_REDIRECT, &moved, Bytes::new())
        else {
            panic!("a redirect is not applied");
        };
        assert_eq!(resp.headers()["location"], "http://tool.internal/mcp2");
        assert!(resp.headers().get("connection").is_none());
        assert!(why.contains("redirected"), "{why}");

        let unauthorized = with(&[("www-authenticate", "Bearer resource_metadata=\"x\"")]);
        let Answered::NotApplied(resp, _) =
            answer(&id, StatusCode::UNAUTHORIZED, &unauthorized, Bytes::new())
        else {
            panic!("a 401 is not applied");
        };
        assert!(resp.headers().get("www-authenticate").is_some());

        let busy = with(&[("retry-after", "3"), ("content-type", "text/plain")]);
        let Answered::Outcome(stored, resp) = answer(
            &id,
            StatusCode::SERVICE_UNAVAILABLE,
            &busy,
            Bytes::from_static(b"busy"),
        ) else {
            panic!("a 5xx goes to the journal's rules");
        };
        assert_eq!(resp.headers()["retry-after"], "3");
        let replayed = replay(&json!(9), Some(&stored));
        assert_eq!(replayed.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(replayed.headers()["retry-after"], "3");
        assert_eq!(replayed.headers()["content-type"], "text/plain");
        assert_eq!(replayed.headers()[headers::REPLAYED], "true");
    }
}
