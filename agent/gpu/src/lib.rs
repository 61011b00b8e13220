//! Local GPU health for Outrigger: reads NVML, classifies each GPU as healthy,
//! degraded, unhealthy or unknown with reasons, and publishes immutable snapshots that
//! readiness, `GET /v1/gpu`, `outrigger gpu`, the metrics and the policies read.
//!
//! Invariants:
//! - **NVML is optional.** It is loaded with `dlopen` at run time ([`NvmlBackend`]); a
//!   machine without the driver runs normally and reports "no NVML" with the reason.
//! - **NVML stays off the request path.** Every NVML call happens on the monitor's
//!   sampler or event thread (or in a one-shot [`probe_once`]); probes and the API read
//!   the cached [`Snapshot`] only, because NVML calls can hang on a wedged GPU.
//! - **Unhealthy is latched** until the process restarts; degraded enters after
//!   several bad samples and clears after a quiet period; liveness never depends on
//!   any of it (only [`Snapshot::ready`] does).
//! - **This crate is the only one that names `nvml-wrapper`**, and inside it only the
//!   `nvml` module does: everything else speaks the crate-owned [`Backend`] trait and
//!   [`Sample`], which is what lets [`FakeBackend`] and the stub library test the whole
//!   path without a GPU.
//!
//! Shape: a [`Backend`] (real or fake) feeds a pure [`Classifier`] (time injected, so
//! hysteresis is table-tested), driven by a [`Monitor`] that owns two threads and a
//! `tokio::sync::watch` of `Arc<Snapshot>`. Rules and thresholds follow the project's
//! GPU health reference (DCGM health watches, the NVIDIA XID catalog, the device
//! plugin); the fatal XID set is configurable in [`Options`].

mod backend;
mod classify;
mod clock;
mod fake;
mod monitor;
mod nvml;
mod options;
mod probe;
mod sample;
mod snapshot;
mod time;

pub use backend::{Backend, DeviceInfo, DriverInfo, Error, Event, EventStatus};
pub use classify::{
    Classifier, GpuHealth, Reason, ReasonCode, XID_HISTORY_LEN, XidRecord, describe_xid,
    pcie_replay_limit, recovery_action_name,
};
pub use clock::{Clock, ManualClock, Moment, Stop, SystemClock};
pub use fake::{FakeBackend, fake_uuid, healthy_sample};
pub use monitor::{INCIDENT_HISTORY_LEN, Monitor};
pub use nvml::{
    Check, CheckStatus, DEFAULT_LIBRARY, NvmlBackend, SampleCost, SelfTestDevice, SelfTestReport,
    self_test,
};
pub use options::{
    DEFAULT_FATAL_XIDS, DEFAULT_IGNORED_XIDS, MAX_SAMPLE_INTERVAL, MIN_SAMPLE_INTERVAL, Options,
    STALE_DEGRADED_AFTER, STALE_UNHEALTHY_AFTER, Watch,
};
pub use probe::{probe, probe_once};
pub use sample::{
    CLOCK_EVENT_REASONS, EccCounts, NvLink, Pcie, RemappedRows, RetiredPages, SLOWDOWN_REASONS,
    Sample, SignalFailure, clock_event_names,
};
pub use snapshot::{Incident, MetricKind, MetricSample, NvmlStatus, Snapshot, readiness};
