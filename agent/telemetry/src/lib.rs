//! Telemetry for the sidecar: the metric names (one pinned convention set, kept in
//! [`names`]), the Prometheus registry served on the admin plane's `/metrics`, and
//! the instruments the data plane records into.
//!
//! Metrics are recorded into `prometheus-client` families directly on the request
//! path (an atomic add per instrument) so that scraping never blocks traffic and a
//! slow or absent collector costs nothing. Label values are bounded: request ids,
//! task ids and keys never become labels; they travel on spans and exemplars.

mod error;
mod labels;
mod metrics;
pub mod names;
pub mod slo;
mod pipeline;
pub mod spans;

pub use error::{Error, SloProblem};
pub use labels::{Interner, Label, TraceId};
pub use metrics::{
    HttpLabels, Inflight, Metrics, MetricsOptions, ModelCallRecord, PolicyEventKind, ReplayKind,
    RouteLabel, ToolCallRecord,
};
pub use pipeline::{LogFormat, OtlpOptions, TelemetryGuard, TelemetryOptions, dispatch, init};
