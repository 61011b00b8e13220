//! A scripted backend for tests and demos: GPUs with a steady reading, optional
//! one-off readings queued in front of it, and events pushed while the monitor runs.
//! Clones share the script, so a test keeps a handle and steers a running monitor.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::backend::{Backend, DeviceInfo, DriverInfo, Error, Event, EventStatus};
use crate::clock::lock;
use crate::sample::{EccCounts, Pcie, RemappedRows, Sample};

/// A scripted [`Backend`].
#[derive(Debug, Clone, Default)]
pub struct FakeBackend {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    script: Mutex<Script>,
    event_pushed: Condvar,
    samples_released: Condvar,
}

#[derive(Debug, Default)]
struct Script {
    devices: Vec<DeviceInfo>,
    devices_error: Option<Error>,
    gpus: BTreeMap<String, FakeGpu>,
    events: VecDeque<Result<Event, Error>>,
    events_unsupported: bool,
    /// Why some GPUs' events are not delivered (a partial registration).
    events_partial: Option<String>,
    /// While set, every `next_event` fails with it.
    events_failing: Option<Error>,
    samples_taken: u64,
    /// While set, `sample` blocks, like NVML on a wedged GPU.
    samples_held: bool,
}

#[derive(Debug)]
struct FakeGpu {
    queued: VecDeque<Result<Sample, Error>>,
    steady: Result<Sample, Error>,
}

/// The UUID [`FakeBackend::with_gpus`] gives GPU `index`.
pub fn fake_uuid(index: u32) -> String {
    format!("GPU-fa4e0000-0000-4000-8000-{index:012}")
}

/// An idle, cool, error-free datacenter GPU.
pub fn healthy_sample() -> Sample {
    Sample {
        temperature_c: Some(38),
        slowdown_temperature_c: Some(87),
        shutdown_temperature_c: Some(92),
        power_mw: Some(74_000),
        power_limit_mw: Some(700_000),
        energy_mj: Some(1_000_000),
        gpu_utilization_pct: Some(0),
        memory_utilization_pct: Some(0),
        memory_used_bytes: Some(555_745_280),
        memory_total_bytes: Some(150_754_820_096),
        ecc_enabled: Some(true),
        ecc: EccCounts {
            corrected_volatile: Some(0),
            uncorrected_volatile: Some(0),
            corrected_aggregate: Some(0),
            uncorrected_aggregate: Some(0),
        },
        remapped_rows: RemappedRows {
            correctable: Some(0),
            uncorrectable: Some(0),
            pending: Some(false),
            failure: Some(false),
        },
        recovery_action: Some(0),
        clock_event_reasons: Some(0x1),
        pcie: Pcie {
            replays: Some(0),
            generation: Some(5),
            width: Some(16),
            max_generation: Some(5),
            max_width: Some(16),
        },
        mig_enabled: Some(false),
        ..Sample::default()
    }
}

impl FakeBackend {
    /// A backend with no GPUs.
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend with `count` healthy GPUs named by [`fake_uuid`].
    pub fn with_gpus(count: u32) -> Self {
        let backend = Self::new();
        for index in 0..count {
            backend.add_gpu(
                DeviceInfo {
                    uuid: fake_uuid(index),
                    index,
                    name: "NVIDIA H200 (fake)".to_owned(),
                    mig_devices: Vec::new(),
                },
                healthy_sample(),
            );
        }
        backend
    }

    /// Adds a GPU whose every sample is `steady` until changed.
    pub fn add_gpu(&self, device: DeviceInfo, steady: Sample) {
        let mut script = lock(&self.inner.script);
        script.gpus.insert(
            device.uuid.clone(),
            FakeGpu {
                queued: VecDeque::new(),
                steady: Ok(steady),
            },
        );
        script.devices.push(device);
    }

    /// Replaces the steady reading of a GPU (a sample, or a failure such as `GpuLost`).
    pub fn set_sample(&self, uuid: &str, reading: Result<Sample, Error>) {
        if let Some(gpu) = lock(&self.inner.script).gpus.get_mut(uuid) {
            gpu.steady = reading;
        }
    }

    /// Queues readings returned once each, in order, before the steady one.
    pub fn queue_samples(
        &self,
        uuid: &str,
        readings: impl IntoIterator<Item = Result<Sample, Error>>,
    ) {
        if let Some(gpu) = lock(&self.inner.script).gpus.get_mut(uuid) {
            gpu.queued.extend(readings);
        }
    }

    /// Makes `devices()` fail (or succeed again with `None`).
    pub fn set_devices_error(&self, error: Option<Error>) {
        lock(&self.inner.script).devices_error = error;
    }

    /// Delivers an event to the next `next_event` call.
    pub fn push_event(&self, event: Event) {
        lock(&self.inner.script).events.push_back(Ok(event));
        self.inner.event_pushed.notify_all();
    }

    /// Makes one `next_event` call fail.
    pub fn push_event_error(&self, error: Error) {
        lock(&self.inner.script).events.push_back(Err(error));
        self.inner.event_pushed.notify_all();
    }

    /// Makes `next_event` report that events are not supported.
    pub fn disable_events(&self) {
        lock(&self.inner.script).events_unsupported = true;
        self.inner.event_pushed.notify_all();
    }

    /// Makes every `next_event` fail with `error` until called with `None`, like an
    /// event set on a wedged driver.
    pub fn set_events_failing(&self, error: Option<Error>) {
        lock(&self.inner.script).events_failing = error;
        self.inner.event_pushed.notify_all();
    }

    /// Reports events as delivered for some GPUs only, as NVML does when one GPU's
    /// registration failed; events still flow.
    pub fn partial_events(&self, reason: &str) {
        lock(&self.inner.script).events_partial = Some(reason.to_owned());
    }

    /// Makes every `sample` call block until [`FakeBackend::release_samples`], like an
    /// NVML call on a wedged GPU.
    pub fn hold_samples(&self) {
        lock(&self.inner.script).samples_held = true;
    }

    pub fn release_samples(&self) {
        lock(&self.inner.script).samples_held = false;
        self.inner.samples_released.notify_all();
    }

    /// Events pushed but not yet taken by `next_event`.
    pub fn events_pending(&self) -> usize {
        lock(&self.inner.script).events.len()
    }

    /// How many `sample` calls have been answered.
    pub fn samples_taken(&self) -> u64 {
        lock(&self.inner.script).samples_taken
    }
}

impl Backend for FakeBackend {
    fn driver(&self) -> DriverInfo {
        DriverInfo {
            driver_version: "fake".to_owned(),
            nvml_version: "fake".to_owned(),
        }
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>, Error> {
        let script = lock(&self.inner.script);
        match &script.devices_error {
            Some(error) => Err(error.clone()),
            None => Ok(script.devices.clone()),
        }
    }

    fn sample(&self, uuid: &str) -> Result<Sample, Error> {
        let script = lock(&self.inner.script);
        let mut script = self
            .inner
            .samples_released
            .wait_while(script, |script| script.samples_held)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        script.samples_taken += 1;
        let gpu = script
            .gpus
            .get_mut(uuid)
            .ok_or_else(|| Error::UnknownGpu(uuid.to_owned()))?;
        gpu.queued.pop_front().unwrap_or_else(|| gpu.steady.clone())
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<Event>, Error> {
        let script = lock(&self.inner.script);
        let (mut script, _) = self
            .inner
            .event_pushed
            .wait_timeout_while(script, timeout, |script| {
                script.events.is_empty()
                    && !script.events_unsupported
                    && script.events_failing.is_none()
            })
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if script.events_unsupported {
            return Err(Error::NotSupported(
                "the fake has events disabled".to_owned(),
            ));
        }
        if let Some(error) = &script.events_failing {
            return Err(error.clone());
        }
        script.events.pop_front().transpose()
    }

    fn event_status(&self) -> EventStatus {
        let script = lock(&self.inner.script);
        if script.events_unsupported {
            EventStatus::Down("the fake has events disabled".to_owned())
        } else if let Some(reason) = &script.events_partial {
            EventStatus::Partial(reason.clone())
        } else {
            EventStatus::Up
        }
    }
}
