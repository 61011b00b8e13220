//! A single look at the GPUs, for `outrigger gpu`: load, sample once, drain the events
//! already queued, classify, report. No threads.

use std::time::{Duration, Instant};

use crate::backend::{Backend, Error, EventStatus};
use crate::classify::Classifier;
use crate::clock::Moment;
use crate::monitor::Engine;
use crate::nvml::NvmlBackend;
use crate::options::Options;
use crate::snapshot::{NvmlStatus, Snapshot};

/// How long the probe waits for each queued event; the first empty wait ends the poll.
const EVENT_POLL: Duration = Duration::from_millis(200);
/// The most events one probe takes in.
const MAX_EVENTS: usize = 64;

/// Loads NVML per `options` and reports once. Never fails: a machine without the
/// driver gets a snapshot that says so.
pub fn probe_once(options: &Options) -> Snapshot {
    if !options.enabled {
        return Snapshot::without_gpus(NvmlStatus::Disabled, options);
    }
    match NvmlBackend::load(options.library_path.as_deref()) {
        Ok(backend) => probe(&backend, options),
        Err(error) => Snapshot::without_gpus(NvmlStatus::unavailable(error), options),
    }
}

/// Reports once on `backend`. With no history to go on, conditions present in this one
/// sample are reported at once (see [`Classifier::one_shot`]).
pub fn probe(backend: &dyn Backend, options: &Options) -> Snapshot {
    let driver = backend.driver();
    let mut events_status = backend.event_status();
    let mut engine = Engine::new(
        options.clone(),
        Classifier::one_shot(options),
        NvmlStatus::Up {
            driver_version: driver.driver_version,
            nvml_version: driver.nvml_version,
        },
    );
    let devices = match backend.devices() {
        Ok(devices) => devices,
        Err(error) => {
            engine.set_enumeration_error(Moment::now(), &error);
            return engine.snapshot(Moment::now());
        }
    };
    engine.set_devices(Moment::now(), &devices);

    let mut events = Vec::new();
    while events.len() < MAX_EVENTS {
        match backend.next_event(EVENT_POLL) {
            Ok(Some(event)) => events.push(event),
            Ok(None) => break,
            Err(Error::NotSupported(why) | Error::Unavailable(why)) => {
                events_status = EventStatus::Down(why);
                break;
            }
            Err(error) => {
                tracing::debug!(%error, "no GPU events for the probe");
                events_status = EventStatus::Down(format!("waiting for events failed: {error}"));
                break;
            }
        }
    }
    engine.set_events(events_status);
    engine.record_events(Moment::now(), &events);

    let started = Instant::now();
    let readings = devices
        .iter()
        .map(|device| (device.clone(), backend.sample(&device.uuid)))
        .collect();
    let took = started.elapsed();
    let now = Moment::now();
    engine.record_round(now, readings, took);
    engine.snapshot(now)
}
