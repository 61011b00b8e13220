//! Canonical JSON for fingerprints, written straight from a `serde_json::Value`.
//!
//! Fingerprints hash the canonical form of every journaled request, so its cost is
//! paid on every tool call and every journaled model call. The form is the one the
//! `serde_jcs` crate writes, which journals already hold fingerprints of: RFC 8785
//! (JCS), except that an object's keys are ordered by the bytes of their escaped,
//! quoted form rather than by UTF-16 code units. The two orders differ only for keys
//! holding control characters, a space, `!`, `"`, or characters from U+E000 up.
//! `serde_jcs` builds and sorts a buffer per object member; this writer sorts the
//! members and writes in one pass, and hands floats (which JCS prints as ECMAScript
//! does) back to `serde_jcs`. A test holds the two byte-identical.

use serde_json::Value;

/// Appends the canonical form of `value` to `out`. Returns false, with `out` holding
/// a partial write, where the value holds a float: the caller then uses `serde_jcs`.
pub(crate) fn write(value: &Value, out: &mut Vec<u8>) -> bool {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                out.extend_from_slice(itoa::Buffer::new().format(u).as_bytes());
            } else if let Some(i) = n.as_i64() {
                out.extend_from_slice(itoa::Buffer::new().format(i).as_bytes());
            } else {
                return false;
            }
        }
        Value::String(s) => string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                if !write(item, out) {
                    return false;
                }
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_unstable_by(|a, b| quoted(a.0).cmp(quoted(b.0)));
            out.push(b'{');
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                string(k, out);
                out.push(b':');
                if !write(v, out) {
                    return false;
                }
            }
            out.push(b'}');
        }
    }
    true
}

/// A JSON string as JCS (and ECMAScript's `JSON.stringify`) writes it: `"` and `\`
/// escaped, the five short control escapes, other control characters as `\u00xx`
/// in lower-case hex, everything else as it is.
pub(crate) fn string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let Some(escape) = escape(b) else { continue };
        out.extend_from_slice(&bytes[start..i]);
        out.extend_from_slice(escape.as_slice());
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// A key's bytes as [`string`] writes them, after the opening quote.
fn quoted(key: &str) -> impl Iterator<Item = u8> + '_ {
    key.bytes()
        .flat_map(|b| escape(b).unwrap_or(Escape::plain(b)))
        .chain(std::iter::once(b'"'))
}

/// The escape sequence for one byte of a string, if it needs one.
fn escape(b: u8) -> Option<Escape> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let short = |c: u8| Escape::new(&[b'\\', c]);
    Some(match b {
        b'"' => short(b'"'),
        b'\\' => short(b'\\'),
        0x08 => short(b'b'),
        0x09 => short(b't'),
        0x0a => short(b'n'),
        0x0c => short(b'f'),
        0x0d => short(b'r'),
        0x00..=0x1f => Escape::new(&[
            b'\\',
            b'u',
            b'0',
            b'0',
            HEX[usize::from(b >> 4)],
            HEX[usize::from(b & 0xf)],
        ]),
        _ => return None,
    })
}

/// Up to six bytes, iterated front to back.
#[derive(Clone, Copy)]
struct Escape {
    bytes: [u8; 6],
    len: u8,
    at: u8,
}

impl Escape {
    fn new(bytes: &[u8]) -> Self {
        let mut out = Self {
            bytes: [0; 6],
            len: 0,
            at: 0,
        };
        out.bytes[..bytes.len()].copy_from_slice(bytes);
        out.len = bytes.len() as u8;
        out
    }

    fn plain(b: u8) -> Self {
        Self::new(&[b])
    }

    fn as_slice(&self) -> &[u8] {
        &self.bytes[usize::from(self.at)..usize::from(self.len)]
    }
}

impl Iterator for Escape {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        let b = *self.as_slice().first()?;
        self.at += 1;
        Some(b)
    }
}

/// Parses JSON like `serde_json::from_slice::<Value>`, except that an object naming
/// a member twice is an error (`Category::Data`) instead of keeping the last one:
/// what a fingerprint is taken of must be what every reader of the bytes sees.
pub(crate) fn parse_unique(bytes: &[u8]) -> serde_json::Result<Value> {
    let Unique(value) = serde_json::from_slice(bytes)?;
    Ok(value)
}

/// A JSON value whose objects name each member once.
struct Unique(Value);

impl<'de> serde::Deserialize<'de> for Unique {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueVisitor).map(Unique)
    }
}

struct UniqueVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(Unique(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Unique(value) = map.next_value()?;
            match members.entry(key) {
                serde_json::map::Entry::Vacant(slot) => {
                    slot.insert(value);
                }
                serde_json::map::Entry::Occupied(taken) => {
                    return Err(serde::de::Error::custom(format_args!(
                        "the member {:?} appears twice in one object",
                        taken.key()
                    )));
                }
            }
        }
        Ok(Value::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Map, Number, json};

    use super::*;

    fn fast(value: &Value) -> Option<String> {
        let mut out = Vec::new();
        write(value, &mut out).then(|| String::from_utf8(out).expect("utf-8"))
    }

    fn jcs(value: &Value) -> String {
        String::from_utf8(serde_jcs::to_vec(value).expect("jcs")).expect("utf-8")
    }

    /// The same values as serde_json's own parse, and a member named twice refused.
    #[test]
    fn parse_unique_reads_what_serde_json_reads_and_refuses_a_member_named_twice() {
        for doc in [
            &br#"{"a":[1,-2,3.5,1e300,"x\u00e9",true,null,{}],"b":{"c":18446744073709551615}}"#[..],
            b"[]",
            b"\"s\"",
            b"0",
        ] {
            let theirs: Value = serde_json::from_slice(doc).expect("JSON");
            assert_eq!(parse_unique(doc).expect("unique"), theirs);
        }
        for doc in [&br#"{"a":1,"a":2}"#[..], br#"[{"x":{"b":1,"b":1}}]"#] {
            let err = parse_unique(doc).expect_err("a member twice");
            assert_eq!(err.classify(), serde_json::error::Category::Data, "{err}");
        }
        let err = parse_unique(b"{").expect_err("unfinished");
        assert_ne!(err.classify(), serde_json::error::Category::Data);
    }

    #[test]
    fn writes_what_jcs_writes() {
        let cases = [
            json!({"b": [1, -2, true, null], "a": {"z": "x\u{1}y\n\"\\/", "é": 0}}),
            json!("tab\there\u{7f}\u{1f}\u{8}\u{c}\r"),
            json!({"": [], "a": {}, "aa": [[]], "A": u64::MAX, "B": i64::MIN}),
            json!({"a!": 1, "a": 2, "a ": 3, "ab": 4, "\u{0}": 5, "\"": 6, "\\": 7, "\t": 8}),
            json!({"z": 1, "é": 2, "\u{e000}": 3, "😀": 4}),
            json!({"emoji": "😀 snow ☃", "\u{d7ff}x": 1, "ÿ": [-0]}),
        ];
        for case in cases {
            assert_eq!(fast(&case).as_deref(), Some(jcs(&case).as_str()), "{case}");
        }
    }

    #[test]
    fn hands_floats_back() {
        for case in [json!(1.5), json!({"a": [0.1]}), json!([1, -0.0])] {
            assert_eq!(fast(&case), None, "{case}");
        }
    }

    fn values() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|i| Value::Number(Number::from(i))),
            any::<u64>().prop_map(|u| Value::Number(Number::from(u))),
            any::<String>().prop_map(Value::String),
            "[\\x00-\\x7f]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec(
                    ("[a-c!\"\\\\ \\x00-\\x1f\\x7fé☃\u{e000}😀]{0,4}", inner),
                    0..6
                )
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
            ]
        })
    }

    proptest! {
        /// Wherever the fast writer answers, it answers exactly what `serde_jcs` does.
        #[test]
        fn agrees_with_serde_jcs(value in values()) {
            if let Some(fast) = fast(&value) {
                prop_assert_eq!(fast, jcs(&value));
            }
        }
    }
}
