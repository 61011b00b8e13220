//! The real NVML adapter (`nvml-wrapper`, `dlopen`, error mapping, C struct layouts,
//! event sets) with no library at all and against the stub `libnvidia-ml` built from
//! `agent/nvml-stub`.
//!
//! The stub picks its scenario from an environment variable at `nvmlInit_v2`, and NVML
//! is initialised once per process, so every scenario runs in its own process: a test
//! re-executes this test binary, filtered to itself, with the scenario set. The stub is
//! a dev-dependency of this crate, so cargo builds it (into the directory of this test
//! binary) before the tests run; no nested cargo, no stale copy.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use outrigger_gpu::{
    Backend, CheckStatus, Classifier, Error, EventStatus, Moment, Monitor, NvmlBackend, NvmlStatus,
    Options, ReasonCode, Snapshot, Watch, probe_once, self_test,
};
use outrigger_types::GpuState;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const SCENARIO_ENV: &str = "OUTRIGGER_NVML_STUB_SCENARIO";
const STUB_PATH_ENV: &str = "OUTRIGGER_NVML_STUB_PATH";
const GPU0: &str = "GPU-5a1b0000-0000-4000-8000-000000000000";
const GPU1: &str = "GPU-5a1b0000-0000-4000-8000-000000000001";
const MIG0: &str = "MIG-5a1b0000-0000-4000-8000-0000000000a0";
const MIG2: &str = "MIG-5a1b0000-0000-4000-8000-0000000000a2";

/// The stub library. It is a dev-dependency of this crate, so cargo has built it, up
/// to date, into the directory of this test binary before running it.
fn stub_library() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|error| format!("no test binary path: {error}"))?;
    let name = format!(
        "{}outrigger_nvml_stub{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let path = exe
        .parent()
        .map(|dir| dir.join(&name))
        .ok_or_else(|| format!("{} has no directory", exe.display()))?;
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing; it is built as a dev-dependency of outrigger-gpu",
            path.display()
        ))
    }
}

/// Runs `body` with the stub loaded in `scenario`. In the parent this re-executes the
/// test binary for `test` alone with the scenario set, and asserts that it passed; in
/// that child it runs `body` with the stub's path.
fn in_scenario(scenario: &str, test: &str, body: impl FnOnce(&Path) -> TestResult) -> TestResult {
    if std::env::var(SCENARIO_ENV).as_deref() == Ok(scenario)
        && let Ok(stub) = std::env::var(STUB_PATH_ENV)
    {
        return body(Path::new(&stub));
    }
    let stub = stub_library()?;
    let output = Command::new(std::env::current_exe()?)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO_ENV, scenario)
        .env(STUB_PATH_ENV, &stub)
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "scenario {scenario} failed in its process:\n{stdout}\n{stderr}"
    );
    Ok(())
}

fn stub_options(stub: &Path) -> Options {
    Options {
        library_path: Some(stub.to_path_buf()),
        event_wait: Duration::from_millis(50),
        ..Options::default()
    }
}

fn gpu_state(snapshot: &Snapshot, uuid: &str) -> Option<GpuState> {
    snapshot.gpu(uuid).map(|gpu| gpu.state)
}

fn reasons(snapshot: &Snapshot, uuid: &str) -> Vec<ReasonCode> {
    snapshot
        .gpu(uuid)
        .map(|gpu| gpu.reason_codes())
        .unwrap_or_default()
}

/// Waits (bounded) until a running monitor publishes a snapshot for which `done` holds.
fn wait_for(
    monitor: &Monitor,
    what: &str,
    done: impl Fn(&Snapshot) -> bool,
) -> Result<Arc<Snapshot>, Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let mut snapshots = monitor.subscribe();
    let waited = runtime.block_on(async {
        let changed = snapshots.wait_for(|snapshot| done(snapshot));
        tokio::time::timeout(Duration::from_secs(20), changed)
            .await
            .map(|found| found.map(|snapshot| Arc::clone(&snapshot)))
    });
    match waited {
        Ok(Ok(snapshot)) => Ok(snapshot),
        _ => Err(format!("gave up waiting for {what}: {:#?}", monitor.snapshot()).into()),
    }
}

fn stop(monitor: Monitor, handles: Vec<std::thread::JoinHandle<()>>) {
    drop(monitor);
    for handle in handles {
        assert!(handle.join().is_ok());
    }
}

#[test]
fn no_library_is_reported_plainly() {
    let missing = Path::new("outrigger-test-missing/libnvidia-ml.so.1");
    match NvmlBackend::load(Some(missing)) {
        Err(Error::Unavailable(reason)) => assert!(
            reason.starts_with("outrigger-test-missing/libnvidia-ml.so.1 not found: "),
            "{reason}"
        ),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let snapshot = probe_once(&Options {
        library_path: Some(missing.to_path_buf()),
        ..Options::default()
    });
    assert!(matches!(snapshot.nvml, NvmlStatus::Unavailable { .. }));
    assert!(snapshot.ready);
    assert_eq!(snapshot.summary.state, GpuState::Unknown);
    assert!(
        snapshot
            .render_text()
            .starts_with("no NVML: outrigger-test-missing/")
    );
    let metrics = snapshot.metrics();
    assert!(
        metrics
            .iter()
            .any(|m| m.name == "outrigger_gpu_nvml_up" && m.value == 0.0)
    );
}

#[test]
fn default_library_is_missing_or_real() {
    // On a machine without the driver this is the "no NVML" path with the name the
    // loader looked for; on a GPU machine it loads the real library.
    match NvmlBackend::load(None) {
        Err(Error::Unavailable(reason)) => {
            assert!(
                reason.starts_with("libnvidia-ml.so.1 not found: "),
                "{reason}"
            );
        }
        Ok(backend) => assert!(!backend.driver().driver_version.is_empty()),
        Err(other) => panic!("unexpected error: {other:?}"),
    }
}

#[test]
fn stub_healthy() -> TestResult {
    in_scenario("healthy", "stub_healthy", |stub| {
        let snapshot = probe_once(&stub_options(stub));
        assert_eq!(
            snapshot.nvml,
            NvmlStatus::Up {
                driver_version: "550.54.15".to_owned(),
                nvml_version: "12.550.54.15".to_owned(),
            }
        );
        assert!(snapshot.ready, "{}", snapshot.ready_reason);
        assert_eq!(snapshot.gpus.len(), 2);
        let gpu = snapshot.gpu(GPU0).ok_or("GPU 0 missing")?;
        assert_eq!(gpu.state, GpuState::Healthy, "{:?}", gpu.reasons);
        assert_eq!(gpu.name, "NVIDIA H200 (outrigger stub)");
        let s = &gpu.signals;
        assert_eq!(s.temperature_c, Some(41));
        assert_eq!(
            (s.slowdown_temperature_c, s.shutdown_temperature_c),
            (Some(87), Some(95))
        );
        assert_eq!(
            (s.power_mw, s.power_limit_mw),
            (Some(74_000), Some(700_000))
        );
        assert_eq!(s.energy_mj, Some(1_234_567));
        assert_eq!(
            (s.gpu_utilization_pct, s.memory_utilization_pct),
            (Some(3), Some(1))
        );
        assert_eq!(s.memory_total_bytes, Some(150_754_820_096));
        assert_eq!(s.memory_used_bytes, Some(555_745_280));
        assert_eq!(s.ecc_enabled, Some(true));
        assert_eq!(s.ecc.uncorrected_volatile, Some(0));
        assert_eq!(s.remapped_rows.uncorrectable, Some(0));
        assert_eq!(s.remapped_rows.failure, Some(false));
        assert_eq!(s.recovery_action, Some(0));
        assert_eq!(s.clock_event_reasons, Some(0x1));
        assert_eq!(
            (s.pcie.generation, s.pcie.width, s.pcie.replays),
            (Some(5), Some(16), Some(0))
        );
        assert_eq!(s.mig_enabled, Some(false));
        assert!(s.nvlinks.is_empty());
        // Unsupported signals are recorded, not treated as faults.
        for absent in [
            "nvlink",
            "retired_pages_single_bit",
            "retired_pages_pending",
        ] {
            assert!(
                s.absent.iter().any(|a| a == absent),
                "{absent} in {:?}",
                s.absent
            );
        }
        assert!(s.failed.is_empty(), "{:?}", s.failed);
        assert!(snapshot.render_text().contains(GPU1));

        // A quiet event set times out, which is "no event", not an error.
        let backend = NvmlBackend::load(Some(stub))?;
        assert_eq!(backend.next_event(Duration::from_millis(10)), Ok(None));
        assert_eq!(
            backend.sample("GPU-nope"),
            Err(Error::UnknownGpu("GPU-nope".to_owned()))
        );

        let report = self_test(Some(stub));
        let failed: Vec<_> = report.failures();
        assert!(report.passed, "{}", report.render_text());
        assert!(failed.is_empty());
        for (name, status) in [
            ("nvml_init", CheckStatus::Pass),
            ("row_remap_raw", CheckStatus::Pass),
            ("clock_event_reasons", CheckStatus::Pass),
            ("event_registration", CheckStatus::Pass),
            ("event_wait", CheckStatus::Pass),
            ("classifier_verdict", CheckStatus::Pass),
            ("sample_cost", CheckStatus::Pass),
            ("missing_library", CheckStatus::Pass),
            ("recovery_action", CheckStatus::Pass),
        ] {
            assert!(
                report
                    .checks
                    .iter()
                    .any(|c| c.name == name && c.status == status),
                "{name} should be {status:?}:\n{}",
                report.render_text()
            );
        }
        assert_eq!(report.device_count, Some(2));
        assert_eq!(report.devices[0].raw_remapped_rows, Some([0, 0, 0, 0]));
        assert_eq!(report.sample_cost.map(|cost| cost.samples), Some(100));
        let json = serde_json::to_value(&report)?;
        assert_eq!(json["passed"], true);
        assert_eq!(json["devices"][0]["uuid"], GPU0);

        // The monitor over the real adapter: sampler and event threads.
        let (monitor, handles) = Monitor::launch(stub_options(stub));
        let sampled = wait_for(&monitor, "the first round", |s| s.rounds >= 1)?;
        assert_eq!(gpu_state(&sampled, GPU0), Some(GpuState::Healthy));
        assert!(sampled.ready);
        assert_eq!(sampled.events, EventStatus::Up);
        stop(monitor, handles);
        Ok(())
    })
}

#[test]
fn stub_xid79() -> TestResult {
    in_scenario("xid79", "stub_xid79", |stub| {
        // The monitor's event thread is the first to wait, so it receives the XID.
        let (monitor, handles) = Monitor::launch(stub_options(stub));
        // The sampler may see the lost GPU before the event thread records the XID;
        // wait for both a round and the XID.
        let down = wait_for(&monitor, "XID 79 after a round", |s| {
            s.rounds >= 1 && reasons(s, GPU0).contains(&ReasonCode::XidFatal)
        })?;
        assert!(!down.ready, "{}", down.ready_reason);
        let gpu = down.gpu(GPU0).ok_or("GPU 0 missing")?;
        assert_eq!(gpu.xid_history.first().and_then(|r| r.xid), Some(79));
        assert_eq!(gpu_state(&down, GPU1), Some(GpuState::Healthy));
        assert_eq!(down.summary.unhealthy, vec![GPU0.to_owned()]);
        stop(monitor, handles);

        // After XID 79 the GPU is gone: every query says so.
        let snapshot = probe_once(&stub_options(stub));
        assert_eq!(reasons(&snapshot, GPU0), vec![ReasonCode::GpuLost]);
        assert!(!snapshot.ready);
        Ok(())
    })
}

#[test]
fn stub_dbe() -> TestResult {
    in_scenario("dbe", "stub_dbe", |stub| {
        let snapshot = probe_once(&stub_options(stub));
        assert!(!snapshot.ready);
        let gpu = snapshot.gpu(GPU0).ok_or("GPU 0 missing")?;
        assert_eq!(gpu.reason_codes(), vec![ReasonCode::EccUncorrected]);
        assert_eq!(gpu.uncorrected_ecc_events, 1, "the DBE event arrived");
        assert_eq!(gpu.signals.ecc.uncorrected_volatile, Some(1));
        assert_eq!(gpu_state(&snapshot, GPU1), Some(GpuState::Healthy));
        Ok(())
    })
}

#[test]
fn stub_hot() -> TestResult {
    in_scenario("hot", "stub_hot", |stub| {
        let snapshot = probe_once(&stub_options(stub));
        assert_eq!(
            reasons(&snapshot, GPU0),
            vec![ReasonCode::Thermal, ReasonCode::ClockSlowdown]
        );
        assert!(snapshot.ready, "degraded is ready by default");

        // The same readings through the real adapter into a classifier with history:
        // degraded on the third sample, not before.
        let backend = NvmlBackend::load(Some(stub))?;
        let devices = backend.devices()?;
        let device = devices.first().ok_or("no GPU")?;
        let mut classifier = Classifier::new(&Options::default());
        let mut now = Moment::now();
        let mut states = Vec::new();
        for _ in 0..3 {
            now = now.after(Duration::from_secs(5));
            states.push(
                classifier
                    .step(now, device, backend.sample(&device.uuid), &[])
                    .state,
            );
        }
        assert_eq!(
            states,
            vec![GpuState::Healthy, GpuState::Healthy, GpuState::Degraded]
        );
        Ok(())
    })
}

#[test]
fn stub_lost() -> TestResult {
    in_scenario("lost", "stub_lost", |stub| {
        let backend = NvmlBackend::load(Some(stub))?;
        assert_eq!(backend.sample(GPU0), Err(Error::GpuLost));
        let snapshot = probe_once(&stub_options(stub));
        assert_eq!(reasons(&snapshot, GPU0), vec![ReasonCode::GpuLost]);
        assert_eq!(gpu_state(&snapshot, GPU1), Some(GpuState::Healthy));
        assert!(!snapshot.ready);

        let report = self_test(Some(stub));
        assert!(!report.passed);
        assert!(
            report
                .failures()
                .iter()
                .any(|c| c.name == "sample" && c.gpu.as_deref() == Some(GPU0)),
            "{}",
            report.render_text()
        );
        Ok(())
    })
}

#[test]
fn stub_mig() -> TestResult {
    in_scenario("mig", "stub_mig", |stub| {
        // The adapter lists the physical GPUs with the MIG devices they are split into
        // (slot 1 is empty and skipped).
        let backend = NvmlBackend::load(Some(stub))?;
        let devices = backend.devices()?;
        assert_eq!(devices.len(), 2);
        assert_eq!(devices[0].uuid, GPU0);
        assert_eq!(devices[0].mig_devices, vec![MIG0, MIG2]);
        assert!(devices[1].mig_devices.is_empty());

        // Watching a MIG UUID (what a pod on a partitioned GPU is given) watches its
        // physical GPU: ready, GPU 0 gating readiness, nothing missing.
        let options = Options {
            watch: Watch::Uuids(vec![MIG2.to_owned()]),
            ..stub_options(stub)
        };
        let (monitor, handles) = Monitor::launch(options);
        let sampled = wait_for(&monitor, "the first round", |s| s.rounds >= 1)?;
        assert!(sampled.ready, "{}", sampled.ready_reason);
        assert!(sampled.problems.is_empty(), "{:?}", sampled.problems);
        let gpu0 = sampled.gpu(GPU0).ok_or("GPU 0 missing")?;
        assert!(gpu0.watched);
        assert_eq!(gpu0.signals.mig_enabled, Some(true));
        assert_eq!(gpu0.mig_devices, vec![MIG0, MIG2]);
        assert!(!sampled.gpu(GPU1).ok_or("GPU 1 missing")?.watched);
        assert_eq!(sampled.summary.ids, vec![GPU0.to_owned()]);
        assert!(sampled.render_text().contains(MIG2));
        stop(monitor, handles);
        Ok(())
    })
}

#[test]
fn stub_init_fails() -> TestResult {
    in_scenario("init_fails", "stub_init_fails", |stub| {
        match NvmlBackend::load(Some(stub)) {
            Err(Error::Unavailable(reason)) => {
                assert!(reason.contains("DRIVER_NOT_LOADED"), "{reason}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
        let snapshot = probe_once(&stub_options(stub));
        assert!(matches!(snapshot.nvml, NvmlStatus::Unavailable { .. }));
        let report = self_test(Some(stub));
        assert!(!report.passed);
        assert_eq!(report.failures().first().map(|c| c.name), Some("nvml_init"));
        Ok(())
    })
}

#[test]
fn stub_nvlink_flaky() -> TestResult {
    in_scenario("nvlink_flaky", "stub_nvlink_flaky", |stub| {
        let backend = NvmlBackend::load(Some(stub))?;
        let device = backend
            .devices()?
            .into_iter()
            .find(|device| device.uuid == GPU0)
            .ok_or("GPU 0 missing")?;
        let mut classifier = Classifier::new(&stub_options(stub));
        let start = Moment::now();

        let first = backend.sample(GPU0)?;
        let states: Vec<_> = first.nvlinks.iter().map(|l| (l.link, l.active)).collect();
        assert_eq!(states, vec![(0, Some(true)), (1, Some(true))]);
        classifier.step(start, &device, Ok(first), &[]);

        // Link 1's state read fails: the link is listed as unknown, not left out (which
        // the classifier would take for "down").
        let second = backend.sample(GPU0)?;
        let states: Vec<_> = second.nvlinks.iter().map(|l| (l.link, l.active)).collect();
        assert_eq!(states, vec![(0, Some(true)), (1, None)]);
        assert!(second.signal_failed("nvlink1_state"), "{:?}", second.failed);
        let health = classifier.step(
            start.after(Duration::from_secs(5)),
            &device,
            Ok(second),
            &[],
        );
        assert_eq!(health.state, GpuState::Healthy, "{:?}", health.reasons);
        Ok(())
    })
}

#[test]
fn stub_handle_flaky() -> TestResult {
    in_scenario("handle_flaky", "stub_handle_flaky", |stub| {
        // GPU 0's handle fails once, at load: it is listed under a placeholder, asked
        // for again when sampled, and then monitored under its real UUID.
        let options = Options {
            sample_interval: Duration::from_millis(100),
            watch: Watch::Uuids(vec![GPU0.to_owned()]),
            ..stub_options(stub)
        };
        let (monitor, handles) = Monitor::launch(options);
        let sampled = wait_for(&monitor, "GPU 0 under its UUID, healthy", |s| {
            gpu_state(s, GPU0) == Some(GpuState::Healthy)
        })?;
        assert!(sampled.gpu("nvml-index-0").is_none(), "{:#?}", sampled.gpus);
        assert_eq!(sampled.gpus.len(), 2);
        assert!(sampled.problems.is_empty(), "{:?}", sampled.problems);
        assert!(sampled.ready, "{}", sampled.ready_reason);
        // Its events were never registered, and the snapshot says so.
        assert!(
            matches!(&sampled.events, EventStatus::Partial(why) if why.contains("nvml-index-0")),
            "{:?}",
            sampled.events
        );
        stop(monitor, handles);
        Ok(())
    })
}
