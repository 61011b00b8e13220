//! `/v1/tasks` and `/v1/slo`: the task tracker and the SLO accounting, read (and a
//! task ended) over the admin plane.
//!
//! - `GET /v1/tasks` lists every known task, newest first (no timelines).
//! - `GET /v1/tasks/{id}` is one task with its ordered timeline and its journaled
//!   tool calls.
//! - `POST /v1/tasks/{id}/end` with `{"outcome": "success" | "failure" | "cancelled"}`
//!   ends it and returns the verdict on its recovery.
//! - `GET /v1/slo` reports each SLO with its budget left and burn by cause, and the
//!   maintenance window.
//! - `POST /v1/slo/maintenance` with `{"open": true, "for": "2h"}` (or without `for`:
//!   until closed) or `{"open": false}` opens or closes a declared maintenance window:
//!   calls that end inside it are left out of the SLOs.

use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use outrigger_proxy::body::Body;
use outrigger_proxy::problem::Problem;
use outrigger_proxy::tasks::{self, TaskOutcome, Tasks};
use outrigger_telemetry::slo::Slos;
use outrigger_types::TaskId;

use super::method_not_allowed;
use serde::Deserialize;
use serde_json::json;

use super::json_response;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EndRequest {
    outcome: String,
}

pub async fn handle(
    tasks: Option<&Tasks>,
    method: &Method,
    path: &str,
    body: Bytes,
) -> Response<Body> {
    let Some(tasks) = tasks else {
        return Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "tasks-unavailable",
            "Task tracking is unavailable",
            "The task tracker could not start (see the log).",
        )
        .into_response();
    };
    let now = SystemTime::now();
    let rest = path.trim_start_matches("/v1/tasks").trim_start_matches('/');
    if rest.is_empty() {
        return match *method {
            Method::GET => json_response(StatusCode::OK, &json!({"tasks": tasks.list(now)})),
            _ => method_not_allowed("GET"),
        };
    }
    let (id, action) = match rest.split_once('/') {
        Some((id, action)) => (id, Some(action)),
        None => (rest, None),
    };
    // Percent-decoded, as journal keys are: a client library encodes `:` and the like.
    let id = match TaskId::new(super::journal::decode_path(id)) {
        Ok(id) => id,
        Err(e) => {
            return Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid-task-id",
                "Invalid task id",
                e.to_string(),
            )
            .into_response();
        }
    };
    match (method, action) {
        (&Method::GET, None) => match tasks.get(&id, now) {
            Some(report) => json_response(StatusCode::OK, &json!(report)),
            None => unknown(&id),
        },
        (_, None) => method_not_allowed("GET"),
        (&Method::POST, Some("end")) => {
            let outcome = match parse_end(&body) {
                Ok(o) => o,
                Err(detail) => {
                    return Problem::new(
                        StatusCode::BAD_REQUEST,
                        "invalid-task-end",
                        "Invalid task end",
                        detail,
                    )
                    .into_response();
                }
            };
            match tasks.end(&id, outcome, now).await {
                Ok(report) => json_response(StatusCode::OK, &json!(report)),
                Err(tasks::Error::UnknownTask(_)) => unknown(&id),
                Err(e) => Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "task-store-failed",
                    "The task could not be ended",
                    e.to_string(),
                )
                .into_response(),
            }
        }
        (_, Some("end")) => method_not_allowed("POST"),
        (_, Some(other)) => Problem::new(
            StatusCode::NOT_FOUND,
            "no-route",
            "No such task route",
            format!("/v1/tasks/{{id}}/{other} does not exist; use GET /v1/tasks/{{id}} or POST /v1/tasks/{{id}}/end."),
        )
        .into_response(),
    }
}

fn parse_end(body: &[u8]) -> Result<TaskOutcome, String> {
    const HINT: &str = "send {\"outcome\": \"success\" | \"failure\" | \"cancelled\"}";
    let req: EndRequest = serde_json::from_slice(body).map_err(|e| format!("{e}: {HINT}"))?;
    match req.outcome.as_str() {
        "success" => Ok(TaskOutcome::Success),
        "failure" => Ok(TaskOutcome::Failure),
        "cancelled" => Ok(TaskOutcome::Cancelled),
        other => Err(format!("outcome {other:?} is not one of those: {HINT}")),
    }
}

pub fn slo(slos: &Arc<Slos>, method: &Method) -> Response<Body> {
    match *method {
        Method::GET => {
            let now = SystemTime::now();
            json_response(
                StatusCode::OK,
                &json!({"slos": slos.report(now), "maintenance": maintenance_json(slos, now)}),
            )
        }
        _ => method_not_allowed("GET"),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MaintenanceRequest {
    open: bool,
    #[serde(rename = "for")]
    lasting: Option<String>,
}

/// `POST /v1/slo/maintenance`.
pub fn maintenance(slos: &Slos, method: &Method, body: &[u8]) -> Response<Body> {
    if *method != Method::POST {
        return method_not_allowed("POST");
    }
    let invalid = |detail: String| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-request",
            "Invalid maintenance request",
            detail,
        )
        .into_response()
    };
    let request: MaintenanceRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            return invalid(format!(
                "{e}. Send {{\"open\": true, \"for\": \"2h\"}}, {{\"open\": true}} (until closed) or {{\"open\": false}}."
            ));
        }
    };
    let now = SystemTime::now();
    match (request.open, request.lasting) {
        (false, Some(_)) => return invalid("\"for\" only goes with \"open\": true.".into()),
        (false, None) => {
            slos.close_maintenance();
            tracing::info!("SLO maintenance window closed");
        }
        (true, None) => {
            slos.open_maintenance(None);
            tracing::info!("SLO maintenance window opened until closed");
        }
        (true, Some(lasting)) => {
            let lasting = match humantime::parse_duration(&lasting) {
                Ok(d) if !d.is_zero() => d,
                Ok(_) => return invalid("\"for\" must be longer than 0.".into()),
                Err(e) => {
                    return invalid(format!(
                        "\"for\": {lasting:?} is not a duration ({e}); write e.g. \"90m\" or \"2h\"."
                    ));
                }
            };
            let Some(end) = now.checked_add(lasting) else {
                return invalid("\"for\" is too long.".into());
            };
            slos.open_maintenance(Some(end));
            tracing::info!(until = %humantime::format_rfc3339_seconds(end), "SLO maintenance window opened");
        }
    }
    json_response(StatusCode::OK, &maintenance_json(slos, now))
}

fn maintenance_json(slos: &Slos, now: SystemTime) -> serde_json::Value {
    match slos.maintenance(now) {
        None => json!({"open": false, "until": null}),
        Some(until) => json!({
            "open": true,
            "until": until.map(|t| humantime::format_rfc3339_seconds(t).to_string()),
        }),
    }
}

fn unknown(id: &TaskId) -> Response<Body> {
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-task",
        "Unknown task",
        format!("No task {id} is known: it never made a call through this sidecar, or it ended longer ago than tasks.retention."),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task id in the path is percent-decoded, as a client library encodes it.
    #[tokio::test]
    async fn an_encoded_task_id_names_the_task() {
        let tasks = Tasks::open(
            tasks::TasksOptions::default(),
            None,
            outrigger_telemetry::Metrics::new(),
            None,
            SystemTime::now(),
        )
        .expect("a tracker");
        let id = TaskId::new("run:1").expect("an id");
        tasks.touch(&id, "req-1", SystemTime::now());
        for path in ["/v1/tasks/run:1", "/v1/tasks/run%3A1"] {
            let resp = handle(Some(&tasks), &Method::GET, path, Bytes::new()).await;
            assert_eq!(resp.status(), StatusCode::OK, "{path}");
        }
    }

    #[test]
    fn end_bodies() {
        assert_eq!(
            parse_end(br#"{"outcome":"success"}"#),
            Ok(TaskOutcome::Success)
        );
        assert_eq!(
            parse_end(br#"{"outcome":"cancelled"}"#),
            Ok(TaskOutcome::Cancelled)
        );
        // idle_timeout is the sweeper's, not the agent's, to give.
        assert!(
            parse_end(br#"{"outcome":"idle_timeout"}"#)
                .unwrap_err()
                .contains("success")
        );
        assert!(parse_end(b"{}").is_err());
        assert!(parse_end(br#"{"outcome":"success","x":1}"#).is_err());
    }
}
