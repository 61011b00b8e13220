//! The journal's decoders on arbitrary bytes. Shared by the `record_decode` fuzz
//! target and the corpus regression test (`tests/fuzz_corpus.rs`).
//!
//! A journal is read back after crashes, by other versions and by the offline
//! audit, so every persisted shape is decoded from bytes the reader did not write.
//! For each public persisted type (`Record`, `StreamMeta`, `LogEntry` and their
//! parts) and any input:
//! - decoding never panics (it may refuse);
//! - what decodes re-encodes, decodes back to an equal value, and re-encodes to the
//!   same bytes (the stored form is canonical, so digests in the hash chain are
//!   stable across a read-modify-write).
//!
//! The stored-format layer under these (sled keys and values) is private to the
//! crate, so the JSON decoders are what can be reached from outside.

use std::fmt::Debug;

use outrigger_journal::{
    Body, Headers, LogEntry, Record, RedactedRequest, StoredResponse, StreamEnd, StreamMeta,
    StreamRequest, Timestamp,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The types tried, by name; a corpus file named `valid-<name>-…` must decode as
/// that type.
pub const TYPES: &[&str] = &[
    "record",
    "stream-meta",
    "log-entry",
    "stored-response",
    "redacted-request",
    "stream-request",
    "stream-end",
    "headers",
    "body",
    "timestamp",
];

/// Runs every decoder on `input`; panics (a fuzz crash) when an invariant fails.
pub fn check(input: &[u8]) {
    for name in TYPES {
        decodes_as(name, input);
    }
}

/// Runs the decoder `name` on `input` and checks the round trip; whether it
/// decoded.
pub fn decodes_as(name: &str, input: &[u8]) -> bool {
    match name {
        "record" => round_trip::<Record>(input),
        "stream-meta" => round_trip::<StreamMeta>(input),
        "log-entry" => round_trip::<LogEntry>(input),
        "stored-response" => round_trip::<StoredResponse>(input),
        "redacted-request" => round_trip::<RedactedRequest>(input),
        "stream-request" => round_trip::<StreamRequest>(input),
        "stream-end" => round_trip::<StreamEnd>(input),
        "headers" => round_trip::<Headers>(input),
        "body" => round_trip::<Body>(input),
        "timestamp" => round_trip::<Timestamp>(input),
        other => panic!("no decoder named {other:?}"),
    }
}

fn round_trip<T>(input: &[u8]) -> bool
where
    T: DeserializeOwned + Serialize + PartialEq + Debug,
{
    let Ok(value) = serde_json::from_slice::<T>(input) else {
        return false;
    };
    let encoded = serde_json::to_vec(&value)
        .unwrap_or_else(|e| panic!("{value:?} decoded but does not encode: {e}"));
    let again: T = serde_json::from_slice(&encoded).unwrap_or_else(|e| {
        panic!(
            "{value:?} does not decode from its own encoding {:?}: {e}",
            String::from_utf8_lossy(&encoded)
        )
    });
    assert_eq!(again, value, "decode(encode(v)) == v");
    let twice = serde_json::to_vec(&again)
        .unwrap_or_else(|e| panic!("{again:?} does not encode a second time: {e}"));
    assert_eq!(
        twice,
        encoded,
        "the encoding is canonical: {:?}",
        String::from_utf8_lossy(&encoded)
    );
    true
}
