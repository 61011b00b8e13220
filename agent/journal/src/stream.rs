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
    /// Past `stream_retention`: its events are gone. The metadata stays as long
    /// again, so that a resume is told the stream expired (not that it never
    /// existed), a different body under the key is still a mismatch, and a new
    /// attempt of the key takes the next number. `end` still says how the last
    /// attempt ended.
    Expired,
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "end", rename_all = "snake_case")]
pub enum StreamEnd {
    /// The provider's terminal event arrived; `usage` is the provider's usage object
    /// (the sum over its pieces when it was continued).
    Completed {
        usage: serde_json::Value,
        /// How many times the generation was continued after an interruption (its
        /// events are stitched from that many more upstream answers).
        #[serde(default, skip_serializing_if = "is_zero")]
        continued: u32,
    },
    /// The provider answered with a definitive error.
    Failed { reason: String },
    /// The attempt broke off (upstream break, half a tool call, restart).
    Abandoned {
        reason: String,
        /// The last event its clients were sent, when the journal lost some of its
        /// events (it holds fewer than that): a client that has this one has all
        /// there was.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sent_to: Option<u64>,
    },
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl StreamEnd {
    /// An attempt that broke off for `reason`, every event it sent journaled.
    pub fn abandoned(reason: impl Into<String>) -> Self {
        Self::Abandoned {
            reason: reason.into(),
            sent_to: None,
        }
    }

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
    /// Where the stream's events are stored: a slot numbered in creation order
    /// (journal format 3), or, for a stream begun under an older format, `None`: its
    /// events are stored under its key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_slot: Option<u64>,
    /// The attempt the stream was at when retention expired it (dropping the events
    /// of it and every earlier attempt): a resume of any of them is told the stream
    /// expired, also after a later attempt has begun.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expired_through: Option<u32>,
    /// Each attempt's tag, by number (attempt `n` at index `n - 1`), drawn at random
    /// when its start was decided: a client's event id names it, so that an id of a
    /// generation whose start the journal never held (lost to a failed write or a
    /// stop before it was written, or a key forgotten by retention) is not taken for one
    /// of a later generation that reused its number. 0 where none is known: attempts
    /// begun before journal format 8, whose ids have no tag, and numbers no
    /// journaled start took.
    ///
    /// Stored as 8 hex digits each, as the event ids show them.
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "hex_tags")]
    pub tags: Vec<u32>,
}

impl StreamMeta {
    /// Whether retention dropped the events of `attempt`.
    pub fn expired(&self, attempt: u32) -> bool {
        self.expired_through.is_some_and(|last| attempt <= last)
    }

    /// The tag of `attempt` (see [`StreamMeta::tags`]); `None` for an attempt begun
    /// before tags existed, or one this journal never held.
    pub fn tag(&self, attempt: u32) -> Option<u32> {
        self.tags
            .get(tag_index(attempt)?)
            .copied()
            .filter(|t| *t != 0)
    }

    /// Records `tag` as the tag of `attempt`.
    pub(crate) fn set_tag(&mut self, attempt: u32, tag: u32) {
        let Some(index) = tag_index(attempt) else {
            return;
        };
        if self.tags.len() <= index {
            self.tags.resize(index + 1, 0);
        }
        self.tags[index] = tag;
    }
}

/// Where attempt `attempt` (1-based) sits in [`StreamMeta::tags`].
fn tag_index(attempt: u32) -> Option<usize> {
    usize::try_from(attempt.checked_sub(1)?).ok()
}

/// [`StreamMeta::tags`] as strings of 8 hex digits (`"00000000"`: none).
mod hex_tags {
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    pub(super) fn serialize<S: Serializer>(tags: &[u32], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(tags.iter().map(|t| format!("{t:08x}")))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|t| u32::from_str_radix(t, 16).map_err(D::Error::custom))
            .collect()
    }
}

/// A new attempt's tag (see [`StreamMeta::tags`]): random, never 0.
pub(crate) fn draw_tag() -> u32 {
    rand::random::<u32>().max(1)
}

impl StreamMeta {
    /// Where this stream's events are stored.
    pub(crate) fn events_at(&self) -> crate::store::keys::Events<'_> {
        crate::store::keys::Events::of(self.key.as_str(), self.events_slot)
    }
}

/// The journal's answer to `stream_begin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamBegin {
    /// Generate: events go under this attempt number. A stream whose previous attempt
    /// failed or was abandoned starts a fresh attempt (its half-received tool calls
    /// were never handed to the agent, so nothing repeats).
    New {
        attempt: u32,
        /// The attempt's tag (see [`StreamMeta::tags`]), which its event ids carry.
        tag: u32,
    },
    /// The stream exists and is completed (replay it) or still open in this process
    /// (attach to its journaled prefix and live tail).
    Existing { meta: StreamMeta },
    /// Same key, different request.
    Mismatch { meta: StreamMeta },
}

/// How events sit in the store: the events one `stream_append` took in share one
/// value, stored under the sequence number of the first.
///
/// A single event is stored as its raw bytes. Several are a chunk: a 0 byte (no SSE
/// event starts with one), the count, then each event as a big-endian `u32` length
/// and its bytes. Journals written before chunks existed hold only single events, so
/// they read unchanged.
pub(crate) mod chunk {
    use bytes::Bytes;

    use crate::Error;

    const MARK: u8 = 0;

    pub(crate) fn encode(events: &[Bytes]) -> Vec<u8> {
        if let [single] = events
            && single.first() != Some(&MARK)
        {
            return single.to_vec();
        }
        let body: usize = events.iter().map(|e| 4 + e.len()).sum();
        let mut out = Vec::with_capacity(5 + body);
        out.push(MARK);
        out.extend_from_slice(&len32(events.len()).to_be_bytes());
        for event in events {
            out.extend_from_slice(&len32(event.len()).to_be_bytes());
            out.extend_from_slice(event);
        }
        out
    }

    fn len32(n: usize) -> u32 {
        // Events and chunks are bounded far below 4 GiB by the stream size limit.
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// How many events the stored value holds.
    pub(crate) fn count(value: &[u8]) -> Result<u64, Error> {
        match value.first() {
            Some(&MARK) => Ok(u64::from(chunk_count(value)?)),
            _ => Ok(1),
        }
    }

    /// A chunk's count of events, no more than its bytes can hold (each event takes
    /// at least its 4-byte length): the count is read from the store, and a damaged
    /// one must not size an allocation.
    fn chunk_count(value: &[u8]) -> Result<u32, Error> {
        let count = read_u32(value, 1)?;
        if count as usize > value.len().saturating_sub(5) / 4 {
            return Err(corrupt("a chunk counts more events than its bytes hold"));
        }
        Ok(count)
    }

    /// The events of a stored value, numbered from `first_seq`; slices of `value`.
    pub(crate) fn decode(first_seq: u64, value: Bytes) -> Result<Vec<(u64, Bytes)>, Error> {
        if value.first() != Some(&MARK) {
            return Ok(vec![(first_seq, value)]);
        }
        let count = chunk_count(&value)?;
        let mut out = Vec::with_capacity(count as usize);
        let mut at = 5;
        for i in 0..u64::from(count) {
            let len = read_u32(&value, at)? as usize;
            let start = at + 4;
            let end = start
                .checked_add(len)
                .filter(|&end| end <= value.len())
                .ok_or_else(|| corrupt("an event runs past the end of its chunk"))?;
            let seq = first_seq
                .checked_add(i)
                .ok_or_else(|| corrupt("event numbers past the largest"))?;
            out.push((seq, value.slice(start..end)));
            at = end;
        }
        if at != value.len() {
            return Err(corrupt("bytes left over after the last event of a chunk"));
        }
        Ok(out)
    }

    fn read_u32(value: &[u8], at: usize) -> Result<u32, Error> {
        value
            .get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_be_bytes)
            .ok_or_else(|| corrupt("a chunk is cut short"))
    }

    fn corrupt(detail: &str) -> Error {
        Error::Decode {
            what: "stream events".to_owned(),
            detail: detail.to_owned(),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn events(raw: &[&'static str]) -> Vec<Bytes> {
            raw.iter()
                .map(|s| Bytes::from_static(s.as_bytes()))
                .collect()
        }

        #[test]
        fn a_single_event_is_stored_raw_and_reads_back() {
            let one = events(&["data: {\"a\":1}\n\n"]);
            let stored = encode(&one);
            assert_eq!(stored, b"data: {\"a\":1}\n\n");
            assert_eq!(count(&stored).unwrap(), 1);
            let back = decode(7, Bytes::from(stored)).unwrap();
            assert_eq!(back, vec![(7, one[0].clone())]);
        }

        #[test]
        fn several_events_round_trip_with_their_sequence_numbers() {
            let many = events(&["data: a\n\n", "", "event: x\ndata: b\n\n"]);
            let stored = encode(&many);
            assert_eq!(stored[0], MARK);
            assert_eq!(count(&stored).unwrap(), 3);
            let back = decode(10, Bytes::from(stored)).unwrap();
            let seqs: Vec<u64> = back.iter().map(|(s, _)| *s).collect();
            assert_eq!(seqs, vec![10, 11, 12]);
            let bodies: Vec<Bytes> = back.into_iter().map(|(_, b)| b).collect();
            assert_eq!(bodies, many);
        }

        #[test]
        fn a_single_event_that_starts_with_the_mark_is_chunked() {
            let odd = vec![Bytes::from_static(b"\0odd")];
            let stored = encode(&odd);
            assert_eq!(count(&stored).unwrap(), 1);
            assert_eq!(
                decode(0, Bytes::from(stored)).unwrap(),
                vec![(0, odd[0].clone())]
            );
        }

        #[test]
        fn a_damaged_chunk_is_an_error_not_a_short_stream() {
            let mut stored = encode(&events(&["data: a\n\n", "data: b\n\n"]));
            stored.truncate(stored.len() - 3);
            assert!(decode(0, Bytes::from(stored.clone())).is_err());
            stored.truncate(3);
            assert!(count(&stored).is_err());
            let mut long = encode(&events(&["data: a\n\n", "data: b\n\n"]));
            long.push(b'x');
            assert!(decode(0, Bytes::from(long)).is_err());
        }

        #[test]
        fn a_damaged_count_is_an_error_not_a_huge_allocation() {
            let mut huge = vec![MARK];
            huge.extend_from_slice(&u32::MAX.to_be_bytes());
            huge.extend_from_slice(&[0; 12]);
            assert!(count(&huge).is_err());
            assert!(decode(0, Bytes::from(huge)).is_err());
            // Three empty events are as many as 12 bytes can hold.
            let mut three = vec![MARK];
            three.extend_from_slice(&3u32.to_be_bytes());
            three.extend_from_slice(&[0; 12]);
            assert_eq!(count(&three).unwrap(), 3);
            assert_eq!(decode(0, Bytes::from(three.clone())).unwrap().len(), 3);
            // Numbered past the largest (a damaged key): an error, not a panic or a
            // wrapped number.
            let e = decode(u64::MAX - 1, Bytes::from(three)).expect_err("past the largest");
            assert!(e.to_string().contains("past the largest"), "{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `end` as the journal writes it, after checking it reads back the same.
    fn written(end: &StreamEnd) -> String {
        let text = serde_json::to_string(end).unwrap();
        assert_eq!(&serde_json::from_str::<StreamEnd>(&text).unwrap(), end);
        text
    }

    #[test]
    fn a_completed_end_says_continued_only_when_it_was() {
        let plain = StreamEnd::Completed {
            usage: serde_json::json!({"output_tokens": 3}),
            continued: 0,
        };
        assert_eq!(
            written(&plain),
            r#"{"end":"completed","usage":{"output_tokens":3}}"#,
            "written as before continuations existed"
        );
        let stitched = StreamEnd::Completed {
            usage: serde_json::Value::Null,
            continued: 2,
        };
        let text = written(&stitched);
        assert!(text.contains(r#""continued":2"#), "{text}");
    }

    #[test]
    fn an_abandoned_end_says_how_far_its_clients_got_only_when_the_journal_lost_events() {
        assert_eq!(
            written(&StreamEnd::abandoned("cut")),
            r#"{"end":"abandoned","reason":"cut"}"#,
            "written as before"
        );
        let holed = StreamEnd::Abandoned {
            reason: "lost".into(),
            sent_to: Some(41),
        };
        let text = written(&holed);
        assert!(text.contains(r#""sent_to":41"#), "{text}");
    }
}
