//! One reading of every health signal of one GPU, in crate-owned types and NVML's
//! units (°C, mW, mJ, bytes, percent). `None` means "this GPU or driver does not offer
//! the signal", so a consumer GPU without ECC or NVLink samples cleanly.

use serde::Serialize;

/// Clock-event ("throttle") reason bits, as NVML defines them, with the names
/// dcgm-exporter uses for its `clock_event` label.
pub const CLOCK_EVENT_REASONS: [(u64, &str); 9] = [
    (0x1, "gpu_idle"),
    (0x2, "clocks_setting"),
    (0x4, "power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
];

/// The clock-event reasons that mean the hardware is protecting itself (clocks cut
/// for heat or power faults), as opposed to normal load management such as
/// `power_cap` or `gpu_idle`.
pub const SLOWDOWN_REASONS: u64 = 0x8 | 0x20 | 0x40 | 0x80;

/// The names of the reasons set in `bits`, in bit order.
pub fn clock_event_names(bits: u64) -> Vec<&'static str> {
    CLOCK_EVENT_REASONS
        .iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|(_, name)| *name)
        .collect()
}

/// Every signal of one GPU at one moment.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Sample {
    pub temperature_c: Option<u32>,
    pub slowdown_temperature_c: Option<u32>,
    pub shutdown_temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub power_limit_mw: Option<u32>,
    /// Energy since the driver loaded.
    pub energy_mj: Option<u64>,
    pub gpu_utilization_pct: Option<u32>,
    pub memory_utilization_pct: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub ecc_enabled: Option<bool>,
    pub ecc: EccCounts,
    pub retired_pages: RetiredPages,
    pub remapped_rows: RemappedRows,
    /// NVML's GPU recovery action field: 0 none, 1 GPU reset, 2 node reboot,
    /// 3 drain P2P, 4 drain and reset (newer drivers add more).
    pub recovery_action: Option<u32>,
    /// Clock-event reason bits (see [`CLOCK_EVENT_REASONS`]).
    pub clock_event_reasons: Option<u64>,
    pub pcie: Pcie,
    /// Links that exist (a link whose state read failed is listed with `active: None`);
    /// empty on GPUs without NVLink.
    pub nvlinks: Vec<NvLink>,
    /// `None` both when the GPU has no MIG and when the read failed (then `failed`
    /// lists `mig_mode`).
    pub mig_enabled: Option<bool>,
    /// Signals the GPU or driver does not offer (not an error).
    pub absent: Vec<String>,
    /// Signals that failed with an error other than "not supported".
    pub failed: Vec<SignalFailure>,
}

/// ECC error counters. Volatile counts reset when the driver reloads; aggregate
/// counts persist in the InfoROM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct EccCounts {
    pub corrected_volatile: Option<u64>,
    pub uncorrected_volatile: Option<u64>,
    pub corrected_aggregate: Option<u64>,
    pub uncorrected_aggregate: Option<u64>,
}

/// Dynamic page retirement (before Ampere; newer GPUs report it unsupported).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RetiredPages {
    pub single_bit: Option<u64>,
    pub double_bit: Option<u64>,
    pub pending: Option<bool>,
}

/// Row remapping (Ampere and newer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RemappedRows {
    pub correctable: Option<u64>,
    pub uncorrectable: Option<u64>,
    pub pending: Option<bool>,
    pub failure: Option<bool>,
}

/// The PCIe link and its replay counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Pcie {
    pub replays: Option<u64>,
    pub generation: Option<u32>,
    pub width: Option<u32>,
    pub max_generation: Option<u32>,
    pub max_width: Option<u32>,
}

/// One NVLink link. Counters are read only on active links.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct NvLink {
    pub link: u32,
    /// `None` when the link's state could not be read this time: unknown, not down.
    pub active: Option<bool>,
    pub replay_errors: Option<u64>,
    pub recovery_errors: Option<u64>,
    pub crc_flit_errors: Option<u64>,
    pub crc_data_errors: Option<u64>,
}

/// A signal whose read failed, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SignalFailure {
    pub signal: String,
    pub error: String,
}

impl Sample {
    /// Whether reading `signal` failed (rather than being unsupported).
    pub fn signal_failed(&self, signal: &str) -> bool {
        self.failed.iter().any(|failure| failure.signal == signal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_event_names_follow_bit_order() {
        assert_eq!(clock_event_names(0), Vec::<&str>::new());
        assert_eq!(
            clock_event_names(0x1 | 0x40),
            vec!["gpu_idle", "hw_thermal"]
        );
        assert_eq!(
            clock_event_names(SLOWDOWN_REASONS),
            vec!["hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"]
        );
        // Bits NVML may add later are ignored rather than misnamed.
        assert_eq!(clock_event_names(0x1000), Vec::<&str>::new());
    }
}
