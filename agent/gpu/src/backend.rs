//! The seam between Outrigger and NVML: a small trait with crate-owned types, so the
//! classifier, the monitor and their tests never see an `nvml_wrapper` type.

use std::time::Duration;

use serde::Serialize;

use crate::sample::Sample;

/// What a backend failed to do, mapped once from NVML's error space by the adapter.
///
/// Only `GpuLost` and `ResetRequired` are health signals in themselves; everything else
/// says "no data", which the classifier turns into staleness or `unknown`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum Error {
    /// NVML cannot be used at all: no library, no driver, no permission.
    #[error("NVML unavailable: {0}")]
    Unavailable(String),
    /// The GPU fell off the bus or is otherwise inaccessible (NVML `GPU_IS_LOST`).
    #[error("the GPU has fallen off the bus or is otherwise inaccessible")]
    GpuLost,
    /// The GPU needs a reset before it can be used again (NVML `RESET_REQUIRED`).
    #[error("the GPU requires a reset before it can be used again")]
    ResetRequired,
    /// The driver or the GPU does not offer this operation.
    #[error("not supported: {0}")]
    NotSupported(String),
    /// The backend knows no GPU with this UUID.
    #[error("no GPU with UUID {0}")]
    UnknownGpu(String),
    /// Any other failure, with NVML's description.
    #[error("{0}")]
    Other(String),
}

/// One GPU as enumerated by the backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// The GPU's UUID (`GPU-…`); the stable identity used everywhere else.
    pub uuid: String,
    /// NVML's index; not stable across reboots, shown for humans only.
    pub index: u32,
    /// The product name, e.g. `NVIDIA H200`.
    pub name: String,
    /// The UUIDs (`MIG-…`) of the MIG devices this GPU is partitioned into, when MIG is
    /// on. Health is per physical GPU: a MIG UUID stands for the GPU it is part of.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<String>,
}

impl DeviceInfo {
    /// Whether `uuid` names this GPU or one of its MIG devices.
    pub fn answers_to(&self, uuid: &str) -> bool {
        self.uuid == uuid || self.mig_devices.iter().any(|mig| mig == uuid)
    }
}

/// Versions reported by the loaded library.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DriverInfo {
    pub driver_version: String,
    pub nvml_version: String,
}

/// An asynchronous GPU event (NVML event set), attributed to a GPU by UUID.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// A critical XID error. `xid` is `None` when the driver reports it as unknown.
    Xid { uuid: String, xid: Option<u64> },
    /// A double-bit (uncorrectable) ECC error.
    DoubleBitEcc { uuid: String },
}

impl Event {
    /// The GPU the event belongs to.
    pub fn uuid(&self) -> &str {
        match self {
            Self::Xid { uuid, .. } | Self::DoubleBitEcc { uuid } => uuid,
        }
    }
}

/// Whether asynchronous GPU events (XIDs, double-bit ECC errors) reach the monitor.
///
/// Without them a fatal XID that leaves no persistent state behind goes unseen while
/// sampling still reports the GPU as healthy; the signals that do persist (recovery
/// action, row-remap flags, volatile ECC counts, a lost GPU) are still sampled.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[serde(tag = "status", content = "reason", rename_all = "snake_case")]
pub enum EventStatus {
    /// No event source: NVML is loading, unavailable, or monitoring is disabled.
    #[default]
    Inactive,
    /// Events of every GPU are delivered.
    Up,
    /// Events of some GPUs only; the reason names the others.
    Partial(String),
    /// No events are delivered; the reason says why.
    Down(String),
}

impl EventStatus {
    /// Whether events of every GPU are delivered.
    pub fn is_up(&self) -> bool {
        matches!(self, Self::Up)
    }
}

/// A source of GPU telemetry. Implementations block (NVML calls can hang on a wedged
/// GPU), so they are only ever called from the monitor's own threads, never from an
/// async runtime or a request path.
pub trait Backend: Send + Sync {
    /// Driver and library versions.
    fn driver(&self) -> DriverInfo;

    /// The GPUs this backend can see.
    fn devices(&self) -> Result<Vec<DeviceInfo>, Error>;

    /// Reads every signal of one GPU. Signals the GPU does not support are `None` in
    /// the sample; only a failure of the GPU as a whole is an `Err`.
    fn sample(&self, uuid: &str) -> Result<Sample, Error>;

    /// Waits up to `timeout` for the next event; `Ok(None)` when none arrived.
    /// `Err(Error::NotSupported(_))` means this backend cannot deliver events at all.
    fn next_event(&self, timeout: Duration) -> Result<Option<Event>, Error>;

    /// Whether events are delivered, as far as the backend knows before waiting (a
    /// GPU whose registration failed, say). The monitor also marks them down when a
    /// wait fails.
    fn event_status(&self) -> EventStatus {
        EventStatus::Up
    }
}
