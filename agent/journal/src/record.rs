//! What the journal stores about one tool call, and the values that cross its API.
//!
//! A [`Record`] is both the persisted form (JSON, `"v": 1`) and what the admin API and
//! `journal export` print, so the two can never drift apart.

use std::fmt;
use std::time::SystemTime;

use base64::Engine as _;
use bytes::Bytes;
use outrigger_types::{Fingerprint, IdempotencyKey, PolicyVersion, RequestId, TaskId, ToolClass};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

use crate::time::Timestamp;

/// The persisted record format; bumped on any incompatible change.
pub const RECORD_VERSION: u32 = 1;

/// Headers that carry credentials. The proxy redacts before it hands a request to the
/// journal; the journal drops these again because a leaked secret in an append-only,
/// hash-chained log cannot be taken back.
const SECRET_HEADERS: [&str; 6] = [
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
    "set-cookie",
];

fn is_secret_header(name: &str) -> bool {
    SECRET_HEADERS.iter().any(|s| s.eq_ignore_ascii_case(name))
}

/// Where a tool call stands. See durability.md §6.1 for the meaning of each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Intent durable; not yet sent (only unsafe tools rest here, between their two writes).
    Claimed,
    /// The request may have left the sidecar for the current attempt.
    Dispatched,
    /// A definitive outcome is stored and is replayed for the same request.
    Completed,
    /// The current attempt provably did not take effect; the next request executes again.
    FailedBeforeSend,
    /// Sent, outcome unknown; the tool class decides what the next request does.
    InDoubt,
    /// A probe tool is being asked whether the in-doubt call took effect.
    Reconciling,
    /// In doubt for a tool that must never be re-sent automatically: an operator decides.
    NeedsOperator,
    /// Past retention: only the key, fingerprint, final status and body digest remain.
    Tombstone,
}

impl State {
    pub const ALL: [State; 8] = [
        State::Claimed,
        State::Dispatched,
        State::Completed,
        State::FailedBeforeSend,
        State::InDoubt,
        State::Reconciling,
        State::NeedsOperator,
        State::Tombstone,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Claimed => "claimed",
            State::Dispatched => "dispatched",
            State::Completed => "completed",
            State::FailedBeforeSend => "failed_before_send",
            State::InDoubt => "in_doubt",
            State::Reconciling => "reconciling",
            State::NeedsOperator => "needs_operator",
            State::Tombstone => "tombstone",
        }
    }

    /// A live attempt owns the key: a second request must wait or get 409.
    pub fn in_flight(self) -> bool {
        matches!(
            self,
            State::Claimed | State::Dispatched | State::Reconciling
        )
    }

    /// Whether the call has ended: what `wait_settled` waits for.
    pub fn settled(self) -> bool {
        !self.in_flight()
    }

    pub(crate) fn index(self) -> usize {
        match self {
            State::Claimed => 0,
            State::Dispatched => 1,
            State::Completed => 2,
            State::FailedBeforeSend => 3,
            State::InDoubt => 4,
            State::Reconciling => 5,
            State::NeedsOperator => 6,
            State::Tombstone => 7,
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for State {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        State::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown state {s:?}; expected one of claimed, dispatched, completed, \
                     failed_before_send, in_doubt, reconciling, needs_operator, tombstone"
                )
            })
    }
}

/// A request or response body. Printed as a JSON string when it is UTF-8, otherwise as
/// `{"base64": "..."}`, so exports stay readable without losing binary bodies.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Body(Bytes);

impl Body {
    pub fn new(bytes: impl Into<Bytes>) -> Self {
        Self(bytes.into())
    }

    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Hex SHA-256 of the body: what a tombstone keeps instead of the body.
    pub fn digest_hex(&self) -> String {
        hex::encode(Sha256::digest(&self.0))
    }
}

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(text) => write!(f, "Body({text:?})"),
            Err(_) => write!(f, "Body({} binary bytes)", self.0.len()),
        }
    }
}

impl From<&str> for Body {
    fn from(s: &str) -> Self {
        Self(Bytes::copy_from_slice(s.as_bytes()))
    }
}

impl From<Vec<u8>> for Body {
    fn from(v: Vec<u8>) -> Self {
        Self(Bytes::from(v))
    }
}

impl From<Bytes> for Body {
    fn from(b: Bytes) -> Self {
        Self(b)
    }
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum BodyRepr {
    Text(String),
    Binary { base64: String },
}

impl Serialize for Body {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match std::str::from_utf8(&self.0) {
            Ok(text) => s.serialize_str(text),
            Err(_) => BodyRepr::Binary {
                base64: base64::engine::general_purpose::STANDARD.encode(&self.0),
            }
            .serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Body {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match BodyRepr::deserialize(d)? {
            BodyRepr::Text(text) => Ok(Self(Bytes::from(text))),
            BodyRepr::Binary { base64 } => base64::engine::general_purpose::STANDARD
                .decode(base64)
                .map(|v| Self(Bytes::from(v)))
                .map_err(serde::de::Error::custom),
        }
    }
}

/// Header name/value pairs with credentials removed.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Headers(Vec<(String, String)>);

impl Headers {
    /// Keeps every header except those that carry credentials (`Authorization`,
    /// `Proxy-Authorization`, `x-api-key`, `api-key`, `Cookie`, `Set-Cookie`).
    pub fn redacted(pairs: impl IntoIterator<Item = (String, String)>) -> Self {
        Self(
            pairs
                .into_iter()
                .filter(|(name, _)| !is_secret_header(name))
                .collect(),
        )
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }

    fn scrub(&mut self) {
        self.0.retain(|(name, _)| !is_secret_header(name));
    }
}

/// The request as the proxy forwards it, after redaction.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RedactedRequest {
    pub headers: Headers,
    pub body: Body,
}

impl RedactedRequest {
    pub fn new(headers: Headers, body: impl Into<Body>) -> Self {
        Self {
            headers,
            body: body.into(),
        }
    }

    pub(crate) fn scrub(&mut self) {
        self.headers.scrub();
    }
}

/// A response the tool gave (or an operator stated), replayed for the same request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    pub status: u16,
    pub headers: Headers,
    pub body: Body,
}

impl StoredResponse {
    pub fn new(status: u16, headers: Headers, body: impl Into<Body>) -> Self {
        Self {
            status,
            headers,
            body: body.into(),
        }
    }

    pub(crate) fn scrub(&mut self) {
        self.headers.scrub();
    }
}

/// What a response status says about whether the call took effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMeaning {
    /// 2xx, or a 4xx other than 408/409/425/429 (and any 1xx/3xx the proxy did not
    /// follow): the tool answered for good; replay it.
    Definitive,
    /// 408, 409, 425, 429: the tool refused before acting; a retry executes again.
    NotApplied,
    /// 5xx: the tool may or may not have acted.
    Ambiguous,
}

impl StatusMeaning {
    pub fn of(status: u16) -> Self {
        match status {
            408 | 409 | 425 | 429 => StatusMeaning::NotApplied,
            500..=599 => StatusMeaning::Ambiguous,
            _ => StatusMeaning::Definitive,
        }
    }
}

/// Where the idempotency key came from (the README documents the derivation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeySource {
    /// The agent's `Idempotency-Key` header.
    Header,
    /// An MCP `params._meta` key.
    McpMeta,
    /// Derived by the sidecar from the task and the model's `tool_call_id`.
    ToolCallId,
}

/// What the proxy knows about a tool call before it sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intent {
    pub key: IdempotencyKey,
    pub fingerprint: Fingerprint,
    pub tool: String,
    pub class: ToolClass,
    pub method: String,
    pub target: String,
    pub task_id: Option<TaskId>,
    pub request_id: RequestId,
    /// The key forwarded to the tool on every attempt (the same across re-sends).
    pub downstream_key: String,
    pub request: RedactedRequest,
    pub policy_versions: Vec<PolicyVersion>,
    pub model_revision: Option<String>,
    pub derived_from: KeySource,
}

/// Permission to act on one attempt of one key, issued by the journal. Outcomes
/// reported with a ticket from an older attempt or an earlier process are refused, so a
/// late reply can never overwrite a newer attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    key: IdempotencyKey,
    attempt: u32,
    epoch: u64,
}

impl Ticket {
    pub(crate) fn new(key: IdempotencyKey, attempt: u32, epoch: u64) -> Self {
        Self {
            key,
            attempt,
            epoch,
        }
    }

    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// 1-based attempt number.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The process epoch that issued the ticket.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

/// One attempt at the call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    pub n: u32,
    pub request_id: RequestId,
    pub claimed_at: Timestamp,
    pub dispatched_at: Option<Timestamp>,
    pub ended_at: Option<Timestamp>,
    /// How the attempt ended, in words (`completed: status 201`, `in doubt: timeout`).
    pub outcome: Option<String>,
}

/// One state change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    pub at: Timestamp,
    pub state: State,
    pub note: String,
}

/// An operator's decision about a call whose outcome was unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The call took effect; this is its result (2xx).
    MarkSucceeded(StoredResponse),
    /// The call failed for good; this failure (status ≥ 400) is replayed.
    MarkFailed(StoredResponse),
    /// The call did not take effect: the next request with the key executes again.
    Retry,
}

impl Resolution {
    pub fn as_str(&self) -> &'static str {
        match self {
            Resolution::MarkSucceeded(_) => "mark_succeeded",
            Resolution::MarkFailed(_) => "mark_failed",
            Resolution::Retry => "retry",
        }
    }
}

/// A resolution as journaled: who, when, why, what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolutionEntry {
    pub at: Timestamp,
    pub actor: String,
    pub reason: String,
    pub action: String,
    pub from_state: State,
}

/// Everything the journal knows about one idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub v: u32,
    pub key: IdempotencyKey,
    pub state: State,
    pub fingerprint: Fingerprint,
    pub tool: String,
    pub class: ToolClass,
    pub method: String,
    pub target: String,
    pub task_id: Option<TaskId>,
    /// The request that created the record; later attempts name theirs in `attempts`.
    pub request_id: RequestId,
    pub downstream_key: String,
    pub derived_from: KeySource,
    pub policy_versions: Vec<PolicyVersion>,
    pub model_revision: Option<String>,
    /// The process epoch of the latest attempt (or probe).
    pub epoch: u64,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    /// The current attempt number (1-based).
    pub attempt: u32,
    pub attempts: Vec<Attempt>,
    pub history: Vec<Transition>,
    pub resolutions: Vec<ResolutionEntry>,
    pub request: Option<RedactedRequest>,
    pub response: Option<StoredResponse>,
    pub final_status: Option<u16>,
    /// Hex SHA-256 of the stored response body, kept after tombstoning.
    pub body_digest: Option<String>,
    /// Sequence number of this record's latest entry in the hash-chained log.
    pub log_seq: u64,
}

impl Record {
    pub fn created(&self) -> SystemTime {
        self.created_at.to_system()
    }

    /// The time from creation to the last state change.
    pub fn duration(&self) -> std::time::Duration {
        self.updated_at.since(self.created_at)
    }

    pub(crate) fn current_attempt(&self) -> Option<&Attempt> {
        self.attempts.iter().rev().find(|a| a.n == self.attempt)
    }

    pub(crate) fn current_attempt_mut(&mut self) -> Option<&mut Attempt> {
        let n = self.attempt;
        self.attempts.iter_mut().rev().find(|a| a.n == n)
    }
}

/// The journal's answer to `begin`: what the proxy must do with this request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// Send now. For keyed, idempotent and probe tools the intent (claimed + dispatched)
    /// is already durable; for unsafe tools `dispatch_write` is true: call
    /// `dispatched(&ticket)` right before the send. It follows the class the record
    /// was created with, not the tool's configured class now (an operator may have
    /// changed it since). `resend` is true when an earlier attempt may have reached
    /// the tool: the proxy forwards the same downstream key so the tool can
    /// deduplicate.
    Execute {
        ticket: Ticket,
        resend: bool,
        dispatch_write: bool,
    },
    /// A definitive outcome exists: answer from `record.response`, do not execute.
    Replay(Record),
    /// A live attempt owns the key: 409 + Retry-After, or wait (`Prefer: wait=N`).
    InFlight { record: Record },
    /// Same key, different request: 422.
    Mismatch { record: Record },
    /// The previous attempt may have executed and the tool must not be re-sent: 409
    /// `outcome-unknown` naming the state; an operator resolves it.
    OutcomeUnknown { record: Record },
    /// A probe tool's call is in doubt: probe it by downstream key, then call
    /// `reconciled(&ticket, found)`.
    Probe { ticket: Ticket },
    /// Past retention: only the key, fingerprint, final status and body digest remain.
    Tombstoned { record: Record },
}

/// What `list` and `export` select. Empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub task: Option<TaskId>,
    pub tool: Option<String>,
    pub state: Option<State>,
    /// Records created at or after this time.
    pub since: Option<SystemTime>,
    /// Records created before this time.
    pub until: Option<SystemTime>,
    /// At most this many (a page; see [`crate::Page`]).
    pub limit: Option<usize>,
    /// Only records after this one in the listing's order: the `next` of the page
    /// before.
    pub after: Option<crate::Cursor>,
}

impl Filter {
    pub fn matches(&self, record: &Record) -> bool {
        let created = record.created_at;
        self.task
            .as_ref()
            .is_none_or(|t| record.task_id.as_ref() == Some(t))
            && self.tool.as_ref().is_none_or(|t| &record.tool == t)
            && self.state.is_none_or(|s| record.state == s)
            && self
                .since
                .is_none_or(|s| created >= Timestamp::from_system(s))
            && self
                .until
                .is_none_or(|u| created < Timestamp::from_system(u))
    }
}

/// One call in a task's timeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TimelineEntry {
    pub key: IdempotencyKey,
    pub tool: String,
    pub target: String,
    pub state: State,
    pub started_at: Timestamp,
    pub last_change_at: Timestamp,
    /// From creation to the last state change, in microseconds.
    pub duration_us: u64,
    pub attempts: u32,
    pub final_status: Option<u16>,
    pub resolved_by: Option<String>,
}

impl TimelineEntry {
    pub fn of(record: &Record) -> Self {
        Self {
            key: record.key.clone(),
            tool: record.tool.clone(),
            target: record.target.clone(),
            state: record.state,
            started_at: record.created_at,
            last_change_at: record.updated_at,
            duration_us: u64::try_from(record.duration().as_micros()).unwrap_or(u64::MAX),
            attempts: record.attempt,
            final_status: record.final_status,
            resolved_by: record.resolutions.last().map(|r| r.actor.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_print_as_text_or_marked_base64() -> Result<(), serde_json::Error> {
        let text = Body::from("{\"a\":1}");
        assert_eq!(serde_json::to_string(&text)?, r#""{\"a\":1}""#);
        let binary = Body::from(vec![0xff, 0x00, 0x01]);
        let json = serde_json::to_string(&binary)?;
        assert_eq!(json, r#"{"base64":"/wAB"}"#);
        assert_eq!(serde_json::from_str::<Body>(&json)?, binary);
        assert_eq!(serde_json::from_str::<Body>(r#""{\"a\":1}""#)?, text);
        Ok(())
    }

    #[test]
    fn credentials_never_survive_redaction() {
        let headers = Headers::redacted([
            ("Authorization".to_owned(), "Bearer sk".to_owned()),
            ("X-API-Key".to_owned(), "k".to_owned()),
            ("cookie".to_owned(), "c".to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
        ]);
        let names: Vec<&str> = headers.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["content-type"]);
        assert_eq!(headers.get("Content-Type"), Some("application/json"));
    }

    #[test]
    fn status_meanings() {
        let cases = [
            (200, StatusMeaning::Definitive),
            (201, StatusMeaning::Definitive),
            (302, StatusMeaning::Definitive),
            (400, StatusMeaning::Definitive),
            (404, StatusMeaning::Definitive),
            (408, StatusMeaning::NotApplied),
            (409, StatusMeaning::NotApplied),
            (425, StatusMeaning::NotApplied),
            (429, StatusMeaning::NotApplied),
            (500, StatusMeaning::Ambiguous),
            (503, StatusMeaning::Ambiguous),
        ];
        for (status, meaning) in cases {
            assert_eq!(StatusMeaning::of(status), meaning, "{status}");
        }
    }

    #[test]
    fn state_names_round_trip() {
        for state in State::ALL {
            assert_eq!(state.as_str().parse::<State>(), Ok(state));
            assert_eq!(State::ALL[state.index()], state);
        }
    }
}
