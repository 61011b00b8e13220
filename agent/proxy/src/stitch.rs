//! Continuing an interrupted text-only stream at its provider and stitching the
//! continuation into the stream its agent is reading (Anthropic messages, opt-in
//! per provider with `continuation`).
//!
//! Anthropic has no server-side resume: a dropped stream is gone. Its recipe for
//! recovering one is a new request that carries the text already generated —
//! as the start of the assistant's message (prefill, Claude up to 4.5), or quoted
//! in a user message that asks the model to go on (Claude 4.6 and later). Only
//! text can be recovered so: a tool-use or thinking block cannot be continued, so
//! a turn that has begun one is never continued (it ends with the typed error
//! event, as without this module).
//!
//! The continuation's events are renumbered into the interrupted turn: its
//! `message_start` is dropped (the agent already has one), its first text block
//! becomes the rest of the text block that was open, and later blocks take the
//! indexes after those the agent has seen. What the agent reads is one message
//! with one terminal event; the journal holds it as it was sent, so a resume or a
//! replay returns the same bytes.

use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use http_body_util::Full;
use serde_json::Value;

use crate::events::{ReportedUsage, anthropic_input};
use crate::options::{Continuation, Provider};
use crate::sse;

/// What a generation needs to be continued.
pub(crate) struct Continuable {
    pub mode: Continuation,
    pub provider: Provider,
    /// The path the request was sent to, after the provider's base URL.
    pub suffix: &'static str,
    pub agent_headers: HeaderMap,
    /// The request as it was sent to `provider`.
    pub body: Bytes,
    /// Continuations left to this generation.
    pub left: u32,
}

/// A generation's continuation state: what its agent was sent, the continuation
/// now streaming, and the usage of the pieces before it.
pub(crate) struct Continuer {
    how: Continuable,
    sent: Sent,
    stitch: Option<Stitch>,
    /// What the pieces before the one streaming now consumed and generated.
    pub carried: ReportedUsage,
    /// Continuations taken.
    pub taken: u32,
}

impl Continuer {
    pub fn new(how: Continuable) -> Self {
        Self {
            how,
            sent: Sent::default(),
            stitch: None,
            carried: ReportedUsage::default(),
            taken: 0,
        }
    }

    /// The events the agent gets for one upstream event (renumbered when it comes
    /// from a continuation), and the usage a continuation's dropped
    /// `message_start` reported.
    pub fn take(&mut self, raw: Bytes) -> (Vec<Bytes>, Option<ReportedUsage>) {
        let (events, started) = match &mut self.stitch {
            Some(stitch) => stitch.map(raw),
            None => (vec![raw], None),
        };
        for ev in &events {
            self.sent.observe(ev);
        }
        (events, started)
    }

    /// Whether the turn can be continued: a continuation is left, the message has
    /// begun, and every block the agent saw (or that is held) is text.
    pub fn can_continue(&self) -> bool {
        self.how.left > 0 && self.sent.started && !self.sent.other_block
    }

    /// The upstream request that continues the turn, with `usage` (the piece that
    /// broke: its input, and its output if more than its text's estimate) added to
    /// what is carried.
    pub fn request(&self) -> Result<(Request<Full<Bytes>>, bool), crate::Error> {
        let piece = &self.sent.text[self.sent.piece_start..];
        let (body, trimmed) = continuation_body(
            &self.how.body,
            self.how.mode,
            &self.sent.text,
            estimate_tokens(piece) + self.carried.output,
        )
        .map_err(crate::Error::BuildRequest)?;
        let req = crate::model::build_request(
            &self.how.provider,
            self.how.suffix,
            Method::POST,
            &self.how.agent_headers,
            body,
        )?;
        Ok((req, trimmed))
    }

    /// Starts stitching the continuation that was just answered; `broke` is what
    /// the turn reported of the piece that broke.
    pub fn begin(&mut self, trimmed: bool, broke: Option<ReportedUsage>) {
        let piece = &self.sent.text[self.sent.piece_start..];
        let broke = broke.unwrap_or_default();
        self.carried.input += broke.input;
        self.carried.output += broke.output.max(estimate_tokens(piece));
        self.sent.piece_start = self.sent.text.len();
        self.stitch = Some(Stitch::new(&self.sent, trimmed));
        self.how.left -= 1;
        self.taken += 1;
    }

    /// The provider this generation continues at.
    pub fn provider(&self) -> &Provider {
        &self.how.provider
    }

    /// The turn's usage with what the pieces before the one streaming now
    /// consumed and generated (unchanged when no continuation was taken).
    pub fn with_carried(&self, usage: Option<ReportedUsage>) -> Option<ReportedUsage> {
        if self.taken == 0 {
            return usage;
        }
        let u = usage.unwrap_or_default();
        Some(ReportedUsage {
            input: u.input + self.carried.input,
            output: u.output + self.carried.output,
        })
    }
}

/// Output tokens estimated from text (4 bytes a token, as prompts are estimated).
fn estimate_tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4)
}

/// What the agent has been sent of the turn, by the agent's block indexes.
#[derive(Debug, Default)]
struct Sent {
    /// The text of every text block, in order.
    text: String,
    /// Where in `text` the piece streaming now began.
    piece_start: usize,
    /// The text block open now.
    open_text: Option<u64>,
    /// One past the highest block index.
    next_index: u64,
    /// A block that is not text (tool use, thinking) has begun.
    other_block: bool,
    /// `message_start` has come.
    started: bool,
}

impl Sent {
    fn observe(&mut self, raw: &[u8]) {
        let Some(v) = data(raw) else {
            return;
        };
        let index = v["index"].as_u64().unwrap_or(0);
        match v["type"].as_str() {
            Some("message_start") => self.started = true,
            Some("content_block_start") => {
                self.next_index = self.next_index.max(index + 1);
                let block = &v["content_block"];
                if block["type"] == "text" {
                    self.open_text = Some(index);
                    self.text
                        .push_str(block["text"].as_str().unwrap_or_default());
                } else {
                    self.other_block = true;
                }
            }
            Some("content_block_delta") if v["delta"]["type"] == "text_delta" => {
                self.text
                    .push_str(v["delta"]["text"].as_str().unwrap_or_default());
            }
            Some("content_block_stop") if self.open_text == Some(index) => self.open_text = None,
            _ => {}
        }
    }
}

/// An event's JSON data.
fn data(raw: &[u8]) -> Option<Value> {
    serde_json::from_str(&sse::parse(raw).data?).ok()
}

/// Renumbers a continuation's events into the turn the agent is reading.
#[derive(Debug)]
struct Stitch {
    /// The agent's text block the continuation's first block goes on with.
    joins: Option<u64>,
    /// The agent's index for the continuation's first block that does not join.
    next: u64,
    /// Whitespace was trimmed off the prefill: the continuation's leading
    /// whitespace goes (the agent already has it).
    strip_space: bool,
}

impl Stitch {
    fn new(sent: &Sent, trimmed: bool) -> Self {
        Self {
            joins: sent.open_text,
            next: sent.next_index,
            strip_space: trimmed,
        }
    }

    /// The agent's index for the continuation's block `k`.
    fn index(&self, k: u64) -> u64 {
        match self.joins {
            Some(j) if k == 0 => j,
            Some(_) => self.next + k - 1,
            None => self.next + k,
        }
    }

    fn map(&mut self, raw: Bytes) -> (Vec<Bytes>, Option<ReportedUsage>) {
        let parsed = sse::parse(&raw);
        let Some(mut v) = parsed
            .data
            .and_then(|d| serde_json::from_str::<Value>(&d).ok())
        else {
            return (vec![raw], None);
        };
        let name = parsed
            .event
            .or_else(|| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        let k = v["index"].as_u64().unwrap_or(0);
        match name.as_str() {
            "message_start" => {
                let usage = &v["message"]["usage"];
                let started = ReportedUsage {
                    input: anthropic_input(usage).unwrap_or(0),
                    output: usage["output_tokens"].as_u64().unwrap_or(0),
                };
                (Vec::new(), Some(started))
            }
            "content_block_start" => {
                let mut out = Vec::new();
                if let Some(j) = self.joins
                    && k == 0
                {
                    if v["content_block"]["type"] == "text" {
                        // The agent's open text block goes on.
                        return (Vec::new(), None);
                    }
                    // Not text after all: the open block ends where it was cut, and
                    // the new block takes the next index.
                    out.push(event(
                        "content_block_stop",
                        &serde_json::json!({"type": "content_block_stop", "index": j}),
                    ));
                    self.joins = None;
                    self.strip_space = false;
                }
                v["index"] = self.index(k).into();
                out.push(event(&name, &v));
                (out, None)
            }
            "content_block_delta" => {
                if self.strip_space && v["delta"]["type"] == "text_delta" {
                    let text = v["delta"]["text"].as_str().unwrap_or_default();
                    let rest = text.trim_start();
                    if rest.is_empty() {
                        return (Vec::new(), None);
                    }
                    self.strip_space = false;
                    v["delta"]["text"] = rest.into();
                }
                v["index"] = self.index(k).into();
                (vec![event(&name, &v)], None)
            }
            "content_block_stop" => {
                v["index"] = self.index(k).into();
                (vec![event(&name, &v)], None)
            }
            _ => (vec![raw], None),
        }
    }
}

/// A named SSE event as Anthropic frames them.
fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// The body of the request that continues a turn after `text`, with the request's
/// `max_tokens` less the `generated` tokens; and whether whitespace was trimmed
/// off the end of the prefill (the API refuses a prefill that ends in it).
fn continuation_body(
    body: &[u8],
    mode: Continuation,
    text: &str,
    generated: u64,
) -> Result<(Bytes, bool), String> {
    let mut v: Value = serde_json::from_slice(body)
        .map_err(|e| format!("the request to continue is not JSON: {e}"))?;
    if !v.is_object() {
        return Err("the request to continue is not a JSON object".into());
    }
    if let Some(max) = v["max_tokens"].as_u64() {
        v["max_tokens"] = max.saturating_sub(generated).max(1).into();
    }
    let Some(messages) = v["messages"].as_array_mut() else {
        return Err("the request to continue has no messages".into());
    };
    let kept = text.trim_end();
    let trimmed = kept.len() < text.len();
    if kept.is_empty() {
        // Nothing to carry on from: the same request again, for a fresh answer.
        return Ok((Bytes::from(v.to_string()), trimmed));
    }
    match mode {
        Continuation::Prefill => {
            match messages.last_mut() {
                // The agent prefilled the answer itself: the text goes on from it.
                Some(last) if last["role"] == "assistant" => match &mut last["content"] {
                    Value::String(s) => {
                        s.push_str(kept);
                    }
                    Value::Array(blocks) => {
                        blocks.push(serde_json::json!({"type": "text", "text": kept}));
                    }
                    other => *other = Value::String(kept.to_owned()),
                },
                _ => messages.push(serde_json::json!({"role": "assistant", "content": kept})),
            }
        }
        Continuation::Instruction => messages.push(serde_json::json!({
            "role": "user",
            "content": format!(
                "Your previous response was interrupted and ended with:\n\n{kept}\n\n\
                 Continue from exactly where it left off, without repeating any of it."
            ),
        })),
    }
    Ok((Bytes::from(v.to_string()), trimmed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn named(name: &str, data: Value) -> Bytes {
        event(name, &data)
    }

    fn text_start(i: u64) -> Bytes {
        named(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}),
        )
    }

    fn text_delta(i: u64, t: &str) -> Bytes {
        named(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": t}}),
        )
    }

    fn message_start(input: u64) -> Bytes {
        named(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_2", "usage": {"input_tokens": input, "output_tokens": 1}}}),
        )
    }

    fn continuer(mode: Continuation) -> Continuer {
        Continuer::new(Continuable {
            mode,
            provider: Provider {
                name: "a".into(),
                dialect: crate::options::Dialect::Anthropic,
                base_url: "http://127.0.0.1:9".parse().unwrap(),
                api_key: None,
                models: vec![crate::options::ModelPattern::Any],
                caps: crate::options::Capabilities::permissive(),
            },
            suffix: "/v1/messages",
            agent_headers: HeaderMap::new(),
            body: Bytes::from(
                json!({"model": "m", "max_tokens": 100, "stream": true,
                       "messages": [{"role": "user", "content": "hi"}]})
                .to_string(),
            ),
            left: 1,
        })
    }

    fn data_of(ev: &Bytes) -> Value {
        data(ev).unwrap()
    }

    #[test]
    fn a_continuation_goes_on_with_the_open_text_block_and_drops_its_message_start() {
        let mut c = continuer(Continuation::Prefill);
        for ev in [message_start(10), text_start(0), text_delta(0, "Hello, ")] {
            assert_eq!(c.take(ev).0.len(), 1);
        }
        assert!(c.can_continue());
        let (req, trimmed) = c.request().unwrap();
        assert!(trimmed, "the prefill cannot end in whitespace");
        let body: Value = serde_json::from_slice(req.body().clone().into_inner().unwrap().as_ref())
            .unwrap_or_default();
        assert_eq!(
            body["messages"][1],
            json!({"role": "assistant", "content": "Hello,"})
        );
        assert_eq!(body["max_tokens"], 98, "less the 2 tokens generated");
        c.begin(
            trimmed,
            Some(ReportedUsage {
                input: 10,
                output: 1,
            }),
        );
        assert!(!c.can_continue(), "one continuation was allowed");

        let (out, started) = c.take(message_start(14));
        assert!(out.is_empty());
        assert_eq!(
            started,
            Some(ReportedUsage {
                input: 14,
                output: 1
            })
        );
        assert!(c.take(text_start(0)).0.is_empty(), "the open block goes on");
        // The space the agent already has is not sent twice.
        assert!(c.take(text_delta(0, " ")).0.is_empty());
        let (out, _) = c.take(text_delta(0, " world"));
        assert_eq!(data_of(&out[0])["delta"]["text"], "world");
        assert_eq!(data_of(&out[0])["index"], 0);
        let (out, _) = c.take(named(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ));
        assert_eq!(data_of(&out[0])["index"], 0);
        let (out, _) = c.take(text_start(1));
        assert_eq!(data_of(&out[0])["index"], 1);
        let stop = named("message_stop", json!({"type": "message_stop"}));
        assert_eq!(c.take(stop.clone()).0, vec![stop], "passed on as it came");
        assert_eq!(c.sent.text, "Hello, world");
        assert_eq!(
            c.carried,
            ReportedUsage {
                input: 10,
                output: 2
            }
        );
    }

    #[test]
    fn a_continuation_after_a_closed_block_takes_the_next_index() {
        let mut c = continuer(Continuation::Instruction);
        for ev in [
            message_start(10),
            text_start(0),
            text_delta(0, "One."),
            named(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ),
        ] {
            c.take(ev);
        }
        let (req, trimmed) = c.request().unwrap();
        assert!(!trimmed);
        let body: Value =
            serde_json::from_slice(req.body().clone().into_inner().unwrap().as_ref()).unwrap();
        assert_eq!(body["messages"][1]["role"], "user");
        assert!(
            body["messages"][1]["content"]
                .as_str()
                .unwrap()
                .contains("\n\nOne.\n\n")
        );
        c.begin(trimmed, None);
        c.take(message_start(30));
        let (out, _) = c.take(text_start(0));
        assert_eq!(data_of(&out[0])["index"], 1);
        let (out, _) = c.take(text_delta(0, " Two."));
        assert_eq!(
            data_of(&out[0])["delta"]["text"],
            " Two.",
            "nothing was trimmed"
        );
    }

    #[test]
    fn a_continuation_that_opens_with_a_tool_call_closes_the_open_text_block_first() {
        let mut c = continuer(Continuation::Prefill);
        for ev in [
            message_start(10),
            text_start(0),
            text_delta(0, "Let me look"),
        ] {
            c.take(ev);
        }
        c.begin(false, None);
        let tool = named(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}}),
        );
        let (out, _) = c.take(tool);
        assert_eq!(out.len(), 2);
        assert_eq!(
            data_of(&out[0]),
            json!({"type": "content_block_stop", "index": 0})
        );
        assert_eq!(data_of(&out[1])["index"], 1);
        assert!(!c.can_continue());
    }

    #[test]
    fn a_turn_with_a_tool_call_or_thinking_is_not_continued() {
        for block in [
            json!({"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}),
            json!({"type": "thinking", "thinking": ""}),
        ] {
            let mut c = continuer(Continuation::Prefill);
            c.take(message_start(10));
            c.take(named(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0, "content_block": block}),
            ));
            assert!(!c.can_continue());
        }
        let mut c = continuer(Continuation::Prefill);
        assert!(
            !c.can_continue(),
            "nothing began: the attempt is retried instead"
        );
        c.take(message_start(10));
        assert!(c.can_continue());
    }

    #[test]
    fn an_agents_own_prefill_is_continued_and_empty_text_asks_again() {
        let body = json!({"model": "m", "max_tokens": 10, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Sure:"}]})
        .to_string();
        let (b, _) = continuation_body(body.as_bytes(), Continuation::Prefill, " yes", 3).unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["messages"][1]["content"], "Sure: yes");
        assert_eq!(v["messages"].as_array().unwrap().len(), 2);
        assert_eq!(v["max_tokens"], 7);
        let (b, trimmed) =
            continuation_body(body.as_bytes(), Continuation::Prefill, "\n", 0).unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            v["messages"][1]["content"], "Sure:",
            "nothing to carry on from"
        );
        assert!(trimmed);
        assert!(continuation_body(b"[]", Continuation::Prefill, "x", 0).is_err());
    }
}
