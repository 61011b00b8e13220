//! The monitor end to end on a scripted backend and a manual clock: faults arrive as
//! events or samples on the monitor's own threads, and the published snapshots (the
//! readiness verdict above all) follow, deterministically and in milliseconds.

use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use outrigger_gpu::{
    DeviceInfo, Error, Event, EventStatus, FakeBackend, GpuHealth, ManualClock, Monitor,
    NvmlStatus, Options, ReasonCode, Sample, Snapshot, Watch, fake_uuid, healthy_sample, probe,
};
use outrigger_types::GpuState;
use tokio::sync::watch;

const TICK: Duration = Duration::from_secs(5);
/// A safety net only: every wait below ends as soon as its condition holds.
const PATIENCE: Duration = Duration::from_secs(20);

fn options() -> Options {
    Options {
        // Short real-time event waits keep shutdown quick.
        event_wait: Duration::from_millis(20),
        ..Options::default()
    }
}

struct Harness {
    backend: FakeBackend,
    clock: ManualClock,
    monitor: Monitor,
    handles: Vec<JoinHandle<()>>,
    snapshots: watch::Receiver<Arc<Snapshot>>,
}

impl Harness {
    fn start(backend: FakeBackend, options: Options) -> Self {
        let clock = ManualClock::new();
        let (monitor, handles) =
            Monitor::start_with_clock(Arc::new(backend.clone()), options, Arc::new(clock.clone()));
        let snapshots = monitor.subscribe();
        Self {
            backend,
            clock,
            monitor,
            handles,
            snapshots,
        }
    }

    async fn until(
        &mut self,
        what: &str,
        mut done: impl FnMut(&Snapshot) -> bool,
    ) -> Arc<Snapshot> {
        let waited = tokio::time::timeout(PATIENCE, self.snapshots.wait_for(|s| done(s))).await;
        match waited {
            Ok(Ok(snapshot)) => Arc::clone(&snapshot),
            _ => panic!(
                "gave up waiting for {what}; last snapshot: {:#?}",
                self.monitor.snapshot()
            ),
        }
    }

    /// Moves the clock one sampling interval and waits for that round.
    async fn round(&mut self) -> Arc<Snapshot> {
        let next = self.monitor.snapshot().rounds + 1;
        self.clock.advance(TICK);
        self.until(&format!("round {next}"), |s| s.rounds >= next)
            .await
    }

    /// Stops the monitor and checks that its threads end.
    fn stop(self) {
        let Self {
            monitor, handles, ..
        } = self;
        let count = handles.len();
        drop(monitor);
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            for handle in handles {
                let _ = done.send(handle.join().is_ok());
            }
        });
        for _ in 0..count {
            assert_eq!(
                finished.recv_timeout(PATIENCE),
                Ok(true),
                "a monitor thread did not stop"
            );
        }
    }
}

fn gpu(snapshot: &Snapshot, index: u32) -> &GpuHealth {
    match snapshot.gpu(&fake_uuid(index)) {
        Some(gpu) => gpu,
        None => panic!("GPU {index} missing from {snapshot:#?}"),
    }
}

fn hot() -> Sample {
    Sample {
        temperature_c: Some(88),
        clock_event_reasons: Some(0x40 | 0x20),
        ..healthy_sample()
    }
}

#[tokio::test]
async fn xid_79_makes_the_gpu_unhealthy_and_the_pod_unready_for_good() {
    let mut h = Harness::start(FakeBackend::with_gpus(2), options());
    let first = h.until("the first round", |s| s.rounds >= 1).await;
    assert!(first.ready, "{}", first.ready_reason);
    assert_eq!(first.summary.state, GpuState::Healthy);
    assert_eq!(h.monitor.snapshot().gpus.len(), 2);

    h.backend.push_event(Event::Xid {
        uuid: fake_uuid(1),
        xid: Some(79),
    });
    // Between samples: the event thread alone flips readiness.
    let down = h.until("readiness to fail", |s| !s.ready).await;
    assert_eq!(down.rounds, 1, "no sampling round was needed");
    assert_eq!(gpu(&down, 0).state, GpuState::Healthy);
    let broken = gpu(&down, 1);
    assert_eq!(broken.state, GpuState::Unhealthy);
    assert_eq!(broken.reason_codes(), vec![ReasonCode::XidFatal]);
    assert_eq!(broken.xid_history.len(), 1);
    assert_eq!(down.summary.unhealthy, vec![fake_uuid(1)]);
    assert!(
        down.ready_reason.contains(&fake_uuid(1)),
        "{}",
        down.ready_reason
    );
    let incident = down.incidents.last().cloned();
    assert_eq!(
        incident.as_ref().map(|i| (i.state, i.until)),
        Some((GpuState::Unhealthy, None))
    );
    let since = incident.map(|i| i.from).unwrap_or(std::time::UNIX_EPOCH);
    assert!(
        down.hardware_fault(since, since).is_some(),
        "errors now are charged to hardware"
    );

    // Latched: many healthy samples later it is still down.
    for _ in 0..20 {
        let later = h.round().await;
        assert!(!later.ready);
        assert_eq!(gpu(&later, 1).state, GpuState::Unhealthy);
    }
    h.stop();
}

#[tokio::test]
async fn a_double_bit_ecc_error_is_unhealthy() {
    let mut h = Harness::start(FakeBackend::with_gpus(1), options());
    h.until("the first round", |s| s.rounds >= 1).await;

    h.backend
        .push_event(Event::DoubleBitEcc { uuid: fake_uuid(0) });
    let mut counted = healthy_sample();
    counted.ecc.uncorrected_volatile = Some(1);
    h.backend.set_sample(&fake_uuid(0), Ok(counted));
    let down = h.until("readiness to fail", |s| !s.ready).await;
    assert_eq!(
        gpu(&down, 0).reason_codes(),
        vec![ReasonCode::EccUncorrected]
    );
    assert_eq!(gpu(&down, 0).uncorrected_ecc_events, 1);

    let sampled = h.round().await;
    assert_eq!(gpu(&sampled, 0).state, GpuState::Unhealthy);
    assert_eq!(sampled.summary.state, GpuState::Unhealthy);
    h.stop();
}

#[tokio::test]
async fn thermal_slowdown_enters_after_three_samples_and_leaves_after_five_quiet_minutes() {
    let mut h = Harness::start(FakeBackend::with_gpus(1), options());
    h.until("the first round", |s| s.rounds >= 1).await;

    h.backend.set_sample(&fake_uuid(0), Ok(hot()));
    assert_eq!(gpu(&*h.round().await, 0).state, GpuState::Healthy);
    assert_eq!(gpu(&*h.round().await, 0).state, GpuState::Healthy);
    let entered = h.round().await;
    let hot_gpu = gpu(&entered, 0);
    assert_eq!(hot_gpu.state, GpuState::Degraded);
    assert_eq!(
        hot_gpu.reason_codes(),
        vec![ReasonCode::Thermal, ReasonCode::ClockSlowdown]
    );
    assert!(entered.ready, "degraded still serves by default");
    assert_eq!(entered.summary.state, GpuState::Degraded);

    h.backend.set_sample(&fake_uuid(0), Ok(healthy_sample()));
    let cooling_from = entered.rounds + 1;
    // Well inside the five quiet minutes it stays degraded...
    let mut snapshot = h.round().await;
    while snapshot.rounds < cooling_from + 50 {
        assert_eq!(
            gpu(&snapshot, 0).state,
            GpuState::Degraded,
            "round {}",
            snapshot.rounds
        );
        snapshot = h.round().await;
    }
    // ...and once they have passed it is healthy again.
    while snapshot.rounds < cooling_from + 60 {
        snapshot = h.round().await;
    }
    let cleared = h
        .until("the GPU to clear", |s| {
            s.gpus.first().is_some_and(|g| g.state == GpuState::Healthy)
        })
        .await;
    assert!(cleared.ready);
    let incident = cleared.incidents.last().cloned();
    assert_eq!(incident.as_ref().map(|i| i.state), Some(GpuState::Degraded));
    assert!(
        incident.is_some_and(|i| i.until.is_some()),
        "the incident is closed"
    );
    h.stop();
}

#[tokio::test]
async fn a_sampler_stuck_in_nvml_goes_stale_then_unhealthy_and_recovers() {
    let mut h = Harness::start(FakeBackend::with_gpus(1), options());
    h.until("the first round", |s| s.rounds >= 1).await;
    h.backend.hold_samples();
    // The sampler wakes and blocks inside `sample`; only the watchdog moves now.
    h.clock.advance(Duration::from_secs(20));
    let stale = h
        .until("a stale verdict", |s| {
            s.gpus
                .first()
                .is_some_and(|g| g.state == GpuState::Degraded)
        })
        .await;
    assert_eq!(gpu(&stale, 0).reason_codes(), vec![ReasonCode::StaleSample]);
    assert!(stale.ready);
    assert_eq!(stale.rounds, 1);

    h.clock.advance(Duration::from_secs(45));
    let stuck = h.until("readiness to fail", |s| !s.ready).await;
    assert_eq!(gpu(&stuck, 0).reason_codes(), vec![ReasonCode::StaleSample]);
    assert_eq!(gpu(&stuck, 0).state, GpuState::Unhealthy);

    // Not latched: data brings it back.
    h.backend.release_samples();
    let back = h.until("the next round", |s| s.rounds >= 2).await;
    assert_eq!(gpu(&back, 0).state, GpuState::Healthy);
    assert!(back.ready);
    h.stop();
}

#[tokio::test]
async fn strict_readiness_fails_on_degraded() {
    let strict = Options {
        degraded_is_ready: false,
        degraded_enter_samples: 1,
        ..options()
    };
    let mut h = Harness::start(FakeBackend::with_gpus(1), strict);
    h.until("the first round", |s| s.rounds >= 1).await;
    h.backend.set_sample(&fake_uuid(0), Ok(hot()));
    let snapshot = h.round().await;
    assert!(!snapshot.ready, "{}", snapshot.ready_reason);
    h.stop();
}

#[tokio::test]
async fn a_lost_gpu_is_unhealthy_after_the_next_sample() {
    let mut h = Harness::start(FakeBackend::with_gpus(1), options());
    h.until("the first round", |s| s.rounds >= 1).await;
    h.backend.set_sample(&fake_uuid(0), Err(Error::GpuLost));
    let snapshot = h.round().await;
    let lost = gpu(&snapshot, 0);
    assert_eq!(lost.reason_codes(), vec![ReasonCode::GpuLost]);
    assert_eq!(lost.last_error, Some(Error::GpuLost));
    assert_eq!(
        lost.signals,
        healthy_sample(),
        "the last good values are kept"
    );
    assert!(!snapshot.ready);
    h.stop();
}

#[tokio::test]
async fn only_watched_gpus_gate_readiness() {
    let watch_first = Options {
        watch: Watch::Uuids(vec![fake_uuid(0)]),
        ..options()
    };
    let mut h = Harness::start(FakeBackend::with_gpus(2), watch_first);
    h.until("the first round", |s| s.rounds >= 1).await;
    h.backend.push_event(Event::Xid {
        uuid: fake_uuid(1),
        xid: Some(48),
    });
    let snapshot = h
        .until("GPU 1 to turn unhealthy", |s| {
            s.gpu(&fake_uuid(1))
                .is_some_and(|g| g.state == GpuState::Unhealthy)
        })
        .await;
    assert!(!gpu(&snapshot, 1).watched);
    assert!(snapshot.ready, "{}", snapshot.ready_reason);
    assert_eq!(snapshot.summary.state, GpuState::Healthy);
    assert!(
        snapshot.incidents.is_empty(),
        "unwatched GPUs open no incident"
    );
    h.stop();
}

#[tokio::test]
async fn a_watched_mig_device_gates_readiness_through_its_gpu() {
    let mig = "MIG-fa4e0000-0000-4000-8000-0000000000a1";
    let backend = FakeBackend::new();
    for index in 0..2 {
        backend.add_gpu(
            DeviceInfo {
                uuid: fake_uuid(index),
                index,
                name: "NVIDIA H200 (fake)".to_owned(),
                mig_devices: if index == 1 {
                    vec![mig.to_owned()]
                } else {
                    Vec::new()
                },
            },
            healthy_sample(),
        );
    }
    let watch_mig = Options {
        watch: Watch::Uuids(vec![mig.to_owned()]),
        ..options()
    };
    let mut h = Harness::start(backend, watch_mig);
    let first = h.until("the first round", |s| s.rounds >= 1).await;
    assert!(first.ready, "{}", first.ready_reason);
    assert!(first.problems.is_empty(), "{:?}", first.problems);
    assert!(gpu(&first, 1).watched);
    assert!(!gpu(&first, 0).watched);

    // A fault of the physical GPU is the MIG device's fault.
    h.backend.push_event(Event::Xid {
        uuid: fake_uuid(1),
        xid: Some(79),
    });
    let down = h.until("readiness to fail", |s| !s.ready).await;
    assert_eq!(down.summary.unhealthy, vec![fake_uuid(1)]);
    h.stop();
}

#[tokio::test]
async fn missing_gpus_are_a_node_problem() {
    let expecting_two = Options {
        expected_count: Some(2),
        ..options()
    };
    let mut h = Harness::start(FakeBackend::with_gpus(1), expecting_two);
    let snapshot = h.until("the first round", |s| s.rounds >= 1).await;
    assert!(!snapshot.ready);
    assert_eq!(snapshot.problems.len(), 1);
    assert_eq!(snapshot.problems[0].code, ReasonCode::GpuMissing);
    assert_eq!(snapshot.problems[0].detail, "1 GPU(s) visible, 2 expected");
    assert_eq!(snapshot.summary.state, GpuState::Unhealthy);
    h.stop();
}

#[tokio::test]
async fn two_missing_gpu_problems_are_one_metric_series() {
    let options = Options {
        expected_count: Some(2),
        watch: Watch::Uuids(vec![fake_uuid(0), fake_uuid(7)]),
        ..options()
    };
    let mut h = Harness::start(FakeBackend::with_gpus(1), options);
    let snapshot = h.until("the first round", |s| s.rounds >= 1).await;
    let codes: Vec<ReasonCode> = snapshot.problems.iter().map(|p| p.code).collect();
    assert_eq!(codes, vec![ReasonCode::GpuMissing, ReasonCode::GpuMissing]);
    let metrics = snapshot.metrics();
    let mut series: Vec<_> = metrics
        .iter()
        .map(|metric| (metric.name, metric.labels.clone()))
        .collect();
    let all = series.len();
    series.sort();
    series.dedup();
    assert_eq!(series.len(), all, "a label set appears twice: {metrics:#?}");
    let missing = metrics
        .iter()
        .filter(|metric| {
            metric.name == "outrigger_gpu_node_problem"
                && metric.labels == [("reason", "gpu_missing".to_owned())]
        })
        .count();
    assert_eq!(missing, 1);
    h.stop();
}

#[tokio::test]
async fn enumeration_is_retried_until_it_works() {
    let backend = FakeBackend::with_gpus(1);
    backend.set_devices_error(Some(Error::Other("NVML busy".to_owned())));
    let mut h = Harness::start(backend, options());
    let failing = h
        .until("the enumeration failure", |s| !s.problems.is_empty())
        .await;
    assert_eq!(failing.problems[0].code, ReasonCode::EnumerationFailed);
    assert!(failing.ready, "unknown counts as ready by default");
    assert_eq!(failing.rounds, 0);

    h.backend.set_devices_error(None);
    h.clock.advance(TICK);
    let recovered = h.until("the first round", |s| s.rounds >= 1).await;
    assert!(recovered.problems.is_empty());
    assert_eq!(gpu(&recovered, 0).state, GpuState::Healthy);
    h.stop();
}

#[tokio::test]
async fn an_xid_before_the_gpus_are_listed_is_not_lost() {
    let backend = FakeBackend::with_gpus(1);
    backend.set_devices_error(Some(Error::Other("not yet".to_owned())));
    backend.push_event(Event::Xid {
        uuid: fake_uuid(0),
        xid: Some(79),
    });
    let mut h = Harness::start(backend, options());
    h.until("the enumeration failure", |s| !s.problems.is_empty())
        .await;
    // Bounded poll: the event thread takes the XID while no GPU is known yet.
    let deadline = std::time::Instant::now() + PATIENCE;
    while h.backend.events_pending() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the event was never taken"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    h.backend.set_devices_error(None);
    h.clock.advance(TICK);
    let listed = h
        .until("the first round to show the XID", |s| {
            s.rounds >= 1 && !s.ready
        })
        .await;
    assert_eq!(gpu(&listed, 0).reason_codes(), vec![ReasonCode::XidFatal]);
    h.stop();
}

fn events_up(snapshot: &Snapshot) -> Option<f64> {
    snapshot
        .metrics()
        .iter()
        .find(|metric| metric.name == "outrigger_gpu_events_up")
        .map(|metric| metric.value)
}

#[tokio::test]
async fn without_event_support_sampling_goes_on() {
    let backend = FakeBackend::with_gpus(1);
    backend.disable_events();
    let mut h = Harness::start(backend, options());
    let first = h.until("the first round", |s| s.rounds >= 1).await;
    // Shown, exported and explained, but not a health verdict: the GPU stays healthy
    // and the pod ready.
    assert_eq!(
        first.events,
        EventStatus::Down("the fake has events disabled".to_owned())
    );
    assert_eq!(events_up(&first), Some(0.0));
    assert!(first.ready, "{}", first.ready_reason);
    assert_eq!(gpu(&first, 0).state, GpuState::Healthy);
    assert!(
        first.render_text().contains("XID events: NOT delivered"),
        "{}",
        first.render_text()
    );
    let json = serde_json::to_value(&*first).unwrap_or_default();
    assert_eq!(json["events"]["status"], "down");
    h.backend.set_sample(
        &fake_uuid(0),
        Ok(Sample {
            recovery_action: Some(1),
            ..healthy_sample()
        }),
    );
    let snapshot = h.round().await;
    assert_eq!(
        gpu(&snapshot, 0).reason_codes(),
        vec![ReasonCode::RecoveryAction]
    );
    h.stop();
}

#[tokio::test]
async fn failing_event_waits_are_shown_until_events_flow_again() {
    let mut h = Harness::start(FakeBackend::with_gpus(1), options());
    let first = h.until("the first round", |s| s.rounds >= 1).await;
    assert_eq!(first.events, EventStatus::Up);
    assert_eq!(events_up(&first), Some(1.0));

    h.backend
        .set_events_failing(Some(Error::Other("Unknown Error".to_owned())));
    let failing = h.until("events to be down", |s| !s.events.is_up()).await;
    assert_eq!(
        failing.events,
        EventStatus::Down("waiting for events failed: Unknown Error".to_owned())
    );
    assert_eq!(events_up(&failing), Some(0.0));
    assert!(failing.ready);

    h.backend.set_events_failing(None);
    let back = h.until("events to be up again", |s| s.events.is_up()).await;
    assert_eq!(events_up(&back), Some(1.0));

    // A backend that stops delivering events altogether: the event thread ends, and
    // says so.
    h.backend.disable_events();
    let gone = h.until("events to be gone", |s| !s.events.is_up()).await;
    assert_eq!(
        gone.events,
        EventStatus::Down("the fake has events disabled".to_owned())
    );
    h.stop();
}

#[tokio::test]
async fn a_partial_event_registration_is_shown() {
    let backend = FakeBackend::with_gpus(2);
    backend.partial_events("GPU-1: cannot register for events");
    let mut h = Harness::start(backend, options());
    let first = h.until("the first round", |s| s.rounds >= 1).await;
    assert_eq!(
        first.events,
        EventStatus::Partial("GPU-1: cannot register for events".to_owned())
    );
    assert_eq!(events_up(&first), Some(0.0));
    // Events of the other GPUs still flow.
    h.backend.push_event(Event::Xid {
        uuid: fake_uuid(0),
        xid: Some(79),
    });
    h.until("the XID to arrive", |s| !s.ready).await;
    h.stop();
}

#[tokio::test]
async fn snapshots_are_published_without_touching_the_backend() {
    let mut h = Harness::start(FakeBackend::with_gpus(1), options());
    h.until("the first round", |s| s.rounds >= 1).await;
    let taken = h.backend.samples_taken();
    for _ in 0..100 {
        assert!(h.monitor.snapshot().ready);
    }
    assert_eq!(
        h.backend.samples_taken(),
        taken,
        "reading a snapshot never samples"
    );
    h.stop();
}

#[test]
fn launch_without_a_driver_reports_it_and_stops() {
    let options = Options {
        library_path: Some("outrigger-test-missing/libnvidia-ml.so.1".into()),
        ..options()
    };
    let (monitor, handles) = Monitor::launch(options);
    assert_eq!(handles.len(), 1);
    for handle in handles {
        assert!(handle.join().is_ok(), "the loader thread ends by itself");
    }
    let snapshot = monitor.snapshot();
    match &snapshot.nvml {
        NvmlStatus::Unavailable { reason } => assert!(
            reason.starts_with("outrigger-test-missing/libnvidia-ml.so.1 not found"),
            "{reason}"
        ),
        other => panic!("expected unavailable, got {other:?}"),
    }
    assert!(snapshot.ready, "unknown counts as ready by default");
    assert!(!snapshot.summary.present);
}

#[test]
fn launch_disabled_starts_nothing() {
    let (monitor, handles) = Monitor::launch(Options {
        enabled: false,
        ..options()
    });
    assert!(handles.is_empty());
    assert_eq!(monitor.snapshot().nvml, NvmlStatus::Disabled);
    assert!(monitor.snapshot().ready);
}

#[test]
fn a_probe_reports_once_with_queued_events() {
    let backend = FakeBackend::with_gpus(2);
    let healthy = probe(&backend, &options());
    assert!(healthy.ready);
    assert_eq!(healthy.rounds, 1);
    assert!(healthy.gpus.iter().all(|g| g.state == GpuState::Healthy));

    backend.push_event(Event::Xid {
        uuid: fake_uuid(0),
        xid: Some(79),
    });
    backend.set_sample(&fake_uuid(1), Ok(hot()));
    let snapshot = probe(&backend, &options());
    assert!(!snapshot.ready);
    assert_eq!(gpu(&snapshot, 0).reason_codes(), vec![ReasonCode::XidFatal]);
    // One look has no history: a hot sample is reported at once.
    assert_eq!(gpu(&snapshot, 1).state, GpuState::Degraded);
    assert!(snapshot.render_text().contains("XID"));
}
