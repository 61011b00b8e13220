//! The journaled-call engine shared by HTTP tools and MCP `tools/call`.
//!
//! The journal decides what a request with a key must do (`outrigger_journal::Begin`);
//! this loop enforces it: execute (with the unsafe class's second durable write just
//! before the send), replay the stored answer, refuse, wait (`Prefer: wait=N`),
//! probe, and record every outcome durably before the agent sees it. A call that has
//! left for the tool, or a probe under way, is not cancelled when its agent goes
//! away: it finishes on its own and is journaled, as if the agent were still there. How a request
//! is built and how answers and refusals are worded is the [`Protocol`]'s business.

use std::time::Duration;

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use outrigger_journal::{Begin, Intent, Journal, Record, State, StoredResponse, Ticket};
use outrigger_telemetry::slo::Failed;
use outrigger_types::IdempotencyKey;

use crate::Shared;
use crate::body::{self, Body};
use crate::detach::{Detachable, Orphaned};
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
    /// the agent. It owns what it needs, so that a call can finish without its agent.
    fn answerer(&self) -> impl FnOnce(StatusCode, &HeaderMap, Bytes) -> Answered + Send + 'static;
    fn replay(&self, record: &Record) -> Response<Body>;
    /// The agent's request headers (its credentials for the tool among them).
    fn agent_headers(&self) -> &HeaderMap;
    fn in_flight(&self, record: &Record) -> Response<Body>;
    fn mismatch(&self, record: &Record) -> Response<Body>;
    fn outcome_unknown(&self, record: &Record) -> Response<Body>;
    fn tombstoned(&self, record: &Record) -> Response<Body>;
    /// Attempt `attempt` may have reached the tool and its outcome is unknown
    /// (`cause`: no answer came back, a probe could not tell, or the journal could
    /// not record the answer); the call is now `state` (see [`next_step`]).
    fn in_doubt(
        &self,
        key: &IdempotencyKey,
        attempt: u32,
        cause: &str,
        state: &str,
    ) -> Response<Body>;
    /// Who to tell how the call ended if it ends without its agent (the call's
    /// observer, for metrics, SLOs and the task).
    fn on_detached(&self) -> DetachedEnd;
    /// Whether an answer read in part (its status and headers, its body's first
    /// bytes, of which those from the given offset on are new) already holds the
    /// call's outcome, so that the rest is not waited for: an MCP server's event
    /// stream that holds the response but is kept open. `None`: the whole body is
    /// the answer.
    fn answered_early(&self) -> Option<AnsweredEarly> {
        None
    }
}

/// See [`Protocol::answered_early`].
pub(crate) type AnsweredEarly =
    Box<dyn Fn(StatusCode, &HeaderMap, &[u8], usize) -> bool + Send + Sync>;

/// Told how a call ended that ended without its agent: how it settled and, when it
/// failed, its `error.type`; or the error it ended in.
pub(crate) type DetachedEnd = Box<dyn FnOnce(Result<(Settled, Option<String>), Error>) + Send>;

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

/// How a journaled call settled, for the side channels.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settled {
    pub outcome: ToolCallOutcome,
    /// The journal state the call rests in (`unjournaled` for pass-through calls).
    pub state: &'static str,
    /// Answered from the journal rather than executed.
    pub replayed: bool,
    /// What went wrong, for the SLOs; `None` when the tool did what it was asked.
    /// The journal state says what may be done with the call, this says whose
    /// failure it was: a tool's 429 and a refused connection are both "not
    /// executed", but one is capacity and the other the network.
    pub failed: Option<Failed>,
}

impl Settled {
    /// Refused by the sidecar before anything was journaled: the agent's request
    /// was wrong.
    pub(crate) const REFUSED: Settled = Settled {
        outcome: ToolCallOutcome::Refused,
        state: "none",
        replayed: false,
        failed: Some(Failed::InvalidRequest),
    };

    /// Refused because the journal cannot record the call: the sidecar's failure.
    pub(crate) const UNAVAILABLE: Settled = Settled {
        failed: Some(Failed::Internal),
        ..Self::REFUSED
    };

    /// The tool answered (or may have acted) but the journal could not record it:
    /// the record stays in flight, and what failed is the sidecar's journal.
    const UNRECORDED: Settled = Settled {
        outcome: ToolCallOutcome::InDoubt,
        state: "dispatched",
        replayed: false,
        failed: Some(Failed::Internal),
    };

    pub(crate) fn of(state: State, failed: Option<Failed>) -> Self {
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
            failed,
        }
    }

    /// The tool answered with `status` and the call rests in `state`.
    fn answered(state: State, status: StatusCode) -> Self {
        Self::of(state, Failed::of_tool_status(status.as_u16()))
    }

    /// Refused by the journal's rules (a call in flight, a key reused or expired, a
    /// call already in doubt asked about again): nothing new went wrong.
    fn refused(state: State) -> Self {
        Self {
            outcome: ToolCallOutcome::Refused,
            state: state.as_str(),
            replayed: false,
            failed: Some(Failed::InvalidRequest),
        }
    }

    fn replayed(record: &Record) -> Self {
        let failed = match &record.response {
            Some(stored) => Failed::of_tool_status(stored.status),
            None => Some(Failed::Internal),
        };
        Self {
            replayed: true,
            ..Self::of(record.state, failed)
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
            Begin::Execute {
                ticket,
                resend,
                dispatch_write,
            } => {
                let attempt = Attempt {
                    ticket: &ticket,
                    resend,
                    dispatch_write,
                };
                return execute(shared, journal, tool, attempt, &downstream, proto).await;
            }
            Begin::Replay(record) => {
                return Ok((proto.replay(&record), Settled::replayed(&record)));
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
                match reconcile(shared, journal, tool, &ticket, &downstream, proto).await? {
                    Reconciled::Decided(next) => *next,
                    Reconciled::Unrecorded(e) => return Ok(unrecorded(&ticket, proto, &e)),
                    Reconciled::Unknown {
                        detail,
                        state,
                        failed,
                    } => {
                        return Ok((
                            proto.in_doubt(&key, ticket.attempt(), &detail, state.as_str()),
                            Settled::of(state, Some(failed)),
                        ));
                    }
                }
            }
        };
    }
}

/// What a probe, once journaled, made of a call in doubt.
enum Reconciled {
    /// The journal's decision: replay what the probe found, or (it found nothing)
    /// execute the next attempt, already durable as dispatched.
    Decided(Box<Begin>),
    /// The probe could not tell: the call is back in doubt (the next request probes
    /// again).
    Unknown {
        detail: String,
        state: State,
        failed: Failed,
    },
    /// The probe found the call, but the journal could not record what it found: the
    /// call did execute, so the agent is not told it was refused.
    Unrecorded(outrigger_journal::Error),
}

/// Probes a call in doubt and journals what the probe found. Like a call at the
/// tool, it is not cut short when its agent goes away: it goes on by itself and
/// journals its outcome, and a decision to execute that nobody will act on is
/// settled as never sent, so the key is not left reconciling (or dispatched) until a
/// restart.
async fn reconcile(
    shared: &Shared,
    journal: &Journal,
    tool: &Tool,
    ticket: &Ticket,
    downstream: &str,
    proto: &impl Protocol,
) -> Result<Reconciled, Error> {
    let upstream = shared.upstream.clone();
    let max_body = shared.options.limits.max_body_bytes;
    let (owned_journal, owned_ticket) = (journal.clone(), ticket.clone());
    let (owned_tool, downstream, agent) = (
        tool.clone(),
        downstream.to_owned(),
        proto.agent_headers().clone(),
    );
    let probing = async move {
        let (journal, ticket, tool) = (&owned_journal, &owned_ticket, &owned_tool);
        match probe(&upstream, max_body, tool, &downstream, &agent).await {
            Probed::Found(resp) => match journal.reconciled(ticket, Some(resp)).await {
                Ok(next) => Ok(Reconciled::Decided(Box::new(next))),
                Err(e) => Ok(Reconciled::Unrecorded(e)),
            },
            Probed::NotFound => journal
                .reconciled(ticket, None)
                .await
                .map(|next| Reconciled::Decided(Box::new(next))),
            Probed::Failed(detail, failed) => {
                tracing::warn!(tool = %tool.name, key = %ticket.key(), %detail, "probe failed; the call stays in doubt");
                // Back to in doubt (not left reconciling): the next request probes again.
                match journal
                    .in_doubt(ticket, &format!("the probe failed: {detail}"))
                    .await
                {
                    Ok(state) => Ok(Reconciled::Unknown {
                        detail,
                        state,
                        failed,
                    }),
                    // Not recorded, the call may still have executed: the answer is
                    // the in-doubt one, never "not executed".
                    Err(e) => Ok(Reconciled::Unrecorded(e)),
                }
            }
        }
    };
    let (journal, key, on_detached) = (journal.clone(), ticket.key().clone(), proto.on_detached());
    let orphaned: Orphaned<Result<Reconciled, outrigger_journal::Error>> = Box::new(
        move |reconciled| {
            Box::pin(async move {
                let end = match reconciled {
                    Ok(Reconciled::Decided(next)) => {
                        match journal.unanswered(&next, GONE_BEFORE_SEND).await {
                            Ok(()) => {
                                tracing::info!(%key, "the agent went away during a probe; what it found was journaled");
                                Ok(settled_unanswered(&next))
                            }
                            Err(e) => {
                                tracing::error!(%key, error = %e, "the agent went away during a probe; the decision that followed could not be settled");
                                Err(Error::Journal(e))
                            }
                        }
                    }
                    Ok(Reconciled::Unrecorded(e)) => {
                        tracing::error!(%key, error = %e, "the agent went away during a probe that found the call; what it found could not be journaled");
                        Ok((Settled::UNRECORDED, Some("outcome-unknown".to_owned())))
                    }
                    Ok(Reconciled::Unknown { state, failed, .. }) => {
                        tracing::info!(%key, state = state.as_str(), "the agent went away during a probe that could not tell");
                        Ok((
                            Settled::of(state, Some(failed)),
                            Some("outcome-unknown".to_owned()),
                        ))
                    }
                    Err(e) => {
                        tracing::error!(%key, error = %e, "the agent went away during a probe whose outcome could not be journaled");
                        Err(Error::Journal(e))
                    }
                };
                on_detached(end);
            })
        },
    );
    Detachable::new(probing, shared.detached.count(), orphaned)
        .await
        .map_err(Error::Journal)
}

/// Why a decision to execute that followed a probe is settled as never sent.
const GONE_BEFORE_SEND: &str = "the agent went away before the call was sent";

/// How a call settled whose agent went away before it acted on `begin` (which
/// [`Journal::unanswered`] has settled).
fn settled_unanswered(begin: &Begin) -> (Settled, Option<String>) {
    match begin {
        Begin::Replay(record) => {
            let status = record.response.as_ref().map(|r| r.status).unwrap_or(500);
            let failed = (!(200..300).contains(&status)).then(|| status.to_string());
            (Settled::replayed(record), failed)
        }
        Begin::Execute { .. } => (Settled::of(State::FailedBeforeSend, None), None),
        Begin::Probe { .. } => (
            Settled::of(State::InDoubt, None),
            Some("outcome-unknown".to_owned()),
        ),
        Begin::InFlight { record }
        | Begin::Mismatch { record }
        | Begin::OutcomeUnknown { record }
        | Begin::Tombstoned { record } => (Settled::refused(record.state), None),
    }
}

/// One attempt the journal decided to send.
struct Attempt<'a> {
    ticket: &'a Ticket,
    /// An earlier attempt may have reached the tool.
    resend: bool,
    /// The record rests at `claimed` (its class is `unsafe`): `dispatched` must be
    /// durable before the send. The record's class decides, not the tool's class
    /// in the configuration now, which may have changed since the record was made.
    dispatch_write: bool,
}

async fn execute(
    shared: &Shared,
    journal: &Journal,
    tool: &Tool,
    attempt: Attempt<'_>,
    downstream: &str,
    proto: &impl Protocol,
) -> Result<(Response<Body>, Settled), Error> {
    let Attempt {
        ticket,
        resend,
        dispatch_write,
    } = attempt;
    let req = match proto.build(downstream) {
        Ok(req) => req,
        Err(e) => {
            // Nothing left for the tool: the key must not stay in flight.
            let reason = format!("the request could not be built: {e}");
            if let Err(j) = journal.failed_before_send(ticket, &reason).await {
                tracing::error!(key = %ticket.key(), error = %j, "could not record a call that was never sent");
            }
            return Err(e);
        }
    };
    if dispatch_write {
        // Unsafe tools take two durable writes: a crash between the claim and this
        // one is then provably "never sent" rather than in doubt.
        journal.dispatched(ticket).await.map_err(Error::Journal)?;
    }
    if resend {
        tracing::info!(tool = %tool.name, key = %ticket.key(), attempt = ticket.attempt(),
            "re-sending a call whose earlier attempt may have reached the tool (same downstream key)");
    }
    let upstream = shared.upstream.clone();
    let (timeout, max_body) = (tool.timeout, shared.options.limits.max_body_bytes);
    let fault = shared.faults.tool(&tool.name);
    let (owned_journal, owned_ticket) = (journal.clone(), ticket.clone());
    let answer = proto.answerer();
    let early = proto.answered_early();
    let at_tool = async move {
        let reached = dispatch(upstream, req, timeout, max_body, early, fault).await;
        record(&owned_journal, &owned_ticket, reached, answer).await
    };
    let (key, on_detached) = (ticket.key().clone(), proto.on_detached());
    let orphaned: Orphaned<Recorded> = Box::new(move |recorded| {
        Box::pin(async move {
            match &recorded {
                Recorded::Answered(_, settled) => {
                    tracing::info!(%key, state = settled.state, "the agent went away; its call finished and was journaled");
                }
                Recorded::NotSent(e) => {
                    tracing::info!(%key, error = %e, "the agent went away; its call was never sent");
                }
                Recorded::InDoubt { cause, settled, .. } => {
                    tracing::info!(%key, %cause, state = settled.state, "the agent went away; its call ended in doubt");
                }
                Recorded::Unrecorded(e) | Recorded::Failed(e) => {
                    tracing::error!(%key, error = %e, "the agent went away; its call's outcome could not be journaled");
                }
            }
            on_detached(recorded.detached_end());
        })
    });
    let recorded = Detachable::new(at_tool, shared.detached.count(), orphaned).await;
    respond(recorded, tool, ticket, proto)
}

/// What came of one attempt, before the journal has heard of it.
enum Reached {
    /// The tool's answer, whole.
    Answer(StatusCode, HeaderMap, Bytes),
    /// The attempt never left: provably not executed.
    NotSent(crate::upstream::Error),
    /// The attempt may have reached the tool, but no whole answer came back.
    Lost(String, Failed),
}

/// Sends one attempt and reads its answer whole (or until `early` finds the outcome
/// in it), each within the tool's `timeout`. It owns all it uses, so that it can
/// finish on its own once the agent has gone.
async fn dispatch(
    upstream: crate::upstream::Upstream,
    req: Request<Full<Bytes>>,
    timeout: Duration,
    max_body: usize,
    early: Option<AnsweredEarly>,
    fault: Option<FaultKind>,
) -> Reached {
    let injected = |status: StatusCode, mut h: HeaderMap, body: &'static [u8]| {
        h.insert(headers::FAULT_INJECTED, HeaderValue::from_static("true"));
        Reached::Answer(status, h, Bytes::from_static(body))
    };
    match fault {
        Some(FaultKind::Delay { delay }) => tokio::time::sleep(delay).await,
        Some(FaultKind::RateLimit { retry_after }) => {
            let mut h = HeaderMap::new();
            h.insert(RETRY_AFTER, HeaderValue::from(retry_after.as_secs().max(1)));
            let body = b"fault injected by the sidecar: 429";
            return injected(StatusCode::TOO_MANY_REQUESTS, h, body);
        }
        Some(FaultKind::ServerError { status }) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            return injected(
                status,
                HeaderMap::new(),
                b"fault injected by the sidecar: 5xx",
            );
        }
        _ => {}
    }
    let sent_at = tokio::time::Instant::now();
    let resp = match upstream.send(req, timeout).await {
        Ok(resp) => match fault {
            // The tool got the request (its effect happened); its answer is lost.
            Some(FaultKind::ToolTimeout) => {
                drop(resp);
                tokio::time::sleep_until(sent_at + timeout).await;
                return Reached::Lost(
                    format!("fault injected: no answer within {timeout:?}"),
                    Failed::Timeout,
                );
            }
            Some(FaultKind::ToolResetAfterEffect) => {
                return Reached::Lost(
                    "fault injected: the connection was reset after the request was sent".into(),
                    Failed::Transport,
                );
            }
            _ => resp,
        },
        Err(e) if !e.may_have_been_sent() => return Reached::NotSent(e),
        Err(e) => return Reached::Lost(e.to_string(), crate::observe::failed_of_upstream(&e)),
    };
    let (parts, body) = resp.into_parts();
    let read = async {
        match &early {
            Some(done) => {
                body::read_until(body, max_body, |read, new| {
                    done(parts.status, &parts.headers, read, new)
                })
                .await
            }
            None => body::read_limited(body, max_body).await,
        }
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(bytes)) => Reached::Answer(parts.status, parts.headers, bytes),
        Ok(Err(e)) => Reached::Lost(
            format!("the response body broke off: {e}"),
            Failed::Transport,
        ),
        Err(_) => Reached::Lost(
            format!("the response body did not arrive within {timeout:?}"),
            Failed::Timeout,
        ),
    }
}

/// What the journal made of an attempt, and how the call settled when it did not end
/// in an error (the same whether its agent is there or not).
enum Recorded {
    /// Journaled as the answer says (done, not applied or in doubt).
    Answered(Response<Body>, Settled),
    /// Journaled as never sent.
    NotSent(crate::upstream::Error),
    InDoubt {
        cause: String,
        settled: Settled,
        /// The attempt that may have executed: this one, or, when this re-send
        /// never left, the one before it.
        attempt: u32,
    },
    /// The tool may have acted, but the journal could not record how the call ended.
    Unrecorded(outrigger_journal::Error),
    /// The journal could not record a call that provably did not execute.
    Failed(outrigger_journal::Error),
}

impl Recorded {
    /// What the observer of a call that ended without its agent is told: how it
    /// settled and its `error.type`, or the error it ended in (as [`respond`] would
    /// have answered).
    fn detached_end(self) -> Result<(Settled, Option<String>), Error> {
        let unknown = || Some("outcome-unknown".to_owned());
        match self {
            Recorded::Answered(resp, settled) => {
                let status = resp.status();
                Ok((
                    settled,
                    (!status.is_success()).then(|| status.as_str().to_owned()),
                ))
            }
            Recorded::InDoubt { settled, .. } => Ok((settled, unknown())),
            Recorded::Unrecorded(_) => Ok((Settled::UNRECORDED, unknown())),
            Recorded::NotSent(source) => Err(Error::Upstream {
                target: String::new(),
                source,
            }),
            Recorded::Failed(e) => Err(Error::Journal(e)),
        }
    }
}

/// Journals what came of an attempt: the outcome is durable before anyone sees it.
async fn record(
    journal: &Journal,
    ticket: &Ticket,
    reached: Reached,
    answer: impl FnOnce(StatusCode, &HeaderMap, Bytes) -> Answered,
) -> Recorded {
    let lost = async |cause: String, failed: Failed| match journal.in_doubt(ticket, &cause).await {
        Ok(state) => Recorded::InDoubt {
            attempt: ticket.attempt(),
            cause,
            settled: Settled::of(state, Some(failed)),
        },
        Err(e) => Recorded::Unrecorded(e),
    };
    let (status, headers, bytes) = match reached {
        Reached::Answer(status, headers, bytes) => (status, headers, bytes),
        Reached::NotSent(e) => {
            return match journal.failed_before_send(ticket, &e.to_string()).await {
                // The re-send of a call an earlier attempt of which may have
                // executed never left: the call is still in doubt, and the agent is
                // told so, not that nothing was sent.
                Ok(state @ (State::InDoubt | State::NeedsOperator)) => Recorded::InDoubt {
                    attempt: ticket.attempt().saturating_sub(1).max(1),
                    cause: format!(
                        "its re-send, attempt {}, could not reach the tool: {e}",
                        ticket.attempt()
                    ),
                    settled: Settled::of(state, Some(crate::observe::failed_of_upstream(&e))),
                },
                Ok(_) => Recorded::NotSent(e),
                Err(e) => Recorded::Failed(e),
            };
        }
        Reached::Lost(cause, failed) => return lost(cause, failed).await,
    };
    match answer(status, &headers, bytes) {
        Answered::Outcome(stored, resp) => match journal.complete(ticket, stored).await {
            Ok(state) => {
                let settled = Settled::answered(state, resp.status());
                Recorded::Answered(resp, settled)
            }
            Err(e) => Recorded::Unrecorded(e),
        },
        Answered::NotApplied(resp, reason) => {
            // Still in doubt when this was the re-send of an attempt in doubt.
            match journal.failed_before_send(ticket, &reason).await {
                Ok(state) => {
                    let settled = Settled::answered(state, resp.status());
                    Recorded::Answered(resp, settled)
                }
                Err(e) => Recorded::Failed(e),
            }
        }
        // A success that holds no answer: the server's stream was not what it owed.
        Answered::Unknown(cause) => lost(cause, Failed::UpstreamStream).await,
    }
}

/// What the agent is told of a recorded attempt.
fn respond(
    recorded: Recorded,
    tool: &Tool,
    ticket: &Ticket,
    proto: &impl Protocol,
) -> Result<(Response<Body>, Settled), Error> {
    match recorded {
        Recorded::Answered(resp, settled) => Ok((resp, settled)),
        Recorded::NotSent(source) => Err(Error::Upstream {
            target: tool.name.clone(),
            source,
        }),
        Recorded::InDoubt {
            cause,
            settled,
            attempt,
        } => {
            let resp = proto.in_doubt(ticket.key(), attempt, &cause, settled.state);
            Ok((resp, settled))
        }
        Recorded::Unrecorded(e) => Ok(unrecorded(ticket, proto, &e)),
        Recorded::Failed(e) => Err(Error::Journal(e)),
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
    let resp = proto.in_doubt(
        ticket.key(),
        ticket.attempt(),
        &cause,
        Settled::UNRECORDED.state,
    );
    (resp, Settled::UNRECORDED)
}

/// What a retry with the same key does to a call whose outcome is unknown and that
/// rests in `state`, told to the agent (or its model) with the in-doubt answer.
pub(crate) fn next_step(state: &str) -> &'static str {
    match state {
        "needs_operator" => {
            "The tool is not safe to re-send, so the call is held for an operator and is \
             never retried automatically: do not repeat it, not even with a new key, until an \
             operator has resolved it."
        }
        "in_doubt" => {
            "Retrying with the same key is safe: as the tool's class says, the call is re-sent \
             with the same key (the tool deduplicates it, or repeating it is harmless), or the \
             tool is first asked whether it happened."
        }
        // Still in flight: the journal could not record how the attempt ended.
        _ => {
            "Its end could not be journaled, so a retry with the same key is answered \
             \"request in progress\" until the sidecar restarts and marks the call in doubt; \
             retry with the same key then, never with a new one."
        }
    }
}

enum Probed {
    Found(StoredResponse),
    NotFound,
    /// The probe could not tell, and why (for the SLOs).
    Failed(String, Failed),
}

/// Asks a probe tool whether the call with `downstream` happened: 2xx = yes (the
/// answer is the call's result), 404 = no, anything else = still unknown. It goes
/// with the agent's headers, as the call itself did: a tool that needs the agent's
/// credentials must not answer an anonymous probe with a 404 that reads as "never
/// happened". An answer whose body cannot be read whole is no answer.
async fn probe(
    upstream: &crate::upstream::Upstream,
    max_body: usize,
    tool: &Tool,
    downstream: &str,
    agent: &HeaderMap,
) -> Probed {
    let Some(path) = &tool.probe_path else {
        return Probed::Failed(
            format!("tool {} has no probe_path", tool.name),
            Failed::Internal,
        );
    };
    let rest = path.replace("{key}", &encode_segment(downstream));
    // What described the call's own body does not describe the probe's (none), and
    // the call's conditions are not the probe's: a `304` or `412` would leave it
    // unable to tell.
    let mut agent = agent.clone();
    for h in [
        http::header::IF_MATCH,
        http::header::IF_NONE_MATCH,
        http::header::IF_MODIFIED_SINCE,
        http::header::IF_UNMODIFIED_SINCE,
        http::header::IF_RANGE,
        http::header::RANGE,
        http::header::CONTENT_LENGTH,
        http::header::CONTENT_TYPE,
        http::header::CONTENT_ENCODING,
        http::header::CONTENT_LANGUAGE,
        http::header::EXPECT,
        http::HeaderName::from_static("content-digest"),
        http::HeaderName::from_static("repr-digest"),
        http::HeaderName::from_static("digest"),
        http::HeaderName::from_static("content-md5"),
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
        Err(e) => return Probed::Failed(e.to_string(), Failed::Internal),
    };
    match upstream.send(req, tool.timeout).await {
        Ok(resp) => {
            let status = resp.status();
            let (parts, body) = resp.into_parts();
            let read = body::read_limited(body, max_body);
            let bytes = match tokio::time::timeout(tool.timeout, read).await {
                Ok(Ok(bytes)) => bytes,
                Ok(Err(e)) => {
                    return Probed::Failed(
                        format!("the probe's answer broke off: {e}"),
                        Failed::Transport,
                    );
                }
                Err(_) => {
                    return Probed::Failed(
                        format!(
                            "the probe's answer did not arrive whole within {:?}",
                            tool.timeout
                        ),
                        Failed::Timeout,
                    );
                }
            };
            probed(status, &parts.headers, bytes)
        }
        Err(e) => Probed::Failed(
            format!("the probe failed: {e}"),
            crate::observe::failed_of_upstream(&e),
        ),
    }
}

/// What a probe's answer, read whole, says. What it found is stored as the call's
/// answer, as a call's own answer is (its hop-by-hop headers left out).
fn probed(status: StatusCode, h: &HeaderMap, bytes: Bytes) -> Probed {
    if status.is_success() {
        let (stored, _) = tools::relayed(status, h, bytes);
        Probed::Found(stored)
    } else if status == StatusCode::NOT_FOUND {
        Probed::NotFound
    } else {
        Probed::Failed(
            format!("the probe answered {status}"),
            Failed::of_tool_status(status.as_u16()).unwrap_or(Failed::Unclassified),
        )
    }
}

/// Percent-encodes what may not appear in an RFC 3986 path segment (`/`, `?`, `#`,
/// `%`, spaces…), so any key stays one segment of the probe URL.
pub(crate) fn encode_segment(s: &str) -> String {
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

/// `Prefer: wait=N` (RFC 7240: the name case-insensitive, space allowed around
/// `=`), capped at 60 s.
pub(crate) fn prefer_wait(h: &HeaderMap) -> Option<Duration> {
    h.get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|p| {
            let (name, value) = p.split_once('=')?;
            // A preference's parameters follow `;`; only its value is the time.
            let value = value.split(';').next()?.trim().trim_matches('"');
            name.trim().eq_ignore_ascii_case("wait").then_some(value)
        })
        .filter_map(|n| n.parse::<u64>().ok())
        .map(|n| Duration::from_secs(n.min(60)))
        .next()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a probe found is stored like a call's answer: without hop-by-hop
    /// headers, which a replay would otherwise send again.
    #[test]
    fn a_found_call_is_stored_without_hop_by_hop_headers() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("transfer-encoding", "chunked"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("content-length", "9"),
            ("content-type", "application/json"),
            ("x-order", "7"),
        ] {
            h.insert(
                http::HeaderName::from_static(k),
                HeaderValue::from_static(v),
            );
        }
        let Probed::Found(stored) = probed(StatusCode::OK, &h, Bytes::from_static(b"{}")) else {
            panic!("a 2xx is found");
        };
        let mut names: Vec<&str> = stored.headers.iter().map(|(k, _)| k).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-type", "x-order"]);
        assert!(matches!(
            probed(StatusCode::NOT_FOUND, &h, Bytes::new()),
            Probed::NotFound
        ));
    }

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
        for spelled in [
            "Wait=7",
            "WAIT = 7",
            "handling=lenient, wait=\"7\"",
            "wait=7;x=1",
        ] {
            h.insert("prefer", http::HeaderValue::from_static(spelled));
            assert_eq!(prefer_wait(&h), Some(Duration::from_secs(7)), "{spelled}");
        }
        for not in ["await=7", "wait=soon", "wait"] {
            h.insert("prefer", http::HeaderValue::from_static(not));
            assert_eq!(prefer_wait(&h), None, "{not}");
        }
    }
}
