//! `/v1/journal` on the admin plane: list, show, verify, timeline, statistics and the
//! resolution of in-doubt calls.
//!
//! - `GET /v1/journal?task=&tool=&state=&since=&until=&limit=&after=` — one page of
//!   records, oldest first (`since`/`until` are RFC 3339 times or durations ago, e.g.
//!   `1h`; `limit` defaults to [`DEFAULT_PAGE`], at most [`MAX_PAGE`]; `after` is the
//!   `next` of the page before, set when a page is full);
//! - `GET /v1/journal?view=verify` — the hash-chain check;
//! - `GET /v1/journal?view=timeline&task=T` — the task's calls in order;
//! - `GET /v1/journal?view=stats` — writer statistics (flushes per record, states);
//! - `GET /v1/journal/{key}` — one record (the key is percent-decoded; it may hold `/`);
//! - `POST /v1/journal/{key}/resolve` — `{"action": "mark_succeeded" | "mark_failed" |
//!   "retry", "status": 200, "body": …, "actor": "…", "reason": "…"}`.

use std::time::SystemTime;

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use outrigger_journal::{Filter, Headers, Journal, Resolution, State, StoredResponse, StreamKey};
use outrigger_proxy::body::Body;
use outrigger_proxy::problem::Problem;
use outrigger_types::{IdempotencyKey, TaskId};
use serde_json::{Value, json};

use super::json_response;

/// Records in a page of `GET /v1/journal` when the request names no `limit`.
pub const DEFAULT_PAGE: usize = 100;
/// The most records one page holds: a page is read, decoded and answered whole.
pub const MAX_PAGE: usize = 1000;

pub async fn handle(
    journal: Option<&Journal>,
    method: &Method,
    path: &str,
    query: &str,
    body: Bytes,
) -> Response<Body> {
    let Some(journal) = journal else {
        return Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "journal-unavailable",
            "The journal is not open",
            "The sidecar runs without a journal (see its log for why); nothing can be read.",
        )
        .into_response();
    };
    let rest = path.strip_prefix("/v1/journal").unwrap_or_default();
    let result = match (method, rest) {
        (&Method::GET, "" | "/") => collection(journal, query),
        (&Method::POST, r) if r.ends_with("/resolve") && r.len() > "/resolve".len() + 1 => {
            let key = decode_path(&r[1..r.len() - "/resolve".len()]);
            resolve(journal, &key, &body).await
        }
        (&Method::GET, r) if r.len() > 1 => {
            let key = decode_path(&r[1..]);
            show(journal, &key)
        }
        // Every other path under /v1/journal is a route; its method is not.
        (_, r) if r.ends_with("/resolve") && r.len() > "/resolve".len() + 1 => {
            Ok(super::method_not_allowed("GET, POST"))
        }
        _ => Ok(super::method_not_allowed("GET")),
    };
    result.unwrap_or_else(Problem::into_response)
}

fn bad(detail: impl Into<String>) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "invalid-request",
        "Invalid request",
        detail,
    )
}

fn journal_error(e: outrigger_journal::Error) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "journal-error",
        "Journal error",
        e.to_string(),
    )
}

fn collection(journal: &Journal, query: &str) -> Result<Response<Body>, Problem> {
    let q = parse_query(query);
    let get = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    match get("view").unwrap_or("records") {
        "records" => {
            let mut filter = filter_from(&q).map_err(bad)?;
            let limit = *filter.limit.get_or_insert(DEFAULT_PAGE);
            if !(1..=MAX_PAGE).contains(&limit) {
                return Err(bad(format!(
                    "limit {limit} is not a page size: use 1 to {MAX_PAGE}, and page on with \
                     after=<next> while a page says next"
                )));
            }
            let page = journal.page(&filter).map_err(journal_error)?;
            Ok(json_response(
                StatusCode::OK,
                &json!({"count": page.records.len(), "records": page.records,
                        "next": page.next.map(|next| next.to_string())}),
            ))
        }
        "verify" => {
            let report = journal.verify().map_err(journal_error)?;
            Ok(json_response(
                StatusCode::OK,
                &json!({"clean": report.is_clean(), "entries": report.entries,
                        "records": report.records, "problems": report.problems}),
            ))
        }
        "timeline" => {
            let task = get("task").ok_or_else(|| bad("view=timeline needs task=<task id>"))?;
            let task = TaskId::new(task).map_err(|e| bad(format!("task: {e}")))?;
            let entries = journal.timeline(&task).map_err(journal_error)?;
            Ok(json_response(
                StatusCode::OK,
                &json!({"task": task, "calls": entries}),
            ))
        }
        "stats" => Ok(json_response(StatusCode::OK, &json!(journal.stats()))),
        "stream" => {
            let key = get("key").ok_or_else(|| bad("view=stream needs key=<stream key>"))?;
            let key = StreamKey::new(key).map_err(|e| bad(format!("key: {e}")))?;
            match journal.stream_meta(&key).map_err(journal_error)? {
                Some(meta) => Ok(json_response(StatusCode::OK, &json!(meta))),
                None => Err(Problem::new(
                    StatusCode::NOT_FOUND,
                    "unknown-stream",
                    "No such stream",
                    format!("The journal has no stream with key {key}."),
                )),
            }
        }
        other => Err(bad(format!(
            "view={other:?} is not a view; use records, verify, timeline, stats or stream"
        ))),
    }
}

fn show(journal: &Journal, key: &str) -> Result<Response<Body>, Problem> {
    let key = IdempotencyKey::new(key).map_err(|e| bad(format!("key: {e}")))?;
    match journal.get(&key).map_err(journal_error)? {
        Some(record) => Ok(json_response(StatusCode::OK, &json!(record))),
        None => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-key",
            "No such key",
            format!("The journal has no record for key {key}."),
        )),
    }
}

async fn resolve(journal: &Journal, key: &str, body: &[u8]) -> Result<Response<Body>, Problem> {
    let key = IdempotencyKey::new(key).map_err(|e| bad(format!("key: {e}")))?;
    let doc: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("the body must be a JSON object ({e})")))?;
    let reason = doc["reason"].as_str().unwrap_or_default();
    if reason.trim().is_empty() {
        return Err(bad(
            "say why: \"reason\" is required (it is journaled with the resolution)",
        ));
    }
    let actor = doc["actor"].as_str().unwrap_or("admin-api");
    let stored = |default_status: u16| -> Result<StoredResponse, Problem> {
        // A status that is there but no integer is refused, not taken for the
        // default: recorded as 500 (or 200), it would replay as something else.
        let status = match &doc["status"] {
            Value::Null => u64::from(default_status),
            v => v.as_u64().ok_or_else(|| {
                bad(format!(
                    "status must be an HTTP status as a JSON integer (e.g. 409), not {v}"
                ))
            })?,
        };
        let status = u16::try_from(status).map_err(|_| bad("status must be an HTTP status"))?;
        let body = match &doc["body"] {
            Value::Null => Bytes::new(),
            Value::String(s) => Bytes::from(s.clone()),
            other => Bytes::from(other.to_string()),
        };
        let ct = if doc["body"].is_string() {
            "text/plain"
        } else {
            "application/json"
        };
        Ok(StoredResponse::new(
            status,
            Headers::redacted([("content-type".to_string(), ct.to_string())]),
            body,
        ))
    };
    let resolution = match doc["action"].as_str() {
        Some("mark_succeeded") => Resolution::MarkSucceeded(stored(200)?),
        Some("mark_failed") => Resolution::MarkFailed(stored(500)?),
        Some("retry") => Resolution::Retry,
        other => {
            return Err(bad(format!(
                "action {other:?} is not one of mark_succeeded, mark_failed, retry"
            )));
        }
    };
    match journal.resolve(&key, resolution, actor, reason).await {
        Ok(record) => Ok(json_response(StatusCode::OK, &json!(record))),
        Err(e @ outrigger_journal::Error::UnknownKey(_)) => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-key",
            "No such key",
            e.to_string(),
        )),
        Err(
            e @ (outrigger_journal::Error::NotResolvable { .. }
            | outrigger_journal::Error::InvalidResolution(_)),
        ) => Err(Problem::new(
            StatusCode::CONFLICT,
            "not-resolvable",
            "Cannot resolve this call",
            e.to_string(),
        )),
        Err(e) => Err(journal_error(e)),
    }
}

/// A journal filter from query pairs (also used by the CLI).
pub fn filter_from(q: &[(String, String)]) -> Result<Filter, String> {
    let mut f = Filter::default();
    for (k, v) in q {
        match k.as_str() {
            "task" => f.task = Some(TaskId::new(v.as_str()).map_err(|e| format!("task: {e}"))?),
            "tool" => f.tool = Some(v.clone()),
            "state" => f.state = Some(v.parse::<State>()?),
            "since" => f.since = Some(parse_time(v)?),
            "until" => f.until = Some(parse_time(v)?),
            "limit" => {
                f.limit = Some(
                    v.parse()
                        .map_err(|_| format!("limit {v:?} is not a number"))?,
                )
            }
            "after" => f.after = Some(v.parse().map_err(|e| format!("after: {e}"))?),
            "view" => {}
            other => {
                return Err(format!(
                    "unknown filter {other:?}; use task, tool, state, since, until, limit, after"
                ));
            }
        }
    }
    Ok(f)
}

/// An RFC 3339 time, or a duration meaning "that long ago" (`90m`, `2d`).
pub fn parse_time(s: &str) -> Result<SystemTime, String> {
    if let Ok(t) = humantime::parse_rfc3339_weak(s) {
        return Ok(t);
    }
    match humantime::parse_duration(s) {
        Ok(d) => SystemTime::now()
            .checked_sub(d)
            .ok_or_else(|| format!("{s:?} reaches before the epoch")),
        Err(_) => Err(format!(
            "{s:?} is neither an RFC 3339 time (2026-11-29T10:00:00Z) nor a duration ago (90m)"
        )),
    }
}

pub fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// Percent-decoding (and `+` as space in queries), lenient on malformed escapes.
/// Percent-decodes a query component (`+` is a space there).
pub fn decode(s: &str) -> String {
    percent_decode(s, true)
}

/// Percent-decodes a path segment (`+` is itself there: keys may contain it).
pub fn decode_path(s: &str) -> String {
    percent_decode(s, false)
}

fn percent_decode(s: &str, plus_is_space: bool) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resolution whose status is not a JSON integer is refused before anything
    /// is recorded, not taken for the default status.
    #[tokio::test]
    async fn a_status_that_is_no_integer_is_refused() {
        let dir = tempfile::tempdir().expect("a directory");
        let (journal, writer, _) =
            Journal::open(outrigger_journal::Options::new(dir.path())).expect("a journal");
        let writer = tokio::spawn(writer.run());
        for status in [r#""409""#, "404.0", "-1"] {
            let body =
                format!(r#"{{"action": "mark_failed", "status": {status}, "reason": "checked"}}"#);
            let refused = resolve(&journal, "payments/k", body.as_bytes())
                .await
                .expect_err("refused");
            assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{status}");
            assert!(
                refused.detail.contains("JSON integer"),
                "{}",
                refused.detail
            );
        }
        drop(journal);
        let _ = writer.await;
    }

    /// A stream's record needs its key, and an unknown one is a 404 that names it.
    #[tokio::test]
    async fn a_stream_view_needs_a_known_key() {
        let dir = tempfile::tempdir().expect("a directory");
        let (journal, writer, _) =
            Journal::open(outrigger_journal::Options::new(dir.path())).expect("a journal");
        let writer = tokio::spawn(writer.run());
        let refused = collection(&journal, "view=stream").expect_err("no key");
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        assert!(refused.detail.contains("key="), "{}", refused.detail);
        let unknown = collection(&journal, "view=stream&key=m%2Fanthropic%2Fk").expect_err("none");
        assert_eq!(unknown.status, StatusCode::NOT_FOUND);
        assert!(
            unknown.detail.contains("m/anthropic/k"),
            "{}",
            unknown.detail
        );
        drop(journal);
        let _ = writer.await;
    }

    #[test]
    fn decoding() {
        assert_eq!(decode("payments%2Fabc"), "payments/abc");
        assert_eq!(decode("a+b"), "a b");
        assert_eq!(decode_path("a+b"), "a+b");
        assert_eq!(decode_path("payments%2Fa%2Bb"), "payments/a+b");
        assert_eq!(decode("bad%zz"), "bad%zz");
        assert_eq!(decode("end%2"), "end%2");
    }

    #[test]
    fn filters() {
        let q = parse_query("task=t1&state=in_doubt&since=1h&limit=5");
        let f = filter_from(&q).unwrap();
        assert_eq!(f.task.unwrap().as_str(), "t1");
        assert_eq!(f.state, Some(State::InDoubt));
        assert!(f.since.is_some());
        assert_eq!(f.limit, Some(5));
        assert!(filter_from(&parse_query("state=bogus")).is_err());
        let f = filter_from(&parse_query("after=41")).unwrap();
        assert_eq!(f.after.unwrap().to_string(), "41");
        let f = filter_from(&parse_query("after=k%3Apayments%2Fa")).unwrap();
        assert_eq!(f.after.unwrap().to_string(), "k:payments/a");
        assert!(filter_from(&parse_query("after=yesterday")).is_err());
        assert!(filter_from(&parse_query("colour=red")).is_err());
    }
}
