//! A tiny stand-in for `libnvidia-ml.so.1`, used only by the tests of the real NVML
//! adapter in `outrigger-gpu`.
//!
//! It exports the C symbols `nvml-wrapper` calls while Outrigger samples a GPU and
//! waits for events, so that the adapter's real code paths (dynamic loading, symbol
//! lookup, error-code mapping, struct layouts, the event set) run on a machine without
//! an NVIDIA driver. The stub pretends there are two GPUs; what GPU 0 does is chosen by
//! the environment variable `OUTRIGGER_NVML_STUB_SCENARIO`, read once at `nvmlInit_v2`:
//!
//! | scenario | GPU 0 |
//! | --- | --- |
//! | `healthy` (default) | idle, cool, no errors |
//! | `xid79` | the first event wait reports XID 79; every later query returns `GPU_IS_LOST` |
//! | `dbe` | one volatile uncorrected ECC error, and a double-bit ECC event |
//! | `hot` | 90 °C against an 87 °C slowdown threshold, thermal clock-event reasons set |
//! | `lost` | every telemetry query returns `GPU_IS_LOST` |
//! | `mig` | MIG mode on, partitioned into MIG devices in slots 0 and 2 of 7 |
//! | `init_fails` | `nvmlInit_v2` itself returns `DRIVER_NOT_LOADED` |
//! | `handle_flaky` | the first `nvmlDeviceGetHandleByIndex_v2` for it fails with `UNKNOWN` |
//! | `nvlink_flaky` | NVLinks 0 and 1 active; link 1's state reads fail with `UNKNOWN` after the first |
//!
//! GPU 1 is healthy in every scenario, so tests can check that a fault stays on its GPU.
//! Functions the stub does not export fail in `nvml-wrapper` with `FailedToLoadSymbol`,
//! which is itself a path the adapter must handle. The C struct layouts come from
//! `nvml_wrapper_sys::bindings` (the same bindgen output the wrapper uses), never from a
//! hand-written copy, so a layout mismatch cannot hide here. The whole crate is FFI:
//! every item is an exported C function that writes through caller-supplied pointers,
//! hence the crate-wide `unsafe_code` expectation.

#![expect(
    unsafe_code,
    reason = "every item of this crate is an exported C ABI function writing through NVML out-pointers"
)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use nvml_wrapper_sys::bindings::{
    nvmlClocksThrottleReasonGpuIdle, nvmlClocksThrottleReasonHwThermalSlowdown,
    nvmlClocksThrottleReasonSwThermalSlowdown, nvmlDevice_st, nvmlDevice_t,
    nvmlEccCounterType_enum_NVML_AGGREGATE_ECC, nvmlEccCounterType_enum_NVML_VOLATILE_ECC,
    nvmlEccCounterType_t, nvmlEnableState_enum_NVML_FEATURE_ENABLED, nvmlEnableState_t,
    nvmlEventData_t, nvmlEventSet_st, nvmlEventSet_t, nvmlEventTypeDoubleBitEccError,
    nvmlEventTypeSingleBitEccError, nvmlEventTypeXidCriticalError, nvmlFieldValue_t,
    nvmlMemory_v2_t, nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    nvmlMemoryErrorType_t, nvmlNvLinkErrorCounter_t, nvmlPageRetirementCause_t,
    nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED, nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE, nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    nvmlReturn_enum_NVML_ERROR_NOT_FOUND, nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
    nvmlReturn_enum_NVML_ERROR_TIMEOUT, nvmlReturn_enum_NVML_ERROR_UNINITIALIZED,
    nvmlReturn_enum_NVML_ERROR_UNKNOWN, nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
    nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU, nvmlTemperatureSensors_t,
    nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_GPU_MAX,
    nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
    nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
    nvmlTemperatureThresholds_t, nvmlUtilization_t,
    nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
};

/// The environment variable that selects the scenario at `nvmlInit_v2`.
pub const SCENARIO_ENV: &str = "OUTRIGGER_NVML_STUB_SCENARIO";

const GPU_COUNT: usize = 2;
const UUIDS: [&str; GPU_COUNT] = [
    "GPU-5a1b0000-0000-4000-8000-000000000000",
    "GPU-5a1b0000-0000-4000-8000-000000000001",
];
/// GPU 0's MIG devices in the `mig` scenario, by slot (`None`: an empty slot).
const MIG_UUIDS: [Option<&str>; MIG_SLOTS] = [
    Some("MIG-5a1b0000-0000-4000-8000-0000000000a0"),
    None,
    Some("MIG-5a1b0000-0000-4000-8000-0000000000a2"),
    None,
    None,
    None,
    None,
];
const MIG_SLOTS: usize = 7;
const NAME: &str = "NVIDIA H200 (outrigger stub)";
const DRIVER_VERSION: &str = "550.54.15";
const NVML_VERSION: &str = "12.550.54.15";

const TEMPERATURE_C: c_uint = 41;
const HOT_TEMPERATURE_C: c_uint = 90;
const SLOWDOWN_C: c_uint = 87;
const SHUTDOWN_C: c_uint = 95;
const GPU_MAX_C: c_uint = 89;
const POWER_MW: c_uint = 74_000;
const POWER_LIMIT_MW: c_uint = 700_000;
const ENERGY_MJ: c_ulonglong = 1_234_567;
const MEMORY_TOTAL: c_ulonglong = 150_754_820_096;
const MEMORY_RESERVED: c_ulonglong = 536_870_912;
const MEMORY_USED: c_ulonglong = 555_745_280;

// NVML field ids the adapter asks for (nvml.h `NVML_FI_DEV_*`).
const FI_REMAPPED_COR: c_uint = 142;
const FI_REMAPPED_UNC: c_uint = 143;
const FI_REMAPPED_PENDING: c_uint = 144;
const FI_REMAPPED_FAILURE: c_uint = 145;
const FI_RECOVERY_ACTION: c_uint = 230;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Healthy,
    Xid79,
    Dbe,
    Hot,
    Lost,
    Mig,
    InitFails,
    HandleFlaky,
    NvlinkFlaky,
}

impl Scenario {
    fn from_env() -> Option<Self> {
        match std::env::var(SCENARIO_ENV).as_deref() {
            Err(_) | Ok("") | Ok("healthy") => Some(Self::Healthy),
            Ok("xid79") => Some(Self::Xid79),
            Ok("dbe") => Some(Self::Dbe),
            Ok("hot") => Some(Self::Hot),
            Ok("lost") => Some(Self::Lost),
            Ok("mig") => Some(Self::Mig),
            Ok("init_fails") => Some(Self::InitFails),
            Ok("handle_flaky") => Some(Self::HandleFlaky),
            Ok("nvlink_flaky") => Some(Self::NvlinkFlaky),
            Ok(_) => None,
        }
    }
}

#[derive(Debug)]
struct State {
    scenario: Scenario,
    /// XID 79 has been handed out; from then on GPU 0 is gone.
    xid_delivered: bool,
    dbe_delivered: bool,
    /// Whether GPU 0's handle was asked for already (`handle_flaky`).
    handle0_asked: bool,
    /// How often GPU 0's NVLink 1 state was asked for (`nvlink_flaky`).
    link1_state_reads: u32,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

// Device and event-set handles are addresses inside these statics: stable, unique and
// never dereferenced by the caller (the types are opaque in nvml.h).
static DEVICE_SLOTS: [u8; GPU_COUNT] = [0; GPU_COUNT];
static MIG_DEVICE_SLOTS: [u8; MIG_SLOTS] = [0; MIG_SLOTS];
static EVENT_SET_SLOT: u8 = 0;

fn state() -> MutexGuard<'static, Option<State>> {
    // A poisoned lock only means another exported call panicked mid-update; the state
    // is plain data and still usable, and a C caller cannot handle a panic anyway.
    STATE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn device_handle(index: usize) -> nvmlDevice_t {
    (&raw const DEVICE_SLOTS[index])
        .cast_mut()
        .cast::<nvmlDevice_st>()
}

fn device_index(device: nvmlDevice_t) -> Option<usize> {
    (0..GPU_COUNT).find(|&index| device_handle(index) == device)
}

fn mig_handle(slot: usize) -> nvmlDevice_t {
    (&raw const MIG_DEVICE_SLOTS[slot])
        .cast_mut()
        .cast::<nvmlDevice_st>()
}

/// The MIG device a handle stands for, as its UUID.
fn mig_uuid(device: nvmlDevice_t) -> Option<&'static str> {
    (0..MIG_SLOTS)
        .find(|&slot| mig_handle(slot) == device)
        .and_then(|slot| MIG_UUIDS[slot])
}

/// Whether GPU `index` is in MIG mode.
fn mig_enabled(index: usize, scenario: Scenario) -> bool {
    index == 0 && scenario == Scenario::Mig
}

fn event_set_handle() -> nvmlEventSet_t {
    (&raw const EVENT_SET_SLOT)
        .cast_mut()
        .cast::<nvmlEventSet_st>()
}

/// Identity queries (UUID, name, index) keep working on a lost GPU, as the driver
/// caches them; telemetry does not.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Query {
    Identity,
    Telemetry,
}

/// Resolves a device handle for a query, applying the scenario's failures.
fn resolve(device: nvmlDevice_t, query: Query) -> Result<(usize, Scenario), nvmlReturn_t> {
    let guard = state();
    let Some(state) = guard.as_ref() else {
        return Err(nvmlReturn_enum_NVML_ERROR_UNINITIALIZED);
    };
    let index = device_index(device).ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
    let lost = index == 0
        && match state.scenario {
            Scenario::Lost => true,
            Scenario::Xid79 => state.xid_delivered,
            _ => false,
        };
    if lost && query == Query::Telemetry {
        return Err(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST);
    }
    Ok((index, state.scenario))
}

/// Writes `value` through an out-pointer, rejecting null like NVML does.
///
/// # Safety
/// `out` must be null or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> nvmlReturn_t {
    if out.is_null() {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null, and the caller guarantees it is valid for a write of `T`.
    unsafe { out.write(value) };
    nvmlReturn_enum_NVML_SUCCESS
}

/// Copies `text` plus a terminating NUL into a caller buffer of `length` bytes.
///
/// # Safety
/// `buffer` must be null or valid for writes of `length` bytes.
unsafe fn put_str(buffer: *mut c_char, length: c_uint, text: &str) -> nvmlReturn_t {
    if buffer.is_null() {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    let bytes = text.as_bytes();
    if bytes.len() + 1 > length as usize {
        return nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller guarantees `length` writable bytes, and we write
    // `bytes.len() + 1 <= length` of them; the regions cannot overlap (ours is static).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buffer, bytes.len());
        buffer.add(bytes.len()).write(0);
    }
    nvmlReturn_enum_NVML_SUCCESS
}

/// Runs `body` for a resolved device, or returns the resolution error code.
fn with_device(
    device: nvmlDevice_t,
    query: Query,
    body: impl FnOnce(usize, Scenario) -> nvmlReturn_t,
) -> nvmlReturn_t {
    match resolve(device, query) {
        Ok((index, scenario)) => body(index, scenario),
        Err(code) => code,
    }
}

// ---------------------------------------------------------------------------------
// Library lifetime and system queries.
// ---------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    let Some(scenario) = Scenario::from_env() else {
        return nvmlReturn_enum_NVML_ERROR_UNKNOWN;
    };
    if scenario == Scenario::InitFails {
        return nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
    }
    let mut guard = state();
    // NVML reference-counts initialisation; a second init keeps the first state so
    // that an XID already handed out is not handed out again.
    if guard.is_none() {
        *guard = Some(State {
            scenario,
            xid_delivered: false,
            dbe_delivered: false,
            handle0_asked: false,
            link1_state_reads: 0,
        });
    }
    nvmlReturn_enum_NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    nvmlReturn_enum_NVML_SUCCESS
}

/// # Safety
/// `version` must be valid for writes of `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    unsafe { put_str(version, length, DRIVER_VERSION) }
}

/// # Safety
/// `version` must be valid for writes of `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    unsafe { put_str(version, length, NVML_VERSION) }
}

/// # Safety
/// `count` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    if state().is_none() {
        return nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
    }
    // SAFETY: forwarded caller contract.
    unsafe { put(count, GPU_COUNT as c_uint) }
}

/// # Safety
/// `device` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let index = index as usize;
    {
        let mut guard = state();
        let Some(state) = guard.as_mut() else {
            return nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
        };
        if index == 0 && state.scenario == Scenario::HandleFlaky && !state.handle0_asked {
            state.handle0_asked = true;
            return nvmlReturn_enum_NVML_ERROR_UNKNOWN;
        }
    }
    if index >= GPU_COUNT {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: forwarded caller contract.
    unsafe { put(device, device_handle(index)) }
}

/// # Safety
/// `uuid` must be a NUL-terminated string and `device` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    if uuid.is_null() {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let wanted = unsafe { std::ffi::CStr::from_ptr(uuid) };
    match UUIDS
        .iter()
        .position(|known| known.as_bytes() == wanted.to_bytes())
    {
        // SAFETY: forwarded caller contract.
        Some(index) => unsafe { put(device, device_handle(index)) },
        None => nvmlReturn_enum_NVML_ERROR_NOT_FOUND,
    }
}

// ---------------------------------------------------------------------------------
// Identity.
// ---------------------------------------------------------------------------------

/// # Safety
/// `uuid` must be valid for writes of `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    if let Some(mig) = mig_uuid(device) {
        // SAFETY: forwarded caller contract.
        return unsafe { put_str(uuid, length, mig) };
    }
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Identity, |index, _| unsafe {
        put_str(uuid, length, UUIDS[index])
    })
}

/// # Safety
/// `name` must be valid for writes of `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Identity, |_, _| unsafe {
        put_str(name, length, NAME)
    })
}

/// # Safety
/// `index` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Identity, |found, _| unsafe {
        put(index, found as c_uint)
    })
}

// ---------------------------------------------------------------------------------
// Thermals, power, utilisation, memory.
// ---------------------------------------------------------------------------------

/// # Safety
/// `temp` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |index, scenario| {
        if sensor != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
        }
        let value = if index == 0 && scenario == Scenario::Hot {
            HOT_TEMPERATURE_C
        } else {
            TEMPERATURE_C
        };
        // SAFETY: forwarded caller contract.
        unsafe { put(temp, value) }
    })
}

/// # Safety
/// `temp` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperatureThreshold(
    device: nvmlDevice_t,
    threshold: nvmlTemperatureThresholds_t,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |_, _| {
        let value = if threshold
            == nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        {
            SLOWDOWN_C
        } else if threshold == nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_SHUTDOWN {
            SHUTDOWN_C
        } else if threshold == nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_GPU_MAX {
            GPU_MAX_C
        } else {
            return nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
        };
        // SAFETY: forwarded caller contract.
        unsafe { put(temp, value) }
    })
}

/// # Safety
/// `power` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    power: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe {
        put(power, POWER_MW)
    })
}

/// # Safety
/// `limit` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe {
        put(limit, POWER_LIMIT_MW)
    })
}

/// # Safety
/// `energy` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEnergyConsumption(
    device: nvmlDevice_t,
    energy: *mut c_ulonglong,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe {
        put(energy, ENERGY_MJ)
    })
}

/// # Safety
/// `utilization` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe {
        put(utilization, nvmlUtilization_t { gpu: 3, memory: 1 })
    })
}

/// # Safety
/// `memory` must be valid for a read and a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |_, _| {
        if memory.is_null() {
            return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: non-null and valid per the caller contract. The caller sets the
        // struct version, which real NVML checks; keep it so the layout is honoured.
        let version = unsafe { (*memory).version };
        let info = nvmlMemory_v2_t {
            version,
            total: MEMORY_TOTAL,
            reserved: MEMORY_RESERVED,
            free: MEMORY_TOTAL - MEMORY_RESERVED - MEMORY_USED,
            used: MEMORY_USED,
        };
        // SAFETY: as above.
        unsafe { put(memory, info) }
    })
}

// ---------------------------------------------------------------------------------
// ECC, retired pages, remapped rows, field values.
// ---------------------------------------------------------------------------------

/// # Safety
/// `current` and `pending` must be valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEccMode(
    device: nvmlDevice_t,
    current: *mut nvmlEnableState_t,
    pending: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |_, _| {
        // SAFETY: forwarded caller contract.
        let code = unsafe { put(current, nvmlEnableState_enum_NVML_FEATURE_ENABLED) };
        if code != nvmlReturn_enum_NVML_SUCCESS {
            return code;
        }
        // SAFETY: forwarded caller contract.
        unsafe { put(pending, nvmlEnableState_enum_NVML_FEATURE_ENABLED) }
    })
}

/// # Safety
/// `count` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    error_type: nvmlMemoryErrorType_t,
    counter_type: nvmlEccCounterType_t,
    count: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |index, scenario| {
        if counter_type != nvmlEccCounterType_enum_NVML_VOLATILE_ECC
            && counter_type != nvmlEccCounterType_enum_NVML_AGGREGATE_ECC
        {
            return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
        }
        let uncorrected = error_type == nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED;
        let value = if index == 0 && scenario == Scenario::Dbe && uncorrected {
            1
        } else {
            0
        };
        // SAFETY: forwarded caller contract.
        unsafe { put(count, value) }
    })
}

/// Pre-Ampere page retirement: Hopper reports it unsupported, and so does the stub.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetRetiredPages(
    device: nvmlDevice_t,
    _cause: nvmlPageRetirementCause_t,
    _count: *mut c_uint,
    _addresses: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |_, _| {
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
    })
}

/// Not supported on the stub (pre-Ampere page retirement).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    device: nvmlDevice_t,
    _pending: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |_, _| {
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
    })
}

/// # Safety
/// All four out-pointers must be valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRemappedRows(
    device: nvmlDevice_t,
    correctable: *mut c_uint,
    uncorrectable: *mut c_uint,
    pending: *mut c_uint,
    failure: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |_, _| {
        for out in [correctable, uncorrectable, pending, failure] {
            // SAFETY: forwarded caller contract.
            let code = unsafe { put(out, 0) };
            if code != nvmlReturn_enum_NVML_SUCCESS {
                return code;
            }
        }
        nvmlReturn_enum_NVML_SUCCESS
    })
}

/// # Safety
/// `values` must point to `count` initialised `nvmlFieldValue_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |_, _| {
        let Ok(count) = usize::try_from(count) else {
            return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
        };
        if values.is_null() {
            return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: the caller passes `count` initialised, exclusively borrowed values.
        let values = unsafe { std::slice::from_raw_parts_mut(values, count) };
        for value in values {
            match value.fieldId {
                FI_REMAPPED_COR | FI_REMAPPED_UNC | FI_REMAPPED_PENDING | FI_REMAPPED_FAILURE
                | FI_RECOVERY_ACTION => {
                    value.nvmlReturn = nvmlReturn_enum_NVML_SUCCESS;
                    value.valueType = nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
                    value.value.ullVal = 0;
                    value.timestamp = 1_700_000_000_000_000;
                    value.latencyUsec = 12;
                }
                _ => value.nvmlReturn = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
            }
        }
        nvmlReturn_enum_NVML_SUCCESS
    })
}

// ---------------------------------------------------------------------------------
// Clock events, PCIe, NVLink, MIG.
// ---------------------------------------------------------------------------------

fn clock_event_reasons(index: usize, scenario: Scenario) -> c_ulonglong {
    if index == 0 && scenario == Scenario::Hot {
        c_ulonglong::from(
            nvmlClocksThrottleReasonHwThermalSlowdown | nvmlClocksThrottleReasonSwThermalSlowdown,
        )
    } else {
        c_ulonglong::from(nvmlClocksThrottleReasonGpuIdle)
    }
}

/// # Safety
/// `reasons` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksThrottleReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |index, scenario| {
        // SAFETY: forwarded caller contract.
        unsafe { put(reasons, clock_event_reasons(index, scenario)) }
    })
}

/// # Safety
/// `reasons` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksEventReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |index, scenario| {
        // SAFETY: forwarded caller contract.
        unsafe { put(reasons, clock_event_reasons(index, scenario)) }
    })
}

/// # Safety
/// `value` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieReplayCounter(
    device: nvmlDevice_t,
    value: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe { put(value, 0) })
}

/// # Safety
/// `generation` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkGeneration(
    device: nvmlDevice_t,
    generation: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe {
        put(generation, 5)
    })
}

/// # Safety
/// `generation` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkGeneration(
    device: nvmlDevice_t,
    generation: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe {
        put(generation, 5)
    })
}

/// # Safety
/// `width` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkWidth(
    device: nvmlDevice_t,
    width: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe { put(width, 16) })
}

/// # Safety
/// `width` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkWidth(
    device: nvmlDevice_t,
    width: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe { put(width, 16) })
}

/// The stub's GPUs have no NVLink, like a PCIe card, except GPU 0 in `nvlink_flaky`.
///
/// # Safety
/// `active` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    active: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |index, scenario| {
        if index != 0 || scenario != Scenario::NvlinkFlaky {
            return nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
        }
        let readable = match link {
            0 => true,
            1 => state().as_mut().is_some_and(|state| {
                state.link1_state_reads += 1;
                state.link1_state_reads == 1
            }),
            _ => return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
        };
        if !readable {
            return nvmlReturn_enum_NVML_ERROR_UNKNOWN;
        }
        // SAFETY: forwarded caller contract.
        unsafe { put(active, nvmlEnableState_enum_NVML_FEATURE_ENABLED) }
    })
}

/// No NVLink, so no NVLink error counters.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNvLinkErrorCounter(
    device: nvmlDevice_t,
    _link: c_uint,
    _counter: nvmlNvLinkErrorCounter_t,
    _value: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |_, _| {
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
    })
}

/// # Safety
/// `current` and `pending` must be valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |index, scenario| {
        let mode = c_uint::from(mig_enabled(index, scenario));
        // SAFETY: forwarded caller contract.
        let code = unsafe { put(current, mode) };
        if code != nvmlReturn_enum_NVML_SUCCESS {
            return code;
        }
        // SAFETY: forwarded caller contract.
        unsafe { put(pending, mode) }
    })
}

/// # Safety
/// `count` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, Query::Identity, |index, scenario| {
        if !mig_enabled(index, scenario) {
            return nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
        }
        // SAFETY: forwarded caller contract.
        unsafe { put(count, MIG_SLOTS as c_uint) }
    })
}

/// # Safety
/// `mig_device` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    slot: c_uint,
    mig_device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_device(device, Query::Identity, |index, scenario| {
        let slot = slot as usize;
        if !mig_enabled(index, scenario) || slot >= MIG_SLOTS {
            return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
        }
        if MIG_UUIDS[slot].is_none() {
            return nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
        }
        // SAFETY: forwarded caller contract.
        unsafe { put(mig_device, mig_handle(slot)) }
    })
}

// ---------------------------------------------------------------------------------
// Events.
// ---------------------------------------------------------------------------------

const SUPPORTED_EVENTS: c_ulonglong = (nvmlEventTypeXidCriticalError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypeSingleBitEccError) as c_ulonglong;

/// # Safety
/// `types` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    // SAFETY: forwarded caller contract.
    with_device(device, Query::Telemetry, |_, _| unsafe {
        put(types, SUPPORTED_EVENTS)
    })
}

/// # Safety
/// `set` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    if state().is_none() {
        return nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
    }
    // SAFETY: forwarded caller contract.
    unsafe { put(set, event_set_handle()) }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    if set == event_set_handle() {
        nvmlReturn_enum_NVML_SUCCESS
    } else {
        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    with_device(device, Query::Telemetry, |_, _| {
        if set != event_set_handle() || types & !SUPPORTED_EVENTS != 0 {
            return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
        }
        nvmlReturn_enum_NVML_SUCCESS
    })
}

/// Hands out the scenario's one event, then blocks for `timeout_ms` and times out,
/// as NVML does when nothing happens.
///
/// # Safety
/// `data` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    if set != event_set_handle() {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    let event = {
        let mut guard = state();
        let Some(state) = guard.as_mut() else {
            return nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
        };
        match state.scenario {
            Scenario::Xid79 if !state.xid_delivered => {
                state.xid_delivered = true;
                Some((c_ulonglong::from(nvmlEventTypeXidCriticalError), 79))
            }
            Scenario::Dbe if !state.dbe_delivered => {
                state.dbe_delivered = true;
                Some((c_ulonglong::from(nvmlEventTypeDoubleBitEccError), 0))
            }
            _ => None,
        }
    };
    match event {
        Some((event_type, event_data)) => {
            let record = nvmlEventData_t {
                device: device_handle(0),
                eventType: event_type,
                eventData: event_data,
                gpuInstanceId: u32::MAX,
                computeInstanceId: u32::MAX,
            };
            // SAFETY: forwarded caller contract.
            unsafe { put(data, record) }
        }
        None => {
            // Real NVML blocks here; returning at once would turn the caller's wait
            // loop into a busy loop.
            std::thread::sleep(Duration::from_millis(u64::from(timeout_ms)));
            nvmlReturn_enum_NVML_ERROR_TIMEOUT
        }
    }
}
