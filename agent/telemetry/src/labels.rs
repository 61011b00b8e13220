//! Bounded metric label values and the trace-id exemplar.
//!
//! Every free-form label value (model, tool, provider, target, error type, reason)
//! goes through an [`Interner`]: the values named in config are admitted up front, at
//! most `cap` more are learned as they appear, and everything after that is `_OTHER`.
//! A label value is an `Arc<str>`, so building a label set on the request path clones
//! reference counts and allocates nothing once a value is known.

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::sync::{Arc, PoisonError, RwLock};

use prometheus_client::encoding::{
    EncodeLabel, EncodeLabelSet, EncodeLabelValue, LabelSetEncoder, LabelValueEncoder,
};

use crate::names;

/// One label value, shared.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label(Arc<str>);

impl Label {
    pub fn new(value: &str) -> Self {
        Self(Arc::from(value))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl EncodeLabelValue for Label {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), fmt::Error> {
        encoder.write_str(&self.0)
    }
}

/// Maps raw values onto a bounded set of label values.
#[derive(Debug)]
pub struct Interner {
    known: RwLock<HashMap<Box<str>, Label>>,
    /// How many values may be learned beyond the configured ones.
    cap: usize,
    learned: std::sync::atomic::AtomicUsize,
    other: Label,
}

impl Interner {
    /// `allowed` are always kept (config-named models, tools, providers); at most `cap`
    /// further distinct values are learned, then the rest fold into `_OTHER`.
    pub fn new<'a>(allowed: impl IntoIterator<Item = &'a str>, cap: usize) -> Self {
        let known = allowed
            .into_iter()
            .map(|v| (Box::from(v), Label::new(v)))
            .collect();
        Self {
            known: RwLock::new(known),
            cap,
            learned: std::sync::atomic::AtomicUsize::new(0),
            other: Label::new(names::OTHER),
        }
    }

    /// The label value for `raw`. Known values cost one read lock and no allocation.
    pub fn get(&self, raw: &str) -> Label {
        if let Some(label) = self
            .known
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(raw)
        {
            return label.clone();
        }
        use std::sync::atomic::Ordering;
        if self.learned.load(Ordering::Relaxed) >= self.cap {
            return self.other.clone();
        }
        let mut known = self.known.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(label) = known.get(raw) {
            return label.clone();
        }
        if self.learned.load(Ordering::Relaxed) >= self.cap {
            return self.other.clone();
        }
        self.learned.fetch_add(1, Ordering::Relaxed);
        let label = Label::new(raw);
        known.insert(Box::from(raw), label.clone());
        label
    }

    pub fn other(&self) -> Label {
        self.other.clone()
    }
}

/// A W3C trace id (16 bytes), as carried on exemplars. `Copy`, so recording an
/// exemplar allocates nothing; it is written as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

impl TraceId {
    /// `None` for the all-zero (invalid) id.
    pub fn new(bytes: [u8; 16]) -> Option<Self> {
        (bytes != [0; 16]).then_some(Self(bytes))
    }

    pub fn from_hex(hex: &str) -> Option<Self> {
        if hex.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
            let hi = char::from(pair[0]).to_digit(16)?;
            let lo = char::from(pair[1]).to_digit(16)?;
            out[i] = u8::try_from(hi * 16 + lo).ok()?;
        }
        Self::new(out)
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceId({self})")
    }
}

struct Hex<'a>(&'a TraceId);

impl EncodeLabelValue for Hex<'_> {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), fmt::Error> {
        write!(encoder, "{}", self.0)
    }
}

/// The exemplar label set: `{trace_id="…"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceExemplar(pub TraceId);

impl EncodeLabelSet for TraceExemplar {
    fn encode(&self, encoder: &mut LabelSetEncoder<'_>) -> Result<(), fmt::Error> {
        (names::EXEMPLAR_TRACE_ID, Hex(&self.0)).encode(encoder.encode_label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interner_keeps_configured_values_and_caps_the_rest() {
        let interner = Interner::new(["gpt-4o"], 2);
        assert_eq!(interner.get("gpt-4o").as_str(), "gpt-4o");
        assert_eq!(interner.get("a").as_str(), "a");
        assert_eq!(interner.get("b").as_str(), "b");
        assert_eq!(interner.get("c").as_str(), names::OTHER);
        // Learned values stay learned; configured ones never fold.
        assert_eq!(interner.get("a").as_str(), "a");
        assert_eq!(interner.get("gpt-4o").as_str(), "gpt-4o");
    }

    #[test]
    fn trace_ids_round_trip_through_hex() {
        let id = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(
            id.map(|i| i.to_string()).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(TraceId::from_hex("00000000000000000000000000000000"), None);
        assert_eq!(TraceId::from_hex("xyz"), None);
    }
}
