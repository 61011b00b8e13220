//! The attempt loop of a model call: send to a target, classify a failure, ask the
//! retry policy, and enforce its answer — wait and retry, fall back to another
//! target, or give up — within the retry budget, past open circuits and through the
//! provider's limiter. Nothing reaches the agent until an attempt succeeds or the
//! policy gives up, so retries and fallbacks are invisible to it; for streams an
//! attempt only counts as a success once its first event has arrived.

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, header};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, Full};
use outrigger_types::{
    AttemptRecord, CallContext, CallKind, Failure, PolicyVersion, RetryDecision,
};

use crate::body::{self, BoxError};
use crate::decider::{Decider, MAX_RETRY_DELAY};
use crate::faults::Kind as FaultKind;
use crate::options::Provider;
use crate::resilience::{Breakers, Limiters, Permit, Price, RetryBudgets};
use crate::sse::Framer;
use crate::upstream;
use crate::upstream_body::UpstreamBody;
use outrigger_telemetry::spans;
use tracing::Instrument;

/// Sends one upstream request (the real client, or a script in tests).
pub trait Transport: Send + Sync {
    type Body: HttpBody<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static;
    fn send(
        &self,
        req: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Response<Self::Body>, upstream::Error>> + Send;
}

impl Transport for upstream::Upstream {
    type Body = hyper::body::Incoming;
    fn send(
        &self,
        req: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Response<Self::Body>, upstream::Error>> + Send {
        upstream::Upstream::send(self, req, timeout)
    }
}

/// The machinery the loop drives.
pub struct Mechanics<'a, T> {
    pub transport: &'a T,
    pub decider: &'a dyn Decider,
    pub breakers: &'a Breakers,
    pub limiters: &'a Limiters,
    pub budgets: &'a RetryBudgets,
    pub first_byte_timeout: Duration,
    /// The longest an answer body may send nothing once it started.
    pub stream_idle_timeout: Duration,
    pub max_event_bytes: usize,
    /// The most attempts one call makes, whatever the policy answers.
    pub max_attempts: u32,
    /// The call's task, whose retries are counted (and bounded by `[budget]
    /// retries`) in its ledger account.
    pub task_retries: Option<TaskRetries<'a>>,
    /// Where retries, fallbacks and breaker changes are counted (`None` in tests).
    pub metrics: Option<&'a outrigger_telemetry::Metrics>,
    /// Faults injected on purpose (`None`: never).
    pub faults: Option<&'a crate::faults::Injector>,
}

/// Where a task's retries are taken from.
#[derive(Clone, Copy)]
pub struct TaskRetries<'a> {
    pub ledger: &'a crate::resilience::Ledger,
    pub task: &'a str,
    /// `[budget] retries`, if set.
    pub max: Option<u32>,
}

/// Builds the request for a target (its URL, credentials and model name).
pub type BuildFn<'a> = dyn Fn(&Provider) -> Result<Request<Full<Bytes>>, crate::Error> + Sync + 'a;

/// One call to make.
pub struct Plan<'a> {
    pub task_id: Option<&'a str>,
    pub request_id: &'a str,
    pub model: &'a str,
    pub stream: bool,
    /// Targets in the order the fallback policy chose; the first is tried first.
    pub order: Vec<&'a Provider>,
    /// Builds the request for a target (its URL, credentials and model name).
    pub build: &'a BuildFn<'a>,
    pub estimated_tokens: u64,
}

/// What each attempt and decision was, for the journal, telemetry and the task.
#[derive(Debug, Default, Clone)]
pub struct Trail {
    pub attempts: u32,
    pub retries: u32,
    pub fallbacks: u32,
    pub history: Vec<AttemptRecord>,
    /// Versions of the policies that decided, in order, without repeats.
    pub policy_versions: Vec<PolicyVersion>,
    /// Why the loop stopped retrying, when it did.
    pub gave_up: Option<String>,
    pub retry_budget_exhausted: bool,
    /// A request went to a provider (these are its prices) and its attempt has not
    /// ended (set before it is sent, so it holds when the loop is dropped
    /// mid-attempt, as a cancel does): it may be generating, and is billed at least
    /// its estimate.
    pub in_flight: Option<Price>,
    /// The prices of the providers of the attempts that broke inside a tool call
    /// they had streamed (held back from the agent, and retried): the provider
    /// generated, and bills, what the agent never received.
    pub unseen: Vec<Price>,
}

impl Trail {
    /// The prices of the attempts the provider generated for and the agent never
    /// received: each that broke inside a tool call, and the one in flight.
    pub fn generated_unseen(&self) -> Vec<Price> {
        let mut generated = self.unseen.clone();
        generated.extend(self.in_flight);
        generated
    }

    fn decided_by(&mut self, v: &PolicyVersion) {
        if !self.policy_versions.contains(v) {
            self.policy_versions.push(v.clone());
        }
    }
}

/// A successful attempt: the head, any events already read (streams), and the rest
/// of the body.
pub struct Success<'a, B> {
    pub provider: &'a Provider,
    pub parts: http::response::Parts,
    pub body: B,
    /// For streams: the framer holding what was read past the first events.
    pub framer: Option<Framer>,
    pub first_events: Vec<Bytes>,
    /// The provider limiter's slot, held until the body is done.
    pub permit: Option<Permit>,
}

/// How the call ended without success.
pub enum Ended<'a> {
    /// The last upstream answer, to pass through faithfully (status, headers, body).
    Answer {
        provider: &'a Provider,
        /// What the answer stands for: its status, or for a stream whose first event
        /// is an error, the status that error means (`parts` stay as the provider
        /// sent them).
        status: StatusCode,
        parts: http::response::Parts,
        body: Bytes,
        failure: Option<Failure>,
    },
    /// No upstream answer to pass on.
    Error {
        /// `None` when no target was tried at all.
        provider: Option<&'a Provider>,
        error: crate::Error,
        failure: Failure,
    },
}

enum Outcome<'a, B> {
    Ok(Success<'a, B>),
    /// Not retryable: pass the answer through as is (a client error, say).
    Final(Ended<'a>),
    Failed(Failure, Ended<'a>),
    /// Refused here before anything was sent (the provider's queue is full or timed
    /// out, the request could not be built): not retried, and the provider said
    /// nothing, so its breaker learns nothing.
    Refused(Ended<'a>),
}

/// Runs the call to a success or its end. A success's body is the upstream's,
/// wrapped (see [`UpstreamBody`]) before its first byte was read: every byte of it,
/// the first events included, has passed the provider key's scrubber.
pub async fn run<'a, T: Transport>(
    m: &Mechanics<'_, T>,
    plan: &Plan<'a>,
    trail: &mut Trail,
) -> Result<Success<'a, UpstreamBody<T::Body>>, Ended<'a>> {
    let started = Instant::now();
    let Some(&first) = plan.order.first() else {
        return Err(Ended::Error {
            provider: None,
            error: crate::Error::NoCandidate {
                model: plan.model.to_string(),
            },
            failure: Failure::Connect { sent: false },
        });
    };
    let mut target = first;
    let mut remaining: Vec<&Provider> = plan.order.iter().skip(1).copied().collect();
    m.budgets.record_request(&target.name);
    loop {
        trail.attempts += 1;
        let join = spans::Join {
            request_id: plan.request_id,
            task_id: plan.task_id,
            policy_versions: None,
            gpu_id: None,
        };
        let span = spans::attempt(
            &tracing::Span::current(),
            &join,
            trail.attempts,
            "POST",
            &target.name,
        );
        let outcome = attempt(m, plan, target, &mut trail.in_flight)
            .instrument(span.clone())
            .await;
        trail.in_flight = None;
        let (status, error_type) = match &outcome {
            Outcome::Ok(s) => (Some(s.parts.status.as_u16()), None),
            Outcome::Final(Ended::Answer { status, .. })
            | Outcome::Failed(_, Ended::Answer { status, .. })
            | Outcome::Refused(Ended::Answer { status, .. }) => {
                (Some(status.as_u16()), Some(status.as_str().to_owned()))
            }
            Outcome::Final(Ended::Error { error, .. })
            | Outcome::Failed(_, Ended::Error { error, .. })
            | Outcome::Refused(Ended::Error { error, .. }) => {
                (None, Some(error.to_problem().slug.to_owned()))
            }
        };
        spans::finish_attempt(&span, status, error_type.as_deref());
        let (failure, ended) = match outcome {
            Outcome::Ok(s) => return Ok(s),
            Outcome::Final(ended) | Outcome::Refused(ended) => return Err(ended),
            Outcome::Failed(f, ended) => (f, ended),
        };
        let ctx = CallContext {
            task_id: plan.task_id.map(str::to_owned),
            request_id: plan.request_id.to_string(),
            kind: CallKind::Model,
            target: target.name.clone(),
            model: Some(plan.model.to_string()),
            tool_class: None,
            attempt: trail.attempts,
            elapsed: started.elapsed(),
            dispatched: failure.may_have_dispatched(),
            history: trail.history.clone(),
            retry_budget: m.budgets.view(&target.name),
            fallbacks: remaining.iter().map(|p| p.name.clone()).collect(),
        };
        if matches!(
            failure,
            Failure::StreamInterrupted {
                inside_tool_call: true,
                ..
            }
        ) {
            trail.unseen.push(target.price());
        }
        trail.history.push(AttemptRecord {
            target: target.name.clone(),
            failure: failure.clone(),
            elapsed: started.elapsed(),
        });
        let decided = m.decider.retry(&ctx, &failure);
        trail.decided_by(&decided.version);
        if trail.attempts >= m.max_attempts && !matches!(decided.value, RetryDecision::GiveUp(_)) {
            // A policy that never gives up still stops here: the retry budget alone
            // would let a lone call go on for as long as its window refills.
            trail.gave_up = Some(format!(
                "the call made {} attempts, the most resilience.max_attempts allows",
                trail.attempts
            ));
            return Err(ended);
        }
        match decided.value {
            RetryDecision::RetryAfter(delay) => {
                // The task's retry first: a retry its task may not make must not
                // spend the provider's budget, which every task shares.
                if let Some(t) = m.task_retries
                    && !t.ledger.try_take_retry(t.task, t.max)
                {
                    trail.gave_up =
                        Some("the task has no retries left under [budget] retries".into());
                    return Err(ended);
                }
                if !m.budgets.try_retry(&target.name) {
                    if let Some(t) = m.task_retries {
                        t.ledger.give_back_retry(t.task);
                    }
                    trail.gave_up = Some("the retry budget is exhausted".into());
                    budget_spent(m, trail, &target.name);
                    return Err(ended);
                }
                trail.retries += 1;
                if let Some(metrics) = m.metrics {
                    metrics.retry(&target.name, failure.reason());
                }
                tracing::debug!(target = %target.name, attempt = trail.attempts, ?delay, reason = failure.reason(), "retrying");
                tokio::time::sleep(delay.min(MAX_RETRY_DELAY)).await;
            }
            RetryDecision::FallBack(name) => {
                if !ctx.retry_budget.available {
                    budget_spent(m, trail, &target.name);
                }
                let Some(i) = remaining.iter().position(|p| p.name == name) else {
                    trail.gave_up = Some(format!(
                        "the policy chose {name:?}, which is not a fallback of this call"
                    ));
                    return Err(ended);
                };
                let next = remaining.remove(i);
                tracing::debug!(from = %target.name, to = %next.name, reason = failure.reason(), "falling back");
                trail.fallbacks += 1;
                if let Some(metrics) = m.metrics {
                    metrics.fallback(&target.name, &next.name);
                }
                target = next;
                m.budgets.record_request(&target.name);
            }
            RetryDecision::GiveUp(reason) => {
                if !ctx.retry_budget.available {
                    budget_spent(m, trail, &target.name);
                }
                trail.gave_up = Some(reason);
                return Err(ended);
            }
        }
    }
}

/// A failed call on `target` not retried there because its retry budget was spent:
/// the host refused the retry, or the policy gave up or fell back seeing the budget
/// spent.
fn budget_spent<T>(m: &Mechanics<'_, T>, trail: &mut Trail, target: &str) {
    trail.retry_budget_exhausted = true;
    if let Some(metrics) = m.metrics {
        metrics.retry_budget_exhausted(target);
    }
}

fn jitter() -> f64 {
    rand::random::<f64>()
}

/// One attempt, through the target's breaker, which learns what the provider's
/// answer (or its silence) says about it. The breaker's own refusal is no news of
/// the provider and is not recorded; neither is a local refusal, and an attempt
/// dropped mid-way (its caller went away) records nothing: either gives back a probe.
async fn attempt<'a, T: Transport>(
    m: &Mechanics<'_, T>,
    plan: &Plan<'a>,
    target: &'a Provider,
    in_flight: &mut Option<Price>,
) -> Outcome<'a, UpstreamBody<T::Body>> {
    let pass = match m.breakers.pass(&target.name) {
        Ok(pass) => pass,
        Err(retry_after) => {
            return Outcome::Failed(
                Failure::Connect { sent: false },
                Ended::Error {
                    provider: Some(target),
                    error: crate::Error::CircuitOpen {
                        target: target.name.clone(),
                        retry_after,
                    },
                    failure: Failure::Connect { sent: false },
                },
            );
        }
    };
    let outcome = exchange(m, plan, target, in_flight).await;
    let alive = match &outcome {
        Outcome::Ok(_) | Outcome::Final(_) => Some(true),
        Outcome::Failed(f, _) => Some(!broken(f)),
        Outcome::Refused(_) => None,
    };
    if let Some(alive) = alive {
        let state = pass.record(alive, jitter());
        if let Some(metrics) = m.metrics {
            metrics.breaker_state(&target.name, state);
        }
    }
    outcome
}

/// Whether a failure says the provider is broken, and counts toward opening its
/// circuit. A rate limit is the provider's capacity talking (the limiter paces it),
/// and an overflow or a filter is about the request: each is an answer from a
/// provider that is alive, a success as far as its breaker goes (a half-open
/// circuit's probe that gets one closes it).
fn broken(failure: &Failure) -> bool {
    match failure {
        Failure::ServerError { .. }
        | Failure::Timeout
        | Failure::Connect { .. }
        | Failure::StreamInterrupted { .. } => true,
        Failure::RateLimited { .. }
        | Failure::ContextOverflow
        | Failure::ContentFiltered
        | Failure::ToolParseError => false,
    }
}

/// Takes a slot of the target's limiter, sends, and classifies what came back.
async fn exchange<'a, T: Transport>(
    m: &Mechanics<'_, T>,
    plan: &Plan<'a>,
    target: &'a Provider,
    in_flight: &mut Option<Price>,
) -> Outcome<'a, UpstreamBody<T::Body>> {
    let limiter = m.limiters.get(&target.name);
    let permit = match limiter
        .acquire(plan.task_id.unwrap_or("-"), plan.estimated_tokens)
        .await
    {
        Ok(p) => p,
        Err(rejected) => {
            return Outcome::Refused(Ended::Error {
                provider: Some(target),
                error: crate::Error::Overloaded {
                    target: target.name.clone(),
                    detail: rejected.to_string(),
                },
                failure: Failure::RateLimited { retry_after: None },
            });
        }
    };
    let req = match (plan.build)(target) {
        Ok(r) => r,
        Err(error) => {
            return Outcome::Refused(Ended::Error {
                provider: Some(target),
                error,
                failure: Failure::Connect { sent: false },
            });
        }
    };
    match m.faults.and_then(|f| f.provider(&target.name)) {
        Some(FaultKind::Delay { delay }) => tokio::time::sleep(delay).await,
        Some(FaultKind::RateLimit { retry_after }) => {
            let (parts, body) = injected_answer(StatusCode::TOO_MANY_REQUESTS, Some(retry_after));
            return answered(target, &limiter, permit, parts, body);
        }
        Some(FaultKind::ServerError { status }) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            let (parts, body) = injected_answer(status, None);
            return answered(target, &limiter, permit, parts, body);
        }
        _ => {}
    }
    *in_flight = Some(target.price());
    let resp = match m.transport.send(req, m.first_byte_timeout).await {
        Ok(r) => r,
        Err(e) => {
            let failure = match &e {
                upstream::Error::Connect { .. } => Failure::Connect { sent: false },
                upstream::Error::AfterSend { .. } => Failure::Connect { sent: true },
                upstream::Error::Timeout { .. } => Failure::Timeout,
            };
            return Outcome::Failed(
                failure.clone(),
                Ended::Error {
                    provider: Some(target),
                    error: crate::Error::Upstream {
                        target: target.name.clone(),
                        source: e,
                    },
                    failure,
                },
            );
        }
    };
    let (parts, body) = resp.into_parts();
    // Everything read from here on, by this loop or after it, is scrubbed of the key.
    let body = UpstreamBody::new(body, target.api_key.as_ref().map(|k| k.expose()))
        .idle_limit(m.stream_idle_timeout);
    let status = parts.status;
    if status.is_success() {
        // The permit lives as long as the response body: a stream occupies its slot.
        if !plan.stream || !crate::headers::is_event_stream(&parts.headers) {
            limiter.observe(status.as_u16(), &parts.headers, None);
            return Outcome::Ok(Success {
                provider: target,
                parts,
                body,
                framer: None,
                first_events: Vec::new(),
                permit: Some(permit),
            });
        }
        return first_event(m, target, &limiter, parts, body, permit).await;
    }
    // An error answer: small, read whole to classify it.
    let bytes = tokio::time::timeout(m.first_byte_timeout, body::read_limited(body, 1 << 20))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    answered(target, &limiter, permit, parts, bytes)
}

/// An error answer (real or injected): the limiter learns from it, the retry policy
/// gets its classification.
fn answered<'a, B>(
    target: &'a Provider,
    limiter: &crate::resilience::Limiter,
    permit: Permit,
    parts: http::response::Parts,
    bytes: Bytes,
) -> Outcome<'a, B> {
    let status = parts.status;
    answered_as(target, limiter, permit, status, parts, bytes)
}

/// An error answer classified as `status` (a stream's error event carries its own
/// error in a 200 answer).
fn answered_as<'a, B>(
    target: &'a Provider,
    limiter: &crate::resilience::Limiter,
    permit: Permit,
    status: StatusCode,
    parts: http::response::Parts,
    bytes: Bytes,
) -> Outcome<'a, B> {
    let retry_after = retry_after(&parts.headers);
    limiter.observe(status.as_u16(), &parts.headers, retry_after);
    drop(permit);
    let failure = classify(status, retry_after, &bytes);
    let ended = Ended::Answer {
        provider: target,
        status,
        parts,
        body: bytes,
        failure: failure.clone(),
    };
    match failure {
        Some(f) => Outcome::Failed(f, ended),
        None => Outcome::Final(ended),
    }
}

/// What an injected 429 or 5xx looks like: an OpenAI-style error body, marked.
fn injected_answer(
    status: StatusCode,
    retry_after: Option<Duration>,
) -> (http::response::Parts, Bytes) {
    let mut builder = http::Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(crate::headers::FAULT_INJECTED, "true");
    if let Some(ra) = retry_after {
        builder = builder.header(
            http::header::RETRY_AFTER,
            ra.as_secs_f64().ceil().to_string(),
        );
    }
    let body = serde_json::json!({"error": {
        "message": format!("fault injected by the sidecar: {status}"),
        "type": "fault_injected",
    }});
    let (parts, ()) = builder.body(()).unwrap_or_default().into_parts();
    (parts, Bytes::from(body.to_string()))
}

/// Waits for the first complete event of a stream: until then a failure is
/// invisible to the agent and can be retried.
///
/// The first event is the first block that carries data: blocks without (comments
/// such as `: keep-alive` or `: OPENROUTER PROCESSING`, a lone `retry:`) are not
/// events to an SSE client, so they do not start the stream (though, as the body's
/// first bytes, they stop the `first_byte_timeout`: see below); they are kept and go
/// out, byte for byte, just before the first event. A first event that is the provider's error event is an error answer
/// sent as a stream: classified like an error status, and retried or passed on as
/// such.
async fn first_event<'a, B: HttpBody<Data = Bytes, Error: Into<BoxError>> + Unpin>(
    m: &Mechanics<'_, impl Transport>,
    target: &'a Provider,
    limiter: &crate::resilience::Limiter,
    parts: http::response::Parts,
    mut body: B,
    permit: Permit,
) -> Outcome<'a, B> {
    let mut framer = Framer::new(m.max_event_bytes);
    let mut events = Vec::new();
    // The first byte must come within the timeout; once the provider is sending
    // (comments, like a keep-alive while it thinks), the first event may take as long
    // as any later one: timing out then would pay for the prompt twice.
    let mut deadline = Some(tokio::time::Instant::now() + m.first_byte_timeout);
    // From the first event on, what the tool-call gate would let through. A turn that
    // opens with a tool call (OpenAI's first chunk carries it) has the gate hold
    // every event until the call completes: until something would reach the agent, a
    // failure is still invisible to it, and retried like one before the first event.
    let mut gate: Option<crate::events::Gate> = None;
    let mut gated = 0;
    loop {
        let frame = match deadline {
            Some(at) => tokio::time::timeout_at(at, body.frame()).await,
            None => Ok(body.frame().await),
        };
        let held_call = gate.as_ref().is_some_and(|g| g.turn.inside_tool_call());
        let interrupted = |why: String| {
            let failure = Failure::StreamInterrupted {
                events_delivered: 0,
                inside_tool_call: held_call,
            };
            Outcome::Failed(
                failure.clone(),
                Ended::Error {
                    provider: Some(target),
                    error: crate::Error::StreamBroke {
                        target: target.name.clone(),
                        detail: why,
                    },
                    failure,
                },
            )
        };
        match frame {
            Err(_) => {
                return Outcome::Failed(
                    Failure::Timeout,
                    Ended::Error {
                        provider: Some(target),
                        error: crate::Error::Upstream {
                            target: target.name.clone(),
                            source: upstream::Error::Timeout {
                                authority: target.authority().unwrap_or_default().to_string(),
                                timeout: m.first_byte_timeout,
                            },
                        },
                        failure: Failure::Timeout,
                    },
                );
            }
            Ok(None) if held_call => {
                return interrupted(
                    "the stream ended inside the tool call it opened with, before anything was forwarded"
                        .into(),
                );
            }
            Ok(None) => return interrupted("the stream ended before its first event".into()),
            Ok(Some(Err(e))) if held_call => {
                let e: BoxError = e.into();
                return interrupted(format!(
                    "the stream broke inside the tool call it opened with, before anything was forwarded: {e}"
                ));
            }
            Ok(Some(Err(e))) => {
                let e: BoxError = e.into();
                return interrupted(format!("the stream broke before its first event: {e}"));
            }
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if !data.is_empty() {
                    deadline = None;
                }
                if let Err(e) = framer.push(&data, &mut events) {
                    return interrupted(e.to_string());
                }
                let gate = match gate.as_mut() {
                    Some(gate) => gate,
                    None => {
                        let Some(first) = events
                            .iter()
                            .position(|e| crate::sse::parse(e).data.is_some())
                        else {
                            continue;
                        };
                        if crate::events::Turn::new(target.dialect).observe(&events[first])
                            == crate::events::Kind::Error
                        {
                            let status = error_event_status(&events[first]);
                            let body = Bytes::from(events[..=first].concat());
                            return answered_as(target, limiter, permit, status, parts, body);
                        }
                        gated = first;
                        gate.insert(crate::events::Gate::new(target.dialect))
                    }
                };
                let mut released = false;
                for ev in &events[gated..] {
                    released |= !gate.push(ev.clone()).events.is_empty();
                }
                gated = events.len();
                if !released {
                    continue;
                }
                // Only now is the answer a success for the limiter: a first event
                // that is an error counts as the error it stands for, not as a 200.
                limiter.observe(parts.status.as_u16(), &parts.headers, None);
                return Outcome::Ok(Success {
                    provider: target,
                    parts,
                    body,
                    framer: Some(framer),
                    first_events: events,
                    permit: Some(permit),
                });
            }
        }
    }
}

/// The status an error event stands for, from its error's `type` (or `code`): what
/// the provider answers with that error outside a stream (Anthropic documents the
/// pairs; OpenAI's types map the same way). Unknown types are server errors.
/// Whether an answer with `status` (and `body`, as far as it was read) says its
/// provider is broken, as an attempt's breaker reads it.
pub(crate) fn answer_says_broken(status: StatusCode, body: &[u8]) -> bool {
    classify(status, None, body).as_ref().is_some_and(broken)
}

/// Whether a stream's opening error event says its provider is broken, as an
/// attempt's breaker reads it (a rate limit or a refused request says it is alive).
pub(crate) fn error_event_says_broken(raw: &[u8]) -> bool {
    answer_says_broken(error_event_status(raw), raw)
}

pub(crate) fn error_event_status(raw: &[u8]) -> StatusCode {
    let data = crate::sse::parse(raw).data.unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(&data).unwrap_or_default();
    let error = &v["error"];
    // OpenAI's rate limits say it in `code` (`type` is `requests` or `tokens`).
    let status = [&error["type"], &error["code"]]
        .into_iter()
        .filter_map(serde_json::Value::as_str)
        .find_map(|kind| match kind {
            "invalid_request_error" => Some(400),
            "authentication_error" => Some(401),
            "permission_error" => Some(403),
            "not_found_error" => Some(404),
            "request_too_large" => Some(413),
            "rate_limit_error" | "rate_limit_exceeded" | "insufficient_quota" => Some(429),
            "overloaded_error" => Some(529),
            "timeout_error" => Some(504),
            _ => None,
        })
        .unwrap_or(500);
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// What an error answer means for a retry policy; `None` when it is the agent's
/// own mistake (4xx) and retrying cannot help.
pub fn classify(status: StatusCode, retry_after: Option<Duration>, body: &[u8]) -> Option<Failure> {
    let text = String::from_utf8_lossy(body).to_ascii_lowercase();
    match status.as_u16() {
        429 => Some(Failure::RateLimited { retry_after }),
        408 => Some(Failure::Timeout),
        400 | 413
            if text.contains("context_length_exceeded")
                || text.contains("maximum context length")
                || text.contains("prompt is too long")
                || text.contains("too many tokens") =>
        {
            Some(Failure::ContextOverflow)
        }
        400 | 403
            if text.contains("content_filter")
                || text.contains("content_policy_violation")
                || text.contains("content management policy") =>
        {
            Some(Failure::ContentFiltered)
        }
        s @ 500..=599 => Some(Failure::ServerError { status: s }),
        _ => None,
    }
}

/// `Retry-After` in seconds or as an HTTP date, or OpenAI's `retry-after-ms`, capped
/// at [`MAX_PROVIDER_WAIT`](crate::resilience::limiter::MAX_PROVIDER_WAIT).
pub fn retry_after(h: &HeaderMap) -> Option<Duration> {
    use crate::resilience::limiter::{MAX_PROVIDER_WAIT, provider_wait};
    if let Some(ms) = h
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
    {
        return provider_wait(ms / 1000.0);
    }
    let v = h.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = v.parse::<f64>() {
        return provider_wait(secs);
    }
    let when = humantime::parse_rfc3339_weak(v)
        .ok()
        .or_else(|| httpdate(v))?;
    let wait = when
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    Some(wait.min(MAX_PROVIDER_WAIT))
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`).
fn httpdate(v: &str) -> Option<std::time::SystemTime> {
    let parts: Vec<&str> = v.split_whitespace().collect();
    if parts.len() != 6 || parts[5] != "GMT" {
        return None;
    }
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| *m == parts[2])?
        + 1;
    let iso = format!(
        "{}-{:02}-{:02}T{}Z",
        parts[3],
        month,
        parts[1].parse::<u32>().ok()?,
        parts[4]
    );
    humantime::parse_rfc3339_weak(&iso).ok()
}

#[cfg(test)]
mod tests;
