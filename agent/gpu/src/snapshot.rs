//! What everyone else reads: one immutable [`Snapshot`] of the node's GPU health, with
//! the readiness verdict, the text of `outrigger gpu`, the metric samples and the
//! hardware-fault timeline, all computed from cached state (never from NVML).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::SystemTime;

use outrigger_types::{GpuState, GpuSummary};
use serde::Serialize;

use crate::backend::{Error, EventStatus};
use crate::classify::{GpuHealth, Reason, ReasonCode, recovery_action_name};
use crate::options::Options;
use crate::sample::{CLOCK_EVENT_REASONS, clock_event_names};

/// Whether NVML is usable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum NvmlStatus {
    Up {
        driver_version: String,
        nvml_version: String,
    },
    /// No library, no driver or no permission; the reason says which.
    Unavailable { reason: String },
    /// GPU monitoring is switched off in the configuration.
    Disabled,
    /// The library is being loaded (off the caller's thread: loading can hang).
    Starting,
}

impl NvmlStatus {
    /// The status for a backend that could not be loaded.
    pub fn unavailable(error: Error) -> Self {
        let reason = match error {
            Error::Unavailable(reason) => reason,
            other => other.to_string(),
        };
        Self::Unavailable { reason }
    }
}

/// A period during which a GPU (or the node, `gpu == "node"`) was degraded or
/// unhealthy; the basis for charging errors to the `hardware` cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Incident {
    pub gpu: String,
    pub state: GpuState,
    pub reasons: Vec<ReasonCode>,
    #[serde(with = "crate::time")]
    pub from: SystemTime,
    /// `None` while it lasts.
    #[serde(with = "crate::time::option")]
    pub until: Option<SystemTime>,
}

impl Incident {
    /// Whether this incident overlaps `[started, ended]`.
    pub fn overlaps(&self, started: SystemTime, ended: SystemTime) -> bool {
        self.from <= ended && self.until.is_none_or(|until| until >= started)
    }
}

/// The node's GPU health at one moment. Serialises to the body of `GET /v1/gpu`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    pub nvml: NvmlStatus,
    /// Whether XID and ECC events reach the monitor. Not a health verdict: without
    /// events, fatal XIDs that leave no persistent state go unseen, so this is shown
    /// (and exported as `outrigger_gpu_events_up`) for operators to alert on.
    pub events: EventStatus,
    /// Every visible GPU, by NVML index.
    pub gpus: Vec<GpuHealth>,
    /// Node-level problems: missing GPUs, enumeration failures.
    pub problems: Vec<Reason>,
    /// The worst state over the watched GPUs, for the data plane and policies.
    pub summary: GpuSummary,
    /// Whether GPU health allows `/readyz` to pass.
    pub ready: bool,
    /// Why (or why not), in one line.
    pub ready_reason: String,
    /// When the last sampling round finished.
    #[serde(with = "crate::time::option")]
    pub sampled_at: Option<SystemTime>,
    /// Sampling rounds completed since start.
    pub rounds: u64,
    /// Increases with every published snapshot.
    pub generation: u64,
    /// How long the last sampling round took, all GPUs together.
    pub sample_duration_ms: Option<f64>,
    /// Degraded and unhealthy periods, oldest first (bounded).
    pub incidents: Vec<Incident>,
}

/// The kind of a metric sample, as Prometheus and OpenTelemetry see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricKind {
    Gauge,
    Counter,
}

/// One metric sample derived from a snapshot, ready to encode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricSample {
    /// The exposition name; counters end in `_total`.
    pub name: &'static str,
    pub kind: MetricKind,
    pub help: &'static str,
    pub labels: Vec<(&'static str, String)>,
    pub value: f64,
}

impl MetricSample {
    /// The metric family name (counters without their `_total` suffix), which is what
    /// `prometheus-client` registers.
    pub fn family(&self) -> &'static str {
        match self.kind {
            MetricKind::Counter => self.name.strip_suffix("_total").unwrap_or(self.name),
            MetricKind::Gauge => self.name,
        }
    }
}

/// The pieces a snapshot is made of; readiness and the summary are derived.
#[derive(Debug, Clone)]
pub(crate) struct Parts {
    pub nvml: NvmlStatus,
    pub events: EventStatus,
    pub gpus: Vec<GpuHealth>,
    pub problems: Vec<Reason>,
    pub sampled_at: Option<SystemTime>,
    pub rounds: u64,
    pub generation: u64,
    pub sample_duration_ms: Option<f64>,
    pub incidents: Vec<Incident>,
}

impl Snapshot {
    pub(crate) fn from_parts(parts: Parts, options: &Options) -> Self {
        let summary = summarize(&parts.nvml, &parts.gpus, &parts.problems);
        let (ready, ready_reason) = readiness(&parts.nvml, &parts.gpus, &parts.problems, options);
        Self {
            nvml: parts.nvml,
            events: parts.events,
            gpus: parts.gpus,
            problems: parts.problems,
            summary,
            ready,
            ready_reason,
            sampled_at: parts.sampled_at,
            rounds: parts.rounds,
            generation: parts.generation,
            sample_duration_ms: parts.sample_duration_ms,
            incidents: parts.incidents,
        }
    }

    /// A snapshot with no GPU data and the given NVML status.
    pub fn without_gpus(nvml: NvmlStatus, options: &Options) -> Self {
        Self::from_parts(
            Parts {
                nvml,
                events: EventStatus::Inactive,
                gpus: Vec::new(),
                problems: Vec::new(),
                sampled_at: None,
                rounds: 0,
                generation: 0,
                sample_duration_ms: None,
                incidents: Vec::new(),
            },
            options,
        )
    }

    /// The health of one GPU by UUID.
    pub fn gpu(&self, uuid: &str) -> Option<&GpuHealth> {
        self.gpus.iter().find(|gpu| gpu.uuid == uuid)
    }

    /// The most severe hardware incident overlapping `[started, ended]`, if any: an
    /// error that happened then is charged to the `hardware` cause.
    pub fn hardware_fault(&self, started: SystemTime, ended: SystemTime) -> Option<&Incident> {
        self.incidents
            .iter()
            .filter(|incident| incident.overlaps(started, ended))
            .max_by(|a, b| a.state.cmp(&b.state).then(b.from.cmp(&a.from)))
    }

    /// The human-readable report of `outrigger gpu`.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        match &self.nvml {
            NvmlStatus::Unavailable { reason } => {
                let _ = writeln!(out, "no NVML: {reason}");
                let _ = writeln!(
                    out,
                    "GPU health is unknown on this machine; Outrigger keeps running without it."
                );
                return out;
            }
            NvmlStatus::Disabled => {
                let _ = writeln!(out, "GPU monitoring is disabled in the configuration.");
                return out;
            }
            NvmlStatus::Starting => {
                let _ = writeln!(out, "NVML is still loading.");
                return out;
            }
            NvmlStatus::Up {
                driver_version,
                nvml_version,
            } => {
                let _ = writeln!(out, "NVIDIA driver {driver_version}, NVML {nvml_version}");
            }
        }
        let verdict = if self.ready { "ready" } else { "NOT READY" };
        let _ = writeln!(
            out,
            "{} GPU(s), overall {}: {verdict} ({})",
            self.gpus.len(),
            self.summary.state.as_str(),
            self.ready_reason
        );
        match &self.events {
            EventStatus::Up | EventStatus::Inactive => {}
            EventStatus::Partial(reason) => {
                let _ = writeln!(
                    out,
                    "XID events: NOT delivered for some GPUs ({reason}); their XIDs that \
                     leave no persistent state go unseen"
                );
            }
            EventStatus::Down(reason) => {
                let _ = writeln!(
                    out,
                    "XID events: NOT delivered ({reason}); XIDs that leave no persistent \
                     state go unseen"
                );
            }
        }
        for problem in &self.problems {
            let _ = writeln!(
                out,
                "node problem [{}] {}: {}",
                problem.severity.as_str(),
                problem.code.as_str(),
                problem.detail
            );
        }
        for gpu in &self.gpus {
            out.push('\n');
            render_gpu(&mut out, gpu);
        }
        out
    }

    /// Every metric this snapshot implies: Outrigger's own `outrigger_gpu_*` health
    /// metrics and the OpenTelemetry hardware semantic conventions (`hw.*`) in their
    /// Prometheus form. GPUs are labelled by UUID (`gpu`, `hw_id`).
    ///
    /// The samples of one family are contiguous (families in the order they first
    /// appear, GPUs by index within each), as the OpenMetrics text `/metrics` serves
    /// requires.
    pub fn metrics(&self) -> Vec<MetricSample> {
        let mut out = Vec::new();
        let up = matches!(self.nvml, NvmlStatus::Up { .. });
        push(
            &mut out,
            "outrigger_gpu_nvml_up",
            MetricKind::Gauge,
            "Whether NVML is loaded and answering (1) or not (0).",
            Vec::new(),
            flag(up),
        );
        if up {
            push(
                &mut out,
                "outrigger_gpu_events_up",
                MetricKind::Gauge,
                "Whether XID and ECC events of every GPU reach the monitor (1) or not (0); \
                 while 0, XIDs that leave no persistent state go unseen.",
                Vec::new(),
                flag(self.events.is_up()),
            );
        }
        push(
            &mut out,
            "outrigger_gpu_ready",
            MetricKind::Gauge,
            "Whether GPU health allows readiness.",
            Vec::new(),
            flag(self.ready),
        );
        push(
            &mut out,
            "outrigger_gpu_count",
            MetricKind::Gauge,
            "GPUs visible through NVML.",
            Vec::new(),
            self.gpus.len() as f64,
        );
        push(
            &mut out,
            "outrigger_gpu_sample_rounds_total",
            MetricKind::Counter,
            "Completed GPU sampling rounds.",
            Vec::new(),
            self.rounds as f64,
        );
        if let Some(sampled_at) = self.sampled_at {
            push(
                &mut out,
                "outrigger_gpu_last_sample_timestamp_seconds",
                MetricKind::Gauge,
                "When the last GPU sampling round finished (Unix time).",
                Vec::new(),
                crate::time::unix_seconds(sampled_at),
            );
        }
        if let Some(duration) = self.sample_duration_ms {
            push(
                &mut out,
                "outrigger_gpu_sample_duration_seconds",
                MetricKind::Gauge,
                "How long the last GPU sampling round took.",
                Vec::new(),
                duration / 1000.0,
            );
        }
        // Several problems can share a reason (too few GPUs, and a watched one not
        // visible); a label set must appear once.
        let mut reasons = BTreeSet::new();
        for problem in self
            .problems
            .iter()
            .filter(|problem| reasons.insert(problem.code))
        {
            push(
                &mut out,
                "outrigger_gpu_node_problem",
                MetricKind::Gauge,
                "Node-level GPU problems (missing GPUs, enumeration failures).",
                vec![("reason", problem.code.as_str().to_owned())],
                1.0,
            );
        }
        for gpu in &self.gpus {
            gpu_metrics(&mut out, gpu);
        }
        group_by_family(&mut out);
        out
    }
}

const STATES: [GpuState; 4] = [
    GpuState::Healthy,
    GpuState::Unknown,
    GpuState::Degraded,
    GpuState::Unhealthy,
];

/// Puts the samples of each family together, families in the order they first appear
/// and samples in their order within a family.
fn group_by_family(samples: &mut [MetricSample]) {
    let mut first_seen: Vec<&'static str> = Vec::new();
    for sample in samples.iter() {
        if !first_seen.contains(&sample.family()) {
            first_seen.push(sample.family());
        }
    }
    // A stable sort: within a family the order is kept.
    samples.sort_by_key(|sample| {
        first_seen
            .iter()
            .position(|family| *family == sample.family())
    });
}

fn flag(value: bool) -> f64 {
    if value { 1.0 } else { 0.0 }
}

fn push(
    out: &mut Vec<MetricSample>,
    name: &'static str,
    kind: MetricKind,
    help: &'static str,
    labels: Vec<(&'static str, String)>,
    value: f64,
) {
    out.push(MetricSample {
        name,
        kind,
        help,
        labels,
        value,
    });
}

fn gpu_metrics(out: &mut Vec<MetricSample>, gpu: &GpuHealth) {
    let own = |extra: &[(&'static str, String)]| {
        let mut labels = vec![("gpu", gpu.uuid.clone())];
        labels.extend_from_slice(extra);
        labels
    };
    let hw = |extra: &[(&'static str, String)]| {
        let mut labels = vec![("hw_id", gpu.uuid.clone()), ("hw_type", "gpu".to_owned())];
        labels.extend_from_slice(extra);
        labels
    };
    let signals = &gpu.signals;

    for state in STATES {
        push(
            out,
            "outrigger_gpu_health_state",
            MetricKind::Gauge,
            "GPU health state (1 for the current state).",
            own(&[("state", state.as_str().to_owned())]),
            flag(gpu.state == state),
        );
        push(
            out,
            "hw_status",
            MetricKind::Gauge,
            "Operational status of the hardware component (OpenTelemetry hw.status).",
            hw(&[("hw_state", state.hw_state().to_owned())]),
            flag(gpu.state == state),
        );
    }
    for reason in &gpu.reasons {
        push(
            out,
            "outrigger_gpu_health_reason",
            MetricKind::Gauge,
            "Why a GPU is not healthy (1 while the reason holds).",
            own(&[("reason", reason.code.as_str().to_owned())]),
            1.0,
        );
    }
    for (xid, count) in &gpu.xid_counts {
        push(
            out,
            "outrigger_gpu_xid_total",
            MetricKind::Counter,
            "XID events seen since start.",
            own(&[("xid", xid.clone())]),
            *count as f64,
        );
        push(
            out,
            "hw_errors_total",
            MetricKind::Counter,
            "Errors encountered by the hardware component (OpenTelemetry hw.errors).",
            hw(&[("error_type", format!("xid_{xid}"))]),
            *count as f64,
        );
    }
    for (error_type, count) in [
        ("corrected", signals.ecc.corrected_volatile),
        ("uncorrected", signals.ecc.uncorrected_volatile),
    ] {
        if let Some(count) = count {
            push(
                out,
                "hw_errors_total",
                MetricKind::Counter,
                "Errors encountered by the hardware component (OpenTelemetry hw.errors).",
                hw(&[("error_type", error_type.to_owned())]),
                count as f64,
            );
        }
    }
    if let Some(pct) = signals.gpu_utilization_pct {
        push(
            out,
            "hw_gpu_utilization",
            MetricKind::Gauge,
            "Fraction of time the GPU was busy (OpenTelemetry hw.gpu.utilization).",
            hw(&[("hw_gpu_task", "general".to_owned())]),
            f64::from(pct) / 100.0,
        );
    }
    if let Some(pct) = signals.memory_utilization_pct {
        push(
            out,
            "hw_gpu_memory_utilization",
            MetricKind::Gauge,
            "Fraction of time GPU memory was read or written (OpenTelemetry hw.gpu.memory.utilization).",
            hw(&[]),
            f64::from(pct) / 100.0,
        );
    }
    if let Some(bytes) = signals.memory_used_bytes {
        push(
            out,
            "hw_gpu_memory_usage_bytes",
            MetricKind::Gauge,
            "GPU memory in use (OpenTelemetry hw.gpu.memory.usage).",
            hw(&[]),
            bytes as f64,
        );
    }
    if let Some(bytes) = signals.memory_total_bytes {
        push(
            out,
            "hw_gpu_memory_limit_bytes",
            MetricKind::Gauge,
            "GPU memory size (OpenTelemetry hw.gpu.memory.limit).",
            hw(&[]),
            bytes as f64,
        );
    }
    if let Some(milliwatts) = signals.power_mw {
        push(
            out,
            "hw_power_watts",
            MetricKind::Gauge,
            "Instantaneous power draw (OpenTelemetry hw.power).",
            hw(&[]),
            f64::from(milliwatts) / 1000.0,
        );
    }
    if let Some(millijoules) = signals.energy_mj {
        push(
            out,
            "hw_energy_joules_total",
            MetricKind::Counter,
            "Energy consumed since the driver loaded (OpenTelemetry hw.energy).",
            hw(&[]),
            millijoules as f64 / 1000.0,
        );
    }
    if let Some(celsius) = signals.temperature_c {
        push(
            out,
            "outrigger_gpu_temperature_celsius",
            MetricKind::Gauge,
            "GPU core temperature.",
            own(&[]),
            f64::from(celsius),
        );
    }
    if let Some(replays) = signals.pcie.replays {
        push(
            out,
            "outrigger_gpu_pcie_replays_total",
            MetricKind::Counter,
            "PCIe replay counter.",
            own(&[]),
            replays as f64,
        );
    }
    let remap = signals.remapped_rows;
    for (kind, rows) in [
        ("correctable", remap.correctable),
        ("uncorrectable", remap.uncorrectable),
    ] {
        if let Some(rows) = rows {
            push(
                out,
                "outrigger_gpu_remapped_rows",
                MetricKind::Gauge,
                "Memory rows remapped, by the kind of error that caused it.",
                own(&[("type", kind.to_owned())]),
                rows as f64,
            );
        }
    }
    if let Some(pending) = remap.pending {
        push(
            out,
            "outrigger_gpu_row_remap_pending",
            MetricKind::Gauge,
            "Whether a row remap waits for a GPU reset.",
            own(&[]),
            flag(pending),
        );
    }
    if let Some(failure) = remap.failure {
        push(
            out,
            "outrigger_gpu_row_remap_failure",
            MetricKind::Gauge,
            "Whether row remapping has failed.",
            own(&[]),
            flag(failure),
        );
    }
    if let Some(action) = signals.recovery_action {
        push(
            out,
            "outrigger_gpu_recovery_action",
            MetricKind::Gauge,
            "The driver's GPU recovery action (0 none, 1 reset, 2 node reboot, 3 drain P2P, 4 drain and reset).",
            own(&[]),
            f64::from(action),
        );
    }
    for link in &signals.nvlinks {
        for (kind, count) in [
            ("replay", link.replay_errors),
            ("recovery", link.recovery_errors),
            ("crc_flit", link.crc_flit_errors),
            ("crc_data", link.crc_data_errors),
        ] {
            if let Some(count) = count {
                push(
                    out,
                    "outrigger_gpu_nvlink_errors_total",
                    MetricKind::Counter,
                    "NVLink error counters, per link.",
                    own(&[("link", link.link.to_string()), ("type", kind.to_owned())]),
                    count as f64,
                );
            }
        }
    }
    if let Some(bits) = signals.clock_event_reasons {
        for (bit, name) in CLOCK_EVENT_REASONS {
            push(
                out,
                "outrigger_gpu_clock_event_active",
                MetricKind::Gauge,
                "Whether a clock-event (throttle) reason is active.",
                own(&[("reason", name.to_owned())]),
                flag(bits & bit != 0),
            );
        }
    }
}

fn render_gpu(out: &mut String, gpu: &GpuHealth) {
    let watched = if gpu.watched { "" } else { " (not watched)" };
    let _ = writeln!(
        out,
        "GPU {}  {}  {}  {}{watched}",
        gpu.index,
        gpu.uuid,
        gpu.name,
        gpu.state.as_str().to_uppercase()
    );
    if !gpu.mig_devices.is_empty() {
        let _ = writeln!(out, "  MIG devices  {}", gpu.mig_devices.join(", "));
    }
    if gpu.reasons.is_empty() {
        let _ = writeln!(out, "  reasons: none");
    }
    for reason in &gpu.reasons {
        let _ = writeln!(
            out,
            "  [{}] {}: {} (since {})",
            reason.severity.as_str(),
            reason.code.as_str(),
            reason.detail,
            crate::time::rfc3339(reason.since)
        );
    }
    let s = &gpu.signals;
    let unknown = || "n/a".to_owned();
    let temperature = s.temperature_c.map_or_else(unknown, |t| format!("{t} °C"));
    let thresholds = match (s.slowdown_temperature_c, s.shutdown_temperature_c) {
        (Some(slowdown), Some(shutdown)) => {
            format!(" (slowdown {slowdown} °C, shutdown {shutdown} °C)")
        }
        _ => String::new(),
    };
    let _ = writeln!(out, "  temperature  {temperature}{thresholds}");
    let power = s
        .power_mw
        .map_or_else(unknown, |mw| format!("{:.1} W", f64::from(mw) / 1000.0));
    let limit = s.power_limit_mw.map_or_else(String::new, |mw| {
        format!(" of {:.0} W", f64::from(mw) / 1000.0)
    });
    let _ = writeln!(out, "  power        {power}{limit}");
    let _ = writeln!(
        out,
        "  utilization  gpu {}, memory {}",
        s.gpu_utilization_pct
            .map_or_else(unknown, |p| format!("{p}%")),
        s.memory_utilization_pct
            .map_or_else(unknown, |p| format!("{p}%"))
    );
    let gib = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
    let memory = match (s.memory_used_bytes, s.memory_total_bytes) {
        (Some(used), Some(total)) => format!("{:.1} of {:.1} GiB used", gib(used), gib(total)),
        _ => unknown(),
    };
    let _ = writeln!(out, "  memory       {memory}");
    let count = |value: Option<u64>| value.map_or_else(unknown, |v| v.to_string());
    let ecc_mode = match s.ecc_enabled {
        Some(true) => "on",
        Some(false) => "OFF",
        None => "n/a",
    };
    let _ = writeln!(
        out,
        "  ECC          {ecc_mode}; volatile {} corrected, {} uncorrected; aggregate {} corrected, {} uncorrected",
        count(s.ecc.corrected_volatile),
        count(s.ecc.uncorrected_volatile),
        count(s.ecc.corrected_aggregate),
        count(s.ecc.uncorrected_aggregate)
    );
    let yes_no = |value: Option<bool>| match value {
        Some(true) => "yes",
        Some(false) => "no",
        None => "n/a",
    };
    let remap = s.remapped_rows;
    let _ = writeln!(
        out,
        "  row remap    {} correctable, {} uncorrectable, pending {}, failure {}",
        count(remap.correctable),
        count(remap.uncorrectable),
        yes_no(remap.pending),
        yes_no(remap.failure)
    );
    if s.retired_pages.single_bit.is_some() || s.retired_pages.double_bit.is_some() {
        let _ = writeln!(
            out,
            "  retired      {} single-bit, {} double-bit pages, pending {}",
            count(s.retired_pages.single_bit),
            count(s.retired_pages.double_bit),
            yes_no(s.retired_pages.pending)
        );
    }
    let _ = writeln!(
        out,
        "  recovery     {}",
        s.recovery_action.map_or_else(unknown, recovery_action_name)
    );
    let clocks = s.clock_event_reasons.map_or_else(unknown, |bits| {
        let names = clock_event_names(bits);
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join(", ")
        }
    });
    let _ = writeln!(out, "  clock events {clocks}");
    let pcie = match (s.pcie.generation, s.pcie.width) {
        (Some(generation), Some(width)) => {
            let max = match (s.pcie.max_generation, s.pcie.max_width) {
                (Some(max_generation), Some(max_width)) => {
                    format!(" (max gen {max_generation} x{max_width})")
                }
                _ => String::new(),
            };
            format!(
                "gen {generation} x{width}{max}, {} replays",
                count(s.pcie.replays)
            )
        }
        _ => unknown(),
    };
    let _ = writeln!(out, "  PCIe         {pcie}");
    let active = s
        .nvlinks
        .iter()
        .filter(|link| link.active == Some(true))
        .count();
    let _ = writeln!(
        out,
        "  NVLink       {active} of {} link(s) active",
        s.nvlinks.len()
    );
    if gpu.xid_history.is_empty() {
        let _ = writeln!(out, "  XIDs         none seen");
    } else {
        let seen: Vec<String> = gpu
            .xid_history
            .iter()
            .map(|record| {
                let xid = record
                    .xid
                    .map_or_else(|| "unknown".to_owned(), |x| x.to_string());
                format!("{xid} at {}", crate::time::rfc3339(record.at))
            })
            .collect();
        let _ = writeln!(out, "  XIDs         {}", seen.join(", "));
    }
    if !s.absent.is_empty() {
        let _ = writeln!(out, "  unsupported  {}", s.absent.join(", "));
    }
    for failure in &s.failed {
        let _ = writeln!(out, "  unreadable   {}: {}", failure.signal, failure.error);
    }
    if let Some(error) = &gpu.last_error {
        let _ = writeln!(out, "  last error   {error}");
    }
}

/// The node summary over the watched GPUs.
fn summarize(nvml: &NvmlStatus, gpus: &[GpuHealth], problems: &[Reason]) -> GpuSummary {
    if !matches!(nvml, NvmlStatus::Up { .. }) {
        return GpuSummary::default();
    }
    let watched: Vec<&GpuHealth> = gpus.iter().filter(|gpu| gpu.watched).collect();
    let worst = watched
        .iter()
        .map(|gpu| gpu.state)
        .chain(problems.iter().map(|problem| problem.severity))
        .max()
        .unwrap_or(GpuState::Unknown);
    GpuSummary {
        state: worst,
        unhealthy: watched
            .iter()
            .filter(|gpu| gpu.state == GpuState::Unhealthy)
            .map(|gpu| gpu.uuid.clone())
            .collect(),
        present: !watched.is_empty(),
        ids: watched.iter().map(|gpu| gpu.uuid.clone()).collect(),
    }
}

/// The readiness verdict: not ready while a watched GPU is unhealthy (or a watched GPU
/// is missing); degraded and unknown count as ready unless the options say otherwise.
/// Liveness never looks at this.
pub fn readiness(
    nvml: &NvmlStatus,
    gpus: &[GpuHealth],
    problems: &[Reason],
    options: &Options,
) -> (bool, String) {
    let unknown_verdict = |what: String| {
        if options.unknown_is_ready {
            (true, format!("{what}; unknown GPU health counts as ready"))
        } else {
            (
                false,
                format!("{what}; unknown GPU health counts as not ready"),
            )
        }
    };
    match nvml {
        NvmlStatus::Disabled => return (true, "GPU monitoring disabled".to_owned()),
        NvmlStatus::Starting => return unknown_verdict("NVML is loading".to_owned()),
        NvmlStatus::Unavailable { reason } => return unknown_verdict(format!("no NVML: {reason}")),
        NvmlStatus::Up { .. } => {}
    }

    let mut blockers = Vec::new();
    for problem in problems {
        let blocks = match problem.severity {
            GpuState::Unhealthy => true,
            GpuState::Degraded => !options.degraded_is_ready,
            GpuState::Unknown => !options.unknown_is_ready,
            GpuState::Healthy => false,
        };
        if blocks {
            blockers.push(format!("{}: {}", problem.code.as_str(), problem.detail));
        }
    }
    let watched: Vec<&GpuHealth> = gpus.iter().filter(|gpu| gpu.watched).collect();
    for gpu in &watched {
        let blocks = match gpu.state {
            GpuState::Unhealthy => true,
            GpuState::Degraded => !options.degraded_is_ready,
            GpuState::Unknown => !options.unknown_is_ready,
            GpuState::Healthy => false,
        };
        if blocks {
            let codes: Vec<&str> = gpu.reasons.iter().map(|r| r.code.as_str()).collect();
            blockers.push(format!(
                "GPU {} {} {}: {}",
                gpu.index,
                gpu.uuid,
                gpu.state.as_str(),
                codes.join(", ")
            ));
        }
    }
    if !blockers.is_empty() {
        return (false, blockers.join("; "));
    }
    if watched.is_empty() {
        return unknown_verdict("no watched GPU is visible".to_owned());
    }
    let count = |state: GpuState| watched.iter().filter(|gpu| gpu.state == state).count();
    let mut parts = Vec::new();
    for state in STATES {
        let n = count(state);
        if n > 0 {
            parts.push(format!("{n} {}", state.as_str()));
        }
    }
    (
        true,
        format!("{} watched GPU(s): {}", watched.len(), parts.join(", ")),
    )
}

#[cfg(test)]
mod tests;
