//! The journaled-call engine shared by HTTP tools and MCP `tools/call`.
//!
//! The journal decides what a request with a key must do (`outrigger_journal::Begin`);
//! this loop enforces it: execute (with the unsafe class's second durable write just
//! before the send), replay the stored answer, refuse, wait (`Prefer: wait=N`),
//! probe, and record every outcome durably before the agent sees it. How a request
//! is built and how answers and refusals are worded is the [`Protocol`]'s business.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::Full;
use outrigger_journal::{Begin, Intent, Journal, Record, StoredResponse, Ticket};
use outrigger_types::{IdempotencyKey, ToolClass};

use crate::Shared;
use crate::body::{self, Body};
use crate::error::Error;
use crate::options::Tool;
use crate::tools;

/// How one protocol builds a tool request and words its answers.
pub(crate) trait Protocol {
    /// The request for one attempt, carrying `downstream` as its idempotency key.
    fn build(&self, downstream: &str) -> Result<Request<Full<Bytes>>, Error>;
    /// What to journal and what to send the agent, from the tool's answer.
    fn answer(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        body: Bytes,
    ) -> (StoredResponse, Response<Body>);
    fn replay(&self, record: &Record) -> Response<Body>;
    fn in_flight(&self, record: &Record) -> Response<Body>;
    fn mismatch(&self, record: &Record) -> Response<Body>;
    fn outcome_unknown(&self, record: &Record) -> Response<Body>;
    fn tombstoned(&self, record: &Record) -> Response<Body>;
    /// The attempt reached the tool but no answer came back; the call is now `state`.
    fn in_doubt(&self, key: &IdempotencyKey, cause: &str, state: &str) -> Response<Body>;
}

/// Runs one journaled call to completion.
pub(crate) async fn run(
    shared: &Shared,
    journal: &Journal,
    tool: &Tool,
    intent: Intent,
    wait: Option<Duration>,
    proto: &impl Protocol,
) -> Result<Response<Body>, Error> {
    let key = intent.key.clone();
    let downstream = intent.downstream_key.clone();
    let mut begin = journal
        .begin(intent.clone())
        .await
        .map_err(Error::Journal)?;
    let mut waited = false;
    loop {
        begin = match begin {
            Begin::Execute { ticket, resend } => {
                return execute(shared, journal, tool, &ticket, &downstream, resend, proto).await;
            }
            Begin::Replay(record) => return Ok(proto.replay(&record)),
            Begin::InFlight { record } => match wait {
                Some(wait) if !waited => {
                    waited = true;
                    journal
                        .wait_settled(&key, wait)
                        .await
                        .map_err(Error::Journal)?;
                    journal
                        .begin(intent.clone())
                        .await
                        .map_err(Error::Journal)?
                }
                _ => return Ok(proto.in_flight(&record)),
            },
            Begin::Mismatch { record } => return Ok(proto.mismatch(&record)),
            Begin::OutcomeUnknown { record } => return Ok(proto.outcome_unknown(&record)),
            Begin::Tombstoned { record } => return Ok(proto.tombstoned(&record)),
            Begin::Probe { ticket } => match probe(shared, tool, &downstream).await {
                Probed::Found(resp) => journal
                    .reconciled(&ticket, Some(resp))
                    .await
                    .map_err(Error::Journal)?,
                Probed::NotFound => journal
                    .reconciled(&ticket, None)
                    .await
                    .map_err(Error::Journal)?,
                Probed::Failed(detail) => {
                    tracing::warn!(tool = %tool.name, %key, %detail, "probe failed; the call stays in doubt");
                    return match journal.get(&key).map_err(Error::Journal)? {
                        Some(record) => Ok(proto.outcome_unknown(&record)),
                        None => Ok(proto.in_doubt(&key, &detail, "in_doubt")),
                    };
                }
            },
        };
    }
}

async fn execute(
    shared: &Shared,
    journal: &Journal,
    tool: &Tool,
    ticket: &Ticket,
    downstream: &str,
    resend: bool,
    proto: &impl Protocol,
) -> Result<Response<Body>, Error> {
    if tool.class == ToolClass::Unsafe {
        // Unsafe tools take two durable writes: a crash between the claim and this
        // one is then provably "never sent" rather than in doubt.
        journal.dispatched(ticket).await.map_err(Error::Journal)?;
    }
    if resend {
        tracing::info!(tool = %tool.name, key = %ticket.key(), attempt = ticket.attempt(),
            "re-sending a call whose earlier attempt may have reached the tool (same downstream key)");
    }
    let req = proto.build(downstream)?;
    let resp = match shared.upstream.send(req, tool.timeout).await {
        Ok(resp) => resp,
        Err(e) if !e.may_have_been_sent() => {
            journal
                .failed_before_send(ticket, &e.to_string())
                .await
                .map_err(Error::Journal)?;
            return Err(Error::Upstream {
                target: tool.name.clone(),
                source: e,
            });
        }
        Err(e) => return in_doubt(journal, ticket, &e.to_string(), proto).await,
    };
    let (parts, body) = resp.into_parts();
    let read = tokio::time::timeout(
        tool.timeout,
        body::read_limited(body, shared.options.limits.max_body_bytes),
    )
    .await;
    let bytes = match read {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            return in_doubt(
                journal,
                ticket,
                &format!("the response body broke off: {e}"),
                proto,
            )
            .await;
        }
        Err(_) => {
            let cause = format!("the response body did not arrive within {:?}", tool.timeout);
            return in_doubt(journal, ticket, &cause, proto).await;
        }
    };
    let (stored, answer) = proto.answer(parts.status, &parts.headers, bytes);
    // The outcome is durable before the agent sees it.
    journal
        .complete(ticket, stored)
        .await
        .map_err(Error::Journal)?;
    Ok(answer)
}

async fn in_doubt(
    journal: &Journal,
    ticket: &Ticket,
    cause: &str,
    proto: &impl Protocol,
) -> Result<Response<Body>, Error> {
    let state = journal
        .in_doubt(ticket, cause)
        .await
        .map_err(Error::Journal)?;
    Ok(proto.in_doubt(ticket.key(), cause, state.as_str()))
}

enum Probed {
    Found(StoredResponse),
    NotFound,
    Failed(String),
}

/// Asks a probe tool whether the call with `downstream` happened: 2xx = yes (the
/// answer is the call's result), 404 = no, anything else = still unknown.
async fn probe(shared: &Shared, tool: &Tool, downstream: &str) -> Probed {
    let Some(path) = &tool.probe_path else {
        return Probed::Failed(format!("tool {} has no probe_path", tool.name));
    };
    let rest = path.replace("{key}", downstream);
    let req = match tools::build(
        tool,
        &rest,
        Method::GET,
        &HeaderMap::new(),
        Bytes::new(),
        Some(downstream),
    ) {
        Ok(r) => r,
        Err(e) => return Probed::Failed(e.to_string()),
    };
    match shared.upstream.send(req, tool.timeout).await {
        Ok(resp) => {
            let status = resp.status();
            let (parts, body) = resp.into_parts();
            let bytes = body::read_limited(body, shared.options.limits.max_body_bytes)
                .await
                .unwrap_or_default();
            if status.is_success() {
                Probed::Found(StoredResponse::new(
                    status.as_u16(),
                    tools::redacted_headers(&parts.headers),
                    bytes,
                ))
            } else if status == StatusCode::NOT_FOUND {
                Probed::NotFound
            } else {
                Probed::Failed(format!("the probe answered {status}"))
            }
        }
        Err(e) => Probed::Failed(format!("the probe failed: {e}")),
    }
}

/// `Prefer: wait=N` (RFC 7240), capped at 60 s.
pub(crate) fn prefer_wait(h: &HeaderMap) -> Option<Duration> {
    h.get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|p| p.trim().strip_prefix("wait="))
        .filter_map(|n| n.trim().parse::<u64>().ok())
        .map(|n| Duration::from_secs(n.min(60)))
        .next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefer_wait_parses_rfc7240() {
        let mut h = HeaderMap::new();
        assert_eq!(prefer_wait(&h), None);
        h.insert(
            "prefer",
            http::HeaderValue::from_static("respond-async, wait=5"),
        );
        assert_eq!(prefer_wait(&h), Some(Duration::from_secs(5)));
        h.insert("prefer", http::HeaderValue::from_static("wait=9999"));
        assert_eq!(prefer_wait(&h), Some(Duration::from_secs(60)));
    }
}
