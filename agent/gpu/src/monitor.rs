//! The running monitor: a sampler thread and an event thread that own every NVML call,
//! a watchdog thread that never calls NVML (so time-based verdicts move even when NVML
//! hangs),
//! and a `watch` channel of immutable snapshots that probes, the admin API and the data
//! plane read without ever blocking on the GPU.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use outrigger_types::GpuState;
use tokio::sync::watch;

use crate::backend::{Backend, DeviceInfo, Error, Event, EventStatus};
use crate::classify::{Classifier, GpuHealth, Reason, ReasonCode};
use crate::clock::{Clock, Moment, Stop, SystemClock, lock};
use crate::nvml::NvmlBackend;
use crate::options::Options;
use crate::sample::Sample;
use crate::snapshot::{Incident, NvmlStatus, Parts, Snapshot};

/// How many incidents a snapshot keeps.
pub const INCIDENT_HISTORY_LEN: usize = 64;

/// The health bookkeeping shared by the monitor's threads and by one-shot probes.
#[derive(Debug)]
pub(crate) struct Engine {
    options: Options,
    classifier: Classifier,
    nvml: NvmlStatus,
    events: EventStatus,
    devices: Vec<DeviceInfo>,
    health: BTreeMap<String, GpuHealth>,
    problems: Vec<Reason>,
    sampled_at: Option<SystemTime>,
    rounds: u64,
    generation: u64,
    sample_duration: Option<Duration>,
    incidents: VecDeque<Incident>,
    /// Events that arrived before the GPUs were listed; applied once they are, so an
    /// XID delivered at start-up is not lost.
    early_events: Vec<(Moment, Event)>,
    enumerated: bool,
}

impl Engine {
    pub(crate) fn new(options: Options, classifier: Classifier, nvml: NvmlStatus) -> Self {
        Self {
            options,
            classifier,
            nvml,
            events: EventStatus::Inactive,
            devices: Vec::new(),
            health: BTreeMap::new(),
            problems: Vec::new(),
            sampled_at: None,
            rounds: 0,
            generation: 0,
            sample_duration: None,
            incidents: VecDeque::new(),
            early_events: Vec::new(),
            enumerated: false,
        }
    }

    pub(crate) fn set_nvml(&mut self, nvml: NvmlStatus) {
        self.nvml = nvml;
    }

    pub(crate) fn set_events(&mut self, events: EventStatus) {
        self.events = events;
    }

    /// Records the GPU inventory and the node-level problems it implies.
    pub(crate) fn set_devices(&mut self, now: Moment, devices: &[DeviceInfo]) {
        self.devices = devices.to_vec();
        self.problems.clear();
        // A GPU listed before but not now (listed anew under another id) is forgotten.
        let listed = |uuid: &str| devices.iter().any(|device| device.uuid == uuid);
        let gone: Vec<String> = self
            .health
            .keys()
            .filter(|uuid| !listed(uuid))
            .cloned()
            .collect();
        for uuid in gone {
            self.health.remove(&uuid);
            self.classifier.untrack(&uuid);
        }
        for device in devices {
            self.classifier.track(now, device);
            if let Some(health) = self.classifier.health(now, &device.uuid) {
                self.store(health);
            }
        }
        if let Some(expected) = self.options.expected_count
            && devices.len() < expected as usize
        {
            self.problems.push(Reason {
                code: ReasonCode::GpuMissing,
                severity: GpuState::Unhealthy,
                detail: format!("{} GPU(s) visible, {expected} expected", devices.len()),
                since: now.wall,
            });
        }
        let missing = self.options.watch.missing(devices);
        if !missing.is_empty() {
            self.problems.push(Reason {
                code: ReasonCode::GpuMissing,
                severity: GpuState::Unhealthy,
                detail: format!("watched GPU(s) not visible: {}", missing.join(", ")),
                since: now.wall,
            });
        }
        self.enumerated = true;
        for (at, event) in std::mem::take(&mut self.early_events) {
            self.record_events(at, &[event]);
        }
    }

    pub(crate) fn set_enumeration_error(&mut self, now: Moment, error: &Error) {
        let since = self
            .problems
            .iter()
            .find(|problem| problem.code == ReasonCode::EnumerationFailed)
            .map_or(now.wall, |problem| problem.since);
        self.problems = vec![Reason {
            code: ReasonCode::EnumerationFailed,
            severity: GpuState::Unknown,
            detail: format!("cannot list GPUs: {error}"),
            since,
        }];
    }

    /// Applies one sampling round.
    pub(crate) fn record_round(
        &mut self,
        now: Moment,
        readings: Vec<(DeviceInfo, Result<Sample, Error>)>,
        took: Duration,
    ) {
        for (device, reading) in readings {
            let health = self.classifier.step(now, &device, reading, &[]);
            self.store(health);
        }
        self.sampled_at = Some(now.wall);
        self.rounds += 1;
        self.sample_duration = Some(took);
    }

    pub(crate) fn record_events(&mut self, now: Moment, events: &[Event]) {
        if !self.enumerated {
            self.early_events
                .extend(events.iter().map(|event| (now, event.clone())));
            return;
        }
        for health in self.classifier.observe_events(now, events) {
            self.store(health);
        }
    }

    /// Re-evaluates time-based conditions; true when any GPU's verdict changed.
    pub(crate) fn refresh(&mut self, now: Moment) -> bool {
        let mut changed = false;
        let uuids: Vec<String> = self.health.keys().cloned().collect();
        for uuid in uuids {
            if let Some(health) = self.classifier.health(now, &uuid) {
                let before = self.health.get(&uuid);
                if before.is_none_or(|before| {
                    before.state != health.state || before.reasons != health.reasons
                }) {
                    changed = true;
                    self.store(health);
                }
            }
        }
        changed
    }

    fn store(&mut self, mut health: GpuHealth) {
        health.watched = self
            .devices
            .iter()
            .find(|device| device.uuid == health.uuid)
            .is_none_or(|device| self.options.watch.covers(device));
        self.health.insert(health.uuid.clone(), health);
    }

    /// Builds the next snapshot, updating the incident timeline on the way.
    pub(crate) fn snapshot(&mut self, now: Moment) -> Snapshot {
        self.generation += 1;
        let mut gpus: Vec<GpuHealth> = self.health.values().cloned().collect();
        gpus.sort_by(|a, b| a.index.cmp(&b.index).then(a.uuid.cmp(&b.uuid)));

        let mut current: Vec<(String, GpuState, Vec<ReasonCode>)> = gpus
            .iter()
            .filter(|gpu| gpu.watched)
            .map(|gpu| (gpu.uuid.clone(), gpu.state, gpu.reason_codes()))
            .collect();
        if let Some(worst) = self.problems.iter().map(|problem| problem.severity).max() {
            let codes = self.problems.iter().map(|problem| problem.code).collect();
            current.push(("node".to_owned(), worst, codes));
        }
        self.update_incidents(now, &current);

        Snapshot::from_parts(
            Parts {
                nvml: self.nvml.clone(),
                events: self.events.clone(),
                gpus,
                problems: self.problems.clone(),
                sampled_at: self.sampled_at,
                rounds: self.rounds,
                generation: self.generation,
                sample_duration_ms: self.sample_duration.map(|took| took.as_secs_f64() * 1000.0),
                incidents: self.incidents.iter().cloned().collect(),
            },
            &self.options,
        )
    }

    fn update_incidents(&mut self, now: Moment, current: &[(String, GpuState, Vec<ReasonCode>)]) {
        for incident in self.incidents.iter_mut().filter(|i| i.until.is_none()) {
            let still = current
                .iter()
                .find(|(gpu, _, _)| *gpu == incident.gpu)
                .is_some_and(|(_, state, _)| *state == incident.state);
            if !still {
                incident.until = Some(now.wall);
            }
        }
        for (gpu, state, codes) in current {
            if *state < GpuState::Degraded {
                continue;
            }
            let open = self
                .incidents
                .iter_mut()
                .find(|incident| incident.until.is_none() && incident.gpu == *gpu);
            match open {
                Some(incident) => {
                    for code in codes {
                        if !incident.reasons.contains(code) {
                            incident.reasons.push(*code);
                        }
                    }
                }
                None => self.incidents.push_back(Incident {
                    gpu: gpu.clone(),
                    state: *state,
                    reasons: codes.clone(),
                    from: now.wall,
                    until: None,
                }),
            }
        }
        while self.incidents.len() > INCIDENT_HISTORY_LEN {
            let closed = self
                .incidents
                .iter()
                .position(|incident| incident.until.is_some());
            match closed {
                Some(position) => {
                    self.incidents.remove(position);
                }
                None => {
                    self.incidents.pop_front();
                }
            }
        }
    }
}

/// State shared by the monitor handle and its threads.
struct Shared {
    options: Options,
    stop: Stop,
    clock: Arc<dyn Clock>,
    engine: Mutex<Engine>,
    snapshots: watch::Sender<Arc<Snapshot>>,
}

impl Shared {
    fn new(
        options: Options,
        clock: Arc<dyn Clock>,
        nvml: NvmlStatus,
        events: EventStatus,
    ) -> (Arc<Self>, watch::Receiver<Arc<Snapshot>>) {
        let mut engine = Engine::new(options.clone(), Classifier::new(&options), nvml);
        engine.set_events(events);
        let first = engine.snapshot(clock.now());
        let (snapshots, receiver) = watch::channel(Arc::new(first));
        let shared = Arc::new(Self {
            options,
            stop: Stop::new(),
            clock,
            engine: Mutex::new(engine),
            snapshots,
        });
        (shared, receiver)
    }

    /// Applies `change` to the engine and publishes the resulting snapshot.
    fn publish(&self, change: impl FnOnce(&mut Engine, Moment)) {
        let mut engine = lock(&self.engine);
        let now = self.clock.now();
        change(&mut engine, now);
        let snapshot = engine.snapshot(now);
        self.snapshots.send_replace(Arc::new(snapshot));
    }

    /// Publishes a new event status, if it changed.
    fn set_events(&self, events: EventStatus) {
        let mut engine = lock(&self.engine);
        if engine.events == events {
            return;
        }
        let now = self.clock.now();
        engine.set_events(events);
        let snapshot = engine.snapshot(now);
        self.snapshots.send_replace(Arc::new(snapshot));
    }

    fn refresh(&self) {
        let mut engine = lock(&self.engine);
        let now = self.clock.now();
        if engine.refresh(now) {
            let snapshot = engine.snapshot(now);
            self.snapshots.send_replace(Arc::new(snapshot));
        }
    }
}

/// A running GPU monitor. Dropping it stops its threads (within one wait cycle); the
/// join handles returned at start let the owner wait for that.
pub struct Monitor {
    shared: Arc<Shared>,
    receiver: watch::Receiver<Arc<Snapshot>>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("generation", &self.receiver.borrow().generation)
            .finish_non_exhaustive()
    }
}

impl Monitor {
    /// Loads NVML per `options` and monitors it. Loading happens on the sampler thread
    /// (it can hang on a wedged driver), so this returns at once with an NVML status
    /// of `starting`. Without NVML the snapshot says why and no thread keeps running;
    /// with monitoring disabled no thread is started at all.
    pub fn launch(options: Options) -> (Self, Vec<JoinHandle<()>>) {
        let initial = if options.enabled {
            NvmlStatus::Starting
        } else {
            NvmlStatus::Disabled
        };
        let (shared, receiver) = Shared::new(
            options,
            Arc::new(SystemClock),
            initial,
            EventStatus::Inactive,
        );
        let monitor = Self { shared, receiver };
        if !monitor.shared.options.enabled {
            return (monitor, Vec::new());
        }
        let thread_shared = Arc::clone(&monitor.shared);
        let spawned = std::thread::Builder::new()
            .name("outrigger-gpu-sampler".to_owned())
            .spawn(move || load_and_run(&thread_shared));
        match spawned {
            Ok(handle) => (monitor, vec![handle]),
            Err(error) => {
                tracing::error!(%error, "cannot start the GPU sampler thread");
                monitor.shared.publish(|engine, _| {
                    engine.set_nvml(NvmlStatus::Unavailable {
                        reason: format!("cannot start the GPU sampler thread: {error}"),
                    });
                });
                (monitor, Vec::new())
            }
        }
    }

    /// Monitors `backend` on the real clock: a sampler, an event and a watchdog thread.
    pub fn start(backend: Arc<dyn Backend>, options: Options) -> (Self, Vec<JoinHandle<()>>) {
        Self::start_with_clock(backend, options, Arc::new(SystemClock))
    }

    /// As [`Monitor::start`], with an injected clock (tests use a `ManualClock`).
    pub fn start_with_clock(
        backend: Arc<dyn Backend>,
        options: Options,
        clock: Arc<dyn Clock>,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let driver = backend.driver();
        let nvml = NvmlStatus::Up {
            driver_version: driver.driver_version,
            nvml_version: driver.nvml_version,
        };
        let (shared, receiver) = Shared::new(options, clock, nvml, backend.event_status());
        let mut handles = Vec::new();
        let sampler_shared = Arc::clone(&shared);
        let sampler_backend = Arc::clone(&backend);
        match std::thread::Builder::new()
            .name("outrigger-gpu-sampler".to_owned())
            .spawn(move || run_sampler(&sampler_shared, sampler_backend.as_ref()))
        {
            Ok(handle) => handles.push(handle),
            Err(error) => {
                tracing::error!(%error, "cannot start the GPU sampler thread");
                shared.publish(|engine, _| {
                    engine.set_nvml(NvmlStatus::Unavailable {
                        reason: format!("cannot start the GPU sampler thread: {error}"),
                    });
                });
            }
        }
        handles.extend(spawn_events(&shared, &backend));
        handles.extend(spawn_watchdog(&shared));
        (Self { shared, receiver }, handles)
    }

    /// The latest snapshot; never blocks on the GPU.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(&self.receiver.borrow())
    }

    /// A receiver that sees every new snapshot.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.receiver.clone()
    }

    /// Asks the threads to stop (dropping the monitor does the same).
    pub fn stop(&self) {
        self.shared.stop.raise();
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.shared.stop.raise();
    }
}

/// The body of a launched monitor's first thread: load NVML, then sample, with the
/// event and watchdog threads beside it.
fn load_and_run(shared: &Arc<Shared>) {
    let path = shared.options.library_path.clone();
    let backend: Arc<dyn Backend> = match NvmlBackend::load(path.as_deref()) {
        Ok(backend) => Arc::new(backend),
        Err(error) => {
            tracing::warn!(%error, "GPU health unavailable");
            shared.publish(|engine, _| engine.set_nvml(NvmlStatus::unavailable(error)));
            return;
        }
    };
    let driver = backend.driver();
    let events = backend.event_status();
    shared.publish(|engine, _| {
        engine.set_nvml(NvmlStatus::Up {
            driver_version: driver.driver_version,
            nvml_version: driver.nvml_version,
        });
        engine.set_events(events);
    });
    let helpers: Vec<JoinHandle<()>> = spawn_events(shared, &backend)
        .into_iter()
        .chain(spawn_watchdog(shared))
        .collect();
    run_sampler(shared, backend.as_ref());
    for helper in helpers {
        let _ = helper.join();
    }
}

fn spawn_watchdog(shared: &Arc<Shared>) -> Option<JoinHandle<()>> {
    let shared = Arc::clone(shared);
    std::thread::Builder::new()
        .name("outrigger-gpu-watchdog".to_owned())
        .spawn(move || run_watchdog(&shared))
        .map_err(|error| tracing::error!(%error, "cannot start the GPU watchdog thread"))
        .ok()
}

fn spawn_events(shared: &Arc<Shared>, backend: &Arc<dyn Backend>) -> Option<JoinHandle<()>> {
    let shared = Arc::clone(shared);
    let backend = Arc::clone(backend);
    std::thread::Builder::new()
        .name("outrigger-gpu-events".to_owned())
        .spawn(move || run_events(&shared, backend.as_ref()))
        .map_err(|error| tracing::error!(%error, "cannot start the GPU event thread"))
        .ok()
}

fn run_sampler(shared: &Shared, backend: &dyn Backend) {
    let interval = shared.options.sample_interval;
    let mut devices: Option<Vec<DeviceInfo>> = None;
    let mut next = shared.clock.now().mono;
    while !shared.stop.is_raised() {
        // Listed every round: a backend may list a GPU anew (NVML lists a GPU whose
        // handle failed at start-up under its real UUID once the handle works).
        match backend.devices() {
            Ok(list) => {
                if devices.as_ref() != Some(&list) {
                    shared.publish(|engine, now| engine.set_devices(now, &list));
                    devices = Some(list);
                }
            }
            Err(error) if devices.is_none() => {
                tracing::warn!(%error, "cannot list GPUs; retrying");
                shared.publish(|engine, now| engine.set_enumeration_error(now, &error));
            }
            Err(error) => {
                tracing::debug!(%error, "cannot list GPUs again; keeping the last list");
            }
        }
        if let Some(list) = &devices {
            let started = Instant::now();
            // No lock is held while NVML runs: readers and the event thread go on.
            let readings: Vec<(DeviceInfo, Result<Sample, Error>)> = list
                .iter()
                .map(|device| (device.clone(), backend.sample(&device.uuid)))
                .collect();
            let took = started.elapsed();
            shared.publish(|engine, now| engine.record_round(now, readings, took));
        }
        next += interval;
        let now = shared.clock.now().mono;
        if next < now {
            // We fell behind (a slow NVML call or a jump of the clock): skip the
            // missed ticks rather than sample in a burst.
            next = now + interval;
        }
        if !shared.clock.wait_until(next, &shared.stop) {
            break;
        }
    }
}

/// Takes events until stopped. Event delivery that fails is published (the snapshot's
/// `events`, the `outrigger_gpu_events_up` metric) and logged at WARN: it does not
/// change any GPU's health, but without it fatal XIDs that leave no persistent state
/// go unseen.
fn run_events(shared: &Shared, backend: &dyn Backend) {
    let wait = shared.options.event_wait;
    // What a working wait means: all GPUs, or only those whose registration worked.
    let working = backend.event_status();
    // A wedged GPU can fail every wait; say so once per distinct error, not per second.
    let mut last_error: Option<Error> = None;
    while !shared.stop.is_raised() {
        match backend.next_event(wait) {
            Ok(Some(event)) => {
                if last_error.take().is_some() {
                    shared.set_events(working.clone());
                }
                tracing::warn!(?event, "GPU event");
                shared.publish(|engine, now| engine.record_events(now, &[event]));
            }
            Ok(None) => {
                if last_error.take().is_some() {
                    tracing::info!("GPU events are delivered again");
                    shared.set_events(working.clone());
                }
            }
            Err(Error::NotSupported(why) | Error::Unavailable(why)) => {
                tracing::warn!(
                    %why,
                    "GPU events are not delivered: XIDs that leave no persistent state will \
                     not be seen; sampling goes on"
                );
                shared.set_events(EventStatus::Down(why));
                return;
            }
            Err(error) => {
                if last_error.as_ref() != Some(&error) {
                    tracing::warn!(%error, "waiting for GPU events failed");
                    shared.set_events(EventStatus::Down(format!(
                        "waiting for events failed: {error}"
                    )));
                    last_error = Some(error);
                }
                // Do not spin on a persistent error.
                if !shared.stop.wait_timeout(wait) {
                    return;
                }
            }
        }
    }
}

/// Moves time-based verdicts (clear windows, staleness) without touching NVML, so a
/// sampler and an event thread both stuck inside a wedged driver still end in a stale
/// verdict instead of a frozen snapshot.
fn run_watchdog(shared: &Shared) {
    while shared.stop.wait_timeout(shared.options.event_wait) {
        shared.refresh();
    }
}
