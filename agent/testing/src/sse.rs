//! Deterministic model responses in both dialects, as lists of raw SSE events (for
//! streams) or JSON bodies (for plain responses).
//!
//! A generation is described by a [`Generation`]: text split into `chunks` deltas
//! and `tool_calls` function calls whose JSON arguments arrive in several pieces,
//! numbered by `n` so that two generations have different ids (a replay from the
//! journal can then be told apart from a fresh sample).

use serde_json::json;

/// What one generation contains.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generation number: makes response and tool-call ids unique.
    pub n: u64,
    pub model: String,
    pub chunks: usize,
    pub tool_calls: usize,
    pub prompt_tokens: u64,
    /// Adds the usage chunk (OpenAI `stream_options.include_usage`).
    pub include_usage: bool,
    /// Ends with `content_filter` instead of `stop`.
    pub content_filtered: bool,
}

impl Generation {
    pub fn text_piece(&self, i: usize) -> String {
        format!("word{i} ")
    }

    pub fn text(&self) -> String {
        (0..self.chunks).map(|i| self.text_piece(i)).collect()
    }

    pub fn tool_call_id(&self, i: usize, dialect: Dialect) -> String {
        match dialect {
            Dialect::OpenAi => format!("call_mock_{}_{i}", self.n),
            Dialect::Anthropic => format!("toolu_mock_{}_{i}", self.n),
        }
    }

    /// The argument JSON of tool call `i`, and the pieces it is streamed in.
    pub fn tool_arguments(&self, i: usize) -> (String, Vec<String>) {
        let full = format!(
            "{{\"city\":\"City{i}\",\"unit\":\"celsius\",\"n\":{}}}",
            self.n
        );
        let pieces = vec![
            "{\"city\":".to_string(),
            format!("\"City{i}\",\"unit\""),
            ":\"celsius\",".to_string(),
            format!("\"n\":{}}}", self.n),
        ];
        debug_assert_eq!(pieces.concat(), full);
        (full, pieces)
    }

    /// Output tokens the generation "produced": one per text chunk and per
    /// argument piece, plus one per tool call for its name.
    pub fn completion_tokens(&self) -> u64 {
        (self.chunks + self.tool_calls * 5) as u64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
}

fn event(data: &serde_json::Value) -> String {
    format!("data: {data}\n\n")
}

fn named(name: &str, data: &serde_json::Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// An OpenAI chat-completions stream, one string per SSE event. A turn of tool calls
/// alone opens, as OpenAI's do, with the first call in the chunk that names the role.
pub fn openai_stream(g: &Generation) -> Vec<String> {
    let id = format!("chatcmpl-mock-{}", g.n);
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
        event(&json!({
            "id": id, "object": "chat.completion.chunk", "created": 1_700_000_000u64,
            "model": g.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }))
    };
    let calls_only = g.chunks == 0 && g.tool_calls > 0;
    let mut out = Vec::new();
    if !calls_only {
        out.push(chunk(
            json!({"role": "assistant", "content": ""}),
            json!(null),
        ));
    }
    for i in 0..g.chunks {
        out.push(chunk(json!({"content": g.text_piece(i)}), json!(null)));
    }
    for t in 0..g.tool_calls {
        let mut head = json!({"tool_calls": [{"index": t, "id": g.tool_call_id(t, Dialect::OpenAi), "type": "function",
                "function": {"name": "get_weather", "arguments": ""}}]});
        if calls_only && t == 0 {
            head["role"] = json!("assistant");
            head["content"] = json!(null);
        }
        out.push(chunk(head, json!(null)));
        for piece in g.tool_arguments(t).1 {
            out.push(chunk(
                json!({"tool_calls": [{"index": t, "function": {"arguments": piece}}]}),
                json!(null),
            ));
        }
    }
    let finish = if g.content_filtered {
        "content_filter"
    } else if g.tool_calls > 0 {
        "tool_calls"
    } else {
        "stop"
    };
    out.push(chunk(json!({}), json!(finish)));
    if g.include_usage {
        let c = g.completion_tokens();
        out.push(event(&json!({
            "id": id, "object": "chat.completion.chunk", "created": 1_700_000_000u64,
            "model": g.model, "choices": [],
            "usage": {"prompt_tokens": g.prompt_tokens, "completion_tokens": c,
                      "total_tokens": g.prompt_tokens + c},
        })));
    }
    out.push("data: [DONE]\n\n".to_string());
    out
}

/// A non-streaming OpenAI chat completion.
pub fn openai_body(g: &Generation) -> serde_json::Value {
    let tool_calls: Vec<_> = (0..g.tool_calls)
        .map(|t| {
            json!({"id": g.tool_call_id(t, Dialect::OpenAi), "type": "function",
                   "function": {"name": "get_weather", "arguments": g.tool_arguments(t).0}})
        })
        .collect();
    let mut message = json!({"role": "assistant", "content": g.text()});
    if !tool_calls.is_empty() {
        message["tool_calls"] = json!(tool_calls);
    }
    let finish = if g.content_filtered {
        "content_filter"
    } else if g.tool_calls > 0 {
        "tool_calls"
    } else {
        "stop"
    };
    let c = g.completion_tokens();
    json!({
        "id": format!("chatcmpl-mock-{}", g.n), "object": "chat.completion",
        "created": 1_700_000_000u64, "model": g.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": g.prompt_tokens, "completion_tokens": c,
                  "total_tokens": g.prompt_tokens + c},
    })
}

/// An Anthropic messages stream, one string per SSE event.
pub fn anthropic_stream(g: &Generation) -> Vec<String> {
    let mut out = vec![named(
        "message_start",
        &json!({"type": "message_start", "message": {
            "id": format!("msg_mock_{}", g.n), "type": "message", "role": "assistant",
            "model": g.model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": g.prompt_tokens, "output_tokens": 1}}}),
    )];
    out.push(named(
        "content_block_start",
        &json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}}),
    ));
    out.push(named("ping", &json!({"type": "ping"})));
    for i in 0..g.chunks {
        out.push(named(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": g.text_piece(i)}}),
        ));
    }
    out.push(named(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": 0}),
    ));
    for t in 0..g.tool_calls {
        let index = t + 1;
        out.push(named(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": g.tool_call_id(t, Dialect::Anthropic),
                                      "name": "get_weather", "input": {}}}),
        ));
        for piece in g.tool_arguments(t).1 {
            out.push(named(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ));
        }
        out.push(named(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": index}),
        ));
    }
    let stop = if g.content_filtered {
        "refusal"
    } else if g.tool_calls > 0 {
        "tool_use"
    } else {
        "end_turn"
    };
    out.push(named(
        "message_delta",
        &json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
                "usage": {"output_tokens": g.completion_tokens()}}),
    ));
    out.push(named("message_stop", &json!({"type": "message_stop"})));
    out
}

/// A non-streaming Anthropic message.
pub fn anthropic_body(g: &Generation) -> serde_json::Value {
    let mut content = vec![json!({"type": "text", "text": g.text()})];
    for t in 0..g.tool_calls {
        let args: serde_json::Value =
            serde_json::from_str(&g.tool_arguments(t).0).unwrap_or_default();
        content.push(
            json!({"type": "tool_use", "id": g.tool_call_id(t, Dialect::Anthropic),
                            "name": "get_weather", "input": args}),
        );
    }
    let stop = if g.content_filtered {
        "refusal"
    } else if g.tool_calls > 0 {
        "tool_use"
    } else {
        "end_turn"
    };
    json!({
        "id": format!("msg_mock_{}", g.n), "type": "message", "role": "assistant",
        "model": g.model, "content": content, "stop_reason": stop, "stop_sequence": null,
        "usage": {"input_tokens": g.prompt_tokens, "output_tokens": g.completion_tokens()},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(tool_calls: usize) -> Generation {
        Generation {
            n: 3,
            model: "m".into(),
            chunks: 2,
            tool_calls,
            prompt_tokens: 10,
            include_usage: true,
            content_filtered: false,
        }
    }

    #[test]
    fn openai_stream_shape() {
        let events = openai_stream(&g(2));
        // role + 2 text + 2 * (start + 4 pieces) + finish + usage + DONE
        assert_eq!(events.len(), 1 + 2 + 10 + 1 + 1 + 1);
        assert!(events.iter().all(|e| e.ends_with("\n\n")));
        assert!(events[events.len() - 3].contains("\"finish_reason\":\"tool_calls\""));
        assert_eq!(events.last().map(String::as_str), Some("data: [DONE]\n\n"));
        // Tool calls alone: the first call comes in the chunk that names the role.
        let calls_only = openai_stream(&Generation { chunks: 0, ..g(1) });
        assert_eq!(calls_only.len(), 5 + 1 + 1 + 1);
        assert!(
            calls_only[0].contains("\"role\":\"assistant\"")
                && calls_only[0].contains("\"tool_calls\""),
            "{}",
            calls_only[0]
        );
    }

    #[test]
    fn tool_argument_pieces_concatenate_to_valid_json() {
        for i in 0..3 {
            let (full, pieces) = g(3).tool_arguments(i);
            assert_eq!(pieces.concat(), full);
            assert!(serde_json::from_str::<serde_json::Value>(&full).is_ok());
        }
    }

    #[test]
    fn anthropic_stream_shape() {
        let events = anthropic_stream(&g(1));
        assert!(events[0].starts_with("event: message_start\n"));
        assert!(events.iter().any(|e| e.contains("\"tool_use\"")));
        assert_eq!(
            events.last().map(String::as_str),
            Some("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
        );
    }
}
