//! `journal_write_failure`: every journal commit fails (as on a full or failing
//! disk) while streams are in flight. Holds: side-effecting tool calls are refused
//! (503, fail closed) and the tool shows nothing was executed; model calls keep
//! working; the alert metric rises; and once the fault is removed the refused calls,
//! retried with their keys, run exactly once. Readiness turns false, naming the
//! journal, while writes fail and returns by itself after.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::json;

use super::Run;
use crate::drill::Error;
use crate::drill::agent::{ModelAsk, Told};
use crate::drill::observe::Look;

const KEYS_PER_TOOL: usize = 2;
const STREAMS: usize = 2;

pub async fn run(run: &mut Run<'_>) -> Result<(), Error> {
    let tools = run.drill.plan.tools.clone();
    let flush_errors = outrigger_telemetry::names::JOURNAL_FLUSH_ERRORS;
    run.record.error_budget.expected_causes = vec!["release".into()];
    run.record.limits.max_detection_ms = Some(5_000);
    run.record.limits.max_recovery_ms = Some(15_000);
    run.record.recovery_definition =
        "after the fault is removed, every refused tool call retried with its key completes once"
            .into();
    for tool in &tools {
        let task = run.task(&tool.name);
        run.baseline_tool_call(tool, &task, &format!("{}-base", tool.name))
            .await?;
    }
    let errors_before = run.before.sum(flush_errors, &[]);

    // Streams in a task (journaled) are in flight when the disk fails.
    let stream_task = run.task("streams");
    let mut streams = Vec::new();
    let mut progress = Vec::new();
    for i in 0..STREAMS {
        let frames = Arc::new(AtomicUsize::new(0));
        progress.push(frames.clone());
        let ask = ModelAsk {
            stream: true,
            task: Some(stream_task.clone()),
            prompt: run.prompt(&format!("in flight {i}")),
            mock: Some("chunks=100,delay_ms=10".into()),
            frames: Some(frames),
            ..ModelAsk::default()
        };
        let agent = run.agent.clone();
        streams.push(tokio::spawn(async move { agent.model(&ask).await }));
    }
    wait_frames(&progress, 3).await;

    let fault = json!({"journal": "fail_flush"});
    run.record.fault = crate::drill::record::Fault {
        kind: "journal_write_failure".into(),
        injector: "sidecar: POST /v1/faults".into(),
        params: fault.clone(),
    };
    run.faults(fault).await?;
    let injected = run.now_ms();
    run.record.t_fault_injected_ms = Some(injected);
    // In flight at the fault: the streams that had not ended when it was in.
    let running: Vec<bool> = streams.iter().map(|s| !s.is_finished()).collect();
    run.record.figure(
        "stream_frames_at_fault",
        progress
            .iter()
            .map(|p| p.load(Ordering::Relaxed))
            .collect::<Vec<_>>(),
    );
    let in_flight = running.iter().filter(|r| **r).count();
    run.record.inflight_at_fault.llm_streams = in_flight as u32;
    run.record.check(in_flight > 0, || {
        format!(
            "none of the {STREAMS} streams was still running when the journal failed: the \
             drill could not check streams in flight"
        )
    });

    let mut refused = Vec::new();
    for tool in &tools {
        let task = run.task(&tool.name);
        for i in 0..KEYS_PER_TOOL {
            let key = run.key(&format!("{}-{i}", tool.name));
            let seen = run
                .agent
                .tool(tool, &key, &task, &run.payload(&key), None)
                .await;
            run.record.check(
                seen.status == Some(503) && seen.told() == Told::NotDone,
                || {
                    format!(
                        "{}/{key}: a side-effecting call during a journal failure must be \
                         refused 503 (journal-unavailable); it got {:?} {:?}",
                        tool.name, seen.status, seen.problem
                    )
                },
            );
            // Nothing executed unjournaled: ask the tool now, while the fault holds.
            if run
                .status_supported
                .get(&tool.name)
                .copied()
                .unwrap_or(false)
            {
                match run.agent.tool_status(tool, &key).await {
                    Ok(None) => {}
                    Ok(Some(_)) => run.record.violations.push(format!(
                        "{}/{key}: the tool reports an effect for a call the journal refused",
                        tool.name
                    )),
                    Err(e) => run.record.violations.push(format!(
                        "{}/{key}: the tool could not be asked whether a refused call took \
                         effect: {e}",
                        tool.name
                    )),
                }
            }
            refused.push((tool.clone(), key, task.clone()));
        }
    }
    let plain = run
        .agent
        .model(&ModelAsk {
            prompt: run.prompt("plain call during the journal failure"),
            ..ModelAsk::default()
        })
        .await;
    let plain_stream = run
        .agent
        .model(&ModelAsk {
            stream: true,
            prompt: run.prompt("plain stream during the journal failure"),
            mock: Some("chunks=4".into()),
            ..ModelAsk::default()
        })
        .await;
    run.record
        .check(plain.completed() && plain_stream.completed(), || {
            format!(
                "model calls stopped working during the journal failure: plain {:?}, stream {:?}",
                plain.status, plain_stream.status
            )
        });
    let in_task = run
        .agent
        .model(&ModelAsk {
            task: Some(run.task("model")),
            prompt: run.prompt("task call during the journal failure"),
            ..ModelAsk::default()
        })
        .await;
    run.record.figure(
        "model_call_in_a_task_during_fault",
        json!({"status": in_task.status, "completed": in_task.completed()}),
    );
    run.record.check(in_task.completed(), || {
        format!(
            "a model call carrying a task id was refused during the journal failure ({:?}): \
             a model call has no side effect and must be relayed unjournaled",
            in_task.status
        )
    });

    let mut completed = 0u32;
    let mut broken = 0u32;
    for (s, running) in streams.into_iter().zip(running) {
        let ok = match s.await {
            Ok(seen) if seen.completed() => true,
            Ok(seen) => {
                run.record.violations.push(format!(
                    "a stream {} did not complete ({:?}, {:?}, interrupted {})",
                    if running {
                        "in flight when the journal failed"
                    } else {
                        "that ended before the journal failed"
                    },
                    seen.status,
                    seen.error,
                    seen.stream.interrupted
                ));
                false
            }
            Err(_) => false,
        };
        // Only the streams in flight at the fault are its outcomes.
        match (running, ok) {
            (true, true) => completed += 1,
            (true, false) => broken += 1,
            (false, _) => {}
        }
    }
    run.record.inflight_outcomes.completed = completed;
    run.record.inflight_outcomes.failed_to_client = broken;

    run.record.t_detected_ms = run
        .watcher
        .wait_for(injected, Duration::from_secs(5), |l| {
            l.metrics
                .as_ref()
                .is_some_and(|m| m.sum(flush_errors, &[]) > errors_before)
        })
        .await;
    run.record.detection_source = Some("outrigger_journal_flush_errors rose".into());
    run.record.signal(
        "outrigger_journal_flush_errors rose (alert)",
        true,
        run.record.t_detected_ms,
        true,
    );
    let unready = run
        .watcher
        .wait_for(injected, Duration::from_secs(3), journal_not_ready)
        .await;
    run.record.signal(
        "/readyz flipped to 503 naming the journal",
        true,
        unready,
        true,
    );
    run.record.t_drain_started_ms = unready;

    run.faults(json!({"journal": null})).await?;
    let removed = run.now_ms();
    run.record.t_fault_removed_ms = Some(removed);
    let mut all_done = true;
    for (tool, key, task) in &refused {
        let seen = run
            .agent
            .tool(tool, key, task, &run.payload(key), Some(5))
            .await;
        if seen.told() != Told::Done {
            all_done = false;
            run.record.violations.push(format!(
                "{}/{key}: retried after the journal recovered, it got {:?} {:?}",
                tool.name, seen.status, seen.problem
            ));
        }
    }
    if all_done {
        run.record.t_recovered_ms = Some(run.now_ms());
    }
    let ready_again = run
        .watcher
        .wait_for(removed, Duration::from_secs(5), |l| l.ready == Some(true))
        .await;
    run.record.check(ready_again.is_some(), || {
        "readiness did not return after the journal recovered".into()
    });
    run.record.figure("refused_calls", refused.len());
    Ok(())
}

/// `/readyz` not ready, and saying it is the journal (`journal: …`), not any reason.
fn journal_not_ready(l: &Look) -> bool {
    l.ready == Some(false) && l.reasons.iter().any(|r| r.starts_with("journal"))
}

/// Waits (bounded) until every stream has delivered `n` body frames.
pub async fn wait_frames(progress: &[Arc<AtomicUsize>], n: usize) {
    for _ in 0..500 {
        if progress.iter().all(|p| p.load(Ordering::Relaxed) >= n) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_must_name_the_journal() {
        let look = |ready: Option<bool>, reasons: &[&str]| Look {
            at_ms: 0,
            ready,
            reasons: reasons.iter().map(|r| r.to_string()).collect(),
            metrics: None,
        };
        assert!(journal_not_ready(&look(
            Some(false),
            &["journal: writes are failing; side-effecting tool calls are refused"]
        )));
        assert!(!journal_not_ready(&look(
            Some(false),
            &["gpu: GPU 0 unhealthy"]
        )));
        assert!(!journal_not_ready(&look(Some(false), &[])));
        assert!(!journal_not_ready(&look(None, &[])));
        assert!(!journal_not_ready(&look(Some(true), &[])));
    }
}
