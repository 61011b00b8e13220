//! What the sidecar needs to know about a model request: the model, whether it
//! streams, whether it carries tools, images, audio or documents, and a token
//! estimate — read once from the agent's JSON without re-encoding it unless the
//! model must change.
//!
//! The request is skimmed into a typed summary that borrows from the body and skips
//! the prompt's text unbuilt; a request the skim does not fit (a field of another
//! type, a duplicated field) is read whole into a `serde_json::Value` instead, so
//! both paths mean the same and malformed JSON gets the parser's own message.

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;
use serde::Deserialize;
use serde::de::{self, IgnoredAny, SeqAccess, Visitor};
use serde_json::Value;

use outrigger_types::Modalities;

use crate::error::Error;
use crate::options::Dialect;

#[derive(Debug, Clone)]
pub struct ModelRequest {
    pub dialect: Dialect,
    pub model: String,
    pub stream: bool,
    pub has_tools: bool,
    pub modalities: Modalities,
    /// A rough prompt-size estimate, for budgets, the limiter and context checks:
    /// see [`estimate_prompt_tokens`].
    pub estimated_prompt_tokens: u64,
    /// `max_tokens` / `max_completion_tokens` if given.
    pub max_output_tokens: Option<u64>,
    pub body: Bytes,
}

impl ModelRequest {
    pub fn parse(dialect: Dialect, body: Bytes) -> Result<Self, Error> {
        // Only an object is skimmed: serde would also read a struct from an array.
        let object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        if object && let Ok(skim) = serde_json::from_slice::<Skim<'_>>(&body) {
            let Some(model) = skim.model.filter(|m| !m.is_empty()) else {
                return Err(no_model());
            };
            let model = model.into_owned();
            let mut modalities = Modalities::TEXT;
            for part in skim.messages.iter().flatten().flat_map(|m| &m.content.0) {
                modalities |= modality(part.kind.as_deref());
            }
            return Ok(Self {
                dialect,
                model,
                stream: skim.stream.unwrap_or(false),
                has_tools: skim.tools.is_some_and(|t| !t.is_empty()),
                modalities,
                estimated_prompt_tokens: estimate_prompt_tokens(&body),
                max_output_tokens: skim.max_completion_tokens.or(skim.max_tokens),
                body,
            });
        }
        Self::parse_whole(dialect, body)
    }

    /// Reads the request into a `Value`: what the skim means, for any JSON.
    fn parse_whole(dialect: Dialect, body: Bytes) -> Result<Self, Error> {
        let v: Value =
            serde_json::from_slice(&body).map_err(|e| Error::MalformedJson(e.to_string()))?;
        if !v.is_object() {
            return Err(Error::InvalidRequest(
                "The request body must be a JSON object.".into(),
            ));
        }
        let model = v["model"]
            .as_str()
            .filter(|m| !m.is_empty())
            .ok_or_else(no_model)?
            .to_string();
        let stream = v["stream"].as_bool().unwrap_or(false);
        let has_tools = v["tools"].as_array().is_some_and(|t| !t.is_empty());
        // Text always; other modalities from the content parts' types (OpenAI's and
        // Anthropic's names).
        let mut modalities = Modalities::TEXT;
        let parts = v["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|m| m["content"].as_array().into_iter().flatten());
        for part in parts {
            modalities |= modality(part["type"].as_str());
        }
        let max_output_tokens = v["max_completion_tokens"]
            .as_u64()
            .or_else(|| v["max_tokens"].as_u64());
        Ok(Self {
            dialect,
            model,
            stream,
            has_tools,
            modalities,
            estimated_prompt_tokens: estimate_prompt_tokens(&body),
            max_output_tokens,
            body,
        })
    }

    /// The body with `model` replaced (a downgrade or a fallback to another model).
    pub fn with_model(&self, model: &str) -> Bytes {
        if model == self.model {
            return self.body.clone();
        }
        match serde_json::from_slice::<Value>(&self.body) {
            // Only an object was accepted (`parse`); anything else goes as it came.
            Ok(mut v) => match v.as_object_mut() {
                Some(obj) => {
                    obj.insert("model".to_owned(), Value::String(model.to_string()));
                    Bytes::from(v.to_string())
                }
                None => self.body.clone(),
            },
            Err(_) => self.body.clone(),
        }
    }

    /// Output tokens to reserve: `max_tokens` when given, else a default.
    pub fn reserve_output_tokens(&self) -> u64 {
        self.max_output_tokens.unwrap_or(1_024)
    }
}

/// A payload string at least this long counts as binary: an image, audio or a
/// document (a shorter one is counted as text).
const PAYLOAD_MIN_BYTES: usize = 1_024;
/// What one image or audio payload is estimated at, whatever its size: about what
/// the providers charge for one large image (Anthropic's ~1,600 for 1.15 megapixels;
/// OpenAI's high detail stays below it).
const PAYLOAD_TOKENS: u64 = 1_600;
/// A PDF's decoded bytes per estimated token: about 3,000 tokens for a 100 KB page.
const PDF_BYTES_PER_TOKEN: u64 = 32;
/// The members whose value is a bare base64 payload: Anthropic's and OpenAI's
/// `source.data` / `input_audio.data`, OpenAI's `file.file_data`.
const PAYLOAD_KEYS: [&[u8]; 2] = [b"data", b"file_data"];

/// A prompt's size in tokens, roughly: a token per 4 bytes of its JSON, except that
/// base64 payloads count as [`PAYLOAD_TOKENS`] each (a PDF by its size): counted by
/// their bytes, a 1.5 MB image came to ~390,000 tokens and no budget admitted it. A
/// payload is a `data:…;base64,` URL, or the value of a [`PAYLOAD_KEYS`] member;
/// base64 anywhere else (a file a tool returned, in a message's text) is text to the
/// model, and counted as such.
pub fn estimate_prompt_tokens(body: &[u8]) -> u64 {
    let mut text_bytes = body.len();
    let mut payload_tokens = 0u64;
    let mut at = 0;
    // Walks the JSON strings; a backslash escapes the next byte.
    while let Some(open) = memchr::memchr(b'"', &body[at..]) {
        let quote = at + open;
        let start = quote + 1;
        let mut end = start;
        while let Some(next) = body
            .get(end..)
            .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
        {
            end += next;
            if body[end] == b'\\' {
                end += 2;
                continue;
            }
            break;
        }
        let end = end.min(body.len());
        let string = &body[start..end];
        if let Some(tokens) = payload(string, || member_of(body, quote)) {
            text_bytes -= string.len();
            payload_tokens = payload_tokens.saturating_add(tokens);
        }
        at = end + 1;
        if at >= body.len() {
            break;
        }
    }
    (text_bytes as u64 / 4)
        .max(1)
        .saturating_add(payload_tokens)
}

/// The name of the member whose value is the string opening at `quote`, if it is
/// one (`"name": "…"`).
fn member_of(body: &[u8], quote: usize) -> Option<&[u8]> {
    let before = body[..quote].trim_ascii_end();
    let before = before.strip_suffix(b":")?.trim_ascii_end();
    let before = before.strip_suffix(b"\"")?;
    let open = memchr::memrchr(b'"', before)?;
    Some(&before[open + 1..])
}

/// The tokens a JSON string's content is estimated at if it is a base64 payload;
/// `member` names the member it is the value of.
fn payload<'a>(string: &[u8], member: impl FnOnce() -> Option<&'a [u8]>) -> Option<u64> {
    if string.len() < PAYLOAD_MIN_BYTES {
        return None;
    }
    let data = match string.strip_prefix(b"data:") {
        Some(url) => {
            let head = &url[..url.len().min(256)];
            let comma = memchr::memmem::find(head, b";base64,")?;
            &url[comma + b";base64,".len()..]
        }
        None if member().is_some_and(|m| PAYLOAD_KEYS.contains(&m)) => string,
        None => return None,
    };
    // Base64, as some encoders write it: `\/` for `/`, `\n` where lines wrap.
    let base64 = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=' | b'\\');
    if data.len() < PAYLOAD_MIN_BYTES || !data.iter().all(base64) {
        return None;
    }
    // `%PDF` encodes as `JVBER`.
    Some(if data.starts_with(b"JVBER") {
        (data.len() as u64 * 3 / 4 / PDF_BYTES_PER_TOKEN).max(1)
    } else {
        PAYLOAD_TOKENS
    })
}

fn no_model() -> Error {
    Error::InvalidRequest("The request has no \"model\"; name the model to call.".into())
}

/// What a content part's type says about the modality it carries (OpenAI's and
/// Anthropic's names); text is always assumed.
fn modality(kind: Option<&str>) -> Modalities {
    match kind {
        Some("image_url" | "image" | "input_image") => Modalities::IMAGE,
        Some("input_audio" | "audio") => Modalities::AUDIO,
        Some("file" | "input_file" | "document") => Modalities::DOCUMENT,
        _ => Modalities::EMPTY,
    }
}

/// The fields of a request the skim keeps; serde skips the rest unbuilt.
#[derive(Deserialize)]
struct Skim<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    /// Only whether there are any: the elements are skipped unbuilt (and, being of
    /// a zero-sized type, take no memory).
    #[serde(default)]
    tools: Option<Vec<IgnoredAny>>,
    #[serde(borrow, default)]
    messages: Option<Vec<SkimMessage<'a>>>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    max_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct SkimMessage<'a> {
    #[serde(borrow, default)]
    content: Parts<'a>,
}

/// A message's content parts: none for plain-text (or null) content.
#[derive(Default)]
struct Parts<'a>(Vec<SkimPart<'a>>);

#[derive(Deserialize)]
struct SkimPart<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Parts<'a> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct PartsVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for PartsVisitor<'a> {
            type Value = Parts<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Parts::default())
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Parts::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(part) = seq.next_element()? {
                    parts.push(part);
                }
                Ok(Parts(parts))
            }
        }
        d.deserialize_any(PartsVisitor(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text counts by its bytes; an image by what a provider charges for one,
    /// whatever its size; a PDF by its size, far below its base64 length.
    #[test]
    fn base64_payloads_are_estimated_as_what_they_cost() {
        let text = "the quick brown fox ".repeat(5_000);
        let plain = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{text}"}}]}}"#);
        assert_eq!(
            estimate_prompt_tokens(plain.as_bytes()),
            plain.len() as u64 / 4
        );

        let image = "iVBORw0KGgo".repeat(150_000);
        let openai = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"what is it?"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{image}"}}}}]}}]}}"#
        );
        let estimate = estimate_prompt_tokens(openai.as_bytes());
        assert!(openai.len() > 1_600_000);
        assert!((1_600..1_700).contains(&estimate), "{estimate}");
        let anthropic = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{image}"}}}},{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{image}"}}}}]}}]}}"#
        );
        let estimate = estimate_prompt_tokens(anthropic.as_bytes());
        assert!((3_200..3_300).contains(&estimate), "{estimate}");

        let pdf = format!("JVBERi0x{}", "LjcKJeLjz9MK".repeat(10_000));
        let document = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"document","source":{{"type":"base64","media_type":"application/pdf","data":"{pdf}"}}}}]}}]}}"#
        );
        let estimate = estimate_prompt_tokens(document.as_bytes());
        let decoded = pdf.len() as u64 * 3 / 4;
        assert!(
            (decoded / 32..decoded / 32 + 100).contains(&estimate),
            "{estimate}"
        );
        // Escapes, unfinished strings and long words that are not base64 are text.
        for body in [
            br#"{"a":"x\"y","b":"\\"}"#.as_slice(),
            b"{\"a\":\"unfinished",
            b"{\"a\":\"ends in a backslash\\",
            b"\"",
        ] {
            assert_eq!(estimate_prompt_tokens(body), (body.len() as u64 / 4).max(1));
        }
        let word = format!(r#"{{"a":"{}"}}"#, "a-b".repeat(1_000));
        assert_eq!(
            estimate_prompt_tokens(word.as_bytes()),
            word.len() as u64 / 4
        );
        // Base64 that is not a payload (a file a tool returned, as text) is text.
        let as_text = format!(
            r#"{{"model":"m","messages":[{{"role":"tool","content":"{image}"}},{{"role":"user","content":[{{"type":"text","text":"{image}"}}]}}]}}"#
        );
        assert_eq!(
            estimate_prompt_tokens(as_text.as_bytes()),
            as_text.len() as u64 / 4
        );
        // An encoder that escapes `/` still writes a payload.
        let escaped = format!(
            r#"{{"type":"image","source":{{"type":"base64","data" : "{}"}}}}"#,
            r"ab\/c".repeat(1_000)
        );
        let estimate = estimate_prompt_tokens(escaped.as_bytes());
        assert!((1_600..1_700).contains(&estimate), "{estimate}");
    }

    #[test]
    fn reads_what_routing_needs() {
        let body = Bytes::from(
            r#"{"model":"gpt-4o","stream":true,"max_tokens":50,"tools":[{"type":"function"}],
               "messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        );
        let r = ModelRequest::parse(Dialect::OpenAi, body).unwrap();
        assert_eq!(r.model, "gpt-4o");
        assert!(r.stream && r.has_tools);
        assert_eq!(r.modalities, Modalities::TEXT | Modalities::IMAGE);
        assert_eq!(r.max_output_tokens, Some(50));
        let swapped: Value = serde_json::from_slice(&r.with_model("gpt-4o-mini")).unwrap();
        assert_eq!(swapped["model"], "gpt-4o-mini");
        assert_eq!(swapped["max_tokens"], 50);
        let pdf = Bytes::from(
            r#"{"model":"claude","messages":[{"role":"user","content":[{"type":"document","source":{}},{"type":"text","text":"sum up"}]}]}"#,
        );
        let pdf_request = ModelRequest::parse(Dialect::Anthropic, pdf).unwrap();
        assert_eq!(
            pdf_request.modalities,
            Modalities::TEXT | Modalities::DOCUMENT
        );
    }

    /// Every field the routing reads, compared between the two readers.
    fn same(body: &str) {
        let skimmed = ModelRequest::parse(Dialect::OpenAi, Bytes::from(body.to_owned()));
        let whole = ModelRequest::parse_whole(Dialect::OpenAi, Bytes::from(body.to_owned()));
        match (skimmed, whole) {
            (Ok(a), Ok(b)) => {
                assert_eq!(
                    (
                        &a.model,
                        a.stream,
                        a.has_tools,
                        a.modalities,
                        a.max_output_tokens
                    ),
                    (
                        &b.model,
                        b.stream,
                        b.has_tools,
                        b.modalities,
                        b.max_output_tokens
                    ),
                    "{body}"
                );
            }
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{body}"),
            (a, b) => panic!("{body}: skimmed {a:?}, whole {b:?}"),
        }
    }

    #[test]
    fn the_skim_and_the_whole_read_agree() {
        for body in [
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","stream":true,"tools":[],"max_tokens":7}"#,
            r#"{"model":"m","stream":null,"tools":null,"messages":null}"#,
            r#"{"model":"m","max_completion_tokens":3,"max_tokens":9}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio"},{"type":"file"},{"text":"no type"}]}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":null},{"role":"user"}]}"#,
            // Shapes the skim does not fit: read whole, same meaning.
            r#"{"model":"m","stream":"yes","tools":{"a":1}}"#,
            r#"{"model":"m","model":"n"}"#,
            r#"{"model":"m","messages":"text","max_tokens":-1}"#,
            r#"{"model":"m","messages":[{"content":{"type":"image"}}, 3]}"#,
            r#"{"model":"m","messages":[{"content":[{"type":7}]}]}"#,
            r#"{"model":7}"#,
            r#"{"model":""}"#,
            r#"["m", true]"#,
            r#" {"model":"m" "#,
        ] {
            same(body);
        }
    }

    #[test]
    fn refuses_what_it_cannot_route() {
        assert!(matches!(
            ModelRequest::parse(Dialect::OpenAi, Bytes::from("[1]")),
            Err(Error::InvalidRequest(_))
        ));
        assert!(matches!(
            ModelRequest::parse(Dialect::OpenAi, Bytes::from("{\"model\":\"\"}")),
            Err(Error::InvalidRequest(_))
        ));
        assert!(matches!(
            ModelRequest::parse(Dialect::OpenAi, Bytes::from("{")),
            Err(Error::MalformedJson(_))
        ));
    }
}
