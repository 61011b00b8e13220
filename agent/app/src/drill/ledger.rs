//! The exactly-once checker, Jepsen-style: every tool-call key the agent used, what
//! the agent was told each time (done / not done / unknown), what the journal says
//! the key ended as, and what the tool itself says happened (its status endpoint),
//! reduced to lost, duplicated, unexpected, recovered and in-doubt counts.
//!
//! A tool's status endpoint says whether a key's effect exists, not how many times
//! it was applied; a second application under the same key is caught two ways:
//! the journal shows an `unsafe` or `probe` call sent more often than an operator
//! allowed, or the answer the agent finally got disagrees with what the status
//! endpoint reports for the key on a field both carry (a tool that honours the key
//! answers a repeat with the first result).

use std::collections::BTreeMap;

use outrigger_types::ToolClass;
use serde_json::Value;

use super::agent::{Agent, Told, ToolSeen};
use super::http::{Admin, Failed, Reply};
use super::record::{ClassTally, Consistency};
use super::setup::ToolPlan;

/// Journal states whose outcome is still unknown.
const UNRESOLVED: [&str; 5] = [
    "claimed",
    "dispatched",
    "in_doubt",
    "reconciling",
    "needs_operator",
];

/// What one key's history adds up to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyVerdict {
    pub lost: bool,
    pub duplicated: Option<String>,
    pub unexpected: bool,
    pub recovered: bool,
    pub in_doubt: bool,
    /// `None`: the tool cannot say.
    pub effect: Option<bool>,
    pub final_state: String,
}

/// The facts about one key.
#[derive(Debug, Clone, Default)]
pub struct KeyFacts<'a> {
    pub class: Option<ToolClass>,
    /// What the agent was told, in order.
    pub answers: Vec<&'a ToolSeen>,
    /// The journal record (`GET /v1/journal/{key}`), if there is one.
    pub record: Option<Value>,
    /// The tool's status answer: `Some(Some(body))` effect, `Some(None)` none.
    pub status: Option<Option<Value>>,
}

/// Judges one key.
pub fn judge(f: &KeyFacts<'_>) -> KeyVerdict {
    let told: Vec<Told> = f.answers.iter().map(|a| a.told()).collect();
    let effect = f.status.as_ref().map(Option::is_some);
    let final_state = f
        .record
        .as_ref()
        .and_then(|r| r["state"].as_str())
        .unwrap_or("none")
        .to_owned();
    let done = told.contains(&Told::Done);
    let mut v = KeyVerdict {
        lost: done && effect == Some(false),
        unexpected: effect == Some(true)
            && !told.is_empty()
            && told.iter().all(|t| *t == Told::NotDone),
        in_doubt: UNRESOLVED.contains(&final_state.as_str()),
        effect,
        final_state: final_state.clone(),
        ..KeyVerdict::default()
    };
    let first_unknown = told.first() == Some(&Told::Unknown);
    v.recovered = first_unknown
        && !v.in_doubt
        && (effect == Some(true) || (effect.is_none() && final_state == "completed"));
    if let (Some(record), Some(ToolClass::Unsafe | ToolClass::Probe)) = (&f.record, f.class) {
        let sent = record["attempts"]
            .as_array()
            .map(|a| a.iter().filter(|x| !x["dispatched_at"].is_null()).count())
            .unwrap_or(0);
        let allowed = 1 + record["resolutions"]
            .as_array()
            .map(|a| a.iter().filter(|x| x["action"] == "retry").count())
            .unwrap_or(0);
        // A probe tool's resend after a probe that found nothing is allowed too.
        let probed_absent = f.class == Some(ToolClass::Probe)
            && record["history"]
                .as_array()
                .is_some_and(|h| h.iter().any(|t| t["state"] == "reconciling"));
        if sent > allowed + usize::from(probed_absent) {
            v.duplicated = Some(format!(
                "the journal shows it sent {sent} times (an operator allowed {})",
                allowed - 1
            ));
        }
    }
    if v.duplicated.is_none()
        && f.class != Some(ToolClass::Idempotent)
        && let (Some(Some(status)), Some(answer)) = (
            &f.status,
            f.answers.iter().rev().find(|a| a.told() == Told::Done),
        )
        && let Some(field) = disagreement(&answer.body, status)
    {
        v.duplicated = Some(format!(
            "the tool reports {field} = {} for the key, the agent was answered {}: the key \
             was applied again",
            status[&field], answer.body[&field]
        ));
    }
    v
}

/// The first scalar top-level field both JSON objects carry with different values.
fn disagreement(answer: &Value, status: &Value) -> Option<String> {
    let (Some(a), Some(s)) = (answer.as_object(), status.as_object()) else {
        return None;
    };
    a.iter()
        .filter(|(_, v)| !v.is_object() && !v.is_array())
        .find(|(k, v)| s.get(*k).is_some_and(|sv| sv != *v))
        .map(|(k, _)| k.clone())
}

/// The journal's answer to `GET /v1/journal/{tool}/{key}` (`path`): the record,
/// `None` when the journal holds none for the key (404 `unknown-key`); `Err` when
/// the journal could not be asked (no answer, any other status).
pub fn journal_record(path: &str, reply: Result<Reply, Failed>) -> Result<Option<Value>, String> {
    let reply = reply.map_err(|e| format!("GET {path}: {e}"))?;
    let body = reply.json();
    match reply.status.as_u16() {
        200..=299 if body.is_object() => Ok(Some(body)),
        404 if body["type"] == "urn:outrigger:problem:unknown-key" => Ok(None),
        status => Err(format!("GET {path} answered {status} {}", reply.text())),
    }
}

/// Checks every key of `calls` (the agent's tool calls, in order).
pub async fn check(
    agent: &Agent,
    admin: &Admin,
    tools: &[ToolPlan],
    calls: &[ToolSeen],
    status_supported: &BTreeMap<String, bool>,
) -> (Consistency, Vec<String>) {
    let mut keys: BTreeMap<(String, String), Vec<&ToolSeen>> = BTreeMap::new();
    for c in calls {
        keys.entry((c.tool.clone(), c.key.clone()))
            .or_default()
            .push(c);
    }
    let mut out = Consistency::default();
    let mut details = Vec::new();
    let mut observed = 0u64;
    let mut any_status = false;
    for ((tool_name, key), answers) in keys {
        let plan = tools.iter().find(|t| t.name == tool_name);
        let path = format!("/v1/journal/{tool_name}/{key}");
        let record = match journal_record(&path, admin.get(&path).await) {
            Ok(record) => record,
            Err(e) => {
                details.push(format!(
                    "{tool_name}/{key}: the journal could not be asked what the key ended as: {e}"
                ));
                continue;
            }
        };
        let status = match plan {
            Some(p) if status_supported.get(&p.name).copied().unwrap_or(false) => {
                match agent.tool_status(p, &key).await {
                    Ok(status) => Some(status),
                    Err(e) => {
                        details.push(format!(
                            "{tool_name}/{key}: the tool could not be asked whether the key \
                             took effect: {e}"
                        ));
                        continue;
                    }
                }
            }
            _ => None,
        };
        let facts = KeyFacts {
            class: plan.map(|p| p.class),
            answers,
            record,
            status,
        };
        let v = judge(&facts);
        let class = facts.class.map_or("unknown", ToolClass::as_str).to_owned();
        let t: &mut ClassTally = out.by_class.entry(class).or_default();
        t.keys += 1;
        *t.final_states.entry(v.final_state.clone()).or_default() += 1;
        if v.effect == Some(true) {
            t.effects += 1;
            observed += 1;
        }
        any_status |= v.effect.is_some();
        if v.lost {
            t.lost += 1;
            out.lost += 1;
            details.push(format!(
                "{tool_name}/{key}: the agent was told it was done, the tool has no effect for it"
            ));
        }
        if let Some(why) = &v.duplicated {
            t.duplicated += 1;
            out.duplicated += 1;
            details.push(format!("{tool_name}/{key}: {why}"));
        }
        if v.unexpected {
            out.unexpected += 1;
            details.push(format!(
                "{tool_name}/{key}: the agent was told it was not executed, the tool has its effect"
            ));
        }
        if v.recovered {
            t.recovered += 1;
            out.recovered += 1;
        }
        if v.in_doubt {
            t.in_doubt += 1;
            out.in_doubt += 1;
        }
    }
    out.effects_observed = any_status.then_some(observed);
    (out, details)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn seen(status: u16, problem: Option<&str>, body: Value) -> ToolSeen {
        ToolSeen {
            status: Some(status),
            problem: problem.map(str::to_owned),
            body,
            ..ToolSeen::default()
        }
    }

    fn record(state: &str, dispatched: usize, retries: usize) -> Value {
        let attempts: Vec<Value> = (0..dispatched)
            .map(|_| json!({"dispatched_at": "2026-01-01T00:00:00Z"}))
            .collect();
        let resolutions: Vec<Value> = (0..retries).map(|_| json!({"action": "retry"})).collect();
        json!({"state": state, "attempts": attempts, "resolutions": resolutions, "history": []})
    }

    #[test]
    fn keys_are_judged_like_a_jepsen_set() {
        let ok = seen(200, None, json!({"effect": 1, "ok": true}));
        let refused = seen(503, Some("journal-unavailable"), json!({}));
        let unknown = seen(502, Some("outcome-unknown"), json!({}));
        let present = Some(Some(json!({"effect": 1, "ok": true})));
        let cases: Vec<(KeyFacts<'_>, KeyVerdict)> = vec![
            (
                KeyFacts {
                    class: Some(ToolClass::Unsafe),
                    answers: vec![&ok],
                    record: Some(record("completed", 1, 0)),
                    status: present.clone(),
                },
                KeyVerdict {
                    effect: Some(true),
                    final_state: "completed".into(),
                    ..KeyVerdict::default()
                },
            ),
            (
                KeyFacts {
                    class: Some(ToolClass::Unsafe),
                    answers: vec![&ok],
                    record: Some(record("completed", 1, 0)),
                    status: Some(None),
                },
                KeyVerdict {
                    lost: true,
                    effect: Some(false),
                    final_state: "completed".into(),
                    ..KeyVerdict::default()
                },
            ),
            (
                KeyFacts {
                    class: Some(ToolClass::Keyed),
                    answers: vec![&refused],
                    record: None,
                    status: present.clone(),
                },
                KeyVerdict {
                    unexpected: true,
                    effect: Some(true),
                    final_state: "none".into(),
                    ..KeyVerdict::default()
                },
            ),
            (
                KeyFacts {
                    class: Some(ToolClass::Unsafe),
                    answers: vec![&unknown, &ok],
                    record: Some(record("completed", 2, 1)),
                    status: present.clone(),
                },
                KeyVerdict {
                    recovered: true,
                    effect: Some(true),
                    final_state: "completed".into(),
                    ..KeyVerdict::default()
                },
            ),
            (
                KeyFacts {
                    class: Some(ToolClass::Unsafe),
                    answers: vec![&unknown],
                    record: Some(record("needs_operator", 1, 0)),
                    status: present.clone(),
                },
                KeyVerdict {
                    in_doubt: true,
                    effect: Some(true),
                    final_state: "needs_operator".into(),
                    ..KeyVerdict::default()
                },
            ),
        ];
        for (facts, want) in cases {
            assert_eq!(judge(&facts), want, "{:?}", facts.answers);
        }
    }

    #[test]
    fn a_journal_that_cannot_answer_is_not_a_key_without_a_record() {
        let reply = |status: u16, body: Value| {
            Ok(Reply {
                status: http::StatusCode::from_u16(status).unwrap(),
                headers: http::HeaderMap::new(),
                body: body.to_string().into(),
                elapsed: std::time::Duration::ZERO,
                body_error: None,
            })
        };
        let path = "/v1/journal/t/k";
        assert_eq!(
            journal_record(path, reply(200, json!({"state": "completed"}))),
            Ok(Some(json!({"state": "completed"})))
        );
        assert_eq!(
            journal_record(
                path,
                reply(404, json!({"type": "urn:outrigger:problem:unknown-key"}))
            ),
            Ok(None)
        );
        let unavailable = journal_record(
            path,
            reply(503, json!({"type": "urn:outrigger:problem:journal-error"})),
        );
        assert!(unavailable.unwrap_err().contains("503"));
        let timeout = journal_record(
            path,
            Err(Failed {
                detail: "no response head within 10s".into(),
                after: std::time::Duration::from_secs(10),
            }),
        );
        assert!(timeout.unwrap_err().contains("no response head"));
    }

    #[test]
    fn second_applications_are_caught_from_the_journal_or_the_tool() {
        let unknown = seen(502, Some("outcome-unknown"), json!({}));
        let resent = seen(200, None, json!({"effect": 2, "ok": true, "echo": {}}));
        let v = judge(&KeyFacts {
            class: Some(ToolClass::Unsafe),
            answers: vec![&unknown, &resent],
            record: Some(record("completed", 2, 0)),
            status: None,
        });
        assert!(v.duplicated.unwrap().contains("sent 2 times"));
        let v = judge(&KeyFacts {
            class: Some(ToolClass::Keyed),
            answers: vec![&unknown, &resent],
            record: Some(record("completed", 2, 0)),
            status: Some(Some(json!({"effect": 1, "ok": true}))),
        });
        assert!(v.duplicated.unwrap().contains("effect = 1"));
        // Declared idempotent: a repeat is harmless by declaration.
        let v = judge(&KeyFacts {
            class: Some(ToolClass::Idempotent),
            answers: vec![&unknown, &resent],
            record: Some(record("completed", 2, 0)),
            status: Some(Some(json!({"effect": 1, "ok": true}))),
        });
        assert_eq!(v.duplicated, None);
    }
}
