//! `stream_cut_text` and `stream_cut_tool_call`: the provider's stream is cut after
//! N events — in the text, or in the middle of a tool call. Holds: the agent gets
//! the sidecar's typed `stream_interrupted` error event, never a silent truncation
//! nor half a tool call; the same request retried (same task, same body) completes.
//!
//! N comes from a baseline stream of the same request: half its events for text,
//! the middle of its tool-call events for a tool call.

use serde_json::json;
use tokio::time::Instant;

use super::Run;
use crate::drill::Error;
use crate::drill::agent::ModelAsk;
use crate::drill::observe::ms;

const STREAMS: usize = 4;

pub async fn run(run: &mut Run<'_>, tool_call: bool) -> Result<(), Error> {
    let mock = if tool_call {
        "chunks=4,tools=1,delay_ms=2"
    } else {
        "chunks=12,delay_ms=2"
    };
    let ask = |run: &Run<'_>, task: String, what: &str| ModelAsk {
        stream: true,
        task: Some(task),
        prompt: run.prompt(what),
        tools: tool_call,
        mock: Some(mock.into()),
        ..ModelAsk::default()
    };
    run.record.error_budget.expected_causes = vec!["network".into()];
    run.record.limits.max_detection_ms = Some(5_000);
    run.record.limits.max_recovery_ms = Some(10_000);
    run.record.recovery_definition =
        "every interrupted request, sent again unchanged in its task, completes".into();

    let base_ask = ask(run, run.task("baseline"), "baseline stream");
    let base = run.agent.model(&base_ask).await;
    if !base.completed() {
        return Err(Error::Sidecar(format!(
            "the baseline stream did not complete before any fault ({:?}, {:?})",
            base.status, base.error
        )));
    }
    let events = base.stream.events;
    let after_events = if tool_call {
        let (Some(first), Some(last)) = (
            base.stream.tool_events.first().copied(),
            base.stream.tool_events.last().copied(),
        ) else {
            return Err(Error::Sidecar(
                "the provider's baseline answer has no tool call to cut (it was asked to call \
                 get_weather)"
                    .into(),
            ));
        };
        if last == first {
            run.record.warnings.push(
                "the tool call arrived in one event: the cut lands right after it, not inside it"
                    .into(),
            );
        }
        first + ((last - first) / 2).max(1)
    } else {
        (events / 2).max(1)
    };
    run.record.figure("baseline_events", events);
    run.record
        .figure("baseline_tool_events", &base.stream.tool_events);

    let fault = json!({"provider": "*", "kind": "stream_cut", "percent": 100,
                       "after_events": after_events});
    run.record.fault = crate::drill::record::Fault {
        kind: if tool_call {
            "stream_cut_in_tool_call".into()
        } else {
            "stream_cut_in_text".into()
        },
        injector: "sidecar: POST /v1/faults".into(),
        params: fault.clone(),
    };
    run.faults(json!({"faults": [fault]})).await?;
    let injected = run.now_ms();
    run.record.t_fault_injected_ms = Some(injected);

    let asks: Vec<ModelAsk> = (0..STREAMS)
        .map(|i| ask(run, run.task(&format!("s{i}")), &format!("stream {i}")))
        .collect();
    let t0 = run.t0;
    let mut calls = Vec::new();
    for a in asks.clone() {
        let agent = run.agent.clone();
        calls.push(tokio::spawn(async move {
            let sent = Instant::now();
            let seen = agent.model(&a).await;
            (ms(sent.duration_since(t0) + seen.elapsed), seen)
        }));
    }
    // The cut strikes every stream sent under it: those are the fault's in-flight
    // work, and each is accounted for by what became of it.
    run.record.inflight_at_fault.llm_streams = calls.len() as u32;
    let mut cut = Vec::new();
    for (i, c) in calls.into_iter().enumerate() {
        if let Ok((at, seen)) = c.await {
            cut.push((i, at, seen));
        }
    }
    run.record.t_detected_ms = cut
        .iter()
        .filter(|(_, _, s)| s.stream.interrupted)
        .map(|(_, at, _)| *at)
        .min();
    run.record.detection_source =
        Some("the sidecar's typed stream_interrupted event reached the agent".into());
    for (i, _, s) in &cut {
        run.record.check(!s.completed(), || {
            format!("stream {i} was not cut: the fault did not strike it")
        });
        run.record.check(!s.silently_truncated(), || {
            format!("stream {i} ended silently, with neither its terminal event nor an error event")
        });
        run.record.check(s.stream.half_tool_calls == 0, || {
            format!(
                "stream {i} handed the agent {} half tool call(s)",
                s.stream.half_tool_calls
            )
        });
        run.record.check(
            s.stream.interrupted || s.status.is_none_or(|x| x >= 300),
            || format!("stream {i} broke without the typed stream_interrupted event"),
        );
    }
    let active = run
        .metric_seen(
            injected,
            outrigger_telemetry::names::FAULTS_ACTIVE,
            &[],
            |v| v >= 1.0,
        )
        .await;
    run.record
        .signal("outrigger_faults_active = 1 (alert)", true, active, true);

    run.faults(json!({"faults": []})).await?;
    run.record.t_fault_removed_ms = Some(run.now_ms());
    let mut completed = 0u32;
    let mut retried = 0u32;
    let mut failed = 0u32;
    for (i, _, s) in &cut {
        // Not cut (a violation above): nothing to retry.
        if s.completed() {
            completed += 1;
            continue;
        }
        let again = run.agent.model(&asks[*i]).await;
        let whole = again.completed() && (!tool_call || again.stream.complete_tool_calls > 0);
        if whole {
            retried += 1;
        } else {
            failed += 1;
            run.record.violations.push(format!(
                "stream {i} sent again did not complete ({:?}, {:?}, {} complete tool call(s))",
                again.status, again.error, again.stream.complete_tool_calls
            ));
        }
    }
    if failed == 0 {
        run.record.t_recovered_ms = Some(run.now_ms());
    }
    run.record.inflight_outcomes.completed = completed;
    run.record.inflight_outcomes.retried_safely = retried;
    run.record.inflight_outcomes.failed_to_client = failed;
    run.record.figure("after_events", after_events);
    run.record.figure(
        "events_before_cut",
        cut.iter()
            .map(|(_, _, s)| s.stream.events)
            .collect::<Vec<_>>(),
    );
    Ok(())
}
