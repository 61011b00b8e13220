//! What the sidecar reads from a plain (non-streaming) model answer: its id, model
//! and reported usage, and, in a task, the tool calls it issued.
//!
//! Most answers are read for the first three only, so those are skimmed into a typed
//! summary that borrows from the answer and skips everything else without building
//! it; parsing whole answers into a `serde_json::Value` was about 6 % of the
//! sidecar's CPU per model call. An answer the skim does not fit (a field of another
//! type, a duplicated field) is read whole instead, so both paths mean the same.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;

use crate::keys::{self, IssuedCall};

/// What a plain answer said about itself.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Answer {
    pub id: Option<String>,
    pub model: Option<String>,
    /// Input and output tokens, when the provider reported both.
    pub usage: Option<(u64, u64)>,
    /// The tool calls the answer issued (read only when asked for).
    pub calls: Vec<IssuedCall>,
}

impl Answer {
    /// Reads an answer's bytes; `with_calls` also collects its tool calls.
    pub(crate) fn read(bytes: &[u8], with_calls: bool) -> Self {
        if !with_calls && let Ok(skim) = serde_json::from_slice::<Skim<'_>>(bytes) {
            let usage = skim.usage.unwrap_or_default();
            return Self {
                id: skim.id.map(Cow::into_owned),
                model: skim.model.map(Cow::into_owned),
                usage: usage
                    .prompt_tokens
                    .or(usage.input_tokens.map(|i| {
                        crate::events::with_cache(
                            i,
                            usage.cache_read_input_tokens,
                            usage.cache_creation_input_tokens,
                        )
                    }))
                    .zip(usage.completion_tokens.or(usage.output_tokens)),
                calls: Vec::new(),
            };
        }
        let v: Value = serde_json::from_slice(bytes).unwrap_or_default();
        Self::from_value(&v, with_calls)
    }

    /// Reads an answer already parsed whole.
    pub(crate) fn from_value(v: &Value, with_calls: bool) -> Self {
        let usage = &v["usage"];
        let input = usage["prompt_tokens"]
            .as_u64()
            .or_else(|| crate::events::anthropic_input(usage));
        let output = usage["completion_tokens"]
            .as_u64()
            .or_else(|| usage["output_tokens"].as_u64());
        Self {
            id: v["id"].as_str().map(str::to_owned),
            model: v["model"].as_str().map(str::to_owned),
            usage: input.zip(output),
            calls: if with_calls {
                keys::calls_in_response(v)
            } else {
                Vec::new()
            },
        }
    }
}

/// The fields of an answer the skim keeps; serde skips the rest unbuilt.
#[derive(Deserialize)]
struct Skim<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    usage: Option<SkimUsage>,
}

/// OpenAI's and Anthropic's names for the two counts.
#[derive(Deserialize, Default)]
struct SkimUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    /// Anthropic's prompt-cache counts, which its `input_tokens` leaves out.
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The skim and the whole read agree.
    fn both(bytes: &[u8]) -> Answer {
        let skimmed = Answer::read(bytes, false);
        let whole = Answer::from_value(&serde_json::from_slice(bytes).unwrap_or_default(), false);
        assert_eq!(skimmed, whole, "{}", String::from_utf8_lossy(bytes));
        skimmed
    }

    #[test]
    fn the_skim_reads_what_the_whole_answer_says() {
        let openai = both(
            br#"{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-4o",
                "choices":[{"index":0,"message":{"role":"assistant","content":"hi \"there\""},
                "finish_reason":"stop"}],
                "usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#,
        );
        assert_eq!(openai.id.as_deref(), Some("chatcmpl-1"));
        assert_eq!(openai.model.as_deref(), Some("gpt-4o"));
        assert_eq!(openai.usage, Some((12, 3)));
        let anthropic = both(
            br#"{"id":"msg_1","type":"message","model":"claude","content":[{"type":"text","text":"hi"}],
                "usage":{"input_tokens":7,"output_tokens":2,"cache_read_input_tokens":0}}"#,
        );
        assert_eq!(anthropic.usage, Some((7, 2)));
        assert_eq!(anthropic.id.as_deref(), Some("msg_1"));
        // Anthropic's input count leaves out what the prompt cache read and wrote.
        let cached = both(
            br#"{"id":"msg_2","type":"message","model":"claude","content":[],
                "usage":{"input_tokens":7,"output_tokens":2,"cache_read_input_tokens":900,
                "cache_creation_input_tokens":50}}"#,
        );
        assert_eq!(cached.usage, Some((957, 2)));
    }

    #[test]
    fn answers_the_skim_does_not_fit_are_read_whole_with_the_same_meaning() {
        for odd in [
            &br#"{"id":42,"model":"m","usage":{"prompt_tokens":1,"completion_tokens":2}}"#[..],
            br#"{"id":"a","id":"b","usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
            br#"{"id":"a","usage":{"prompt_tokens":1.5,"completion_tokens":2}}"#,
            br#"{"id":"a","usage":{"prompt_tokens":-1,"output_tokens":2}}"#,
            br#"{"id":"a","usage":"none"}"#,
            br#"{"id":"a","usage":null,"model":null}"#,
            br#"{"usage":{"completion_tokens":2}}"#,
            br#"[1,2]"#,
            br#"not json"#,
            br#""#,
        ] {
            both(odd);
        }
        assert_eq!(
            both(br#"{"id":42,"model":"m","usage":{"prompt_tokens":1,"completion_tokens":2}}"#),
            Answer {
                id: None,
                model: Some("m".into()),
                usage: Some((1, 2)),
                calls: Vec::new(),
            }
        );
    }

    #[test]
    fn tool_calls_are_read_only_when_asked_for() {
        let answer = br#"{"id":"c","choices":[{"message":{"tool_calls":[
            {"id":"call_1","type":"function","function":{"name":"pay","arguments":"{\"a\":1}"}}]}}],
            "usage":{"prompt_tokens":1,"completion_tokens":2}}"#;
        assert!(Answer::read(answer, false).calls.is_empty());
        let read = Answer::read(answer, true);
        assert_eq!(read.calls.len(), 1);
        assert_eq!(read.usage, Some((1, 2)));
    }
}
