//! The journaled-call engine shared by HTTP tools and MCP `tools/call`.
//!
//! The journal decides what a request with a key must do (`outrigger_journal::Begin`);
//! this loop enforces it: execute (with the unsafe class's second durable write just
//! before the send), replay the stored answer, refuse, wait (`Prefer: wait=N`),
//! probe, and record every outcome durably before the agent sees it. How a request
//! is built and how answers and refusals are worded is the [`Protocol`]'s business.

use std::time::Duration;

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use outrigger_journal::{Begin, Intent, Journal, Record, State, StoredResponse, Ticket};
use outrigger_types::{IdempotencyKey, ToolClass};

use crate::Shared;
use crate::body::{self, Body};
use crate::error::Error;
use crate::faults::Kind as FaultKind;
use crate::headers;
use crate::options::Tool;
use crate::tasks::ToolCallOutcome;
use crate::tools;

/// How one protocol builds a tool request and words its answers.
pub(crate) trait Protocol {
    /// The request for one attempt, carrying `downstream` as its idempotency key.
    fn build(&self, downstream: &str) -> Result<Request<Full<Bytes>>, Error>;
    /// What the tool's answer means for the call: what to journal and what to send
    /// the agent.
    fn answer(&self, status: StatusCode, headers: &HeaderMap, body: Bytes) -> Answered;
    fn replay(&self, record: &Record) -> Response<Body>;
    /// The agent's request headers (its credentials for the tool among them).
    fn agent_headers(&self) -> &HeaderMap;
    fn in_flight(&self, record: &Record) -> Response<Body>;
    fn mismatch(&self, record: &Record) -> Response<Body>;
    fn outcome_unknown(&self, record: &Record) -> Response<Body>;
    fn tombstoned(&self, record: &Record) -> Response<Body>;
    /// The attempt reached the tool but no answer came back; the call is now `state`.
    fn in_doubt(&self, key: &IdempotencyKey, cause: &str, state: &str) -> Response<Body>;
    /// What to tell the tool when the agent gives up on a call in flight (MCP's
    /// `notifications/cancelled`); `None` where the protocol has no such message.
    fn cancellation(&self) -> Option<Request<Full<Bytes>>> {
        None
    }
}

/// What a tool's answer means for the call.
pub(crate) enum Answered {
    /// The call's outcome: journaled (as the journal's status rules say: done, not
    /// applied or in doubt), then handed over.
    Outcome(StoredResponse, Response<Body>),
    /// Refused before the call was applied (an MCP server's transport-level 4xx: an
    /// expired session, a missing token): the call is recorded as not executed, so a
    /// retry runs it, and the agent gets the answer as it came.
    NotApplied(Response<Body>, String),
    /// A success that holds no answer to this call (an MCP stream that closed
    /// before the call's response): whether the call took effect is unknown.
    Unknown(String),
}

/// Armed while a call is at the tool. If the agent goes away first (its request,
/// and with it this future, is dropped), the call is journaled in doubt at once
/// instead of staying in flight until a restart, and the tool is told where the
/// protocol allows it.
struct Abandonment {
    armed: Option<(Journal, Ticket)>,
    cancel: Option<(crate::upstream::Upstream, Request<Full<Bytes>>, Duration)>,
}

impl Abandonment {
    fn disarm(mut self) {
        self.armed = None;
        self.cancel = None;
    }
}

impl Drop for Abandonment {
    fn drop(&mut self) {
        let Some((journal, ticket)) = self.armed.take() else {
            return;
        };
        let cancel = self.cancel.take();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let cause = "the agent went away before the tool answered";
            if let Err(e) = journal.in_doubt(&ticket, cause).await {
                tracing::debug!(key = %ticket.key(), error = %e, "could not journal an abandoned call");
            }
            if let Some((upstream, req, timeout)) = cancel
                && let Err(e) = upstream.send(req, timeout).await
            {
                tracing::debug!(error = %e, "could not tell the tool a call was cancelled");
            }
        });
    }
}

/// How a journaled call settled, for the side channels.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settled {
    pub outcome: ToolCallOutcome,
    /// The journal state the call rests in (`unjournaled` for pass-through calls).
    pub state: &'static str,
    /// Answered from the journal rather than executed.
    pub replayed: bool,
}

impl Settled {
    /// Refused by the sidecar before anything was journaled.
    pub(crate) const REFUSED: Settled = Settled {
        outcome: ToolCallOutcome::Refused,
        state: "none",
        replayed: false,
    };

    pub(crate) fn of(state: State) -> Self {
        let outcome = match state {
            State::Completed | State::Tombstone => ToolCallOutcome::Completed,
            State::FailedBeforeSend | State::Claimed => ToolCallOutcome::NotExecuted,
            State::Dispatched | State::InDoubt | State::Reconciling | State::NeedsOperator => {
                ToolCallOutcome::InDoubt
            }
        };
        Self {
            outcome,
            state: state.as_str(),
            replayed: false,
        }
    }

    fn refused(state: State) -> Self {
        Self {
            outcome: ToolCallOutcome::Refused,
            state: state.as_str(),
            replayed: false,
        }
    }

    fn replayed(state: State) -> Self {
        Self {
            replayed: true,
            ..Self::of(state)
        }
    }
}

/// Runs one journaled call to completion.
pub(crate) async fn run(
    shared: &Shared,
    journal: &Journal,
    tool: &Tool,
    intent: Intent,
    wait: Option<Duration>,
    proto: &impl Protocol,
) -> Result<(Response<Body>, Settled), Error> {
    let key = intent.key.clone();
    let downstream = intent.downstream_key.clone();
    // Kept only to ask again after waiting for a call in flight.
    let again = wait.map(|_| intent.clone());
    let mut begin = journal.begin(intent).await.map_err(Error::Journal)?;
    let mut waited = false;
    loop {
        begin = match begin {
            Begin::Execute { ticket, resend } => {
                return execute(shared, journal, tool, &ticket, &downstream, resend, proto).await;
            }
            Begin::Replay(record) => {
                return Ok((proto.replay(&record), Settled::replayed(record.state)));
            }
            Begin::InFlight { record } => match (wait, &again) {
                (Some(wait), Some(intent)) if !waited => {
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
                _ => return Ok((proto.in_flight(&record), Settled::refused(record.state))),
            },
            Begin::Mismatch { record } => {
                return Ok((proto.mismatch(&record), Settled::refused(record.state)));
            }
            Begin::OutcomeUnknown { record } => {
                // Asked again about a call already in doubt: no new fault.
                return Ok((
                    proto.outcome_unknown(&record),
                    Settled::refused(record.state),
                ));
            }
            Begin::Tombstoned { record } => {
                return Ok((proto.tombstoned(&record), Settled::refused(record.state)));
            }
            Begin::Probe { ticket } => {
                match probe(shared, tool, &downstream, proto.agent_headers()).await {
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
                        // Back to in doubt (not left reconciling): the next request probes again.
                        let state = journal
                            .in_doubt(&ticket, &format!("the probe failed: {detail}"))
                            .await
                            .map_err(Error::Journal)?;
                        return Ok((
                            proto.in_doubt(&key, &detail, state.as_str()),
                            Settled::of(state),
                        ));
                    }
                }
            }
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
) -> Result<(Response<Body>, Settled), Error> {
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
    let guard = Abandonment {
        armed: Some((journal.clone(), ticket.clone())),
        cancel: proto
            .cancellation()
            .map(|c| (shared.upstream.clone(), c, tool.timeout)),
    };
    let settled = send(shared, journal, tool, ticket, req, proto).await;
    guard.disarm();
    settled
}

/// Sends one attempt and journals how it ended.
async fn send(
    shared: &Shared,
    journal: &Journal,
    tool: &Tool,
    ticket: &Ticket,
    req: Request<Full<Bytes>>,
    proto: &impl Protocol,
) -> Result<(Response<Body>, Settled), Error> {
    let fault = shared.faults.tool(&tool.name);
    match fault {
        Some(FaultKind::Delay { delay }) => tokio::time::sleep(delay).await,
        Some(FaultKind::RateLimit { retry_after }) => {
            let mut h = HeaderMap::new();
            h.insert(RETRY_AFTER, HeaderValue::from(retry_after.as_secs().max(1)));
            h.insert(headers::FAULT_INJECTED, HeaderValue::from_static("true"));
            return answer(
                journal,
                ticket,
                proto,
                StatusCode::TOO_MANY_REQUESTS,
                &h,
                Bytes::from_static(b"fault injected by the sidecar: 429"),
            )
            .await;
        }
        Some(FaultKind::ServerError { status }) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            let mut h = HeaderMap::new();
            h.insert(headers::FAULT_INJECTED, HeaderValue::from_static("true"));
            return answer(
                journal,
                ticket,
                proto,
                status,
                &h,
                Bytes::from_static(b"fault injected by the sidecar: 5xx"),
            )
            .await;
        }
        _ => {}
    }
    let sent_at = tokio::time::Instant::now();
    let resp = match shared.upstream.send(req, tool.timeout).await {
        Ok(resp) => match fault {
            // The tool got the request (its effect happened); its answer is lost.
            Some(FaultKind::ToolTimeout) => {
                drop(resp);
                tokio::time::sleep_until(sent_at + tool.timeout).await;
                let cause = format!("fault injected: no answer within {:?}", tool.timeout);
                return in_doubt(journal, ticket, &cause, proto).await;
            }
            Some(FaultKind::ToolResetAfterEffect) => {
                drop(resp);
                let cause = "fault injected: the connection was reset after the request was sent";
                return in_doubt(journal, ticket, cause, proto).await;
            }
            _ => resp,
        },
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
    answer(journal, ticket, proto, parts.status, &parts.headers, bytes).await
}

/// Journals the tool's answer, then hands it over: the outcome is durable before the
/// agent sees it.
async fn answer(
    journal: &Journal,
    ticket: &Ticket,
    proto: &impl Protocol,
    status: StatusCode,
    headers: &HeaderMap,
    bytes: Bytes,
) -> Result<(Response<Body>, Settled), Error> {
    let (stored, answer) = match proto.answer(status, headers, bytes) {
        Answered::Outcome(stored, answer) => (stored, answer),
        Answered::NotApplied(answer, reason) => {
            journal
                .failed_before_send(ticket, &reason)
                .await
                .map_err(Error::Journal)?;
            return Ok((answer, Settled::of(State::FailedBeforeSend)));
        }
        Answered::Unknown(cause) => return in_doubt(journal, ticket, &cause, proto).await,
    };
    match journal.complete(ticket, stored).await {
        Ok(state) => Ok((answer, Settled::of(state))),
        Err(e) => Ok(unrecorded(ticket, proto, &e)),
    }
}

/// The tool answered (or may have acted) but the journal could not record it: the
/// answer is not released (it is not durable), and the agent is told the call may
/// have executed, not that it was refused. The record stays in flight until a
/// restart makes it in doubt.
fn unrecorded(
    ticket: &Ticket,
    proto: &impl Protocol,
    e: &outrigger_journal::Error,
) -> (Response<Body>, Settled) {
    tracing::error!(key = %ticket.key(), error = %e, "the call's outcome could not be journaled; it may have executed");
    let cause = format!("its outcome could not be journaled ({e})");
    let resp = proto.in_doubt(ticket.key(), &cause, State::Dispatched.as_str());
    (resp, Settled::of(State::Dispatched))
}

async fn in_doubt(
    journal: &Journal,
    ticket: &Ticket,
    cause: &str,
    proto: &impl Protocol,
) -> Result<(Response<Body>, Settled), Error> {
    let state = match journal.in_doubt(ticket, cause).await {
        Ok(state) => state,
        Err(e) => return Ok(unrecorded(ticket, proto, &e)),
    };
    Ok((
        proto.in_doubt(ticket.key(), cause, state.as_str()),
        Settled::of(state),
    ))
}

enum Probed {
    Found(StoredResponse),
    NotFound,
    Failed(String),
}

/// Asks a probe tool whether the call with `downstream` happened: 2xx = yes (the
/// answer is the call's result), 404 = no, anything else = still unknown. It goes
/// with the agent's headers, as the call itself did: a tool that needs the agent's
/// credentials must not answer an anonymous probe with a 404 that reads as "never
/// happened". An answer whose body cannot be read whole is no answer.
async fn probe(shared: &Shared, tool: &Tool, downstream: &str, agent: &HeaderMap) -> Probed {
    let Some(path) = &tool.probe_path else {
        return Probed::Failed(format!("tool {} has no probe_path", tool.name));
    };
    let rest = path.replace("{key}", &encode_segment(downstream));
    // What described the call's own body does not describe the probe's (none).
    let mut agent = agent.clone();
    for h in [
        http::header::CONTENT_LENGTH,
        http::header::CONTENT_TYPE,
        http::header::EXPECT,
    ] {
        agent.remove(h);
    }
    let req = match tools::build(
        tool,
        &rest,
        Method::GET,
        &agent,
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
            let read = body::read_limited(body, shared.options.limits.max_body_bytes);
            let bytes = match tokio::time::timeout(tool.timeout, read).await {
                Ok(Ok(bytes)) => bytes,
                Ok(Err(e)) => return Probed::Failed(format!("the probe's answer broke off: {e}")),
                Err(_) => {
                    return Probed::Failed(format!(
                        "the probe's answer did not arrive whole within {:?}",
                        tool.timeout
                    ));
                }
            };
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

/// Percent-encodes what may not appear in an RFC 3986 path segment (`/`, `?`, `#`,
/// `%`, spaces…), so any key stays one segment of the probe URL.
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        let pchar = b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'-' | b'.'
                    | b'_'
                    | b'~'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
                    | b':'
                    | b'@'
            );
        if pchar {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
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
    fn probe_keys_stay_one_segment() {
        assert_eq!(encode_segment("payments:abc-1"), "payments:abc-1");
        assert_eq!(encode_segment("a/b?c#d%e f"), "a%2Fb%3Fc%23d%25e%20f");
    }

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
