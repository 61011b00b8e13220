//! Model calls: `POST /v1/chat/completions` (OpenAI), `POST /v1/messages`
//! (Anthropic) and `GET /v1/models`.
//!
//! A call goes: parse → budget (admit, reject or downgrade, with the estimate
//! reserved in the task's ledger) → fallback order of the candidates → the attempt
//! loop (retries and fallbacks per the retry policy) → relay. Every decision's
//! policy version is collected in a [`attempts::Trail`].

mod answer;
pub mod attempts;
mod list;
pub mod request;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Method, Request, Response, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use outrigger_types::{
    BudgetDecision, BudgetRequest, Candidate, DowngradeOption, FallbackRequest, GpuState, TaskId,
    Usage,
};

pub use list::list;

use outrigger_journal::{Journal, StreamBegin, StreamEnd, StreamMeta, StreamRequest, StreamState};

use self::answer::Answer;
use self::attempts::{Ended, Mechanics, Plan, Success, Trail};
use self::request::ModelRequest;
use crate::body::{self, Body, Guarded};
use crate::detach::{Detachable, Orphaned};
use crate::error::Error;
use crate::events::{Gate, Turn};
use crate::observe::{ModelCall, ModelEnd};
use crate::options::{Dialect, Provider};
use crate::relay::{SseRelay, StreamObserver};
use crate::resilience::{Price, Reservation};
use crate::upstream_body::UpstreamBody;
use crate::{RequestContext, Shared, headers, keys, streams};
use outrigger_telemetry::slo::Failed;
use tracing::Instrument;

/// What the model call resolved to, for metrics and logs.
pub struct Routed {
    pub provider: String,
}

fn suffix(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::OpenAi => "/chat/completions",
        Dialect::Anthropic => "/v1/messages",
    }
}

pub async fn call(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    dialect: Dialect,
    ctx: &RequestContext,
    routed: &mut Option<Routed>,
) -> Result<Response<Body>, Error> {
    let (parts, body) = req.into_parts();
    // The span is named after the model (`chat gpt-4o`), so it starts once the request
    // is read; a request that cannot be read or routed is still one (failed) call.
    let limits = &shared.options.limits;
    let read = body::read_request(body, limits.max_body_bytes, limits.client_read_timeout);
    let parsed = match read.await {
        Ok(bytes) => ModelRequest::parse(dialect, bytes)
            .and_then(|request| Ok((resolve(shared, dialect, &request.model)?, request))),
        Err(e) => Err(Error::from(e)),
    };
    let model = parsed.as_ref().map_or("", |(_, r)| r.model.as_str());
    let mut rec = ModelCall::start(shared, ctx, dialect, &parts.headers, model);
    let (primary, request) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            rec.finish_error(&e);
            return Err(e);
        }
    };
    *routed = Some(Routed {
        provider: primary.name.clone(),
    });
    rec.routed(
        &primary.name,
        primary.caps.local,
        &request.model,
        request.stream,
    );
    let span = rec.span.clone();
    let mut rec = Some(rec);
    let result = call_inner(shared, parts, request, primary, ctx, routed, &mut rec)
        .instrument(span)
        .await;
    finish_unended(rec.take(), &result);
    result
}

/// Finishes the record of a call whose end is not a body's end (errors, replays).
fn finish_unended(rec: Option<ModelCall>, result: &Result<Response<Body>, Error>) {
    let Some(rec) = rec else {
        return;
    };
    match result {
        Err(e) => rec.finish_error(e),
        Ok(resp) => {
            let status = resp.status().as_u16();
            rec.finish(ModelEnd {
                failed: (!resp.status().is_success()).then(|| Failed::from_upstream_status(status)),
                error_type: (!resp.status().is_success()).then(|| status.to_string()),
                ..ModelEnd::default()
            });
        }
    }
}

async fn call_inner(
    shared: &Arc<Shared>,
    parts: http::request::Parts,
    request: ModelRequest,
    primary: &Provider,
    ctx: &RequestContext,
    routed: &mut Option<Routed>,
    rec: &mut Option<ModelCall>,
) -> Result<Response<Body>, Error> {
    // Checked before anything is journaled: a resume point that is not ours is the
    // client's mistake, not a reason to send the whole stream again.
    if let Some(last) = streams::last_event_id(&parts.headers)? {
        let resp = resume(shared, &parts.headers, &request, ctx, last).await?;
        // A resume that had nothing to send (`204`) is no replay, as on
        // `GET /v1/streams/{key}`.
        if let Some(r) = rec.as_mut() {
            if resp.status() == http::StatusCode::OK {
                r.replayed(outrigger_telemetry::ReplayKind::StreamResume);
            } else {
                r.answered_here();
            }
        }
        return Ok(resp);
    }
    let keyed = match &shared.journal {
        Some(_) => streams::key_for(&parts.headers, ctx, &request, &shared.options.streams)?,
        None => None,
    };
    let begun = match (keyed, shared.journal.clone()) {
        (Some(keyed), Some(journal)) => {
            match begin(shared, &journal, &keyed, &request, primary, ctx).await? {
                Begun::Replayed(resp) => {
                    if let Some(r) = rec.as_mut() {
                        r.replayed(outrigger_telemetry::ReplayKind::ModelTurn);
                    }
                    return Ok(streams::with_key(resp, &keyed.key));
                }
                Begun::New(generation) => Some((keyed, journal, generation)),
                Begun::Unjournaled => None,
            }
        }
        _ => None,
    };
    let starting = begun.map(|(keyed, journal, generation)| {
        streams::Starting::new(shared, journal, &keyed, generation, &request)
    });
    let key = starting.as_ref().map(|s| s.key().clone());
    let resp = match starting {
        Some(starting) if !shared.options.streams.cancel_on_disconnect => {
            generate_detachable(shared, request, parts.headers, ctx, routed, starting, rec).await?
        }
        starting => {
            generate(
                shared,
                request,
                primary,
                parts.headers,
                ctx,
                routed,
                starting,
                rec,
            )
            .await?
        }
    };
    Ok(match key {
        Some(key) => streams::with_key(resp, &key),
        None => resp,
    })
}

/// What a journaled generation's work hands back to its call: the answer, the
/// call's record when the answer's path did not take it, and where it went.
type Generated = (
    Result<Response<Body>, Error>,
    Option<ModelCall>,
    Option<Routed>,
);

/// A journaled generation that its agent's going away does not cancel (detach,
/// the default): up to its answer (a stream's first events, or a plain answer
/// whole) it runs as work of its own, so that a call whose agent leaves, or is
/// killed, while the provider is still thinking goes on to be journaled, and the
/// agent's repeat is answered from it instead of generating (and paying) again.
/// Bounded like any attempt: the first-byte timeout, the attempts and the time
/// each takes; after its first event a stream's producer bounds what follows
/// (`detach_timeout`). The drain waits for it.
async fn generate_detachable(
    shared: &Arc<Shared>,
    request: ModelRequest,
    agent_headers: http::HeaderMap,
    ctx: &RequestContext,
    routed: &mut Option<Routed>,
    starting: streams::Starting,
    rec: &mut Option<ModelCall>,
) -> Result<Response<Body>, Error> {
    let key = starting.key().clone();
    let work = {
        let (shared, ctx, mut rec) = (shared.clone(), ctx.clone(), rec.take());
        async move {
            let mut routed = None;
            // The provider the call was routed to: the same lookup, owned here.
            let result = match resolve(&shared, request.dialect, &request.model) {
                Ok(primary) => {
                    generate(
                        &shared,
                        request,
                        primary,
                        agent_headers,
                        &ctx,
                        &mut routed,
                        Some(starting),
                        &mut rec,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            (result, rec, routed)
        }
        .instrument(tracing::Span::current())
    };
    let orphaned: Orphaned<Generated> = Box::new(move |(result, rec, _): Generated| {
        Box::pin(async move {
            match &result {
                Ok(resp) => {
                    tracing::info!(%key, status = resp.status().as_u16(), "the agent went away before the model answered; its generation went on and is journaled");
                }
                Err(e) => {
                    tracing::info!(%key, error = %e, "the agent went away before the model answered; its generation went on and failed");
                }
            }
            finish_unended(rec, &result);
            // A stream's response, dropped: its producer goes on without a client.
        })
    });
    let (result, back, went) = Detachable::new(work, shared.detached.count(), orphaned).await;
    *rec = back;
    if went.is_some() {
        *routed = went;
    }
    result
}

/// A repeated request that names where its client is (`Last-Event-ID`): the rest of
/// that attempt of the key's stream (see [`streams::resume_repeat`]), never a new
/// generation.
async fn resume(
    shared: &Arc<Shared>,
    h: &http::HeaderMap,
    request: &ModelRequest,
    ctx: &RequestContext,
    last: streams::EventId,
) -> Result<Response<Body>, Error> {
    let refused = |detail: &str| Error::BadHeader {
        header: "Last-Event-ID",
        detail: detail.into(),
    };
    if !request.stream {
        return Err(refused(
            "a plain request (\"stream\": false) has no events to resume after; send it without this header",
        ));
    }
    let Some(journal) = &shared.journal else {
        return Err(Error::Journal(outrigger_journal::Error::Unavailable(
            "the journal is not open: no stream can be resumed".into(),
        )));
    };
    let Some(keyed) = streams::key_for(h, ctx, request, &shared.options.streams)? else {
        return Err(refused(
            "the request names no stream to resume (it has neither an Idempotency-Key nor an Outrigger-Task-Id); send the stream's key, or GET /v1/streams/{key}",
        ));
    };
    let resp = streams::resume_repeat(shared, journal, &keyed.key, keyed.fingerprint, last).await?;
    Ok(streams::with_key(resp, &keyed.key))
}

/// What beginning a keyed call's stream came to.
enum Begun {
    /// Answered from the stream the key already has.
    Replayed(Response<Body>),
    /// A fresh generation.
    New(streams::Generation),
    /// The journal cannot take the stream: it is relayed unjournaled.
    Unjournaled,
}

/// Begins the key's stream in the journal: a new attempt, or the answer of the one
/// it has.
async fn begin(
    shared: &Arc<Shared>,
    journal: &Journal,
    keyed: &streams::Keyed,
    request: &ModelRequest,
    primary: &Provider,
    ctx: &RequestContext,
) -> Result<Begun, Error> {
    // An attempt that ends while this request waits on it (its call was dropped, or
    // failed, a moment before its end reached the journal) is no answer: the key is
    // begun again, and then gets attempt n+1.
    for _ in 0..3 {
        let stream_request = StreamRequest {
            fingerprint: keyed.fingerprint,
            task_id: ctx.task_id.clone(),
            request_id: ctx.request_id.clone(),
            provider: primary.name.clone(),
            model: request.model.clone(),
            policy_versions: shared.decider.versions(),
        };
        let begin = match journal.stream_begin(&keyed.key, stream_request).await {
            Ok(begin) => begin,
            // A model call has no side effect to protect: when the journal cannot
            // take the stream, it is relayed unjournaled rather than refused.
            Err(e) if e.is_write_failure() => {
                tracing::warn!(key = %keyed.key, error = %e, "the journal cannot take this stream; relaying it unjournaled");
                return Ok(Begun::Unjournaled);
            }
            Err(e) => return Err(Error::Journal(e)),
        };
        match begin {
            StreamBegin::Mismatch { meta } => {
                return Err(Error::StreamKeyReused {
                    key: meta.key.to_string(),
                });
            }
            StreamBegin::Existing { meta } => {
                let replayed = replay(shared, journal, keyed, meta, request, ctx).await?;
                if let Some(resp) = replayed {
                    return Ok(Begun::Replayed(resp));
                }
            }
            StreamBegin::New { attempt, tag } => {
                return Ok(Begun::New(streams::Generation {
                    attempt,
                    tag: Some(tag),
                }));
            }
        }
    }
    Err(Error::StreamInProgress {
        key: keyed.key.to_string(),
    })
}

/// Answers from an existing stream: the journal for a completed one, the live hub
/// for one still being generated in this process; `None` when the attempt ended
/// without completing while this request waited on it (the key is then begun
/// again).
async fn replay(
    shared: &Arc<Shared>,
    journal: &Journal,
    keyed: &streams::Keyed,
    mut meta: StreamMeta,
    request: &ModelRequest,
    ctx: &RequestContext,
) -> Result<Option<Response<Body>>, Error> {
    // A plain answer this request waited for was cancelled.
    let mut cancelled = false;
    for _ in 0..50 {
        match meta.state {
            StreamState::Completed => {
                let attempt = meta.attempt;
                let events = journal
                    .stream_events(&keyed.key, attempt, None)
                    .map_err(Error::Journal)?;
                if events.is_empty() {
                    // A completed attempt has its terminal event (or a plain answer
                    // its body): none means retention dropped the stream since the
                    // begin, and the key begins again.
                    return Ok(None);
                }
                if request.stream {
                    streams::correlate_replay(
                        shared,
                        ctx.task_id.as_ref(),
                        request.dialect,
                        &events,
                    );
                } else if let (Some(task), Some((_, body))) = (&ctx.task_id, events.first()) {
                    // A plain answer is one JSON document, not events.
                    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
                    shared.correlator.record(task, keys::calls_in_response(&v));
                }
                tracing::debug!(key = %keyed.key, events = events.len(), "model call answered from the journal");
                if request.stream {
                    return Ok(Some(streams::journal_response(
                        events,
                        streams::Generation::of(&meta, attempt),
                    )));
                }
                let body = events
                    .into_iter()
                    .next()
                    .map(|(_, b)| b)
                    .unwrap_or_default();
                return Ok(Some(streams::plain_response(body)));
            }
            StreamState::Open => {
                // The hub of this attempt: an earlier one's may still be leaving the
                // registry while the attempt that replaced it registers its own. One
                // that is ending (its upstream read over), or whose turn an error
                // ended (its upstream still read for the usage that follows), has its
                // end awaited: a failed or abandoned attempt is then begun again, not
                // replayed with its error, to an agent that repeats the call the
                // moment it reads that error.
                let current = streams::Generation::of(&meta, meta.attempt);
                if let Some(live) = shared.streams.get(&keyed.key).filter(|live| {
                    live.generation == current && !live.is_ending() && !live.is_broken()
                }) {
                    if live.is_plain() {
                        // A plain answer still being generated (its agent may have
                        // gone): waited for, then read from the journal. One that was
                        // cancelled meanwhile is cancelled for this request too (as a
                        // stream's waiting repeat gets the cancel's error event), not
                        // generated again at once.
                        live.closed().await;
                        cancelled = live.is_cancelled();
                    } else if !request.stream {
                        return Err(Error::StreamInProgress {
                            key: keyed.key.to_string(),
                        });
                    } else {
                        return Ok(Some(streams::live_response(&live, 0, true)));
                    }
                }
            }
            // The journal answers a begin with a stream that is open or completed:
            // this one ended while the request waited (its hub gone first), or
            // retention expired it.
            StreamState::Abandoned if cancelled => {
                return Err(Error::Cancelled {
                    key: keyed.key.to_string(),
                });
            }
            StreamState::Failed | StreamState::Abandoned | StreamState::Expired => {
                return Ok(None);
            }
        }
        // Open, but its producer is finishing: read again.
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        meta = journal
            .stream_meta(&keyed.key)
            .map_err(Error::Journal)?
            .ok_or_else(|| Error::StreamInProgress {
                key: keyed.key.to_string(),
            })?;
    }
    Err(Error::StreamInProgress {
        key: keyed.key.to_string(),
    })
}

/// A fresh generation: budget, fallback order, the attempt loop, then the relay (or,
/// with a journal, the producer).
#[expect(
    clippy::too_many_arguments,
    reason = "the pieces of one call, passed once"
)]
async fn generate(
    shared: &Arc<Shared>,
    mut request: ModelRequest,
    mut primary: &Provider,
    agent_headers: http::HeaderMap,
    ctx: &RequestContext,
    routed: &mut Option<Routed>,
    journaled: Option<streams::Starting>,
    rec: &mut Option<ModelCall>,
) -> Result<Response<Body>, Error> {
    let dialect = request.dialect;
    let mut trail = Trail::default();
    let reservation = match &ctx.task_id {
        Some(task) if !shared.options.budget.limits.is_unlimited() => {
            let admitted = admit(shared, task, ctx, &request, primary, &mut trail);
            let (reservation, downgrade) = match admitted {
                Ok(a) => a,
                Err(e) => {
                    if let Error::BudgetExceeded { reason } = &e {
                        shared.metrics.budget_rejection(reason);
                    }
                    end_failed(journaled, &e.to_string()).await;
                    return Err(e);
                }
            };
            if let Some(model) = downgrade {
                tracing::info!(task = %task, from = %request.model, to = %model, "budget downgrade");
                request.body = request.with_model(&model);
                request.model = model;
                primary = resolve(shared, dialect, &request.model)?;
            }
            reservation
        }
        _ => None,
    };
    *routed = Some(Routed {
        provider: primary.name.clone(),
    });

    let order = order(shared, ctx, &request, primary, &mut trail);
    let build = |p: &Provider| -> Result<Request<Full<Bytes>>, Error> {
        let model = model_for(p, primary, &request);
        build_request(
            p,
            suffix(dialect),
            Method::POST,
            &agent_headers,
            request.with_model(model),
        )
    };
    let plan = Plan {
        task_id: ctx.task_id.as_ref().map(TaskId::as_str),
        request_id: ctx.request_id.as_str(),
        model: &request.model,
        stream: request.stream,
        order,
        build: &build,
        estimated_tokens: request
            .estimated_prompt_tokens
            .saturating_add(request.reserve_output_tokens()),
    };
    let mech = Mechanics {
        transport: &shared.upstream,
        decider: shared.decider.as_ref(),
        breakers: &shared.breakers,
        limiters: &shared.limiters,
        budgets: &shared.retry_budgets,
        first_byte_timeout: shared.options.limits.first_byte_timeout,
        stream_idle_timeout: shared.options.limits.stream_idle_timeout,
        max_event_bytes: shared.options.limits.max_event_bytes,
        max_attempts: shared.options.resilience.max_attempts,
        task_retries: ctx.task_id.as_ref().map(|task| attempts::TaskRetries {
            ledger: &shared.ledger,
            task: task.as_str(),
            max: shared.options.budget.limits.retries,
        }),
        metrics: Some(&shared.metrics),
        faults: Some(&shared.faults),
    };
    // A generation is cancellable from its start (`POST /v1/streams/{key}/cancel`):
    // a cancel while it still waits for its first event drops the attempt loop, and
    // with it the upstream request, instead of letting its events through.
    //
    // Until the loop is over, its trail and the reservation are held together, so
    // that a call dropped mid-loop (its agent went away) is charged what the
    // provider generated for it.
    let mut billed = Billed { trail, reservation };
    let run = attempts::run(&mech, &plan, &mut billed.trail);
    let run = match journaled.as_ref().map(streams::Starting::live) {
        Some(live) => tokio::select! {
            biased;
            // A success that raced the cancel is dropped, with its upstream (and
            // is billed: the provider generated it).
            result = run => if live.is_cancelled() {
                let raced = result.as_ref().ok().map(|s| s.provider.price());
                Run::Cancelled(live, raced)
            } else {
                Run::Done(result)
            },
            () = live.cancellation() => Run::Cancelled(live, None),
        },
        None => Run::Done(run.await),
    };
    let (trail, mut reservation) = billed.disarm();
    if let Some(r) = rec.as_mut() {
        r.trail(&trail);
    }
    let result = match run {
        Run::Done(result) => result,
        Run::Cancelled(live, raced) => {
            // The attempt the cancel cut short may have been generating at the
            // provider, which bills what it generated: like any call that did not
            // complete, it costs at least the estimate, and so does a success that
            // raced the cancel (nothing when no request was out: cancelled in the
            // limiter's queue, a back-off or by an open circuit). On top, each
            // attempt before it that broke inside a tool call.
            let mut generated = trail.generated_unseen();
            generated.extend(raced);
            settle_generated(reservation, &generated);
            if let Some(r) = rec.take() {
                r.finish(cancelled_end());
            }
            if let Some(starting) = journaled {
                starting.cancelled().await;
            }
            // A plain call has no events to end: its agent gets the error whole.
            if !request.stream {
                return Err(Error::Cancelled {
                    key: live.key.to_string(),
                });
            }
            // The hub's clients, this call's agent among them, get the typed error.
            return Ok(with_attempts(
                streams::live_response(&live, 0, false),
                trail.attempts,
            ));
        }
    };
    match result {
        Ok(success) => {
            // Attempts before this one that broke inside a tool call are billed on
            // top of what this one reports, and an estimate this one is charged is
            // priced at its provider (a fallback's prices may differ).
            if let Some(r) = &mut reservation {
                r.charge_generated(&trail.unseen);
                r.price_at(success.provider.price());
            }
            *routed = Some(Routed {
                provider: success.provider.name.clone(),
            });
            if let Some(r) = rec.as_mut() {
                r.routed(
                    &success.provider.name,
                    success.provider.caps.local,
                    &request.model,
                    request.stream,
                );
            }
            let rec = rec.take();
            // Declared after the record: dropped mid-way (the agent went away), the
            // reservation is settled before the record is, which then holds it.
            let mut reservation = Answered(reservation);
            let resp = match journaled {
                Some(starting) if request.stream && success.framer.is_none() => {
                    // A plain answer to a streamed request (a provider that ignores
                    // `stream`, or a 200 error document) is passed on as it came and
                    // not journaled: stored, it would be replayed as a stream it never
                    // was, and a 200 error would answer the key for good.
                    let content_type = success
                        .parts
                        .headers
                        .get(header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("none")
                        .to_owned();
                    starting
                        .failed(&format!(
                            "the provider answered a streamed request with a plain body \
                             (content-type {content_type}); it was passed on, not journaled"
                        ))
                        .await;
                    Ok(relay(
                        shared,
                        success,
                        ctx.task_id.as_ref(),
                        reservation.take(),
                        rec,
                    ))
                }
                Some(starting) => {
                    // A provider that allows it continues a text-only turn its
                    // stream broke off, up to `[streams] max_continuations` times.
                    let continuable = success
                        .provider
                        .caps
                        .continuation
                        .filter(|_| shared.options.streams.max_continuations > 0)
                        .map(|mode| crate::stitch::Continuable {
                            mode,
                            provider: success.provider.clone(),
                            suffix: suffix(dialect),
                            agent_headers: agent_headers.clone(),
                            body: request.with_model(model_for(
                                success.provider,
                                primary,
                                &request,
                            )),
                            left: shared.options.streams.max_continuations,
                        });
                    produce(
                        shared,
                        success,
                        ctx.task_id.as_ref(),
                        rec,
                        starting,
                        continuable,
                        reservation,
                    )
                    .await
                }
                None => Ok(relay(
                    shared,
                    success,
                    ctx.task_id.as_ref(),
                    reservation.take(),
                    rec,
                )),
            };
            resp.map(|r| with_attempts(r, trail.attempts))
        }
        Err(Ended::Answer {
            provider,
            status,
            mut parts,
            body,
            failure,
        }) => {
            *routed = Some(Routed {
                provider: provider.name.clone(),
            });
            // Settled before the call is finished, so its record holds the charge.
            charge_broken_attempts(reservation, &trail);
            if let Some(r) = rec.take() {
                let status = status.as_u16();
                r.finish(ModelEnd {
                    failed: Some(failure.as_ref().map_or_else(
                        || Failed::from_upstream_status(status),
                        Failed::from_failure,
                    )),
                    error_type: Some(status.to_string()),
                    ..ModelEnd::default()
                });
            }
            end_failed(journaled, &format!("upstream answered {status}")).await;
            // A faithful pass-through of the last answer (read scrubbed of the key).
            headers::strip_hop_by_hop(&mut parts.headers);
            parts.headers.remove(header::CONTENT_LENGTH);
            Ok(with_attempts(
                Response::from_parts(parts, body::full(body)),
                trail.attempts,
            ))
        }
        Err(Ended::Error {
            provider,
            error,
            failure,
        }) => {
            if let Some(p) = provider {
                *routed = Some(Routed {
                    provider: p.name.clone(),
                });
            }
            // Settled before the call is finished, so its record holds the charge.
            charge_broken_attempts(reservation, &trail);
            if let Some(r) = rec.take() {
                r.finish(ModelEnd {
                    failed: Some(match &error {
                        Error::Upstream { .. } | Error::StreamBroke { .. } => {
                            Failed::from_failure(&failure)
                        }
                        other => crate::observe::failed_of(other),
                    }),
                    error_type: Some(crate::observe::error_type_of(&error).to_string()),
                    ..ModelEnd::default()
                });
            }
            end_failed(journaled, &error.to_string()).await;
            Err(error)
        }
    }
}

/// Charges a call that ended without an answer the estimate for each of its
/// attempts that broke inside a tool call it had streamed (held back from the
/// agent, so retried as if nothing had come): the provider generated, and bills,
/// those tokens. Otherwise its reservation is released (nothing was generated).
fn charge_broken_attempts(reservation: Option<Reservation>, trail: &Trail) {
    settle_generated(reservation, &trail.unseen);
}

/// Settles a call without an answer at an estimate for each attempt the provider
/// generated for (each at the prices of the provider it went to), or releases its
/// reservation when there were none.
fn settle_generated(reservation: Option<Reservation>, generated: &[Price]) {
    if let (Some(mut r), Some((last, before))) = (reservation, generated.split_last()) {
        r.charge_generated(before);
        r.price_at(*last);
        r.settle_estimate();
    }
}

/// The budget reservation of a call the provider has answered, until the answer's
/// own path settles it. Dropped first (the agent went away while a plain answer was
/// read, or before its relay began), the call costs its estimate: the provider
/// generated the answer.
struct Answered(Option<Reservation>);

impl Answered {
    fn take(&mut self) -> Option<Reservation> {
        self.0.take()
    }
}

impl Drop for Answered {
    fn drop(&mut self) {
        if let Some(r) = self.0.take() {
            r.settle_estimate();
        }
    }
}

/// A call's attempt trail and budget reservation while its attempt loop runs.
/// Dropped armed (the call was dropped mid-loop: its agent went away before any
/// answer), it charges the attempts the provider generated for: each that broke
/// inside a tool call, and the one in flight.
struct Billed {
    trail: Trail,
    reservation: Option<Reservation>,
}

impl Billed {
    /// The trail and the reservation, for the call's own paths to settle.
    fn disarm(&mut self) -> (Trail, Option<Reservation>) {
        (std::mem::take(&mut self.trail), self.reservation.take())
    }
}

impl Drop for Billed {
    fn drop(&mut self) {
        settle_generated(self.reservation.take(), &self.trail.generated_unseen());
    }
}

/// How the attempt loop of a call that can be cancelled ended.
enum Run<T> {
    Done(T),
    /// Cancelled before its first event: this generation's hub, and the prices of
    /// the provider of a success the loop had just ended with (dropped for the
    /// cancel).
    Cancelled(Arc<streams::Live>, Option<Price>),
}

/// How a cancelled call ends, for its record.
fn cancelled_end() -> ModelEnd {
    ModelEnd {
        error_type: Some(streams::CANCELLED.to_owned()),
        aborted: true,
        client_cancelled: true,
        ..ModelEnd::default()
    }
}

/// Records that a journaled call produced no stream (so a retry starts afresh).
async fn end_failed(journaled: Option<streams::Starting>, reason: &str) {
    if let Some(starting) = journaled {
        starting.failed(reason).await;
    }
}

/// Journals a successful attempt: a stream through the producer, a plain body whole.
async fn produce(
    shared: &Arc<Shared>,
    success: Success<'_, UpstreamBody>,
    task: Option<&TaskId>,
    rec: Option<ModelCall>,
    starting: streams::Starting,
    continuable: Option<crate::stitch::Continuable>,
    // Last, so that it is dropped first (parameters drop in reverse order): a call
    // dropped mid-way settles its reservation before its record is dropped.
    mut reservation: Answered,
) -> Result<Response<Body>, Error> {
    let Success {
        provider,
        mut parts,
        body,
        framer,
        first_events,
        permit,
        ..
    } = success;
    headers::strip_hop_by_hop(&mut parts.headers);
    let price = provider.price();
    let Some(framer) = framer else {
        // A plain answer: journal it whole, durably, before it is released. A cancel
        // reaches it until it is read whole.
        let live = starting.live();
        let read = body::read_limited(body, shared.options.limits.max_body_bytes);
        let read = tokio::select! {
            biased;
            () = live.cancellation() => None,
            read = read => Some(read),
        };
        let read = match read {
            Some(read) if live.outcome_in() => read,
            cancelled => {
                // The provider bills what it generated: what the answer says when
                // it was read whole before the cancel won, else unknown here (the
                // upstream is dropped mid-answer).
                let usage = match &cancelled {
                    Some(Ok(bytes)) => {
                        let v: serde_json::Value =
                            serde_json::from_slice(bytes).unwrap_or_default();
                        Answer::from_value(&v, false).usage
                    }
                    _ => None,
                };
                settle(reservation.take(), price, usage, true);
                if let Some(rec) = rec {
                    rec.finish(ModelEnd {
                        tokens: usage,
                        ..cancelled_end()
                    });
                }
                starting.cancelled().await;
                return Err(Error::Cancelled {
                    key: live.key.to_string(),
                });
            }
        };
        let bytes = match read {
            Ok(b) => b,
            Err(e) => {
                let e = Error::StreamBroke {
                    target: provider.name.clone(),
                    detail: e.to_string(),
                };
                // The key must not stay "in progress": the next request runs afresh.
                starting.failed(&e.to_string()).await;
                // The provider answered (and bills it); what it cost is unknown.
                if let Some(r) = reservation.take() {
                    r.settle_estimate();
                }
                // A failure upstream, not the agent's cancel.
                if let Some(rec) = rec {
                    rec.finish_error(&e);
                }
                return Err(e);
            }
        };
        drop(permit);
        // The journal keeps the reported usage whole, so this answer is read whole.
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        let answer = Answer::from_value(&v, task.is_some());
        if let Some(task) = task {
            shared.correlator.record(task, answer.calls);
        }
        settle(reservation.take(), price, answer.usage, true);
        if let Some(rec) = rec {
            rec.finish(ModelEnd {
                tokens: answer.usage,
                response_model: answer.model,
                response_id: answer.id,
                ..ModelEnd::default()
            });
        }
        // The answer and the end record are made durable by one flush (the end's).
        let (journal, key, attempt) = (starting.journal(), starting.key(), starting.attempt());
        let journaled = async {
            journal
                .stream_append(key, attempt, 0, vec![bytes.clone()], false)
                .await?;
            journal
                .stream_end(
                    key,
                    attempt,
                    StreamEnd::Completed {
                        usage: v["usage"].clone(),
                        continued: 0,
                    },
                )
                .await
        };
        match journaled.await {
            Ok(()) => starting.answered(),
            // A model answer has no side effect to protect: when the journal cannot
            // write, the agent still gets it, unjournaled.
            Err(e) if e.is_write_failure() => {
                tracing::warn!(key = %starting.key(), error = %e, "the journal cannot take this answer; releasing it unjournaled");
                starting.failed(&e.to_string()).await;
            }
            Err(e) => {
                starting.failed(&e.to_string()).await;
                return Err(Error::Journal(e));
            }
        }
        parts.headers.remove(header::CONTENT_LENGTH);
        return Ok(Response::from_parts(parts, body::full(bytes)));
    };
    let (journal, live) = starting.started();
    let observer = Box::new(Observed {
        rec,
        task: task.cloned(),
        shared: shared.clone(),
        reservation: reservation.take(),
        price,
    });
    let production = streams::Production {
        journal,
        live: live.clone(),
        gate: Gate::new(provider.dialect),
        framer,
        first_events,
        observer,
        permit,
        continuer: continuable.map(crate::stitch::Continuer::new),
    };
    let body = body
        .cut_after(shared.faults.stream_cut(&provider.name))
        .gathering();
    streams::start(shared, production, body);
    let mut resp = streams::live_response(&live, 0, false);
    live.release_start();
    *resp.status_mut() = parts.status;
    Ok(resp)
}

fn resolve<'a>(shared: &'a Shared, dialect: Dialect, model: &str) -> Result<&'a Provider, Error> {
    shared
        .options
        .provider_for(dialect, model)
        .ok_or_else(|| Error::UnknownModel {
            model: model.to_string(),
            known: shared.options.known_models(dialect),
        })
}

/// The model a target is asked for: the agent's when the target serves it, else the
/// target's configured default.
fn model_for<'a>(p: &'a Provider, primary: &Provider, request: &'a ModelRequest) -> &'a str {
    if p.name == primary.name || p.models.iter().any(|m| m.matches(&request.model)) {
        &request.model
    } else {
        p.caps.default_model.as_deref().unwrap_or(&request.model)
    }
}

/// Asks the budget policy; reserves the estimate when the call is admitted.
fn admit(
    shared: &Arc<Shared>,
    task: &TaskId,
    ctx: &RequestContext,
    request: &ModelRequest,
    primary: &Provider,
    trail: &mut Trail,
) -> Result<(Option<Reservation>, Option<String>), Error> {
    let tokens_in = request.estimated_prompt_tokens;
    let tokens_out = request.reserve_output_tokens();
    let estimate = Usage {
        tokens_in,
        tokens_out,
        cost_micros: primary.price().cost(tokens_in, tokens_out),
        calls: 1,
        ..Usage::default()
    };
    let downgrades: Vec<DowngradeOption> = shared
        .options
        .budget
        .downgrades
        .iter()
        .filter_map(|m| {
            let p = shared.options.provider_for(request.dialect, m)?;
            Some(DowngradeOption {
                model: m.clone(),
                cost_per_mtok_in: p.caps.price_in,
                cost_per_mtok_out: p.caps.price_out,
            })
        })
        .collect();
    let limits = shared.options.budget.limits;
    let wall_clock_ms = shared.ledger.wall_clock(task.as_str()).as_millis() as u64;
    let (reservation, decided) = shared.ledger.reserve_with(task.as_str(), |usage| {
        let req = BudgetRequest {
            task_id: Some(task.to_string()),
            request_id: ctx.request_id.to_string(),
            model: request.model.clone(),
            estimated_tokens_in: tokens_in,
            estimated_tokens_out: tokens_out,
            estimated_cost_micros: estimate.cost_micros,
            usage: Usage {
                wall_clock_ms,
                ..*usage
            },
            limits,
            downgrades,
        };
        let decided = shared.decider.budget(&req);
        let reserved = match &decided.value {
            BudgetDecision::Admit => Some(estimate),
            // The call goes to the cheaper model: its estimate is what it may cost.
            BudgetDecision::Downgrade(model) => Some(Usage {
                cost_micros: shared
                    .options
                    .provider_for(request.dialect, model)
                    .map_or(estimate.cost_micros, |p| {
                        p.price().cost(tokens_in, tokens_out)
                    }),
                ..estimate
            }),
            BudgetDecision::Reject(_) => None,
        };
        (reserved, decided)
    });
    trail.policy_versions.push(decided.version.clone());
    match decided.value {
        BudgetDecision::Admit => Ok((reservation, None)),
        BudgetDecision::Downgrade(model) => Ok((reservation, Some(model))),
        BudgetDecision::Reject(reason) => {
            tracing::info!(task = %task, %reason, "budget rejected a call");
            Err(Error::BudgetExceeded { reason })
        }
    }
}

/// The primary and its fallbacks (same dialect), ordered by the fallback policy.
fn order<'a>(
    shared: &'a Shared,
    ctx: &RequestContext,
    request: &ModelRequest,
    primary: &'a Provider,
    trail: &mut Trail,
) -> Vec<&'a Provider> {
    let mut targets: Vec<&Provider> = vec![primary];
    for name in &primary.caps.fallbacks {
        if let Some(p) = shared
            .options
            .providers
            .iter()
            .find(|p| &p.name == name && p.dialect == primary.dialect)
            && !targets.iter().any(|t| t.name == p.name)
        {
            targets.push(p);
        }
    }
    if targets.len() == 1
        && shared.breakers.state(&primary.name) == outrigger_types::CircuitState::Closed
    {
        // Nothing to order: skip the policy call on the common path.
        return targets;
    }
    let gpu = shared.gpu.load();
    let candidates = targets
        .iter()
        .map(|p| Candidate {
            name: p.name.clone(),
            supports_tools: p.caps.supports_tools,
            supports_streaming: p.caps.supports_streaming,
            context_window: p.caps.context_window,
            modalities: p.caps.modalities,
            circuit: shared.breakers.state(&p.name),
            local: p.caps.local,
            gpu: p.caps.local.then_some(if gpu.present {
                gpu.state
            } else {
                GpuState::Unknown
            }),
            cost_per_mtok_in: p.caps.price_in,
            cost_per_mtok_out: p.caps.price_out,
        })
        .collect();
    let decided = shared.decider.fallback(&FallbackRequest {
        task_id: ctx.task_id.as_ref().map(ToString::to_string),
        request_id: ctx.request_id.to_string(),
        model: request.model.clone(),
        needs_tools: request.has_tools,
        streaming: request.stream,
        estimated_tokens: u32::try_from(request.estimated_prompt_tokens).unwrap_or(u32::MAX),
        modalities: request.modalities,
        candidates,
    });
    trail.policy_versions.push(decided.version.clone());
    decided
        .value
        .iter()
        .filter_map(|&i| targets.get(i).copied())
        .collect()
}

pub fn build_request(
    provider: &Provider,
    suffix: &str,
    method: Method,
    agent_headers: &http::HeaderMap,
    body: Bytes,
) -> Result<Request<Full<Bytes>>, Error> {
    let uri = provider
        .url(suffix)
        .map_err(|e| Error::BuildRequest(e.to_string()))?;
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    let mut h = headers::forwardable(agent_headers);
    headers::inject_credential(&mut h, provider.dialect, provider.api_key.as_ref());
    *req.headers_mut() = h;
    Ok(req)
}

/// Turns a successful attempt into the agent's response: SSE streams are relayed
/// event by event; plain bodies stream through unchanged.
fn relay(
    shared: &Arc<Shared>,
    success: Success<'_, UpstreamBody>,
    task: Option<&TaskId>,
    reservation: Option<Reservation>,
    rec: Option<ModelCall>,
) -> Response<Body> {
    let Success {
        provider,
        mut parts,
        body,
        framer,
        first_events,
        permit,
        ..
    } = success;
    headers::strip_hop_by_hop(&mut parts.headers);
    let price = provider.price();
    let mut observed = Observed {
        rec,
        task: task.cloned(),
        shared: shared.clone(),
        reservation,
        price,
    };
    let body: Body = match framer {
        Some(framer) => SseRelay::resume(
            body.cut_after(shared.faults.stream_cut(&provider.name))
                .gathering(),
            framer,
            first_events,
            observed,
        )
        .gated(provider.dialect)
        .boxed_unsync(),
        None => {
            // Plain responses stream through; a bounded copy is parsed at the end for the
            // tool calls the model issued (key derivation) and its usage.
            let limit = shared.options.limits.max_body_bytes;
            if provider.api_key.is_some() {
                // Scrubbing may change the length.
                parts.headers.remove(header::CONTENT_LENGTH);
            }
            body::Tee::new(
                body,
                limit,
                move |copy: Result<&[u8], body::TeeEnd>| match copy {
                    Ok(bytes) => {
                        let mut answer = Answer::read(bytes, observed.task.is_some());
                        if let Some(task) = &observed.task {
                            let calls = std::mem::take(&mut answer.calls);
                            observed.shared.correlator.record(task, calls);
                        }
                        observed.finish_plain(answer);
                    }
                    // Whole, but too long to read: its usage is unknown (the estimate).
                    Err(body::TeeEnd::TooLong) => observed.finish_plain(Answer::default()),
                    // A failure upstream, not the agent's cancel.
                    Err(body::TeeEnd::Broke(reason)) => observed.end(Err(&reason), None),
                },
            )
            .boxed_unsync()
        }
    };
    Response::from_parts(parts, Guarded::new(body, permit).boxed_unsync())
}

/// Tells the agent how many upstream attempts the answer took (`outrigger-attempts`).
fn with_attempts(mut resp: Response<Body>, attempts: u32) -> Response<Body> {
    resp.headers_mut()
        .insert(headers::ATTEMPTS, http::HeaderValue::from(attempts));
    resp
}

/// Charges a finished call: what the provider reported, else the estimate (a budget
/// errs on the side of what may have been spent).
/// Settles a budget reservation on the reported usage; a call that did not complete
/// costs at least its estimate (see [`Reservation::settle_at_least`]).
fn settle(
    reservation: Option<Reservation>,
    price: Price,
    usage: Option<(u64, u64)>,
    complete: bool,
) {
    match (reservation, usage) {
        (Some(r), Some((i, o))) if complete => r.settle(&price.usage(i, o)),
        (Some(r), Some((i, o))) => r.settle_at_least(&price.usage(i, o)),
        (Some(r), None) => r.settle_estimate(),
        (None, _) => {}
    }
}

/// Follows a relayed answer to its end: times its chunks, records the tool calls a
/// task's turn completed (key derivation), settles the budget reservation on the
/// reported usage, and finishes the call's observation.
struct Observed {
    rec: Option<ModelCall>,
    task: Option<TaskId>,
    shared: Arc<Shared>,
    reservation: Option<Reservation>,
    price: Price,
}

impl Observed {
    fn end(&mut self, outcome: Result<(), &str>, turn: Option<&Turn>) {
        if let (Some(task), Some(turn)) = (&self.task, turn) {
            self.shared.correlator.record(task, turn.completed_calls());
        }
        let usage = turn.and_then(|t| t.usage);
        let complete = outcome.is_ok() && !turn.is_some_and(|t| t.errored);
        settle(
            self.reservation.take(),
            self.price,
            usage.map(|u| (u.input, u.output)),
            complete,
        );
        if let Some(rec) = self.rec.take() {
            rec.finish(ModelEnd {
                failed: turn
                    .is_some_and(|t| t.errored)
                    .then_some(Failed::UpstreamStream),
                error_type: outcome.err().map(str::to_owned),
                response_model: turn.and_then(|t| t.response_model.clone()),
                response_id: turn.and_then(|t| t.response_id.clone()),
                finish_reason: turn.and_then(|t| t.finish_reason.clone()),
                tokens: usage.map(|u| (u.input, u.output)),
                aborted: outcome.is_err() && !turn.is_some_and(|t| t.errored),
                // The agent's own cancel is excluded from the SLO, not a network fault.
                client_cancelled: outcome == Err(streams::CANCELLED),
            });
        }
    }

    fn finish_plain(&mut self, answer: Answer) {
        settle(self.reservation.take(), self.price, answer.usage, true);
        if let Some(rec) = self.rec.take() {
            rec.finish(ModelEnd {
                tokens: answer.usage,
                response_model: answer.model,
                response_id: answer.id,
                ..ModelEnd::default()
            });
        }
    }
}

impl Drop for Observed {
    /// A relayed answer dropped before its end (the agent went away mid-stream or
    /// mid-body) never reached [`Observed::end`]: the provider bills what it
    /// generated, which nobody counted, so the call costs its estimate rather than
    /// nothing.
    fn drop(&mut self) {
        if let Some(reservation) = self.reservation.take() {
            reservation.settle_estimate();
        }
    }
}

impl StreamObserver for Observed {
    fn on_event(&mut self, _raw: &Bytes, at: Instant) {
        if let Some(rec) = self.rec.as_mut() {
            rec.chunk(at);
        }
    }

    fn on_end(&mut self, outcome: Result<(), &str>, turn: Option<&Turn>) {
        self.end(outcome, turn);
    }
}

/// Keeps `guard` alive for as long as the response body is being sent.
pub fn guard_body<G: Send + Unpin + 'static>(resp: Response<Body>, guard: G) -> Response<Body> {
    let (parts, body) = resp.into_parts();
    Response::from_parts(parts, Guarded::new(body, guard).boxed_unsync())
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use http_body::Body as HttpBody;

    use super::*;
    use crate::sse::Framer;
    use crate::test_journal::TempJournal;

    /// An upstream body that has nothing more, yet.
    struct Waiting;

    impl HttpBody for Waiting {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            Poll::Pending
        }
    }

    fn ctx() -> RequestContext {
        RequestContext {
            request_id: outrigger_types::RequestId::from_generated("r1".into()),
            task_id: None,
            peer: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
            synthetic: false,
        }
    }

    fn provider() -> Provider {
        Provider {
            name: "oa".into(),
            dialect: Dialect::OpenAi,
            base_url: "http://127.0.0.1:1/v1".parse().expect("a url"),
            api_key: None,
            models: vec![crate::options::ModelPattern::Any],
            caps: crate::options::Capabilities::permissive(),
        }
    }

    /// A proxy with the one provider over `j`'s journal, and the keyed request every
    /// repeat below sends (`Idempotency-Key: k`).
    fn keyed_setup(j: &TempJournal) -> (Arc<Shared>, ModelRequest, streams::Keyed) {
        let proxy = crate::Proxy::new(
            crate::Options {
                providers: vec![provider()],
                ..crate::Options::default()
            },
            crate::Components::new(outrigger_telemetry::Metrics::new(), Some(j.journal.clone())),
        );
        let shared = proxy.shared.clone();
        let request = ModelRequest::parse(
            Dialect::OpenAi,
            Bytes::from_static(br#"{"model":"gpt","stream":true,"messages":[]}"#),
        )
        .expect("a request");
        let mut h = http::HeaderMap::new();
        h.insert(
            headers::IDEMPOTENCY_KEY,
            http::HeaderValue::from_static("k"),
        );
        let keyed = streams::key_for(&h, &ctx(), &request, &shared.options.streams)
            .expect("keyed")
            .expect("a key");
        (shared, request, keyed)
    }

    /// A repeat's begin of `keyed` while its attempt is open: the open stream.
    async fn begin_existing(j: &TempJournal, keyed: &streams::Keyed) -> StreamMeta {
        let begun = j
            .journal
            .stream_begin(
                &keyed.key,
                outrigger_journal::StreamRequest {
                    fingerprint: keyed.fingerprint,
                    task_id: None,
                    request_id: ctx().request_id,
                    provider: "oa".into(),
                    model: "gpt".into(),
                    policy_versions: Vec::new(),
                },
            )
            .await
            .expect("begun");
        match begun {
            StreamBegin::Existing { meta } => meta,
            other => panic!("the first attempt is open: {other:?}"),
        }
    }

    /// The first call of `keyed` begun (attempt 1), waiting for its first event.
    async fn first_attempt(
        shared: &Arc<Shared>,
        j: &TempJournal,
        request: &ModelRequest,
        keyed: &streams::Keyed,
    ) -> streams::Starting {
        let first = begin(shared, &j.journal, keyed, request, &provider(), &ctx())
            .await
            .expect("begun");
        let Begun::New(generation) = first else {
            panic!("not a new generation");
        };
        assert_eq!(generation.attempt, 1);
        streams::Starting::new(shared, j.journal.clone(), keyed, generation, request)
    }

    /// A call dropped before its first event removes its hub at once and records its
    /// end a moment later. A repeat that began in between finds the stream open and
    /// then ended: that is no answer (a 204) but a reason to begin again, as the key's
    /// next attempt.
    #[tokio::test]
    async fn a_repeat_that_meets_an_attempt_ending_begins_the_next_one() {
        let j = TempJournal::open().expect("a journal");
        let (shared, request, keyed) = keyed_setup(&j);
        let starting = first_attempt(&shared, &j, &request, &keyed).await;
        // The repeat begins while the first call waits for its first event…
        let meta = begin_existing(&j, &keyed).await;
        // …which its agent then leaves.
        drop(starting);
        let replayed = replay(&shared, &j.journal, &keyed, meta, &request, &ctx())
            .await
            .expect("no error");
        assert!(
            replayed.is_none(),
            "answered {:?}",
            replayed.map(|r| r.status())
        );
        let again = begin(&shared, &j.journal, &keyed, &request, &provider(), &ctx())
            .await
            .expect("begun");
        assert!(matches!(again, Begun::New(g) if g.attempt == 2));
    }

    /// An agent that repeats its call the moment it reads the typed error of an
    /// interrupted stream meets that attempt still open, its hub still registered
    /// while its end is being recorded. It is not answered with the broken attempt
    /// again (its events and its error): the repeat waits for the end, and then
    /// begins the key afresh.
    #[tokio::test]
    async fn a_repeat_of_a_broken_stream_whose_end_is_being_recorded_begins_afresh() {
        let end = outrigger_journal::StreamEnd::abandoned("the upstream broke");
        a_repeat_of_a_broken_turn_begins_afresh(streams::Live::mark_ending, end).await;
    }

    /// The same when the turn's error event is out while its upstream is still read
    /// (for the usage that follows): the repeat is not attached to the broken turn
    /// but waits for its end (`409` with `Retry-After` past half a second).
    #[tokio::test]
    async fn a_repeat_of_a_turn_an_error_ended_while_its_upstream_runs_begins_afresh() {
        let end = outrigger_journal::StreamEnd::Failed {
            reason: "the provider reported an error".into(),
        };
        // What the producer does when the error event closes the turn's gate.
        a_repeat_of_a_broken_turn_begins_afresh(streams::Live::mark_broken, end).await;
    }

    /// Attempt 1 sends text and then its typed error, and `mark` says how far its
    /// hub is; a repeat then waits until `end` is recorded, and begins attempt 2.
    async fn a_repeat_of_a_broken_turn_begins_afresh(
        mark: fn(&streams::Live),
        end: outrigger_journal::StreamEnd,
    ) {
        let j = TempJournal::open().expect("a journal");
        let (shared, request, keyed) = keyed_setup(&j);
        let starting = first_attempt(&shared, &j, &request, &keyed).await;
        let (journal, live) = starting.started();
        live.push([
            Bytes::from_static(
                b"id: 1:0\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
            ),
            Bytes::from_static(b"id: 1:1\ndata: {\"error\":{\"type\":\"stream_interrupted\"}}\n\n"),
        ]);
        mark(&live);
        let meta = begin_existing(&j, &keyed).await;
        let repeat = tokio::spawn({
            let (shared, journal, keyed, request) = (
                shared.clone(),
                j.journal.clone(),
                keyed.clone(),
                request.clone(),
            );
            async move { replay(&shared, &journal, &keyed, meta, &request, &ctx()).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!repeat.is_finished(), "the repeat waits for the end");
        live.mark_ending();
        journal.stream_end(&keyed.key, 1, end).await.expect("ended");
        let replayed = repeat.await.expect("joined").expect("no error");
        assert!(
            replayed.is_none(),
            "answered {:?}",
            replayed.map(|r| r.status())
        );
        let again = begin(&shared, &j.journal, &keyed, &request, &provider(), &ctx())
            .await
            .expect("begun");
        assert!(matches!(again, Begun::New(g) if g.attempt == 2));
    }

    /// An agent that goes away in the middle of an unjournaled stream drops the relay
    /// before its end: the task is charged the call's estimate, not nothing.
    #[tokio::test]
    async fn a_relayed_call_its_agent_left_mid_stream_costs_its_estimate() {
        let proxy = crate::Proxy::new(
            crate::Options::default(),
            crate::Components::new(outrigger_telemetry::Metrics::new(), None),
        );
        let shared = proxy.shared.clone();
        let estimate = Usage {
            tokens_in: 100,
            tokens_out: 50,
            cost_micros: 7,
            calls: 1,
            ..Usage::default()
        };
        let (reservation, ()) = shared.ledger.reserve_if("t", estimate, |_| (true, ()));
        let observed = Observed {
            rec: None,
            task: Some(TaskId::new("t").expect("a task id")),
            shared: shared.clone(),
            reservation,
            price: Price {
                per_mtok_in: 1,
                per_mtok_out: 1,
            },
        };
        let first = Bytes::from_static(
            b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\n",
        );
        let mut relay = SseRelay::resume(Waiting, Framer::default(), vec![first.clone()], observed)
            .gated(Dialect::OpenAi);
        let got = std::future::poll_fn(|cx| Pin::new(&mut relay).poll_frame(cx)).await;
        let data = got
            .and_then(Result::ok)
            .and_then(|f| f.into_data().ok())
            .expect("the first event");
        assert_eq!(data, first);
        assert_eq!(shared.ledger.committed("t"), Usage::default());
        drop(relay);
        assert_eq!(shared.ledger.committed("t"), estimate);
        assert_eq!(shared.ledger.usage("t"), estimate, "nothing left reserved");
    }

    /// An agent that leaves after the turn's terminal event reached it, while the
    /// upstream has not yet ended its body, had the whole turn: the task is charged
    /// the usage the turn reported, not the estimate.
    #[tokio::test]
    async fn a_relayed_call_its_agent_left_after_the_terminal_event_costs_its_usage() {
        let proxy = crate::Proxy::new(
            crate::Options::default(),
            crate::Components::new(outrigger_telemetry::Metrics::new(), None),
        );
        let shared = proxy.shared.clone();
        let estimate = Usage {
            tokens_in: 100,
            tokens_out: 50,
            calls: 1,
            ..Usage::default()
        };
        let relay_until = |events: &'static [&'static [u8]], task: &str| {
            let (reservation, ()) = shared.ledger.reserve_if(task, estimate, |_| (true, ()));
            let observed = Observed {
                rec: None,
                task: Some(TaskId::new(task).expect("a task id")),
                shared: shared.clone(),
                reservation,
                price: Price::default(),
            };
            let first = events.iter().map(|e| Bytes::from_static(e)).collect();
            SseRelay::resume(Waiting, Framer::default(), first, observed).gated(Dialect::OpenAi)
        };
        let whole: &[&[u8]] = &[
            b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\n",
            b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            b"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"total_tokens\":10}}\n\n",
            b"data: [DONE]\n\n",
        ];
        for (task, delivered, charged) in [
            // Every event reached the agent, [DONE] included.
            ("whole", 4, Price::default().usage(7, 3)),
            // The agent left before [DONE] reached it: not the whole turn.
            ("short", 3, estimate),
        ] {
            let mut relay = relay_until(whole, task);
            for _ in 0..delivered {
                let got = std::future::poll_fn(|cx| Pin::new(&mut relay).poll_frame(cx)).await;
                assert!(got.is_some_and(|f| f.is_ok()), "{task}");
            }
            drop(relay);
            assert_eq!(shared.ledger.committed(task), charged, "{task}");
            assert_eq!(
                shared.ledger.usage(task),
                charged,
                "{task}: nothing left reserved"
            );
        }
    }

    /// A call whose attempts all failed costs nothing, unless one broke inside a
    /// tool call it had streamed: the provider generated those tokens, and bills
    /// them at its own prices, whatever model the call was reserved at.
    #[test]
    fn a_call_whose_attempt_broke_inside_a_tool_call_costs_its_estimate() {
        // Reserved at the model asked for: 100 tokens in and 50 out at $1 and $2
        // per million is 200 micro-dollars.
        let asked = Price {
            per_mtok_in: 1_000_000,
            per_mtok_out: 2_000_000,
        };
        let estimate = asked.usage(100, 50);
        assert_eq!(estimate.cost_micros, 200);
        // A fallback at $10 and $30: 1,000 + 1,500.
        let fallback = Price {
            per_mtok_in: 10_000_000,
            per_mtok_out: 30_000_000,
        };
        let failed = |unseen: Vec<Price>| {
            let ledger = crate::resilience::Ledger::default();
            let (reservation, ()) = ledger.reserve_if("t", estimate, |_| (true, ()));
            let trail = Trail {
                unseen,
                ..Trail::default()
            };
            charge_broken_attempts(reservation, &trail);
            (ledger.committed("t"), ledger.usage("t"))
        };
        assert_eq!(failed(vec![asked]), (estimate, estimate));
        // Each broken attempt was generated: two cost the estimate's tokens twice,
        // each at its provider's prices, still one call.
        let both = Usage {
            tokens_in: 200,
            tokens_out: 100,
            cost_micros: 200 + 2_500,
            calls: 1,
            ..Usage::default()
        };
        assert_eq!(failed(vec![asked, fallback]), (both, both));
        assert_eq!(failed(vec![fallback, asked]), (both, both));
        let on_the_fallback = Usage {
            cost_micros: 2_500,
            ..estimate
        };
        assert_eq!(
            failed(vec![fallback]),
            (on_the_fallback, on_the_fallback),
            "nothing left reserved"
        );
        let refused = failed(vec![]);
        assert_eq!(refused, (Usage::default(), Usage::default()), "released");
    }

    /// A call dropped between the provider's answer and its settlement (the agent
    /// left while a plain answer was read) costs its estimate; one whose path took
    /// the reservation out settles it there, not twice.
    #[test]
    fn an_answered_call_dropped_before_its_settlement_costs_its_estimate() {
        let estimate = Usage {
            tokens_in: 100,
            tokens_out: 50,
            calls: 1,
            ..Usage::default()
        };
        let ledger = crate::resilience::Ledger::default();
        let (reservation, ()) = ledger.reserve_if("t", estimate, |_| (true, ()));
        drop(Answered(reservation));
        assert_eq!(ledger.committed("t"), estimate);

        let ledger = crate::resilience::Ledger::default();
        let (reservation, ()) = ledger.reserve_if("t", estimate, |_| (true, ()));
        let mut answered = Answered(reservation);
        let taken = answered.take();
        drop(answered);
        assert_eq!(
            ledger.committed("t"),
            Usage::default(),
            "not settled by the guard"
        );
        drop(taken);
        assert_eq!(
            ledger.committed("t"),
            Usage::default(),
            "released by its path"
        );
    }

    /// The budget policy downgrades a call: the task's reservation is the cheaper
    /// model's estimate, not the one asked for, so the task's other calls are not
    /// refused for money this one will not spend.
    #[test]
    fn a_downgraded_call_reserves_the_cheaper_models_estimate() {
        struct Downgrading;
        impl crate::decider::Decider for Downgrading {
            fn retry(
                &self,
                ctx: &outrigger_types::CallContext,
                failure: &outrigger_types::Failure,
            ) -> outrigger_types::Decided<outrigger_types::RetryDecision> {
                crate::decider::NoPolicy.retry(ctx, failure)
            }
            fn fallback(
                &self,
                req: &outrigger_types::FallbackRequest,
            ) -> outrigger_types::Decided<Vec<usize>> {
                crate::decider::NoPolicy.fallback(req)
            }
            fn budget(
                &self,
                _: &outrigger_types::BudgetRequest,
            ) -> outrigger_types::Decided<BudgetDecision> {
                outrigger_types::Decided {
                    value: BudgetDecision::Downgrade("small".into()),
                    version: outrigger_types::PolicyVersion::new("budget", "test"),
                    source: outrigger_types::DecisionSource::Policy,
                }
            }
        }
        let priced = |name: &str, price_in, price_out| Provider {
            name: name.into(),
            models: vec![crate::options::ModelPattern::Name(name.into())],
            caps: crate::options::Capabilities {
                price_in,
                price_out,
                ..crate::options::Capabilities::permissive()
            },
            ..provider()
        };
        let (big, small) = (
            priced("big", 10_000_000, 30_000_000),
            priced("small", 100_000, 400_000),
        );
        let proxy = crate::Proxy::new(
            crate::Options {
                providers: vec![big.clone(), small.clone()],
                budget: crate::options::Budget {
                    limits: outrigger_types::Limits {
                        cost_micros: Some(50_000_000),
                        ..outrigger_types::Limits::default()
                    },
                    downgrades: vec!["small".into()],
                },
                ..crate::Options::default()
            },
            crate::Components {
                decider: Arc::new(Downgrading),
                ..crate::Components::new(outrigger_telemetry::Metrics::new(), None)
            },
        );
        let request = ModelRequest::parse(
            Dialect::OpenAi,
            Bytes::from_static(
                br#"{"model":"big","max_tokens":1000,"messages":[{"role":"user","content":"hello there"}]}"#,
            ),
        )
        .expect("a request");
        let task = TaskId::new("t").expect("a task id");
        let (reservation, downgrade) = admit(
            &proxy.shared,
            &task,
            &ctx(),
            &request,
            &big,
            &mut Trail::default(),
        )
        .expect("admitted");
        assert_eq!(downgrade.as_deref(), Some("small"));
        let (tokens_in, tokens_out) = (
            request.estimated_prompt_tokens,
            request.reserve_output_tokens(),
        );
        let reserved = proxy.shared.ledger.usage("t");
        assert_eq!(
            reserved.cost_micros,
            small.price().cost(tokens_in, tokens_out)
        );
        assert!(reserved.cost_micros < big.price().cost(tokens_in, tokens_out));
        drop(reservation);
    }
}
