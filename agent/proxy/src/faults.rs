//! Fault injection inside the sidecar, the way Envoy's fault filter works: for a share
//! of the calls to one provider or tool, answer 429 (with `Retry-After`) or 5xx
//! without sending, delay the send, cut a stream after N events, or let a tool call
//! reach the tool and then lose its answer (timeout, or a reset after the effect).
//!
//! Off by default and loud when on: every change is logged at WARN, the active set is
//! on `GET /v1/faults`, and each injection is counted in
//! `outrigger_faults_injected_total`. Injected faults go through the same machinery
//! as real ones (classification, retry policy, breaker, limiter, journal), which is
//! what a drill needs: the point is to watch the real recovery paths work.
//!
//! With no faults set the data plane pays one relaxed atomic load per call.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};

use crate::options::Options;

/// A fault as written in config (`[[faults]]`) or posted to `/v1/faults`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// A provider name, or `*` for every provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// A tool or MCP server name, or `*` for every tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// `rate_limit`, `server_error`, `delay`, `stream_cut` (providers), `tool_timeout`,
    /// `tool_reset_after_effect` (tools).
    #[serde(default)]
    pub kind: String,
    /// The share of calls hit, in percent (0 < percent ≤ 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<f64>,
    /// `rate_limit`: the `Retry-After` sent (default `1s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
    /// `server_error`: the status, 500–599 (default 503).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// `delay`: how long the send is held back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay: Option<String>,
    /// `stream_cut`: events relayed before the cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_events: Option<u32>,
}

/// A validated fault.
#[derive(Debug, Clone, PartialEq)]
pub struct Fault {
    pub target: Target,
    pub kind: Kind,
    /// In (0, 1].
    pub share: f64,
    /// As written, for `GET /v1/faults`.
    pub spec: FaultSpec,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Provider(Option<String>),
    Tool(Option<String>),
}

impl Target {
    fn label(&self) -> String {
        match self {
            Target::Provider(name) => format!("provider:{}", name.as_deref().unwrap_or("*")),
            Target::Tool(name) => format!("tool:{}", name.as_deref().unwrap_or("*")),
        }
    }

    fn hits_provider(&self, name: &str) -> bool {
        matches!(self, Target::Provider(n) if n.as_deref().is_none_or(|n| n == name))
    }

    fn hits_tool(&self, name: &str) -> bool {
        matches!(self, Target::Tool(n) if n.as_deref().is_none_or(|n| n == name))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    RateLimit { retry_after: Duration },
    ServerError { status: u16 },
    Delay { delay: Duration },
    StreamCut { after_events: u32 },
    ToolTimeout,
    ToolResetAfterEffect,
}

impl Kind {
    pub fn as_str(&self) -> &'static str {
        match self {
            Kind::RateLimit { .. } => "rate_limit",
            Kind::ServerError { .. } => "server_error",
            Kind::Delay { .. } => "delay",
            Kind::StreamCut { .. } => "stream_cut",
            Kind::ToolTimeout => "tool_timeout",
            Kind::ToolResetAfterEffect => "tool_reset_after_effect",
        }
    }
}

/// One thing wrong with a fault spec, with its path (`faults[2].percent`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

const PROVIDER_KINDS: &str = "rate_limit, server_error, delay, stream_cut";
const TOOL_KINDS: &str = "rate_limit, server_error, delay, tool_timeout, tool_reset_after_effect";

impl Fault {
    /// Validates every spec against the configured providers and tools, reporting
    /// every problem at once (`{prefix}[i].field`).
    pub fn from_specs(
        specs: &[FaultSpec],
        options: &Options,
        prefix: &str,
    ) -> Result<Vec<Fault>, Vec<Problem>> {
        let mut problems = Vec::new();
        let faults: Vec<Fault> = specs
            .iter()
            .enumerate()
            .filter_map(|(i, spec)| {
                validate(spec, options, &format!("{prefix}[{i}]"), &mut problems)
            })
            .collect();
        if problems.is_empty() {
            Ok(faults)
        } else {
            Err(problems)
        }
    }
}

fn validate(
    spec: &FaultSpec,
    options: &Options,
    path: &str,
    problems: &mut Vec<Problem>,
) -> Option<Fault> {
    let mut problem = |field: &str, message: String| {
        problems.push(Problem {
            path: format!("{path}.{field}"),
            message,
        });
    };
    let wildcard = |n: &str| (n != "*").then(|| n.to_owned());
    let target = match (&spec.provider, &spec.tool) {
        (Some(p), None) => {
            if p != "*" && !options.providers.iter().any(|x| &x.name == p) {
                let known: Vec<&str> = options.providers.iter().map(|x| x.name.as_str()).collect();
                problem(
                    "provider",
                    format!("no provider {p:?} is configured (known: {known:?}, or \"*\")"),
                );
            }
            Target::Provider(wildcard(p))
        }
        (None, Some(t)) => {
            if t != "*" && options.tool(t).is_none() {
                let known: Vec<&str> = options.tools.iter().map(|x| x.name.as_str()).collect();
                problem(
                    "tool",
                    format!("no tool {t:?} is configured (known: {known:?}, or \"*\")"),
                );
            }
            Target::Tool(wildcard(t))
        }
        _ => {
            problem(
                "provider",
                "name exactly one of `provider` or `tool`".into(),
            );
            return None;
        }
    };
    let share = match spec.percent {
        Some(p) if p > 0.0 && p <= 100.0 => p / 100.0,
        Some(p) => {
            problem("percent", format!("{p} is not in (0, 100]"));
            1.0
        }
        None => {
            problem(
                "percent",
                "missing: the share of calls to hit, e.g. 25".into(),
            );
            1.0
        }
    };
    let duration = |field: &str,
                    value: &Option<String>,
                    default: Option<Duration>,
                    problem: &mut dyn FnMut(&str, String)|
     -> Duration {
        match value {
            Some(s) => humantime::parse_duration(s).unwrap_or_else(|e| {
                problem(
                    field,
                    format!("{s:?} is not a duration ({e}); write e.g. \"500ms\", \"2s\""),
                );
                Duration::ZERO
            }),
            None => default.unwrap_or_else(|| {
                problem(field, "missing".into());
                Duration::ZERO
            }),
        }
    };
    let for_provider = matches!(target, Target::Provider(_));
    let kind = match spec.kind.as_str() {
        "rate_limit" => Kind::RateLimit {
            retry_after: duration(
                "retry_after",
                &spec.retry_after,
                Some(Duration::from_secs(1)),
                &mut problem,
            ),
        },
        "server_error" => {
            let status = spec.status.unwrap_or(503);
            if !(500..=599).contains(&status) {
                problem("status", format!("{status} is not a 5xx status"));
            }
            Kind::ServerError { status }
        }
        "delay" => Kind::Delay {
            delay: duration("delay", &spec.delay, None, &mut problem),
        },
        "stream_cut" if for_provider => match spec.after_events {
            Some(n) => Kind::StreamCut { after_events: n },
            None => {
                problem(
                    "after_events",
                    "missing: how many events to relay before the cut".into(),
                );
                Kind::StreamCut { after_events: 0 }
            }
        },
        "tool_timeout" if !for_provider => Kind::ToolTimeout,
        "tool_reset_after_effect" if !for_provider => Kind::ToolResetAfterEffect,
        other => {
            let kinds = if for_provider {
                PROVIDER_KINDS
            } else {
                TOOL_KINDS
            };
            problem(
                "kind",
                format!(
                    "{other:?} is not a fault for a {}; use one of: {kinds}",
                    if for_provider { "provider" } else { "tool" }
                ),
            );
            return None;
        }
    };
    let stray = [
        (
            "retry_after",
            spec.retry_after.is_some(),
            matches!(kind, Kind::RateLimit { .. }),
        ),
        (
            "status",
            spec.status.is_some(),
            matches!(kind, Kind::ServerError { .. }),
        ),
        (
            "delay",
            spec.delay.is_some(),
            matches!(kind, Kind::Delay { .. }),
        ),
        (
            "after_events",
            spec.after_events.is_some(),
            matches!(kind, Kind::StreamCut { .. }),
        ),
    ];
    for (field, set, allowed) in stray {
        if set && !allowed {
            problem(field, format!("does not apply to kind {:?}", kind.as_str()));
        }
    }
    Some(Fault {
        target,
        kind,
        share,
        spec: spec.clone(),
    })
}

/// The active faults, swappable at run time. Cheap to share.
pub struct Injector {
    on: AtomicBool,
    active: ArcSwap<Vec<Active>>,
    metrics: outrigger_telemetry::Metrics,
}

struct Active {
    fault: Fault,
    injected: AtomicU64,
}

/// A fault as `GET /v1/faults` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    #[serde(flatten)]
    pub spec: FaultSpec,
    pub target: String,
    pub injected: u64,
}

impl fmt::Debug for Injector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Injector")
            .field("faults", &self.active.load().len())
            .finish()
    }
}

impl Injector {
    /// No faults; injections are counted in `metrics`.
    pub fn new(metrics: outrigger_telemetry::Metrics) -> Self {
        Self {
            on: AtomicBool::new(false),
            active: ArcSwap::from_pointee(Vec::new()),
            metrics,
        }
    }

    /// Replaces the active set (an empty set turns injection off).
    pub fn set(&self, faults: Vec<Fault>) {
        for f in &faults {
            tracing::warn!(target_of = %f.target.label(), kind = f.kind.as_str(), percent = f.share * 100.0,
                "FAULT INJECTION ON: this sidecar is failing calls on purpose");
        }
        if faults.is_empty() && self.on.load(Ordering::Relaxed) {
            tracing::warn!("fault injection off");
        }
        self.on.store(!faults.is_empty(), Ordering::Relaxed);
        self.metrics.faults_active(!faults.is_empty());
        self.active.store(Arc::new(
            faults
                .into_iter()
                .map(|fault| Active {
                    fault,
                    injected: AtomicU64::new(0),
                })
                .collect(),
        ));
    }

    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub fn status(&self) -> Vec<Status> {
        self.active
            .load()
            .iter()
            .map(|a| Status {
                spec: a.fault.spec.clone(),
                target: a.fault.target.label(),
                injected: a.injected.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// The fault to inject into one attempt at `provider`, if the dice say so. A
    /// stream cut is drawn separately ([`Injector::stream_cut`]).
    pub fn provider(&self, provider: &str) -> Option<Kind> {
        self.draw(|f| f.target.hits_provider(provider) && !matches!(f.kind, Kind::StreamCut { .. }))
    }

    /// Events to relay before cutting a stream from `provider`, if one is drawn.
    pub fn stream_cut(&self, provider: &str) -> Option<u32> {
        match self
            .draw(|f| f.target.hits_provider(provider) && matches!(f.kind, Kind::StreamCut { .. }))
        {
            Some(Kind::StreamCut { after_events }) => Some(after_events),
            _ => None,
        }
    }

    pub fn tool(&self, tool: &str) -> Option<Kind> {
        self.draw(|f| f.target.hits_tool(tool))
    }

    fn draw(&self, pick: impl Fn(&Fault) -> bool) -> Option<Kind> {
        if !self.is_on() {
            return None;
        }
        let active = self.active.load();
        let hit = active
            .iter()
            .filter(|a| pick(&a.fault))
            .find(|a| rand::random::<f64>() < a.fault.share)?;
        hit.injected.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .fault_injected(&hit.fault.target.label(), hit.fault.kind.as_str());
        tracing::warn!(target_of = %hit.fault.target.label(), kind = hit.fault.kind.as_str(), "fault injected");
        Some(hit.fault.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::{Capabilities, Dialect, Provider, Tool, ToolKind};

    fn options() -> Options {
        Options {
            providers: vec![Provider {
                name: "mock".into(),
                dialect: Dialect::OpenAi,
                base_url: http::Uri::from_static("http://127.0.0.1:9/v1"),
                api_key: None,
                models: Vec::new(),
                caps: Capabilities::permissive(),
            }],
            tools: vec![Tool {
                name: "payments".into(),
                kind: ToolKind::Http,
                base_url: http::Uri::from_static("http://127.0.0.1:9"),
                class: outrigger_types::ToolClass::Unsafe,
                key_required: false,
                journal_get: false,
                timeout: Duration::from_secs(1),
                probe_path: None,
                redact: Default::default(),
            }],
            ..Options::default()
        }
    }

    fn spec(json: serde_json::Value) -> FaultSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn specs_validate_with_paths() {
        let ok = Fault::from_specs(
            &[
                spec(serde_json::json!({"provider": "mock", "kind": "rate_limit", "percent": 50, "retry_after": "2s"})),
                spec(serde_json::json!({"provider": "*", "kind": "stream_cut", "percent": 100, "after_events": 3})),
                spec(serde_json::json!({"tool": "payments", "kind": "tool_reset_after_effect", "percent": 10})),
            ],
            &options(),
            "faults",
        )
        .unwrap();
        assert_eq!(
            ok[0].kind,
            Kind::RateLimit {
                retry_after: Duration::from_secs(2)
            }
        );
        assert_eq!(ok[0].share, 0.5);
        assert_eq!(ok[1].target, Target::Provider(None));
        assert_eq!(ok[2].kind, Kind::ToolResetAfterEffect);

        let problems = Fault::from_specs(
            &[
                spec(serde_json::json!({"provider": "nope", "kind": "rate_limit", "percent": 5})),
                spec(serde_json::json!({"tool": "payments", "kind": "stream_cut", "percent": 5})),
                spec(serde_json::json!({"provider": "mock", "kind": "server_error", "status": 404, "percent": 0})),
                spec(serde_json::json!({"provider": "mock", "tool": "payments", "kind": "delay"})),
                spec(serde_json::json!({"provider": "mock", "kind": "delay", "percent": 5, "after_events": 2})),
            ],
            &options(),
            "faults",
        )
        .unwrap_err();
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "faults[0].provider",
                "faults[1].kind",
                "faults[2].percent",
                "faults[2].status",
                "faults[3].provider",
                "faults[4].delay",
                "faults[4].after_events",
            ],
            "{problems:?}"
        );
        assert!(problems[1].message.contains("tool_timeout"));
    }

    #[test]
    fn draws_respect_target_and_share() {
        let metrics = outrigger_telemetry::Metrics::new();
        let injector = Injector::new(metrics.clone());
        assert!(!injector.is_on());
        assert_eq!(injector.provider("mock"), None);
        let faults = Fault::from_specs(
            &[
                spec(serde_json::json!({"provider": "mock", "kind": "server_error", "percent": 100})),
                spec(serde_json::json!({"provider": "mock", "kind": "stream_cut", "percent": 100, "after_events": 1})),
            ],
            &options(),
            "faults",
        )
        .unwrap();
        injector.set(faults);
        assert_eq!(
            injector.provider("mock"),
            Some(Kind::ServerError { status: 503 })
        );
        assert_eq!(injector.provider("other"), None);
        assert_eq!(injector.tool("mock"), None);
        assert_eq!(injector.stream_cut("mock"), Some(1));
        assert!(metrics.encode().contains("outrigger_faults_active 1"));
        assert_eq!(injector.status()[0].injected, 1);
        assert!(metrics.encode().contains(
            "outrigger_faults_injected_total{target=\"provider:mock\",kind=\"server_error\"} 1"
        ));
        injector.set(Vec::new());
        assert!(!injector.is_on());
        assert_eq!(injector.provider("mock"), None);
        assert!(metrics.encode().contains("outrigger_faults_active 0"));
    }
}
