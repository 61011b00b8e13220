//! The `tracing` subscriber and the OTLP span pipeline.
//!
//! Spans end on the request path and are handed to a batch span processor whose
//! queue is bounded; a thread of its own exports them over OTLP/HTTP (protobuf) with
//! the blocking `reqwest` client, because the batch processor has no Tokio reactor
//! (an async client there panics its thread and silently loses every later span).
//! When the collector is dead or slow, the queue fills and further spans are dropped
//! and counted (`outrigger_telemetry_dropped_total{signal="spans"}`) — ending a span
//! never waits for the network.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Context, InstrumentationScope, KeyValue};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor,
};
use prometheus_client::metrics::counter::Counter;
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::{Layer, Registry};

use crate::metrics::Metrics;
use crate::{Error, names};

/// How logs are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Where and how spans are exported over OTLP/HTTP.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpOptions {
    /// The collector's base URL (as in `OTEL_EXPORTER_OTLP_ENDPOINT`, e.g.
    /// `http://127.0.0.1:4318`); `/v1/traces` is appended.
    pub endpoint: String,
    /// Extra request headers (e.g. an auth token for the collector).
    pub headers: Vec<(String, String)>,
    /// One export's deadline.
    pub timeout: Duration,
    /// Spans waiting for export; beyond this they are dropped and counted.
    pub max_queue: usize,
    pub max_batch: usize,
    /// How long a span waits for company before a batch is sent.
    pub schedule_delay: Duration,
}

impl OtlpOptions {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            headers: Vec::new(),
            timeout: Duration::from_secs(10),
            max_queue: 2048,
            max_batch: 512,
            schedule_delay: Duration::from_secs(5),
        }
    }

    /// The endpoint to use: the configured one, else `OTEL_EXPORTER_OTLP_ENDPOINT`
    /// from `env` (the binary passes the process environment in; this crate reads
    /// none), else none: export stays off.
    pub fn resolve(configured: Option<&str>, env: &[(String, String)]) -> Option<Self> {
        configured
            .filter(|e| !e.trim().is_empty())
            .map(str::to_owned)
            .or_else(|| {
                env.iter()
                    .find(|(k, v)| k == "OTEL_EXPORTER_OTLP_ENDPOINT" && !v.trim().is_empty())
                    .map(|(_, v)| v.clone())
            })
            .map(Self::new)
    }

    fn traces_url(&self) -> String {
        format!("{}/v1/traces", self.endpoint.trim_end_matches('/'))
    }
}

/// What [`init`] sets up.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryOptions {
    /// `service.name` (default `outrigger`).
    pub service_name: String,
    /// `service.version`.
    pub service_version: String,
    /// `service.instance.id`: unique per process (the binary generates it).
    pub instance_id: String,
    /// A `tracing` filter for the logs, e.g. `info` or `outrigger=debug`.
    pub log_filter: String,
    pub log_format: LogFormat,
    /// `None`: no span export (spans are then never built at all).
    pub otlp: Option<OtlpOptions>,
    /// Record prompt and completion content on spans (opt-in; off by default).
    pub content: bool,
}

impl Default for TelemetryOptions {
    fn default() -> Self {
        Self {
            service_name: names::SERVICE_NAME_DEFAULT.to_owned(),
            service_version: env!("CARGO_PKG_VERSION").to_owned(),
            instance_id: String::new(),
            log_filter: "info".to_owned(),
            log_format: LogFormat::Text,
            otlp: None,
            content: false,
        }
    }
}

/// Keeps the span pipeline alive; flushes and shuts it down on [`shutdown`] or drop
/// (bounded by the export timeout, so a dead collector delays exit, never requests).
///
/// [`shutdown`]: TelemetryGuard::shutdown
#[must_use = "dropping the guard shuts the span pipeline down"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
    timeout: Duration,
}

impl std::fmt::Debug for TelemetryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelemetryGuard")
            .field("exporting", &self.provider.is_some())
            .finish()
    }
}

impl TelemetryGuard {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports what is queued, within the export timeout.
    pub fn flush(&self) -> Result<(), Error> {
        match &self.provider {
            Some(p) => p.force_flush().map_err(|e| Error::Export(e.to_string())),
            None => Ok(()),
        }
    }

    /// Flushes and stops the exporter.
    pub fn shutdown(mut self) -> Result<(), Error> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), Error> {
        match self.provider.take() {
            Some(p) => p
                .shutdown_with_timeout(self.timeout)
                .map_err(|e| Error::Export(e.to_string())),
            None => Ok(()),
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            // The subscriber may already be gone at exit; stderr is all that is left.
            eprintln!("telemetry shutdown: {e}");
        }
    }
}

/// Installs the global `tracing` subscriber (logs to stderr, plus span export over
/// OTLP when configured) and the global tracer provider.
pub fn init(options: &TelemetryOptions, metrics: &Metrics) -> Result<TelemetryGuard, Error> {
    let (dispatch, guard) = dispatch(options, metrics)?;
    tracing::dispatcher::set_global_default(dispatch).map_err(|_| Error::AlreadyInitialised)?;
    if let Some(provider) = &guard.provider {
        opentelemetry::global::set_tracer_provider(provider.clone());
    }
    Ok(guard)
}

/// Builds the subscriber without installing it (tests install it per thread).
pub fn dispatch(
    options: &TelemetryOptions,
    metrics: &Metrics,
) -> Result<(tracing::Dispatch, TelemetryGuard), Error> {
    crate::spans::set_content_capture(options.content);
    let (tracer, guard) = match &options.otlp {
        None => (
            None,
            TelemetryGuard {
                provider: None,
                timeout: Duration::ZERO,
            },
        ),
        Some(otlp) => {
            let provider = otlp_provider(options, otlp, metrics)?;
            let tracer = provider.tracer_with_scope(scope());
            (
                Some(tracer),
                TelemetryGuard {
                    provider: Some(provider),
                    timeout: otlp.timeout,
                },
            )
        }
    };
    Ok((subscriber(options, tracer)?, guard))
}

/// The instrumentation scope: name, version and the pinned schema URL.
pub(crate) fn scope() -> InstrumentationScope {
    InstrumentationScope::builder(names::SCOPE)
        .with_version(env!("CARGO_PKG_VERSION"))
        .with_schema_url(names::SCHEMA_URL)
        .build()
}

pub(crate) fn resource(options: &TelemetryOptions) -> Resource {
    // `builder_empty`: the default builder would read OTEL_* variables itself.
    Resource::builder_empty()
        .with_service_name(options.service_name.clone())
        .with_attributes([
            KeyValue::new(
                names::RESOURCE_SERVICE_VERSION,
                options.service_version.clone(),
            ),
            KeyValue::new(
                names::RESOURCE_SERVICE_INSTANCE_ID,
                options.instance_id.clone(),
            ),
        ])
        .build()
}

fn otlp_provider(
    options: &TelemetryOptions,
    otlp: &OtlpOptions,
    metrics: &Metrics,
) -> Result<SdkTracerProvider, Error> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(otlp.traces_url())
        .with_timeout(otlp.timeout)
        .with_headers(otlp.headers.iter().cloned().collect())
        .build()
        .map_err(|e| Error::Export(format!("cannot build the OTLP exporter: {e}")))?;
    Ok(bounded_provider(exporter, otlp, resource(options), metrics))
}

/// A tracer provider whose batch processor never blocks `on_end` and counts every
/// span it loses.
pub(crate) fn bounded_provider<E: SpanExporter + 'static>(
    exporter: E,
    otlp: &OtlpOptions,
    resource: Resource,
    metrics: &Metrics,
) -> SdkTracerProvider {
    let pending = Arc::new(AtomicUsize::new(0));
    let max_queue = otlp.max_queue.max(1);
    let exporter = Counted {
        inner: exporter,
        pending: Arc::clone(&pending),
        failed: metrics.dropped_counter("spans", "export_failed"),
    };
    let config = BatchConfigBuilder::default()
        .with_max_queue_size(max_queue)
        .with_max_export_batch_size(otlp.max_batch.clamp(1, max_queue))
        .with_scheduled_delay(otlp.schedule_delay)
        .build();
    let processor = Bounded {
        inner: BatchSpanProcessor::builder(exporter)
            .with_batch_config(config)
            .build(),
        pending,
        cap: max_queue,
        full: metrics.dropped_counter("spans", "queue_full"),
    };
    SdkTracerProvider::builder()
        .with_resource(resource)
        .with_span_processor(processor)
        .build()
}

/// Counts spans handed to the batch processor and not yet exported; beyond `cap` it
/// drops (and counts) instead of forwarding. Spans in the processor's channel are a
/// subset of these, so its own queue never overflows and every loss is counted here.
#[derive(Debug)]
struct Bounded {
    inner: BatchSpanProcessor,
    pending: Arc<AtomicUsize>,
    cap: usize,
    full: Counter,
}

impl SpanProcessor for Bounded {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.pending.fetch_add(1, Ordering::AcqRel) >= self.cap {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            self.full.inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Releases exported spans from the pending count, and counts those whose export
/// failed (dead collector, timeout, refused batch).
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    pending: Arc<AtomicUsize>,
    failed: Counter,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let n = batch.len();
        let export = self.inner.export(batch);
        async move {
            let result = export.await;
            self.pending.fetch_sub(n, Ordering::AcqRel);
            if result.is_err() {
                self.failed.inc_by(n as u64);
            }
            result
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Logs (fmt layer under the configured filter) plus, with a tracer, the
/// OpenTelemetry layer restricted to the sidecar's own spans.
pub(crate) fn subscriber(
    options: &TelemetryOptions,
    tracer: Option<SdkTracer>,
) -> Result<tracing::Dispatch, Error> {
    let mut filter = EnvFilter::try_new(&options.log_filter).map_err(|e| Error::LogFilter {
        filter: options.log_filter.clone(),
        detail: e.to_string(),
    })?;
    if !options.log_filter.contains(names::SPAN_TARGET) {
        // The telemetry spans are for export; in the logs they would only repeat
        // every attribute on every line.
        let off = format!("{}=off", names::SPAN_TARGET);
        filter = filter.add_directive(off.parse().map_err(|e| Error::LogFilter {
            filter: off.clone(),
            detail: format!("{e}"),
        })?);
    }
    let fmt: Box<dyn Layer<Registry> + Send + Sync> = match options.log_format {
        LogFormat::Text => Box::new(tracing_subscriber::fmt::layer().with_writer(std::io::stderr)),
        LogFormat::Json => Box::new(
            tracing_subscriber::fmt::layer()
                .json()
                .with_writer(std::io::stderr),
        ),
    };
    let otel = tracer.map(|tracer| {
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_filter(Targets::new().with_target(names::SPAN_TARGET, tracing::Level::INFO))
    });
    let subscriber = Registry::default().with(fmt.with_filter(filter)).with(otel);
    Ok(tracing::Dispatch::new(subscriber))
}

#[cfg(test)]
mod tests;
