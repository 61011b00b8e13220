//! The data plane: what the agent talks to instead of its providers and tools.
//!
//! A request flows one way: listener → route → interception (model | tool) →
//! policy decision → upstream → journal → response. This crate owns that path and
//! the mechanics policies steer (retry loop, breakers, limiter, budget ledger); it
//! asks for decisions through its own [`Decider`](crate) port and never names the
//! WebAssembly host, so its tests never compile wasmtime.
//!
//! Invariants kept here:
//! - the agent's credentials are never forwarded to a provider (tools, the agent's
//!   own services, get them; the journal never does), and the provider's key is only
//!   sent to that provider's configured host (it is injected from
//!   [`options::Secret`], whose `Debug` is redacted, and scrubbed from every byte the
//!   provider answers);
//! - a streamed response is relayed event by event as it arrives, never buffered
//!   whole;
//! - every error the sidecar produces itself is an RFC 9457 problem document.

pub mod body;
mod canonical;
pub mod decider;
mod detach;
mod error;
pub mod events;
pub mod faults;
pub mod headers;
mod journaled;
pub mod keys;
mod mcp;
mod model;
mod observe;
pub mod options;
pub mod problem;
pub mod redact;
pub mod relay;
pub mod resilience;
pub mod server;
pub mod sse;
mod stitch;
pub mod streams;
pub mod tasks;
#[cfg(test)]
mod test_journal;
mod tools;
pub mod upstream;
pub mod upstream_body;
pub mod workers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::{HeaderValue, Method, Request, Response};
use hyper::body::Incoming;
use outrigger_telemetry::{HttpLabels, Metrics, RouteLabel};
use outrigger_types::{RequestId, TaskId};
use tracing::Instrument;

pub use error::Error;
pub use options::Options;

use crate::body::Body;
use crate::options::Dialect;

/// State shared by every request.
pub(crate) struct Shared {
    pub options: Options,
    pub upstream: upstream::Upstream,
    pub metrics: Metrics,
    /// `None` when the journal could not be opened: journaled calls then fail closed.
    pub journal: Option<outrigger_journal::Journal>,
    pub correlator: keys::Correlator,
    pub decider: Arc<dyn decider::Decider>,
    pub breakers: resilience::Breakers,
    pub limiters: resilience::Limiters,
    pub retry_budgets: resilience::RetryBudgets,
    pub ledger: resilience::Ledger,
    /// The node's GPU health, pushed by the binary's GPU monitor.
    pub gpu: arc_swap::ArcSwap<outrigger_types::GpuSummary>,
    /// How many times the GPUs turned unhealthy: a call that sees it change was
    /// served while they were, even if they recovered before it ended.
    pub gpu_unhealthy_spells: std::sync::atomic::AtomicU64,
    /// Generations running in this process, by stream key.
    pub streams: streams::Registry,
    /// Tasks by `Outrigger-Task-Id` (`None` without a journal to keep them in).
    pub tasks: Option<tasks::Tasks>,
    pub slos: Arc<outrigger_telemetry::slo::Slos>,
    pub faults: Arc<faults::Injector>,
    /// Tool calls and model calls going on after their agents went away.
    pub detached: detach::Detached,
}

/// What the binary plugs into the data plane.
pub struct Components {
    pub metrics: Metrics,
    pub journal: Option<outrigger_journal::Journal>,
    pub decider: Arc<dyn decider::Decider>,
    pub tasks: Option<tasks::Tasks>,
    pub slos: Arc<outrigger_telemetry::slo::Slos>,
    /// Faults injected on purpose (none unless configured).
    pub faults: Arc<faults::Injector>,
}

impl Components {
    /// The minimum: no policies (built-in behaviour), no task tracking, no SLOs.
    pub fn new(metrics: Metrics, journal: Option<outrigger_journal::Journal>) -> Self {
        Self {
            slos: Arc::new(outrigger_telemetry::slo::Slos::new(
                Vec::new(),
                metrics.clone(),
            )),
            faults: Arc::new(faults::Injector::new(metrics.clone())),
            metrics,
            journal,
            decider: Arc::new(decider::NoPolicy),
            tasks: None,
        }
    }
}

/// The data plane. Cheap to clone; one per process.
#[derive(Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy").finish_non_exhaustive()
    }
}

/// Per-request facts every handler and log line carries.
#[derive(Debug, Clone)]
pub struct RequestContext {
    pub request_id: RequestId,
    pub task_id: Option<TaskId>,
    pub peer: SocketAddr,
    /// `Outrigger-Synthetic: true`: drill or probe traffic, left out of the SLOs.
    pub synthetic: bool,
}

impl Proxy {
    pub fn new(options: Options, components: Components) -> Self {
        let upstream = upstream::Upstream::new(options.limits.connect_timeout);
        let r = options.resilience;
        // Tasks loaded from the store keep what they had spent: their budget does
        // not start over with the process.
        let ledger = resilience::Ledger::default();
        if let Some(tasks) = &components.tasks {
            for (task, spent, age) in tasks.spent(std::time::SystemTime::now()) {
                ledger.seed(task.as_str(), &spent, age);
            }
        }
        Self {
            shared: Arc::new(Shared {
                upstream,
                metrics: components.metrics,
                journal: components.journal,
                correlator: keys::Correlator::default(),
                decider: components.decider,
                breakers: resilience::Breakers::new(r.breaker),
                limiters: resilience::Limiters::new(r.limiter),
                retry_budgets: resilience::RetryBudgets::new(r.retry_budget),
                ledger,
                gpu: arc_swap::ArcSwap::from_pointee(outrigger_types::GpuSummary::default()),
                gpu_unhealthy_spells: std::sync::atomic::AtomicU64::new(0),
                streams: streams::Registry::default(),
                tasks: components.tasks,
                slos: components.slos,
                faults: components.faults,
                detached: detach::Detached::default(),
                options,
            }),
        }
    }

    /// Resolves once no tool call is going on without its agent (see
    /// `journaled`): a drain waits for it, so such calls end journaled.
    pub fn detached_calls_settled(&self) -> impl Future<Output = ()> + Send + 'static {
        self.shared.detached.clone().settled()
    }

    /// Updates the GPU health the data plane sees (fallback input, hardware cause).
    /// Called by one feeder, in order.
    pub fn set_gpu(&self, summary: outrigger_types::GpuSummary) {
        let unhealthy = outrigger_types::GpuState::Unhealthy;
        if summary.state == unhealthy && self.shared.gpu.load().state != unhealthy {
            self.shared
                .gpu_unhealthy_spells
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        }
        self.shared.gpu.store(Arc::new(summary));
    }

    /// Handles one data-plane request.
    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let started = Instant::now();
        let request_id = RequestId::from_generated(ulid::Ulid::new().to_string());
        let route = route_of(req.uri().path());
        let inflight = self.shared.metrics.inflight(route);
        let mut target = String::from("-");
        let mut call = None;

        let result = match parse_task_id(&req).and_then(|t| Ok((t, parse_synthetic(&req)?))) {
            Err(e) => Err(e),
            Ok((task_id, synthetic)) => {
                // Held with the response body: the task has a call under way until
                // its body is done, a stream's last byte included.
                call = match (&self.shared.tasks, &task_id) {
                    (Some(tasks), Some(t)) => Some(tasks.arrived(
                        t,
                        request_id.as_str(),
                        synthetic,
                        std::time::SystemTime::now(),
                    )),
                    _ => None,
                };
                let ctx = RequestContext {
                    request_id: request_id.clone(),
                    task_id,
                    peer,
                    synthetic,
                };
                self.dispatch(req, route, &ctx, &mut target).await
            }
        };
        let mut resp = match result {
            Ok(resp) => resp,
            Err(e) => {
                tracing::debug!(request_id = %request_id, error = %e, "request refused");
                e.to_problem().into_response()
            }
        };
        if let Ok(v) = HeaderValue::from_str(request_id.as_str()) {
            resp.headers_mut().insert(headers::REQUEST_ID, v);
        }
        self.shared.metrics.request(
            HttpLabels {
                route,
                target,
                status: resp.status().as_u16(),
            },
            started.elapsed().as_secs_f64(),
        );
        model::guard_body(resp, (inflight, call))
    }

    async fn dispatch(
        &self,
        req: Request<Incoming>,
        route: RouteLabel,
        ctx: &RequestContext,
        target: &mut String,
    ) -> Result<Response<Body>, Error> {
        let method = req.method().clone();
        match route {
            RouteLabel::ChatCompletions | RouteLabel::Messages => {
                if method != Method::POST {
                    return Err(Error::MethodNotAllowed {
                        method: method.to_string(),
                        allowed: "POST",
                    });
                }
                let dialect = if route == RouteLabel::ChatCompletions {
                    Dialect::OpenAi
                } else {
                    Dialect::Anthropic
                };
                let mut routed = None;
                let result = model::call(&self.shared, req, dialect, ctx, &mut routed).await;
                if let Some(r) = routed {
                    *target = r.provider;
                }
                result
            }
            RouteLabel::Models => {
                if method != Method::GET {
                    return Err(Error::MethodNotAllowed {
                        method: method.to_string(),
                        allowed: "GET",
                    });
                }
                Ok(model::list(&self.shared, req.headers()).await)
            }
            RouteLabel::Tools => {
                let span = tracing::debug_span!(
                    "execute_tool",
                    request_id = %ctx.request_id,
                    task_id = ctx.task_id.as_ref().map(|t| t.as_str()).unwrap_or(""),
                );
                tools::call(&self.shared, req, ctx, target)
                    .instrument(span)
                    .await
            }
            RouteLabel::Mcp => {
                let span = tracing::debug_span!(
                    "mcp",
                    request_id = %ctx.request_id,
                    task_id = ctx.task_id.as_ref().map(|t| t.as_str()).unwrap_or(""),
                );
                mcp::call(&self.shared, req, ctx, target)
                    .instrument(span)
                    .await
            }
            RouteLabel::Streams => streams::endpoint(&self.shared, req).await,
            RouteLabel::Other => Err(Error::NotFound {
                path: req.uri().path().to_string(),
            }),
        }
    }
}

fn route_of(path: &str) -> RouteLabel {
    match path {
        "/v1/chat/completions" => RouteLabel::ChatCompletions,
        "/v1/messages" => RouteLabel::Messages,
        "/v1/models" => RouteLabel::Models,
        p if p.starts_with("/tools/") => RouteLabel::Tools,
        p if p.starts_with("/mcp/") => RouteLabel::Mcp,
        p if p.starts_with("/v1/streams/") => RouteLabel::Streams,
        _ => RouteLabel::Other,
    }
}

/// `Outrigger-Synthetic`: `true` or `false` (any case); absent is `false`.
fn parse_synthetic<B>(req: &Request<B>) -> Result<bool, Error> {
    let Some(v) = req.headers().get(headers::SYNTHETIC) else {
        return Ok(false);
    };
    match v.as_bytes() {
        v if v.eq_ignore_ascii_case(b"true") => Ok(true),
        v if v.eq_ignore_ascii_case(b"false") => Ok(false),
        _ => Err(Error::BadHeader {
            header: "Outrigger-Synthetic",
            detail: "send true or false".into(),
        }),
    }
}

fn parse_task_id<B>(req: &Request<B>) -> Result<Option<TaskId>, Error> {
    let Some(v) = req.headers().get(headers::TASK_ID) else {
        return Ok(None);
    };
    let s = v.to_str().map_err(|_| Error::BadHeader {
        header: "Outrigger-Task-Id",
        detail: "it is not visible ASCII".into(),
    })?;
    TaskId::new(s).map(Some).map_err(|e| Error::BadHeader {
        header: "Outrigger-Task-Id",
        detail: e.to_string(),
    })
}
