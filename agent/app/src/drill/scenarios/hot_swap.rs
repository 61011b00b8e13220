//! `policy_hot_swap`: a new version of the retry component replaces the file in the
//! policy directory while calls flow (after a warm-up, 5 % of attempts answered 503,
//! so the retry hook decides throughout), and the operator asks for a reload. Holds: calls are in
//! flight across the swap and the new version decides retries; no call fails; the
//! version changes and the old one is kept as `previous_version`; the swap is
//! counted; and how long the swap took.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use super::Run;
use crate::drill::agent::{ModelAsk, ModelSeen};
use crate::drill::setup::tagged_component;
use crate::drill::{Error, observe};

const WORKERS: usize = 4;
/// How long traffic may go on after the swap waiting for the new version's first
/// retry decision (5 % of attempts fail, so one comes within a few dozen calls).
const RETRY_WAIT: Duration = Duration::from_secs(5);
/// Traffic without faults before they start (about 50 calls).
const WARM_UP: Duration = Duration::from_millis(300);

fn retry_binding(doc: &Value) -> Option<&Value> {
    doc["bindings"]
        .as_array()?
        .iter()
        .find(|b| b["hook"] == "retry")
}

fn version(doc: &Value) -> Option<String> {
    retry_binding(doc)?["version"].as_str().map(str::to_owned)
}

pub async fn run(run: &mut Run<'_>) -> Result<(), Error> {
    run.record.error_budget.expected_causes = Vec::new();
    run.record.limits.max_detection_ms = Some(10_000);
    run.record.recovery_definition =
        "the new version is active and every call sent across the swap completed".into();
    let policies = run
        .admin
        .get_json("/v1/policies")
        .await
        .map_err(Error::Sidecar)?;
    let old = version(&policies)
        .ok_or_else(|| Error::Sidecar(format!("no retry version is active: {policies}")))?;

    let budget_metric = format!(
        "{}_total",
        outrigger_telemetry::names::RETRY_BUDGET_EXHAUSTED
    );
    let stop = Arc::new(AtomicBool::new(false));
    // Set once the new version is seen active; calls sent after it that were retried
    // had their retry decided by the new version.
    let swapped = Arc::new(AtomicBool::new(false));
    let retried_after_swap = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let agent = run.agent.clone();
        let stop = stop.clone();
        let swapped = swapped.clone();
        let retried_after_swap = retried_after_swap.clone();
        let task = run.task(&format!("w{w}"));
        let prompts: Vec<String> = (0..400)
            .map(|i| run.prompt(&format!("worker {w} call {i}")))
            .collect();
        workers.push(tokio::spawn(async move {
            let mut seen: Vec<(Instant, ModelSeen)> = Vec::new();
            for (i, prompt) in prompts.into_iter().enumerate() {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let sent = Instant::now();
                let after_swap = swapped.load(Ordering::Relaxed);
                let s = agent
                    .model(&ModelAsk {
                        stream: i % 2 == 0,
                        task: Some(task.clone()),
                        prompt,
                        mock: Some("chunks=6,delay_ms=3".into()),
                        ..ModelAsk::default()
                    })
                    .await;
                if after_swap && s.attempts.unwrap_or(1) > 1 {
                    retried_after_swap.fetch_add(1, Ordering::Relaxed);
                }
                seen.push((sent, s));
            }
            seen
        }));
    }
    // Faults start once the retry budget's window holds some traffic: at the very
    // start its floor (`min_retries`, 3) is all there is, and four early faults
    // would spend it, so a call would fail for the budget and not the swap.
    tokio::time::sleep(WARM_UP).await;
    let background = json!({"provider": "*", "kind": "server_error", "status": 503, "percent": 5});
    run.faults(json!({"faults": [background.clone()]})).await?;
    run.record.figure("background_fault", &background);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let new_bytes = tagged_component(
        outrigger_builtins::RETRY,
        &format!("v2-{}", run.drill.run_id),
    );
    let component = run.derived.retry_component.clone();
    let tmp = component.with_extension("wasm.tmp");
    std::fs::write(&tmp, &new_bytes).map_err(|e| Error::io("write", &tmp, e))?;
    let swap_at = Instant::now();
    std::fs::rename(&tmp, &component).map_err(|e| Error::io("replace", &component, e))?;
    let injected = run.now_ms();
    run.record.t_fault_injected_ms = Some(injected);
    run.record.fault = crate::drill::record::Fault {
        kind: "policy_release".into(),
        injector: "drill: the retry component file replaced, then POST /v1/policies/reload".into(),
        params: json!({"file": component.display().to_string(), "from": old,
                       "size_bytes": new_bytes.len()}),
    };
    let reload = run
        .admin
        .post("/v1/policies/reload", &json!({}))
        .await
        .map_err(|e| Error::Sidecar(format!("POST /v1/policies/reload: {e}")))?;
    let report = reload.json();
    run.record
        .check(reload.status.is_success() && report["ok"] == true, || {
            format!("the reload failed: {} {}", reload.status, reload.text())
        });
    run.record
        .figure("reload_elapsed_ms", &report["report"]["elapsed_ms"]);

    let mut new = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(doc) = run.admin.get_json("/v1/policies").await
            && let Some(v) = version(&doc).filter(|v| *v != old)
        {
            run.record.t_detected_ms = Some(run.now_ms());
            run.record.figure("swap_ms", swap_at.elapsed().as_millis());
            run.record.figure(
                "previous_version",
                retry_binding(&doc).map(|b| b["previous_version"].clone()),
            );
            run.record.check(
                retry_binding(&doc).is_some_and(|b| b["previous_version"] == old.as_str()),
                || format!("the swapped binding does not name {old} as its previous version"),
            );
            new = Some(v);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run.record.detection_source = Some("GET /v1/policies shows the new retry version".into());
    run.record.t_recovered_ms = run.record.t_detected_ms;
    swapped.store(true, Ordering::Relaxed);
    // Keep traffic on the new version for a while, and until it has decided a retry
    // (bounded), then stop.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let deadline = Instant::now() + RETRY_WAIT;
    while new.is_some()
        && retried_after_swap.load(Ordering::Relaxed) == 0
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut seen = Vec::new();
    for w in workers {
        if let Ok(s) = w.await {
            seen.extend(s);
        }
    }
    run.faults(json!({"faults": []})).await?;

    run.record.check(new.is_some(), || {
        format!("the retry version is still {old} 10 s after the file changed")
    });
    let exhausted = observe::scrape(&run.admin)
        .await
        .map(|m| m.sum(&budget_metric, &[]))
        .unwrap_or(0.0);
    run.record
        .figure("calls_stopped_by_retry_budget", exhausted);
    let failed: Vec<String> = seen
        .iter()
        .filter(|(_, s)| !s.completed())
        .map(|(sent, s)| {
            format!(
                "status {:?} error {:?} problem {:?} attempts {:?} fault_injected {} \
                 sent {} ms from the swap, took {} ms",
                s.status,
                s.error,
                s.problem,
                s.attempts,
                s.fault_injected,
                if *sent <= swap_at {
                    -((swap_at - *sent).as_millis() as i128)
                } else {
                    (*sent - swap_at).as_millis() as i128
                },
                s.elapsed.as_millis()
            )
        })
        .collect();
    run.record.check(failed.is_empty(), || {
        format!(
            "{} of {} call(s) across the swap failed ({exhausted} stopped by a spent retry \
             budget): {}",
            failed.len(),
            seen.len(),
            failed.join("; ")
        )
    });
    // In flight at the swap: sent before the file changed, answered after.
    let across: Vec<&ModelSeen> = seen
        .iter()
        .filter(|(sent, s)| *sent <= swap_at && *sent + s.elapsed >= swap_at)
        .map(|(_, s)| s)
        .collect();
    let across_done = across.iter().filter(|s| s.completed()).count() as u32;
    run.record.check(!across.is_empty(), || {
        "no call was in flight across the swap: the drill did not exercise it".into()
    });
    let retried_new = retried_after_swap.load(Ordering::Relaxed);
    run.record.check(retried_new > 0 || new.is_none(), || {
        format!(
            "no call sent after the swap was retried within {RETRY_WAIT:?}: the new \
             version's retry decisions were not exercised"
        )
    });
    run.record.inflight_at_fault.llm_calls = across.len() as u32;
    run.record.inflight_outcomes.completed = across_done;
    run.record.inflight_outcomes.failed_to_client = across.len() as u32 - across_done;
    let swaps = run.metric_first(
        injected,
        &format!("{}_total", outrigger_telemetry::names::POLICY_EVENTS),
        &[("binding", "retry"), ("kind", "swap")],
        |v| v >= 1.0,
    );
    run.record.signal(
        "outrigger_policy_events_total{kind=\"swap\"} rose",
        true,
        swaps,
        true,
    );
    run.record.figure("old_version", &old);
    run.record.figure("new_version", &new);
    run.record.figure("calls", seen.len());
    run.record.figure(
        "retried_calls",
        seen.iter()
            .filter(|(_, s)| s.attempts.unwrap_or(1) > 1)
            .count(),
    );
    run.record.figure("retried_calls_after_swap", retried_new);
    run.record.figure("calls_across_swap", across.len());
    Ok(())
}
