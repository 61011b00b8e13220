//! The health model: samples, events and the passage of time in, one [`GpuHealth`] per
//! GPU out. Pure (no clock, no I/O), so every rule is a table test.
//!
//! Severity is asymmetric, as the reference recommends:
//! - **unhealthy** enters on a single fatal signal and is latched until the process
//!   restarts (XIDs are edge-triggered and the driver may say nothing afterwards), with
//!   one exception: a stale sample is "we cannot see", not "the GPU is broken", so it
//!   lasts only while the staleness does;
//! - **degraded** gauge conditions need `degraded_enter_samples` consecutive bad samples
//!   to enter, counter and event conditions enter at once, and every degraded
//!   condition clears only after it has been absent for `degraded_clear_after`;
//! - **unknown** means no successful sample yet.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant, SystemTime};

use outrigger_types::GpuState;
use serde::Serialize;

use crate::backend::{DeviceInfo, Error, Event};
use crate::clock::Moment;
use crate::options::Options;
use crate::sample::{SLOWDOWN_REASONS, Sample, clock_event_names};

/// How many XIDs a GPU's history keeps.
pub const XID_HISTORY_LEN: usize = 32;

/// Counter rules look at deltas over this window (as DCGM does).
const COUNTER_WINDOW: Duration = Duration::from_secs(60);
/// Temperature must fall this far below the slowdown threshold before the thermal
/// condition counts as gone.
const THERMAL_EXIT_BAND_C: u32 = 5;
/// At or above `shutdown - THERMAL_CRITICAL_MARGIN_C` the GPU is about to power off.
const THERMAL_CRITICAL_MARGIN_C: u32 = 2;
const REMAPPED_ROWS_UNCORRECTABLE_LIMIT: u64 = 512;
const RETIRED_PAGES_LIMIT: u64 = 63;
const NVLINK_CRC_BURST_PER_SECOND: f64 = 100.0;
/// The readings that show NVML can still talk to the GPU. A sample in which every one
/// of them failed (a wedged GPU answers each call with `UNKNOWN`) is no sign of life
/// and counts as a failed sample for staleness.
const CORE_SIGNALS: [&str; 3] = ["temperature", "memory", "power"];
/// XID 154 only announces that the recovery-action field changed; the next sample
/// reads that field and judges it (the reference: "severity from that value"). Where
/// the field cannot be read, 154 counts as any other XID.
const XID_RECOVERY_ACTION_CHANGED: u64 = 154;

/// Why a GPU is not healthy. A bounded set, so it can label a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasonCode {
    GpuLost,
    ResetRequired,
    RecoveryAction,
    XidFatal,
    Xid,
    EccUncorrected,
    EccDisabled,
    RowRemapFailure,
    RowRemapPending,
    RemappedRowsHigh,
    RetiredPagesHigh,
    RetiredPagesPending,
    NvlinkDown,
    NvlinkRecoveryErrors,
    NvlinkReplayErrors,
    NvlinkCrcBurst,
    NvlinkCrcErrors,
    PcieReplayRate,
    PcieLinkWidth,
    ThermalCritical,
    Thermal,
    ClockSlowdown,
    PowerUnreadable,
    StaleSample,
    NoSample,
    /// Node level: fewer GPUs than expected, or a watched GPU is not visible.
    GpuMissing,
    /// Node level: NVML could not list the GPUs.
    EnumerationFailed,
    /// Node level: NVML itself is not there.
    NvmlUnavailable,
}

impl ReasonCode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::GpuLost => "gpu_lost",
            Self::ResetRequired => "reset_required",
            Self::RecoveryAction => "recovery_action",
            Self::XidFatal => "xid_fatal",
            Self::Xid => "xid",
            Self::EccUncorrected => "ecc_uncorrected",
            Self::EccDisabled => "ecc_disabled",
            Self::RowRemapFailure => "row_remap_failure",
            Self::RowRemapPending => "row_remap_pending",
            Self::RemappedRowsHigh => "remapped_rows_high",
            Self::RetiredPagesHigh => "retired_pages_high",
            Self::RetiredPagesPending => "retired_pages_pending",
            Self::NvlinkDown => "nvlink_down",
            Self::NvlinkRecoveryErrors => "nvlink_recovery_errors",
            Self::NvlinkReplayErrors => "nvlink_replay_errors",
            Self::NvlinkCrcBurst => "nvlink_crc_burst",
            Self::NvlinkCrcErrors => "nvlink_crc_errors",
            Self::PcieReplayRate => "pcie_replay_rate",
            Self::PcieLinkWidth => "pcie_link_width",
            Self::ThermalCritical => "thermal_critical",
            Self::Thermal => "thermal",
            Self::ClockSlowdown => "hw_slowdown",
            Self::PowerUnreadable => "power_unreadable",
            Self::StaleSample => "stale_sample",
            Self::NoSample => "no_sample",
            Self::GpuMissing => "gpu_missing",
            Self::EnumerationFailed => "enumeration_failed",
            Self::NvmlUnavailable => "nvml_unavailable",
        }
    }
}

/// One reason, with the severity it imposes and since when it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reason {
    pub code: ReasonCode,
    pub severity: GpuState,
    pub detail: String,
    #[serde(with = "crate::time")]
    pub since: SystemTime,
}

/// One XID seen on a GPU; `xid` is `None` when the driver reported it as unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct XidRecord {
    #[serde(with = "crate::time")]
    pub at: SystemTime,
    pub xid: Option<u64>,
}

/// Health of one GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuHealth {
    pub uuid: String,
    pub index: u32,
    pub name: String,
    /// The MIG devices (`MIG-…`) this GPU is partitioned into; they share its health.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<String>,
    /// Whether this GPU gates readiness (see `Options::watch`).
    pub watched: bool,
    pub state: GpuState,
    /// Most severe first.
    pub reasons: Vec<Reason>,
    /// The last successful sample (all `None` before the first one).
    pub signals: Sample,
    #[serde(with = "crate::time::option")]
    pub last_sampled_at: Option<SystemTime>,
    /// Why the last sample failed, when it did.
    pub last_error: Option<Error>,
    /// The most recent XIDs, oldest first (bounded).
    pub xid_history: Vec<XidRecord>,
    /// Every XID seen since start, by code (`unknown` for undecodable ones).
    pub xid_counts: BTreeMap<String, u64>,
    /// Double-bit ECC events seen since start.
    pub uncorrected_ecc_events: u64,
}

impl GpuHealth {
    /// The reason codes, most severe first.
    pub fn reason_codes(&self) -> Vec<ReasonCode> {
        self.reasons.iter().map(|reason| reason.code).collect()
    }
}

/// A degraded condition under hysteresis.
#[derive(Debug, Clone)]
struct Condition {
    consecutive_bad: u32,
    last_bad: Instant,
    active_since: Option<SystemTime>,
    detail: String,
}

/// A counter's recent values, to judge its delta over [`COUNTER_WINDOW`].
#[derive(Debug, Clone, Default)]
struct CounterWindow {
    points: VecDeque<(Instant, u64)>,
}

impl CounterWindow {
    fn push(&mut self, at: Instant, value: u64) {
        // A counter that went down was reset (driver reload, GPU reset): start over
        // rather than compute a negative or absolute delta.
        if self.points.back().is_some_and(|&(_, last)| value < last) {
            self.points.clear();
        }
        self.points.push_back((at, value));
        while self.points.len() > 1
            && self
                .points
                .front()
                .is_some_and(|&(first, _)| at.duration_since(first) > COUNTER_WINDOW)
        {
            self.points.pop_front();
        }
    }

    fn delta(&self) -> u64 {
        match (self.points.front(), self.points.back()) {
            (Some(&(_, first)), Some(&(_, last))) => last - first,
            _ => 0,
        }
    }

    fn per_second(&self) -> Option<f64> {
        let (&(first_at, _), &(last_at, _)) = (self.points.front()?, self.points.back()?);
        let span = last_at.duration_since(first_at).as_secs_f64();
        (span > 0.0).then(|| self.delta() as f64 / span)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Counter {
    PcieReplays,
    NvlinkReplay(u32),
    NvlinkRecovery(u32),
    /// The two CRC counters keep a window each: one failed read of either must not
    /// look like a reset of their sum (and its recovery like a burst of errors).
    NvlinkCrcFlit(u32),
    NvlinkCrcData(u32),
}

/// A sample-driven finding before hysteresis.
struct Finding {
    code: ReasonCode,
    severity: GpuState,
    detail: String,
    /// Gauge conditions must persist for several samples; counters and flags enter at once.
    sustained: bool,
}

impl Finding {
    fn unhealthy(code: ReasonCode, detail: String) -> Self {
        Self {
            code,
            severity: GpuState::Unhealthy,
            detail,
            sustained: false,
        }
    }

    fn degraded(code: ReasonCode, detail: String) -> Self {
        Self {
            code,
            severity: GpuState::Degraded,
            detail,
            sustained: false,
        }
    }

    fn sustained(code: ReasonCode, detail: String) -> Self {
        Self {
            sustained: true,
            ..Self::degraded(code, detail)
        }
    }
}

/// Everything remembered about one GPU.
#[derive(Debug, Clone)]
struct Track {
    device: DeviceInfo,
    first_seen: Moment,
    latched: BTreeMap<ReasonCode, Reason>,
    conditions: BTreeMap<ReasonCode, Condition>,
    last_ok: Option<Moment>,
    last_error: Option<Error>,
    signals: Sample,
    counters: BTreeMap<Counter, CounterWindow>,
    /// Each link's state the first time it was read; only links active then can
    /// "go down".
    nvlink_baseline: BTreeMap<u32, bool>,
    xid_history: VecDeque<XidRecord>,
    xid_counts: BTreeMap<String, u64>,
    uncorrected_ecc_events: u64,
    /// An XID 154 arrived: the next sample must be able to read the recovery action.
    recovery_action_changed: bool,
}

impl Track {
    fn new(device: DeviceInfo, now: Moment) -> Self {
        Self {
            device,
            first_seen: now,
            latched: BTreeMap::new(),
            conditions: BTreeMap::new(),
            last_ok: None,
            last_error: None,
            signals: Sample::default(),
            counters: BTreeMap::new(),
            nvlink_baseline: BTreeMap::new(),
            xid_history: VecDeque::new(),
            xid_counts: BTreeMap::new(),
            uncorrected_ecc_events: 0,
            recovery_action_changed: false,
        }
    }

    fn latch(&mut self, now: Moment, code: ReasonCode, detail: String) {
        // The first cause is the one worth reporting; later repeats keep it.
        self.latched.entry(code).or_insert(Reason {
            code,
            severity: GpuState::Unhealthy,
            detail,
            since: now.wall,
        });
    }

    fn mark_bad(&mut self, now: Moment, code: ReasonCode, detail: String, needed: u32) {
        let condition = self.conditions.entry(code).or_insert(Condition {
            consecutive_bad: 0,
            last_bad: now.mono,
            active_since: None,
            detail: String::new(),
        });
        condition.consecutive_bad = condition.consecutive_bad.saturating_add(1);
        condition.last_bad = now.mono;
        condition.detail = detail;
        if condition.active_since.is_none() && condition.consecutive_bad >= needed {
            condition.active_since = Some(now.wall);
        }
    }

    fn condition_active(&self, code: ReasonCode) -> bool {
        self.conditions
            .get(&code)
            .is_some_and(|condition| condition.active_since.is_some())
    }

    fn counter(&mut self, counter: Counter, at: Instant, value: u64) -> &CounterWindow {
        let window = self.counters.entry(counter).or_default();
        window.push(at, value);
        window
    }
}

/// The thresholds the classifier applies, taken from [`Options`].
#[derive(Debug, Clone)]
struct Policy {
    fatal_xids: BTreeSet<u64>,
    ignored_xids: BTreeSet<u64>,
    enter_samples: u32,
    clear_after: Duration,
    stale_degraded_after: Duration,
    stale_unhealthy_after: Duration,
}

/// Turns samples and events into health, per GPU, with memory (hysteresis, latches,
/// counter windows, XID history). Time is always passed in.
#[derive(Debug, Clone)]
pub struct Classifier {
    policy: Policy,
    gpus: BTreeMap<String, Track>,
}

impl Classifier {
    pub fn new(options: &Options) -> Self {
        Self {
            policy: Policy {
                fatal_xids: options.fatal_xids.clone(),
                ignored_xids: options.ignored_xids.clone(),
                enter_samples: options.degraded_enter_samples.max(1),
                clear_after: options.degraded_clear_after,
                stale_degraded_after: options.stale_degraded_after(),
                stale_unhealthy_after: options.stale_unhealthy_after(),
            },
            gpus: BTreeMap::new(),
        }
    }

    /// A classifier for a single look (`outrigger gpu`): with no history, a condition
    /// present in the one sample is reported rather than waited for.
    pub fn one_shot(options: &Options) -> Self {
        let mut classifier = Self::new(options);
        classifier.policy.enter_samples = 1;
        classifier
    }

    /// Starts tracking a GPU before its first sample, so staleness counts from now.
    pub fn track(&mut self, now: Moment, device: &DeviceInfo) {
        self.gpus
            .entry(device.uuid.clone())
            .or_insert_with(|| Track::new(device.clone(), now));
    }

    /// Forgets a GPU that is no longer listed.
    pub fn untrack(&mut self, uuid: &str) {
        self.gpus.remove(uuid);
    }

    /// One sampling step for one GPU: its events since the last step, then its sample.
    pub fn step(
        &mut self,
        now: Moment,
        device: &DeviceInfo,
        sample: Result<Sample, Error>,
        events: &[Event],
    ) -> GpuHealth {
        self.track(now, device);
        for event in events {
            self.apply_event(now, event);
        }
        if let Some(track) = self.gpus.get_mut(&device.uuid) {
            track.device = device.clone();
            match sample {
                Ok(sample) => apply_sample(&self.policy, track, now, sample),
                Err(error) => apply_failure(track, now, error),
            }
        }
        self.evaluate(now, &device.uuid)
            .unwrap_or_else(|| untracked(device))
    }

    /// Applies events that arrived between samples; returns the health of every GPU
    /// they touched. An event for a GPU this classifier does not know is applied to
    /// every GPU, as the NVIDIA device plugin does: a fault that cannot be placed must
    /// not be dropped.
    pub fn observe_events(&mut self, now: Moment, events: &[Event]) -> Vec<GpuHealth> {
        let mut touched = BTreeSet::new();
        for event in events {
            if self.gpus.contains_key(event.uuid()) {
                touched.insert(event.uuid().to_owned());
            } else {
                touched.extend(self.gpus.keys().cloned());
            }
            self.apply_event(now, event);
        }
        touched
            .iter()
            .filter_map(|uuid| self.evaluate(now, uuid))
            .collect()
    }

    /// Re-evaluates one GPU at `now` without new data: conditions whose quiet period
    /// ended clear, and staleness grows.
    pub fn health(&mut self, now: Moment, uuid: &str) -> Option<GpuHealth> {
        self.evaluate(now, uuid)
    }

    fn apply_event(&mut self, now: Moment, event: &Event) {
        let targets: Vec<String> = if self.gpus.contains_key(event.uuid()) {
            vec![event.uuid().to_owned()]
        } else {
            self.gpus.keys().cloned().collect()
        };
        for uuid in targets {
            let Some(track) = self.gpus.get_mut(&uuid) else {
                continue;
            };
            match event {
                Event::Xid { xid, .. } => {
                    track.xid_history.push_back(XidRecord {
                        at: now.wall,
                        xid: *xid,
                    });
                    while track.xid_history.len() > XID_HISTORY_LEN {
                        track.xid_history.pop_front();
                    }
                    let key = xid.map_or_else(|| "unknown".to_owned(), |xid| xid.to_string());
                    *track.xid_counts.entry(key).or_default() += 1;
                    match xid {
                        Some(xid) if self.policy.fatal_xids.contains(xid) => {
                            track.latch(now, ReasonCode::XidFatal, describe_xid(*xid));
                        }
                        Some(xid) if self.policy.ignored_xids.contains(xid) => {}
                        Some(XID_RECOVERY_ACTION_CHANGED) => {
                            track.recovery_action_changed = true;
                        }
                        Some(xid) => track.mark_bad(now, ReasonCode::Xid, describe_xid(*xid), 1),
                        None => track.mark_bad(
                            now,
                            ReasonCode::Xid,
                            "XID of a type the driver could not report".to_owned(),
                            1,
                        ),
                    }
                }
                Event::DoubleBitEcc { .. } => {
                    track.uncorrected_ecc_events += 1;
                    track.latch(
                        now,
                        ReasonCode::EccUncorrected,
                        "double-bit (uncorrectable) ECC error event".to_owned(),
                    );
                }
            }
        }
    }

    fn evaluate(&mut self, now: Moment, uuid: &str) -> Option<GpuHealth> {
        let policy = &self.policy;
        let track = self.gpus.get_mut(uuid)?;
        track
            .conditions
            .retain(|_, condition| match condition.active_since {
                Some(_) => {
                    now.mono.saturating_duration_since(condition.last_bad) < policy.clear_after
                }
                // A condition still counting towards entry lives only while it is bad.
                None => condition.consecutive_bad > 0,
            });

        let mut reasons: Vec<Reason> = track.latched.values().cloned().collect();
        reasons.extend(track.conditions.iter().filter_map(|(code, condition)| {
            condition.active_since.map(|since| Reason {
                code: *code,
                severity: GpuState::Degraded,
                detail: condition.detail.clone(),
                since,
            })
        }));

        let seen_since = track.last_ok.unwrap_or(track.first_seen);
        let age = now.mono.saturating_duration_since(seen_since.mono);
        let stale_severity = if age > policy.stale_unhealthy_after {
            Some(GpuState::Unhealthy)
        } else if age > policy.stale_degraded_after {
            Some(GpuState::Degraded)
        } else {
            None
        };
        if let Some(severity) = stale_severity {
            let why = track
                .last_error
                .as_ref()
                .map(|error| format!(": {error}"))
                .unwrap_or_default();
            reasons.push(Reason {
                code: ReasonCode::StaleSample,
                severity,
                detail: format!("no successful sample for {}s{why}", age.as_secs()),
                since: seen_since.wall,
            });
        } else if track.last_ok.is_none() && reasons.is_empty() {
            reasons.push(Reason {
                code: ReasonCode::NoSample,
                severity: GpuState::Unknown,
                detail: track.last_error.as_ref().map_or_else(
                    || "not sampled yet".to_owned(),
                    |error| format!("no successful sample: {error}"),
                ),
                since: track.first_seen.wall,
            });
        }
        reasons.sort_by(|a, b| b.severity.cmp(&a.severity).then(a.code.cmp(&b.code)));
        let state = reasons
            .iter()
            .map(|reason| reason.severity)
            .max()
            .unwrap_or(GpuState::Healthy);

        Some(GpuHealth {
            uuid: track.device.uuid.clone(),
            index: track.device.index,
            name: track.device.name.clone(),
            mig_devices: track.device.mig_devices.clone(),
            watched: true,
            state,
            reasons,
            signals: track.signals.clone(),
            last_sampled_at: track.last_ok.map(|moment| moment.wall),
            last_error: track.last_error.clone(),
            xid_history: track.xid_history.iter().copied().collect(),
            xid_counts: track.xid_counts.clone(),
            uncorrected_ecc_events: track.uncorrected_ecc_events,
        })
    }
}

fn untracked(device: &DeviceInfo) -> GpuHealth {
    GpuHealth {
        uuid: device.uuid.clone(),
        index: device.index,
        name: device.name.clone(),
        mig_devices: device.mig_devices.clone(),
        watched: true,
        state: GpuState::Unknown,
        reasons: Vec::new(),
        signals: Sample::default(),
        last_sampled_at: None,
        last_error: None,
        xid_history: Vec::new(),
        xid_counts: BTreeMap::new(),
        uncorrected_ecc_events: 0,
    }
}

fn apply_failure(track: &mut Track, now: Moment, error: Error) {
    match &error {
        Error::GpuLost => track.latch(now, ReasonCode::GpuLost, error.to_string()),
        Error::ResetRequired => track.latch(now, ReasonCode::ResetRequired, error.to_string()),
        // No data: staleness (or `unknown`) speaks for it.
        Error::Unavailable(_) | Error::NotSupported(_) | Error::UnknownGpu(_) | Error::Other(_) => {
        }
    }
    track.last_error = Some(error);
}

/// Why `sample` counts as failed: none of its core readings succeeded and at least one
/// failed (a GPU that merely lacks them is not blind).
fn blind(sample: &Sample) -> Option<String> {
    let read = sample.temperature_c.is_some()
        || sample.memory_total_bytes.is_some()
        || sample.power_mw.is_some();
    if read {
        return None;
    }
    let failures: Vec<String> = sample
        .failed
        .iter()
        .filter(|failure| CORE_SIGNALS.contains(&failure.signal.as_str()))
        .map(|failure| format!("{}: {}", failure.signal, failure.error))
        .collect();
    (!failures.is_empty()).then(|| format!("no core reading succeeded ({})", failures.join("; ")))
}

fn apply_sample(policy: &Policy, track: &mut Track, now: Moment, sample: Sample) {
    let blind = blind(&sample);
    let findings = findings(track, now, &sample);
    let bad: BTreeSet<ReasonCode> = findings.iter().map(|finding| finding.code).collect();
    for finding in findings {
        match finding.severity {
            GpuState::Unhealthy => track.latch(now, finding.code, finding.detail),
            GpuState::Healthy | GpuState::Unknown | GpuState::Degraded => {
                let needed = if finding.sustained {
                    policy.enter_samples
                } else {
                    1
                };
                track.mark_bad(now, finding.code, finding.detail, needed);
            }
        }
    }
    if let Some(why) = blind {
        // What it did read still counts (findings above), but it is no successful
        // sample: staleness grows, and streaks it could not judge are left as they are.
        track.last_error = Some(Error::Other(why));
        return;
    }
    // A good sample breaks every sample-driven streak (XIDs are event-driven and only
    // clear by time).
    for (code, condition) in &mut track.conditions {
        if *code != ReasonCode::Xid && !bad.contains(code) {
            condition.consecutive_bad = 0;
        }
    }
    track.last_ok = Some(now);
    track.last_error = None;
    track.signals = sample;
}

/// Every rule of the reference's classification table that a sample can trigger.
fn findings(track: &mut Track, now: Moment, sample: &Sample) -> Vec<Finding> {
    let mut found = Vec::new();

    if std::mem::take(&mut track.recovery_action_changed) && sample.recovery_action.is_none() {
        found.push(Finding::degraded(
            ReasonCode::Xid,
            format!(
                "{}, but the recovery action cannot be read",
                describe_xid(XID_RECOVERY_ACTION_CHANGED)
            ),
        ));
    }
    if let Some(action) = sample.recovery_action.filter(|&action| action != 0) {
        found.push(Finding::unhealthy(
            ReasonCode::RecoveryAction,
            format!(
                "the driver asks for recovery: {}",
                recovery_action_name(action)
            ),
        ));
    }
    if let Some(count) = sample.ecc.uncorrected_volatile.filter(|&count| count > 0) {
        found.push(Finding::unhealthy(
            ReasonCode::EccUncorrected,
            format!("{count} uncorrectable ECC error(s) since the driver loaded"),
        ));
    }
    if sample.ecc_enabled == Some(false) {
        found.push(Finding::degraded(
            ReasonCode::EccDisabled,
            "ECC is disabled".to_owned(),
        ));
    }

    let remap = sample.remapped_rows;
    if remap.failure == Some(true) {
        found.push(Finding::unhealthy(
            ReasonCode::RowRemapFailure,
            "row remapping failed".to_owned(),
        ));
    }
    if remap.pending == Some(true) {
        found.push(Finding::degraded(
            ReasonCode::RowRemapPending,
            "a row remap is pending (needs a GPU reset)".to_owned(),
        ));
    }
    if let Some(rows) = remap
        .uncorrectable
        .filter(|&rows| rows >= REMAPPED_ROWS_UNCORRECTABLE_LIMIT)
    {
        found.push(Finding::degraded(
            ReasonCode::RemappedRowsHigh,
            format!("{rows} rows remapped for uncorrectable errors"),
        ));
    }

    let pages = sample.retired_pages;
    let retired = pages.single_bit.unwrap_or(0) + pages.double_bit.unwrap_or(0);
    if retired >= RETIRED_PAGES_LIMIT {
        found.push(Finding::unhealthy(
            ReasonCode::RetiredPagesHigh,
            format!("{retired} memory pages retired"),
        ));
    }
    if pages.pending == Some(true) {
        found.push(Finding::degraded(
            ReasonCode::RetiredPagesPending,
            "page retirement pending (needs a reboot)".to_owned(),
        ));
    }

    nvlink_findings(track, now, sample, &mut found);

    let pcie = sample.pcie;
    if let Some(replays) = pcie.replays {
        let delta = track
            .counter(Counter::PcieReplays, now.mono, replays)
            .delta();
        let limit = pcie
            .generation
            .zip(pcie.width)
            .and_then(|(generation, width)| pcie_replay_limit(generation, width));
        if let Some(limit) = limit.filter(|&limit| delta > limit) {
            found.push(Finding::degraded(
                ReasonCode::PcieReplayRate,
                format!("{delta} PCIe replays in the last minute (limit {limit})"),
            ));
        }
    }
    if let (Some(width), Some(max_width)) = (pcie.width, pcie.max_width)
        && width < max_width
    {
        found.push(Finding::sustained(
            ReasonCode::PcieLinkWidth,
            format!("PCIe link at x{width} of x{max_width}"),
        ));
    }

    if let Some(temperature) = sample.temperature_c {
        if let Some(shutdown) = sample.shutdown_temperature_c
            && temperature + THERMAL_CRITICAL_MARGIN_C >= shutdown
        {
            found.push(Finding::unhealthy(
                ReasonCode::ThermalCritical,
                format!("{temperature} °C, shutdown at {shutdown} °C"),
            ));
        }
        if let Some(slowdown) = sample.slowdown_temperature_c {
            let still_hot = track.condition_active(ReasonCode::Thermal)
                && temperature > slowdown.saturating_sub(THERMAL_EXIT_BAND_C);
            if temperature >= slowdown || still_hot {
                found.push(Finding::sustained(
                    ReasonCode::Thermal,
                    format!("{temperature} °C, slowdown at {slowdown} °C"),
                ));
            }
        }
    }

    if let Some(bits) = sample
        .clock_event_reasons
        .filter(|bits| bits & SLOWDOWN_REASONS != 0)
    {
        found.push(Finding::sustained(
            ReasonCode::ClockSlowdown,
            format!(
                "clocks cut by {}",
                clock_event_names(bits & SLOWDOWN_REASONS).join(", ")
            ),
        ));
    }

    if sample.signal_failed("power") {
        found.push(Finding::sustained(
            ReasonCode::PowerUnreadable,
            "power draw unreadable".to_owned(),
        ));
    }
    found
}

fn nvlink_findings(track: &mut Track, now: Moment, sample: &Sample, found: &mut Vec<Finding>) {
    if sample.nvlinks.is_empty() {
        return;
    }
    for link in &sample.nvlinks {
        if let Some(active) = link.active {
            track.nvlink_baseline.entry(link.link).or_insert(active);
        }
    }
    // NVML reports MIG-mode links as down, so "down" means nothing there (DCGM does
    // the same); when the MIG mode could not be read, neither can "down" be judged.
    let mig_unknown = sample.mig_enabled.is_none() && sample.signal_failed("mig_mode");
    if sample.mig_enabled != Some(true) && !mig_unknown {
        // Only links read as inactive count: a link whose state could not be read this
        // time is unknown, not down.
        let down: Vec<String> = sample
            .nvlinks
            .iter()
            .filter(|link| {
                link.active == Some(false) && track.nvlink_baseline.get(&link.link) == Some(&true)
            })
            .map(|link| link.link.to_string())
            .collect();
        if !down.is_empty() {
            found.push(Finding::unhealthy(
                ReasonCode::NvlinkDown,
                format!("NVLink link(s) {} went down", down.join(", ")),
            ));
        }
    }
    for link in sample
        .nvlinks
        .iter()
        .filter(|link| link.active == Some(true))
    {
        if let Some(recovery) = link.recovery_errors {
            let delta = track
                .counter(Counter::NvlinkRecovery(link.link), now.mono, recovery)
                .delta();
            if delta >= 1 {
                found.push(Finding::unhealthy(
                    ReasonCode::NvlinkRecoveryErrors,
                    format!(
                        "{delta} recovery error(s) on NVLink {} in a minute",
                        link.link
                    ),
                ));
            }
        }
        if let Some(replay) = link.replay_errors {
            let delta = track
                .counter(Counter::NvlinkReplay(link.link), now.mono, replay)
                .delta();
            if delta >= 1 {
                found.push(Finding::degraded(
                    ReasonCode::NvlinkReplayErrors,
                    format!(
                        "{delta} replay error(s) on NVLink {} in a minute",
                        link.link
                    ),
                ));
            }
        }
        let mut crc_read = false;
        let (mut delta, mut rate) = (0, 0.0);
        for (counter, value) in [
            (Counter::NvlinkCrcFlit(link.link), link.crc_flit_errors),
            (Counter::NvlinkCrcData(link.link), link.crc_data_errors),
        ] {
            // A counter that could not be read this time is skipped, not taken as 0.
            if let Some(value) = value {
                let window = track.counter(counter, now.mono, value);
                delta += window.delta();
                rate += window.per_second().unwrap_or(0.0);
                crc_read = true;
            }
        }
        if crc_read {
            if rate >= NVLINK_CRC_BURST_PER_SECOND {
                found.push(Finding::unhealthy(
                    ReasonCode::NvlinkCrcBurst,
                    format!("NVLink {} CRC errors at {rate:.0}/s", link.link),
                ));
            } else if delta >= 1 {
                found.push(Finding::degraded(
                    ReasonCode::NvlinkCrcErrors,
                    format!("{delta} CRC error(s) on NVLink {} in a minute", link.link),
                ));
            }
        }
    }
}

/// DCGM's PCIe replay budget per minute: a per-lane rate by generation times the width.
pub fn pcie_replay_limit(generation: u32, width: u32) -> Option<u64> {
    let per_lane_per_minute = match generation {
        0 => return None,
        1 => 0.15,
        2 => 0.3,
        3 => 0.48,
        4 => 0.96,
        5 => 1.92,
        _ => 3.84,
    };
    Some((per_lane_per_minute * f64::from(width)).ceil() as u64)
}

/// What NVML's recovery-action field asks for.
pub fn recovery_action_name(action: u32) -> String {
    match action {
        0 => "none".to_owned(),
        1 => "GPU reset".to_owned(),
        2 => "node reboot".to_owned(),
        3 => "drain peer-to-peer traffic".to_owned(),
        4 => "drain and reset".to_owned(),
        5 => "recover IMEX domain".to_owned(),
        6 => "bus reset".to_owned(),
        7 => "system reboot".to_owned(),
        other => format!("action {other}"),
    }
}

/// `XID 79 (GPU has fallen off the bus)`, from NVIDIA's XID catalog for the codes that
/// matter most; other codes are shown bare.
pub fn describe_xid(xid: u64) -> String {
    let meaning = match xid {
        13 => "graphics engine exception",
        31 => "GPU memory page fault",
        32 => "invalid or corrupted push buffer",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup",
        46 => "GPU stopped processing (timeout)",
        48 => "double-bit ECC error",
        54 => "auxiliary power not connected",
        62 => "internal micro-controller halt",
        63 => "row-remap or page-retirement event",
        64 => "row-remap or page-retirement failure",
        68 => "video decoder exception",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        109 => "context switch timeout",
        110 => "security fault",
        119 => "GSP RPC timeout",
        120 => "GSP error",
        136 => "link training failed",
        140 => "unrecovered ECC error",
        143 => "GPU initialization error",
        151 => "key rotation error",
        154 => "GPU recovery action changed",
        155 => "NVLink software-defined error",
        156 => "resource retirement event",
        158 => "GPU fatal timeout",
        _ => return format!("XID {xid}"),
    };
    format!("XID {xid} ({meaning})")
}

#[cfg(test)]
mod tests;
