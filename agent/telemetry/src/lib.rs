//! Telemetry for the sidecar: every span, attribute and metric name (one pinned
//! GenAI convention set, kept in [`names`]), the Prometheus registry served on the
//! admin plane's `/metrics` ([`Metrics`]), the spans the data plane opens ([`spans`]),
//! the `tracing` subscriber with its OTLP span pipeline ([`init`]), and SLO accounting
//! with error budgets by cause ([`slo`]).
//!
//! Invariants:
//! - **Nothing here slows a request.** Metrics are recorded into `prometheus-client`
//!   families on the request path (an atomic add, or a short lock for histograms
//!   with exemplars); ending a span puts it on a bounded queue that a thread of its
//!   own exports; what does not fit is dropped and counted, never waited for.
//! - **Labels are bounded.** Request ids, task ids and keys never become labels; they
//!   travel on spans and on exemplars. Free-form values fold into `_OTHER` past a cap.
//! - **One place for names, one place for causes.** Names are only spelled in
//!   [`names`]; the cause of a bad event is only decided by [`slo::classify`].
//! - **The crate reads no environment.** The binary passes values in (for example
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` through [`OtlpOptions::resolve`]).
//!
//! It is its own crate so that the OpenTelemetry stack (which must move in lockstep,
//! `opentelemetry*` 0.33 with `tracing-opentelemetry` 0.34) is named in one place.

mod error;
mod labels;
mod metrics;
pub mod names;
mod pipeline;
pub mod slo;
pub mod spans;

pub use error::{Error, SloProblem};
pub use labels::{Interner, Label, TraceId};
pub use metrics::{
    ChunkGaps, HttpLabels, Inflight, Metrics, MetricsOptions, ModelCallRecord, PolicyEventKind,
    ReplayKind, RouteLabel, ToolCallRecord,
};
pub use pipeline::{LogFormat, OtlpOptions, TelemetryGuard, TelemetryOptions, dispatch, init};
