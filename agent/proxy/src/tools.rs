//! HTTP tool calls: `POST|PUT|PATCH|DELETE /tools/{tool}/{path…}`, forwarded to the
//! tool's base URL and journaled under an idempotency key before they leave.
//!
//! The journal decides (see `outrigger_journal::Begin`); this module enforces:
//! execute, replay the stored answer, refuse with 409/422, probe, or fail closed with
//! 503 when the journal cannot write. `GET` passes through unjournaled unless the
//! tool sets `journal_get`.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use outrigger_journal::{
    self as journal, Headers, Intent, KeySource, Record, RedactedRequest, StoredResponse,
};
use outrigger_types::IdempotencyKey;
use tracing::Instrument;

use crate::body::{self, Body};
use crate::error::Error;
use crate::headers::{self, IDEMPOTENCY_KEY};
use crate::journaled::{self, Answered, DetachedEnd, Protocol, Settled};
use crate::keys;
use crate::observe::{PendingTool, ToolCall, ToolEnd};
use crate::options::{Tool, ToolKind};
use crate::problem::Problem;
use crate::redact;
use crate::tasks::ToolCallOutcome;
use crate::{RequestContext, Shared};

pub const TOOL_CALL_ID: &str = "outrigger-tool-call-id";
pub const JOURNAL_KEY: &str = "outrigger-journal-key";

/// Where a call's key came from.
pub(crate) enum KeyChoice {
    Found {
        journal_key: IdempotencyKey,
        downstream: String,
        source: KeySource,
    },
    None,
}

/// What `/tools/{tool}/{rest}` addresses.
struct Address<'a> {
    tool: &'a Tool,
    /// Path and query below the tool's base URL, starting with `/`.
    rest: String,
}

fn address<'a>(shared: &'a Shared, path_and_query: &str) -> Result<Address<'a>, Error> {
    let after = path_and_query.strip_prefix("/tools/").unwrap_or_default();
    let (name, rest) = match after.find(['/', '?']) {
        Some(i) => (&after[..i], &after[i..]),
        None => (after, ""),
    };
    let tool = shared
        .options
        .tool(name)
        .filter(|t| t.kind == ToolKind::Http)
        .ok_or_else(|| Error::UnknownTool {
            tool: name.to_string(),
            known: shared
                .options
                .tools
                .iter()
                .filter(|t| t.kind == ToolKind::Http)
                .map(|t| t.name.clone())
                .collect(),
        })?;
    let rest = if rest.starts_with('?') || rest.is_empty() {
        format!("/{rest}")
    } else {
        rest.to_string()
    };
    Ok(Address { tool, rest })
}

pub async fn call(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    ctx: &RequestContext,
    target: &mut String,
) -> Result<Response<Body>, Error> {
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    let addr = address(shared, &pq)?;
    *target = addr.tool.name.clone();
    let rec = ToolCall::start(shared, ctx, &addr.tool.name, "http", req.headers());
    let span = rec.span.clone();
    let pending = PendingTool::new(rec);
    let result = journal_call(shared, req, ctx, &addr, &pending)
        .instrument(span)
        .await;
    if let Some(rec) = pending.take() {
        finish(rec, &result);
    }
    result.map(|(resp, _, _)| resp)
}

/// Logs a tool call that passed through without a key: at WARN for the first of a
/// tool (since the sidecar started), then at DEBUG, so that an agent that never sends
/// keys does not flood the log; `outrigger_tool_unprotected_total` counts them all.
pub(crate) fn unprotected(before: u64, tool: std::fmt::Arguments<'_>, request_id: &str) {
    if before == 0 {
        tracing::warn!(
            %tool,
            request_id,
            "tool call without an idempotency key passed through unprotected; further ones are logged at debug and counted in outrigger_tool_unprotected_total"
        );
    } else {
        tracing::debug!(
            %tool,
            request_id,
            "tool call without an idempotency key passed through unprotected"
        );
    }
}

/// Records how a tool call (HTTP or MCP) ended.
pub(crate) fn finish(
    rec: ToolCall,
    result: &Result<(Response<Body>, Settled, Option<String>), Error>,
) {
    match result {
        Ok((resp, settled, key)) => {
            let status = resp.status();
            rec.finish(ToolEnd {
                outcome: settled.outcome,
                journal_state: settled.state,
                key: key.as_deref(),
                replayed: settled.replayed,
                error_type: (!status.is_success()).then(|| status.as_str()),
                failed: settled.failed,
            })
        }
        Err(e) => ended_in(rec, e),
    }
}

/// Records a tool call that ended in an error.
fn ended_in(rec: ToolCall, e: &Error) {
    rec.finish(ToolEnd {
        outcome: match e {
            Error::Upstream { source, .. } if !source.may_have_been_sent() => {
                ToolCallOutcome::NotExecuted
            }
            Error::Upstream { .. } => ToolCallOutcome::InDoubt,
            _ => ToolCallOutcome::Refused,
        },
        journal_state: "none",
        key: None,
        replayed: false,
        error_type: Some(crate::observe::error_type_of(e)),
        failed: Some(crate::observe::failed_of(e)),
    })
}

/// Records a call that ended without its agent (see `journaled`), unless it was
/// recorded already.
pub(crate) fn finish_detached(pending: &PendingTool, key: String) -> DetachedEnd {
    let pending = pending.clone();
    Box::new(move |ended| {
        let Some(rec) = pending.take() else {
            return;
        };
        match ended {
            Ok((settled, error_type)) => rec.finish(ToolEnd {
                outcome: settled.outcome,
                journal_state: settled.state,
                key: Some(&key),
                replayed: settled.replayed,
                error_type: error_type.as_deref(),
                failed: settled.failed,
            }),
            Err(e) => ended_in(rec, &e),
        }
    })
}

/// An unjournaled call's outcome, from its status.
pub(crate) fn unjournaled(status: StatusCode) -> Settled {
    Settled {
        outcome: if status.is_server_error() {
            ToolCallOutcome::InDoubt
        } else {
            ToolCallOutcome::Completed
        },
        state: "unjournaled",
        replayed: false,
        failed: outrigger_telemetry::slo::Failed::of_tool_status(status.as_u16()),
    }
}

async fn journal_call(
    shared: &Shared,
    req: Request<Incoming>,
    ctx: &RequestContext,
    addr: &Address<'_>,
    pending: &PendingTool,
) -> Result<(Response<Body>, Settled, Option<String>), Error> {
    let tool = addr.tool;
    let method = req.method().clone();
    let journaled = match method {
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE => true,
        Method::GET | Method::HEAD => tool.journal_get,
        _ => {
            return Err(Error::MethodNotAllowed {
                method: method.to_string(),
                allowed: "GET, HEAD, POST, PUT, PATCH, DELETE",
            });
        }
    };
    let (parts, body) = req.into_parts();
    let limits = &shared.options.limits;
    let bytes = body::read_request(body, limits.max_body_bytes, limits.client_read_timeout).await?;

    let choice = if journaled {
        choose_key(shared, &parts.headers, ctx, tool, None, &bytes)?
    } else {
        KeyChoice::None
    };
    let KeyChoice::Found {
        journal_key,
        downstream,
        source,
    } = choice
    else {
        if journaled && tool.key_required {
            return Err(Error::MissingKey {
                tool: tool.name.clone(),
            });
        }
        if journaled {
            let before = shared.metrics.unprotected_tool_call(&tool.name);
            unprotected(
                before,
                format_args!("{}", tool.name),
                ctx.request_id.as_ref(),
            );
        }
        // Nothing is journaled here, so the agent's own key (if any) is the only
        // protection the tool gets: pass it through unchanged.
        let agent_key = parts
            .headers
            .get(IDEMPOTENCY_KEY)
            .and_then(|v| v.to_str().ok());
        let upstream = build(tool, &addr.rest, method, &parts.headers, bytes, agent_key)?;
        let resp = shared
            .upstream
            .send(upstream, tool.timeout)
            .await
            .map_err(|source| Error::Upstream {
                target: tool.name.clone(),
                source,
            })?;
        let (mut p, b) = resp.into_parts();
        headers::strip_hop_by_hop(&mut p.headers);
        let settled = unjournaled(p.status);
        return Ok((Response::from_parts(p, body::stream(b)), settled, None));
    };

    let Some(journal) = shared.journal.as_ref() else {
        return Err(Error::Journal(journal::Error::Unavailable(
            "the journal is not open".into(),
        )));
    };
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let intent = Intent {
        key: journal_key.clone(),
        fingerprint: keys::http_fingerprint(
            method.as_str(),
            &tool.name,
            &addr.rest,
            content_type,
            &bytes,
        ),
        tool: tool.name.clone(),
        class: tool.class,
        method: method.to_string(),
        target: redact::target(&tool.base_url.to_string(), &addr.rest),
        task_id: ctx.task_id.clone(),
        request_id: ctx.request_id.clone(),
        downstream_key: downstream,
        request: RedactedRequest::new(
            redact::request_headers(&parts.headers, &tool.redact),
            redact::request_body(&bytes, &tool.redact),
        ),
        policy_versions: shared.decider.versions(),
        model_revision: None,
        derived_from: source,
    };
    let proto = Http {
        tool,
        rest: &addr.rest,
        method: &method,
        agent: &parts.headers,
        body: &bytes,
        pending,
        journal_key: &journal_key,
    };
    let wait = journaled::prefer_wait(&parts.headers);
    let (resp, settled) = journaled::run(shared, journal, tool, intent, wait, &proto).await?;
    Ok((
        with_key(resp, &journal_key),
        settled,
        Some(journal_key.to_string()),
    ))
}

/// Picks the journal key: the agent's `Idempotency-Key` (scoped to the tool), an
/// MCP `_meta` key (passed in by the MCP path), or one derived from the task and the
/// model's tool-call id.
pub(crate) fn choose_key(
    shared: &Shared,
    h: &HeaderMap,
    ctx: &RequestContext,
    tool: &Tool,
    mcp: Option<(Option<IdempotencyKey>, &str, &serde_json::Value)>,
    body: &[u8],
) -> Result<KeyChoice, Error> {
    if let Some(v) = h.get(IDEMPOTENCY_KEY) {
        let raw = v.to_str().map_err(|_| Error::BadHeader {
            header: "Idempotency-Key",
            detail: "it is not visible ASCII".into(),
        })?;
        let key = IdempotencyKey::from_header(raw).map_err(|e| Error::BadHeader {
            header: "Idempotency-Key",
            detail: e.to_string(),
        })?;
        return Ok(KeyChoice::Found {
            journal_key: keys::scoped(&tool.name, &key),
            downstream: key.to_string(),
            source: KeySource::Header,
        });
    }
    if let Some((Some(meta_key), _, _)) = &mcp {
        return Ok(KeyChoice::Found {
            journal_key: keys::scoped(&tool.name, meta_key),
            downstream: meta_key.to_string(),
            source: KeySource::McpMeta,
        });
    }
    let Some(task) = &ctx.task_id else {
        // A model's tool-call id names a call within a task: without the task there
        // is no key to derive, and the call would go unprotected unnoticed.
        if h.contains_key(TOOL_CALL_ID) {
            return Err(Error::BadHeader {
                header: "Outrigger-Tool-Call-Id",
                detail: "it needs Outrigger-Task-Id (the key is derived from the task and \
                         the model's tool_call_id): send the task id too, or an \
                         Idempotency-Key instead"
                    .into(),
            });
        }
        return Ok(KeyChoice::None);
    };
    // A header that is there but unreadable is refused, as a bad `Idempotency-Key`
    // is: taken for no id, the call would match another call's, or go unprotected.
    let explicit = match h.get(TOOL_CALL_ID) {
        None => None,
        Some(v) => {
            let id = v.to_str().map(str::trim).unwrap_or_default();
            if id.is_empty() {
                return Err(Error::BadHeader {
                    header: "Outrigger-Tool-Call-Id",
                    detail: "it is empty or not visible ASCII; send the model's tool_call_id, or leave the header out".into(),
                });
            }
            Some(id.to_owned())
        }
    };
    let call_id = match explicit {
        Some(id) => Some(id),
        None => match &mcp {
            Some((_, name, args)) => {
                shared
                    .correlator
                    .find(task, Some(name), &keys::arguments_fingerprint(args))
            }
            None => serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| shared.correlator.find(task, None, &keys::fingerprint(&v))),
        },
    };
    Ok(match call_id {
        Some(id) => {
            let key = keys::derived(task, &tool.name, &id);
            KeyChoice::Found {
                downstream: key.to_string(),
                journal_key: key,
                source: KeySource::ToolCallId,
            }
        }
        None => KeyChoice::None,
    })
}

pub(crate) fn build(
    tool: &Tool,
    rest: &str,
    method: Method,
    agent: &HeaderMap,
    body: Bytes,
    downstream_key: Option<&str>,
) -> Result<Request<Full<Bytes>>, Error> {
    let base = tool.base_url.to_string();
    let uri = format!("{}{rest}", base.trim_end_matches('/'))
        .parse()
        .map_err(|e: http::uri::InvalidUri| Error::BuildRequest(e.to_string()))?;
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    // Tools are the agent's own services: its credentials travel to them (they are
    // never journaled); only hop-by-hop and the sidecar's own headers are dropped.
    let mut h = headers::end_to_end(agent);
    if let Some(k) = downstream_key.and_then(|k| HeaderValue::from_str(k).ok()) {
        h.insert(IDEMPOTENCY_KEY, k);
    }
    // The tool's spans join the sidecar's `execute_tool` span, itself a child of the
    // agent's trace when the agent sent one.
    if let Some(tp) = outrigger_telemetry::spans::current_traceparent()
        .and_then(|tp| HeaderValue::from_str(&tp).ok())
    {
        h.insert(header::HeaderName::from_static("traceparent"), tp);
    }
    *req.headers_mut() = h;
    Ok(req)
}

pub(crate) fn redacted_headers(h: &HeaderMap) -> Headers {
    Headers::redacted(
        h.iter()
            .filter(|(k, _)| !headers::is_credential(k))
            .map(|(k, v)| {
                (
                    k.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            }),
    )
}

fn with_key(mut resp: Response<Body>, key: &IdempotencyKey) -> Response<Body> {
    if let Ok(v) = HeaderValue::from_str(key.as_str()) {
        resp.headers_mut().insert(JOURNAL_KEY, v);
    }
    resp
}

pub(crate) fn resolve_url(key: &IdempotencyKey) -> String {
    // The admin plane decodes the key: each of its `/`-separated parts is encoded
    // (a `?`, `#` or `%` in a key would otherwise end the path or name another key).
    let path: Vec<String> = key
        .as_str()
        .split('/')
        .map(crate::journaled::encode_segment)
        .collect();
    format!("/v1/journal/{}/resolve", path.join("/"))
}

/// An HTTP tool call: problem documents for refusals, the tool's own answer
/// (status, headers, body) stored and replayed.
struct Http<'a> {
    tool: &'a Tool,
    rest: &'a str,
    method: &'a Method,
    agent: &'a HeaderMap,
    body: &'a Bytes,
    pending: &'a PendingTool,
    journal_key: &'a IdempotencyKey,
}

impl Protocol for Http<'_> {
    fn on_detached(&self) -> DetachedEnd {
        finish_detached(self.pending, self.journal_key.to_string())
    }

    fn agent_headers(&self) -> &HeaderMap {
        self.agent
    }

    fn build(&self, downstream: &str) -> Result<Request<Full<Bytes>>, Error> {
        build(
            self.tool,
            self.rest,
            self.method.clone(),
            self.agent,
            self.body.clone(),
            Some(downstream),
        )
    }

    fn answerer(&self) -> impl FnOnce(StatusCode, &HeaderMap, Bytes) -> Answered + Send + 'static {
        answer
    }

    fn replay(&self, record: &Record) -> Response<Body> {
        let Some(stored) = &record.response else {
            return Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "journal-inconsistent",
                "Journal record has no response",
                format!(
                    "The journal says {} completed but holds no response.",
                    record.key
                ),
            )
            .into_response();
        };
        replay_stored(stored)
    }

    fn in_flight(&self, record: &Record) -> Response<Body> {
        Problem::new(
            StatusCode::CONFLICT,
            "request-in-progress",
            "A request is outstanding for this Idempotency-Key",
            format!(
                "Key {} is {} by a request that has not finished. Retry after a moment, or send \
                 `Prefer: wait=N` to wait up to N seconds for its result.",
                record.key,
                record.state.as_str()
            ),
        )
        .with("key", record.key.as_str())
        .with("state", record.state.as_str())
        .header(header::RETRY_AFTER, HeaderValue::from_static("1"))
        .into_response()
    }

    fn mismatch(&self, record: &Record) -> Response<Body> {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "key-reused",
            "Idempotency-Key reused with a different request",
            format!(
                "Key {} was first used for a different request to {} (fingerprint {}). Use a new \
                 key for a new request.",
                record.key, record.tool, record.fingerprint
            ),
        )
        .with("key", record.key.as_str())
        .into_response()
    }

    fn outcome_unknown(&self, record: &Record) -> Response<Body> {
        Problem::new(
            StatusCode::CONFLICT,
            "outcome-unknown",
            "The previous attempt may have executed",
            format!(
                "Key {} is {}: attempt {} may have reached {} but its outcome is unknown, and this \
                 tool is not safe to re-send. It will not be retried automatically. An operator \
                 resolves it with POST {} on the admin plane (mark_succeeded, mark_failed or retry).",
                record.key,
                record.state.as_str(),
                record.attempt,
                record.tool,
                resolve_url(&record.key)
            ),
        )
        .with("key", record.key.as_str())
        .with("state", record.state.as_str())
        .with("attempt", record.attempt)
        .with("resolve_url", resolve_url(&record.key))
        .into_response()
    }

    fn tombstoned(&self, record: &Record) -> Response<Body> {
        let mut p = Problem::new(
            StatusCode::GONE,
            "key-expired",
            "The result for this key has expired",
            match record.final_status {
                Some(status) => format!(
                    "Key {} completed with status {status} but its stored result is past \
                     retention; only a digest remains. Use a new key to call again.",
                    record.key
                ),
                // Tombstoned from `failed_before_send`: no attempt took effect.
                None => format!(
                    "Key {} is past retention; no attempt of its call took effect. Use a new \
                     key to call again.",
                    record.key
                ),
            },
        )
        .with("key", record.key.as_str());
        if let Some(s) = record.final_status {
            p = p.with("final_status", s);
        }
        p.into_response()
    }

    fn in_doubt(
        &self,
        key: &IdempotencyKey,
        attempt: u32,
        cause: &str,
        state: &str,
    ) -> Response<Body> {
        in_doubt_problem(&self.tool.name, key, attempt, cause, state).into_response()
    }
}

/// The `502 outcome-unknown` of an attempt whose outcome is unknown, saying what a
/// retry with the same key does in the state the call rests in.
fn in_doubt_problem(
    tool: &str,
    key: &IdempotencyKey,
    attempt: u32,
    cause: &str,
    state: &str,
) -> Problem {
    let mut p = Problem::new(
        StatusCode::BAD_GATEWAY,
        "outcome-unknown",
        "The call may have executed",
        format!(
            "Attempt {attempt} of the call to {tool} under key {key} may have executed, and its \
             outcome is unknown ({cause}); the call is now {state}. {}",
            journaled::next_step(state)
        ),
    )
    .with("key", key.as_str())
    .with("state", state)
    .with("attempt", attempt);
    if state == "needs_operator" {
        p = p.with("resolve_url", resolve_url(key));
    }
    p
}

/// An HTTP tool's answer is the call's outcome, whatever its status: the journal's
/// rules say what each status means.
fn answer(status: StatusCode, h: &HeaderMap, body: Bytes) -> Answered {
    let (stored, resp) = relayed(status, h, body);
    Answered::Outcome(stored, resp)
}

/// A tool's answer as it is stored and as it is passed on: status, body, and the
/// end-to-end headers (`Location`, `Retry-After`, `WWW-Authenticate`…) without the
/// hop-by-hop ones and the length, which the body's own framing says.
pub(crate) fn relayed(
    status: StatusCode,
    h: &HeaderMap,
    body: Bytes,
) -> (StoredResponse, Response<Body>) {
    let mut h = h.clone();
    keep_end_to_end(&mut h);
    let stored = StoredResponse::new(status.as_u16(), redacted_headers(&h), body.clone());
    let mut resp = Response::new(body::full(body));
    *resp.status_mut() = status;
    *resp.headers_mut() = h;
    (stored, resp)
}

/// Leaves out the hop-by-hop headers and the length, which the body's own framing
/// says.
fn keep_end_to_end(h: &mut HeaderMap) {
    headers::strip_hop_by_hop(h);
    h.remove(header::CONTENT_LENGTH);
}

/// A stored answer, replayed as it was given: status, end-to-end headers and body,
/// marked `Outrigger-Replayed`. Hop-by-hop headers a record may hold (one stored
/// before they were left out) are not replayed.
pub(crate) fn replay_stored(stored: &StoredResponse) -> Response<Body> {
    let mut resp = Response::new(body::full(stored.body.bytes().clone()));
    *resp.status_mut() = replayed_status(stored.status);
    for (k, v) in stored.headers.iter() {
        if let (Ok(k), Ok(v)) = (
            header::HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            resp.headers_mut().append(k, v);
        }
    }
    keep_end_to_end(resp.headers_mut());
    resp.headers_mut()
        .insert(headers::REPLAYED, HeaderValue::from_static("true"));
    resp
}

/// The status a stored answer is replayed with. One HTTP cannot carry (which no tool
/// answered with) is replayed as a failure, never as a success.
fn replayed_status(stored: u16) -> StatusCode {
    StatusCode::from_u16(stored).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-doubt answer says what is true of the state the call rests in: held
    /// for an operator, safe to retry, or in progress until a restart (its end
    /// could not be journaled).
    #[test]
    fn an_in_doubt_answer_says_what_a_retry_does_in_its_state() {
        let key = IdempotencyKey::new("payments/k").expect("a key");
        let check = |cause: &str, state: &str, says: &[&str], never: &[&str]| {
            let p = in_doubt_problem("payments", &key, 2, cause, state);
            assert_eq!(p.status, StatusCode::BAD_GATEWAY);
            let doc = p.to_json();
            assert_eq!(doc["attempt"], 2, "{doc}");
            assert_eq!(doc["state"], state, "{doc}");
            let detail = doc["detail"].as_str().unwrap_or_default();
            for s in says {
                assert!(detail.contains(s), "{state}: {detail:?} lacks {s:?}");
            }
            for s in never {
                assert!(!detail.contains(s), "{state}: {detail:?} says {s:?}");
            }
            doc
        };
        let held = check(
            "payments sent no response within 2s",
            "needs_operator",
            &["Attempt 2", "held for an operator", "never retried"],
            &["is safe"],
        );
        assert_eq!(held["resolve_url"], "/v1/journal/payments/k/resolve");
        // A key with what would end the path (or name another key) is encoded.
        let odd = IdempotencyKey::new("payments/inv?7#%62").expect("a key");
        assert_eq!(
            resolve_url(&odd),
            "/v1/journal/payments/inv%3F7%23%2562/resolve"
        );
        check(
            "the probe answered 500 Internal Server Error",
            "in_doubt",
            &["Retrying with the same key is safe"],
            &["operator"],
        );
        let unrecorded = check(
            "its outcome could not be journaled (the journal cannot write)",
            "dispatched",
            &["until the sidecar restarts", "could not be journaled"],
            &["is safe", "no answer came back"],
        );
        assert!(unrecorded.get("resolve_url").is_none());
    }

    /// A stored answer is replayed with its end-to-end headers only, whatever the
    /// record holds.
    #[test]
    fn a_replay_carries_no_hop_by_hop_headers() {
        let stored = StoredResponse::new(
            201,
            Headers::redacted(
                [
                    ("transfer-encoding", "chunked"),
                    ("connection", "close, x-hop"),
                    ("x-hop", "1"),
                    ("content-length", "12"),
                    ("location", "/orders/7"),
                    ("content-type", "application/json"),
                ]
                .map(|(k, v)| (k.to_owned(), v.to_owned())),
            ),
            Bytes::from_static(b"{\"id\":7}"),
        );
        let resp = replay_stored(&stored);
        assert_eq!(resp.status(), StatusCode::CREATED);
        let mut names: Vec<&str> = resp.headers().keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-type", "location", headers::REPLAYED]);
    }

    #[test]
    fn a_stored_status_is_replayed_as_it_is_and_never_turns_into_a_success() {
        for (stored, replayed) in [
            (200, StatusCode::OK),
            (404, StatusCode::NOT_FOUND),
            (599, StatusCode::from_u16(599).unwrap()),
            (0, StatusCode::INTERNAL_SERVER_ERROR),
            (1000, StatusCode::INTERNAL_SERVER_ERROR),
            (u16::MAX, StatusCode::INTERNAL_SERVER_ERROR),
        ] {
            assert_eq!(replayed_status(stored), replayed, "{stored}");
        }
    }
}
