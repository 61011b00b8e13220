//! The Prometheus registry and the recording methods the data plane calls.
//!
//! Recording is an atomic add (or a short write lock for histograms with exemplars)
//! behind a family lookup; label values come from bounded [`Interner`]s, so a known
//! value allocates nothing and an unknown one folds into `_OTHER` once the cap is hit.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use outrigger_types::CircuitState;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::exemplar::{CounterWithExemplar, HistogramWithExemplars};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::labels::{Interner, Label, TraceExemplar, TraceId};
use crate::names;

/// The data-plane route a request matched (bounded set of label values).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum RouteLabel {
    ChatCompletions,
    Messages,
    Models,
    Tools,
    Mcp,
    Streams,
    Other,
}

impl RouteLabel {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat_completions",
            Self::Messages => "messages",
            Self::Models => "models",
            Self::Tools => "tools",
            Self::Mcp => "mcp",
            Self::Streams => "streams",
            Self::Other => "other",
        }
    }
}

impl EncodeLabelValue for RouteLabel {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        encoder.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    pub route: RouteLabel,
    /// Provider or tool name from config (bounded by config), or "-".
    pub target: String,
    pub status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteOnly {
    route: RouteLabel,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolLabel {
    tool: String,
}

/// What the data plane knows about one finished model call (all attempts of it).
#[derive(Debug, Clone, Copy)]
pub struct ModelCallRecord<'a> {
    /// `gen_ai.provider.name`: `openai`, `anthropic`, …
    pub provider: &'a str,
    pub request_model: &'a str,
    /// The model the provider says served the call, when it said.
    pub response_model: Option<&'a str>,
    /// `gen_ai.operation.name`, e.g. [`names::OPERATION_CHAT`].
    pub operation: &'a str,
    pub stream: bool,
    /// From the request leaving the sidecar to its last byte (or failure).
    pub duration: Duration,
    /// Streaming only: from the request to the first chunk.
    pub ttft: Option<Duration>,
    /// Streaming only: the gap before each chunk after the first.
    pub chunk_gaps: &'a ChunkGaps,
    /// Billable input / output tokens the provider reported; `None` when it did not
    /// (the usage histogram is then left alone rather than fed a zero).
    pub tokens_in: Option<u64>,
    pub tokens_out: Option<u64>,
    /// `error.type` when the call failed (a status code or a failure reason).
    pub error_type: Option<&'a str>,
    pub trace_id: Option<TraceId>,
}

/// The gaps between a stream's chunks: their sum and count, and the first
/// [`ChunkGaps::KEPT`] of them for the histogram, in 4 bytes each (microseconds; a
/// gap past 71 minutes is kept as 71 minutes). A stream longer than that (65,536
/// chunks is about as many tokens) feeds the histogram its first gaps only, so that
/// neither its memory nor the work at its end grows without bound; its mean is of
/// every gap.
#[derive(Debug, Default, Clone)]
pub struct ChunkGaps {
    micros: Vec<u32>,
    total: Duration,
    count: u64,
}

impl ChunkGaps {
    /// Gaps kept for the histogram per call.
    pub const KEPT: usize = 65_536;

    pub fn push(&mut self, gap: Duration) {
        if self.micros.len() < Self::KEPT {
            self.micros
                .push(u32::try_from(gap.as_micros()).unwrap_or(u32::MAX));
        }
        self.total = self.total.saturating_add(gap);
        self.count += 1;
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// How many gaps there were (not only those kept).
    pub fn len(&self) -> u64 {
        self.count
    }

    /// The mean of every gap, as measured.
    pub fn mean(&self) -> Option<Duration> {
        let n = u32::try_from(self.count).unwrap_or(u32::MAX);
        (n > 0).then(|| self.total / n)
    }

    /// The gaps kept for the histogram.
    pub fn iter(&self) -> impl Iterator<Item = Duration> + '_ {
        self.micros
            .iter()
            .map(|&us| Duration::from_micros(u64::from(us)))
    }
}

/// What the data plane knows about one finished tool call.
#[derive(Debug, Clone, Copy)]
pub struct ToolCallRecord<'a> {
    pub tool: &'a str,
    /// `gen_ai.tool.type`-like protocol label: `http` or `mcp`.
    pub protocol: &'static str,
    pub duration: Duration,
    /// The journal state the call ended in (`completed`, `in_doubt`, …), or
    /// `unjournaled`.
    pub journal_state: &'static str,
    pub error_type: Option<&'a str>,
    pub trace_id: Option<TraceId>,
}

/// Where an answer served from the journal came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplayKind {
    /// A tool call answered from its stored response.
    Tool,
    /// A model stream resumed from its journaled prefix (`Last-Event-ID`).
    StreamResume,
    /// A repeated model request answered from the journal within a task.
    ModelTurn,
}

impl ReplayKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tool => "tool",
            Self::StreamResume => "stream_resume",
            Self::ModelTurn => "model_turn",
        }
    }
}

/// Something that happened to a policy binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyEventKind {
    /// The component trapped.
    Trap,
    /// The component ran past its deadline (epoch interruption).
    Deadline,
    /// The component returned a decision the host refused.
    Invalid,
    /// A new version was swapped in.
    Swap,
    /// A new version failed validation; the previous one keeps serving.
    SwapFailed,
}

impl PolicyEventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Trap => "trap",
            Self::Deadline => "deadline",
            Self::Invalid => "invalid",
            Self::Swap => "swap",
            Self::SwapFailed => "swap_failed",
        }
    }
}

/// Which values the bounded labels admit up front, and how many more they learn.
#[derive(Debug, Clone)]
pub struct MetricsOptions {
    /// Model names from config (request and response models).
    pub models: Vec<String>,
    /// Tool and MCP server names from config.
    pub tools: Vec<String>,
    /// Provider names and kinds from config (`gen_ai.provider.name`, targets).
    pub providers: Vec<String>,
    /// Policy binding names.
    pub bindings: Vec<String>,
    /// How many unconfigured values each label learns before folding to `_OTHER`.
    pub learn_cap: usize,
}

impl Default for MetricsOptions {
    fn default() -> Self {
        Self {
            models: Vec::new(),
            tools: Vec::new(),
            providers: Vec::new(),
            bindings: Vec::new(),
            learn_cap: 64,
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    gen_ai_operation_name: Label,
    gen_ai_provider_name: Label,
    gen_ai_request_model: Label,
    gen_ai_response_model: Label,
    error_type: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabels {
    gen_ai_operation_name: Label,
    gen_ai_provider_name: Label,
    gen_ai_request_model: Label,
    gen_ai_response_model: Label,
    gen_ai_token_type: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolLabels {
    gen_ai_tool_name: Label,
    protocol: &'static str,
    error_type: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolStateLabels {
    gen_ai_tool_name: Label,
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RetryLabels {
    target: Label,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ContinuationLabels {
    target: Label,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FallbackLabels {
    from: Label,
    to: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabel {
    target: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    /// `provider:<name>` or `tool:<name>` (from config or the admin API: bounded).
    target: String,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    binding: Label,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TaskLabels {
    outcome: &'static str,
    recovered: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SloLabels {
    pub(crate) slo: Label,
    pub(crate) outcome: &'static str,
    pub(crate) cause: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SloName {
    slo: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DroppedLabels {
    signal: &'static str,
    reason: &'static str,
}

type ExemplarHistogram = HistogramWithExemplars<TraceExemplar>;

fn gen_ai_duration_with_exemplars() -> ExemplarHistogram {
    HistogramWithExemplars::new(names::GEN_AI_DURATION_BUCKETS.into_iter())
}

fn gen_ai_duration() -> Histogram {
    Histogram::new(names::GEN_AI_DURATION_BUCKETS)
}

fn gen_ai_tokens() -> Histogram {
    Histogram::new(names::GEN_AI_TOKEN_BUCKETS)
}

fn http_duration() -> Histogram {
    Histogram::new(names::HTTP_DURATION_BUCKETS)
}

fn task_duration() -> Histogram {
    Histogram::new(names::TASK_DURATION_BUCKETS)
}

struct Interners {
    models: Interner,
    tools: Interner,
    providers: Interner,
    bindings: Interner,
    /// `error.type` values and free-form reasons (budget rejections, operations).
    misc: Interner,
    empty: Label,
}

struct Instruments {
    requests: Family<HttpLabels, Counter>,
    http_duration: Family<RouteOnly, Histogram>,
    inflight: Family<RouteOnly, Gauge>,
    unprotected: Family<ToolLabel, Counter>,
    operation_duration: Family<ModelLabels, ExemplarHistogram>,
    token_usage: Family<TokenLabels, Histogram>,
    time_to_first_chunk: Family<ModelLabels, ExemplarHistogram>,
    time_per_output_chunk: Family<ModelLabels, Histogram>,
    tool_duration: Family<ToolLabels, Histogram>,
    tool_calls: Family<ToolStateLabels, Counter>,
    journal_records: Family<StateLabel, Gauge>,
    journal_in_doubt: Gauge,
    journal_flush_errors: Gauge,
    journal_size: Gauge,
    replays: Family<KindLabel, Counter>,
    continuations: Family<ContinuationLabels, Counter>,
    retries: Family<RetryLabels, Counter>,
    fallbacks: Family<FallbackLabels, Counter>,
    retry_budget_exhausted: Family<TargetLabel, Counter>,
    breaker: Family<TargetLabel, Gauge>,
    budget_rejections: Family<ReasonLabel, Counter>,
    policy_events: Family<PolicyLabels, Counter>,
    task_duration: Family<TaskLabels, Histogram>,
    task_recoveries: Family<ResultLabel, Counter>,
    slo_events: Family<SloLabels, CounterWithExemplar<TraceExemplar>>,
    slo_objective: Family<SloName, Gauge<f64, AtomicU64>>,
    dropped: Family<DroppedLabels, Counter>,
    faults_injected: Family<FaultLabels, Counter>,
    faults_active: Gauge,
}

/// The sidecar's metric instruments. Cheap to clone (one `Arc` inside).
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    i: Instruments,
    labels: Interners,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Instruments with no configured label values (each label learns up to 64).
    pub fn new() -> Self {
        Self::with_options(&MetricsOptions::default())
    }

    pub fn with_options(options: &MetricsOptions) -> Self {
        let cap = options.learn_cap;
        let labels = Interners {
            models: Interner::new(options.models.iter().map(String::as_str), cap),
            tools: Interner::new(options.tools.iter().map(String::as_str), cap),
            providers: Interner::new(options.providers.iter().map(String::as_str), cap),
            bindings: Interner::new(options.bindings.iter().map(String::as_str), cap),
            misc: Interner::new([names::OPERATION_CHAT], cap),
            empty: Label::new(""),
        };
        let i = Instruments {
            requests: Family::default(),
            http_duration: Family::new_with_constructor(http_duration),
            inflight: Family::default(),
            unprotected: Family::default(),
            operation_duration: Family::new_with_constructor(gen_ai_duration_with_exemplars),
            token_usage: Family::new_with_constructor(gen_ai_tokens),
            time_to_first_chunk: Family::new_with_constructor(gen_ai_duration_with_exemplars),
            time_per_output_chunk: Family::new_with_constructor(gen_ai_duration),
            tool_duration: Family::new_with_constructor(gen_ai_duration),
            tool_calls: Family::default(),
            journal_records: Family::default(),
            journal_in_doubt: Gauge::default(),
            journal_flush_errors: Gauge::default(),
            journal_size: Gauge::default(),
            replays: Family::default(),
            continuations: Family::default(),
            retries: Family::default(),
            fallbacks: Family::default(),
            retry_budget_exhausted: Family::default(),
            breaker: Family::default(),
            budget_rejections: Family::default(),
            policy_events: Family::default(),
            task_duration: Family::new_with_constructor(task_duration),
            task_recoveries: Family::default(),
            slo_events: Family::default(),
            slo_objective: Family::default(),
            dropped: Family::default(),
            faults_injected: Family::default(),
            faults_active: Gauge::default(),
        };
        let registry = register(&i);
        Self {
            inner: Arc::new(Inner {
                registry,
                i,
                labels,
            }),
        }
    }

    fn i(&self) -> &Instruments {
        &self.inner.i
    }

    // --- the HTTP layer (kept as the data plane calls it) ---

    /// Counts one finished request and observes its duration.
    pub fn request(&self, labels: HttpLabels, seconds: f64) {
        self.i()
            .http_duration
            .get_or_create(&RouteOnly {
                route: labels.route,
            })
            .observe(seconds);
        self.i().requests.get_or_create(&labels).inc();
    }

    /// Marks a request in flight until the returned guard drops.
    pub fn inflight(&self, route: RouteLabel) -> Inflight {
        let gauge = self
            .i()
            .inflight
            .get_or_create(&RouteOnly { route })
            .clone();
        gauge.inc();
        Inflight { gauge }
    }

    /// Counts a side-effecting tool call that passed through without a key; returns
    /// how many the tool had before this one (so the caller can log the first).
    pub fn unprotected_tool_call(&self, tool: &str) -> u64 {
        self.i()
            .unprotected
            .get_or_create(&ToolLabel {
                tool: self.inner.labels.tools.get(tool).as_str().to_owned(),
            })
            .inc()
    }

    // --- GenAI client metrics ---

    /// Records one finished model call: duration (with the trace id as exemplar),
    /// token usage, and for streams the time to first chunk and each chunk gap.
    pub fn model_call(&self, call: &ModelCallRecord<'_>) {
        let l = &self.inner.labels;
        let labels = ModelLabels {
            gen_ai_operation_name: l.misc.get(call.operation),
            gen_ai_provider_name: l.providers.get(call.provider),
            gen_ai_request_model: l.models.get(call.request_model),
            gen_ai_response_model: call
                .response_model
                .map_or_else(|| l.empty.clone(), |m| l.models.get(m)),
            error_type: call
                .error_type
                .map_or_else(|| l.empty.clone(), |e| l.misc.get(e)),
        };
        let exemplar = call.trace_id.map(TraceExemplar);
        self.i().operation_duration.get_or_create(&labels).observe(
            call.duration.as_secs_f64(),
            exemplar,
            None,
        );
        if call.stream {
            if let Some(ttft) = call.ttft {
                self.i().time_to_first_chunk.get_or_create(&labels).observe(
                    ttft.as_secs_f64(),
                    exemplar,
                    None,
                );
            }
            if !call.chunk_gaps.is_empty() {
                let histogram = self.i().time_per_output_chunk.get_or_create(&labels);
                for gap in call.chunk_gaps.iter() {
                    histogram.observe(gap.as_secs_f64());
                }
            }
        }
        for (token_type, count) in [
            (names::TOKEN_TYPE_INPUT, call.tokens_in),
            (names::TOKEN_TYPE_OUTPUT, call.tokens_out),
        ] {
            let Some(count) = count else { continue };
            self.i()
                .token_usage
                .get_or_create(&TokenLabels {
                    gen_ai_operation_name: labels.gen_ai_operation_name.clone(),
                    gen_ai_provider_name: labels.gen_ai_provider_name.clone(),
                    gen_ai_request_model: labels.gen_ai_request_model.clone(),
                    gen_ai_response_model: labels.gen_ai_response_model.clone(),
                    gen_ai_token_type: token_type,
                })
                .observe(count as f64);
        }
    }

    /// Records one finished tool call: its duration and the journal state it ended in.
    pub fn tool_call(&self, call: &ToolCallRecord<'_>) {
        let l = &self.inner.labels;
        let tool = l.tools.get(call.tool);
        self.i()
            .tool_duration
            .get_or_create(&ToolLabels {
                gen_ai_tool_name: tool.clone(),
                protocol: call.protocol,
                error_type: call
                    .error_type
                    .map_or_else(|| l.empty.clone(), |e| l.misc.get(e)),
            })
            .observe(call.duration.as_secs_f64());
        self.i()
            .tool_calls
            .get_or_create(&ToolStateLabels {
                gen_ai_tool_name: tool,
                state: call.journal_state,
            })
            .inc();
    }

    // --- resilience and policy ---

    /// One retry of a call to `target`, for `reason` (`Failure::reason()`).
    /// A stream interrupted while only text had come was continued at `target`
    /// (`continued`), or continuing it failed (`failed`).
    pub fn stream_continuation(&self, target: &str, continued: bool) {
        self.i()
            .continuations
            .get_or_create(&ContinuationLabels {
                target: self.inner.labels.providers.get(target),
                result: if continued { "continued" } else { "failed" },
            })
            .inc();
    }

    pub fn retry(&self, target: &str, reason: &'static str) {
        self.i()
            .retries
            .get_or_create(&RetryLabels {
                target: self.inner.labels.providers.get(target),
                reason,
            })
            .inc();
    }

    pub fn fallback(&self, from: &str, to: &str) {
        let p = &self.inner.labels.providers;
        self.i()
            .fallbacks
            .get_or_create(&FallbackLabels {
                from: p.get(from),
                to: p.get(to),
            })
            .inc();
    }

    /// A failed call to `target` that was not retried because its retry budget
    /// was spent.
    pub fn retry_budget_exhausted(&self, target: &str) {
        self.i()
            .retry_budget_exhausted
            .get_or_create(&TargetLabel {
                target: self.inner.labels.providers.get(target),
            })
            .inc();
    }

    /// The breaker of `target` is now `state` (0 closed, 1 half-open, 2 open).
    pub fn breaker_state(&self, target: &str, state: CircuitState) {
        let value = match state {
            CircuitState::Closed => 0,
            CircuitState::HalfOpen => 1,
            CircuitState::Open => 2,
        };
        self.i()
            .breaker
            .get_or_create(&TargetLabel {
                target: self.inner.labels.providers.get(target),
            })
            .set(value);
    }

    /// A call the budget policy rejected; `reason` is the policy's (bounded here).
    pub fn budget_rejection(&self, reason: &str) {
        self.i()
            .budget_rejections
            .get_or_create(&ReasonLabel {
                reason: self.inner.labels.misc.get(reason),
            })
            .inc();
    }

    pub fn replay(&self, kind: ReplayKind) {
        self.i()
            .replays
            .get_or_create(&KindLabel {
                kind: kind.as_str(),
            })
            .inc();
    }

    pub fn policy_event(&self, binding: &str, kind: PolicyEventKind) {
        self.policy_events(binding, kind, 1);
    }

    /// `n` policy events at once (the host counts traps itself; the binary folds
    /// its counters in before each scrape).
    pub fn policy_events(&self, binding: &str, kind: PolicyEventKind, n: u64) {
        if n == 0 {
            return;
        }
        self.i()
            .policy_events
            .get_or_create(&PolicyLabels {
                binding: self.inner.labels.bindings.get(binding),
                kind: kind.as_str(),
            })
            .inc_by(n);
    }

    /// Sets the journal gauges from its stats (call it before each scrape, or
    /// periodically).
    pub fn journal(&self, stats: &outrigger_journal::Stats) {
        for state in outrigger_journal::State::ALL {
            self.i()
                .journal_records
                .get_or_create(&StateLabel {
                    state: state.as_str(),
                })
                .set(gauge_value(stats.states.get(state)));
        }
        let s = &stats.states;
        self.i().journal_in_doubt.set(gauge_value(
            s.in_doubt
                .saturating_add(s.reconciling)
                .saturating_add(s.needs_operator),
        ));
        self.i()
            .journal_flush_errors
            .set(gauge_value(stats.flush_errors));
        self.i().journal_size.set(gauge_value(stats.size_on_disk));
    }

    // --- fault injection ---

    pub fn fault_injected(&self, target: &str, kind: &'static str) {
        self.i()
            .faults_injected
            .get_or_create(&FaultLabels {
                target: target.to_owned(),
                kind,
            })
            .inc();
    }

    pub fn faults_active(&self, active: bool) {
        self.i().faults_active.set(i64::from(active));
    }

    // --- tasks ---

    /// A task ended after `wall_clock` (downtime included). `recovered` is `None`
    /// for a task that had no fault.
    pub fn task_ended(&self, wall_clock: Duration, outcome: &'static str, recovered: Option<bool>) {
        let recovered = match recovered {
            None => "none",
            Some(true) => "true",
            Some(false) => "false",
        };
        self.i()
            .task_duration
            .get_or_create(&TaskLabels { outcome, recovered })
            .observe(wall_clock.as_secs_f64());
    }

    /// The verdict on one task that had a fault.
    pub fn recovery(&self, success: bool) {
        self.i()
            .task_recoveries
            .get_or_create(&ResultLabel {
                result: if success { "success" } else { "failure" },
            })
            .inc();
    }

    // --- SLO events and the telemetry pipeline (crate-internal) ---

    pub(crate) fn slo_event(&self, labels: &SloLabels, trace_id: Option<TraceId>) {
        self.i()
            .slo_events
            .get_or_create(labels)
            .inc_by(1, trace_id.map(TraceExemplar), None);
    }

    /// Publishes an SLO's target, so alert rules can read it instead of repeating it.
    pub(crate) fn slo_objective(&self, slo: &Label, target: f64) {
        self.i()
            .slo_objective
            .get_or_create(&SloName { slo: slo.clone() })
            .set(target);
    }

    /// A task the tracker forgot to stay within `[tasks] max_tasks`: its timeline and
    /// duration will never be recorded.
    pub fn task_forgotten(&self) {
        self.dropped_counter("tasks", "tracker_full").inc();
    }

    /// The counter of `signal` data dropped for `reason` (shared with the exporter
    /// threads, which count without touching the family again).
    pub(crate) fn dropped_counter(&self, signal: &'static str, reason: &'static str) -> Counter {
        self.i()
            .dropped
            .get_or_create_owned(&DroppedLabels { signal, reason })
    }

    /// OpenMetrics text exposition of every registered metric (exemplars included);
    /// serve it as `application/openmetrics-text; version=1.0.0; charset=utf-8`.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Encoding into a String cannot fail for lack of space; an error would be a
        // bug in a metric's encoder, which we surface as a comment rather than a panic.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.inner.registry) {
            out.push_str(&format!("# encoding error: {e}\n"));
        }
        out
    }
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn register(i: &Instruments) -> Registry {
    let mut r = Registry::default();
    r.register(
        names::HTTP_REQUESTS,
        "Requests handled by the data plane, by route, target and status",
        i.requests.clone(),
    );
    r.register_with_unit(
        names::HTTP_SERVER_REQUEST_DURATION,
        "Duration of data-plane requests until the response head",
        Unit::Seconds,
        i.http_duration.clone(),
    );
    r.register(
        names::HTTP_INFLIGHT,
        "Data-plane requests in flight, streams included until their last byte",
        i.inflight.clone(),
    );
    r.register(
        names::TOOL_UNPROTECTED,
        "Tool calls that carried no idempotency key and passed through unjournaled",
        i.unprotected.clone(),
    );
    r.register_with_unit(
        names::GEN_AI_CLIENT_OPERATION_DURATION,
        "GenAI operation duration (gen_ai.client.operation.duration)",
        Unit::Seconds,
        i.operation_duration.clone(),
    );
    r.register(
        names::GEN_AI_CLIENT_TOKEN_USAGE,
        "Tokens used per call, by token type (gen_ai.client.token.usage, {token})",
        i.token_usage.clone(),
    );
    r.register_with_unit(
        names::GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK,
        "Time from the request to the first streamed chunk",
        Unit::Seconds,
        i.time_to_first_chunk.clone(),
    );
    r.register_with_unit(
        names::GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK,
        "Time between consecutive streamed chunks after the first",
        Unit::Seconds,
        i.time_per_output_chunk.clone(),
    );
    r.register_with_unit(
        names::GEN_AI_EXECUTE_TOOL_DURATION,
        "Tool execution duration (gen_ai.execute_tool.duration)",
        Unit::Seconds,
        i.tool_duration.clone(),
    );
    r.register(
        names::TOOL_CALLS,
        "Tool calls by tool and the journal state they ended in",
        i.tool_calls.clone(),
    );
    r.register(
        names::JOURNAL_RECORDS,
        "Journal records by state",
        i.journal_records.clone(),
    );
    r.register(
        names::JOURNAL_IN_DOUBT,
        "Tool calls whose outcome is unknown (in doubt, reconciling, needs operator)",
        i.journal_in_doubt.clone(),
    );
    r.register(
        names::JOURNAL_FLUSH_ERRORS,
        "Journal flushes that failed since the journal was opened",
        i.journal_flush_errors.clone(),
    );
    r.register_with_unit(
        names::JOURNAL_SIZE,
        "Journal size on disk",
        Unit::Bytes,
        i.journal_size.clone(),
    );
    r.register(
        names::REPLAYS,
        "Answers served from the journal instead of executed, by kind",
        i.replays.clone(),
    );
    r.register(
        names::STREAM_CONTINUATIONS,
        "Interrupted text-only streams continued at their provider, by target and \
         result (continued, failed)",
        i.continuations.clone(),
    );
    r.register(
        names::RETRIES,
        "Retries by target and failure reason",
        i.retries.clone(),
    );
    r.register(
        names::FALLBACKS,
        "Fallbacks from one target to another",
        i.fallbacks.clone(),
    );
    r.register(
        names::RETRY_BUDGET_EXHAUSTED,
        "Failed calls a spent retry budget kept from retrying, by target",
        i.retry_budget_exhausted.clone(),
    );
    r.register(
        names::BREAKER_STATE,
        "Circuit-breaker state by target: 0 closed, 1 half-open, 2 open",
        i.breaker.clone(),
    );
    r.register(
        names::BUDGET_REJECTIONS,
        "Calls the budget policy rejected, by reason",
        i.budget_rejections.clone(),
    );
    r.register(
        names::POLICY_EVENTS,
        "Policy traps, deadline hits, invalid decisions, swaps and failed swaps",
        i.policy_events.clone(),
    );
    r.register_with_unit(
        names::TASK_DURATION,
        "Task wall-clock from first call to end, downtime included",
        Unit::Seconds,
        i.task_duration.clone(),
    );
    r.register(
        names::TASK_RECOVERIES,
        "Tasks that had a fault, by whether their recovery succeeded",
        i.task_recoveries.clone(),
    );
    r.register(
        names::SLO_EVENTS,
        "SLO events by SLO, outcome (good, bad, excluded) and cause",
        i.slo_events.clone(),
    );
    r.register(
        names::SLO_OBJECTIVE,
        "Each configured SLO's target (the good fraction aimed for)",
        i.slo_objective.clone(),
    );
    r.register(
        names::TELEMETRY_DROPPED,
        "Telemetry dropped rather than slow the request path, by signal and reason",
        i.dropped.clone(),
    );
    r.register(
        names::FAULTS_INJECTED,
        "Faults injected on purpose, by target and kind",
        i.faults_injected.clone(),
    );
    r.register(
        names::FAULTS_ACTIVE,
        "1 while fault injection is configured",
        i.faults_active.clone(),
    );
    r
}

/// Decrements the in-flight gauge when dropped.
pub struct Inflight {
    gauge: Gauge,
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

#[cfg(test)]
mod tests;
