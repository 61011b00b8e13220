//! Model streams journaled event by event, so an interrupted stream can be replayed
//! byte for byte (durability.md §7).

use std::fmt;

use outrigger_types::{Fingerprint, PolicyVersion, RequestId, TaskId};
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::time::Timestamp;

/// Names one model call's stream: the explicit idempotency key, or a key the proxy
/// derives from the task and the request fingerprint.
///
/// 1–512 visible ASCII characters, so it can sit in a storage key before a separator
/// byte that it can never contain.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct StreamKey(String);

impl StreamKey {
    pub const MAX_LEN: usize = 512;

    pub fn new(raw: impl Into<String>) -> Result<Self, Error> {
        let raw = raw.into();
        if raw.is_empty() || raw.len() > Self::MAX_LEN {
            return Err(Error::Invalid {
                what: "stream key",
                detail: format!("must be 1 to {} bytes, got {}", Self::MAX_LEN, raw.len()),
            });
        }
        if let Some(bad) = raw.chars().find(|c| !c.is_ascii_graphic()) {
            return Err(Error::Invalid {
                what: "stream key",
                detail: format!("contains {bad:?}; only visible ASCII is allowed"),
            });
        }
        Ok(Self(raw))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for StreamKey {
    type Error = Error;
    fn try_from(s: String) -> Result<Self, Error> {
        Self::new(s)
    }
}

impl From<StreamKey> for String {
    fn from(k: StreamKey) -> String {
        k.0
    }
}

/// What the proxy knows about a model call when its stream starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamRequest {
    /// Identifies the request body; a different body under the same key is a mismatch.
    pub fingerprint: Fingerprint,
    pub task_id: Option<TaskId>,
    pub request_id: RequestId,
    pub provider: String,
    pub model: String,
    pub policy_versions: Vec<PolicyVersion>,
}

/// Where a stream's current attempt stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamState {
    Open,
    Completed,
    Failed,
    Abandoned,
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "end", rename_all = "snake_case")]
pub enum StreamEnd {
    /// The provider's terminal event arrived; `usage` is the provider's usage object.
    Completed { usage: serde_json::Value },
    /// The provider answered with a definitive error.
    Failed { reason: String },
    /// The attempt broke off (upstream break, half a tool call, restart).
    Abandoned { reason: String },
}

impl StreamEnd {
    pub fn state(&self) -> StreamState {
        match self {
            StreamEnd::Completed { .. } => StreamState::Completed,
            StreamEnd::Failed { .. } => StreamState::Failed,
            StreamEnd::Abandoned { .. } => StreamState::Abandoned,
        }
    }
}

/// A journaled stream: the request it serves and its current attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamMeta {
    pub v: u32,
    pub key: StreamKey,
    pub request: StreamRequest,
    /// The current attempt (1-based); events are stored per attempt.
    pub attempt: u32,
    pub state: StreamState,
    pub epoch: u64,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    pub end: Option<StreamEnd>,
    /// The highest sequence number journaled for the current attempt (filled on read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seq: Option<u64>,
}

/// The journal's answer to `stream_begin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamBegin {
    /// Generate: events go under this attempt number. A stream whose previous attempt
    /// failed or was abandoned starts a fresh attempt (its half-received tool calls
    /// were never handed to the agent, so nothing repeats).
    New { attempt: u32 },
    /// The stream exists and is completed (replay it) or still open in this process
    /// (attach to its journaled prefix and live tail).
    Existing { meta: StreamMeta },
    /// Same key, different request.
    Mismatch { meta: StreamMeta },
}
