//! `tool_reset_after_effect`: every tool call reaches the tool, takes effect, and its
//! answer is lost (the connection reset). Holds, for every HTTP tool and by its
//! class: the effect happened once; retries with the same key never repeat it —
//! `unsafe` calls are held for an operator (who asks the tool and resolves them),
//! `probe` calls are settled by asking the tool, `keyed` calls are re-sent with the
//! same key (the tool must deduplicate), `idempotent` calls are re-sent (a repeat is
//! harmless by declaration); and a last retry is answered from the journal.

use std::collections::BTreeMap;

use outrigger_types::ToolClass;
use serde_json::{Value, json};

use super::Run;
use crate::drill::Error;
use crate::drill::agent::Told;

const KEYS_PER_TOOL: usize = 3;

pub async fn run(run: &mut Run<'_>) -> Result<(), Error> {
    let tools = run.drill.plan.tools.clone();
    run.record.error_budget.expected_causes = vec!["network".into()];
    run.record.limits.max_detection_ms = Some(5_000);
    run.record.limits.max_recovery_ms = Some(15_000);
    run.record.recovery_definition =
        "every key retried after the fault has one effect and a definitive answer (an \
         operator resolved the unsafe ones after asking the tool)"
            .into();
    for tool in &tools {
        let task = run.task(&tool.name);
        run.baseline_tool_call(tool, &task, &format!("{}-base", tool.name))
            .await?;
    }

    let fault = json!({"tool": "*", "kind": "tool_reset_after_effect", "percent": 100});
    run.record.fault = crate::drill::record::Fault {
        kind: "tool_reset_after_effect".into(),
        injector: "sidecar: POST /v1/faults".into(),
        params: fault.clone(),
    };
    run.faults(json!({"faults": [fault]})).await?;
    let injected = run.now_ms();
    run.record.t_fault_injected_ms = Some(injected);
    let mut struck = Vec::new();
    for tool in &tools {
        let task = run.task(&tool.name);
        for i in 0..KEYS_PER_TOOL {
            let key = run.key(&format!("{}-{i}", tool.name));
            let seen = run
                .agent
                .tool(tool, &key, &task, &run.payload(&key), None)
                .await;
            if run.record.t_detected_ms.is_none() && seen.told() == Told::Unknown {
                run.record.t_detected_ms = Some(run.now_ms());
            }
            run.record.check(seen.told() != Told::Done, || {
                format!(
                    "{}/{key}: the fault did not strike (the agent got an answer)",
                    tool.name
                )
            });
            struck.push((tool.clone(), key, task.clone(), seen));
        }
    }
    run.record.inflight_at_fault.tool_calls = struck.len() as u32;
    run.record.detection_source = Some(
        "the sidecar journaled the call in doubt and told the agent its outcome is unknown".into(),
    );
    let in_doubt = run
        .metric_seen(
            injected,
            outrigger_telemetry::names::JOURNAL_IN_DOUBT,
            &[],
            |v| v > 0.0,
        )
        .await;
    run.record.signal(
        "outrigger_journal_in_doubt > 0",
        tools.iter().any(|t| t.class == ToolClass::Unsafe),
        in_doubt,
        false,
    );
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
    let mut by_class: BTreeMap<&'static str, Value> = BTreeMap::new();
    let mut done = 0u32;
    let mut unresolved = 0u32;
    let mut operator_actions: BTreeMap<&'static str, u32> = BTreeMap::new();
    for (tool, key, task, _) in &struck {
        let payload = run.payload(key);
        let first = run.agent.tool(tool, key, task, &payload, Some(5)).await;
        by_class.entry(tool.class.as_str()).or_insert_with(|| {
            json!(format!(
                "first retry: {} {}{}",
                first
                    .status
                    .map_or("no answer".to_owned(), |s| s.to_string()),
                first.problem.as_deref().unwrap_or(""),
                first
                    .state
                    .as_deref()
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default()
            ))
        });
        let mut last = first.clone();
        match tool.class {
            ToolClass::Unsafe => {
                run.record.check(
                    first.problem.as_deref() == Some("outcome-unknown")
                        && first.state.as_deref() == Some("needs_operator"),
                    || {
                        format!(
                            "{}/{key}: an unsafe call in doubt must be held for an operator \
                             (409 outcome-unknown, needs_operator); the retry got {:?} {:?}",
                            tool.name, first.status, first.problem
                        )
                    },
                );
                if first.told() != Told::Done
                    && let Some(action) = run.resolve_in_doubt(tool, key).await
                {
                    *operator_actions.entry(action).or_default() += 1;
                    last = run.agent.tool(tool, key, task, &payload, Some(5)).await;
                }
            }
            ToolClass::Keyed | ToolClass::Idempotent | ToolClass::Probe => {
                run.record.check(first.told() == Told::Done, || {
                    format!(
                        "{}/{key}: a {} call in doubt must settle on retry; it got {:?} {:?}",
                        tool.name,
                        tool.class.as_str(),
                        first.status,
                        first.problem
                    )
                });
            }
        }
        if last.told() == Told::Done {
            done += 1;
            let again = run.agent.tool(tool, key, task, &payload, None).await;
            run.record
                .check(again.told() == Told::Done && again.replayed, || {
                    format!(
                        "{}/{key}: a settled key must be answered from the journal; got {:?} \
                     (replayed {})",
                        tool.name, again.status, again.replayed
                    )
                });
        } else {
            unresolved += 1;
        }
    }
    if unresolved == 0 {
        run.record.t_recovered_ms = Some(run.now_ms());
    }
    run.record.inflight_outcomes.retried_safely = done;
    run.record.inflight_outcomes.in_doubt = unresolved;
    run.record.figure("behaviour_by_class", &by_class);
    run.record.figure("operator_resolutions", &operator_actions);
    Ok(())
}
