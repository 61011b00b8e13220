//! The configuration file as written: every field optional and loosely typed
//! (durations and addresses are strings), so that validation can report every
//! problem with its key path instead of stopping at the first.

use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Config {
    pub listen: Listen,
    pub admin: Admin,
    pub journal: Journal,
    pub limits: Limits,
    pub drain: Drain,
    pub log: Log,
    pub providers: Vec<Provider>,
    pub tools: Vec<Tool>,
    pub policies: Policies,
    pub resilience: Resilience,
    pub budget: Budget,
    pub gpu: Gpu,
    pub streams: Streams,
    pub telemetry: Telemetry,
    pub slos: Vec<outrigger_telemetry::slo::SloSpec>,
    pub tasks: Tasks,
    pub faults: Vec<outrigger_proxy::faults::FaultSpec>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Telemetry {
    /// OTLP/HTTP collector base URL; `OTEL_EXPORTER_OTLP_ENDPOINT` when unset.
    pub otlp_endpoint: Option<String>,
    /// Extra headers for the collector (e.g. an auth token).
    pub otlp_headers: toml::Table,
    /// Record prompt and completion content on spans (off by default).
    pub content: Option<bool>,
    pub service_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Tasks {
    /// A task with no call for this long ends with outcome `idle_timeout`.
    pub idle_timeout: Option<String>,
    /// How long an ended task stays listed.
    pub retention: Option<String>,
    /// The most tasks kept; a new one beyond it makes room by forgetting the
    /// oldest ended task, else the open task idle longest.
    pub max_tasks: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Streams {
    /// Answer a repeated identical model request of a task from the journal.
    pub replay_in_task: Option<bool>,
    /// How long a generation keeps being drained after its last client left.
    pub detach_timeout: Option<String>,
    pub max_stream_bytes: Option<usize>,
    pub cancel_on_disconnect: Option<bool>,
    /// The most continuations one generation may take.
    pub max_continuations: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Policies {
    /// A directory of `.wasm` components, watched for changes.
    pub dir: Option<String>,
    /// Where compiled components are cached (default `<journal dir>/policy-cache`).
    pub cache_dir: Option<String>,
    pub deadline: Option<String>,
    pub memory_limit_mb: Option<usize>,
    pub max_retry_delay: Option<String>,
    /// Seeds the policies' `random` import (repeatable jitter, for tests and drills).
    pub seed: Option<u64>,
    pub bindings: Vec<PolicyBinding>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct PolicyBinding {
    pub hook: String,
    /// `builtin:<name>`, the stem of a `.wasm` in `dir`, or a path ending in `.wasm`.
    pub policy: String,
    pub on_error: Option<String>,
    pub params: toml::Table,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Resilience {
    pub retry_budget_ratio: Option<f64>,
    pub retry_budget_min: Option<u32>,
    pub retry_budget_window: Option<String>,
    pub breaker_failures: Option<u32>,
    pub breaker_min_penalty: Option<String>,
    pub breaker_max_penalty: Option<String>,
    pub max_concurrency: Option<u32>,
    pub max_queue: Option<usize>,
    pub queue_timeout: Option<String>,
    pub max_attempts: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Budget {
    pub tokens_in: Option<u64>,
    pub tokens_out: Option<u64>,
    pub tokens_total: Option<u64>,
    /// Dollars.
    pub cost: Option<f64>,
    pub wall_clock: Option<String>,
    pub calls: Option<u32>,
    pub retries: Option<u32>,
    pub downgrade_models: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Gpu {
    pub enabled: Option<bool>,
    pub library: Option<String>,
    pub sample_interval: Option<String>,
    /// GPU UUIDs (`GPU-…`) or indices to watch; all when empty.
    pub watch: Vec<toml::Value>,
    pub unknown_is_ready: Option<bool>,
    pub degraded_is_ready: Option<bool>,
    pub fatal_xids: Option<Vec<u64>>,
    pub expected_count: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Listen {
    pub data: Option<String>,
    pub admin: Option<String>,
    /// Data-plane worker threads; 0 (the default) is one per available core.
    pub workers: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Admin {
    /// Bearer token for the admin plane (required when it binds a non-loopback address).
    pub token: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Journal {
    /// The data directory: the journal lives in `<dir>/journal`.
    pub dir: Option<String>,
    /// "process" (default: survives a crash of the sidecar) or "node" (adds fdatasync:
    /// survives a crash of the machine).
    pub durability: Option<String>,
    /// How long full tool-call records are kept before they become tombstones.
    pub retention: Option<String>,
    /// How long tombstones are kept before the key is forgotten.
    pub tombstone_retention: Option<String>,
    /// How long journaled model streams are kept.
    pub stream_retention: Option<String>,
    /// sled's page cache in bytes.
    pub cache_bytes: Option<u64>,
    /// What the sidecar does with a journal found corrupt at start-up:
    /// "fail-closed" (default) or "quarantine".
    pub on_corrupt: Option<String>,
    /// How long start-up waits for a journal another process holds locked.
    pub lock_wait: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Limits {
    pub max_body_bytes: Option<usize>,
    pub max_event_bytes: Option<usize>,
    pub connect_timeout: Option<String>,
    pub first_byte_timeout: Option<String>,
    pub stream_idle_timeout: Option<String>,
    pub client_stall_timeout: Option<String>,
    pub client_read_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Drain {
    pub deadline: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Log {
    /// "text" (default) or "json".
    pub format: Option<String>,
    /// A tracing filter, e.g. "info" or "outrigger=debug".
    pub level: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Provider {
    pub name: String,
    pub kind: String,
    pub base_url: String,
    pub api_key_env: Option<String>,
    pub models: Vec<String>,
    pub fallbacks: Vec<String>,
    pub default_model: Option<String>,
    pub supports_tools: Option<bool>,
    pub supports_streaming: Option<bool>,
    pub context_window: Option<u32>,
    pub modalities: Vec<String>,
    pub local: Option<bool>,
    /// Dollars per million input tokens.
    pub price_in: Option<f64>,
    /// Dollars per million output tokens.
    pub price_out: Option<f64>,
    /// How an interrupted text-only stream is continued: `"prefill"` (Anthropic
    /// providers only) or `"instruction"`; off when absent.
    pub continuation: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Tool {
    pub name: String,
    pub kind: String,
    pub base_url: String,
    pub class: Option<String>,
    pub key_required: Option<bool>,
    pub journal_get: Option<bool>,
    pub timeout: Option<String>,
    pub probe_path: Option<String>,
    pub redact_headers: Vec<String>,
    pub redact_json: Vec<String>,
}
