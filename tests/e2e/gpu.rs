//! GPU health in the running sidecar, against no NVML at all (this machine) and
//! against the stub `libnvidia-ml` built in the workspace, which behaves like a GPU
//! that fell off the bus (XID 79) when asked to.

use std::path::PathBuf;
use std::time::Duration;

use http::StatusCode;

use crate::support::*;

/// The stub library cargo built for this test binary (a dev-dependency).
fn stub() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary");
    let deps = exe.parent().expect("deps dir");
    ["liboutrigger_nvml_stub.so"]
        .iter()
        .map(|n| deps.join(n))
        .chain(deps.parent().map(|p| p.join("liboutrigger_nvml_stub.so")))
        .find(|p| p.exists())
        .expect("the stub library is built next to the test binary")
}

#[tokio::test]
async fn without_nvml_the_sidecar_says_so_and_stays_ready() {
    let sidecar =
        Sidecar::start("[gpu]\nlibrary = \"/nonexistent/libnvidia-ml.so.1\"\n", &[]).await;
    let gpu = get(&sidecar.admin_url("/v1/gpu")).await;
    assert_eq!(gpu.status, StatusCode::OK);
    let doc = gpu.json();
    // Launching NVML happens on its own thread: wait for the verdict.
    let mut doc = doc;
    for _ in 0..100 {
        if doc["nvml"]["status"] != "starting" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        doc = get(&sidecar.admin_url("/v1/gpu")).await.json();
    }
    assert!(doc.to_string().contains("not found"), "{doc}");
    assert_eq!(
        get(&sidecar.admin_url("/readyz")).await.status,
        StatusCode::OK
    );
    let metrics = get(&sidecar.admin_url("/metrics")).await.text();
    assert!(metrics.contains("outrigger_gpu_nvml_up 0"), "{metrics}");
    assert!(metrics.trim_end().ends_with("# EOF"));

    let out = std::process::Command::new(outrigger_bin())
        .args(["gpu", "--nvml-library", "/nonexistent/libnvidia-ml.so.1"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("no NVML"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[tokio::test]
async fn a_gpu_that_falls_off_the_bus_makes_the_sidecar_unready() {
    let lib = stub();
    let config = format!(
        "[gpu]\nlibrary = {:?}\nsample_interval = \"200ms\"\n",
        lib.display().to_string()
    );
    let sidecar = Sidecar::start(&config, &[("OUTRIGGER_NVML_STUB_SCENARIO", "xid79")]).await;
    let mut ready = StatusCode::OK;
    for _ in 0..100 {
        ready = get(&sidecar.admin_url("/readyz")).await.status;
        if ready == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ready, StatusCode::SERVICE_UNAVAILABLE);
    let why = get(&sidecar.admin_url("/readyz")).await.json();
    assert!(why["reasons"].to_string().contains("gpu"), "{why}");
    let gpu = get(&sidecar.admin_url("/v1/gpu")).await.json();
    assert_eq!(gpu["summary"]["state"], "unhealthy", "{gpu}");
    // Liveness never depends on the GPU.
    assert_eq!(
        get(&sidecar.admin_url("/healthz")).await.status,
        StatusCode::OK
    );
    let metrics = get(&sidecar.admin_url("/metrics")).await.text();
    assert!(metrics.contains("hw_status{"), "{metrics}");
    assert!(metrics.contains("hw_state=\"failed\""), "{metrics}");
}

#[test]
fn outrigger_gpu_applies_the_gpu_section_of_its_config() {
    let lib = stub();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(outrigger_bin())
            .arg("gpu")
            .args(args)
            .env("OUTRIGGER_NVML_STUB_SCENARIO", "healthy")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.code(), stdout)
    };
    let lib_arg = lib.display().to_string();

    // The stub's two healthy GPUs, with the defaults.
    let (code, text) = run(&["--nvml-library", &lib_arg]);
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("gpu_missing"), "{text}");

    // The config names the library and expects three GPUs: one is missing.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("outrigger.toml");
    std::fs::write(
        &config,
        format!("[gpu]\nlibrary = {lib_arg:?}\nexpected_count = 3\n"),
    )
    .unwrap();
    let (code, text) = run(&["--config", &config.display().to_string()]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("gpu_missing"), "{text}");
    assert!(text.contains("2 GPU(s) visible, 3 expected"), "{text}");

    // A config with a problem is refused, as `serve` would refuse it.
    std::fs::write(&config, "[gpu]\nsample_interval = \"0s\"\n").unwrap();
    let (code, _) = run(&["--config", &config.display().to_string()]);
    assert_eq!(code, Some(2));
}
