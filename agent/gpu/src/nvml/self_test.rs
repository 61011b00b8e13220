//! `outrigger gpu --self-test`: the checks a real GPU machine should pass (reference
//! §9.2). Read-only: nothing here resets a GPU, changes a mode or clears a counter.
//! Cross-checks against `nvidia-smi` live in `cargo xtask gpu-check`, which reads this
//! report as JSON.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use nvml_wrapper::Device;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use outrigger_types::GpuState;
use serde::Serialize;

use super::{DEFAULT_LIBRARY, NvmlBackend, read_sample};
use crate::backend::{Backend, Error};
use crate::classify::{Classifier, Reason};
use crate::clock::{Moment, lock};
use crate::options::Options;
use crate::sample::Sample;

/// Consecutive full samples timed per GPU.
const COST_SAMPLES: usize = 50;
/// A full sample of one GPU should take less than this.
const COST_TARGET: Duration = Duration::from_millis(50);
/// Event waits that must all time out on a quiet machine.
const EVENT_WAITS: usize = 3;
const EVENT_WAIT: Duration = Duration::from_millis(500);
/// A library path that cannot exist, for the negative check.
const MISSING_LIBRARY: &str = "outrigger-self-test-missing/libnvidia-ml.so.1";

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckStatus {
    Pass,
    /// Worth a look, not a failure (an unsupported feature, a racy comparison).
    Warn,
    Fail,
}

impl CheckStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pass => "PASS",
            Self::Warn => "WARN",
            Self::Fail => "FAIL",
        }
    }
}

/// One check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    /// The GPU it concerns, when it concerns one.
    pub gpu: Option<String>,
    pub status: CheckStatus,
    pub detail: String,
}

/// What was read from one GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SelfTestDevice {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub sample: Option<Sample>,
    /// The classifier's verdict on that sample.
    pub state: GpuState,
    pub reasons: Vec<Reason>,
    /// `nvmlDeviceGetRemappedRows`: correctable, uncorrectable, pending, failure.
    pub raw_remapped_rows: Option<[u32; 4]>,
    /// `nvmlDeviceGetCurrentClocksEventReasons`.
    pub raw_clock_event_reasons: Option<u64>,
    pub supported_event_types: Option<u64>,
}

/// Timing of full samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SampleCost {
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// The self-test report (`outrigger gpu --self-test --json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SelfTestReport {
    /// No check failed.
    pub passed: bool,
    pub library: String,
    pub driver_version: Option<String>,
    pub nvml_version: Option<String>,
    pub field_id_scheme: Option<String>,
    pub device_count: Option<usize>,
    pub devices: Vec<SelfTestDevice>,
    pub checks: Vec<Check>,
    pub sample_cost: Option<SampleCost>,
    /// Resident memory of this process after the checks.
    pub rss_kib: Option<u64>,
    pub elapsed_ms: u64,
}

impl SelfTestReport {
    fn check(
        &mut self,
        name: &'static str,
        gpu: Option<&str>,
        status: CheckStatus,
        detail: String,
    ) {
        self.checks.push(Check {
            name,
            gpu: gpu.map(str::to_owned),
            status,
            detail,
        });
    }

    /// The checks that failed.
    pub fn failures(&self) -> Vec<&Check> {
        self.checks
            .iter()
            .filter(|check| check.status == CheckStatus::Fail)
            .collect()
    }

    /// One line per check, then a verdict.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "NVML self-test of {}", self.library);
        for check in &self.checks {
            let gpu = check
                .gpu
                .as_deref()
                .map(|gpu| format!(" [{gpu}]"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "{} {}{gpu}: {}",
                check.status.as_str(),
                check.name,
                check.detail
            );
        }
        if let Some(cost) = self.sample_cost {
            let _ = writeln!(
                out,
                "sample cost over {} samples: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
                cost.samples, cost.p50_ms, cost.p99_ms, cost.max_ms
            );
        }
        let verdict = if self.passed { "passed" } else { "FAILED" };
        let _ = writeln!(
            out,
            "self-test {verdict} ({} checks, {} failed) in {} ms",
            self.checks.len(),
            self.failures().len(),
            self.elapsed_ms
        );
        out
    }
}

/// Runs the read-only checks against the NVML at `library_path` (default:
/// `libnvidia-ml.so.1`). Never fails: problems are checks with status `fail`.
pub fn self_test(library_path: Option<&Path>) -> SelfTestReport {
    let started = Instant::now();
    let mut report = SelfTestReport {
        passed: false,
        library: library_path.map_or_else(
            || DEFAULT_LIBRARY.to_owned(),
            |path| path.display().to_string(),
        ),
        driver_version: None,
        nvml_version: None,
        field_id_scheme: None,
        device_count: None,
        devices: Vec::new(),
        checks: Vec::new(),
        sample_cost: None,
        rss_kib: None,
        elapsed_ms: 0,
    };

    match NvmlBackend::load(library_path) {
        Ok(backend) => {
            report.check(
                "nvml_init",
                None,
                CheckStatus::Pass,
                format!(
                    "driver {}, NVML {}",
                    backend.driver.driver_version, backend.driver.nvml_version
                ),
            );
            run_checks(&mut report, &backend);
        }
        Err(error) => report.check("nvml_init", None, CheckStatus::Fail, error.to_string()),
    }
    check_missing_library(&mut report);

    report.rss_kib = resident_kib();
    report.passed = report.failures().is_empty();
    report.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    report
}

fn run_checks(report: &mut SelfTestReport, backend: &NvmlBackend) {
    report.driver_version = Some(backend.driver.driver_version.clone());
    report.nvml_version = Some(backend.driver.nvml_version.clone());
    report.field_id_scheme = Some(format!("{:?}", backend.nvml.field_id_scheme()));
    let gpus = backend.gpus();
    report.device_count = Some(gpus.len());
    let (status, detail) = if gpus.is_empty() {
        (CheckStatus::Fail, "NVML sees no GPU".to_owned())
    } else {
        (CheckStatus::Pass, format!("{} GPU(s)", gpus.len()))
    };
    report.check("device_count", None, status, detail);

    for gpu in &gpus {
        let uuid = gpu.info.uuid.as_str();
        let device = match &gpu.device {
            Ok(device) => device,
            Err(error) => {
                report.check(
                    "device_handle",
                    Some(uuid),
                    CheckStatus::Fail,
                    error.to_string(),
                );
                continue;
            }
        };
        let status = if uuid.starts_with("GPU-") {
            CheckStatus::Pass
        } else {
            CheckStatus::Fail
        };
        report.check("uuid_format", Some(uuid), status, uuid.to_owned());

        let mut record = SelfTestDevice {
            index: gpu.info.index,
            uuid: uuid.to_owned(),
            name: gpu.info.name.clone(),
            sample: None,
            state: GpuState::Unknown,
            reasons: Vec::new(),
            raw_remapped_rows: raw_remapped_rows(device).ok(),
            raw_clock_event_reasons: raw_clock_event_reasons(device).ok(),
            supported_event_types: device
                .supported_event_types()
                .ok()
                .map(|types| types.bits()),
        };
        match read_sample(device) {
            Ok(sample) => {
                check_sample(report, uuid, &sample, &record);
                let health = Classifier::one_shot(&Options::default()).step(
                    Moment::now(),
                    &gpu.info,
                    Ok(sample.clone()),
                    &[],
                );
                let codes: Vec<&str> = health.reasons.iter().map(|r| r.code.as_str()).collect();
                let status = match health.state {
                    GpuState::Healthy => CheckStatus::Pass,
                    GpuState::Degraded => CheckStatus::Warn,
                    GpuState::Unknown | GpuState::Unhealthy => CheckStatus::Fail,
                };
                report.check(
                    "classifier_verdict",
                    Some(uuid),
                    status,
                    format!("{} {}", health.state.as_str(), codes.join(", "))
                        .trim_end()
                        .to_owned(),
                );
                record.state = health.state;
                record.reasons = health.reasons;
                record.sample = Some(sample);
            }
            Err(error) => report.check("sample", Some(uuid), CheckStatus::Fail, error.to_string()),
        }
        check_event_support(report, uuid, record.supported_event_types);
        report.devices.push(record);
    }

    check_event_waits(report, backend);
    measure_cost(report, backend);
}

fn check_sample(report: &mut SelfTestReport, uuid: &str, sample: &Sample, record: &SelfTestDevice) {
    use CheckStatus::{Fail, Pass, Warn};
    let gpu = Some(uuid);

    let (status, detail) = match sample.temperature_c {
        Some(t) if (15..=95).contains(&t) => (Pass, format!("{t} °C")),
        Some(t) => (Fail, format!("{t} °C is outside 15–95 °C")),
        None => (Fail, "unreadable".to_owned()),
    };
    report.check("temperature", gpu, status, detail);

    let (status, detail) = match (
        sample.temperature_c,
        sample.slowdown_temperature_c,
        sample.shutdown_temperature_c,
    ) {
        (Some(t), Some(slowdown), Some(shutdown)) if slowdown > t && shutdown > t => (
            Pass,
            format!("slowdown {slowdown} °C, shutdown {shutdown} °C"),
        ),
        (Some(t), Some(slowdown), Some(shutdown)) => (
            Fail,
            format!("{t} °C is not below slowdown {slowdown} °C and shutdown {shutdown} °C"),
        ),
        _ => (
            Warn,
            "thresholds unreadable: the thermal rule cannot run".to_owned(),
        ),
    };
    report.check("temperature_thresholds", gpu, status, detail);

    let (status, detail) = match (sample.power_mw, sample.power_limit_mw) {
        (Some(power), Some(limit)) if power > 0 && f64::from(power) <= 1.1 * f64::from(limit) => (
            Pass,
            format!(
                "{:.1} W of {:.0} W",
                f64::from(power) / 1e3,
                f64::from(limit) / 1e3
            ),
        ),
        (Some(power), Some(limit)) => (
            Fail,
            format!("{power} mW is not within (0, 1.1 × {limit} mW]"),
        ),
        _ => (Warn, "power or power limit unreadable".to_owned()),
    };
    report.check("power", gpu, status, detail);

    let (status, detail) = match (sample.memory_used_bytes, sample.memory_total_bytes) {
        (Some(used), Some(total)) if total > 0 && used <= total => {
            (Pass, format!("{used} of {total} bytes used"))
        }
        (Some(used), Some(total)) => (Fail, format!("used {used} > total {total}")),
        _ => (Fail, "memory info unreadable".to_owned()),
    };
    report.check("memory", gpu, status, detail);

    let (status, detail) = match (sample.gpu_utilization_pct, sample.memory_utilization_pct) {
        (Some(g), Some(m)) if g <= 100 && m <= 100 => (Pass, format!("gpu {g}%, memory {m}%")),
        (Some(g), Some(m)) => (Fail, format!("gpu {g}%, memory {m}% exceed 100%")),
        _ => (Warn, "utilization unreadable".to_owned()),
    };
    report.check("utilization", gpu, status, detail);

    let (status, detail) = match sample.ecc_enabled {
        Some(enabled) => (Pass, format!("ECC {}", if enabled { "on" } else { "off" })),
        None => (Warn, "ECC mode unreadable".to_owned()),
    };
    report.check("ecc_mode", gpu, status, detail);

    let ecc = sample.ecc;
    let (status, detail) = match ecc.uncorrected_volatile {
        Some(0) => (
            Pass,
            format!(
                "volatile {} corrected, 0 uncorrected; aggregate {} corrected, {} uncorrected",
                shown(ecc.corrected_volatile),
                shown(ecc.corrected_aggregate),
                shown(ecc.uncorrected_aggregate)
            ),
        ),
        Some(count) => (Fail, format!("{count} uncorrected volatile ECC errors")),
        None if sample.ecc_enabled == Some(true) => {
            (Fail, "ECC is on but its counters are unreadable".to_owned())
        }
        None => (Warn, "ECC counters unreadable".to_owned()),
    };
    report.check("ecc_counters", gpu, status, detail);

    let remap = sample.remapped_rows;
    let fields_read = remap.correctable.is_some()
        && remap.uncorrectable.is_some()
        && remap.pending.is_some()
        && remap.failure.is_some();
    let (status, detail) = match (fields_read, sample.mig_enabled) {
        (true, _) => (
            Pass,
            format!(
                "{} correctable, {} uncorrectable rows",
                shown(remap.correctable),
                shown(remap.uncorrectable)
            ),
        ),
        // NVML does not report remapped rows on MIG GPUs with active instances.
        (false, Some(true)) => (Warn, "not readable with MIG enabled".to_owned()),
        (false, _) => (Fail, "row-remapper fields 142–145 unreadable".to_owned()),
    };
    report.check("row_remap_fields", gpu, status, detail);

    let (status, detail) = match (remap.pending, remap.failure) {
        (Some(false), Some(false)) => (Pass, "no remap pending or failed".to_owned()),
        (Some(pending), Some(failure)) => (Fail, format!("pending {pending}, failure {failure}")),
        _ => (Warn, "remap flags unreadable".to_owned()),
    };
    report.check("row_remap_state", gpu, status, detail);

    let (status, detail) = match (record.raw_remapped_rows, fields_read) {
        (Some(raw), true) => {
            let via_fields = [
                remap.correctable,
                remap.uncorrectable,
                remap.pending.map(u64::from),
                remap.failure.map(u64::from),
            ];
            let raw_values = raw.map(|value| Some(u64::from(value)));
            if raw_values == via_fields {
                (Pass, format!("nvmlDeviceGetRemappedRows agrees: {raw:?}"))
            } else {
                (Fail, format!("raw {raw:?} vs fields {via_fields:?}"))
            }
        }
        (Some(raw), false) => (Warn, format!("raw {raw:?}, fields unreadable")),
        (None, _) => (Warn, "nvmlDeviceGetRemappedRows unavailable".to_owned()),
    };
    report.check("row_remap_raw", gpu, status, detail);

    let (status, detail) = match sample.recovery_action {
        Some(0) => (Pass, "none".to_owned()),
        Some(action) => (Fail, format!("recovery action {action} requested")),
        None => (
            Warn,
            "recovery-action field 230 unreadable (needs a newer driver)".to_owned(),
        ),
    };
    report.check("recovery_action", gpu, status, detail);

    let pcie = sample.pcie;
    let (status, detail) = match (
        pcie.replays,
        pcie.generation,
        pcie.width,
        pcie.max_generation,
        pcie.max_width,
    ) {
        (Some(replays), Some(generation), Some(width), Some(max_generation), Some(max_width))
            if generation <= max_generation && width <= max_width =>
        {
            (
                Pass,
                format!(
                    "gen {generation} x{width} (max gen {max_generation} x{max_width}), {replays} replays"
                ),
            )
        }
        (Some(_), Some(generation), Some(width), Some(max_generation), Some(max_width)) => (
            Fail,
            format!(
                "current gen {generation} x{width} exceeds max gen {max_generation} x{max_width}"
            ),
        ),
        _ => (Warn, format!("PCIe partly unreadable: {pcie:?}")),
    };
    report.check("pcie", gpu, status, detail);

    let known = crate::sample::CLOCK_EVENT_REASONS
        .iter()
        .fold(0u64, |mask, (bit, _)| mask | bit);
    let (status, detail) = match (sample.clock_event_reasons, record.raw_clock_event_reasons) {
        (Some(wrapped), Some(raw)) if wrapped == raw & known => (
            Pass,
            format!("0x{wrapped:x}, equal to nvmlDeviceGetCurrentClocksEventReasons"),
        ),
        // Two calls a moment apart can legitimately differ (e.g. gpu_idle flips).
        (Some(wrapped), Some(raw)) => (Warn, format!("wrapper 0x{wrapped:x}, raw 0x{raw:x}")),
        (Some(wrapped), None) => (
            Warn,
            format!("0x{wrapped:x}; raw clock-event call unavailable"),
        ),
        (None, _) => (Fail, "clock-event reasons unreadable".to_owned()),
    };
    report.check("clock_event_reasons", gpu, status, detail);

    let active = sample
        .nvlinks
        .iter()
        .filter(|link| link.active == Some(true))
        .count();
    report.check(
        "nvlink",
        gpu,
        Pass,
        format!(
            "{active} of {} answering link(s) active",
            sample.nvlinks.len()
        ),
    );

    let (status, detail) = match sample.mig_enabled {
        Some(enabled) => (
            Pass,
            format!("MIG {}", if enabled { "enabled" } else { "disabled" }),
        ),
        None => (Warn, "MIG mode unreadable".to_owned()),
    };
    report.check("mig_mode", gpu, status, detail);

    if !sample.failed.is_empty() {
        let failed: Vec<String> = sample
            .failed
            .iter()
            .map(|failure| format!("{}: {}", failure.signal, failure.error))
            .collect();
        report.check("signal_errors", gpu, Warn, failed.join("; "));
    }
    report.check(
        "absent_signals",
        gpu,
        Pass,
        if sample.absent.is_empty() {
            "none".to_owned()
        } else {
            sample.absent.join(", ")
        },
    );
}

fn check_event_support(report: &mut SelfTestReport, uuid: &str, supported: Option<u64>) {
    let (status, detail) = match supported.map(EventTypes::from_bits_truncate) {
        Some(types) if types.contains(EventTypes::CRITICAL_XID_ERROR) => (
            CheckStatus::Pass,
            format!("supported event types 0x{:x}", types.bits()),
        ),
        Some(types) => (
            CheckStatus::Fail,
            format!("XID events not supported (types 0x{:x})", types.bits()),
        ),
        None => (CheckStatus::Fail, "event types unreadable".to_owned()),
    };
    report.check("event_types", Some(uuid), status, detail);
}

fn check_event_waits(report: &mut SelfTestReport, backend: &NvmlBackend) {
    let registered = lock(&backend.events).is_some();
    let (status, detail) = match (&backend.event_problem, registered) {
        (None, true) => (CheckStatus::Pass, "every GPU registered".to_owned()),
        (Some(problem), true) => (CheckStatus::Warn, problem.clone()),
        (problem, false) => (
            CheckStatus::Fail,
            problem.clone().unwrap_or_else(|| "no event set".to_owned()),
        ),
    };
    report.check("event_registration", None, status, detail);
    if !registered {
        return;
    }
    let mut outcomes = Vec::new();
    let mut status = CheckStatus::Pass;
    for _ in 0..EVENT_WAITS {
        match backend.next_event(EVENT_WAIT) {
            Ok(None) => outcomes.push("timeout".to_owned()),
            Ok(Some(event)) => {
                status = CheckStatus::Warn;
                outcomes.push(format!("event {event:?}"));
            }
            Err(error) => {
                status = CheckStatus::Fail;
                outcomes.push(format!("error: {error}"));
            }
        }
    }
    report.check(
        "event_wait",
        None,
        status,
        format!(
            "{} × {} ms: {}",
            EVENT_WAITS,
            EVENT_WAIT.as_millis(),
            outcomes.join(", ")
        ),
    );
}

fn measure_cost(report: &mut SelfTestReport, backend: &NvmlBackend) {
    let uuids: Vec<String> = backend
        .gpus()
        .iter()
        .filter(|gpu| gpu.device.is_ok())
        .map(|gpu| gpu.info.uuid.clone())
        .collect();
    if uuids.is_empty() {
        return;
    }
    let mut timings = Vec::with_capacity(COST_SAMPLES * uuids.len());
    let mut errors = 0usize;
    for _ in 0..COST_SAMPLES {
        for uuid in &uuids {
            let started = Instant::now();
            if backend.sample(uuid).is_err() {
                errors += 1;
            }
            timings.push(started.elapsed());
        }
    }
    timings.sort();
    let at = |quantile: f64| {
        let rank = ((timings.len() as f64 - 1.0) * quantile).round() as usize;
        timings
            .get(rank)
            .map_or(0.0, |duration| duration.as_secs_f64() * 1000.0)
    };
    let cost = SampleCost {
        samples: timings.len(),
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        max_ms: at(1.0),
    };
    report.sample_cost = Some(cost);
    let target_ms = COST_TARGET.as_secs_f64() * 1000.0;
    let (status, detail) = if errors > 0 {
        (
            CheckStatus::Fail,
            format!("{errors} of {} samples failed", timings.len()),
        )
    } else if cost.p99_ms < target_ms {
        (
            CheckStatus::Pass,
            format!(
                "p99 {:.2} ms per GPU (target < {target_ms:.0} ms)",
                cost.p99_ms
            ),
        )
    } else {
        (
            CheckStatus::Warn,
            format!(
                "p99 {:.2} ms per GPU exceeds {target_ms:.0} ms",
                cost.p99_ms
            ),
        )
    };
    report.check("sample_cost", None, status, detail);
}

fn check_missing_library(report: &mut SelfTestReport) {
    let (status, detail) = match NvmlBackend::load(Some(Path::new(MISSING_LIBRARY))) {
        Err(Error::Unavailable(reason)) if reason.contains("not found") => {
            (CheckStatus::Pass, reason)
        }
        Err(other) => (CheckStatus::Fail, format!("unexpected error: {other}")),
        Ok(_) => (CheckStatus::Fail, "a missing library loaded".to_owned()),
    };
    report.check("missing_library", None, status, detail);
}

/// `nvmlDeviceGetRemappedRows`, which `nvml-wrapper` 0.13 does not wrap; used to
/// cross-check the field-value path the sampler uses.
fn raw_remapped_rows(device: &Device<'_>) -> Result<[u32; 4], NvmlError> {
    let symbol = nvml_sym(device.nvml().lib().nvmlDeviceGetRemappedRows.as_ref())?;
    let (mut correctable, mut uncorrectable, mut pending, mut failure) = (0u32, 0u32, 0u32, 0u32);
    #[expect(unsafe_code, reason = "nvmlDeviceGetRemappedRows has no safe wrapper")]
    // SAFETY: the handle belongs to a live `Device` of an `Nvml` that is never unloaded,
    // the symbol has the header's signature (bindgen), and the four out-pointers are
    // distinct, valid `u32`s for the duration of the call.
    let code = unsafe {
        symbol(
            device.handle(),
            &mut correctable,
            &mut uncorrectable,
            &mut pending,
            &mut failure,
        )
    };
    nvml_try(code)?;
    Ok([correctable, uncorrectable, pending, failure])
}

/// `nvmlDeviceGetCurrentClocksEventReasons`, the successor of the deprecated call that
/// `nvml-wrapper` wraps; the two must agree.
fn raw_clock_event_reasons(device: &Device<'_>) -> Result<u64, NvmlError> {
    let symbol = nvml_sym(
        device
            .nvml()
            .lib()
            .nvmlDeviceGetCurrentClocksEventReasons
            .as_ref(),
    )?;
    let mut reasons = 0u64;
    #[expect(
        unsafe_code,
        reason = "nvmlDeviceGetCurrentClocksEventReasons has no safe wrapper"
    )]
    // SAFETY: as in `raw_remapped_rows`; the out-pointer is a valid `u64`
    // (`unsigned long long`).
    let code = unsafe { symbol(device.handle(), &mut reasons) };
    nvml_try(code)?;
    Ok(reasons)
}

fn shown(value: Option<u64>) -> String {
    value.map_or_else(|| "n/a".to_owned(), |value| value.to_string())
}

/// Resident set size of this process, from the kernel (Linux only).
fn resident_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
}
