//! What the GPU monitor is told: which GPUs matter, how often to look, and how
//! conservative readiness should be.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::backend::DeviceInfo;

/// XIDs that make a GPU unhealthy (latched): DCGM's "devastating" XIDs plus the NVIDIA
/// catalog's `RESET_GPU` / `RESTART_BM` buckets, i.e. the EKS node-monitoring list minus
/// 63 (a row-remap *recording* event; the remap flags decide instead) and 142 (NVENC).
pub const DEFAULT_FATAL_XIDS: [u64; 19] = [
    46, 48, 54, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 151, 155, 156, 158,
];

/// XIDs that are application errors, not hardware faults (the NVIDIA device plugin's
/// default ignore list, minus 109, which the catalog says needs a GPU reset).
pub const DEFAULT_IGNORED_XIDS: [u64; 5] = [13, 31, 43, 45, 68];

/// The shortest `sample_interval`: sampling faster would keep a sampler with several
/// GPUs busy all the time.
pub const MIN_SAMPLE_INTERVAL: Duration = Duration::from_millis(100);
/// The longest `sample_interval`: at least three samples must fit in
/// [`STALE_DEGRADED_AFTER`], so one slow sample is never taken for a hung NVML.
pub const MAX_SAMPLE_INTERVAL: Duration = Duration::from_secs(5);
/// No successful sample for longer than this makes a GPU degraded (the sampler is
/// stuck in NVML): the reference's 15 s, whatever the interval.
pub const STALE_DEGRADED_AFTER: Duration = Duration::from_secs(15);
/// No successful sample for longer than this makes a GPU unhealthy while it lasts:
/// the reference's 60 s, whatever the interval.
pub const STALE_UNHEALTHY_AFTER: Duration = Duration::from_secs(60);

/// Which GPUs count for readiness and the node summary. All visible GPUs are always
/// reported; unwatched ones just do not gate readiness.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[serde(tag = "kind", content = "ids", rename_all = "snake_case")]
pub enum Watch {
    #[default]
    All,
    /// GPUs by UUID, e.g. the ones the pod was allocated. A MIG device's UUID
    /// (`MIG-…`) stands for the physical GPU it is part of: health is per GPU.
    Uuids(Vec<String>),
    /// GPUs by NVML index (not stable across reboots; prefer UUIDs).
    Indices(Vec<u32>),
}

impl Watch {
    /// Whether `device` is watched.
    pub fn covers(&self, device: &DeviceInfo) -> bool {
        match self {
            Self::All => true,
            Self::Uuids(uuids) => uuids.iter().any(|uuid| device.answers_to(uuid)),
            Self::Indices(indices) => indices.contains(&device.index),
        }
    }

    /// The watched GPUs that `devices` does not contain, as written in the options.
    pub fn missing(&self, devices: &[DeviceInfo]) -> Vec<String> {
        match self {
            Self::All => Vec::new(),
            Self::Uuids(uuids) => uuids
                .iter()
                .filter(|uuid| !devices.iter().any(|device| device.answers_to(uuid)))
                .cloned()
                .collect(),
            Self::Indices(indices) => indices
                .iter()
                .filter(|index| !devices.iter().any(|device| &device.index == *index))
                .map(|index| format!("index {index}"))
                .collect(),
        }
    }
}

/// Options of the GPU monitor, `outrigger gpu` and the classifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Off: no NVML is loaded and readiness ignores GPUs.
    pub enabled: bool,
    /// Where `libnvidia-ml` lives; `None` lets the dynamic loader find `libnvidia-ml.so.1`.
    pub library_path: Option<PathBuf>,
    /// How often every signal is read, from [`MIN_SAMPLE_INTERVAL`] to
    /// [`MAX_SAMPLE_INTERVAL`].
    pub sample_interval: Duration,
    /// How long one event wait blocks; bounds how fast the event thread notices a stop.
    pub event_wait: Duration,
    pub watch: Watch,
    /// Whether a watched GPU (or NVML itself) in state `unknown` still counts as ready.
    pub unknown_is_ready: bool,
    /// Whether a degraded watched GPU still counts as ready.
    pub degraded_is_ready: bool,
    /// XIDs that make a GPU unhealthy.
    pub fatal_xids: BTreeSet<u64>,
    /// XIDs that are only counted. An XID in both sets is fatal: the fatal set is
    /// what an operator asks for, the ignore list a default.
    pub ignored_xids: BTreeSet<u64>,
    /// Consecutive bad samples before a gauge condition (temperature, clock slowdown,
    /// PCIe width, unreadable power) makes a GPU degraded.
    pub degraded_enter_samples: u32,
    /// How long a degraded condition must stay absent before it clears.
    pub degraded_clear_after: Duration,
    /// How many GPUs this node should show; fewer is unhealthy (a GPU went missing).
    pub expected_count: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            enabled: true,
            library_path: None,
            sample_interval: Duration::from_secs(5),
            event_wait: Duration::from_secs(1),
            watch: Watch::All,
            unknown_is_ready: true,
            degraded_is_ready: true,
            fatal_xids: DEFAULT_FATAL_XIDS.into_iter().collect(),
            ignored_xids: DEFAULT_IGNORED_XIDS.into_iter().collect(),
            degraded_enter_samples: 3,
            degraded_clear_after: Duration::from_secs(300),
            expected_count: None,
        }
    }
}

impl Options {
    /// Every problem with these options at once, as (field, what is wrong); empty when
    /// valid.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        if !(MIN_SAMPLE_INTERVAL..=MAX_SAMPLE_INTERVAL).contains(&self.sample_interval) {
            problems.push((
                "sample_interval",
                format!(
                    "{} is outside {}..={}: sampling must be fast enough that three samples \
                     fit in the {} after which a GPU without one is degraded, and no faster \
                     than a sampler can keep up with",
                    humantime::format_duration(self.sample_interval),
                    humantime::format_duration(MIN_SAMPLE_INTERVAL),
                    humantime::format_duration(MAX_SAMPLE_INTERVAL),
                    humantime::format_duration(STALE_DEGRADED_AFTER),
                ),
            ));
        }
        if self.event_wait.is_zero() {
            problems.push(("event_wait", "must be greater than zero".to_owned()));
        }
        if self.degraded_enter_samples == 0 {
            problems.push(("degraded_enter_samples", "must be at least 1".to_owned()));
        }
        match &self.watch {
            Watch::Uuids(uuids) if uuids.is_empty() => {
                problems.push((
                    "watch",
                    "an empty UUID list watches nothing; use all".to_owned(),
                ));
            }
            Watch::Indices(indices) if indices.is_empty() => {
                problems.push((
                    "watch",
                    "an empty index list watches nothing; use all".to_owned(),
                ));
            }
            Watch::All | Watch::Uuids(_) | Watch::Indices(_) => {}
        }
        problems
    }

    /// A sample older than this makes a GPU degraded (the sampler is stuck in NVML):
    /// [`STALE_DEGRADED_AFTER`], fixed, so that a fast interval does not turn one slow
    /// NVML call into a degraded GPU.
    pub fn stale_degraded_after(&self) -> Duration {
        STALE_DEGRADED_AFTER
    }

    /// A sample older than this makes a GPU unhealthy (while it stays stale):
    /// [`STALE_UNHEALTHY_AFTER`], fixed.
    pub fn stale_unhealthy_after(&self) -> Duration {
        STALE_UNHEALTHY_AFTER
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(uuid: &str, index: u32) -> DeviceInfo {
        DeviceInfo {
            uuid: uuid.to_owned(),
            index,
            name: "test".to_owned(),
            mig_devices: Vec::new(),
        }
    }

    #[test]
    fn defaults_are_valid_and_follow_the_reference() {
        let options = Options::default();
        assert!(options.problems().is_empty());
        assert!(options.fatal_xids.contains(&79));
        assert!(options.fatal_xids.contains(&48));
        assert!(!options.fatal_xids.contains(&63));
        assert!(options.ignored_xids.contains(&13));
        assert_eq!(options.stale_degraded_after(), Duration::from_secs(15));
        assert_eq!(options.stale_unhealthy_after(), Duration::from_secs(60));
    }

    #[test]
    fn problems_are_all_reported_with_their_field() {
        let options = Options {
            sample_interval: Duration::ZERO,
            degraded_enter_samples: 0,
            watch: Watch::Uuids(Vec::new()),
            ..Options::default()
        };
        let fields: Vec<&str> = options.problems().iter().map(|(field, _)| *field).collect();
        assert_eq!(
            fields,
            ["sample_interval", "degraded_enter_samples", "watch"],
            "{:?}",
            options.problems()
        );
    }

    #[test]
    fn the_sample_interval_is_bounded_and_staleness_does_not_follow_it() {
        for (interval, valid) in [
            (Duration::ZERO, false),
            (Duration::from_millis(99), false),
            (MIN_SAMPLE_INTERVAL, true),
            (Duration::from_secs(1), true),
            (MAX_SAMPLE_INTERVAL, true),
            (Duration::from_secs(6), false),
        ] {
            let options = Options {
                sample_interval: interval,
                ..Options::default()
            };
            let fields: Vec<&str> = options.problems().iter().map(|(f, _)| *f).collect();
            let want: &[&str] = if valid { &[] } else { &["sample_interval"] };
            assert_eq!(fields, want, "{interval:?}: {:?}", options.problems());
            assert_eq!(options.stale_degraded_after(), Duration::from_secs(15));
            assert_eq!(options.stale_unhealthy_after(), Duration::from_secs(60));
        }
        let slow = Options {
            sample_interval: Duration::from_secs(30),
            ..Options::default()
        };
        assert_eq!(
            slow.problems()[0].1,
            "30s is outside 100ms..=5s: sampling must be fast enough that three samples fit \
             in the 15s after which a GPU without one is degraded, and no faster than a \
             sampler can keep up with"
        );
    }

    #[test]
    fn a_fatal_xid_may_be_on_the_ignore_list() {
        let options = Options {
            fatal_xids: [13, 79].into_iter().collect(),
            ..Options::default()
        };
        assert!(options.ignored_xids.contains(&13));
        assert!(options.problems().is_empty(), "{:?}", options.problems());
    }

    #[test]
    fn watch_selects_and_reports_missing_gpus() {
        let devices = [device("GPU-a", 0), device("GPU-b", 1)];
        assert!(Watch::All.covers(&devices[1]));
        let by_uuid = Watch::Uuids(vec!["GPU-b".into(), "GPU-z".into()]);
        assert!(!by_uuid.covers(&devices[0]));
        assert!(by_uuid.covers(&devices[1]));
        assert_eq!(by_uuid.missing(&devices), vec!["GPU-z".to_owned()]);
        let by_index = Watch::Indices(vec![0, 7]);
        assert!(by_index.covers(&devices[0]));
        assert_eq!(by_index.missing(&devices), vec!["index 7".to_owned()]);
    }

    #[test]
    fn a_mig_uuid_stands_for_its_parent_gpu() {
        let mut partitioned = device("GPU-a", 0);
        partitioned.mig_devices = vec!["MIG-a1".into(), "MIG-a2".into()];
        let devices = [partitioned, device("GPU-b", 1)];
        let by_mig = Watch::Uuids(vec!["MIG-a2".into()]);
        assert!(by_mig.covers(&devices[0]));
        assert!(!by_mig.covers(&devices[1]));
        assert!(by_mig.missing(&devices).is_empty());
        let gone = Watch::Uuids(vec!["MIG-zz".into()]);
        assert_eq!(gone.missing(&devices), vec!["MIG-zz".to_owned()]);
    }
}
