//! `/v1/faults`: fault injection at run time (off by default, loud when on).
//!
//! - `GET /v1/faults` — what is injected now, with how often each fault fired;
//! - `POST /v1/faults` — `{"faults": [ … ]}` replaces the provider and tool faults
//!   (the `[[faults]]` shape; `[]` turns them off), and `{"journal": "fail_flush" |
//!   "fail_apply" | null}` makes every journal commit fail (as on a full or failing
//!   disk), or stops doing so. Either key may be given alone. A body with any problem
//!   changes nothing.

use std::sync::{Arc, Mutex};

use http::{Response, StatusCode};
use outrigger_journal::{Journal, WriteFault};
use outrigger_proxy::body::Body;
use outrigger_proxy::faults::{Fault, FaultSpec, Injector};
use outrigger_proxy::options::Options;
use outrigger_proxy::problem::Problem;
use serde_json::{Value, json};

use super::json_response;

/// What is injected right now.
pub struct Faults {
    journal: Mutex<Option<WriteFault>>,
    injector: Arc<Injector>,
    /// The data plane's options, to validate faults against its providers and tools.
    options: Options,
}

fn name(f: Option<WriteFault>) -> Value {
    match f {
        None => Value::Null,
        Some(WriteFault::FailApply) => json!("fail_apply"),
        Some(WriteFault::FailFlush) => json!("fail_flush"),
    }
}

fn parse_journal(v: &Value) -> Result<Option<WriteFault>, String> {
    match v.as_str() {
        None if v.is_null() => Ok(None),
        Some("fail_flush") => Ok(Some(WriteFault::FailFlush)),
        Some("fail_apply") => Ok(Some(WriteFault::FailApply)),
        _ => Err(format!(
            "journal: {v} is not null, \"fail_flush\" or \"fail_apply\""
        )),
    }
}

impl Faults {
    pub fn new(injector: Arc<Injector>, options: Options) -> Self {
        Self {
            journal: Mutex::new(None),
            injector,
            options,
        }
    }

    pub fn snapshot(&self) -> Value {
        let journal = self.journal.lock().map(|j| *j).unwrap_or(None);
        json!({"journal": name(journal), "faults": self.injector.status()})
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
        let Some(obj) = doc.as_object() else {
            return bad(
                "the body must be a JSON object: {\"faults\": [...], \"journal\": ...}".into(),
            );
        };
        if let Some(k) = obj
            .keys()
            .find(|k| !matches!(k.as_str(), "journal" | "faults"))
        {
            return bad(format!(
                "unknown key {k:?}; send {{\"faults\": [...]}} and/or {{\"journal\": ...}}"
            ));
        }
        // Validate everything before changing anything.
        let journal_fault = match obj.get("journal").map(parse_journal) {
            None => None,
            Some(Ok(f)) => Some(f),
            Some(Err(e)) => return bad(e),
        };
        if journal_fault.is_some() && journal.is_none() {
            return bad("the journal is not open".into());
        }
        let faults = match obj.get("faults") {
            None => None,
            Some(v) => {
                let specs: Vec<FaultSpec> = match serde_json::from_value(v.clone()) {
                    Ok(s) => s,
                    Err(e) => {
                        return bad(format!(
                            "faults: {e} (each fault is {{\"provider\" or \"tool\", \"kind\", \"percent\", …}})"
                        ));
                    }
                };
                match Fault::from_specs(&specs, &self.options, "faults") {
                    Ok(f) => Some(f),
                    Err(problems) => {
                        let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
                        return bad(text.join("; "));
                    }
                }
            }
        };
        if let (Some(fault), Some(journal)) = (journal_fault, journal) {
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
        if let Some(faults) = faults {
            self.injector.set(faults);
        }
        json_response(StatusCode::OK, &self.snapshot())
    }
}
