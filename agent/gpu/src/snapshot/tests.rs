use std::collections::BTreeMap;
use std::time::{Duration, UNIX_EPOCH};

use super::*;
use crate::fake::{fake_uuid, healthy_sample};

fn up() -> NvmlStatus {
    NvmlStatus::Up {
        driver_version: "550.54.15".to_owned(),
        nvml_version: "12.550.54.15".to_owned(),
    }
}

fn at(seconds: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000 + seconds)
}

fn gpu(index: u32, state: GpuState) -> GpuHealth {
    let reasons = match state {
        GpuState::Healthy => Vec::new(),
        GpuState::Unknown => vec![reason(ReasonCode::NoSample, state)],
        GpuState::Degraded => vec![reason(ReasonCode::Thermal, state)],
        GpuState::Unhealthy => vec![reason(ReasonCode::XidFatal, state)],
    };
    GpuHealth {
        uuid: fake_uuid(index),
        index,
        name: "NVIDIA H200".to_owned(),
        mig_devices: Vec::new(),
        watched: true,
        state,
        reasons,
        signals: healthy_sample(),
        last_sampled_at: Some(at(0)),
        last_error: None,
        xid_history: Vec::new(),
        xid_counts: BTreeMap::new(),
        uncorrected_ecc_events: 0,
    }
}

fn reason(code: ReasonCode, severity: GpuState) -> Reason {
    Reason {
        code,
        severity,
        detail: format!("{} detail", code.as_str()),
        since: at(0),
    }
}

fn snapshot(nvml: NvmlStatus, gpus: Vec<GpuHealth>, options: &Options) -> Snapshot {
    Snapshot::from_parts(
        Parts {
            nvml,
            events: EventStatus::Up,
            gpus,
            problems: Vec::new(),
            sampled_at: Some(at(10)),
            rounds: 3,
            generation: 7,
            sample_duration_ms: Some(2.5),
            incidents: Vec::new(),
        },
        options,
    )
}

#[test]
fn readiness_table() {
    let strict = Options {
        unknown_is_ready: false,
        degraded_is_ready: false,
        ..Options::default()
    };
    let lenient = Options::default();
    let unavailable = NvmlStatus::Unavailable {
        reason: "libnvidia-ml.so.1 not found".to_owned(),
    };
    // (case, nvml, GPU states, options, ready)
    let cases = [
        (
            "all healthy",
            up(),
            vec![GpuState::Healthy, GpuState::Healthy],
            &lenient,
            true,
        ),
        (
            "one unhealthy",
            up(),
            vec![GpuState::Healthy, GpuState::Unhealthy],
            &lenient,
            false,
        ),
        (
            "degraded, default",
            up(),
            vec![GpuState::Degraded],
            &lenient,
            true,
        ),
        (
            "degraded, strict",
            up(),
            vec![GpuState::Degraded],
            &strict,
            false,
        ),
        (
            "unknown, default",
            up(),
            vec![GpuState::Unknown],
            &lenient,
            true,
        ),
        (
            "unknown, strict",
            up(),
            vec![GpuState::Unknown],
            &strict,
            false,
        ),
        ("no GPU visible, default", up(), vec![], &lenient, true),
        ("no GPU visible, strict", up(), vec![], &strict, false),
        (
            "no NVML, default",
            unavailable.clone(),
            vec![],
            &lenient,
            true,
        ),
        ("no NVML, strict", unavailable, vec![], &strict, false),
        (
            "loading, strict",
            NvmlStatus::Starting,
            vec![],
            &strict,
            false,
        ),
        (
            "disabled, strict",
            NvmlStatus::Disabled,
            vec![],
            &strict,
            true,
        ),
    ];
    for (case, nvml, states, options, ready) in cases {
        let gpus = states
            .iter()
            .enumerate()
            .map(|(index, state)| gpu(index as u32, *state))
            .collect::<Vec<_>>();
        let (verdict, why) = readiness(&nvml, &gpus, &[], options);
        assert_eq!(verdict, ready, "{case}: {why}");
        assert!(!why.is_empty(), "{case}");
    }
}

#[test]
fn unwatched_gpus_do_not_gate_readiness_but_missing_watched_ones_do() {
    let mut broken = gpu(1, GpuState::Unhealthy);
    broken.watched = false;
    let gpus = vec![gpu(0, GpuState::Healthy), broken];
    let (ready, why) = readiness(&up(), &gpus, &[], &Options::default());
    assert!(ready, "{why}");
    assert_eq!(why, "1 watched GPU(s): 1 healthy");

    let missing = reason(ReasonCode::GpuMissing, GpuState::Unhealthy);
    let (ready, why) = readiness(&up(), &gpus, &[missing], &Options::default());
    assert!(!ready);
    assert!(why.starts_with("gpu_missing:"), "{why}");
}

#[test]
fn the_reason_names_the_unhealthy_gpu() {
    let gpus = vec![gpu(0, GpuState::Healthy), gpu(1, GpuState::Unhealthy)];
    let snapshot = snapshot(up(), gpus, &Options::default());
    assert!(!snapshot.ready);
    assert_eq!(
        snapshot.ready_reason,
        format!("GPU 1 {} unhealthy: xid_fatal", fake_uuid(1))
    );
    assert!(snapshot.summary.ids.contains(&fake_uuid(1)));
    assert_eq!(
        snapshot.summary,
        GpuSummary {
            state: GpuState::Unhealthy,
            unhealthy: vec![fake_uuid(1)],
            present: true,
            ids: snapshot.summary.ids.clone(),
        }
    );
}

#[test]
fn summary_without_nvml_is_unknown_and_absent() {
    let snapshot = Snapshot::without_gpus(
        NvmlStatus::Unavailable {
            reason: "x".to_owned(),
        },
        &Options::default(),
    );
    assert_eq!(snapshot.summary, GpuSummary::default());
    assert!(snapshot.ready);
    let text = snapshot.render_text();
    assert!(text.starts_with("no NVML: x\n"), "{text}");
}

#[test]
fn render_text_has_one_block_per_gpu() {
    let mut degraded = gpu(1, GpuState::Degraded);
    degraded.xid_history.push(crate::classify::XidRecord {
        at: at(5),
        xid: Some(94),
    });
    let snapshot = snapshot(
        up(),
        vec![gpu(0, GpuState::Healthy), degraded],
        &Options::default(),
    );
    let text = snapshot.render_text();
    assert!(
        text.starts_with("NVIDIA driver 550.54.15, NVML 12.550.54.15\n"),
        "{text}"
    );
    assert!(text.contains("2 GPU(s), overall degraded: ready"), "{text}");
    assert!(text.contains(&format!("GPU 0  {}  NVIDIA H200  HEALTHY", fake_uuid(0))));
    assert!(text.contains(&format!("GPU 1  {}  NVIDIA H200  DEGRADED", fake_uuid(1))));
    assert!(text.contains("  [degraded] thermal: thermal detail (since 2023-11-14T22:13:20.000Z)"));
    assert!(text.contains("  temperature  38 °C (slowdown 87 °C, shutdown 92 °C)"));
    assert!(text.contains("  power        74.0 W of 700 W"));
    assert!(text.contains("  memory       0.5 of 140.4 GiB used"));
    assert!(text.contains("  clock events gpu_idle"));
    assert!(text.contains("  PCIe         gen 5 x16 (max gen 5 x16), 0 replays"));
    assert!(text.contains("  XIDs         94 at 2023-11-14T22:13:25.000Z"));
    assert_eq!(text.matches("\nGPU ").count(), 2);
}

fn find<'a>(
    metrics: &'a [MetricSample],
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a MetricSample> {
    metrics.iter().find(|metric| {
        metric.name == name
            && labels
                .iter()
                .all(|(key, value)| metric.labels.iter().any(|(k, v)| k == key && v == value))
    })
}

#[test]
fn metrics_carry_own_and_otel_names() {
    let mut broken = gpu(0, GpuState::Unhealthy);
    broken.xid_counts.insert("79".to_owned(), 2);
    broken.signals.ecc.corrected_volatile = Some(4);
    let snapshot = snapshot(up(), vec![broken], &Options::default());
    let metrics = snapshot.metrics();
    let uuid = fake_uuid(0);
    let value = |name: &str, labels: &[(&str, &str)]| find(&metrics, name, labels).map(|m| m.value);

    assert_eq!(value("outrigger_gpu_nvml_up", &[]), Some(1.0));
    assert_eq!(value("outrigger_gpu_ready", &[]), Some(0.0));
    assert_eq!(value("outrigger_gpu_count", &[]), Some(1.0));
    assert_eq!(value("outrigger_gpu_sample_rounds_total", &[]), Some(3.0));
    assert_eq!(
        value("outrigger_gpu_sample_duration_seconds", &[]),
        Some(0.0025)
    );
    assert_eq!(
        value(
            "outrigger_gpu_health_state",
            &[("gpu", &uuid), ("state", "unhealthy")]
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            "outrigger_gpu_health_state",
            &[("gpu", &uuid), ("state", "healthy")]
        ),
        Some(0.0)
    );
    assert_eq!(
        value(
            "outrigger_gpu_health_reason",
            &[("gpu", &uuid), ("reason", "xid_fatal")]
        ),
        Some(1.0)
    );
    assert_eq!(
        value("outrigger_gpu_xid_total", &[("gpu", &uuid), ("xid", "79")]),
        Some(2.0)
    );
    assert_eq!(
        value(
            "hw_status",
            &[("hw_id", &uuid), ("hw_type", "gpu"), ("hw_state", "failed")]
        ),
        Some(1.0)
    );
    assert_eq!(
        value("hw_status", &[("hw_id", &uuid), ("hw_state", "ok")]),
        Some(0.0)
    );
    assert_eq!(
        value(
            "hw_errors_total",
            &[("hw_id", &uuid), ("error_type", "xid_79")]
        ),
        Some(2.0)
    );
    assert_eq!(
        value(
            "hw_errors_total",
            &[("hw_id", &uuid), ("error_type", "corrected")]
        ),
        Some(4.0)
    );
    assert_eq!(value("hw_power_watts", &[("hw_id", &uuid)]), Some(74.0));
    assert_eq!(
        value("hw_gpu_memory_limit_bytes", &[("hw_id", &uuid)]),
        Some(150_754_820_096.0)
    );
    assert_eq!(
        value(
            "hw_gpu_utilization",
            &[("hw_id", &uuid), ("hw_gpu_task", "general")]
        ),
        Some(0.0)
    );
    assert_eq!(
        value("hw_energy_joules_total", &[("hw_id", &uuid)]),
        Some(1000.0)
    );
    assert_eq!(
        value(
            "outrigger_gpu_clock_event_active",
            &[("gpu", &uuid), ("reason", "gpu_idle")]
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            "outrigger_gpu_remapped_rows",
            &[("gpu", &uuid), ("type", "uncorrectable")]
        ),
        Some(0.0)
    );

    for metric in &metrics {
        let counter = metric.kind == MetricKind::Counter;
        assert_eq!(metric.name.ends_with("_total"), counter, "{}", metric.name);
        assert!(!metric.family().ends_with("_total"), "{}", metric.name);
        assert!(
            metric.name.starts_with("outrigger_gpu_") || metric.name.starts_with("hw_"),
            "{}",
            metric.name
        );
        assert!(!metric.help.is_empty());
    }
}

#[test]
fn without_nvml_no_hw_status_is_emitted() {
    let snapshot = Snapshot::without_gpus(NvmlStatus::Disabled, &Options::default());
    let metrics = snapshot.metrics();
    assert_eq!(
        find(&metrics, "outrigger_gpu_nvml_up", &[]).map(|m| m.value),
        Some(0.0)
    );
    assert!(find(&metrics, "hw_status", &[]).is_none());
    assert!(
        find(&metrics, "outrigger_gpu_events_up", &[]).is_none(),
        "no NVML, no event metric to alert on"
    );
}

#[test]
fn each_metric_family_is_contiguous() {
    let mut first = gpu(0, GpuState::Unhealthy);
    first.xid_counts.insert("79".to_owned(), 1);
    first.signals.ecc.corrected_volatile = Some(2);
    let mut second = gpu(1, GpuState::Degraded);
    second.xid_counts.insert("94".to_owned(), 3);
    let snapshot = snapshot(up(), vec![first, second], &Options::default());
    let metrics = snapshot.metrics();
    let mut finished: Vec<&str> = Vec::new();
    let mut current = "";
    for metric in &metrics {
        if metric.family() != current {
            assert!(
                !finished.contains(&metric.family()),
                "{} comes back after other families: {:?}",
                metric.family(),
                metrics.iter().map(MetricSample::family).collect::<Vec<_>>()
            );
            finished.push(current);
            current = metric.family();
        }
    }
    // Both GPUs' states, then both GPUs' hw_status: one family after the other.
    let families: Vec<&str> = metrics
        .iter()
        .map(MetricSample::family)
        .filter(|family| ["outrigger_gpu_health_state", "hw_status"].contains(family))
        .collect();
    assert_eq!(families.len(), 16);
    assert!(
        families[..8]
            .iter()
            .all(|f| *f == "outrigger_gpu_health_state")
    );
    let gpus: Vec<&str> = metrics
        .iter()
        .filter(|metric| metric.name == "outrigger_gpu_health_state")
        .map(|metric| metric.labels[0].1.as_str())
        .collect();
    assert_eq!(gpus[0], fake_uuid(0));
    assert_eq!(gpus[7], fake_uuid(1), "GPUs in index order within a family");
}

#[test]
fn event_delivery_is_exported_and_shown() {
    let mut snapshot = snapshot(up(), vec![gpu(0, GpuState::Healthy)], &Options::default());
    let events_up = |snapshot: &Snapshot| {
        find(&snapshot.metrics(), "outrigger_gpu_events_up", &[]).map(|m| m.value)
    };
    assert_eq!(events_up(&snapshot), Some(1.0));
    assert!(!snapshot.render_text().contains("XID events"));
    snapshot.events = EventStatus::Down("cannot create an NVML event set: Not Supported".into());
    assert_eq!(events_up(&snapshot), Some(0.0));
    assert!(
        snapshot
            .render_text()
            .contains("XID events: NOT delivered (cannot create an NVML event set"),
        "{}",
        snapshot.render_text()
    );
    assert!(snapshot.ready, "event delivery is not a health verdict");
}

#[test]
fn hardware_fault_finds_the_worst_overlapping_incident() {
    let mut snapshot = snapshot(up(), Vec::new(), &Options::default());
    snapshot.incidents = vec![
        Incident {
            gpu: fake_uuid(0),
            state: GpuState::Degraded,
            reasons: vec![ReasonCode::Thermal],
            from: at(100),
            until: Some(at(200)),
        },
        Incident {
            gpu: fake_uuid(0),
            state: GpuState::Unhealthy,
            reasons: vec![ReasonCode::XidFatal],
            from: at(300),
            until: None,
        },
    ];
    assert_eq!(snapshot.hardware_fault(at(0), at(99)), None);
    assert_eq!(
        snapshot.hardware_fault(at(150), at(160)).map(|i| i.state),
        Some(GpuState::Degraded)
    );
    assert_eq!(snapshot.hardware_fault(at(201), at(299)), None);
    assert_eq!(
        snapshot.hardware_fault(at(150), at(350)).map(|i| i.state),
        Some(GpuState::Unhealthy)
    );
    assert_eq!(
        snapshot
            .hardware_fault(at(10_000), at(10_001))
            .map(|i| i.state),
        Some(GpuState::Unhealthy),
        "an open incident covers everything after it started"
    );
}

#[test]
fn serializes_to_the_api_shape() -> Result<(), serde_json::Error> {
    let snapshot = snapshot(up(), vec![gpu(0, GpuState::Degraded)], &Options::default());
    let json = serde_json::to_value(&snapshot)?;
    assert_eq!(json["nvml"]["status"], "up");
    assert_eq!(json["nvml"]["driver_version"], "550.54.15");
    assert_eq!(json["summary"]["state"], "degraded");
    assert_eq!(json["ready"], true);
    assert_eq!(json["sampled_at"], "2023-11-14T22:13:30.000Z");
    assert_eq!(json["gpus"][0]["state"], "degraded");
    assert_eq!(json["gpus"][0]["reasons"][0]["code"], "thermal");
    assert_eq!(json["gpus"][0]["reasons"][0]["severity"], "degraded");
    assert_eq!(json["gpus"][0]["signals"]["temperature_c"], 38);
    assert_eq!(json["gpus"][0]["signals"]["pcie"]["width"], 16);

    let unavailable = Snapshot::without_gpus(
        NvmlStatus::Unavailable {
            reason: "libnvidia-ml.so.1 not found".to_owned(),
        },
        &Options::default(),
    );
    let json = serde_json::to_value(&unavailable)?;
    assert_eq!(json["nvml"]["status"], "unavailable");
    assert_eq!(json["nvml"]["reason"], "libnvidia-ml.so.1 not found");
    assert_eq!(json["sampled_at"], serde_json::Value::Null);
    Ok(())
}
