//! What a provider's stream events mean: text, tool-call blocks opening, growing and
//! completing, usage, errors and the terminal event — for both dialects.
//!
//! A tool call is complete only when the provider says so: Anthropic closes a
//! `tool_use` block with `content_block_stop` and then says the message stopped for
//! it (`message_delta` with `stop_reason: "tool_use"`; any other stop reason, such
//! as `max_tokens`, cut the block short, its `content_block_stop` notwithstanding);
//! OpenAI chat completions close all tool calls of a choice with its
//! `finish_reason` (`tool_calls`, or `stop` for a call the request forced), unless
//! the reason says the choice was cut short (`length`, `content_filter`). A stream
//! that stops before that holds only partial tool calls, which must never reach the
//! agent.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use memchr::memmem;
use serde_json::Value;

use crate::keys::IssuedCall;
use crate::options::Dialect;
use crate::sse;

/// The markers the fast path looks for, each searcher built once: building one
/// costs more than searching a short event with it.
struct Markers {
    content: memmem::Finder<'static>,
    tool_calls: memmem::Finder<'static>,
    usage: memmem::Finder<'static>,
    error: memmem::Finder<'static>,
    finish_reason_null: memmem::Finder<'static>,
    text_delta: memmem::Finder<'static>,
    function_call: memmem::Finder<'static>,
}

static MARKERS: LazyLock<Markers> = LazyLock::new(|| Markers {
    content: memmem::Finder::new(b"\"content\":"),
    tool_calls: memmem::Finder::new(b"tool_calls"),
    usage: memmem::Finder::new(b"\"usage\""),
    error: memmem::Finder::new(b"\"error\""),
    finish_reason_null: memmem::Finder::new(b"\"finish_reason\":null"),
    text_delta: memmem::Finder::new(b"\"text_delta\""),
    function_call: memmem::Finder::new(b"function_call"),
});

/// The block a choice's legacy `function_call` delta grows (OpenAI's `functions`
/// API): one per choice, after any tool-call index a choice can have.
const LEGACY_CALL: u64 = 999;
/// The input tokens of an Anthropic `usage` object: its `input_tokens` and what the
/// prompt cache read and wrote, which `input_tokens` leaves out (OpenAI's
/// `prompt_tokens` counts cached tokens in). `None` without `input_tokens`.
pub(crate) fn anthropic_input(usage: &Value) -> Option<u64> {
    let input = usage["input_tokens"].as_u64()?;
    Some(with_cache(
        input,
        usage["cache_read_input_tokens"].as_u64(),
        usage["cache_creation_input_tokens"].as_u64(),
    ))
}

/// Anthropic's `input_tokens` with what the prompt cache read and wrote.
pub(crate) fn with_cache(input: u64, read: Option<u64>, created: Option<u64>) -> u64 {
    input
        .saturating_add(read.unwrap_or(0))
        .saturating_add(created.unwrap_or(0))
}

/// The largest choice index whose block keys (`index * 1_000 + call`) fit in a `u64`.
const MAX_CHOICE: u64 = u64::MAX / 1_000 - 1;

/// What one event does to the turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Text (or other content the agent may see as it arrives).
    Text,
    /// Part of a tool-call (or thinking) block that is not complete yet.
    ToolPart,
    /// Completes the tool-call blocks named (by block index).
    ToolComplete(Vec<u64>),
    /// The provider reported an error inside the stream.
    Error,
    /// The final event of a complete turn (`[DONE]`, `message_stop`).
    Terminal,
    /// Metadata (start, usage, stop reason, keep-alives).
    Other,
}

#[derive(Debug, Default, Clone)]
struct Partial {
    id: String,
    name: String,
    arguments: String,
    complete: bool,
    thinking: bool,
    /// An Anthropic `tool_use` block: complete only once the message's stop reason
    /// is `tool_use`, after its `content_block_stop`.
    needs_stop_reason: bool,
    /// Its `content_block_stop` has come.
    stopped: bool,
}

/// Token usage as the provider reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReportedUsage {
    pub input: u64,
    pub output: u64,
}

/// Follows one streamed turn event by event.
#[derive(Debug)]
pub struct Turn {
    pub dialect: Dialect,
    /// Open and completed blocks by index (OpenAI: tool-call index).
    blocks: BTreeMap<u64, Partial>,
    /// OpenAI: the block a (choice, tool-call index) now grows, where a server
    /// reused the index for a call with a new id.
    aliases: BTreeMap<u64, u64>,
    pub usage: Option<ReportedUsage>,
    pub finish_reason: Option<String>,
    pub response_model: Option<String>,
    pub response_id: Option<String>,
    pub terminal: bool,
    pub errored: bool,
    /// The provider cut a choice short (`finish_reason` `length` or
    /// `content_filter`, or another reason with a call's arguments unfinished; an
    /// Anthropic `stop_reason` other than `tool_use`) while one of its tool calls
    /// was not complete.
    pub truncated_tool_call: Option<String>,
}

impl Turn {
    pub fn new(dialect: Dialect) -> Self {
        Self {
            dialect,
            blocks: BTreeMap::new(),
            aliases: BTreeMap::new(),
            usage: None,
            finish_reason: None,
            response_model: None,
            response_id: None,
            terminal: false,
            errored: false,
            truncated_tool_call: None,
        }
    }

    /// Classifies one raw event block and updates the turn.
    pub fn observe(&mut self, raw: &[u8]) -> Kind {
        if let Some(kind) = self.fast_path(raw) {
            return kind;
        }
        let ev = sse::parse(raw);
        let Some(data) = ev.data else {
            return Kind::Other;
        };
        match self.dialect {
            Dialect::OpenAi => self.openai(&data),
            Dialect::Anthropic => self.anthropic(ev.event.as_deref(), &data),
        }
    }

    /// Most events of a turn are plain text deltas; recognise those without parsing
    /// their JSON. Anything that might open, grow or close a block, report usage or an
    /// error, or end the turn takes the full path.
    fn fast_path(&self, raw: &[u8]) -> Option<Kind> {
        let m = &*MARKERS;
        let has = |finder: &memmem::Finder<'static>| finder.find(raw).is_some();
        match self.dialect {
            Dialect::OpenAi => {
                let plain_text = raw.starts_with(b"data: {")
                    && has(&m.content)
                    && !has(&m.tool_calls)
                    && !has(&m.function_call)
                    && !has(&m.usage)
                    && !has(&m.error)
                    && has(&m.finish_reason_null);
                (plain_text && self.response_id.is_some()).then_some(Kind::Text)
            }
            Dialect::Anthropic => {
                let text_delta = raw.starts_with(b"event: content_block_delta")
                    && has(&m.text_delta)
                    && !self.inside_tool_call();
                let ping = raw.starts_with(b"event: ping");
                if text_delta {
                    Some(Kind::Text)
                } else if ping {
                    Some(Kind::Other)
                } else {
                    None
                }
            }
        }
    }

    fn openai(&mut self, data: &str) -> Kind {
        if data.trim() == "[DONE]" {
            self.terminal = true;
            return Kind::Terminal;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return Kind::Other;
        };
        if v.get("error").is_some() {
            self.errored = true;
            return Kind::Error;
        }
        // Named by its first chunk's names, or the first that are not blank (Azure
        // opens with a chunk of prompt filter results whose names are blank).
        for (name, kept) in [
            (&v["model"], &mut self.response_model),
            (&v["id"], &mut self.response_id),
        ] {
            if let Some(n) = name.as_str()
                && kept.as_ref().is_none_or(String::is_empty)
            {
                *kept = Some(n.to_owned());
            }
        }
        self.openai_usage(&v);
        let mut kind = Kind::Other;
        for choice in v["choices"].as_array().into_iter().flatten() {
            // Clamped so that the block keys below cannot overflow (real choice
            // indexes are small; an absurd one shares the last block range).
            let c = choice["index"].as_u64().unwrap_or(0).min(MAX_CHOICE);
            let delta = &choice["delta"];
            if let Some(calls) = delta["tool_calls"].as_array() {
                for tc in calls {
                    // One block per (choice, tool-call index).
                    let i = c * 1_000 + self.call_index(c, tc);
                    let b = self.blocks.entry(i).or_default();
                    if let Some(id) = tc["id"].as_str() {
                        b.id = id.to_string();
                    }
                    if let Some(name) = tc["function"]["name"].as_str() {
                        b.name.push_str(name);
                    }
                    if let Some(a) = tc["function"]["arguments"].as_str() {
                        b.arguments.push_str(a);
                    }
                }
                kind = Kind::ToolPart;
            } else if let Some(call) = delta.get("function_call").filter(|c| c.is_object()) {
                let b = self.blocks.entry(c * 1_000 + LEGACY_CALL).or_default();
                if let Some(name) = call["name"].as_str() {
                    b.name.push_str(name);
                }
                if let Some(a) = call["arguments"].as_str() {
                    b.arguments.push_str(a);
                }
                kind = Kind::ToolPart;
            } else if (delta["content"].is_string() || delta["refusal"].is_string())
                && kind == Kind::Other
            {
                kind = Kind::Text;
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                self.finish_reason = Some(reason.to_string());
                let open = |(i, b): &(&u64, &Partial)| **i / 1_000 == c && !b.complete;
                let cut = match reason {
                    "tool_calls" | "function_call" => false,
                    "length" | "content_filter" => true,
                    // `stop` ends a call the request forced (`tool_choice` naming a
                    // function), and compatible servers use their own reasons: the
                    // calls are whole if their arguments are.
                    _ => self.blocks.iter().filter(open).any(|(_, b)| {
                        !b.arguments.trim().is_empty()
                            && serde_json::from_str::<serde::de::IgnoredAny>(&b.arguments).is_err()
                    }),
                };
                let closed: Vec<u64> = self
                    .blocks
                    .iter_mut()
                    .filter(|(i, b)| **i / 1_000 == c && !b.complete)
                    .map(|(i, b)| {
                        b.complete = !cut;
                        *i
                    })
                    .collect();
                if cut && !closed.is_empty() {
                    self.truncated_tool_call = Some(reason.to_string());
                } else if !closed.is_empty() {
                    kind = Kind::ToolComplete(closed);
                }
            }
        }
        kind
    }

    fn openai_usage(&mut self, v: &Value) {
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(ReportedUsage {
                input: u["prompt_tokens"].as_u64().unwrap_or(0),
                output: u["completion_tokens"].as_u64().unwrap_or(0),
            });
        }
    }

    /// Anthropic's running counts (`message_delta`): the output, and the input
    /// when it says it (it grows with server tools).
    fn anthropic_usage(&mut self, v: &Value) {
        let usage = &v["usage"];
        if let Some(out) = usage["output_tokens"].as_u64() {
            let u = self.usage.get_or_insert_with(ReportedUsage::default);
            u.output = out;
        }
        if let Some(input) = anthropic_input(usage) {
            let u = self.usage.get_or_insert_with(ReportedUsage::default);
            u.input = u.input.max(input);
        }
    }

    /// Takes only the usage an event reports. After the turn was ended with an
    /// error event nothing else of it counts, but its tokens were generated (and
    /// billed) whatever became of the events.
    fn observe_usage(&mut self, raw: &[u8]) {
        if MARKERS.usage.find(raw).is_none() {
            return;
        }
        let Some(data) = sse::parse(raw).data else {
            return;
        };
        let Ok(v) = serde_json::from_str::<Value>(&data) else {
            return;
        };
        match self.dialect {
            Dialect::OpenAi => self.openai_usage(&v),
            Dialect::Anthropic => self.anthropic_usage(&v),
        }
    }

    fn anthropic(&mut self, event: Option<&str>, data: &str) -> Kind {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return Kind::Other;
        };
        let ty = event
            .map(str::to_owned)
            .or_else(|| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        match ty.as_str() {
            "message_start" => {
                let m = &v["message"];
                self.response_model = m["model"].as_str().map(str::to_owned);
                self.response_id = m["id"].as_str().map(str::to_owned);
                self.usage = Some(ReportedUsage {
                    input: anthropic_input(&m["usage"]).unwrap_or(0),
                    output: m["usage"]["output_tokens"].as_u64().unwrap_or(0),
                });
                Kind::Other
            }
            "content_block_start" => {
                let i = v["index"].as_u64().unwrap_or(0);
                let block = &v["content_block"];
                match block["type"].as_str() {
                    Some(ty @ ("tool_use" | "server_tool_use")) => {
                        self.blocks.insert(
                            i,
                            Partial {
                                id: block["id"].as_str().unwrap_or_default().to_string(),
                                name: block["name"].as_str().unwrap_or_default().to_string(),
                                // A server tool runs at the provider, within the turn,
                                // which goes on after it: its block is whole at its stop.
                                needs_stop_reason: ty == "tool_use",
                                ..Partial::default()
                            },
                        );
                        Kind::ToolPart
                    }
                    Some("thinking" | "redacted_thinking") => {
                        self.blocks.insert(
                            i,
                            Partial {
                                thinking: true,
                                ..Partial::default()
                            },
                        );
                        Kind::ToolPart
                    }
                    _ => Kind::Text,
                }
            }
            "content_block_delta" => {
                let i = v["index"].as_u64().unwrap_or(0);
                match self.blocks.get_mut(&i) {
                    Some(b) if !b.complete => {
                        if let Some(p) = v["delta"]["partial_json"].as_str() {
                            b.arguments.push_str(p);
                        }
                        Kind::ToolPart
                    }
                    _ => Kind::Text,
                }
            }
            "content_block_stop" => {
                let i = v["index"].as_u64().unwrap_or(0);
                match self.blocks.get_mut(&i) {
                    // Held until the stop reason says the call is whole.
                    Some(b) if b.needs_stop_reason => {
                        b.stopped = true;
                        Kind::ToolPart
                    }
                    Some(b) => {
                        b.complete = true;
                        Kind::ToolComplete(vec![i])
                    }
                    None => Kind::Text,
                }
            }
            "message_delta" => {
                // Counted whatever happens to the event: the tokens were generated.
                self.anthropic_usage(&v);
                let Some(reason) = v["delta"]["stop_reason"].as_str() else {
                    return Kind::Other;
                };
                self.finish_reason = Some(reason.to_string());
                let waiting = |b: &Partial| b.needs_stop_reason && !b.complete;
                if !self.blocks.values().any(waiting) {
                    return Kind::Other;
                }
                if reason != "tool_use" {
                    // `max_tokens` (or a refusal, a stop sequence…) inside a tool call:
                    // its input may be cut short even though its block was stopped.
                    self.truncated_tool_call = Some(reason.to_string());
                    return Kind::Other;
                }
                // A block still open stays open (the turn's end then cuts it).
                let closed: Vec<u64> = self
                    .blocks
                    .iter_mut()
                    .filter(|(_, b)| waiting(b) && b.stopped)
                    .map(|(i, b)| {
                        b.complete = true;
                        *i
                    })
                    .collect();
                if closed.is_empty() {
                    Kind::Other
                } else {
                    Kind::ToolComplete(closed)
                }
            }
            "message_stop" => {
                self.terminal = true;
                Kind::Terminal
            }
            "error" => {
                self.errored = true;
                Kind::Error
            }
            _ => Kind::Other,
        }
    }

    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Whether a tool-call (or thinking) block is open right now.
    pub fn inside_tool_call(&self) -> bool {
        self.blocks.values().any(|b| !b.complete)
    }

    /// A tool-call part's index within its choice. Compatible servers that leave
    /// `index` out send parallel calls one after the other: a part with an id that
    /// is not the last call's starts the next call, one without an id continues it.
    /// Some number every call `index: 0`: there too a new id starts a call of its
    /// own (after the last), and parts without one continue it.
    fn call_index(&mut self, choice: u64, part: &Value) -> u64 {
        let base = choice * 1_000;
        let calls = base..base + LEGACY_CALL;
        let next_free = |blocks: &BTreeMap<u64, Partial>| {
            blocks
                .range(calls.clone())
                .next_back()
                .map_or(0, |(&last, _)| (last - base + 1).min(LEGACY_CALL - 1))
        };
        let new_id = |block: Option<&Partial>| match (part["id"].as_str(), block) {
            (Some(id), Some(b)) => !b.id.is_empty() && id != b.id,
            _ => false,
        };
        if let Some(i) = part["index"].as_u64() {
            let i = i.min(LEGACY_CALL - 1);
            let at = self.aliases.get(&(base + i)).copied().unwrap_or(i);
            if !new_id(self.blocks.get(&(base + at))) {
                return at;
            }
            let next = next_free(&self.blocks);
            self.aliases.insert(base + i, next);
            return next;
        }
        let Some((&last, block)) = self.blocks.range(calls.clone()).next_back() else {
            return 0;
        };
        if new_id(Some(block)) {
            next_free(&self.blocks)
        } else {
            last - base
        }
    }

    /// The tool calls the provider completed, in block order.
    pub fn completed_calls(&self) -> Vec<IssuedCall> {
        self.blocks
            .values()
            .filter(|b| b.complete && !b.thinking && !b.id.is_empty())
            .map(|b| {
                let args: Value = if b.arguments.trim().is_empty() {
                    Value::Object(serde_json::Map::new())
                } else {
                    serde_json::from_str(&b.arguments).unwrap_or(Value::String(b.arguments.clone()))
                };
                IssuedCall::new(&b.id, &b.name, &args)
            })
            .collect()
    }
}

/// What to do with events as they arrive so that the agent never sees part of a
/// tool call: text flows at once; from the first event of a tool-call (or thinking)
/// block on, everything is held, in order, until no block is open any more, and is
/// then released together. Events that complete a block or end the turn must be
/// durable before they are released.
#[derive(Debug)]
pub struct Gate {
    pub turn: Turn,
    held: Vec<bytes::Bytes>,
    /// The bytes of `held`.
    held_bytes: usize,
    /// The turn was ended with a typed error event: nothing more goes out.
    closed: bool,
}

/// The most a gate holds back for one unfinished block (a tool call whose arguments
/// a runaway generation never closes): past it the turn is cut with the typed error
/// event, whatever else bounds the stream.
pub const MAX_HELD_BYTES: usize = 64 << 20;

/// Events the gate lets through.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Release {
    pub events: Vec<bytes::Bytes>,
    /// Journal these durably before the agent sees them.
    pub durable: bool,
}

impl Gate {
    pub fn new(dialect: Dialect) -> Self {
        Self {
            turn: Turn::new(dialect),
            held: Vec::new(),
            held_bytes: 0,
            closed: false,
        }
    }

    pub fn push(&mut self, raw: bytes::Bytes) -> Release {
        if self.closed {
            self.turn.observe_usage(&raw);
            return Release::default();
        }
        let kind = self.turn.observe(&raw);
        if let Some(reason) = &self.turn.truncated_tool_call {
            // The provider stopped inside a tool call: its half never goes out, and
            // the agent gets a typed error instead of a silent end.
            let field = match self.turn.dialect {
                Dialect::OpenAi => "finish_reason",
                Dialect::Anthropic => "stop_reason",
            };
            let detail =
                format!("the provider ended its turn ({field} {reason:?}) inside a tool call");
            return self.cut(interruption_event(self.turn.dialect, &detail));
        }
        let open = !self.held.is_empty() || self.turn.inside_tool_call();
        match kind {
            // The provider's own typed error ends the turn; the parts of a block it
            // left open never go out.
            Kind::Error => return self.cut(raw),
            // A turn must not end as complete with a block still open (`[DONE]`
            // without the finish reason that closes the calls, or `message_stop`
            // before `content_block_stop`).
            Kind::Terminal if open => {
                self.turn.terminal = false;
                let detail = "the provider ended its turn inside a tool call";
                return self.cut(interruption_event(self.turn.dialect, detail));
            }
            _ => {}
        }
        let durable = matches!(kind, Kind::ToolComplete(_) | Kind::Terminal | Kind::Error);
        if self.held.is_empty() && kind != Kind::ToolPart {
            return Release {
                events: vec![raw],
                durable,
            };
        }
        self.held_bytes += raw.len();
        self.held.push(raw);
        if self.turn.inside_tool_call() {
            if self.held_bytes > MAX_HELD_BYTES {
                let detail = format!("a tool call held back passed {MAX_HELD_BYTES} bytes");
                return self.cut(interruption_event(self.turn.dialect, &detail));
            }
            return Release::default();
        }
        self.held_bytes = 0;
        Release {
            events: std::mem::take(&mut self.held),
            durable: true,
        }
    }

    /// Ends the turn with `error` (a typed error event): what is held is dropped,
    /// and nothing more goes out.
    fn cut(&mut self, error: bytes::Bytes) -> Release {
        self.closed = true;
        self.held.clear();
        self.held_bytes = 0;
        self.turn.errored = true;
        Release {
            events: vec![error],
            durable: true,
        }
    }

    /// Whether the turn was ended with an error event (the provider's or ours): a
    /// stream that breaks after that needs no second one.
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// Events held back (parts of an unfinished block), which an interruption drops.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

/// The typed error event that ends an interrupted stream in the provider's dialect
/// (never a faked `[DONE]` or stop reason). The official SDKs raise on it.
pub fn interruption_event(dialect: Dialect, detail: &str) -> bytes::Bytes {
    let message = format!(
        "outrigger: the upstream stream was interrupted ({detail}); no partial tool call was forwarded; retry the request"
    );
    let doc = match dialect {
        Dialect::OpenAi => serde_json::json!({"error": {
            "message": message, "type": "stream_interrupted", "code": "outrigger_stream_interrupted", "param": null}}),
        Dialect::Anthropic => {
            serde_json::json!({"type": "error", "error": {"type": "api_error", "message": message}})
        }
    };
    let text = match dialect {
        Dialect::OpenAi => format!("data: {doc}\n\n"),
        Dialect::Anthropic => format!("event: error\ndata: {doc}\n\n"),
    };
    bytes::Bytes::from(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(data: &Value) -> Vec<u8> {
        format!("data: {data}\n\n").into_bytes()
    }

    fn named(name: &str, data: &Value) -> Vec<u8> {
        format!("event: {name}\ndata: {data}\n\n").into_bytes()
    }

    /// Azure opens a stream with a chunk of prompt filter results whose names are
    /// blank: the turn is named by the first chunk that names it.
    #[test]
    fn a_turn_is_named_by_its_first_names_that_are_not_blank() {
        let mut g = Gate::new(Dialect::OpenAi);
        g.push(
            ev(&json!({"choices": [], "id": "", "model": "", "prompt_filter_results": []})).into(),
        );
        g.push(ev(&json!({"id": "chatcmpl-1", "model": "gpt-4o", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})).into());
        g.push(ev(&json!({"id": "chatcmpl-2", "model": "other", "choices": [{"index": 0, "delta": {"content": "x"}}]})).into());
        assert_eq!(g.turn.response_id.as_deref(), Some("chatcmpl-1"));
        assert_eq!(g.turn.response_model.as_deref(), Some("gpt-4o"));
    }

    /// A choice index near `u64::MAX` once overflowed the block key (a panic in the
    /// producer's task, which left the stream's hub open for ever).
    #[test]
    fn an_absurd_choice_index_is_a_tool_call_like_any_other() {
        for index in [u64::MAX, u64::MAX / 1_000, MAX_CHOICE + 1] {
            let mut g = Gate::new(Dialect::OpenAi);
            let part = g.push(
                ev(
                    &json!({"choices": [{"index": index, "delta": {"tool_calls": [
                {"index": 0, "id": "call_1", "function": {"name": "pay", "arguments": "{}"}}]}}]}),
                )
                .into(),
            );
            assert!(part.events.is_empty(), "held until the call closes");
            let legacy = g.push(
                ev(&json!({"choices": [{"index": index, "delta": {"function_call": {"name": "f", "arguments": "{}"}}}]}))
                    .into(),
            );
            assert!(legacy.events.is_empty());
            let end = g.push(
                ev(&json!({"choices": [{"index": index, "delta": {}, "finish_reason": "tool_calls"}]}))
                    .into(),
            );
            assert_eq!(end.events.len(), 3, "index {index}: the calls and the stop");
            assert!(!g.turn.inside_tool_call());
        }
    }

    #[test]
    fn a_tool_call_cut_by_finish_reason_length_becomes_a_typed_error() {
        let mut g = Gate::new(Dialect::OpenAi);
        let text =
            g.push(ev(&json!({"choices": [{"index": 0, "delta": {"content": "hi"}}]})).into());
        assert_eq!(text.events.len(), 1);
        let part = g.push(
            ev(&json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "function": {"name": "pay", "arguments": "{\"a\":"}}]}}]}))
            .into(),
        );
        assert!(part.events.is_empty());
        let end = g.push(
            ev(&json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})).into(),
        );
        assert_eq!(end.events.len(), 1);
        let text = String::from_utf8_lossy(&end.events[0]);
        assert!(
            text.contains("stream_interrupted") && text.contains("length"),
            "{text}"
        );
        assert!(!text.contains("pay"));
        assert!(g.turn.errored);
        assert!(
            g.push(bytes::Bytes::from_static(b"data: [DONE]\n\n"))
                .events
                .is_empty()
        );
        assert!(!g.turn.terminal);
    }

    fn call_part(args: &str) -> bytes::Bytes {
        ev(&json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "function": {"name": "pay", "arguments": args}}]}}]}))
        .into()
    }

    fn tool_use_start() -> bytes::Bytes {
        named(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "mail", "input": {}}}),
        )
        .into()
    }

    fn finish(reason: &str) -> bytes::Bytes {
        ev(&json!({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})).into()
    }

    /// Servers that leave `index` out of parallel calls: each new id is a call of
    /// its own, and parts without an id continue the last.
    #[test]
    fn parallel_calls_without_an_index_stay_apart() {
        let mut g = Gate::new(Dialect::OpenAi);
        for part in [
            json!({"id": "call_a", "function": {"name": "pay", "arguments": "{\"n\":"}}),
            json!({"function": {"arguments": "1}"}}),
            json!({"id": "call_b", "function": {"name": "mail", "arguments": "{}"}}),
        ] {
            let chunk = ev(&json!({"choices": [{"index": 0, "delta": {"tool_calls": [part]}}]}));
            assert!(g.push(chunk.into()).events.is_empty());
        }
        let end = g.push(finish("tool_calls"));
        assert_eq!(end.events.len(), 4);
        let calls: Vec<(String, String)> = g
            .turn
            .completed_calls()
            .into_iter()
            .map(|c| (c.id.clone(), c.name.clone()))
            .collect();
        assert_eq!(
            calls,
            [
                ("call_a".to_owned(), "pay".to_owned()),
                ("call_b".to_owned(), "mail".to_owned())
            ]
        );
    }

    /// Servers that number every parallel call `index: 0`: a part with an id that
    /// is not the open call's starts a call of its own, and parts without an id
    /// continue the latest call under that index.
    #[test]
    fn parallel_calls_that_reuse_an_index_with_new_ids_stay_apart() {
        let mut g = Gate::new(Dialect::OpenAi);
        for part in [
            json!({"index": 0, "id": "call_a", "function": {"name": "pay", "arguments": "{\"n\":"}}),
            json!({"index": 0, "function": {"arguments": "1}"}}),
            json!({"index": 0, "id": "call_b", "function": {"name": "mail", "arguments": "{\"to\":"}}),
            json!({"index": 0, "function": {"arguments": "\"amy\"}"}}),
            json!({"index": 1, "id": "call_c", "function": {"name": "log", "arguments": "{}"}}),
        ] {
            let chunk = ev(&json!({"choices": [{"index": 0, "delta": {"tool_calls": [part]}}]}));
            assert!(g.push(chunk.into()).events.is_empty());
        }
        let end = g.push(finish("tool_calls"));
        assert_eq!(end.events.len(), 6);
        assert!(!g.turn.errored);
        let calls = g.turn.completed_calls();
        let got: Vec<(&str, &str)> = calls
            .iter()
            .map(|c| (c.id.as_str(), c.name.as_str()))
            .collect();
        assert_eq!(
            got,
            [("call_a", "pay"), ("call_b", "mail"), ("call_c", "log")]
        );
        assert_eq!(
            calls[0].arguments,
            crate::keys::fingerprint(&json!({"n": 1}))
        );
        assert_eq!(
            calls[1].arguments,
            crate::keys::fingerprint(&json!({"to": "amy"}))
        );
    }

    /// Anthropic's input count leaves out what the prompt cache read and wrote:
    /// those count as input too, and a `message_delta` that reports a larger input
    /// (server tools) raises it.
    #[test]
    fn anthropic_cached_prompt_tokens_count_as_input() {
        let mut g = Gate::new(Dialect::Anthropic);
        g.push(
            named(
                "message_start",
                &json!({"type": "message_start", "message": {"id": "msg_1", "model": "c",
                "usage": {"input_tokens": 5, "cache_read_input_tokens": 1000,
                "cache_creation_input_tokens": 20, "output_tokens": 1}}}),
            )
            .into(),
        );
        assert_eq!(
            g.turn.usage,
            Some(ReportedUsage {
                input: 1025,
                output: 1
            })
        );
        g.push(
            named(
                "message_delta",
                &json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 9}}),
            )
            .into(),
        );
        assert_eq!(g.turn.usage.map(|u| (u.input, u.output)), Some((1025, 9)));
        g.push(
            named(
                "message_delta",
                &json!({"type": "message_delta", "delta": {},
                "usage": {"input_tokens": 40, "cache_read_input_tokens": 1000,
                "cache_creation_input_tokens": 20, "output_tokens": 12}}),
            )
            .into(),
        );
        assert_eq!(g.turn.usage.map(|u| (u.input, u.output)), Some((1060, 12)));
    }

    /// The usage chunk OpenAI sends after the finish (`stream_options.include_usage`)
    /// and Anthropic's `message_delta` are counted even when the turn was already
    /// ended with an error event: the tokens were generated and billed.
    #[test]
    fn usage_reported_after_the_turn_was_cut_is_still_counted() {
        let mut g = Gate::new(Dialect::OpenAi);
        assert!(g.push(call_part("{\"a\":")).events.is_empty());
        assert_eq!(g.push(finish("length")).events.len(), 1);
        assert!(g.closed());
        let usage =
            ev(&json!({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 13}}));
        assert!(g.push(usage.into()).events.is_empty());
        assert!(
            g.push(bytes::Bytes::from_static(b"data: [DONE]\n\n"))
                .events
                .is_empty()
        );
        assert_eq!(
            g.turn.usage,
            Some(ReportedUsage {
                input: 11,
                output: 13
            })
        );
        assert!(!g.turn.terminal, "a cut turn never becomes complete");

        let mut g = Gate::new(Dialect::Anthropic);
        g.push(
            named(
                "message_start",
                &json!({"type": "message_start", "message": {"id": "msg_1", "model": "c",
                "usage": {"input_tokens": 5, "output_tokens": 1}}}),
            )
            .into(),
        );
        assert!(g.push(tool_use_start()).events.is_empty());
        let error = named(
            "error",
            &json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
        );
        assert_eq!(g.push(error.into()).events.len(), 1);
        let delta = named(
            "message_delta",
            &json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 21}}),
        );
        assert!(g.push(delta.into()).events.is_empty());
        assert_eq!(
            g.turn.usage,
            Some(ReportedUsage {
                input: 5,
                output: 21
            })
        );
        assert!(g.turn.completed_calls().is_empty());
    }

    #[test]
    fn a_call_the_request_forced_completes_at_finish_reason_stop() {
        let mut g = Gate::new(Dialect::OpenAi);
        assert!(g.push(call_part("{\"a\":")).events.is_empty());
        assert!(g.push(call_part("1}")).events.is_empty());
        let end = g.push(finish("stop"));
        assert_eq!(
            end.events.len(),
            3,
            "the two parts and the finish, together"
        );
        assert!(end.durable);
        assert!(!g.turn.errored);
        assert_eq!(g.turn.completed_calls()[0].id, "call_1");
    }

    #[test]
    fn a_stop_with_unfinished_arguments_is_a_cut_call() {
        let mut g = Gate::new(Dialect::OpenAi);
        assert!(g.push(call_part("{\"a\":")).events.is_empty());
        let end = g.push(finish("stop"));
        assert_eq!(end.events.len(), 1);
        let text = String::from_utf8_lossy(&end.events[0]);
        assert!(
            text.contains("stream_interrupted") && !text.contains("pay"),
            "{text}"
        );
        assert!(g.turn.errored && g.closed());
    }

    #[test]
    fn a_provider_error_inside_a_tool_call_goes_out_and_drops_the_parts() {
        let mut g = Gate::new(Dialect::Anthropic);
        assert!(g.push(tool_use_start()).events.is_empty());
        let error = named(
            "error",
            &json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
        );
        let out = g.push(error.clone().into());
        assert_eq!(out.events, vec![bytes::Bytes::from(error)]);
        assert!(out.durable);
        assert!(g.closed() && g.turn.errored && g.held() == 0);
        let stop = named("message_stop", &json!({"type": "message_stop"}));
        assert!(
            g.push(stop.into()).events.is_empty(),
            "nothing after the error"
        );
        assert!(!g.turn.terminal);
    }

    /// A tool call whose arguments never close (a runaway generation) is held only
    /// up to MAX_HELD_BYTES: then the turn ends with the typed error event, and
    /// what was held is dropped.
    #[test]
    fn a_tool_call_held_past_the_limit_is_cut() {
        let mut g = Gate::new(Dialect::OpenAi);
        let piece = "x".repeat(1 << 20);
        let mut pushed = 0;
        let cut = loop {
            let out = g.push(call_part(&piece));
            pushed += 1;
            if !out.events.is_empty() {
                break out;
            }
            assert!(pushed <= 65, "still held after {pushed} MiB");
        };
        assert_eq!(pushed, 64, "cut once more than 64 MiB was held");
        assert!(cut.durable && g.closed() && g.held() == 0);
        let text = String::from_utf8_lossy(&cut.events[0]);
        assert!(
            text.contains("stream_interrupted") && text.contains("held back passed"),
            "{text}"
        );
        assert!(g.push(finish("tool_calls")).events.is_empty());
    }

    #[test]
    fn a_turn_that_ends_with_a_call_open_ends_with_a_typed_error_not_its_terminal() {
        // OpenAI: `[DONE]` without the finish reason that closes the call.
        let mut g = Gate::new(Dialect::OpenAi);
        assert!(g.push(call_part("{}")).events.is_empty());
        let end = g.push(bytes::Bytes::from_static(b"data: [DONE]\n\n"));
        assert_eq!(end.events.len(), 1);
        let text = String::from_utf8_lossy(&end.events[0]);
        assert!(
            text.contains("stream_interrupted") && !text.contains("[DONE]"),
            "{text}"
        );
        assert!(!g.turn.terminal && g.turn.errored);
        // Anthropic: `message_stop` before `content_block_stop`.
        let mut g = Gate::new(Dialect::Anthropic);
        assert!(g.push(tool_use_start()).events.is_empty());
        let end = g.push(named("message_stop", &json!({"type": "message_stop"})).into());
        assert_eq!(end.events.len(), 1);
        let text = String::from_utf8_lossy(&end.events[0]);
        assert!(
            text.starts_with("event: error\n") && !text.contains("mail"),
            "{text}"
        );
        assert!(!g.turn.terminal);
    }

    /// `max_tokens` inside a `tool_use` block: Anthropic still stops the block, then
    /// says why the message stopped. The input is cut short, so the call never goes
    /// out (nor reaches the correlator): the turn ends with the typed error event.
    #[test]
    fn an_anthropic_tool_call_stopped_by_max_tokens_becomes_a_typed_error() {
        let mut g = Gate::new(Dialect::Anthropic);
        let mut out = Vec::new();
        let mut durable = Vec::new();
        for ev in [
            named(
                "message_start",
                &json!({"type": "message_start", "message": {"id": "msg_1", "model": "c",
                "usage": {"input_tokens": 5, "output_tokens": 1}}}),
            ),
            tool_use_start().to_vec(),
            named(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": "{\"to\":\"am"}}),
            ),
            named(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 0}),
            ),
            named(
                "message_delta",
                &json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                "usage": {"output_tokens": 7}}),
            ),
            named("message_stop", &json!({"type": "message_stop"})),
        ] {
            let released = g.push(ev.into());
            durable.push(released.durable);
            out.extend(released.events);
        }
        let text: Vec<String> = out
            .iter()
            .map(|e| String::from_utf8_lossy(e).into_owned())
            .collect();
        assert_eq!(text.len(), 2, "{text:?}");
        assert!(text[0].starts_with("event: message_start\n"), "{text:?}");
        assert!(
            text[1].starts_with("event: error\n")
                && text[1].contains("was interrupted")
                && text[1].contains("max_tokens"),
            "{text:?}"
        );
        assert!(
            !text
                .iter()
                .any(|e| e.contains("tool_use") || e.contains("mail"))
        );
        assert!(durable[4], "the error event, at message_delta, is durable");
        assert!(g.closed() && g.turn.errored && !g.turn.terminal);
        assert!(g.turn.completed_calls().is_empty());
        // What was generated is still counted.
        assert_eq!(
            g.turn.usage,
            Some(ReportedUsage {
                input: 5,
                output: 7
            })
        );
    }

    /// Stopped and then confirmed by `stop_reason: "tool_use"`, the call goes out
    /// whole, with whatever was held behind it, durably.
    #[test]
    fn an_anthropic_tool_call_goes_out_at_its_stop_reason() {
        let mut g = Gate::new(Dialect::Anthropic);
        assert!(g.push(tool_use_start()).events.is_empty());
        let stop = named(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
        );
        assert!(g.push(stop.into()).events.is_empty(), "held at its stop");
        let delta = named(
            "message_delta",
            &json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}}),
        );
        let out = g.push(delta.into());
        assert_eq!(out.events.len(), 3);
        assert!(out.durable);
        assert_eq!(g.turn.completed_calls()[0].id, "toolu_1");
        let end = g.push(named("message_stop", &json!({"type": "message_stop"})).into());
        assert_eq!(end.events.len(), 1);
        assert!(g.turn.terminal && !g.turn.errored);
    }

    #[test]
    fn a_legacy_function_call_is_held_until_its_finish_reason() {
        let mut g = Gate::new(Dialect::OpenAi);
        let part = |args: &str| -> bytes::Bytes {
            ev(
                &json!({"id": "c1", "choices": [{"index": 0, "delta": {"content": null,
                "function_call": {"name": "pay", "arguments": args}}, "finish_reason": null}]}),
            )
            .into()
        };
        assert!(g.push(part("{\"a\":")).events.is_empty());
        assert!(g.push(part("1}")).events.is_empty());
        let end = g.push(finish("function_call"));
        assert_eq!(end.events.len(), 3);
        assert!(!g.turn.errored);
        // Cut short, it never goes out.
        let mut g = Gate::new(Dialect::OpenAi);
        assert!(g.push(part("{\"a\":")).events.is_empty());
        let end = g.push(finish("length"));
        assert!(String::from_utf8_lossy(&end.events[0]).contains("stream_interrupted"));
    }

    #[test]
    fn openai_tool_calls_complete_at_finish_reason() {
        let mut t = Turn::new(Dialect::OpenAi);
        assert_eq!(
            t.observe(&ev(
                &json!({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
            )),
            Kind::Text
        );
        assert_eq!(
            t.observe(&ev(&json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "call_1", "function": {"name": "pay", "arguments": "{\"a\":"}}]}}]}))),
            Kind::ToolPart
        );
        assert!(t.inside_tool_call());
        t.observe(&ev(
            &json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "1}"}}]}}]}),
        ));
        assert!(t.completed_calls().is_empty());
        assert_eq!(
            t.observe(&ev(
                &json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
            )),
            Kind::ToolComplete(vec![0])
        );
        assert!(!t.inside_tool_call());
        let calls = t.completed_calls();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].id, "call_1");
        assert_eq!(
            calls[0].arguments,
            crate::keys::fingerprint(&json!({"a": 1}))
        );
        t.observe(&ev(
            &json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
        ));
        assert_eq!(
            t.usage,
            Some(ReportedUsage {
                input: 3,
                output: 4
            })
        );
        assert_eq!(t.observe(b"data: [DONE]\n\n"), Kind::Terminal);
    }

    #[test]
    fn anthropic_blocks_complete_at_block_stop_and_tool_calls_at_their_stop_reason() {
        let mut t = Turn::new(Dialect::Anthropic);
        t.observe(&named("message_start", &json!({"type": "message_start", "message": {"id": "msg_1", "model": "c", "usage": {"input_tokens": 5, "output_tokens": 1}}})));
        assert_eq!(t.observe(&named("content_block_start", &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}))), Kind::Text);
        assert_eq!(t.observe(&named("content_block_delta", &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}}))), Kind::Text);
        assert_eq!(
            t.observe(&named(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 0})
            )),
            Kind::Text
        );
        assert_eq!(t.observe(&named("content_block_start", &json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "mail", "input": {}}}))), Kind::ToolPart);
        assert_eq!(t.observe(&named("content_block_delta", &json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"to\":\"amy\"}"}}))), Kind::ToolPart);
        assert!(t.inside_tool_call());
        // Stopped, the call is whole only once the message stopped for it.
        assert_eq!(
            t.observe(&named(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 1})
            )),
            Kind::ToolPart
        );
        assert!(t.inside_tool_call());
        assert!(t.completed_calls().is_empty());
        assert_eq!(
            t.observe(&named("message_delta", &json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}}))),
            Kind::ToolComplete(vec![1])
        );
        assert!(!t.inside_tool_call());
        assert_eq!(
            t.observe(&named("message_stop", &json!({"type": "message_stop"}))),
            Kind::Terminal
        );
        assert_eq!(
            t.usage,
            Some(ReportedUsage {
                input: 5,
                output: 9
            })
        );
        assert_eq!(t.completed_calls()[0].id, "toolu_1");
        assert_eq!(t.finish_reason.as_deref(), Some("tool_use"));
    }
}
