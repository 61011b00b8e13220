//! SLOs and error budgets: config validation, the one cause classifier, and the
//! accumulator behind `GET /v1/slo` and `outrigger_slo_events_total`.
//!
//! Every unit of work (a model call, a tool call, an ended task) is classified once,
//! by [`classify`], into good, bad with exactly one [`Cause`], or excluded. Each SLO
//! then judges the event by its own metric (a TTFT SLO charges a slow first chunk
//! even when the call succeeded) and counts it in five-minute buckets. Because bad
//! events carry one cause and every cause shares the SLO's denominator, the per-cause
//! burn rates add up to the total burn.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outrigger_types::{Cause, Exclusion, Failure, Outcome};
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::error::SloProblem;
use crate::labels::{Label, TraceId};
use crate::metrics::{Metrics, SloLabels};

/// Width of one counting bucket. Burn-rate windows are whole buckets, so a "1h" rate
/// covers between 60 and 65 minutes.
pub const BUCKET: Duration = Duration::from_secs(300);
/// The burn-rate windows reported besides the SLO's own window.
pub const BURN_WINDOWS: [(&str, Duration); 4] = [
    ("1h", Duration::from_secs(3600)),
    ("6h", Duration::from_secs(6 * 3600)),
    ("1d", Duration::from_secs(24 * 3600)),
    ("3d", Duration::from_secs(3 * 24 * 3600)),
];
const MIN_WINDOW: Duration = Duration::from_secs(3600);
const MAX_WINDOW: Duration = Duration::from_secs(400 * 24 * 3600);
/// No maintenance window is open.
const NO_MAINTENANCE: u64 = 0;
/// The maintenance window lasts until it is closed.
const OPEN_ENDED: u64 = u64::MAX;
/// The kv namespace the bucket counts persist under.
pub const STORE_NAMESPACE: &str = "slo";

// ---------------------------------------------------------------------------------
// Classification.

/// What went wrong with a unit of work, as the data plane knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failed {
    /// The agent's request was invalid: 400, 404 (unknown model), 413, 422, context
    /// overflow, a malformed body.
    InvalidRequest,
    /// A policy refused the call on the agent's account (budget exceeded, a denied
    /// tool): counted with invalid client traffic.
    PolicyDenied,
    /// The sidecar itself failed: an internal error, a config problem, the journal
    /// unavailable, the provider refusing the sidecar's own credentials.
    Internal,
    /// The sidecar refused for lack of capacity (concurrency limit, queue timeout,
    /// draining, breaker open).
    Admission,
    /// The upstream said 429 (quota or rate limit).
    RateLimited,
    /// Connect refused or timed out, DNS, TLS, a reset or EOF with no HTTP status.
    Transport,
    /// A deadline passed with the connection established (first byte, idle stream).
    Timeout,
    /// The upstream answered with a failure status (5xx, 529, other non-success).
    UpstreamStatus(u16),
    /// An error event inside the stream, or a malformed stream.
    UpstreamStream,
    /// Nothing above fits.
    Unclassified,
}

impl Failed {
    /// The failure a retry policy saw (`outrigger_types::Failure`).
    pub fn from_failure(failure: &Failure) -> Self {
        match failure {
            Failure::RateLimited { .. } => Self::RateLimited,
            Failure::ServerError { status } => Self::UpstreamStatus(*status),
            Failure::Timeout => Self::Timeout,
            Failure::Connect { .. } => Self::Transport,
            // A stream that broke after it started without an error event: the
            // transport went away under it.
            Failure::StreamInterrupted { .. } => Self::Transport,
            Failure::ContextOverflow => Self::InvalidRequest,
            Failure::ContentFiltered | Failure::ToolParseError => Self::UpstreamStream,
        }
    }

    /// A non-success status a provider answered with (a tool's: [`Failed::of_tool_status`]).
    pub fn from_upstream_status(status: u16) -> Self {
        match status {
            429 => Self::RateLimited,
            408 => Self::Timeout,
            // The sidecar holds the credentials: a refused key is its configuration.
            401 | 403 => Self::Internal,
            400 | 404 | 413 | 422 => Self::InvalidRequest,
            500..=599 => Self::UpstreamStatus(status),
            _ => Self::Unclassified,
        }
    }

    /// What a tool's answer with `status` means, `None` when the tool did what it
    /// was asked (2xx, or a 1xx/3xx the proxy passed on). A tool holds the agent's
    /// own credentials and answers the agent's own request, so a 4xx other than 408
    /// and 429 is the tool refusing that request: invalid client traffic, like the
    /// agent's invalid requests to a model.
    pub fn of_tool_status(status: u16) -> Option<Self> {
        match status {
            0..=399 => None,
            429 => Some(Self::RateLimited),
            408 => Some(Self::Timeout),
            400..=499 => Some(Self::InvalidRequest),
            500..=599 => Some(Self::UpstreamStatus(status)),
            _ => Some(Self::Unclassified),
        }
    }
}

/// Everything [`classify`] looks at.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Signals {
    /// `None`: the work completed.
    pub failure: Option<Failed>,
    /// A local GPU serving the call was unhealthy at some point during it.
    pub gpu_unhealthy: bool,
    /// The agent went away before the work finished.
    pub client_cancelled: bool,
    /// Drill or probe traffic (marked by its sender).
    pub synthetic: bool,
    /// A declared maintenance window is open ([`Slos::maintenance_active`]).
    pub maintenance: bool,
}

impl Signals {
    /// The cause charged when the work succeeded but too slowly for a latency SLO.
    pub fn latency_cause(&self) -> Cause {
        if self.gpu_unhealthy {
            Cause::Hardware
        } else {
            Cause::UpstreamModel
        }
    }
}

/// The SLO outcome of one unit of work. First match wins:
///
/// 1. synthetic traffic → excluded (`synthetic`)
/// 2. inside a maintenance window → excluded (`maintenance`)
/// 3. completed, not cancelled → good
/// 4. the agent cancelled → excluded (`client_cancelled`)
/// 5. invalid request or policy denial → excluded (`invalid_client`)
/// 6. a local GPU was unhealthy during the work → bad, `hardware`
/// 7. the sidecar failed → bad, `release`
/// 8. admission reject or upstream 429 → bad, `capacity`
/// 9. transport failure with no HTTP status → bad, `network`
/// 10. upstream failure status, error event, malformed stream, deadline with the
///     connection up → bad, `upstream_model`
/// 11. anything else → bad, `unknown`
pub fn classify(signals: &Signals) -> Outcome {
    if signals.synthetic {
        return Outcome::Excluded(Exclusion::Synthetic);
    }
    if signals.maintenance {
        return Outcome::Excluded(Exclusion::Maintenance);
    }
    let Some(failure) = signals.failure else {
        return if signals.client_cancelled {
            Outcome::Excluded(Exclusion::ClientCancelled)
        } else {
            Outcome::Good
        };
    };
    if signals.client_cancelled {
        return Outcome::Excluded(Exclusion::ClientCancelled);
    }
    if matches!(failure, Failed::InvalidRequest | Failed::PolicyDenied) {
        return Outcome::Excluded(Exclusion::InvalidClient);
    }
    if signals.gpu_unhealthy {
        return Outcome::Bad(Cause::Hardware);
    }
    Outcome::Bad(match failure {
        Failed::Internal => Cause::Release,
        Failed::Admission | Failed::RateLimited => Cause::Capacity,
        Failed::Transport => Cause::Network,
        Failed::Timeout | Failed::UpstreamStatus(_) | Failed::UpstreamStream => {
            Cause::UpstreamModel
        }
        Failed::Unclassified | Failed::InvalidRequest | Failed::PolicyDenied => Cause::Unknown,
    })
}

// ---------------------------------------------------------------------------------
// Configuration.

/// An `[[slos]]` entry as written. Every part is optional here so that validation
/// can name each missing one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloSpec {
    pub name: Option<String>,
    /// What is measured: `model_calls`, `tool_calls` or `tasks`, optionally narrowed
    /// with `:<name>` (a provider or model for model calls, a tool for tool calls).
    pub object: Option<String>,
    /// One of the built-in SLIs ([`Sli`]).
    pub metric: Option<String>,
    /// For latency SLIs: the bound, e.g. `"2s"`, `"150ms"`, `"30m"`.
    pub threshold: Option<String>,
    /// The good fraction aimed for, in (0, 1), e.g. `0.999`.
    pub target: Option<f64>,
    /// The rolling window, e.g. `"28d"`.
    pub window: Option<String>,
    /// Which excluded events stay out of the denominator (may be empty):
    /// `invalid_client`, `client_cancelled`, `maintenance`, `synthetic`.
    pub exclusions: Option<Vec<String>>,
    /// Where an external evaluator reads the SLI, `<kind>:<reference>`, e.g.
    /// `prometheus:outrigger_slo_events_total`.
    pub data_source: Option<String>,
}

/// What an SLO measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectKind {
    ModelCalls,
    ToolCalls,
    Tasks,
}

impl ObjectKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ModelCalls => "model_calls",
            Self::ToolCalls => "tool_calls",
            Self::Tasks => "tasks",
        }
    }
}

/// The object of an SLO: a kind of work, optionally one provider, model or tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    pub kind: ObjectKind,
    pub selector: Option<String>,
}

impl std::fmt::Display for Object {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.selector {
            Some(s) => write!(f, "{}:{s}", self.kind.as_str()),
            None => f.write_str(self.kind.as_str()),
        }
    }
}

/// The built-in SLIs. Latency SLIs carry their threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sli {
    /// Good: the call completed without error.
    Availability,
    /// Good: the first chunk came within the threshold. "p95" is the target: 95% of
    /// streamed calls within the threshold.
    TtftP95(Duration),
    /// As [`Sli::TtftP95`], at 99%.
    TtftP99(Duration),
    /// Good: the call's mean gap between chunks was within the threshold.
    InterTokenLatency(Duration),
    /// Good: the stream was not aborted (it reached its terminal event).
    AbortRate,
    /// Good: the task ended within the threshold (wall-clock, downtime included).
    TaskWallClock(Duration),
    /// Good: the tool call reached a definitive, journaled outcome.
    ToolSuccess,
    /// Good: a task that had a fault recovered (see the task tracker's rule).
    RecoverySuccess,
}

impl Sli {
    pub fn name(self) -> &'static str {
        match self {
            Self::Availability => "availability",
            Self::TtftP95(_) => "ttft_p95",
            Self::TtftP99(_) => "ttft_p99",
            Self::InterTokenLatency(_) => "inter_token_latency",
            Self::AbortRate => "abort_rate",
            Self::TaskWallClock(_) => "task_wall_clock",
            Self::ToolSuccess => "tool_success",
            Self::RecoverySuccess => "recovery_success",
        }
    }

    pub fn threshold(self) -> Option<Duration> {
        match self {
            Self::TtftP95(t)
            | Self::TtftP99(t)
            | Self::InterTokenLatency(t)
            | Self::TaskWallClock(t) => Some(t),
            Self::Availability | Self::AbortRate | Self::ToolSuccess | Self::RecoverySuccess => {
                None
            }
        }
    }

    fn kinds(self) -> &'static [ObjectKind] {
        match self {
            Self::Availability => &[ObjectKind::ModelCalls, ObjectKind::ToolCalls],
            Self::TtftP95(_) | Self::TtftP99(_) | Self::InterTokenLatency(_) | Self::AbortRate => {
                &[ObjectKind::ModelCalls]
            }
            Self::TaskWallClock(_) | Self::RecoverySuccess => &[ObjectKind::Tasks],
            Self::ToolSuccess => &[ObjectKind::ToolCalls],
        }
    }

    /// The target the metric's name fixes (the percentile SLIs).
    fn fixed_target(self) -> Option<f64> {
        match self {
            Self::TtftP95(_) => Some(0.95),
            Self::TtftP99(_) => Some(0.99),
            _ => None,
        }
    }
}

const SLI_NAMES: &str = "availability, ttft_p95, ttft_p99, inter_token_latency, abort_rate, \
                         task_wall_clock, tool_success, recovery_success";

/// A validated SLO.
#[derive(Debug, Clone, PartialEq)]
pub struct Slo {
    pub name: String,
    pub object: Object,
    pub metric: Sli,
    pub target: f64,
    pub window: Duration,
    /// The window as written, e.g. `28d`.
    pub window_text: String,
    pub exclusions: BTreeSet<Exclusion>,
    pub data_source: String,
}

impl Slo {
    /// Validates every spec, reporting every problem at once with its key path
    /// (`{prefix}[i].part`).
    pub fn from_specs(specs: &[SloSpec], prefix: &str) -> Result<Vec<Slo>, Error> {
        let mut problems = Vec::new();
        let mut slos = Vec::new();
        let mut seen = BTreeSet::new();
        for (i, spec) in specs.iter().enumerate() {
            let path = format!("{prefix}[{i}]");
            if let Some(slo) = validate(spec, &path, &mut problems) {
                if !seen.insert(slo.name.clone()) {
                    problems.push(SloProblem {
                        path: format!("{path}.name"),
                        message: format!(
                            "{:?} names another SLO too; names must be unique",
                            slo.name
                        ),
                    });
                } else {
                    slos.push(slo);
                }
            }
        }
        if problems.is_empty() {
            Ok(slos)
        } else {
            Err(Error::SloConfig(problems))
        }
    }
}

fn validate(spec: &SloSpec, path: &str, problems: &mut Vec<SloProblem>) -> Option<Slo> {
    let before = problems.len();
    let mut problem = |part: &str, message: String| {
        problems.push(SloProblem {
            path: format!("{path}.{part}"),
            message,
        });
    };
    let missing = |part: &str, example: &str| {
        format!("missing: every SLO names its {part} (e.g. {part} = {example})")
    };

    let name = match spec.name.as_deref() {
        None => {
            problem("name", missing("name", "\"llm-availability\""));
            None
        }
        Some(n)
            if n.is_empty()
                || n.len() > 64
                || !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) =>
        {
            problem(
                "name",
                format!("{n:?} must be 1-64 characters from letters, digits, - _ ."),
            );
            None
        }
        Some(n) => Some(n.to_owned()),
    };

    let object = match spec.object.as_deref() {
        None => {
            problem("object", missing("object", "\"model_calls\""));
            None
        }
        Some(raw) => {
            let (kind, selector) = match raw.split_once(':') {
                Some((k, s)) => (k, Some(s)),
                None => (raw, None),
            };
            let kind = match kind {
                "model_calls" => Some(ObjectKind::ModelCalls),
                "tool_calls" => Some(ObjectKind::ToolCalls),
                "tasks" => Some(ObjectKind::Tasks),
                _ => None,
            };
            match (kind, selector) {
                (None, _) => {
                    problem(
                        "object",
                        format!(
                            "{raw:?}: expected model_calls, tool_calls or tasks, optionally with :<name>"
                        ),
                    );
                    None
                }
                (Some(_), Some("")) => {
                    problem("object", format!("{raw:?}: the name after ':' is empty"));
                    None
                }
                (Some(ObjectKind::Tasks), Some(_)) => {
                    problem("object", "tasks cannot be narrowed by name".to_owned());
                    None
                }
                (Some(kind), selector) => Some(Object {
                    kind,
                    selector: selector.map(str::to_owned),
                }),
            }
        }
    };

    let threshold = match spec.threshold.as_deref() {
        None => None,
        Some(t) => match humantime::parse_duration(t) {
            Ok(d) if !d.is_zero() => Some(d),
            Ok(_) => {
                problem("threshold", "must be positive".to_owned());
                None
            }
            Err(e) => {
                problem(
                    "threshold",
                    format!("{t:?} is not a duration ({e}); e.g. \"2s\""),
                );
                None
            }
        },
    };
    let metric = match spec.metric.as_deref() {
        None => {
            problem("metric", missing("metric", "\"availability\""));
            None
        }
        Some(m) => {
            let with_threshold = |f: fn(Duration) -> Sli| -> Option<Sli> { threshold.map(f) };
            let parsed: Result<Option<Sli>, String> = match m {
                "availability" => Ok(Some(Sli::Availability)),
                "abort_rate" => Ok(Some(Sli::AbortRate)),
                "tool_success" => Ok(Some(Sli::ToolSuccess)),
                "recovery_success" => Ok(Some(Sli::RecoverySuccess)),
                "ttft_p95" => Ok(with_threshold(Sli::TtftP95)),
                "ttft_p99" => Ok(with_threshold(Sli::TtftP99)),
                "inter_token_latency" => Ok(with_threshold(Sli::InterTokenLatency)),
                "task_wall_clock" => Ok(with_threshold(Sli::TaskWallClock)),
                other => Err(format!(
                    "{other:?} is not a built-in SLI; expected one of {SLI_NAMES}"
                )),
            };
            match parsed {
                Err(e) => {
                    problem("metric", e);
                    None
                }
                Ok(Some(sli)) => {
                    if sli.threshold().is_none() && spec.threshold.is_some() {
                        problem("threshold", format!("{m} takes no threshold"));
                    }
                    Some(sli)
                }
                Ok(None) => {
                    if spec.threshold.is_none() {
                        problem(
                            "threshold",
                            format!("missing: {m} needs a threshold (e.g. threshold = \"2s\")"),
                        );
                    }
                    None
                }
            }
        }
    };
    if let (Some(metric), Some(object)) = (metric, &object)
        && !metric.kinds().contains(&object.kind)
    {
        let kinds: Vec<&str> = metric.kinds().iter().map(|k| k.as_str()).collect();
        problem(
            "metric",
            format!(
                "{} measures {}, not {}",
                metric.name(),
                kinds.join(" or "),
                object.kind.as_str()
            ),
        );
    }

    let target = match spec.target {
        None => {
            problem("target", missing("target", "0.999"));
            None
        }
        Some(t) if !(t > 0.0 && t < 1.0) => {
            problem(
                "target",
                format!("{t} must be strictly between 0 and 1 (0.999 is 99.9%)"),
            );
            None
        }
        Some(t) => {
            if let Some(fixed) = metric.and_then(Sli::fixed_target)
                && (t - fixed).abs() > 1e-9
            {
                problem(
                    "target",
                    format!(
                        "{} means {}% of streamed calls within the threshold: its target is {fixed}",
                        metric.map_or("", Sli::name),
                        fixed * 100.0
                    ),
                );
            }
            Some(t)
        }
    };

    let window = match spec.window.as_deref() {
        None => {
            problem("window", missing("window", "\"28d\""));
            None
        }
        Some(w) => match humantime::parse_duration(w) {
            Ok(d) if (MIN_WINDOW..=MAX_WINDOW).contains(&d) => Some((d, w.to_owned())),
            Ok(_) => {
                problem("window", format!("{w:?} must be between 1h and 400d"));
                None
            }
            Err(e) => {
                problem(
                    "window",
                    format!("{w:?} is not a duration ({e}); e.g. \"28d\""),
                );
                None
            }
        },
    };

    let exclusions = match &spec.exclusions {
        None => {
            problem(
                "exclusions",
                "missing: list the excluded events, or [] for none (invalid_client, \
                 client_cancelled, maintenance, synthetic)"
                    .to_owned(),
            );
            None
        }
        Some(list) => {
            let mut set = BTreeSet::new();
            let mut ok = true;
            for (j, raw) in list.iter().enumerate() {
                match Exclusion::ALL.iter().find(|e| e.as_str() == raw) {
                    Some(e) => {
                        set.insert(*e);
                    }
                    None => {
                        ok = false;
                        problem(
                            &format!("exclusions[{j}]"),
                            format!(
                                "{raw:?}: expected invalid_client, client_cancelled, maintenance or synthetic"
                            ),
                        );
                    }
                }
            }
            ok.then_some(set)
        }
    };

    let data_source = match spec.data_source.as_deref() {
        None => {
            problem(
                "data_source",
                missing("data_source", "\"prometheus:outrigger_slo_events_total\""),
            );
            None
        }
        Some(ds) => match ds.split_once(':') {
            Some((kind, reference))
                if matches!(kind, "prometheus" | "otlp" | "sidecar")
                    && !reference.trim().is_empty() =>
            {
                Some(ds.to_owned())
            }
            _ => {
                problem(
                    "data_source",
                    format!("{ds:?}: expected <prometheus|otlp|sidecar>:<reference>"),
                );
                None
            }
        },
    };

    if problems.len() != before {
        return None;
    }
    Some(Slo {
        name: name?,
        object: object?,
        metric: metric?,
        target: target?,
        window: window.as_ref()?.0,
        window_text: window?.1,
        exclusions: exclusions?,
        data_source: data_source?,
    })
}

// ---------------------------------------------------------------------------------
// Events and accounting.

/// One unit of work, as the SLOs see it.
#[derive(Debug, Clone, Copy)]
pub struct SloEvent<'a> {
    pub kind: ObjectKind,
    /// For model calls: the provider (target) that served it.
    pub provider: Option<&'a str>,
    /// For model calls: the model asked for.
    pub model: Option<&'a str>,
    /// For tool calls: the tool (or MCP server).
    pub tool: Option<&'a str>,
    /// [`classify`]'s verdict on the work.
    pub outcome: Outcome,
    /// The cause charged for a latency breach ([`Signals::latency_cause`]).
    pub latency_cause: Cause,
    pub stream: bool,
    pub ttft: Option<Duration>,
    /// Mean gap between chunks after the first.
    pub inter_token: Option<Duration>,
    /// Tasks: wall-clock from first call to end.
    pub wall_clock: Option<Duration>,
    /// Streams: ended without their terminal event.
    pub aborted: bool,
    /// Tool calls: the journal recorded a definitive outcome.
    pub definitive: bool,
    /// Tasks: `Some` when the task had a fault; whether it recovered.
    pub recovered: Option<bool>,
    pub at: SystemTime,
    pub trace_id: Option<TraceId>,
}

impl SloEvent<'_> {
    /// An event with nothing but its kind, outcome and time set.
    pub fn new(kind: ObjectKind, outcome: Outcome, at: SystemTime) -> Self {
        Self {
            kind,
            provider: None,
            model: None,
            tool: None,
            outcome,
            latency_cause: Cause::UpstreamModel,
            stream: false,
            ttft: None,
            inter_token: None,
            wall_clock: None,
            aborted: false,
            definitive: false,
            recovered: None,
            at,
            trace_id: None,
        }
    }
}

/// How one SLO counts one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Good,
    Bad(Cause),
    Excluded(Exclusion),
}

impl Slo {
    /// `None`: the event is not this SLO's business (other object, no such latency).
    pub fn judge(&self, event: &SloEvent<'_>) -> Option<Verdict> {
        if event.kind != self.object.kind {
            return None;
        }
        if let Some(selector) = &self.object.selector {
            let names = [event.provider, event.model, event.tool];
            if !names.iter().flatten().any(|n| n == selector) {
                return None;
            }
        }
        let failed_cause = match event.outcome {
            Outcome::Excluded(why) if self.exclusions.contains(&why) => {
                // Still only if the SLO would have judged it at all.
                return self.applies(event).then_some(Verdict::Excluded(why));
            }
            // An exclusion the SLO did not declare: the sidecar handled the event as
            // it should (refused bad input, let a leaving client go), so it is good
            // for every SLI that judges outcomes: a stream its client cancelled is
            // not an abort, a tool call the agent got wrong not a tool failure, a
            // task the agent gave up not a failed recovery. Latency SLIs still judge
            // the latency they measured.
            Outcome::Excluded(_) | Outcome::Good => None,
            Outcome::Bad(cause) => Some(cause),
        };
        let handled = matches!(event.outcome, Outcome::Excluded(_));
        let within = |value: Option<Duration>, limit: Duration| {
            value.map(|v| {
                if v <= limit {
                    Verdict::Good
                } else {
                    Verdict::Bad(event.latency_cause)
                }
            })
        };
        match self.metric {
            Sli::Availability => Some(failed_cause.map_or(Verdict::Good, Verdict::Bad)),
            Sli::TtftP95(t) | Sli::TtftP99(t) => within(event.ttft, t),
            Sli::InterTokenLatency(t) => within(event.inter_token, t),
            Sli::TaskWallClock(t) => within(event.wall_clock, t),
            Sli::AbortRate => event.stream.then(|| {
                if event.aborted && !handled {
                    Verdict::Bad(failed_cause.unwrap_or(Cause::Unknown))
                } else {
                    Verdict::Good
                }
            }),
            Sli::ToolSuccess => Some(if event.definitive || handled {
                Verdict::Good
            } else {
                Verdict::Bad(failed_cause.unwrap_or(Cause::Unknown))
            }),
            Sli::RecoverySuccess => event.recovered.map(|ok| {
                if ok || handled {
                    Verdict::Good
                } else {
                    Verdict::Bad(failed_cause.unwrap_or(Cause::Unknown))
                }
            }),
        }
    }

    fn applies(&self, event: &SloEvent<'_>) -> bool {
        match self.metric {
            Sli::Availability | Sli::ToolSuccess => true,
            Sli::TtftP95(_) | Sli::TtftP99(_) => event.ttft.is_some(),
            Sli::InterTokenLatency(_) => event.inter_token.is_some(),
            Sli::TaskWallClock(_) => event.wall_clock.is_some(),
            Sli::AbortRate => event.stream,
            Sli::RecoverySuccess => event.recovered.is_some(),
        }
    }
}

/// Counts in one bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Counts {
    good: u64,
    /// By cause, in [`Cause::ALL`] order.
    bad: [u64; 6],
    /// By reason, in [`Exclusion::ALL`] order.
    excluded: [u64; 4],
}

impl Counts {
    fn add(&mut self, other: &Counts) {
        self.good += other.good;
        for (a, b) in self.bad.iter_mut().zip(other.bad) {
            *a += b;
        }
        for (a, b) in self.excluded.iter_mut().zip(other.excluded) {
            *a += b;
        }
    }

    fn bad_total(&self) -> u64 {
        self.bad.iter().sum()
    }
}

fn cause_index(cause: Cause) -> usize {
    Cause::ALL
        .iter()
        .position(|c| *c == cause)
        .unwrap_or(Cause::ALL.len() - 1)
}

fn exclusion_index(why: Exclusion) -> usize {
    Exclusion::ALL.iter().position(|e| *e == why).unwrap_or(0)
}

fn bucket_of(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) / BUCKET.as_secs()
}

struct Tracked {
    slo: Slo,
    label: Label,
    buckets: BTreeMap<u64, Counts>,
    dirty: BTreeSet<u64>,
    /// Buckets pruned from memory that the store still holds.
    pruned: BTreeSet<u64>,
}

/// The SLOs and their counts. Cheap to share behind an `Arc`; recording takes one
/// short lock.
pub struct Slos {
    state: Mutex<Vec<Tracked>>,
    metrics: Metrics,
    /// The open maintenance window's end, in milliseconds since the epoch
    /// ([`NO_MAINTENANCE`], [`OPEN_ENDED`]).
    maintenance: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Slos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slos").finish_non_exhaustive()
    }
}

/// The burn rates over the standard windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct BurnRates {
    #[serde(rename = "1h")]
    pub h1: f64,
    #[serde(rename = "6h")]
    pub h6: f64,
    #[serde(rename = "1d")]
    pub d1: f64,
    #[serde(rename = "3d")]
    pub d3: f64,
}

/// One SLO's standing, for `GET /v1/slo`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SloReport {
    pub name: String,
    pub object: String,
    pub metric: &'static str,
    /// The latency bound, in seconds, for latency SLIs.
    pub threshold_seconds: Option<f64>,
    pub target: f64,
    pub window: String,
    pub exclusions: Vec<&'static str>,
    pub data_source: String,
    /// Counts over the SLO window.
    pub good: u64,
    pub bad: u64,
    pub excluded: u64,
    pub bad_by_cause: BTreeMap<&'static str, u64>,
    pub excluded_by_reason: BTreeMap<&'static str, u64>,
    /// good / (good + bad); `None` before the first eligible event.
    pub sli: Option<f64>,
    /// Bad events the window allows so far: (1 − target) × eligible events.
    pub budget_total: f64,
    /// 1 − bad / budget_total (negative once overspent; 1 with no events).
    pub budget_left_fraction: f64,
    /// Burn over the SLO window: (bad / eligible) / (1 − target).
    pub burn_rate: f64,
    /// The same burn split by cause; the parts add up to `burn_rate`.
    pub burn_by_cause: BTreeMap<&'static str, f64>,
    pub burn_rates: BurnRates,
}

/// Where the bucket counts persist (the app implements it over the journal's kv).
pub trait SloStore {
    /// Every stored `(key, value)` of the SLO namespace.
    fn load(&self) -> Result<Vec<(String, Vec<u8>)>, Error>;
    /// Stores (`Some`) or deletes (`None`) one key.
    fn save(
        &self,
        key: String,
        value: Option<Vec<u8>>,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// A store that keeps nothing ([`Slos::forget_old`]).
struct Nowhere;

impl SloStore for Nowhere {
    fn load(&self) -> Result<Vec<(String, Vec<u8>)>, Error> {
        Ok(Vec::new())
    }

    fn save(
        &self,
        _key: String,
        _value: Option<Vec<u8>>,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        std::future::ready(Ok(()))
    }
}

impl SloStore for outrigger_journal::Journal {
    fn load(&self) -> Result<Vec<(String, Vec<u8>)>, Error> {
        self.kv_scan(STORE_NAMESPACE)
            .map_err(|e| Error::Store(e.to_string()))
    }

    async fn save(&self, key: String, value: Option<Vec<u8>>) -> Result<(), Error> {
        let result = match value {
            Some(v) => self.kv_put(STORE_NAMESPACE, &key, v).await,
            None => self.kv_delete(STORE_NAMESPACE, &key).await,
        };
        result.map_err(|e| Error::Store(e.to_string()))
    }
}

fn store_key(slo: &str, bucket: u64) -> String {
    // Zero-padded so a scan returns a name's buckets in time order.
    format!("{slo}/{bucket:012}")
}

impl Slos {
    pub fn new(slos: Vec<Slo>, metrics: Metrics) -> Self {
        let tracked = slos
            .into_iter()
            .map(|slo| Tracked {
                label: {
                    let label = Label::new(&slo.name);
                    metrics.slo_objective(&label, slo.target);
                    label
                },
                slo,
                buckets: BTreeMap::new(),
                dirty: BTreeSet::new(),
                pruned: BTreeSet::new(),
            })
            .collect();
        Self {
            state: Mutex::new(tracked),
            metrics,
            maintenance: std::sync::atomic::AtomicU64::new(NO_MAINTENANCE),
        }
    }

    /// Opens a declared maintenance window, until `until` or, with `None`, until it
    /// is closed (feeds [`Signals::maintenance`]). Opening one replaces the last.
    pub fn open_maintenance(&self, until: Option<SystemTime>) {
        let end = until.map_or(OPEN_ENDED, |t| {
            t.duration_since(UNIX_EPOCH)
                .map_or(NO_MAINTENANCE, |d| {
                    u64::try_from(d.as_millis()).unwrap_or(OPEN_ENDED - 1)
                })
                .clamp(1, OPEN_ENDED - 1)
        });
        self.maintenance
            .store(end, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn close_maintenance(&self) {
        self.maintenance
            .store(NO_MAINTENANCE, std::sync::atomic::Ordering::Relaxed);
    }

    /// The maintenance window open at `now`: `None` when there is none, `Some(None)`
    /// when it lasts until closed, `Some(Some(end))` otherwise.
    pub fn maintenance(&self, now: SystemTime) -> Option<Option<SystemTime>> {
        match self.maintenance.load(std::sync::atomic::Ordering::Relaxed) {
            NO_MAINTENANCE => None,
            OPEN_ENDED => Some(None),
            end_ms => {
                let end = UNIX_EPOCH + Duration::from_millis(end_ms);
                (now < end).then_some(Some(end))
            }
        }
    }

    pub fn maintenance_active(&self) -> bool {
        self.maintenance(SystemTime::now()).is_some()
    }

    /// Counts `event` in every SLO it belongs to, and in
    /// `outrigger_slo_events_total` (bad events carry the trace id as exemplar).
    pub fn record(&self, event: &SloEvent<'_>) {
        let bucket = bucket_of(event.at);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        for t in state.iter_mut() {
            let Some(verdict) = t.slo.judge(event) else {
                continue;
            };
            let counts = t.buckets.entry(bucket).or_default();
            let (outcome, cause, exemplar) = match verdict {
                Verdict::Good => {
                    counts.good += 1;
                    ("good", "none", None)
                }
                Verdict::Bad(cause) => {
                    counts.bad[cause_index(cause)] += 1;
                    ("bad", cause.as_str(), event.trace_id)
                }
                Verdict::Excluded(why) => {
                    counts.excluded[exclusion_index(why)] += 1;
                    ("excluded", why.as_str(), None)
                }
            };
            t.dirty.insert(bucket);
            self.metrics.slo_event(
                &SloLabels {
                    slo: t.label.clone(),
                    outcome,
                    cause,
                },
                exemplar,
            );
        }
    }

    /// Each SLO's standing at `now`.
    pub fn report(&self, now: SystemTime) -> Vec<SloReport> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now_bucket = bucket_of(now);
        state
            .iter()
            .map(|t| {
                // The current bucket is partial: `span` whole buckets before it, so
                // a window never covers less than its length (1h: 60 to 65 minutes).
                let sum = |window: Duration| {
                    let span = window.as_secs().div_ceil(BUCKET.as_secs());
                    let from = now_bucket.saturating_sub(span);
                    let mut total = Counts::default();
                    for (_, c) in t.buckets.range(from..=now_bucket) {
                        total.add(c);
                    }
                    total
                };
                let budget = 1.0 - t.slo.target;
                let burn = |c: &Counts| {
                    let eligible = c.good + c.bad_total();
                    if eligible == 0 {
                        0.0
                    } else {
                        c.bad_total() as f64 / eligible as f64 / budget
                    }
                };
                let window = sum(t.slo.window);
                let eligible = window.good + window.bad_total();
                let bad = window.bad_total();
                let budget_total = budget * eligible as f64;
                let burn_by_cause = Cause::ALL
                    .iter()
                    .zip(window.bad)
                    .filter(|(_, n)| *n > 0)
                    .map(|(c, n)| (c.as_str(), n as f64 / eligible as f64 / budget))
                    .collect();
                let rates = BURN_WINDOWS.map(|(_, w)| burn(&sum(w)));
                SloReport {
                    name: t.slo.name.clone(),
                    object: t.slo.object.to_string(),
                    metric: t.slo.metric.name(),
                    threshold_seconds: t.slo.metric.threshold().map(|d| d.as_secs_f64()),
                    target: t.slo.target,
                    window: t.slo.window_text.clone(),
                    exclusions: t.slo.exclusions.iter().map(|e| e.as_str()).collect(),
                    data_source: t.slo.data_source.clone(),
                    good: window.good,
                    bad,
                    excluded: window.excluded.iter().sum(),
                    bad_by_cause: Cause::ALL
                        .iter()
                        .zip(window.bad)
                        .filter(|(_, n)| *n > 0)
                        .map(|(c, n)| (c.as_str(), n))
                        .collect(),
                    excluded_by_reason: Exclusion::ALL
                        .iter()
                        .zip(window.excluded)
                        .filter(|(_, n)| *n > 0)
                        .map(|(e, n)| (e.as_str(), n))
                        .collect(),
                    sli: (eligible > 0).then(|| window.good as f64 / eligible as f64),
                    budget_total,
                    budget_left_fraction: if eligible == 0 {
                        1.0
                    } else {
                        1.0 - bad as f64 / budget_total
                    },
                    burn_rate: burn(&window),
                    burn_by_cause,
                    burn_rates: BurnRates {
                        h1: rates[0],
                        h6: rates[1],
                        d1: rates[2],
                        d3: rates[3],
                    },
                }
            })
            .collect()
    }

    /// Adds the counts a previous process persisted (call once, at startup, before
    /// recording). Keys of SLOs no longer configured are ignored.
    pub fn restore<S: SloStore>(&self, store: &S) -> Result<usize, Error> {
        let entries = store.load()?;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut restored = 0;
        for (key, value) in entries {
            let Some((name, bucket)) = key.rsplit_once('/') else {
                continue;
            };
            let Ok(bucket) = bucket.parse::<u64>() else {
                continue;
            };
            let Some(t) = state.iter_mut().find(|t| t.slo.name == name) else {
                continue;
            };
            let counts: Counts =
                serde_json::from_slice(&value).map_err(|e| Error::Store(format!("{key}: {e}")))?;
            t.buckets.entry(bucket).or_default().add(&counts);
            restored += 1;
        }
        Ok(restored)
    }

    /// Drops the buckets that fell out of every window, for a sidecar that keeps its
    /// counts nowhere (no journal): without it they would pile up for as long as the
    /// process runs.
    pub async fn forget_old(&self, now: SystemTime) {
        // Nothing fails to be stored nowhere.
        let _ = self.persist(&Nowhere, now).await;
    }

    /// Writes the buckets changed since the last call and deletes those that fell out
    /// of every window. Returns how many keys were written or deleted. A failed write
    /// is retried on the next call.
    pub async fn persist<S: SloStore>(&self, store: &S, now: SystemTime) -> Result<usize, Error> {
        let now_bucket = bucket_of(now);
        let ops: Vec<(usize, u64, String, Option<Vec<u8>>)> = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let mut ops = Vec::new();
            for (i, t) in state.iter_mut().enumerate() {
                let keep = t.slo.window.max(BURN_WINDOWS[3].1);
                let oldest = now_bucket.saturating_sub(keep.as_secs().div_ceil(BUCKET.as_secs()));
                let stale: Vec<u64> = t.buckets.range(..oldest).map(|(b, _)| *b).collect();
                for b in stale {
                    t.buckets.remove(&b);
                    t.dirty.remove(&b);
                    t.pruned.insert(b);
                }
                for b in std::mem::take(&mut t.pruned) {
                    ops.push((i, b, store_key(&t.slo.name, b), None));
                }
                for b in std::mem::take(&mut t.dirty) {
                    if let Some(c) = t.buckets.get(&b) {
                        let bytes =
                            serde_json::to_vec(c).map_err(|e| Error::Store(e.to_string()))?;
                        ops.push((i, b, store_key(&t.slo.name, b), Some(bytes)));
                    }
                }
            }
            ops
        };
        let mut done = 0;
        let mut first_error = None;
        for (i, bucket, key, value) in ops {
            let deleting = value.is_none();
            match store.save(key, value).await {
                Ok(()) => done += 1,
                Err(e) => {
                    let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Some(t) = state.get_mut(i) {
                        if deleting {
                            t.pruned.insert(bucket);
                        } else {
                            t.dirty.insert(bucket);
                        }
                    }
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// The configured SLOs' names, in order.
    pub fn names(&self) -> Vec<String> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.iter().map(|t| t.slo.name.clone()).collect()
    }
}

#[cfg(test)]
mod tests;
