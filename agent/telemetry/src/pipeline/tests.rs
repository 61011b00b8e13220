use std::net::TcpListener;
use std::time::{Duration, Instant};

use opentelemetry::trace::TracerProvider as _;

use super::*;
use crate::spans::{self, Join, ModelCallEnd};

/// An exporter that accepts every batch at once: the cost of the pipeline itself.
#[derive(Debug)]
struct Instant0;

impl SpanExporter for Instant0 {
    fn export(
        &self,
        _batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        std::future::ready(Ok(()))
    }
}

fn emit(n: usize) -> Duration {
    let join = Join {
        request_id: "01JREQ",
        task_id: Some("task-1"),
        ..Join::default()
    };
    let started = Instant::now();
    for _ in 0..n {
        let span = spans::model_call(&join, "chat", "openai", "gpt-4o", true);
        spans::finish_model_call(
            &span,
            &ModelCallEnd {
                attempts: 1,
                tokens_out: Some(10),
                ..ModelCallEnd::default()
            },
        );
    }
    started.elapsed()
}

/// The fastest of five batches of 1000: the code path's cost, without the noise of
/// other processes sharing the machine (which can only add time).
fn best_of_five() -> Duration {
    (0..5).map(|_| emit(1000)).min().unwrap_or(Duration::MAX)
}

fn otlp(endpoint: String) -> OtlpOptions {
    OtlpOptions {
        timeout: Duration::from_millis(500),
        max_queue: 256,
        max_batch: 64,
        schedule_delay: Duration::from_millis(10),
        ..OtlpOptions::new(endpoint)
    }
}

fn dropped(metrics: &Metrics, reason: &str) -> u64 {
    let needle =
        format!("outrigger_telemetry_dropped_total{{signal=\"spans\",reason=\"{reason}\"}} ");
    metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(&needle)?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_black_hole_collector_does_not_slow_the_request_path() -> Result<(), Box<dyn std::error::Error>>
{
    // Accepts connections and never reads or answers them.
    let hole = TcpListener::bind("127.0.0.1:0")?;
    let addr = hole.local_addr()?;
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in hole.incoming().flatten() {
            held.push(stream);
        }
    });

    // Baseline: the same pipeline with an exporter that never waits.
    let metrics = Metrics::new();
    let options = TelemetryOptions::default();
    let provider = bounded_provider(Instant0, &otlp(String::new()), resource(&options), &metrics);
    let baseline_dispatch = subscriber(&options, Some(provider.tracer_with_scope(scope())))?;
    let baseline = tracing::dispatcher::with_default(&baseline_dispatch, || {
        emit(100);
        best_of_five()
    });
    provider.shutdown()?;

    let metrics = Metrics::new();
    let options = TelemetryOptions {
        otlp: Some(otlp(format!("http://{addr}"))),
        ..TelemetryOptions::default()
    };
    let (dispatch, guard) = super::dispatch(&options, &metrics)?;
    let dead = tracing::dispatcher::with_default(&dispatch, || {
        emit(100);
        best_of_five()
    });
    eprintln!(
        "1000 spans: {:?} with an instant exporter, {:?} with a black-hole collector",
        baseline, dead
    );
    assert!(
        dead < Duration::from_millis(50),
        "1000 span emissions took {dead:?}"
    );
    // The queue is bounded: what did not fit was dropped and counted.
    assert!(
        dropped(&metrics, "queue_full") >= 5100 - 256 - 64,
        "{}",
        metrics.encode()
    );

    // Shutting down waits for the stuck export at most about its timeout.
    let stopping = Instant::now();
    let _ = guard.shutdown();
    assert!(
        stopping.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        stopping.elapsed()
    );
    Ok(())
}

#[test]
fn a_refused_export_is_counted() -> Result<(), Box<dyn std::error::Error>> {
    // A port with nothing listening: every export fails fast.
    let closed = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let metrics = Metrics::new();
    let options = TelemetryOptions {
        otlp: Some(otlp(format!("http://{closed}"))),
        ..TelemetryOptions::default()
    };
    let (dispatch, guard) = super::dispatch(&options, &metrics)?;
    tracing::dispatcher::with_default(&dispatch, || emit(10));
    assert!(guard.flush().is_err() || dropped(&metrics, "export_failed") > 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while dropped(&metrics, "export_failed") < 10 && Instant::now() < deadline {
        let _ = guard.flush();
    }
    assert_eq!(dropped(&metrics, "export_failed"), 10);
    assert_eq!(dropped(&metrics, "queue_full"), 0);
    Ok(())
}

#[test]
fn the_endpoint_comes_from_config_then_the_environment() {
    let env = vec![(
        "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
        "http://collector:4318".to_owned(),
    )];
    let from_config = OtlpOptions::resolve(Some("http://127.0.0.1:4318/"), &env);
    assert_eq!(
        from_config.map(|o| o.traces_url()).as_deref(),
        Some("http://127.0.0.1:4318/v1/traces")
    );
    let from_env = OtlpOptions::resolve(None, &env);
    assert_eq!(
        from_env.map(|o| o.endpoint).as_deref(),
        Some("http://collector:4318")
    );
    assert_eq!(OtlpOptions::resolve(Some(""), &[]), None);
}

#[test]
fn a_bad_log_filter_is_reported() {
    let options = TelemetryOptions {
        log_filter: "=[".to_owned(),
        ..TelemetryOptions::default()
    };
    let err = super::dispatch(&options, &Metrics::new()).err();
    assert!(matches!(err, Some(Error::LogFilter { .. })), "{err:?}");
}
