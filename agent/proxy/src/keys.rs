//! Idempotency keys and fingerprints for tool calls, and the correlation of tool
//! calls with the tool calls a model issued, which lets the sidecar derive a key the
//! agent never sent.
//!
//! **Key derivation** (the README repeats this): when a call carries no key but a
//! task id and a tool-call id — from the `Outrigger-Tool-Call-Id` header, or found
//! by matching the call to a tool call in the task's latest model responses — the
//! key is `tc-` followed by the first 40 hex digits of
//! `SHA-256("outrigger/v1" 0x00 task_id 0x00 tool 0x00 tool_call_id)`. A restarted
//! agent replayed the same model response (same `tool_call_id`s) therefore derives
//! the same keys, and its repeated tool calls dedupe against the journal.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use outrigger_types::{Fingerprint, IdempotencyKey, TaskId};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::canonical;

/// The journal key for an agent-supplied key, scoped to the tool (two tools may
/// see the same agent key without colliding). Long keys are hashed to fit.
pub fn scoped(tool: &str, key: &IdempotencyKey) -> IdempotencyKey {
    let joined = format!("{tool}/{key}");
    match IdempotencyKey::new(joined) {
        Ok(k) => k,
        Err(_) => {
            let digest = hex(&Sha256::digest(format!("{tool}\0{key}").as_bytes()));
            // A tool name too long to prefix (configuration refuses those) still
            // gets a key of its own: the digest covers it.
            IdempotencyKey::new(format!("{tool}/sha256:{digest}"))
                .or_else(|_| IdempotencyKey::new(format!("sha256:{digest}")))
                .unwrap_or_else(|_| key.clone())
        }
    }
}

/// The key derived from a task and a model-issued tool-call id (see the module docs).
pub fn derived(task: &TaskId, tool: &str, tool_call_id: &str) -> IdempotencyKey {
    let mut h = Sha256::new();
    for (i, part) in ["outrigger/v1", task.as_str(), tool, tool_call_id]
        .iter()
        .enumerate()
    {
        if i > 0 {
            h.update([0u8]);
        }
        h.update(part.as_bytes());
    }
    IdempotencyKey::derived(&hex(&h.finalize()))
}

/// SHA-256 over the canonical form of `value` (RFC 8785, ordered as
/// [`canonical`](crate::canonical) says).
pub fn fingerprint(value: &Value) -> Fingerprint {
    let mut out = Vec::new();
    canonical_into(value, &mut out);
    Fingerprint(Sha256::digest(&out).into())
}

/// Appends the canonical form of `value` to `out`: written in one pass, or by
/// `serde_jcs` where the value holds a float (serde_json's form, if even that refuses).
fn canonical_into(value: &Value, out: &mut Vec<u8>) {
    let start = out.len();
    if canonical::write(value, out) {
        return;
    }
    out.truncate(start);
    match serde_jcs::to_vec(value) {
        Ok(general) => out.extend_from_slice(&general),
        Err(_) => out.extend_from_slice(value.to_string().as_bytes()),
    }
}

/// The fingerprint of an HTTP tool call: method, tool, path and query, content
/// type and the body (canonicalised when it is JSON whose objects name each member
/// once; otherwise its bytes' SHA-256). Other headers are volatile
/// (tracing ids, dates, user agents) and left out.
///
/// What is hashed is the canonical form of
/// `{"body": {"json": BODY} | {"sha256": HEX}, "content_type", "method", "path", "tool"}`,
/// written here in its canonical key order without building the object.
pub fn http_fingerprint(
    method: &str,
    tool: &str,
    path: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> Fingerprint {
    let mut out = Vec::with_capacity(body.len() + 128);
    out.extend_from_slice(b"{\"body\":{");
    // A body naming a member twice is hashed as bytes: readers disagree on which
    // of the two it says.
    match canonical::parse_unique(body) {
        Ok(v) => {
            out.extend_from_slice(b"\"json\":");
            canonical_into(&v, &mut out);
        }
        Err(_) => {
            out.extend_from_slice(b"\"sha256\":");
            canonical::string(&hex(&Sha256::digest(body)), &mut out);
        }
    }
    out.push(b'}');
    fields(
        &mut out,
        [
            ("content_type", content_type.unwrap_or("")),
            ("method", method),
            ("path", path),
            ("tool", tool),
        ],
    );
    Fingerprint(Sha256::digest(&out).into())
}

/// The fingerprint of an MCP `tools/call`: server, tool name and arguments (not the
/// JSON-RPC id: a retry carries a new one). The canonical form of
/// `{"arguments", "method": "tools/call", "name", "server"}`, written in key order.
/// A call without arguments (absent or `null`) is the same call as one with `{}`, as
/// in [`arguments_fingerprint`]: a retry may send either.
pub fn mcp_fingerprint(server: &str, name: &str, arguments: &Value) -> Fingerprint {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"{\"arguments\":");
    match arguments {
        Value::Null => out.extend_from_slice(b"{}"),
        other => canonical_into(other, &mut out),
    }
    fields(
        &mut out,
        [("method", "tools/call"), ("name", name), ("server", server)],
    );
    Fingerprint(Sha256::digest(&out).into())
}

/// Appends `,"key":"value"` for each pair (in the order given, which must be the
/// canonical one) and closes the object.
fn fields<const N: usize>(out: &mut Vec<u8>, pairs: [(&str, &str); N]) {
    for (key, value) in pairs {
        out.push(b',');
        canonical::string(key, out);
        out.push(b':');
        canonical::string(value, out);
    }
    out.push(b'}');
}

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    s
}

/// A tool call a model issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedCall {
    pub id: String,
    pub name: String,
    /// Fingerprint of the canonical arguments.
    pub arguments: Fingerprint,
}

impl IssuedCall {
    /// Builds one from the arguments as the model wrote them (OpenAI sends a JSON
    /// string, Anthropic an object).
    pub fn new(id: &str, name: &str, arguments: &Value) -> Self {
        let parsed = match arguments {
            Value::String(s) if s.trim().is_empty() => Value::Null,
            Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| arguments.clone()),
            other => other.clone(),
        };
        Self {
            id: id.to_string(),
            name: name.to_string(),
            arguments: arguments_fingerprint(&parsed),
        }
    }
}

/// The fingerprint of a call's arguments, as issued and as received: no arguments
/// (`null`, or left out, as MCP clients do for a tool that takes none) are the
/// empty object a model writes for such a call.
pub fn arguments_fingerprint(arguments: &Value) -> Fingerprint {
    match arguments {
        Value::Null => fingerprint(&Value::Object(serde_json::Map::new())),
        other => fingerprint(other),
    }
}

/// The tool calls models issued per task, newest response last (bounded), each with
/// the number of the response (turn) that issued it.
#[derive(Debug, Default)]
pub struct Correlator {
    tasks: Mutex<HashMap<TaskId, VecDeque<(u64, IssuedCall)>>>,
    turns: std::sync::atomic::AtomicU64,
}

const PER_TASK: usize = 256;
const TASKS: usize = 4096;

impl Correlator {
    /// Remembers the tool calls of one model response.
    pub fn record(&self, task: &TaskId, calls: Vec<IssuedCall>) {
        if calls.is_empty() {
            return;
        }
        let Ok(mut tasks) = self.tasks.lock() else {
            return;
        };
        if tasks.len() >= TASKS && !tasks.contains_key(task) {
            // Forget the task whose last model turn is oldest rather than grow
            // without bound (a busy task keeps the calls its retries match).
            let oldest = tasks
                .iter()
                .min_by_key(|(_, q)| q.back().map_or(0, |(turn, _)| *turn))
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                tasks.remove(&k);
            }
        }
        let turn = self
            .turns
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let q = tasks.entry(task.clone()).or_default();
        for c in calls {
            // A call recorded before (its turn replayed to a restarted agent) is the
            // newest again, with this turn: the agent is about to make it.
            if let Some(at) = q.iter().position(|(_, e)| e.id == c.id) {
                if q[at].0 == turn {
                    continue;
                }
                q.remove(at);
            }
            q.push_back((turn, c));
        }
        while q.len() > PER_TASK {
            q.pop_front();
        }
    }

    /// The id of the tool call in `task` whose arguments match (and, when given,
    /// whose name matches), searching from the most recently recorded call back: a
    /// call repeated over turns resolves to the newest turn's. Two matching calls of
    /// that one turn cannot be told apart (an HTTP call carries no function name):
    /// no id, rather than one key for both, which would run only the first.
    pub fn find(
        &self,
        task: &TaskId,
        name: Option<&str>,
        arguments: &Fingerprint,
    ) -> Option<String> {
        let tasks = self.tasks.lock().ok()?;
        let matches =
            |c: &IssuedCall| &c.arguments == arguments && name.is_none_or(|n| n == c.name);
        let mut found = tasks.get(task)?.iter().rev().filter(|(_, c)| matches(c));
        let (turn, newest) = found.next()?;
        if found.any(|(t, _)| t == turn) {
            tracing::debug!(%task, "two tool calls of one turn match this request; no key is derived");
            return None;
        }
        Some(newest.id.clone())
    }
}

/// Tool calls in a complete (non-streamed) model response body.
pub fn calls_in_response(body: &Value) -> Vec<IssuedCall> {
    let mut out = Vec::new();
    // OpenAI: choices[].message.tool_calls[]
    for choice in body["choices"].as_array().into_iter().flatten() {
        for tc in choice["message"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let (Some(id), Some(name)) = (tc["id"].as_str(), tc["function"]["name"].as_str()) {
                out.push(IssuedCall::new(id, name, &tc["function"]["arguments"]));
            }
        }
    }
    // Anthropic: content[] of type tool_use
    for block in body["content"].as_array().into_iter().flatten() {
        if block["type"] == "tool_use"
            && let (Some(id), Some(name)) = (block["id"].as_str(), block["name"].as_str())
        {
            out.push(IssuedCall::new(id, name, &block["input"]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_are_stable_and_distinct() {
        let t = TaskId::new("task-1").unwrap();
        let a = derived(&t, "payments", "call_1");
        assert_eq!(a, derived(&t, "payments", "call_1"));
        assert_ne!(a, derived(&t, "payments", "call_2"));
        assert_ne!(a, derived(&t, "refunds", "call_1"));
        assert!(a.as_str().starts_with("tc-") && a.as_str().len() == 43);
    }

    #[test]
    fn scoped_keys_fit_the_limit() {
        let k = IdempotencyKey::new("x".repeat(255)).unwrap();
        let s = scoped("payments", &k);
        assert!(s.as_str().starts_with("payments/sha256:"));
        assert_eq!(
            scoped("p", &IdempotencyKey::new("abc").unwrap()).as_str(),
            "p/abc"
        );
        // However long the tool's name, two tools never share a key.
        let (a, b) = ("a".repeat(200), "b".repeat(200));
        assert_ne!(scoped(&a, &k), scoped(&b, &k));
        assert_ne!(scoped(&a, &k), k);
    }

    #[test]
    fn fingerprints_ignore_key_order_and_whitespace() {
        let a = http_fingerprint(
            "POST",
            "t",
            "/x",
            Some("application/json"),
            br#"{"a":1,"b":[1,2]}"#,
        );
        let b = http_fingerprint(
            "POST",
            "t",
            "/x",
            Some("application/json"),
            b"{ \"b\": [1, 2], \"a\": 1 }",
        );
        let c = http_fingerprint(
            "POST",
            "t",
            "/x",
            Some("application/json"),
            br#"{"a":2,"b":[1,2]}"#,
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    /// A body naming a member twice is fingerprinted by its bytes, so it is never
    /// taken for the body that keeps one of the two.
    #[test]
    fn a_body_naming_a_member_twice_is_fingerprinted_as_bytes() {
        let fp = |body: &[u8]| http_fingerprint("POST", "pay", "/x", None, body);
        let twice = br#"{"amount":5,"amount":500}"#;
        assert_ne!(fp(twice), fp(br#"{"amount":500}"#));
        assert_ne!(fp(twice), fp(br#"{"amount":5}"#));
        assert_ne!(fp(twice), fp(br#"{"amount":5, "amount":500}"#));
        assert_eq!(fp(br#"{"b":1,"a":2}"#), fp(br#"{"a":2, "b":1}"#));
    }

    /// The fingerprints written field by field are the ones the journal has always
    /// stored: the canonical form of the whole object, built and sorted by serde_jcs.
    #[test]
    fn fingerprints_match_the_canonical_form_of_the_whole_object() {
        let whole = |v: &Value| Fingerprint(Sha256::digest(serde_jcs::to_vec(v).unwrap()).into());
        for body in [
            &br#"{"b": [1, 2.5, "x\u0001"], "a": {"\u00e9": null}}"#[..],
            b"not json \x00\xff",
            b"",
        ] {
            let expected_body = match serde_json::from_slice::<Value>(body) {
                Ok(v) => serde_json::json!({"json": v}),
                Err(_) => serde_json::json!({"sha256": hex(&Sha256::digest(body))}),
            };
            let expected = whole(&serde_json::json!({
                "method": "POST", "tool": "pay\"ments", "path": "/x?y=1",
                "content_type": "", "body": expected_body,
            }));
            assert_eq!(
                http_fingerprint("POST", "pay\"ments", "/x?y=1", None, body),
                expected
            );
        }
        let args = serde_json::json!({"to": "bob", "amount": 5, "rate": 0.25});
        assert_eq!(
            mcp_fingerprint("srv", "send", &args),
            whole(&serde_json::json!({
                "method": "tools/call", "server": "srv", "name": "send", "arguments": args,
            }))
        );
        assert_eq!(fingerprint(&args), whole(&args));
        let empty = serde_json::json!({});
        assert_eq!(
            mcp_fingerprint("srv", "send", &Value::Null),
            mcp_fingerprint("srv", "send", &empty),
            "a call without arguments is the call with {{}}"
        );
        assert_ne!(
            mcp_fingerprint("srv", "send", &empty),
            mcp_fingerprint("srv", "send", &serde_json::json!({"to": "bob"}))
        );
    }

    #[test]
    fn correlation_matches_arguments_in_either_dialect() {
        let c = Correlator::default();
        let t = TaskId::new("t").unwrap();
        let openai = serde_json::json!({"choices": [{"message": {"tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "pay", "arguments": "{\"amount\": 5, \"to\": \"bob\"}"}}]}}]});
        let anthropic = serde_json::json!({"content": [{"type": "text", "text": "x"},
            {"type": "tool_use", "id": "toolu_2", "name": "mail", "input": {"to": "amy"}}]});
        c.record(&t, calls_in_response(&openai));
        c.record(&t, calls_in_response(&anthropic));
        let args = fingerprint(&serde_json::json!({"to": "bob", "amount": 5}));
        assert_eq!(c.find(&t, None, &args).as_deref(), Some("call_1"));
        assert_eq!(c.find(&t, Some("pay"), &args).as_deref(), Some("call_1"));
        assert_eq!(c.find(&t, Some("other"), &args), None);
        let mail = fingerprint(&serde_json::json!({"to": "amy"}));
        assert_eq!(c.find(&t, Some("mail"), &mail).as_deref(), Some("toolu_2"));
        assert_eq!(c.find(&TaskId::new("u").unwrap(), None, &mail), None);
    }

    /// A call that takes no arguments is issued as `{}` (or `""`, streamed) and
    /// received without them (an MCP client leaves `arguments` out): they match.
    #[test]
    fn no_arguments_match_the_empty_object() {
        let c = Correlator::default();
        let t = TaskId::new("t").unwrap();
        let empty = serde_json::json!({});
        c.record(
            &t,
            vec![IssuedCall::new(
                "call_1",
                "restart",
                &serde_json::json!("{}"),
            )],
        );
        c.record(
            &t,
            vec![IssuedCall::new("call_2", "reboot", &serde_json::json!(""))],
        );
        for received in [serde_json::Value::Null, empty.clone()] {
            let args = arguments_fingerprint(&received);
            assert_eq!(
                c.find(&t, Some("restart"), &args).as_deref(),
                Some("call_1")
            );
            assert_eq!(c.find(&t, Some("reboot"), &args).as_deref(), Some("call_2"));
        }
        assert_ne!(
            arguments_fingerprint(&serde_json::json!({"n": 1})),
            arguments_fingerprint(&serde_json::Value::Null)
        );
    }

    /// Two turns issue the same call (same name and arguments, new ids). A
    /// restarted agent has the first turn replayed: its call is the newest again,
    /// so the agent's repeat of it derives the first call's key, not the second's;
    /// the second turn's replay then makes its own call the newest.
    #[test]
    fn a_replayed_turns_calls_are_the_newest_again() {
        let c = Correlator::default();
        let t = TaskId::new("t").unwrap();
        let args = serde_json::json!({"sym": "X"});
        let turn = |id: &str| vec![IssuedCall::new(id, "get_price", &args)];
        c.record(&t, turn("call_1"));
        c.record(&t, turn("call_2"));
        let received = fingerprint(&args);
        assert_eq!(c.find(&t, None, &received).as_deref(), Some("call_2"));
        c.record(&t, turn("call_1"));
        assert_eq!(c.find(&t, None, &received).as_deref(), Some("call_1"));
        c.record(&t, turn("call_2"));
        assert_eq!(c.find(&t, None, &received).as_deref(), Some("call_2"));
        // One response listing a call twice records it once.
        c.record(&t, [turn("call_3"), turn("call_3")].concat());
        assert_eq!(c.find(&t, None, &received).as_deref(), Some("call_3"));
    }

    /// Full, the correlator forgets the task whose last turn is oldest, not one
    /// that has just been active.
    #[test]
    fn a_full_correlator_forgets_the_task_idle_longest() {
        let c = Correlator::default();
        let call = |id: &str| IssuedCall::new(id, "f", &serde_json::json!({"n": id}));
        let task = |n: usize| TaskId::new(format!("t{n}")).unwrap();
        for n in 0..TASKS {
            c.record(&task(n), vec![call(&format!("c{n}"))]);
        }
        // The first task is active again; the second is now idle longest.
        c.record(&task(0), vec![call("again")]);
        c.record(&task(TASKS), vec![call("new")]);
        let found = |n: usize, id: &str| {
            c.find(&task(n), None, &fingerprint(&serde_json::json!({"n": id})))
        };
        assert_eq!(
            found(0, "c0").as_deref(),
            Some("c0"),
            "the active task kept"
        );
        assert_eq!(found(1, "c1"), None, "the task idle longest forgotten");
        assert_eq!(found(2, "c2").as_deref(), Some("c2"));
        assert_eq!(found(TASKS, "new").as_deref(), Some("new"));
    }

    #[test]
    fn identical_calls_of_one_turn_derive_no_key_and_a_later_turn_wins() {
        let c = Correlator::default();
        let t = TaskId::new("t").unwrap();
        let call = |id: &str, name: &str| IssuedCall::new(id, name, &serde_json::json!({}));
        let empty = fingerprint(&serde_json::json!({}));
        c.record(&t, vec![call("a1", "build"), call("a2", "deploy")]);
        assert_eq!(c.find(&t, None, &empty), None, "build or deploy?");
        assert_eq!(c.find(&t, Some("deploy"), &empty).as_deref(), Some("a2"));
        // The same call again in a later turn is that turn's.
        c.record(&t, vec![call("b1", "build")]);
        assert_eq!(c.find(&t, None, &empty).as_deref(), Some("b1"));
    }
}
