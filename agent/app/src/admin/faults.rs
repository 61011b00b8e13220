//! `/v1/faults`: fault injection at run time (off by default, loud when on).
//!
//! - `GET /v1/faults` — what is injected now;
//! - `POST /v1/faults` — `{"journal": "fail_flush" | "fail_apply" | null}` makes every
//!   journal commit fail (as on a full or failing disk), or stops doing so.

use std::sync::Mutex;

use http::{Response, StatusCode};
use outrigger_journal::{Journal, WriteFault};
use outrigger_proxy::body::Body;
use outrigger_proxy::problem::Problem;
use serde_json::{Value, json};

use super::json_response;

/// What is injected right now.
#[derive(Debug, Default)]
pub struct Faults {
    journal: Mutex<Option<WriteFault>>,
}

fn name(f: Option<WriteFault>) -> Value {
    match f {
        None => Value::Null,
        Some(WriteFault::FailApply) => json!("fail_apply"),
        Some(WriteFault::FailFlush) => json!("fail_flush"),
    }
}

impl Faults {
    pub fn snapshot(&self) -> Value {
        let journal = self.journal.lock().map(|j| *j).unwrap_or(None);
        json!({"journal": name(journal)})
    }

    pub fn get(&self) -> Response<Body> {
        json_response(StatusCode::OK, &self.snapshot())
    }

    pub fn set(&self, journal: Option<&Journal>, body: &[u8]) -> Response<Body> {
        let bad = |d: String| {
            Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "Invalid fault",
                d,
            )
            .into_response()
        };
        let doc: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return bad(format!("the body must be a JSON object ({e})")),
        };
        if let Some(obj) = doc.as_object()
            && let Some(k) = obj.keys().find(|k| k.as_str() != "journal")
        {
            return bad(format!(
                "unknown fault {k:?}; this sidecar injects: journal"
            ));
        }
        if let Some(j) = doc.get("journal") {
            let fault = match j.as_str() {
                None if j.is_null() => None,
                Some("fail_flush") => Some(WriteFault::FailFlush),
                Some("fail_apply") => Some(WriteFault::FailApply),
                _ => {
                    return bad(format!(
                        "journal: {j} is not null, \"fail_flush\" or \"fail_apply\""
                    ));
                }
            };
            let Some(journal) = journal else {
                return bad("the journal is not open".into());
            };
            journal.set_write_fault(fault);
            if let Ok(mut g) = self.journal.lock() {
                *g = fault;
            }
            match fault {
                Some(f) => {
                    tracing::warn!(fault = ?f, "FAULT INJECTION ON: every journal commit will fail")
                }
                None => tracing::warn!("fault injection off: the journal writes again"),
            }
        }
        json_response(StatusCode::OK, &self.snapshot())
    }
}
