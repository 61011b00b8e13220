//! `gpu_unhealthy`: GPU 0 falls off the bus (XID 79) under the NVML stub, while
//! model calls flow. Holds: readiness flips (the drain signal) with the GPU named
//! as the reason; `/v1/gpu` and `hw_status` say the GPU failed while GPU 1 stays
//! healthy; liveness never fails; calls in flight are not failed by it. Recovery is
//! a sidecar on a replaced GPU (the stub's healthy scenario) reporting ready again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::json;

use super::Run;
use crate::drill::Error;
use crate::drill::agent::ModelAsk;
use crate::drill::observe::{Look, ms};

fn gpu_not_ready(l: &Look) -> bool {
    l.ready == Some(false) && l.reasons.iter().any(|r| r.starts_with("gpu"))
}

pub async fn run(run: &mut Run<'_>) -> Result<(), Error> {
    run.record.fault = crate::drill::record::Fault {
        kind: "gpu_xid_79".into(),
        injector: "nvml-stub (OUTRIGGER_NVML_STUB_SCENARIO=xid79)".into(),
        params: json!({"gpu": 0, "xid": 79,
            "armed": "at nvmlInit; fires at the sidecar's first NVML event wait",
            "sample_interval": "200ms"}),
    };
    // The stub is armed when the sidecar starts: t0 (ready) is the injection.
    run.record.t_fault_injected_ms = Some(0);
    run.record.error_budget.expected_causes = vec!["hardware".into()];
    run.record.limits.max_detection_ms = Some(10_000);
    run.record.limits.max_recovery_ms = Some(90_000);
    run.record.recovery_definition = "the GPU is replaced (the stub's healthy scenario) and the \
         restarted sidecar reports ready with the GPU healthy"
        .into();

    let stop = Arc::new(AtomicBool::new(false));
    let agent = run.agent.clone();
    let flag = stop.clone();
    let task = run.task("traffic");
    let prompts: Vec<String> = (0..300)
        .map(|i| run.prompt(&format!("during the GPU fault {i}")))
        .collect();
    let t0 = run.t0;
    let traffic = tokio::spawn(async move {
        let mut seen = Vec::new();
        for p in prompts {
            if flag.load(Ordering::Relaxed) {
                break;
            }
            let sent = ms(t0.elapsed());
            let s = agent
                .model(&ModelAsk {
                    task: Some(task.clone()),
                    prompt: p,
                    ..ModelAsk::default()
                })
                .await;
            seen.push((sent, s));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        seen
    });

    let detected = run
        .watcher
        .wait_for(0, Duration::from_secs(10), gpu_not_ready)
        .await;
    run.record.t_detected_ms = detected;
    run.record.detection_source = Some("/readyz answered 503 naming the GPU".into());
    // Readiness going false is the drain signal: the orchestrator stops routing here.
    run.record.t_drain_started_ms = detected;
    run.record.signal(
        "/readyz flipped to not ready (drain signal)",
        true,
        detected,
        true,
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = traffic.await.unwrap_or_default();
    let at_flip = detected.unwrap_or(0);
    // In flight at the fault: the calls open when readiness flipped (the XID itself
    // lands inside the stub, at a moment the drill cannot see more precisely).
    let across: Vec<_> = seen
        .iter()
        .filter(|(sent, s)| *sent <= at_flip && *sent + ms(s.elapsed) >= at_flip)
        .collect();
    let across_done = across.iter().filter(|(_, s)| s.completed()).count() as u32;
    run.record.inflight_at_fault.llm_calls = across.len() as u32;
    run.record.inflight_outcomes.completed = across_done;
    run.record.inflight_outcomes.failed_to_client = across.len() as u32 - across_done;
    let failed = seen.iter().filter(|(_, s)| !s.completed()).count();
    run.record.check(failed == 0, || {
        format!(
            "{failed} of {} model call(s) failed while the GPU was lost (the providers are not \
             served by it)",
            seen.len()
        )
    });

    let gpu = run
        .admin
        .get_json("/v1/gpu")
        .await
        .map_err(Error::Sidecar)?;
    let gpus = gpu["gpus"].as_array().cloned().unwrap_or_default();
    let state_of = |index: u64| {
        gpus.iter()
            .find(|g| g["index"].as_u64() == Some(index))
            .and_then(|g| g["state"].as_str())
            .unwrap_or("missing")
            .to_owned()
    };
    run.record
        .check(gpu["summary"]["state"] == "unhealthy", || {
            format!(
                "/v1/gpu summary is {}, not unhealthy",
                gpu["summary"]["state"]
            )
        });
    run.record.check(state_of(0) == "unhealthy", || {
        format!("GPU 0 is {}, not unhealthy", state_of(0))
    });
    run.record.check(state_of(1) == "healthy", || {
        format!(
            "GPU 1 is {}: the fault did not stay on its GPU",
            state_of(1)
        )
    });
    run.record.figure(
        "gpu0_reasons",
        gpus.iter()
            .find(|g| g["index"].as_u64() == Some(0))
            .map(|g| g["reasons"].clone()),
    );
    let failed_metric = run.watcher.first_after(0, |l| {
        l.metrics
            .as_ref()
            .and_then(|m| m.max("hw_status", &[("hw_state", "failed")]))
            .is_some_and(|v| v >= 1.0)
    });
    run.record.signal(
        "hw_status{hw_state=\"failed\"} = 1",
        true,
        failed_metric,
        true,
    );
    let liveness = run.admin.get("/healthz").await;
    let live = liveness.as_ref().is_ok_and(|r| r.status.is_success());
    run.record.signal(
        "/healthz failed (liveness)",
        false,
        (!live).then_some(at_flip),
        true,
    );
    run.record.figure("calls_during_fault", seen.len());

    // The GPU is replaced: the node comes back with a healthy one.
    let removed = run.now_ms();
    run.record.t_fault_removed_ms = Some(removed);
    run.restart(Some((
        "OUTRIGGER_NVML_STUB_SCENARIO".to_owned(),
        "healthy".to_owned(),
    )))
    .await?;
    run.record.t_recovered_ms = run
        .watcher
        .wait_for(removed, Duration::from_secs(10), |l| l.ready == Some(true))
        .await;
    let after = run
        .admin
        .get_json("/v1/gpu")
        .await
        .map_err(Error::Sidecar)?;
    run.record
        .check(after["summary"]["state"] == "healthy", || {
            format!(
                "after the replacement the GPUs are {}",
                after["summary"]["state"]
            )
        });
    Ok(())
}
