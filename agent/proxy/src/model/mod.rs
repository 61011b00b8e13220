//! Model calls: `POST /v1/chat/completions` (OpenAI), `POST /v1/messages`
//! (Anthropic) and `GET /v1/models`.
//!
//! A call goes: parse → budget (admit, reject or downgrade, with the estimate
//! reserved in the task's ledger) → fallback order of the candidates → the attempt
//! loop (retries and fallbacks per the retry policy) → relay. Every decision's
//! policy version is collected in a [`attempts::Trail`].

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

use outrigger_journal::{
    Journal, StreamBegin, StreamEnd, StreamKey, StreamMeta, StreamRequest, StreamState,
};

use self::attempts::{Ended, Mechanics, Plan, Success, Trail};
use self::request::ModelRequest;
use crate::body::{self, Body, BoxError, Guarded};
use crate::error::Error;
use crate::events::{Gate, Kind, Turn};
use crate::options::{Dialect, Provider};
use crate::relay::{SseRelay, StreamObserver};
use crate::resilience::Reservation;
use crate::{RequestContext, Shared, headers, keys, streams};

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
    let bytes = body::read_limited(body, shared.options.limits.max_body_bytes).await?;
    let request = ModelRequest::parse(dialect, bytes)?;
    let primary = resolve(shared, dialect, &request.model)?;
    *routed = Some(Routed {
        provider: primary.name.clone(),
    });
    let keyed = match &shared.journal {
        Some(_) => streams::key_for(&parts.headers, ctx, &request, &shared.options.streams)?,
        None => None,
    };
    let (Some(keyed), Some(journal)) = (keyed, shared.journal.clone()) else {
        return generate(shared, request, primary, parts.headers, ctx, routed, None).await;
    };

    let last_event_id = parts
        .headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(streams::parse_event_id);
    let begin = journal
        .stream_begin(
            &keyed.key,
            StreamRequest {
                fingerprint: streams::fingerprint(&request),
                task_id: ctx.task_id.clone(),
                request_id: ctx.request_id.clone(),
                provider: primary.name.clone(),
                model: request.model.clone(),
                policy_versions: Vec::new(),
            },
        )
        .await
        .map_err(Error::Journal)?;
    let attempt = match begin {
        StreamBegin::Mismatch { meta } => {
            return Err(Error::StreamKeyReused {
                key: meta.key.to_string(),
            });
        }
        StreamBegin::Existing { meta } => {
            let resp = replay(shared, &journal, &keyed, meta, &request, ctx, last_event_id).await?;
            return Ok(streams::with_key(resp, &keyed.key));
        }
        StreamBegin::New { attempt } => attempt,
    };
    let resp = generate(
        shared,
        request,
        primary,
        parts.headers,
        ctx,
        routed,
        Some((journal, keyed.key.clone(), attempt)),
    )
    .await?;
    Ok(streams::with_key(resp, &keyed.key))
}

/// Answers from an existing stream: the journal for a completed one, the live hub
/// for one still being generated in this process.
async fn replay(
    shared: &Arc<Shared>,
    journal: &Journal,
    keyed: &streams::Keyed,
    mut meta: StreamMeta,
    request: &ModelRequest,
    ctx: &RequestContext,
    last_event_id: Option<(u32, u64)>,
) -> Result<Response<Body>, Error> {
    for _ in 0..50 {
        match meta.state {
            StreamState::Completed => {
                let (attempt, after) = match last_event_id {
                    Some((a, s)) => (a, Some(s)),
                    None => (meta.attempt, None),
                };
                let events = journal
                    .stream_events(&keyed.key, attempt, after)
                    .map_err(Error::Journal)?;
                if after.is_none() {
                    streams::correlate_replay(
                        shared,
                        ctx.task_id.as_ref(),
                        request.dialect,
                        &events,
                    );
                }
                tracing::debug!(key = %keyed.key, events = events.len(), "model call answered from the journal");
                if request.stream {
                    return Ok(streams::journal_response(events, attempt));
                }
                let body = events
                    .into_iter()
                    .next()
                    .map(|(_, b)| b)
                    .unwrap_or_default();
                let mut resp = Response::new(body::full(body));
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                );
                resp.headers_mut()
                    .insert(headers::REPLAYED, http::HeaderValue::from_static("true"));
                return Ok(resp);
            }
            StreamState::Open => {
                if let Some(live) = shared.streams.get(&keyed.key) {
                    if !request.stream {
                        return Err(Error::StreamInProgress {
                            key: keyed.key.to_string(),
                        });
                    }
                    let from = match last_event_id {
                        Some((a, s)) if a == live.attempt => {
                            usize::try_from(s + 1).unwrap_or(usize::MAX)
                        }
                        Some(_) => return Ok(streams::nothing_more()),
                        None => 0,
                    };
                    return Ok(streams::live_response(&live, from, true));
                }
            }
            StreamState::Failed | StreamState::Abandoned => {
                return Ok(streams::nothing_more());
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
async fn generate(
    shared: &Arc<Shared>,
    mut request: ModelRequest,
    mut primary: &Provider,
    agent_headers: http::HeaderMap,
    ctx: &RequestContext,
    routed: &mut Option<Routed>,
    journaled: Option<(Journal, StreamKey, u32)>,
) -> Result<Response<Body>, Error> {
    let dialect = request.dialect;
    let mut trail = Trail::default();
    let reservation = match &ctx.task_id {
        Some(task) if !shared.options.budget.limits.is_unlimited() => {
            let admitted = admit(shared, task, ctx, &request, primary, &mut trail);
            let (reservation, downgrade) = match admitted {
                Ok(a) => a,
                Err(e) => {
                    end_failed(&journaled, &e.to_string()).await;
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
        estimated_tokens: request.estimated_prompt_tokens + request.reserve_output_tokens(),
    };
    let mech = Mechanics {
        transport: &shared.upstream,
        decider: shared.decider.as_ref(),
        breakers: &shared.breakers,
        limiters: &shared.limiters,
        budgets: &shared.retry_budgets,
        first_byte_timeout: shared.options.limits.first_byte_timeout,
        max_event_bytes: shared.options.limits.max_event_bytes,
    };
    match attempts::run(&mech, &plan, &mut trail).await {
        Ok(success) => {
            *routed = Some(Routed {
                provider: success.provider.name.clone(),
            });
            match journaled {
                Some((journal, key, attempt)) => {
                    produce(
                        shared,
                        success,
                        ctx.task_id.as_ref(),
                        reservation,
                        journal,
                        key,
                        attempt,
                    )
                    .await
                }
                None => Ok(relay(shared, success, ctx.task_id.as_ref(), reservation)),
            }
        }
        Err(Ended::Answer {
            provider,
            mut parts,
            body,
            ..
        }) => {
            *routed = Some(Routed {
                provider: provider.name.clone(),
            });
            end_failed(&journaled, &format!("upstream answered {}", parts.status)).await;
            // A faithful pass-through of the last answer, scrubbed of the key.
            headers::strip_hop_by_hop(&mut parts.headers);
            parts.headers.remove(header::CONTENT_LENGTH);
            Ok(Response::from_parts(
                parts,
                body::full(scrub(body, provider)),
            ))
        }
        Err(Ended::Error {
            provider, error, ..
        }) => {
            if let Some(p) = provider {
                *routed = Some(Routed {
                    provider: p.name.clone(),
                });
            }
            end_failed(&journaled, &error.to_string()).await;
            Err(error)
        }
    }
}

/// Records that a journaled call produced no stream (so a retry starts afresh).
async fn end_failed(journaled: &Option<(Journal, StreamKey, u32)>, reason: &str) {
    if let Some((journal, key, attempt)) = journaled
        && let Err(e) = journal
            .stream_end(
                key,
                *attempt,
                StreamEnd::Failed {
                    reason: reason.to_string(),
                },
            )
            .await
    {
        tracing::warn!(%key, error = %e, "could not record a failed model call");
    }
}

/// Journals a successful attempt: a stream through the producer, a plain body whole.
async fn produce(
    shared: &Arc<Shared>,
    success: Success<'_, Incoming>,
    task: Option<&TaskId>,
    reservation: Option<Reservation>,
    journal: Journal,
    key: StreamKey,
    attempt: u32,
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
    let price = (provider.caps.price_in, provider.caps.price_out);
    let Some(framer) = framer else {
        // A plain answer: journal it whole, durably, before it is released.
        let bytes = body::read_limited(body, shared.options.limits.max_body_bytes)
            .await
            .map_err(|e| Error::StreamBroke {
                target: provider.name.clone(),
                detail: e.to_string(),
            })?;
        drop(permit);
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        if let Some(task) = task {
            shared.correlator.record(task, keys::calls_in_response(&v));
        }
        let usage = plain_usage(&v);
        if let (Some(r), Some((i, o))) = (reservation, usage) {
            r.settle(&actual(price, i, o));
        }
        journal
            .stream_append(&key, attempt, 0, bytes.clone(), true)
            .await
            .map_err(Error::Journal)?;
        journal
            .stream_end(
                &key,
                attempt,
                StreamEnd::Completed {
                    usage: v["usage"].clone(),
                },
            )
            .await
            .map_err(Error::Journal)?;
        parts.headers.remove(header::CONTENT_LENGTH);
        return Ok(Response::from_parts(parts, body::full(bytes)));
    };
    let live = streams::Live::new_for(&key, attempt, provider.dialect, &shared.options.streams);
    let task = task.cloned();
    let shared2 = shared.clone();
    let mut reservation = reservation;
    let on_end = Box::new(move |gate: &Gate, _ended: streams::Ended| {
        if let Some(task) = &task {
            shared2.correlator.record(task, gate.turn.completed_calls());
        }
        match (reservation.take(), gate.turn.usage) {
            (Some(r), Some(u)) => r.settle(&actual(price, u.input, u.output)),
            (Some(r), None) => r.settle_estimate(),
            (None, _) => {}
        }
    });
    let production = streams::Production {
        shared: shared.clone(),
        journal,
        live: live.clone(),
        gate: Gate::new(provider.dialect),
        framer,
        first_events,
        on_end,
        permit,
    };
    streams::spawn(shared, live.clone(), production, body);
    let mut resp = streams::live_response(&live, 0, false);
    *resp.status_mut() = parts.status;
    Ok(resp)
}

fn plain_usage(v: &serde_json::Value) -> Option<(u64, u64)> {
    let usage = &v["usage"];
    let i = usage["prompt_tokens"]
        .as_u64()
        .or_else(|| usage["input_tokens"].as_u64())?;
    let o = usage["completion_tokens"]
        .as_u64()
        .or_else(|| usage["output_tokens"].as_u64())?;
    Some((i, o))
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
        cost_micros: cost(primary, tokens_in, tokens_out),
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
    let (reservation, decided) = shared.ledger.reserve_if(task.as_str(), estimate, |usage| {
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
        let admitted = !matches!(decided.value, BudgetDecision::Reject(_));
        (admitted, decided)
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

/// Micro-dollars for a call at `p`'s prices.
pub fn cost(p: &Provider, tokens_in: u64, tokens_out: u64) -> u64 {
    (u128::from(tokens_in) * u128::from(p.caps.price_in) / 1_000_000
        + u128::from(tokens_out) * u128::from(p.caps.price_out) / 1_000_000) as u64
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
            provider: p.name.clone(),
            model: model_for(p, primary, request).to_string(),
            supports_tools: p.caps.supports_tools,
            supports_streaming: p.caps.supports_streaming,
            context_window: p.caps.context_window,
            modalities: p.caps.modalities.clone(),
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
        modalities: request.modalities.clone(),
        candidates,
    });
    trail.policy_versions.push(decided.version.clone());
    decided
        .value
        .iter()
        .filter_map(|name| targets.iter().find(|p| &p.name == name).copied())
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
    success: Success<'_, Incoming>,
    task: Option<&TaskId>,
    reservation: Option<Reservation>,
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
    let body: Body = match framer {
        Some(framer) => {
            let observer = task.map(|task| TurnObserver {
                turn: Turn::new(provider.dialect),
                task: task.clone(),
                shared: shared.clone(),
                reservation,
                price: (provider.caps.price_in, provider.caps.price_out),
            });
            match observer {
                Some(o) => SseRelay::resume(body, framer, first_events, o)
                    .gated(provider.dialect)
                    .boxed_unsync(),
                None => SseRelay::resume(body, framer, first_events, ())
                    .gated(provider.dialect)
                    .boxed_unsync(),
            }
        }
        None if task.is_some() => {
            // Plain responses stream through; a bounded copy is parsed at the end to
            // learn the tool calls the model issued (key derivation) and its usage.
            let task = task.cloned();
            let shared = shared.clone();
            let limit = shared.options.limits.max_body_bytes;
            let price = (provider.caps.price_in, provider.caps.price_out);
            let mut reservation = reservation;
            body::Tee::new(body, limit, move |bytes: &[u8]| {
                let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) else {
                    return;
                };
                if let Some(task) = &task {
                    shared.correlator.record(task, keys::calls_in_response(&v));
                }
                let usage = &v["usage"];
                let tokens_in = usage["prompt_tokens"]
                    .as_u64()
                    .or_else(|| usage["input_tokens"].as_u64());
                let tokens_out = usage["completion_tokens"]
                    .as_u64()
                    .or_else(|| usage["output_tokens"].as_u64());
                if let (Some(r), Some(i), Some(o)) = (reservation.take(), tokens_in, tokens_out) {
                    r.settle(&actual(price, i, o));
                }
            })
            .boxed_unsync()
        }
        None => body.map_err(BoxError::from).boxed_unsync(),
    };
    Response::from_parts(parts, Guarded::new(body, permit).boxed_unsync())
}

fn actual(price: (u64, u64), tokens_in: u64, tokens_out: u64) -> Usage {
    Usage {
        tokens_in,
        tokens_out,
        cost_micros: (u128::from(tokens_in) * u128::from(price.0) / 1_000_000
            + u128::from(tokens_out) * u128::from(price.1) / 1_000_000) as u64,
        calls: 1,
        ..Usage::default()
    }
}

fn scrub(bytes: Bytes, provider: &Provider) -> Bytes {
    let Some(key) = provider.api_key.as_ref().map(|k| k.expose()) else {
        return bytes;
    };
    if key.is_empty() || !bytes.windows(key.len()).any(|w| w == key.as_bytes()) {
        return bytes;
    }
    let text = String::from_utf8_lossy(&bytes).replace(key, "<redacted>");
    Bytes::from(text)
}

/// Follows a streamed turn for a task: records the tool calls it completes (key
/// derivation) and settles the budget reservation on the reported usage.
struct TurnObserver {
    turn: Turn,
    task: TaskId,
    shared: Arc<Shared>,
    reservation: Option<Reservation>,
    price: (u64, u64),
}

impl StreamObserver for TurnObserver {
    fn on_event(&mut self, raw: &Bytes, _at: Instant) {
        if let Kind::ToolComplete(_) = self.turn.observe(raw) {
            self.shared
                .correlator
                .record(&self.task, self.turn.completed_calls());
        }
    }

    fn on_end(&mut self, _outcome: Result<(), &str>) {
        match (self.reservation.take(), self.turn.usage) {
            (Some(r), Some(u)) => r.settle(&actual(self.price, u.input, u.output)),
            // Without reported usage (an interrupted stream) the estimate is charged: a
            // budget errs on the side of what may have been spent.
            (Some(r), None) => r.settle_estimate(),
            (None, _) => {}
        }
    }
}

/// Keeps `guard` alive for as long as the response body is being sent.
pub fn guard_body<G: Send + Unpin + 'static>(resp: Response<Body>, guard: G) -> Response<Body> {
    let (parts, body) = resp.into_parts();
    Response::from_parts(parts, Guarded::new(body, guard).boxed_unsync())
}
