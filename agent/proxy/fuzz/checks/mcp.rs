//! The MCP `tools/call` path of the data plane, driven with arbitrary upstream
//! answers. Shared by the `mcp_response` fuzz target and the corpus regression test
//! (`tests/fuzz_corpus.rs`).
//!
//! The JSON-RPC response picker (`find_response`) is private to the proxy, so the
//! harness reaches it the way an agent does: a real [`Proxy`] with a real journal,
//! served on loopback, in front of a loopback MCP server that answers every call
//! with the input. An input is the answer's `Content-Type` on its first line and
//! the body after it. For every input:
//! - the sidecar answers (no panic, no hang, no 5xx of its own);
//! - when the body holds the JSON-RPC response for the request's id (the first
//!   message with that id and a `result` or `error`: the body itself, a batch
//!   element, or an SSE event's data), the agent gets exactly that outcome,
//!   re-wrapped as `{"jsonrpc":"2.0","id":<its id>, …}`;
//!   The same call again (same idempotency key) is answered from the journal,
//!   marked `Outrigger-Replayed: true`, identical to the first answer, and never
//!   reaches the server;
//! - otherwise the call's outcome is unknown (a success without its response): the
//!   agent gets the in-doubt tool result for its id, never the body as if it were an
//!   outcome, and the same call again is re-sent with its key (the server is
//!   `keyed`) and is in doubt again.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use outrigger_journal::Journal;
use outrigger_proxy::body::{Body, full};
use outrigger_proxy::options::{Options, Tool, ToolKind};
use outrigger_proxy::{Components, Proxy, headers, sse};
use outrigger_telemetry::Metrics;
use outrigger_types::ToolClass;
use serde_json::{Value, json};

/// The JSON-RPC id of every call the harness makes.
const REQUEST_ID: i64 = 7;

/// What the loopback MCP server answers: content type and body.
type Answer = Arc<Mutex<(Option<HeaderValue>, Bytes)>>;

/// A sidecar data plane and an MCP server, both on loopback.
pub struct Harness {
    sidecar: SocketAddr,
    answer: Answer,
    upstream_calls: Arc<AtomicU64>,
    next_key: AtomicU64,
    client: Client<HttpConnector, Full<Bytes>>,
    _stop: tokio::sync::watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

impl Harness {
    /// Starts the journal, the MCP server and the data plane. Call inside a tokio
    /// runtime that keeps running between checks.
    pub async fn start() -> Harness {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let (journal, writer, _) =
            Journal::open(outrigger_journal::Options::new(dir.path().join("journal")))
                .unwrap_or_else(|e| panic!("journal: {e}"));
        tokio::spawn(writer.run());

        let (stop, stopped) = tokio::sync::watch::channel(false);
        let answer: Answer = Arc::default();
        let upstream_calls = Arc::new(AtomicU64::new(0));
        let (a, calls) = (answer.clone(), upstream_calls.clone());
        let mcp = serve_on_loopback(
            move |req, _peer| {
                let (a, calls) = (a.clone(), calls.clone());
                async move {
                    // Read the request so the connection stays reusable.
                    let _ = req.into_body().collect().await;
                    calls.fetch_add(1, Ordering::SeqCst);
                    let (content_type, body) = a
                        .lock()
                        .map(|g| g.clone())
                        .unwrap_or_else(|e| panic!("answer lock: {e}"));
                    let mut resp = http::Response::new(full(body));
                    if let Some(ct) = content_type {
                        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
                    }
                    resp
                }
            },
            stopped.clone(),
        )
        .await;

        let base_url: Uri = format!("http://{mcp}/mcp")
            .parse()
            .unwrap_or_else(|e| panic!("uri: {e}"));
        let options = Options {
            tools: vec![Tool {
                name: "fuzz".into(),
                kind: ToolKind::Mcp,
                base_url,
                class: ToolClass::Keyed,
                key_required: false,
                journal_get: false,
                timeout: Duration::from_secs(10),
                probe_path: None,
                redact: Default::default(),
            }],
            ..Options::default()
        };
        let proxy = Proxy::new(options, Components::new(Metrics::new(), Some(journal)));
        let sidecar = serve_on_loopback(
            move |req, peer| {
                let proxy = proxy.clone();
                async move { proxy.handle(req, peer).await }
            },
            stopped,
        )
        .await;
        Harness {
            sidecar,
            answer,
            upstream_calls,
            next_key: AtomicU64::new(1),
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            _stop: stop,
            _dir: dir,
        }
    }

    /// Runs one input through the data plane and checks every invariant.
    pub async fn check(&self, input: &[u8]) {
        let (first_line, body) = match input.iter().position(|b| *b == b'\n') {
            Some(i) => (&input[..i], &input[i + 1..]),
            None => (input, &[][..]),
        };
        let content_type = HeaderValue::from_bytes(first_line.trim_ascii())
            .ok()
            .filter(|v| !v.is_empty());
        let body = Bytes::copy_from_slice(body);
        if let Ok(mut a) = self.answer.lock() {
            *a = (content_type.clone(), body.clone());
        }
        let mut upstream_headers = HeaderMap::new();
        if let Some(ct) = content_type {
            upstream_headers.insert(header::CONTENT_TYPE, ct);
        }
        let expected = reference_pick(&upstream_headers, &body, &json!(REQUEST_ID));

        let n = self.next_key.fetch_add(1, Ordering::SeqCst);
        let key = format!("fuzz-{n}");
        let before = self.upstream_calls.load(Ordering::SeqCst);
        let (status, replayed, first) = self.call(&key, n).await;
        assert_eq!(
            self.upstream_calls.load(Ordering::SeqCst),
            before + 1,
            "the call reached the server once"
        );
        assert!(replayed.is_none(), "a first call is not a replay");
        match &expected {
            Some(outcome) => {
                assert_eq!(status, StatusCode::OK);
                assert_eq!(
                    parse(&first),
                    wrap(outcome),
                    "the agent gets the JSON-RPC outcome for its id"
                );
            }
            None => {
                assert_eq!(status, StatusCode::OK);
                assert_in_doubt(&first, &body);
                let (_, again_replayed, again) = self.call(&key, n).await;
                assert_eq!(
                    self.upstream_calls.load(Ordering::SeqCst),
                    before + 2,
                    "a keyed call in doubt is re-sent with its key"
                );
                assert!(again_replayed.is_none(), "nothing to replay");
                assert_in_doubt(&again, &body);
                return;
            }
        }

        let (again_status, again_replayed, again) = self.call(&key, n).await;
        assert_eq!(
            self.upstream_calls.load(Ordering::SeqCst),
            before + 1,
            "a repeated call never reaches the server"
        );
        assert_eq!(
            again_replayed.as_deref(),
            Some("true"),
            "marked as replayed"
        );
        assert_eq!(again_status, status, "the replay keeps the status");
        assert_eq!(parse(&again), parse(&first), "the replay is the answer");
    }

    async fn call(&self, key: &str, n: u64) -> (StatusCode, Option<String>, Bytes) {
        let request = json!({"jsonrpc": "2.0", "id": REQUEST_ID, "method": "tools/call",
            "params": {"name": "echo", "arguments": {"n": n}}});
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("http://{}/mcp/fuzz", self.sidecar))
            .header(header::CONTENT_TYPE, "application/json")
            .header(headers::IDEMPOTENCY_KEY, key)
            .body(Full::new(Bytes::from(request.to_string())))
            .unwrap_or_else(|e| panic!("request: {e}"));
        let resp = tokio::time::timeout(Duration::from_secs(20), self.client.request(req))
            .await
            .unwrap_or_else(|_| panic!("the sidecar answers within 20 s"))
            .unwrap_or_else(|e| panic!("the sidecar answers: {e}"));
        let status = resp.status();
        let replayed = resp
            .headers()
            .get(headers::REPLAYED)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = tokio::time::timeout(Duration::from_secs(20), resp.into_body().collect())
            .await
            .unwrap_or_else(|_| panic!("the body arrives within 20 s"))
            .unwrap_or_else(|e| panic!("the body arrives: {e}"))
            .to_bytes();
        (status, replayed, body)
    }
}

/// Serves `handler` on `127.0.0.1:0` with the data plane's own server until `stop`
/// turns true; the bound address.
async fn serve_on_loopback<H, F>(
    handler: H,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> SocketAddr
where
    H: Fn(Request<hyper::body::Incoming>, SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = http::Response<Body>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap_or_else(|e| panic!("bind: {e}"));
    let addr = listener
        .local_addr()
        .unwrap_or_else(|e| panic!("addr: {e}"));
    tokio::spawn(outrigger_proxy::server::serve(
        listener,
        handler,
        async move {
            let _ = stop.wait_for(|s| *s).await;
        },
        Duration::from_secs(1),
    ));
    addr
}

/// The in-doubt tool result for the request's id, whatever the server's body was.
fn assert_in_doubt(answer: &[u8], upstream: &[u8]) {
    let v = parse(answer);
    assert_eq!(v["id"], json!(REQUEST_ID), "{v}");
    assert_eq!(
        v["result"]["isError"],
        true,
        "a success without the call's response is in doubt (upstream {:?}): {v}",
        String::from_utf8_lossy(upstream)
    );
}

fn parse(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "the sidecar's JSON-RPC answer is JSON ({e}): {:?}",
            String::from_utf8_lossy(body)
        )
    })
}

/// `{"jsonrpc":"2.0","id":<id>}` plus the outcome's `result` or `error`.
fn wrap(outcome: &Value) -> Value {
    let mut doc = json!({"jsonrpc": "2.0", "id": REQUEST_ID});
    if let (Some(d), Some(o)) = (doc.as_object_mut(), outcome.as_object()) {
        d.extend(o.clone());
    }
    doc
}

/// The response to `id` in an answer, as the MCP Streamable HTTP transport defines
/// it: a JSON body (one message or a batch) or an SSE stream whose events carry
/// messages; the first message with that id and a `result` or `error` is it.
fn reference_pick(h: &HeaderMap, body: &[u8], id: &Value) -> Option<Value> {
    let outcome = |msg: &Value| -> Option<Value> {
        let obj = msg.as_object()?;
        if obj.get("id") != Some(id) {
            return None;
        }
        match (obj.get("result"), obj.get("error")) {
            (Some(r), _) => Some(json!({"result": r})),
            (None, Some(e)) => Some(json!({"error": e})),
            (None, None) => None,
        }
    };
    let in_message = |v: Value| -> Option<Value> {
        match v {
            Value::Array(batch) => batch.iter().find_map(outcome),
            single => outcome(&single),
        }
    };
    if headers::is_event_stream(h) {
        let mut framer = sse::Framer::default();
        let mut blocks = Vec::new();
        framer.push(body, &mut blocks).ok()?;
        framer.finish(&mut blocks);
        blocks
            .iter()
            .filter_map(|b| sse::parse(b).data)
            .filter_map(|d| serde_json::from_str::<Value>(&d).ok())
            .find_map(in_message)
    } else {
        serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(in_message)
    }
}
