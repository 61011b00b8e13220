//! The real backend: NVML through `nvml-wrapper`, loaded with `dlopen` at run time, so
//! the binary has no link-time dependency on the driver and runs anywhere. This module
//! is the only place that names `nvml_wrapper`; its errors are mapped once, here.
//!
//! NVML is initialised once per library path and kept for the life of the process
//! (NVIDIA advises against repeated initialisation, and `Device`/`EventSet` borrow the
//! `Nvml`, so a `'static` instance is what lets them move into the monitor's threads).

mod self_test;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, RetirementCause, TemperatureSensor, TemperatureThreshold,
};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::sys_exports::field_id::{
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, NVML_FI_DEV_REMAPPED_COR, NVML_FI_DEV_REMAPPED_FAILURE,
    NVML_FI_DEV_REMAPPED_PENDING, NVML_FI_DEV_REMAPPED_UNC,
};
use nvml_wrapper::{Device, EventSet, Nvml};

pub use self_test::{Check, CheckStatus, SampleCost, SelfTestDevice, SelfTestReport, self_test};

use crate::backend::{Backend, DeviceInfo, DriverInfo, Error, Event, EventStatus};
use crate::clock::lock;
use crate::sample::{NvLink, Sample, SignalFailure};

/// The library `nvml-wrapper` opens when no path is given.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// NVML's highest NVLink count per GPU (`NVML_NVLINK_MAX_LINKS`).
const NVLINK_MAX_LINKS: u32 = 18;

/// The events Outrigger registers for: XIDs and uncorrectable ECC errors.
fn wanted_events() -> EventTypes {
    EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR
}

/// Initialised libraries, by path; never unloaded.
static LOADED: Mutex<Vec<(PathBuf, &'static Nvml)>> = Mutex::new(Vec::new());

fn init(library_path: Option<&Path>) -> Result<&'static Nvml, Error> {
    let key = library_path.map_or_else(|| PathBuf::from(DEFAULT_LIBRARY), Path::to_path_buf);
    let mut loaded = lock(&LOADED);
    if let Some((_, nvml)) = loaded.iter().find(|(path, _)| *path == key) {
        return Ok(nvml);
    }
    let mut builder = Nvml::builder();
    if let Some(path) = library_path {
        builder.lib_path(path.as_os_str());
    }
    let nvml = builder.init().map_err(|error| init_error(&key, error))?;
    let nvml: &'static Nvml = Box::leak(Box::new(nvml));
    loaded.push((key, nvml));
    Ok(nvml)
}

fn init_error(library: &Path, error: NvmlError) -> Error {
    let library = library.display();
    Error::Unavailable(match error {
        NvmlError::LibloadingError(cause) => format!("{library} not found: {cause}"),
        NvmlError::DriverNotLoaded => {
            format!("the NVIDIA driver is not loaded ({library} reports DRIVER_NOT_LOADED)")
        }
        NvmlError::NoPermission => "no permission to talk to the NVIDIA driver".to_owned(),
        NvmlError::FailedToLoadSymbol(cause) => {
            format!("{library} is not a usable NVML library: {cause}")
        }
        other => format!("NVML initialisation through {library} failed: {other}"),
    })
}

/// Maps an NVML error of a whole-GPU operation.
fn map_error(error: NvmlError) -> Error {
    match error {
        NvmlError::GpuLost => Error::GpuLost,
        NvmlError::ResetRequired => Error::ResetRequired,
        NvmlError::NotSupported | NvmlError::FunctionNotFound => {
            Error::NotSupported(error.to_string())
        }
        NvmlError::FailedToLoadSymbol(symbol) => Error::NotSupported(symbol),
        NvmlError::DriverNotLoaded | NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound => {
            Error::Unavailable(error.to_string())
        }
        other => Error::Other(other.to_string()),
    }
}

/// Whether an error means "this signal does not exist here" rather than a failure.
fn is_absent(error: &NvmlError) -> bool {
    matches!(
        error,
        NvmlError::NotSupported
            | NvmlError::NoPermission
            | NvmlError::FailedToLoadSymbol(_)
            | NvmlError::FunctionNotFound
            | NvmlError::InvalidArg
            | NvmlError::NotFound
    )
}

/// One GPU found at load time. A GPU whose handle failed stays listed (under a
/// placeholder id) so that its failure is reported rather than silently skipped, and
/// its handle is asked for again when it is sampled (see [`NvmlBackend::device`]).
#[derive(Clone)]
struct Gpu {
    /// The id the GPU was first listed under; a placeholder when its handle or UUID
    /// could not be read at load. The monitor may go on asking for it by that id.
    listed_as: String,
    info: DeviceInfo,
    device: Result<Arc<Device<'static>>, Error>,
}

impl Gpu {
    /// Whether the handle or the real UUID is still missing.
    fn incomplete(&self) -> bool {
        self.device.is_err() || self.info.uuid == placeholder_uuid(self.info.index)
    }
}

/// The NVML backend.
pub struct NvmlBackend {
    nvml: &'static Nvml,
    driver: DriverInfo,
    /// Locked only to look up or replace an entry, never across an NVML call.
    gpus: Mutex<Vec<Gpu>>,
    /// Used by the event thread only; `None` when events cannot be delivered.
    events: Mutex<Option<EventSet<'static>>>,
    /// Why events are not (fully) available.
    event_problem: Option<String>,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("driver", &self.driver)
            .field(
                "gpus",
                &lock(&self.gpus)
                    .iter()
                    .map(|gpu| gpu.info.clone())
                    .collect::<Vec<_>>(),
            )
            .field("event_problem", &self.event_problem)
            .finish_non_exhaustive()
    }
}

impl NvmlBackend {
    /// Loads NVML from `library_path` (or `libnvidia-ml.so.1` through the dynamic
    /// loader), lists the GPUs and registers for their XID and ECC events.
    ///
    /// Without a driver this returns `Error::Unavailable` naming the library, e.g.
    /// `libnvidia-ml.so.1 not found: …`.
    pub fn load(library_path: Option<&Path>) -> Result<Self, Error> {
        let nvml = init(library_path)?;
        let driver = DriverInfo {
            driver_version: nvml
                .sys_driver_version()
                .unwrap_or_else(|error| format!("unknown ({error})")),
            nvml_version: nvml
                .sys_nvml_version()
                .unwrap_or_else(|error| format!("unknown ({error})")),
        };
        let count = nvml.device_count().map_err(map_error)?;
        let gpus: Vec<Gpu> = (0..count).map(|index| enumerate(nvml, index)).collect();
        let (events, event_problem) = register_events(nvml, &gpus);
        if let Some(problem) = &event_problem {
            tracing::warn!(%problem, "GPU event registration incomplete");
        }
        Ok(Self {
            nvml,
            driver,
            gpus: Mutex::new(gpus),
            events: Mutex::new(events),
            event_problem,
        })
    }

    /// The GPUs as listed now.
    fn gpus(&self) -> Vec<Gpu> {
        lock(&self.gpus).clone()
    }

    /// The handle of the GPU listed as `uuid` (its real UUID, or the placeholder it was
    /// first listed under). A GPU whose handle or UUID failed at load is looked up
    /// again, once per call: a transient failure at start-up must not leave it without
    /// data for the life of the process. Once found, the GPU is listed under its real
    /// UUID. (Its events stay unregistered: the event status says so.)
    fn device(&self, uuid: &str) -> Result<Arc<Device<'static>>, Error> {
        let (index, known) = {
            let gpus = lock(&self.gpus);
            let gpu = gpus
                .iter()
                .find(|gpu| gpu.info.uuid == uuid || gpu.listed_as == uuid)
                .ok_or_else(|| Error::UnknownGpu(uuid.to_owned()))?;
            if !gpu.incomplete() {
                return gpu.device.clone();
            }
            (gpu.info.index, gpu.device.clone())
        };
        // No lock is held while NVML runs.
        let again = enumerate(self.nvml, index);
        if again.device.is_err() {
            // A handle without its UUID still samples; without one, the new failure
            // says why.
            return known.or(again.device);
        }
        let mut gpus = lock(&self.gpus);
        if let Some(gpu) = gpus.iter_mut().find(|gpu| gpu.info.index == index) {
            if gpu.device.is_err() {
                tracing::info!(index, uuid = %again.info.uuid, "GPU handle obtained");
            }
            gpu.info = again.info;
            gpu.device = again.device.clone();
        }
        again.device
    }

    /// The UUID of the GPU an event came from; by index if the GPU no longer answers.
    fn uuid_of(&self, device: &Device<'_>) -> String {
        if let Ok(uuid) = device.uuid() {
            return uuid;
        }
        device
            .index()
            .ok()
            .and_then(|index| {
                lock(&self.gpus)
                    .iter()
                    .find(|gpu| gpu.info.index == index)
                    .map(|gpu| gpu.info.uuid.clone())
            })
            .unwrap_or_else(|| "unknown".to_owned())
    }
}

fn placeholder_uuid(index: u32) -> String {
    format!("nvml-index-{index}")
}

fn enumerate(nvml: &'static Nvml, index: u32) -> Gpu {
    match nvml.device_by_index(index) {
        Ok(device) => {
            let info = DeviceInfo {
                uuid: device.uuid().unwrap_or_else(|_| placeholder_uuid(index)),
                index,
                name: device.name().unwrap_or_else(|_| "unknown".to_owned()),
                mig_devices: mig_devices(&device),
            };
            Gpu {
                listed_as: info.uuid.clone(),
                info,
                device: Ok(Arc::new(device)),
            }
        }
        Err(error) => Gpu {
            listed_as: placeholder_uuid(index),
            info: DeviceInfo {
                uuid: placeholder_uuid(index),
                index,
                name: "unknown".to_owned(),
                mig_devices: Vec::new(),
            },
            device: Err(map_error(error)),
        },
    }
}

/// The UUIDs of the MIG devices a GPU in MIG mode is partitioned into, so that a MIG
/// UUID (what a pod is given on a partitioned GPU) finds its physical GPU. NVML numbers
/// the slots up to the GPU's maximum and leaves empty ones `NOT_FOUND`; a GPU without
/// MIG, or a driver without these calls, has none.
fn mig_devices(device: &Device<'_>) -> Vec<String> {
    let enabled = device.mig_mode().is_ok_and(|mode| mode.current == 1);
    if !enabled {
        return Vec::new();
    }
    let slots = match device.mig_device_count() {
        Ok(slots) => slots,
        Err(error) => {
            tracing::warn!(%error, "MIG is on but its devices cannot be counted");
            return Vec::new();
        }
    };
    let mut uuids = Vec::new();
    for slot in 0..slots {
        match device.mig_device_by_index(slot).and_then(|mig| mig.uuid()) {
            Ok(uuid) => uuids.push(uuid),
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => {}
            Err(error) => tracing::warn!(%error, slot, "cannot read a MIG device"),
        }
    }
    uuids
}

/// Registers every GPU with one event set. NVML releases the whole set when one
/// registration fails, so a failure rebuilds it with the GPUs that worked.
fn register_events(
    nvml: &'static Nvml,
    gpus: &[Gpu],
) -> (Option<EventSet<'static>>, Option<String>) {
    let mut set = match nvml.create_event_set() {
        Ok(set) => set,
        Err(error) => {
            return (
                None,
                Some(format!("cannot create an NVML event set: {error}")),
            );
        }
    };
    let mut registered: Vec<(&Device<'static>, EventTypes)> = Vec::new();
    let mut problems = Vec::new();
    for gpu in gpus {
        let device = match &gpu.device {
            Ok(device) => device.as_ref(),
            Err(error) => {
                problems.push(format!("{}: no NVML handle: {error}", gpu.info.uuid));
                continue;
            }
        };
        let wanted = match device.supported_event_types() {
            Ok(supported) => supported & wanted_events(),
            Err(error) => {
                problems.push(format!(
                    "{}: cannot list event types: {error}",
                    gpu.info.uuid
                ));
                continue;
            }
        };
        if wanted.is_empty() {
            problems.push(format!(
                "{}: supports neither XID nor ECC events",
                gpu.info.uuid
            ));
            continue;
        }
        match device.register_events(wanted, set) {
            Ok(kept) => {
                set = kept;
                registered.push((device, wanted));
            }
            Err(error) => {
                problems.push(format!(
                    "{}: cannot register for events: {}",
                    gpu.info.uuid, error.error
                ));
                match rebuild_event_set(nvml, &registered) {
                    Ok(rebuilt) => set = rebuilt,
                    Err(error) => {
                        problems.push(error);
                        return (None, Some(problems.join("; ")));
                    }
                }
            }
        }
    }
    if registered.is_empty() {
        if problems.is_empty() {
            problems.push("no GPU to register for events".to_owned());
        }
        return (None, Some(problems.join("; ")));
    }
    let problem = (!problems.is_empty()).then(|| problems.join("; "));
    (Some(set), problem)
}

fn rebuild_event_set(
    nvml: &'static Nvml,
    registered: &[(&Device<'static>, EventTypes)],
) -> Result<EventSet<'static>, String> {
    let mut set = nvml
        .create_event_set()
        .map_err(|error| format!("cannot recreate the NVML event set: {error}"))?;
    for (device, wanted) in registered {
        set = device
            .register_events(*wanted, set)
            .map_err(|error| format!("cannot re-register for events: {}", error.error))?;
    }
    Ok(set)
}

impl Backend for NvmlBackend {
    fn driver(&self) -> DriverInfo {
        self.driver.clone()
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>, Error> {
        Ok(lock(&self.gpus)
            .iter()
            .map(|gpu| gpu.info.clone())
            .collect())
    }

    fn sample(&self, uuid: &str) -> Result<Sample, Error> {
        read_sample(self.device(uuid)?.as_ref())
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<Event>, Error> {
        let events = lock(&self.events);
        let Some(set) = events.as_ref() else {
            return Err(Error::NotSupported(
                self.event_problem
                    .clone()
                    .unwrap_or_else(|| "no event set".to_owned()),
            ));
        };
        let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        match set.wait(timeout_ms) {
            Ok(data) => {
                let uuid = self.uuid_of(&data.device);
                if data.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                    Ok(Some(Event::DoubleBitEcc { uuid }))
                } else if data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    let xid = match data.event_data {
                        Some(XidError::Value(xid)) => Some(xid),
                        Some(XidError::Unknown) | None => None,
                    };
                    Ok(Some(Event::Xid { uuid, xid }))
                } else {
                    Ok(None)
                }
            }
            Err(NvmlError::Timeout) => Ok(None),
            Err(error) => Err(map_error(error)),
        }
    }

    fn event_status(&self) -> EventStatus {
        let registered = lock(&self.events).is_some();
        match (&self.event_problem, registered) {
            (None, true) => EventStatus::Up,
            (Some(problem), true) => EventStatus::Partial(problem.clone()),
            (problem, false) => {
                EventStatus::Down(problem.clone().unwrap_or_else(|| "no event set".to_owned()))
            }
        }
    }
}

/// Collects which signals were absent or failed while reading a sample.
#[derive(Default)]
struct Reader {
    absent: Vec<String>,
    failed: Vec<SignalFailure>,
}

impl Reader {
    /// `Ok(None)` for a missing or failed signal; `Err` only when the GPU itself is
    /// gone, which ends the sample.
    fn read<T>(&mut self, signal: &str, result: Result<T, NvmlError>) -> Result<Option<T>, Error> {
        match result {
            Ok(value) => Ok(Some(value)),
            Err(NvmlError::GpuLost) => Err(Error::GpuLost),
            Err(NvmlError::ResetRequired) => Err(Error::ResetRequired),
            Err(error) if is_absent(&error) => {
                self.absent.push(signal.to_owned());
                Ok(None)
            }
            Err(error) => {
                self.failed.push(SignalFailure {
                    signal: signal.to_owned(),
                    error: error.to_string(),
                });
                Ok(None)
            }
        }
    }
}

fn field_value(value: &SampleValue) -> Option<u64> {
    match *value {
        SampleValue::U32(value) => Some(u64::from(value)),
        SampleValue::U64(value) => Some(value),
        SampleValue::I64(value) => u64::try_from(value).ok(),
        SampleValue::F64(value) if value.is_finite() && value >= 0.0 => Some(value as u64),
        SampleValue::F64(_) => None,
    }
}

/// The row-remapper and recovery-action fields, in this order.
const FIELDS: [(u32, &str); 5] = [
    (NVML_FI_DEV_REMAPPED_COR, "remapped_rows_correctable"),
    (NVML_FI_DEV_REMAPPED_UNC, "remapped_rows_uncorrectable"),
    (NVML_FI_DEV_REMAPPED_PENDING, "remapped_rows_pending"),
    (NVML_FI_DEV_REMAPPED_FAILURE, "remapped_rows_failure"),
    (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, "recovery_action"),
];

fn read_fields(reader: &mut Reader, device: &Device<'_>) -> Result<[Option<u64>; 5], Error> {
    let ids: Vec<FieldId> = FIELDS.iter().map(|(id, _)| FieldId(*id)).collect();
    let mut values = [None; 5];
    let Some(samples) = reader.read("field_values", device.field_values_for(&ids))? else {
        return Ok(values);
    };
    for ((slot, (_, signal)), sample) in values.iter_mut().zip(FIELDS).zip(samples) {
        let value = sample.and_then(|sample| sample.value);
        *slot = reader.read(signal, value)?.as_ref().and_then(field_value);
    }
    Ok(values)
}

fn read_nvlinks(reader: &mut Reader, device: &Device<'_>) -> Result<Vec<NvLink>, Error> {
    let mut links = Vec::new();
    let mut unanswered = None;
    for link in 0..NVLINK_MAX_LINKS {
        let wrapper = device.link_wrapper_for(link);
        let active = match wrapper.is_active() {
            Ok(active) => Some(active),
            Err(NvmlError::GpuLost) => return Err(Error::GpuLost),
            Err(NvmlError::ResetRequired) => return Err(Error::ResetRequired),
            // Links beyond this GPU's count answer "invalid argument" or "not
            // supported"; only "no link at all" is worth reporting.
            Err(error) if is_absent(&error) => {
                unanswered.get_or_insert(error);
                continue;
            }
            // Any other failure says nothing about the link: its state is unknown this
            // time, which must not read as "down".
            Err(error) => {
                reader.read::<()>(&format!("nvlink{link}_state"), Err(error))?;
                None
            }
        };
        let mut record = NvLink {
            link,
            active,
            ..NvLink::default()
        };
        if active == Some(true) {
            record.replay_errors = reader.read(
                &format!("nvlink{link}_replay_errors"),
                wrapper.error_counter(ErrorCounter::DlReplay),
            )?;
            record.recovery_errors = reader.read(
                &format!("nvlink{link}_recovery_errors"),
                wrapper.error_counter(ErrorCounter::DlRecovery),
            )?;
            record.crc_flit_errors = reader.read(
                &format!("nvlink{link}_crc_flit_errors"),
                wrapper.error_counter(ErrorCounter::DlCrcFlit),
            )?;
            record.crc_data_errors = reader.read(
                &format!("nvlink{link}_crc_data_errors"),
                wrapper.error_counter(ErrorCounter::DlCrcData),
            )?;
        }
        links.push(record);
    }
    if links.is_empty()
        && let Some(error) = unanswered
    {
        reader.read::<()>("nvlink", Err(error))?;
    }
    Ok(links)
}

/// Reads every signal of one GPU.
fn read_sample(device: &Device<'_>) -> Result<Sample, Error> {
    let mut r = Reader::default();
    let mut sample = Sample {
        temperature_c: r.read("temperature", device.temperature(TemperatureSensor::Gpu))?,
        slowdown_temperature_c: r.read(
            "temperature_slowdown",
            device.temperature_threshold(TemperatureThreshold::Slowdown),
        )?,
        shutdown_temperature_c: r.read(
            "temperature_shutdown",
            device.temperature_threshold(TemperatureThreshold::Shutdown),
        )?,
        power_mw: r.read("power", device.power_usage())?,
        power_limit_mw: r.read("power_limit", device.enforced_power_limit())?,
        energy_mj: r.read("energy", device.total_energy_consumption())?,
        ..Sample::default()
    };
    if let Some(utilization) = r.read("utilization", device.utilization_rates())? {
        sample.gpu_utilization_pct = Some(utilization.gpu);
        sample.memory_utilization_pct = Some(utilization.memory);
    }
    if let Some(memory) = r.read("memory", device.memory_info())? {
        sample.memory_used_bytes = Some(memory.used);
        sample.memory_total_bytes = Some(memory.total);
    }
    sample.ecc_enabled = r
        .read("ecc_mode", device.is_ecc_enabled())?
        .map(|mode| mode.currently_enabled);
    if sample.ecc_enabled != Some(false) {
        sample.ecc.corrected_volatile = r.read(
            "ecc_corrected_volatile",
            device.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile),
        )?;
        sample.ecc.uncorrected_volatile = r.read(
            "ecc_uncorrected_volatile",
            device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
        )?;
        sample.ecc.corrected_aggregate = r.read(
            "ecc_corrected_aggregate",
            device.total_ecc_errors(MemoryError::Corrected, EccCounter::Aggregate),
        )?;
        sample.ecc.uncorrected_aggregate = r.read(
            "ecc_uncorrected_aggregate",
            device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Aggregate),
        )?;
    }
    sample.retired_pages.single_bit = r
        .read(
            "retired_pages_single_bit",
            device.retired_pages(RetirementCause::MultipleSingleBitEccErrors),
        )?
        .map(|pages| pages.len() as u64);
    sample.retired_pages.double_bit = r
        .read(
            "retired_pages_double_bit",
            device.retired_pages(RetirementCause::DoubleBitEccError),
        )?
        .map(|pages| pages.len() as u64);
    sample.retired_pages.pending =
        r.read("retired_pages_pending", device.are_pages_pending_retired())?;

    let [correctable, uncorrectable, pending, failure, recovery] = read_fields(&mut r, device)?;
    sample.remapped_rows.correctable = correctable;
    sample.remapped_rows.uncorrectable = uncorrectable;
    sample.remapped_rows.pending = pending.map(|flag| flag != 0);
    sample.remapped_rows.failure = failure.map(|flag| flag != 0);
    sample.recovery_action = recovery.and_then(|action| u32::try_from(action).ok());

    sample.clock_event_reasons = r
        .read("clock_event_reasons", device.current_throttle_reasons())?
        .map(|reasons| reasons.bits());
    sample.pcie.replays = r
        .read("pcie_replays", device.pcie_replay_counter())?
        .map(u64::from);
    sample.pcie.generation = r.read("pcie_generation", device.current_pcie_link_gen())?;
    sample.pcie.width = r.read("pcie_width", device.current_pcie_link_width())?;
    sample.pcie.max_generation = r.read("pcie_max_generation", device.max_pcie_link_gen())?;
    sample.pcie.max_width = r.read("pcie_max_width", device.max_pcie_link_width())?;
    sample.nvlinks = read_nvlinks(&mut r, device)?;
    sample.mig_enabled = r
        .read("mig_mode", device.mig_mode())?
        .map(|mode| mode.current == 1);

    sample.absent = r.absent;
    sample.failed = r.failed;
    Ok(sample)
}
