//! `sidecar_restart`: the sidecar is SIGKILLed in the middle of a task, with model
//! streams and tool calls in flight, and restarted on the same journal; the agent
//! then retries everything with the same keys. Holds: no effect duplicated or lost;
//! calls answered before the kill are replayed unchanged; the interrupted ones
//! settle by their tool's class (an operator resolves unsafe ones after asking the
//! tool); the task's recovery verdict (`POST /v1/tasks/{id}/end`) is a success; and
//! the downtime and recovery time.
//!
//! Tool calls are held in flight by a sidecar `delay` fault (their intent already
//! journaled, not yet sent) so that the kill lands between the journal and the tool
//! every time, not by luck. A second task, opened just before the kill (after the
//! tracker's 100 ms save window), must survive the kill too.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use outrigger_types::ToolClass;
use serde_json::json;

use super::Run;
use super::journal::wait_frames;
use crate::drill::Error;
use crate::drill::agent::{ModelAsk, Told};
use crate::drill::observe::ms;

const STREAMS: usize = 2;
/// The streams in flight at the kill: far longer than the drill takes to reach the
/// kill on a loaded machine (the kill ends them anyway). Their retries after the
/// restart ask for a short answer (`RETRY_MOCK`): same body, same task, same key.
const LONG_MOCK: &str = "chunks=3000,delay_ms=10";
const RETRY_MOCK: &str = "chunks=40,delay_ms=2";
/// The task tracker saves a changed task at once and then at most once per 100 ms
/// (`serve`'s books); a change older than that, with a margin, survives a kill.
const SAVE_WINDOW_WITH_MARGIN: Duration = Duration::from_millis(300);

pub async fn run(run: &mut Run<'_>) -> Result<(), Error> {
    let tools = run.drill.plan.tools.clone();
    let task = run.task("main");
    let young = run.task("young");
    run.record.error_budget.expected_causes = Vec::new();
    run.record.limits.max_detection_ms = Some(2_000);
    run.record.limits.max_recovery_ms = Some(60_000);
    run.record.recovery_definition = "the restarted sidecar is ready and every interrupted \
         request, retried with its key, reached a definitive outcome"
        .into();

    // Before the kill: one acknowledged call per tool, and a model turn.
    let mut acked = Vec::new();
    for tool in &tools {
        let seen = run
            .baseline_tool_call(tool, &task, &format!("{}-acked", tool.name))
            .await?;
        acked.push((tool.clone(), seen.key.clone(), seen.body.clone()));
    }
    let turn = run
        .agent
        .model(&ModelAsk {
            task: Some(task.clone()),
            prompt: run.prompt("first turn"),
            ..ModelAsk::default()
        })
        .await;
    if !turn.completed() {
        return Err(Error::Sidecar(format!(
            "the first model turn failed before any fault: {:?}",
            turn.status
        )));
    }

    if let Some(tool) = tools.first() {
        let seen = run
            .baseline_tool_call(tool, &young, &format!("{}-young", tool.name))
            .await?;
        acked.push((tool.clone(), seen.key.clone(), seen.body.clone()));
    }
    tokio::time::sleep(SAVE_WINDOW_WITH_MARGIN).await;
    run.record.figure(
        "waited_for_task_persistence_ms",
        SAVE_WINDOW_WITH_MARGIN.as_millis(),
    );

    // Streams in flight.
    let mut stream_asks = Vec::new();
    let mut streams = Vec::new();
    let mut progress = Vec::new();
    for i in 0..STREAMS {
        let frames = Arc::new(AtomicUsize::new(0));
        progress.push(frames.clone());
        let ask = ModelAsk {
            stream: true,
            task: Some(task.clone()),
            prompt: run.prompt(&format!("long stream {i}")),
            mock: Some(LONG_MOCK.into()),
            frames: Some(frames),
            timeout: Some(Duration::from_secs(60)),
            ..ModelAsk::default()
        };
        stream_asks.push(ModelAsk {
            frames: None,
            mock: Some(RETRY_MOCK.into()),
            timeout: None,
            ..ask.clone()
        });
        let agent = run.agent.clone();
        let t0 = run.t0;
        streams.push(tokio::spawn(async move {
            let seen = agent.model(&ask).await;
            (ms(t0.elapsed()), seen)
        }));
    }
    wait_frames(&progress, 3).await;

    // Tool calls in flight: journaled, held before the send.
    run.faults(json!({"faults": [{"tool": "*", "kind": "delay", "delay": "5s", "percent": 100}]}))
        .await?;
    let mut pending = Vec::new();
    let mut calls = Vec::new();
    for tool in &tools {
        let key = run.key(&format!("{}-inflight", tool.name));
        let (agent, tool2, key2, task2, payload) = (
            run.agent.clone(),
            tool.clone(),
            key.clone(),
            task.clone(),
            run.payload(&key),
        );
        calls.push(tokio::spawn(async move {
            agent.tool(&tool2, &key2, &task2, &payload, None).await
        }));
        pending.push((tool.clone(), key));
    }
    let journaled = wait_dispatched(run, &task, pending.len()).await;
    run.record.check(journaled, || {
        "the in-flight tool calls were not journaled as dispatched within 5 s".into()
    });
    // In flight at the kill: what has not ended by now (the kill follows at once).
    let streams_running: Vec<bool> = streams.iter().map(|s| !s.is_finished()).collect();
    let calls_running: Vec<bool> = calls.iter().map(|c| !c.is_finished()).collect();
    let frames_at_kill: Vec<usize> = progress.iter().map(|p| p.load(Ordering::Relaxed)).collect();
    let n_streams = streams_running.iter().filter(|r| **r).count();
    let n_calls = calls_running.iter().filter(|r| **r).count();
    run.record
        .check(n_streams == STREAMS && n_calls == pending.len(), || {
            format!(
                "the drill could not hold its work in flight until the kill: {n_streams} of \
             {STREAMS} stream(s) and {n_calls} of {} tool call(s) were still running",
                pending.len()
            )
        });
    run.record.inflight_at_fault.llm_streams = n_streams as u32;
    run.record.inflight_at_fault.tool_calls = n_calls as u32;
    run.record.figure("stream_frames_at_kill", &frames_at_kill);
    run.record.fault = crate::drill::record::Fault {
        kind: "sidecar_sigkill".into(),
        injector: "drill: SIGKILL to the sidecar process, then a restart on the same journal"
            .into(),
        params: json!({"streams_in_flight": n_streams, "tool_calls_in_flight": n_calls,
            "tool_calls_held_by": "a sidecar delay fault (5 s) between the journal and the tool"}),
    };

    let (killed, ready) = run.restart(None).await?;
    run.record.t_fault_injected_ms = Some(killed);
    run.record.t_fault_removed_ms = Some(killed);
    run.record
        .figure("downtime_ms", ready.saturating_sub(killed));
    let mut broke_at = Vec::new();
    for (s, running) in streams.into_iter().zip(&streams_running) {
        if let Ok((at, seen)) = s.await
            && *running
        {
            run.record.check(!seen.completed(), || {
                "a stream in flight completed although the sidecar was killed under it".into()
            });
            broke_at.push(at);
        }
    }
    // Whoever notices first: the agent's broken streams, or the operator's probes.
    let probes = run.watcher.first_after(killed, |l| l.ready.is_none());
    run.record.t_detected_ms = broke_at.iter().copied().chain(probes).min();
    run.record.detection_source = Some(
        if probes.is_some_and(|p| broke_at.iter().all(|b| p <= *b)) {
            "the admin plane stopped answering (liveness and readiness probes fail)".into()
        } else {
            "the agent's in-flight streams broke off (connection reset)".into()
        },
    );
    for c in calls {
        let _ = c.await;
    }
    let restarts = |t: &serde_json::Value| t["faults"]["sidecar_restarts"].as_u64().unwrap_or(0);
    let report = run.admin.get_json(&format!("/v1/tasks/{task}")).await;
    run.record.signal(
        "the task open at the kill was charged a sidecar_restart fault",
        true,
        report
            .as_ref()
            .is_ok_and(|t| restarts(t) > 0)
            .then_some(ready),
        true,
    );
    match run.admin.get_json(&format!("/v1/tasks/{young}")).await {
        Ok(t) if restarts(&t) > 0 => {}
        Ok(_) => run.record.violations.push(format!(
            "task {young} (opened just before the kill) was not charged a sidecar_restart fault"
        )),
        Err(_) => run.record.violations.push(format!(
            "task {young}, opened just before the kill, is unknown after the restart: its \
             record, sidecar_restart fault and recovery verdict were lost"
        )),
    }

    // The agent comes back: the same requests, the same keys.
    let mut resumed = 0u32;
    let mut failed = 0u32;
    let mut in_doubt = 0u32;
    // The streams are retried side by side while the tool calls settle.
    let stream_retries: Vec<_> = stream_asks
        .iter()
        .zip(&streams_running)
        .filter(|(_, running)| **running)
        .map(|(ask, _)| {
            let (agent, ask) = (run.agent.clone(), ask.clone());
            tokio::spawn(async move { agent.model(&ask).await })
        })
        .collect();
    let mut resolutions = Vec::new();
    let interrupted = pending
        .iter()
        .zip(&calls_running)
        .filter(|(_, running)| **running)
        .map(|(p, _)| p);
    for (tool, key) in interrupted {
        let payload = run.payload(key);
        let mut seen = run.agent.tool(tool, key, &task, &payload, Some(5)).await;
        if seen.told() != Told::Done && tool.class == ToolClass::Unsafe {
            run.record.check(seen.state.as_deref() == Some("needs_operator"), || {
                format!(
                    "{}/{key}: an unsafe call cut by the kill must wait for an operator; it got \
                     {:?} {:?}",
                    tool.name, seen.status, seen.problem
                )
            });
            if let Some(action) = run.resolve_in_doubt(tool, key).await {
                resolutions.push(json!({"key": format!("{}/{key}", tool.name), "action": action}));
                seen = run.agent.tool(tool, key, &task, &payload, Some(5)).await;
            }
        }
        match seen.told() {
            Told::Done => resumed += 1,
            Told::Unknown => in_doubt += 1,
            Told::NotDone => failed += 1,
        }
    }
    for (i, retry) in stream_retries.into_iter().enumerate() {
        match retry.await {
            Ok(again) if again.completed() => resumed += 1,
            Ok(again) => {
                failed += 1;
                run.record.violations.push(format!(
                    "stream {i} retried after the restart did not complete ({:?}, {:?})",
                    again.status, again.error
                ));
            }
            Err(_) => failed += 1,
        }
    }
    for (i, (tool, key, first)) in acked.iter().enumerate() {
        let owner = if i < tools.len() { &task } else { &young };
        let again = run
            .agent
            .tool(tool, key, owner, &run.payload(key), None)
            .await;
        run.record.check(
            again.told() == Told::Done && again.replayed && again.body == *first,
            || {
                format!(
                    "{}/{key}: a call acknowledged before the kill must be replayed unchanged; \
                     got {:?} (replayed {})",
                    tool.name, again.status, again.replayed
                )
            },
        );
    }
    if failed == 0 && in_doubt == 0 {
        run.record.t_recovered_ms = Some(run.now_ms());
    }
    run.record.inflight_outcomes.resumed_after_restart = resumed;
    run.record.inflight_outcomes.failed_to_client = failed;
    run.record.inflight_outcomes.in_doubt = in_doubt;
    run.record.figure("operator_resolutions", &resolutions);
    run.record.figure("ready_after_restart_ms", ready);
    Ok(())
}

/// Waits until `n` records of `task` are `dispatched` in the journal.
async fn wait_dispatched(run: &Run<'_>, task: &str, n: usize) -> bool {
    for _ in 0..250 {
        if let Ok(doc) = run
            .admin
            .get_json(&format!("/v1/journal?task={task}&state=dispatched"))
            .await
            && doc["count"].as_u64().unwrap_or(0) as usize >= n
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}
