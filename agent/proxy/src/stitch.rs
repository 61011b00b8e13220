//! Continuing an interrupted text-only stream at its provider and stitching the
//! continuation into the stream its agent is reading (opt-in per provider with
//! `continuation`: Anthropic messages by prefill or instruction, OpenAI chat
//! completions by instruction).
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
//!
//! OpenAI's chat completions take no prefill, so a turn there is continued by
//! instruction only. Its continuation's chunks are rewritten into the turn: the
//! chunk that only names the role is dropped, every chunk takes the interrupted
//! completion's `id`, `created`, `model` and `system_fingerprint`, and its usage
//! (asked for, so that the turn is metered) reaches the agent only if the agent
//! asked for usage itself. A turn of more than one choice (`n` > 1), or one that
//! has begun a tool call, a refusal, audio or reasoning, is never continued.

use std::sync::LazyLock;

use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use http_body_util::Full;
use memchr::memmem;
use serde_json::Value;

use crate::events::{ReportedUsage, anthropic_input};
use crate::model::request::estimate_prompt_tokens;
use crate::options::{Continuation, Dialect, Provider};
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
    stitch: Option<Stitcher>,
    /// What the pieces before the one streaming now consumed and generated.
    carried: ReportedUsage,
    /// Continuations taken.
    pub taken: u32,
    /// The estimated prompt of the continuation streaming now (`None`: the turn's
    /// own request is streaming), and of the one last requested.
    piece_prompt: Option<u64>,
    requested_prompt: u64,
}

impl Continuer {
    pub fn new(how: Continuable) -> Self {
        let sent = Sent {
            dialect: how.provider.dialect,
            ..Sent::default()
        };
        Self {
            how,
            sent,
            stitch: None,
            carried: ReportedUsage::default(),
            taken: 0,
            piece_prompt: None,
            requested_prompt: 0,
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
        self.how.left > 0 && self.sent.started && !self.sent.other_block && !self.structured()
    }

    /// Whether the agent's request asked for what a second answer would not go on
    /// with: several choices (only choice 0 is followed), or structured output
    /// (OpenAI's `response_format` other than text; Anthropic's `output_config.format`,
    /// or `output_format` of the beta): a continuation would start a new JSON
    /// document, not finish the first. Read only when a turn is to be continued.
    fn structured(&self) -> bool {
        let Ok(v) = serde_json::from_slice::<Value>(&self.how.body) else {
            return false;
        };
        match self.sent.dialect {
            Dialect::OpenAi => {
                v["n"].as_u64().is_some_and(|n| n > 1)
                    || !(v["response_format"].is_null() || v["response_format"]["type"] == "text")
            }
            Dialect::Anthropic => {
                !v["output_format"].is_null() || !v["output_config"]["format"].is_null()
            }
        }
    }

    /// Whether the agent's OpenAI request says `what` (`false` for Anthropic).
    fn agent_asked(&self, what: impl Fn(&Value) -> bool) -> bool {
        self.sent.dialect == Dialect::OpenAi
            && serde_json::from_slice::<Value>(&self.how.body).is_ok_and(|v| what(&v))
    }

    /// The upstream request that continues the turn, and whether whitespace was
    /// trimmed off the end of its prefill.
    pub fn request(&mut self) -> Result<(Request<Full<Bytes>>, bool), crate::Error> {
        let piece = self.sent.text(self.sent.piece_start);
        let (body, trimmed) = continuation_body(
            &self.how.body,
            self.how.provider.dialect,
            self.how.mode,
            &self.sent.text(0),
            estimate_tokens(&piece) + self.carried.output,
        )
        .map_err(crate::Error::BuildRequest)?;
        self.requested_prompt = estimate_prompt_tokens(&body);
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
    /// the turn reported of the piece that broke (OpenAI reports nothing before
    /// the end: its prompt is then estimated, at 4 bytes a token).
    pub fn begin(&mut self, trimmed: bool, broke: Option<ReportedUsage>) {
        let broke = self.broken_piece(broke);
        self.piece_prompt = Some(self.requested_prompt);
        self.carried.input += broke.input;
        self.carried.output += broke.output;
        self.sent.piece_start = self.sent.texts.len();
        self.stitch = Some(match self.sent.dialect {
            Dialect::Anthropic => Stitcher::Messages(Stitch::new(&self.sent, trimmed)),
            Dialect::OpenAi => Stitcher::Chat(ChatStitch {
                identity: self.sent.identity.clone(),
                agent_usage: self.agent_asked(|v| v["stream_options"]["include_usage"] == true),
                strip_space: trimmed,
            }),
        });
        self.how.left -= 1;
        self.taken += 1;
    }

    /// What the piece streaming now consumed and generated, counted as broken: its
    /// prompt as `reported`, else estimated (its request's, at 4 bytes a token);
    /// its text estimated if it reported less.
    fn broken_piece(&self, reported: Option<ReportedUsage>) -> ReportedUsage {
        let text = estimate_tokens(&self.sent.text(self.sent.piece_start));
        match reported {
            Some(r) => ReportedUsage {
                input: r.input,
                output: r.output.max(text),
            },
            None => ReportedUsage {
                input: self
                    .piece_prompt
                    .unwrap_or_else(|| estimate_prompt_tokens(&self.how.body)),
                output: text,
            },
        }
    }

    /// The provider this generation continues at.
    pub fn provider(&self) -> &Provider {
        &self.how.provider
    }

    /// The turn's usage with what the pieces before the one streaming now
    /// consumed and generated (unchanged when no continuation was taken).
    ///
    /// A continuation that did not reach its terminal event (`whole` false), or
    /// reported no usage, is counted as a piece that broke: its prompt as reported
    /// or estimated, its text estimated if it reported less.
    pub fn with_carried(&self, usage: Option<ReportedUsage>, whole: bool) -> Option<ReportedUsage> {
        if self.taken == 0 {
            return usage;
        }
        let u = match usage {
            Some(u) if whole => u,
            // Unreported (a server that ignores `include_usage`) is estimated too.
            _ => self.broken_piece(usage),
        };
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

/// Block indexes past this are not renumbered: a turn that has one is not continued.
const MAX_BLOCKS: u64 = 1 << 20;

/// What the agent has been sent of the turn, by the agent's block indexes.
#[derive(Debug)]
struct Sent {
    dialect: Dialect,
    /// The events that carry text (text deltas, and the starts of text blocks that
    /// open with some), in order: their text is read only when a continuation
    /// needs it, so a turn that never breaks is not parsed twice.
    texts: Vec<Bytes>,
    /// Where in `texts` the piece streaming now began.
    piece_start: usize,
    /// The text block open now.
    open_text: Option<u64>,
    /// One past the highest block index.
    next_index: u64,
    /// A block that is not text (tool use, thinking) has begun, or one whose index
    /// is past [`MAX_BLOCKS`].
    other_block: bool,
    /// `message_start` has come (OpenAI: the first chunk).
    started: bool,
    /// OpenAI: the members that name the completion (`id`, `created`, `model`,
    /// `system_fingerprint`), as its first chunk had them.
    identity: Vec<(String, Value)>,
}

impl Default for Sent {
    fn default() -> Self {
        Self {
            dialect: Dialect::Anthropic,
            texts: Vec::new(),
            piece_start: 0,
            open_text: None,
            next_index: 0,
            other_block: false,
            started: false,
            identity: Vec::new(),
        }
    }
}

/// Whether a member of an OpenAI delta says something (not null, `""` or `[]`).
fn filled(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        _ => true,
    }
}

/// The members of an OpenAI chunk that name its completion.
const IDENTITY: [&str; 4] = ["id", "created", "model", "system_fingerprint"];

/// The markers of the events [`Sent`] reads at once.
static STRUCTURE: LazyLock<[memmem::Finder<'static>; 3]> = LazyLock::new(|| {
    [
        memmem::Finder::new(b"message_start"),
        memmem::Finder::new(b"content_block_start"),
        memmem::Finder::new(b"content_block_stop"),
    ]
});
static TEXT_DELTA: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"text_delta\""));
/// The members of an OpenAI delta that are not text: a chunk that names one is read.
static CHAT_OTHER: LazyLock<[memmem::Finder<'static>; 8]> = LazyLock::new(|| {
    [
        // Typed parts: content that is not a string, a tool call.
        memmem::Finder::new(b"\"type\""),
        memmem::Finder::new(b"\"thinking\""),
        memmem::Finder::new(b"\"annotations\""),
        memmem::Finder::new(b"\"tool_calls\""),
        memmem::Finder::new(b"\"function_call\""),
        memmem::Finder::new(b"\"refusal\""),
        memmem::Finder::new(b"\"reasoning"),
        memmem::Finder::new(b"\"audio\""),
    ]
});
static CHAT_CONTENT: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"content\""));

impl Sent {
    fn observe(&mut self, raw: &Bytes) {
        if self.dialect == Dialect::OpenAi {
            return self.observe_chunk(raw);
        }
        // Only the few events that may open or close something are read now; of the
        // rest, a text delta is kept as it is (read when a continuation needs its
        // text: an event that only looks like one then gives none).
        if STRUCTURE.iter().all(|m| m.find(raw).is_none()) {
            if TEXT_DELTA.find(raw).is_some() {
                self.texts.push(raw.clone());
            }
            return;
        }
        let Some((name, v)) = named_data(raw) else {
            return;
        };
        let index = v["index"].as_u64();
        match name.as_str() {
            "message_start" => self.started = true,
            "content_block_delta" if v["delta"]["type"] == "text_delta" => {
                self.texts.push(raw.clone());
            }
            "content_block_start" => {
                let Some(index) = index.filter(|i| *i < MAX_BLOCKS) else {
                    self.other_block = true;
                    return;
                };
                self.next_index = self.next_index.max(index + 1);
                let block = &v["content_block"];
                if block["type"] == "text" {
                    self.open_text = Some(index);
                    if block["text"].as_str().is_some_and(|t| !t.is_empty()) {
                        self.texts.push(raw.clone());
                    }
                } else {
                    self.other_block = true;
                }
            }
            "content_block_stop" if self.open_text == index => self.open_text = None,
            _ => {}
        }
    }

    /// An OpenAI chunk: the first is read for the completion's names; one that
    /// may carry something other than text is read to see whether it does.
    fn observe_chunk(&mut self, raw: &Bytes) {
        if self.started && CHAT_OTHER.iter().all(|m| m.find(raw).is_none()) {
            if CHAT_CONTENT.find(raw).is_some() {
                self.texts.push(raw.clone());
            }
            return;
        }
        let Some((_, v)) = named_data(raw) else {
            return;
        };
        let choices = v["choices"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        if !self.started && !choices.is_empty() {
            // The first chunk of the completion (Azure's opens with one of
            // `prompt_filter_results`, with no choice and blank names).
            self.started = true;
            self.identity = IDENTITY
                .iter()
                .map(|k| (k.to_string(), v.get(*k).cloned().unwrap_or(Value::Null)))
                .collect();
        }
        for choice in choices {
            let delta = &choice["delta"];
            let content = &delta["content"];
            let other = choice["index"].as_u64() != Some(0)
                // Content that is not a string is not text (Mistral's thinking).
                || !(content.is_null() || content.is_string())
                || delta.as_object().is_some_and(|d| {
                    d.iter()
                        .any(|(k, v)| !matches!(k.as_str(), "role" | "content") && filled(v))
                });
            if other {
                self.other_block = true;
            }
            if content.as_str().is_some_and(|t| !t.is_empty()) {
                self.texts.push(raw.clone());
            }
        }
    }

    /// The text of `texts` from `from` on.
    fn text(&self, from: usize) -> String {
        let mut out = String::new();
        for raw in &self.texts[from..] {
            if let Some((_, v)) = named_data(raw) {
                let text = match self.dialect {
                    Dialect::OpenAi => v["choices"]
                        .as_array()
                        .and_then(|c| c.iter().find(|c| c["index"] == 0))
                        .and_then(|c| c["delta"]["content"].as_str()),
                    Dialect::Anthropic => v["delta"]["text"]
                        .as_str()
                        .or_else(|| v["content_block"]["text"].as_str()),
                };
                out.push_str(text.unwrap_or_default());
            }
        }
        out
    }
}

/// The error type of a provider's error event (Anthropic's `event: error`, an
/// OpenAI chunk with an `error`); `None` for any other event.
pub(crate) fn error_type(raw: &[u8]) -> Option<String> {
    let (name, v) = named_data(raw)?;
    let error = &v["error"];
    // As the gate reads a chunk: one that has an `error` member is an error.
    (name == "error" || v.get("error").is_some()).then(|| {
        error["type"]
            .as_str()
            .or_else(|| error.as_str())
            .unwrap_or("unknown")
            .to_owned()
    })
}

/// An event's name (its `event:` line, else its data's `type`) and its data, when
/// that is a JSON object.
fn named_data(raw: &[u8]) -> Option<(String, Value)> {
    let parsed = sse::parse(raw);
    let v: Value = serde_json::from_str(&parsed.data?).ok()?;
    if !v.is_object() {
        return None;
    }
    let name = parsed
        .event
        .or_else(|| v["type"].as_str().map(str::to_owned))
        .unwrap_or_default();
    Some((name, v))
}

/// Rewrites a continuation's events into the turn the agent is reading, in the
/// provider's dialect.
#[derive(Debug)]
enum Stitcher {
    Messages(Stitch),
    Chat(ChatStitch),
}

impl Stitcher {
    fn map(&mut self, raw: Bytes) -> (Vec<Bytes>, Option<ReportedUsage>) {
        match self {
            Self::Messages(s) => s.map(raw),
            Self::Chat(s) => s.map(raw),
        }
    }
}

/// Renumbers a continuation's events into the Anthropic turn the agent is reading.
#[derive(Debug)]
struct Stitch {
    /// The agent's text block the continuation's first block goes on with.
    joins: Option<u64>,
    /// The agent's index for the continuation's first block that does not join.
    next: u64,
    /// Whitespace was trimmed off the prefill: the continuation's leading
    /// whitespace goes (the agent already has it).
    strip_space: bool,
    /// The agent's open text block, until the continuation's first block starts:
    /// a continuation with no block at all closes it before it ends the message.
    unclosed: Option<u64>,
}

impl Stitch {
    fn new(sent: &Sent, trimmed: bool) -> Self {
        Self {
            joins: sent.open_text,
            next: sent.next_index,
            strip_space: trimmed,
            unclosed: sent.open_text,
        }
    }

    /// The stop of the agent's open text block, when the continuation ends its
    /// message without a block of its own.
    fn close_unclosed(&mut self) -> Option<Bytes> {
        self.unclosed.take().map(|j| {
            event(
                "content_block_stop",
                &serde_json::json!({"type": "content_block_stop", "index": j}),
            )
        })
    }

    /// The agent's index for the continuation's block `k`.
    fn index(&self, k: u64) -> u64 {
        match self.joins {
            Some(j) if k == 0 => j,
            Some(_) => self.next.saturating_add(k - 1),
            None => self.next.saturating_add(k),
        }
    }

    fn map(&mut self, raw: Bytes) -> (Vec<Bytes>, Option<ReportedUsage>) {
        // What is not a JSON object passes as it came (the gate judges it).
        let Some((name, mut v)) = named_data(&raw) else {
            return (vec![raw], None);
        };
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
                let text = v["content_block"]["type"] == "text";
                if k == 0 {
                    self.unclosed = None;
                }
                if let Some(j) = self.joins
                    && k == 0
                {
                    if text {
                        // The agent's open text block goes on, with what text its
                        // start carries (usually none) as a delta of it.
                        let opening = v["content_block"]["text"].as_str().unwrap_or_default();
                        return match self.without_space(opening) {
                            Some(t) => (
                                vec![event(
                                    "content_block_delta",
                                    &serde_json::json!({"type": "content_block_delta", "index": j,
                                        "delta": {"type": "text_delta", "text": t}}),
                                )],
                                None,
                            ),
                            None => (Vec::new(), None),
                        };
                    }
                    // Not text after all: the open block ends where it was cut, and
                    // the new block takes the next index.
                    out.push(event(
                        "content_block_stop",
                        &serde_json::json!({"type": "content_block_stop", "index": j}),
                    ));
                    self.joins = None;
                }
                if !text {
                    // The whitespace to drop was the text's, which goes on no more.
                    self.strip_space = false;
                } else if let Some(opening) = v["content_block"]["text"]
                    .as_str()
                    .filter(|t| !t.is_empty())
                    .map(str::to_owned)
                {
                    let kept = self.without_space(&opening).unwrap_or_default();
                    v["content_block"]["text"] = kept.into();
                }
                v["index"] = self.index(k).into();
                out.push(event(&name, &v));
                (out, None)
            }
            "content_block_delta" => {
                if self.strip_space && v["delta"]["type"] == "text_delta" {
                    let text = v["delta"]["text"].as_str().unwrap_or_default();
                    let Some(rest) = self.without_space(text) else {
                        return (Vec::new(), None);
                    };
                    v["delta"]["text"] = rest.into();
                }
                v["index"] = self.index(k).into();
                (vec![event(&name, &v)], None)
            }
            "content_block_stop" => {
                v["index"] = self.index(k).into();
                (vec![event(&name, &v)], None)
            }
            "message_delta" | "message_stop" => {
                let mut out: Vec<Bytes> = self.close_unclosed().into_iter().collect();
                out.push(raw);
                (out, None)
            }
            _ => (vec![raw], None),
        }
    }
}

impl Stitch {
    fn without_space(&mut self, text: &str) -> Option<String> {
        unspaced(&mut self.strip_space, text)
    }
}

/// `text` without the leading whitespace the agent already has (while `strip` is
/// set, which the first text left clears); `None` when nothing is left of it.
fn unspaced(strip: &mut bool, text: &str) -> Option<String> {
    let rest = if *strip { text.trim_start() } else { text };
    if rest.is_empty() {
        return None;
    }
    *strip = false;
    Some(rest.to_owned())
}

/// Rewrites a continuation's chunks into the OpenAI completion the agent is
/// reading.
#[derive(Debug)]
struct ChatStitch {
    /// The interrupted completion's names, which every chunk takes.
    identity: Vec<(String, Value)>,
    /// The agent asked for the usage chunk: it is passed on (else dropped, its
    /// usage counted).
    agent_usage: bool,
    /// Whitespace was trimmed off the quoted text: the continuation's leading
    /// whitespace goes.
    strip_space: bool,
}

impl ChatStitch {
    fn map(&mut self, raw: Bytes) -> (Vec<Bytes>, Option<ReportedUsage>) {
        // What is not a JSON object (`[DONE]`) passes as it came.
        let Some((_, mut v)) = named_data(&raw) else {
            return (vec![raw], None);
        };
        let Some(chunk) = v.as_object_mut() else {
            return (vec![raw], None);
        };
        // The completion's names, as the agent has them; one its first chunk did
        // not have is not shown either.
        for (k, value) in &self.identity {
            if value.is_null() {
                chunk.remove(k);
            } else if chunk.contains_key(k) {
                chunk.insert(k.clone(), value.clone());
            }
        }
        let usage = chunk
            .get("usage")
            .filter(|u| u.is_object())
            .map(|u| ReportedUsage {
                input: u["prompt_tokens"].as_u64().unwrap_or(0),
                output: u["completion_tokens"].as_u64().unwrap_or(0),
            });
        if !self.agent_usage {
            // Asked for on the agent's behalf: not shown to it.
            chunk.remove("usage");
        }
        let mut keep = (self.agent_usage && usage.is_some()) || chunk.contains_key("error");
        let strip = &mut self.strip_space;
        for choice in chunk
            .get_mut("choices")
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            if !choice["finish_reason"].is_null() {
                keep = true;
            }
            let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) else {
                keep = true;
                continue;
            };
            // The agent has the role: the continuation's message goes on with it.
            delta.remove("role");
            if let Some(text) = delta.get("content").and_then(Value::as_str) {
                match unspaced(strip, text) {
                    Some(rest) => {
                        delta.insert("content".into(), rest.into());
                        keep = true;
                    }
                    None => {
                        delta.remove("content");
                    }
                }
            }
            if delta.values().any(filled) {
                keep = true;
            }
        }
        let started = usage.filter(|_| !self.agent_usage);
        if !keep {
            return (Vec::new(), started);
        }
        (vec![Bytes::from(format!("data: {v}\n\n"))], started)
    }
}

/// A named SSE event as Anthropic frames them.
fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// The body of the request that continues a turn after `text`, with the request's
/// `max_tokens` (and OpenAI's `max_completion_tokens`) less the `generated`
/// tokens; and whether whitespace was trimmed off the end of the prefill (the API
/// refuses a prefill that ends in it). An OpenAI continuation asks for its usage,
/// so that the turn is metered.
fn continuation_body(
    body: &[u8],
    dialect: Dialect,
    mode: Continuation,
    text: &str,
    generated: u64,
) -> Result<(Bytes, bool), String> {
    let mut v: Value = serde_json::from_slice(body)
        .map_err(|e| format!("the request to continue is not JSON: {e}"))?;
    if !v.is_object() {
        return Err("the request to continue is not a JSON object".into());
    }
    for limit in ["max_tokens", "max_completion_tokens"] {
        if let Some(max) = v[limit].as_u64() {
            v[limit] = max.saturating_sub(generated).max(1).into();
        }
    }
    if dialect == Dialect::OpenAi {
        if !v["stream_options"].is_object() {
            v["stream_options"] = serde_json::json!({});
        }
        v["stream_options"]["include_usage"] = true.into();
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
        // OpenAI's chat completions do not continue a prefill (configuration
        // refuses it there): they are asked.
        Continuation::Prefill if dialect == Dialect::Anthropic => {
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
        Continuation::Prefill | Continuation::Instruction => messages.push(serde_json::json!({
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
    use proptest::prelude::*;
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
        continuer_of(
            mode,
            json!({"model": "m", "max_tokens": 100, "stream": true,
                   "messages": [{"role": "user", "content": "hi"}]}),
        )
    }

    /// An Anthropic continuer of the agent's request `body`.
    fn continuer_of(mode: Continuation, body: Value) -> Continuer {
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
            body: Bytes::from(body.to_string()),
            left: 1,
        })
    }

    /// A continuer begun after a closed text block `"Hi "`, its prefill trimmed.
    fn continuing_after_a_closed_block() -> Continuer {
        let mut c = continuer(Continuation::Prefill);
        let stop = named(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        );
        for ev in [message_start(10), text_start(0), text_delta(0, "Hi "), stop] {
            c.take(ev);
        }
        c.begin(true, None);
        c
    }

    fn data_of(ev: &Bytes) -> Value {
        named_data(ev).unwrap().1
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
        assert_eq!(c.sent.text(0), "Hello, world");
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
    fn an_anthropic_turn_with_structured_output_is_not_continued() {
        let schema = json!({"type": "json_schema", "schema": {"type": "object"}});
        let base = json!({"model": "m", "max_tokens": 100, "stream": true,
                          "messages": [{"role": "user", "content": "hi"}]});
        for (member, value) in [
            ("output_config", json!({"format": schema})),
            ("output_format", schema.clone()),
        ] {
            let mut body = base.clone();
            body[member] = value.clone();
            let mut c = continuer_of(Continuation::Instruction, body);
            c.take(message_start(10));
            c.take(text_start(0));
            c.take(text_delta(0, "{\"a\": "));
            assert!(!c.can_continue(), "{member}: {value}");
        }
        // Other output settings (effort) leave a text turn continuable.
        let mut body = base;
        body["output_config"] = json!({"effort": "low"});
        let mut c = continuer_of(Continuation::Instruction, body);
        c.take(message_start(10));
        c.take(text_start(0));
        c.take(text_delta(0, "Hi"));
        assert!(c.can_continue());
    }

    #[test]
    fn a_block_start_that_mentions_text_delta_is_still_a_block_start() {
        let mut c = continuer(Continuation::Prefill);
        c.take(message_start(10));
        c.take(named(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "tool_use", "id": "t", "name": "text_delta", "input": {}}}),
        ));
        assert!(!c.can_continue(), "a tool call began");
        // A text delta that names the markers in its text is still text.
        let mut c = continuer(Continuation::Prefill);
        for ev in [
            message_start(10),
            text_start(0),
            text_delta(0, "content_block_stop and message_start "),
        ] {
            c.take(ev);
        }
        assert!(c.can_continue());
        assert_eq!(c.sent.text(0), "content_block_stop and message_start ");
        assert_eq!(c.sent.open_text, Some(0));
    }

    #[test]
    fn odd_events_neither_panic_nor_pass_for_text() {
        let mut c = continuer(Continuation::Prefill);
        c.take(message_start(10));
        // A block with an absurd index is not renumbered: the turn is not continued.
        let huge = named(
            "content_block_start",
            json!({"type": "content_block_start", "index": u64::MAX, "content_block": {"type": "text"}}),
        );
        c.take(huge);
        assert!(!c.can_continue());
        // A thinking block named by its `event:` line only still counts.
        let mut c = continuer(Continuation::Prefill);
        c.take(message_start(10));
        c.take(Bytes::from(
            "event: content_block_start\ndata: {\"index\":0,\"content_block\":{\"type\":\"thinking\"}}\n\n",
        ));
        assert!(!c.can_continue());
        // Data that is no JSON object passes through a stitch as it came.
        let mut c = continuer(Continuation::Prefill);
        c.take(message_start(10));
        c.begin(false, None);
        for odd in [
            "event: content_block_stop\ndata: []\n\n",
            "event: ping\ndata: 0\n\n",
        ] {
            let raw = Bytes::from_static(odd.as_bytes());
            assert_eq!(c.take(raw.clone()).0, vec![raw]);
        }
    }

    #[test]
    fn trimmed_whitespace_is_dropped_once_and_only_from_text() {
        // The open block's start carries text: it goes on as a delta, unspaced.
        let mut c = continuer(Continuation::Prefill);
        for ev in [message_start(10), text_start(0), text_delta(0, "Hi ")] {
            c.take(ev);
        }
        c.begin(true, None);
        let start = named(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": "  there"}}),
        );
        let (out, _) = c.take(start);
        assert_eq!(data_of(&out[0])["delta"]["text"], "there");
        assert_eq!(data_of(&out[0])["index"], 0);
        let (out, _) = c.take(text_delta(0, " again"));
        assert_eq!(data_of(&out[0])["delta"]["text"], " again", "once only");
        // A tool call first: the text after it keeps its space.
        let mut c = continuing_after_a_closed_block();
        c.take(named(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}}),
        ));
        c.take(text_start(1));
        let (out, _) = c.take(text_delta(1, " after"));
        assert_eq!(data_of(&out[0])["delta"]["text"], " after");
        assert_eq!(data_of(&out[0])["index"], 2);
        // A new text block that opens with text: that text is unspaced.
        let mut c = continuing_after_a_closed_block();
        let (out, _) = c.take(named(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": " x"}}),
        ));
        assert_eq!(data_of(&out[0])["content_block"]["text"], "x");
        assert_eq!(data_of(&out[0])["index"], 1);
        let (out, _) = c.take(text_delta(0, " y"));
        assert_eq!(data_of(&out[0])["delta"]["text"], " y");
    }

    #[test]
    fn an_error_event_is_told_apart() {
        let error = named(
            "error",
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        );
        assert_eq!(error_type(&error).as_deref(), Some("overloaded_error"));
        assert_eq!(error_type(&message_start(1)), None);
    }

    #[test]
    fn an_agents_own_prefill_is_continued_and_empty_text_asks_again() {
        let body = json!({"model": "m", "max_tokens": 10, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Sure:"}]})
        .to_string();
        let (b, _) = continuation_body(
            body.as_bytes(),
            Dialect::Anthropic,
            Continuation::Prefill,
            " yes",
            3,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["messages"][1]["content"], "Sure: yes");
        assert_eq!(v["messages"].as_array().unwrap().len(), 2);
        assert_eq!(v["max_tokens"], 7);
        let (b, trimmed) = continuation_body(
            body.as_bytes(),
            Dialect::Anthropic,
            Continuation::Prefill,
            "\n",
            0,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            v["messages"][1]["content"], "Sure:",
            "nothing to carry on from"
        );
        assert!(trimmed);
        assert!(
            continuation_body(b"[]", Dialect::Anthropic, Continuation::Prefill, "x", 0).is_err()
        );
    }

    fn chat_continuer(body: Value) -> Continuer {
        let mut c = continuer(Continuation::Instruction);
        c.how.provider.dialect = Dialect::OpenAi;
        c.how.suffix = "/chat/completions";
        c.how.body = Bytes::from(body.to_string());
        Continuer::new(c.how)
    }

    fn chunk(id: &str, created: u64, delta: Value, finish: Value) -> Bytes {
        let v = json!({"id": id, "object": "chat.completion.chunk", "created": created,
            "model": "gpt", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        Bytes::from(format!("data: {v}\n\n"))
    }

    fn usage_chunk(id: &str, prompt: u64, completion: u64) -> Bytes {
        let v = json!({"id": id, "object": "chat.completion.chunk", "created": 2, "model": "gpt",
            "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}});
        Bytes::from(format!("data: {v}\n\n"))
    }

    fn chat_body() -> Value {
        json!({"model": "gpt", "stream": true, "max_completion_tokens": 100,
               "messages": [{"role": "user", "content": "hi"}]})
    }

    #[test]
    fn an_openai_turn_is_continued_by_instruction_under_its_own_names() {
        let mut c = chat_continuer(chat_body());
        let first = [
            chunk(
                "chatcmpl-a",
                1,
                json!({"role": "assistant", "content": "", "refusal": null}),
                Value::Null,
            ),
            chunk("chatcmpl-a", 1, json!({"content": "Hello, "}), Value::Null),
        ];
        for ev in first {
            assert_eq!(c.take(ev).0.len(), 1, "the first answer passes as it came");
        }
        assert!(c.can_continue());
        let (req, trimmed) = c.request().unwrap();
        assert!(trimmed);
        assert_eq!(req.uri().path(), "/chat/completions");
        let body: Value = serde_json::from_slice(req.body().clone().into_inner().unwrap().as_ref())
            .unwrap_or_default();
        let last = &body["messages"][1];
        assert_eq!(last["role"], "user");
        assert!(
            last["content"].as_str().unwrap().contains("\n\nHello,\n\n"),
            "{last}"
        );
        assert_eq!(
            body["max_completion_tokens"], 98,
            "less the 2 tokens generated"
        );
        assert_eq!(
            body["stream_options"]["include_usage"], true,
            "asked for, to meter the turn"
        );
        c.begin(trimmed, None);

        // The continuation's role chunk goes; its text goes on under the first
        // answer's id and time, without the space the agent has.
        let (out, usage) = c.take(chunk(
            "chatcmpl-b",
            2,
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        ));
        assert!(out.is_empty() && usage.is_none());
        let (out, _) = c.take(chunk(
            "chatcmpl-b",
            2,
            json!({"content": " world"}),
            Value::Null,
        ));
        let v = named_data(&out[0]).unwrap().1;
        assert_eq!(
            (v["id"].as_str(), v["created"].as_u64()),
            (Some("chatcmpl-a"), Some(1))
        );
        assert_eq!(v["choices"][0]["delta"], json!({"content": "world"}));
        let (out, _) = c.take(chunk("chatcmpl-b", 2, json!({}), json!("stop")));
        assert_eq!(
            named_data(&out[0]).unwrap().1["choices"][0]["finish_reason"],
            "stop"
        );
        // The usage the agent did not ask for is counted, not passed on.
        let (out, usage) = c.take(usage_chunk("chatcmpl-b", 20, 3));
        assert!(out.is_empty());
        let usage = usage.expect("the continuation's usage");
        let (out, _) = c.take(Bytes::from_static(b"data: [DONE]\n\n"));
        assert_eq!(out, [Bytes::from_static(b"data: [DONE]\n\n")]);
        let prompt = estimate_prompt_tokens(chat_body().to_string().as_bytes());
        let total = c.with_carried(Some(usage), true).unwrap();
        assert_eq!((total.input, total.output), (20 + prompt, 3 + 2));
    }

    #[test]
    fn an_azure_turn_takes_its_names_from_its_first_choice_and_shows_no_new_ones() {
        let mut c = chat_continuer(chat_body());
        // Azure opens with the prompt's filter results: no choice, blank names.
        let filter = Bytes::from(format!(
            "data: {}\n\n",
            json!({"choices": [], "created": 0, "id": "", "model": "", "object": "",
                   "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {}}]})
        ));
        c.take(filter);
        assert!(!c.can_continue(), "no choice has come");
        c.take(chunk(
            "chatcmpl-a",
            1,
            json!({"role": "assistant", "content": "Hi"}),
            Value::Null,
        ));
        assert!(c.can_continue());
        let (_, trimmed) = c.request().unwrap();
        c.begin(trimmed, None);
        // The continuation's role chunk goes even with an empty tool-call list, and
        // a fingerprint the agent's chunks did not have is not shown.
        let role = chunk(
            "chatcmpl-b",
            2,
            json!({"role": "assistant", "content": "", "tool_calls": []}),
            Value::Null,
        );
        assert!(c.take(role).0.is_empty());
        let mut more: Value = named_data(&chunk(
            "chatcmpl-b",
            2,
            json!({"content": " there"}),
            Value::Null,
        ))
        .unwrap()
        .1;
        more["system_fingerprint"] = json!("fp_2");
        let (out, _) = c.take(Bytes::from(format!("data: {more}\n\n")));
        let v = named_data(&out[0]).unwrap().1;
        assert_eq!(
            (v["id"].as_str(), v["created"].as_u64()),
            (Some("chatcmpl-a"), Some(1))
        );
        assert!(v.get("system_fingerprint").is_none(), "{v}");
        assert_eq!(v["choices"][0]["delta"], json!({"content": " there"}));
    }

    /// A continuation that broke again, or that ended but reported no usage (its
    /// server ignored `include_usage`), is counted by estimate: both prompts and
    /// both pieces' text.
    #[test]
    fn an_openai_continuation_that_reports_no_usage_is_estimated() {
        for whole in [false, true] {
            let mut c = chat_continuer(chat_body());
            c.take(chunk(
                "chatcmpl-a",
                1,
                json!({"role": "assistant", "content": "Hello"}),
                Value::Null,
            ));
            let (req, trimmed) = c.request().unwrap();
            let asked = estimate_prompt_tokens(&req.into_body().into_inner().unwrap());
            c.begin(trimmed, None);
            c.take(chunk(
                "chatcmpl-b",
                2,
                json!({"content": " there, you"}),
                Value::Null,
            ));
            if whole {
                c.take(chunk("chatcmpl-b", 2, json!({}), json!("stop")));
            }
            let first = estimate_prompt_tokens(chat_body().to_string().as_bytes());
            let total = c.with_carried(None, whole).unwrap();
            assert_eq!(
                (total.input, total.output),
                (first + asked, 2 + 3),
                "whole: {whole}"
            );
        }
    }

    #[test]
    fn an_openai_usage_chunk_the_agent_asked_for_is_passed_on_under_its_names() {
        let mut body = chat_body();
        body["stream_options"] = json!({"include_usage": true});
        let mut c = chat_continuer(body);
        c.take(chunk(
            "chatcmpl-a",
            1,
            json!({"role": "assistant", "content": "Hi"}),
            Value::Null,
        ));
        let (req, trimmed) = c.request().unwrap();
        assert!(!trimmed);
        drop(req);
        c.begin(trimmed, None);
        let mut role = chunk(
            "chatcmpl-b",
            2,
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        );
        // With usage asked for, every chunk names it (null): that keeps none.
        role = Bytes::from(
            String::from_utf8_lossy(&role).replace("\"choices\"", "\"usage\":null,\"choices\""),
        );
        assert!(c.take(role).0.is_empty());
        let (out, usage) = c.take(usage_chunk("chatcmpl-b", 20, 3));
        assert!(
            usage.is_none(),
            "the gate reads it from the chunk passed on"
        );
        let v = named_data(&out[0]).unwrap().1;
        assert_eq!(v["id"], "chatcmpl-a");
        assert_eq!(v["usage"]["prompt_tokens"], 20);
    }

    #[test]
    fn an_openai_turn_with_a_tool_call_refusal_or_several_choices_is_not_continued() {
        let text = |c: &mut Continuer| {
            c.take(chunk(
                "a",
                1,
                json!({"role": "assistant", "content": "ok"}),
                Value::Null,
            ));
        };
        for delta in [
            json!({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}),
            json!({"refusal": "I can't"}),
            json!({"reasoning_content": "thinking"}),
            json!({"function_call": {"name": "f"}}),
            json!({"content": "", "thinking": "hm"}),
            json!({"content": "x", "annotations": [{"type": "url_citation"}]}),
        ] {
            let mut c = chat_continuer(chat_body());
            text(&mut c);
            assert!(c.can_continue());
            c.take(chunk("a", 1, delta.clone(), Value::Null));
            assert!(!c.can_continue(), "{delta}");
        }
        // Mistral's thinking comes as typed content parts.
        let mut c = chat_continuer(chat_body());
        text(&mut c);
        c.take(chunk("a", 1, json!({"content": [{"type": "thinking", "thinking": [{"type": "text", "text": "hm"}]}]}), Value::Null));
        assert!(!c.can_continue(), "typed content");
        for (member, value) in [
            ("n", json!(2)),
            (
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            ),
            ("response_format", json!({"type": "json_object"})),
        ] {
            let mut body = chat_body();
            body[member] = value.clone();
            let mut c = chat_continuer(body);
            text(&mut c);
            assert!(!c.can_continue(), "{member}: {value}");
        }
        let mut body = chat_body();
        body["response_format"] = json!({"type": "text"});
        let mut c = chat_continuer(body);
        text(&mut c);
        assert!(c.can_continue(), "plain text output");
        let error = Bytes::from_static(
            b"data: {\"error\": {\"type\": \"server_error\", \"message\": \"busy\"}}\n\n",
        );
        assert_eq!(error_type(&error).as_deref(), Some("server_error"));
        let bare = Bytes::from_static(b"data: {\"error\": \"overloaded\"}\n\n");
        assert_eq!(error_type(&bare).as_deref(), Some("overloaded"));
        assert_eq!(
            error_type(&chunk("a", 1, json!({"content": "x"}), Value::Null)),
            None
        );
    }

    /// A block of a generated answer: text pieces, or a tool call's input pieces.
    #[derive(Debug, Clone)]
    enum Block {
        Text(Vec<String>),
        Tool(Vec<String>),
    }

    /// The events of an answer made of `blocks`, numbered from 0.
    fn answer(blocks: &[Block]) -> Vec<Bytes> {
        let mut out = vec![message_start(10)];
        for (i, b) in blocks.iter().enumerate() {
            let i = i as u64;
            match b {
                Block::Text(pieces) => {
                    out.push(text_start(i));
                    out.extend(pieces.iter().map(|p| text_delta(i, p)));
                }
                Block::Tool(pieces) => {
                    out.push(named(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": i,
                               "content_block": {"type": "tool_use", "id": format!("t{i}"), "name": "f", "input": {}}}),
                    ));
                    out.extend(pieces.iter().map(|p| {
                        named(
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": i,
                                   "delta": {"type": "input_json_delta", "partial_json": p}}),
                        )
                    }));
                }
            }
            out.push(named(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            ));
        }
        out.push(named(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}}),
        ));
        out.push(named("message_stop", json!({"type": "message_stop"})));
        out
    }

    fn arb_pieces() -> impl Strategy<Value = Vec<String>> {
        prop::collection::vec("[ab \n]{0,4}", 0..4)
    }

    fn arb_block() -> impl Strategy<Value = Block> {
        prop_oneof![
            3 => arb_pieces().prop_map(Block::Text),
            1 => arb_pieces().prop_map(Block::Tool),
        ]
    }

    /// The text the agent should read: the first piece's, then the continuation's
    /// with the whitespace it already has (when the prefill was trimmed) dropped
    /// from the continuation's text up to its first non-space, or its first block
    /// that is not text.
    fn expected_text(sent: &str, trimmed: bool, continuation: &[Block]) -> String {
        let mut out = sent.to_owned();
        let mut strip = trimmed;
        for b in continuation {
            match b {
                Block::Text(pieces) => {
                    for p in pieces {
                        let p = if strip { p.trim_start() } else { p.as_str() };
                        if !p.is_empty() {
                            strip = false;
                        }
                        out.push_str(p);
                    }
                }
                Block::Tool(_) => strip = false,
            }
        }
        out
    }

    /// The text of the events the agent got.
    fn client_text(out: &[Bytes]) -> String {
        out.iter()
            .filter_map(|e| named_data(e))
            .map(|(_, v)| {
                v["delta"]["text"]
                    .as_str()
                    .or_else(|| v["content_block"]["text"].as_str())
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect()
    }

    proptest! {
        /// A text-only answer cut anywhere before its stop reason, then continued by
        /// any answers (text and tool blocks; a text-only one may be cut and
        /// continued again): the agent reads one well-formed message (one
        /// `message_start` first; blocks numbered 0, 1, 2, … in order, one open at
        /// a time, every delta and stop for the open one; one `message_stop`, last),
        /// whose text is what it had at each cut and then the continuation's, and
        /// whose tool calls come whole.
        #[test]
        fn a_stitched_turn_is_one_well_formed_message(
            first in prop::collection::vec(arb_pieces().prop_map(Block::Text), 1..4),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 2),
            continuations in prop::collection::vec(prop::collection::vec(arb_block(), 0..4), 1..3),
        ) {
            let mut c = continuer(Continuation::Prefill);
            c.how.left = 2;
            let events = answer(&first);
            // Delivered: at least message_start, never the message_delta.
            let delivered = 1 + cuts[0].index(events.len() - 2);
            let mut out = Vec::new();
            for ev in &events[..delivered] {
                out.extend(c.take(ev.clone()).0);
            }
            let mut started = 0;
            let mut last = (String::new(), false, Vec::new());
            let mut tools = String::new();
            for (i, continuation) in continuations.iter().enumerate() {
                prop_assert!(c.can_continue());
                let sent = c.sent.text(0);
                prop_assert_eq!(&client_text(&out), &sent, "what is carried on is what the agent has");
                let (_, trimmed) = c.request().unwrap();
                prop_assert_eq!(trimmed, sent.trim_end().len() < sent.len());
                c.begin(trimmed, None);
                let events = answer(continuation);
                let text_only = continuation.iter().all(|b| matches!(b, Block::Text(_)));
                let cut_again = i + 1 < continuations.len() && text_only;
                let delivered = if cut_again {
                    1 + cuts[1].index(events.len() - 2)
                } else {
                    events.len()
                };
                for ev in &events[..delivered] {
                    let (mapped, usage) = c.take(ev.clone());
                    started += usize::from(usage.is_some());
                    out.extend(mapped);
                }
                last = (sent, trimmed, continuation.clone());
                if !cut_again {
                    // Delivered whole: its tool calls' input is all there.
                    for b in continuation {
                        if let Block::Tool(pieces) = b {
                            tools.push_str(&pieces.concat());
                        }
                    }
                    break;
                }
            }
            prop_assert_eq!(started, c.taken as usize, "each continuation's message_start is taken");

            let mut open: Option<u64> = None;
            let mut next = 0;
            let mut text = String::new();
            let mut tool_input = String::new();
            for (n, ev) in out.iter().enumerate() {
                let (name, v) = named_data(ev).unwrap();
                let index = v["index"].as_u64();
                match name.as_str() {
                    "message_start" => prop_assert_eq!(n, 0),
                    "content_block_start" => {
                        prop_assert_eq!(open, None, "a block starts while one is open");
                        prop_assert_eq!(index, Some(next), "blocks are numbered in order");
                        open = index;
                        next += 1;
                        text.push_str(v["content_block"]["text"].as_str().unwrap_or_default());
                    }
                    "content_block_delta" => {
                        prop_assert!(open.is_some() && index == open, "a delta of no open block");
                        text.push_str(v["delta"]["text"].as_str().unwrap_or_default());
                        tool_input.push_str(v["delta"]["partial_json"].as_str().unwrap_or_default());
                    }
                    "content_block_stop" => {
                        prop_assert!(open.is_some() && index == open, "a stop of no open block");
                        open = None;
                    }
                    _ => {}
                }
            }
            prop_assert_eq!(open, None);
            let names: Vec<String> = out.iter().map(|e| named_data(e).unwrap().0).collect();
            prop_assert_eq!(names.iter().filter(|n| *n == "message_start").count(), 1);
            prop_assert_eq!(names.iter().filter(|n| *n == "message_stop").count(), 1);
            prop_assert_eq!(names.last().map(String::as_str), Some("message_stop"));
            // The text up to the last continuation, then that one's.
            let (sent, trimmed, continuation) = last;
            prop_assert_eq!(text, expected_text(&sent, trimmed, &continuation));
            prop_assert_eq!(tool_input, tools);
        }
    }

    /// The chunks of an OpenAI answer `n`: the role, text pieces, then a tool call's
    /// argument pieces if any, the finish, the usage chunk, `[DONE]`.
    fn chat_answer(n: u64, text: &[String], tool: Option<&Vec<String>>) -> Vec<Bytes> {
        let id = format!("chatcmpl-{n}");
        let mut out = vec![chunk(
            &id,
            n,
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        )];
        out.extend(
            text.iter()
                .map(|t| chunk(&id, n, json!({"content": t}), Value::Null)),
        );
        if let Some(pieces) = tool {
            out.push(chunk(
                &id,
                n,
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": ""}}]}),
                Value::Null,
            ));
            out.extend(pieces.iter().map(|p| {
                chunk(
                    &id,
                    n,
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}),
                    Value::Null,
                )
            }));
        }
        let finish = if tool.is_some() { "tool_calls" } else { "stop" };
        out.push(chunk(&id, n, json!({}), json!(finish)));
        out.push(usage_chunk(&id, 7, 3));
        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }

    proptest! {
        /// An OpenAI text answer cut anywhere before its finish reason, then
        /// continued by answers of text and perhaps a tool call (a text-only one may
        /// be cut and continued again): the agent reads one well-formed completion
        /// (every chunk under the first answer's id and time; one role, first; one
        /// finish reason, in the last chunk before `[DONE]`; one `[DONE]`, last;
        /// the usage chunk only if it asked for usage), whose text is what it had
        /// at each cut and then the continuation's, and whose tool call comes whole.
        #[test]
        fn a_stitched_openai_turn_is_one_well_formed_completion(
            first in prop::collection::vec("[ab \n]{0,4}", 0..5),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 2),
            continuations in prop::collection::vec(
                (arb_pieces(), prop::option::weighted(0.3, arb_pieces())), 1..3),
            agent_usage in any::<bool>(),
        ) {
            let mut body = chat_body();
            if agent_usage {
                body["stream_options"] = json!({"include_usage": true});
            }
            let mut c = chat_continuer(body);
            c.how.left = 2;
            let events = chat_answer(0, &first, None);
            // Delivered: at least the role chunk, never the finish.
            let delivered = 1 + cuts[0].index(first.len() + 1);
            let mut out = Vec::new();
            for ev in &events[..delivered] {
                out.extend(c.take(ev.clone()).0);
            }
            let mut counted = 0;
            let mut last = (String::new(), false, Vec::new());
            let mut tools = String::new();
            for (i, (text, tool)) in continuations.iter().enumerate() {
                prop_assert!(c.can_continue());
                let sent = c.sent.text(0);
                let (_, trimmed) = c.request().unwrap();
                c.begin(trimmed, None);
                let events = chat_answer(i as u64 + 1, text, tool.as_ref());
                let cut_again = i + 1 < continuations.len() && tool.is_none();
                let delivered = if cut_again {
                    1 + cuts[1].index(text.len() + 1)
                } else {
                    events.len()
                };
                for ev in &events[..delivered] {
                    let (mapped, usage) = c.take(ev.clone());
                    counted += usize::from(usage.is_some());
                    out.extend(mapped);
                }
                let mut blocks = vec![Block::Text(text.clone())];
                blocks.extend(tool.clone().map(Block::Tool));
                last = (sent, trimmed, blocks);
                if !cut_again {
                    tools = tool.as_ref().map(|t| t.concat()).unwrap_or_default();
                    break;
                }
            }
            prop_assert_eq!(counted, usize::from(!agent_usage), "the usage not shown is counted");

            let done = Bytes::from_static(b"data: [DONE]\n\n");
            prop_assert_eq!(out.last(), Some(&done));
            prop_assert_eq!(out.iter().filter(|e| **e == done).count(), 1);
            let chunks: Vec<Value> = out[..out.len() - 1]
                .iter()
                .map(|e| named_data(e).map(|(_, v)| v).unwrap_or_default())
                .collect();
            prop_assert!(chunks.iter().all(|v| v["id"] == "chatcmpl-0" && v["created"] == 0));
            let roles: Vec<usize> = chunks.iter().enumerate()
                .filter(|(_, v)| !v["choices"][0]["delta"]["role"].is_null())
                .map(|(n, _)| n)
                .collect();
            prop_assert_eq!(roles, vec![0]);
            let usage_chunks = chunks.iter().filter(|v| v["usage"].is_object()).count();
            prop_assert_eq!(usage_chunks, usize::from(agent_usage));
            let finishes: Vec<usize> = chunks.iter().enumerate()
                .filter(|(_, v)| !v["choices"][0]["finish_reason"].is_null())
                .map(|(n, _)| n)
                .collect();
            prop_assert_eq!(finishes.len(), 1);
            prop_assert_eq!(finishes[0] + 1 + usage_chunks, chunks.len(), "the finish comes last");
            let text: String = chunks.iter()
                .filter_map(|v| v["choices"][0]["delta"]["content"].as_str())
                .collect();
            let (sent, trimmed, continuation) = last;
            prop_assert_eq!(text, expected_text(&sent, trimmed, &continuation));
            let arguments: String = chunks.iter()
                .filter_map(|v| v["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
                .collect();
            prop_assert_eq!(arguments, tools);
        }
    }
}
