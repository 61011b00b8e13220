//! Security checks on the real binary (reliability matrix rows S1–S3):
//!
//! - S1, admin exposure: the admin plane binds loopback by default; a non-loopback
//!   bind without a token is refused at start-up; with a token every route but
//!   `/healthz` and `/readyz` needs it, and routes that change state are refused to
//!   peers that are not on loopback (checked through a non-loopback address of this
//!   machine, so the peer really is not loopback);
//! - S2, secret leakage: canary credentials (the agent's key, the provider key, the
//!   admin token) appear in no log line, metric, journal byte or response, across
//!   model calls in both dialects, tool and MCP calls, replays and upstream errors
//!   that quote the request's headers;
//! - S3, key exfiltration: no request shape (absolute-form URI, `Host` header,
//!   `CONNECT`, path tricks) makes the sidecar send anything, let alone the provider
//!   key, to a host other than the configured one.
//!
//! S4 (policies get no capabilities) is the policy host's business and is tested
//! there, on the real WebAssembly components.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};
use outrigger_testing::http::{Server, json_response, read_body};
use outrigger_testing::mcp::{META_KEY, MockMcp};
use outrigger_testing::provider::{Behaviour, MockProvider};
use outrigger_testing::tool::{MockTool, ToolBehaviour};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

/// `<prefix>-canary-<16 random hex digits>`: unique per run, so a hit is a leak from
/// this run and nothing else.
fn canary(prefix: &str) -> String {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    format!("{prefix}-canary-{:016x}", h.finish())
}

/// Status line, headers and body of a reply, as text to scan.
fn transcript(r: &Reply) -> String {
    let mut s = format!("{}\n", r.status);
    for (k, v) in &r.headers {
        s.push_str(&format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())));
    }
    s.push_str(&r.text());
    s
}

/// Every file under `dir`, recursively, with its bytes.
fn files_under(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(bytes) = std::fs::read(&path) {
                out.push((path.display().to_string(), bytes));
            }
        }
    }
    out
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

// ---------------------------------------------------------------------------
// S1: admin exposure
// ---------------------------------------------------------------------------

#[tokio::test]
async fn the_admin_plane_binds_loopback_by_default() {
    // With no listen section at all, the check reports the defaults.
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("empty.toml");
    std::fs::write(&config, "").expect("write config");
    let out = Command::new(outrigger_bin())
        .args(["config", "check", "--config"])
        .arg(&config)
        .env_clear()
        .output()
        .expect("outrigger runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let admin: SocketAddr = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("admin plane"))
        .map(str::trim)
        .expect("the check names the admin address")
        .parse()
        .expect("a socket address");
    assert!(admin.ip().is_loopback(), "default admin address {admin}");

    // A running sidecar reports a loopback admin address in its ready file, and is
    // not reachable on this machine's other addresses.
    let sidecar = Sidecar::start("", &[]).await;
    assert!(sidecar.admin.ip().is_loopback(), "{}", sidecar.admin);
    assert_eq!(
        get(&sidecar.admin_url("/healthz")).await.status,
        StatusCode::OK
    );
    if let Some(ip) = non_loopback_local_ip() {
        let other = SocketAddr::new(ip, sidecar.admin.port());
        let connected = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect(other),
        )
        .await;
        assert!(
            matches!(connected, Ok(Err(_))),
            "the admin port answers on {other}: {connected:?}"
        );
    }
}

#[tokio::test]
async fn a_non_loopback_admin_bind_without_a_token_is_refused_at_start_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("outrigger.toml");
    std::fs::write(
        &config,
        format!(
            "[listen]\ndata = \"127.0.0.1:0\"\nadmin = \"0.0.0.0:0\"\n[journal]\ndir = {:?}\n",
            dir.path().join("data").display().to_string()
        ),
    )
    .expect("write config");
    let ready = dir.path().join("ready.json");
    let mut child = Command::new(outrigger_bin())
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .arg("--ready-file")
        .arg(&ready)
        .env_remove("OUTRIGGER_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn outrigger");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("outrigger started with a public admin plane and no token");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut stderr);
    }
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("admin.token") && stderr.contains("not loopback"),
        "the refusal names the key and the reason: {stderr}"
    );
    assert!(!ready.exists(), "it never became ready");
}

/// The journal CLI sends the admin token from `OUTRIGGER_ADMIN_TOKEN` trimmed, as
/// the sidecar reads its own: a token from a secret file ends in a newline.
#[tokio::test]
async fn the_journal_cli_trims_the_admin_token_like_the_sidecar() {
    let token = canary("admin");
    let sidecar = Sidecar::start(&format!("[admin]\ntoken = \"{token}\"\n"), &[]).await;
    let out = Command::new(outrigger_bin())
        .args(["journal", "list", "--admin"])
        .arg(format!("http://{}", sidecar.admin))
        .arg("--data-dir")
        .arg(sidecar.dir.path().join("data"))
        .env("OUTRIGGER_ADMIN_TOKEN", format!("{token}\n"))
        .output()
        .expect("run the cli");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("through its admin API"), "{err}");
}

/// Routes that read: each needs the token.
const READ_ROUTES: &[&str] = &[
    "/metrics",
    "/v1/journal",
    "/v1/journal/some-key",
    "/v1/tasks",
    "/v1/policies",
    "/v1/gpu",
    "/v1/slo",
    "/v1/faults",
    "/no-such-route",
];

#[tokio::test]
async fn with_a_token_every_admin_route_but_health_needs_it() {
    let token = canary("admin");
    let sidecar = Sidecar::start(&format!("[admin]\ntoken = \"{token}\"\n"), &[]).await;
    let bearer = format!("Bearer {token}");
    let admin = |path: &str| sidecar.admin_url(path);
    let with = |method: Method, path: &str, auth: Option<&str>, body: &str| {
        let mut h = vec![("content-type", "application/json")];
        if let Some(a) = auth {
            h.push(("authorization", a));
        }
        request(method, &admin(path), &h, body.to_string())
    };

    for path in ["/healthz", "/readyz"] {
        let r = get(&admin(path)).await;
        assert_ne!(r.status, StatusCode::UNAUTHORIZED, "{path} is open");
    }
    for path in READ_ROUTES {
        for auth in [None, Some("Bearer wrong"), Some(token.as_str())] {
            let r = send(with(Method::GET, path, auth, "")).await;
            assert_eq!(
                r.status,
                StatusCode::UNAUTHORIZED,
                "GET {path} with {auth:?}"
            );
            assert_eq!(r.header("www-authenticate"), Some("Bearer"), "GET {path}");
            assert!(!r.text().contains(&token), "GET {path} echoes the token");
        }
        let r = send(with(Method::GET, path, Some(&bearer), "")).await;
        assert_ne!(
            r.status,
            StatusCode::UNAUTHORIZED,
            "GET {path} with the token"
        );
    }
    let mutating: [(&str, &str); 4] = [
        ("/v1/policies/reload", ""),
        ("/v1/faults", r#"{"journal": null}"#),
        ("/v1/journal/no-such-key/resolve", r#"{"action": "retry"}"#),
        ("/v1/tasks/no-such-task/end", r#"{"outcome": "success"}"#),
    ];
    for (path, body) in mutating {
        let r = send(with(Method::POST, path, None, body)).await;
        assert_eq!(
            r.status,
            StatusCode::UNAUTHORIZED,
            "POST {path} without the token"
        );
        let r = send(with(Method::POST, path, Some(&bearer), body)).await;
        assert!(
            !matches!(r.status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN),
            "POST {path} from loopback with the token: {} {}",
            r.status,
            r.text()
        );
    }
    // A route asked with a method it does not answer says which it does.
    let wrong: [(Method, &str, &str); 6] = [
        (Method::POST, "/v1/policies", "GET"),
        (Method::GET, "/v1/policies/reload", "POST"),
        (Method::POST, "/v1/gpu", "GET"),
        (Method::DELETE, "/v1/journal", "GET"),
        (Method::POST, "/v1/journal/some-key", "GET"),
        (Method::PUT, "/v1/journal/some-key/resolve", "GET, POST"),
    ];
    for (method, path, allow) in wrong {
        let r = send(with(method.clone(), path, Some(&bearer), "")).await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
    }
    for path in ["/healthz", "/readyz"] {
        let r = send(with(Method::HEAD, path, None, "")).await;
        assert!(
            matches!(r.status, StatusCode::OK | StatusCode::SERVICE_UNAVAILABLE),
            "HEAD {path}: {}",
            r.status
        );
        assert!(r.body.is_empty(), "HEAD {path} has no body");
    }
    let logs = sidecar.logs();
    assert!(!logs.contains(&token), "the admin token is in the log");
}

/// An address of this machine that is not loopback: the one a route to a private
/// address would leave from (connecting a UDP socket sends nothing), or the first
/// of `hostname -I`; kept only if a listener can bind it, which proves it is local,
/// so traffic to it never leaves this host.
fn non_loopback_local_ip() -> Option<IpAddr> {
    let from_route = std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| {
            s.connect("10.255.255.255:9")?;
            s.local_addr()
        })
        .ok()
        .map(|a| a.ip());
    let from_hostname = Command::new("hostname")
        .arg("-I")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|s| s.parse::<IpAddr>().ok())
        .collect::<Vec<_>>();
    from_route
        .into_iter()
        .chain(from_hostname)
        .filter(|ip| ip.is_ipv4() && !ip.is_loopback() && !ip.is_unspecified())
        .find(|ip| std::net::TcpListener::bind((*ip, 0)).is_ok())
}

#[tokio::test]
async fn mutating_admin_routes_refuse_peers_that_are_not_on_loopback() {
    let Some(ip) = non_loopback_local_ip() else {
        eprintln!(
            "SKIPPED mutating_admin_routes_refuse_peers_that_are_not_on_loopback: \
             this machine has no non-loopback address to call the admin plane through"
        );
        return;
    };
    let token = canary("admin");
    let sidecar = Sidecar::start(
        &format!(
            "[listen]\ndata = \"127.0.0.1:0\"\nadmin = \"0.0.0.0:0\"\n[admin]\ntoken = \"{token}\"\n"
        ),
        &[],
    )
    .await;
    let port = sidecar.admin.port();
    let remote = |path: &str| format!("http://{}{path}", SocketAddr::new(ip, port));
    let local = |path: &str| format!("http://127.0.0.1:{port}{path}");
    let bearer = format!("Bearer {token}");
    let auth = [
        ("authorization", bearer.as_str()),
        ("content-type", "application/json"),
    ];

    // Reads are served to a remote peer that has the token, and only then.
    let r = send(request(
        Method::GET,
        &remote("/metrics"),
        &auth,
        Bytes::new(),
    ))
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let r = get(&remote("/metrics")).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(get(&remote("/healthz")).await.status, StatusCode::OK);

    for (path, body) in [
        ("/v1/policies/reload", ""),
        ("/v1/faults", r#"{"journal": "fail_flush"}"#),
        ("/v1/journal/some-key/resolve", r#"{"action": "retry"}"#),
        ("/v1/tasks/some-task/end", r#"{"outcome": "success"}"#),
    ] {
        let r = send(request(
            Method::POST,
            &remote(path),
            &auth,
            body.to_string(),
        ))
        .await;
        assert_eq!(
            r.status,
            StatusCode::FORBIDDEN,
            "POST {path} from {ip} with the token: {}",
            r.text()
        );
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        let r = send(request(
            Method::POST,
            &remote(path),
            &[("content-type", "application/json")],
            body.to_string(),
        ))
        .await;
        assert!(
            matches!(r.status, StatusCode::FORBIDDEN | StatusCode::UNAUTHORIZED),
            "POST {path} from {ip} without the token: {}",
            r.status
        );
    }
    // The refused fault injection did not happen.
    let faults = send(request(
        Method::GET,
        &local("/v1/faults"),
        &auth,
        Bytes::new(),
    ))
    .await;
    assert_eq!(faults.json()["journal"], serde_json::Value::Null);
    // The same call from loopback is served.
    let r = send(request(
        Method::POST,
        &local("/v1/faults"),
        &auth,
        r#"{"journal": null}"#,
    ))
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
}

// ---------------------------------------------------------------------------
// S2: secret leakage
// ---------------------------------------------------------------------------

/// An upstream that fails every call with a body quoting the request's headers, as
/// some gateways and debugging proxies do.
async fn leaky_upstream() -> (Server, Arc<Mutex<Vec<String>>>) {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let server = Server::start(SocketAddr::from(([127, 0, 0, 1], 0)), move |req| {
        let log = log.clone();
        async move {
            let headers: serde_json::Map<String, serde_json::Value> = req
                .headers()
                .iter()
                .map(|(k, v)| (k.to_string(), json!(String::from_utf8_lossy(v.as_bytes()))))
                .collect();
            let _ = read_body(req.into_body()).await;
            let text = serde_json::Value::Object(headers.clone()).to_string();
            if let Ok(mut l) = log.lock() {
                l.push(text);
            }
            json_response(
                500,
                &json!({"error": {"message": "upstream exploded", "type": "api_error",
                                  "request_headers": headers}}),
            )
        }
    })
    .await
    .expect("leaky upstream");
    (server, seen)
}

struct Secrets {
    agent: String,
    provider: String,
    admin: String,
}

impl Secrets {
    fn new() -> Self {
        Self {
            agent: format!("sk-{}", canary("agent")),
            provider: format!("pk-{}", canary("provider")),
            admin: canary("admin"),
        }
    }

    fn all(&self) -> [(&'static str, &str); 3] {
        [
            ("agent key", self.agent.as_str()),
            ("provider key", self.provider.as_str()),
            ("admin token", self.admin.as_str()),
        ]
    }
}

#[tokio::test]
async fn canary_secrets_appear_in_no_log_metric_journal_byte_or_response() {
    let secrets = Secrets::new();
    let model = MockProvider::start(Behaviour {
        chunks: 4,
        tool_calls: 1,
        ..Behaviour::default()
    })
    .await
    .expect("provider");
    let (leaky, leaky_seen) = leaky_upstream().await;
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let mcp = MockMcp::start(ToolBehaviour::default(), true)
        .await
        .expect("mcp");
    let config = format!(
        r#"
[admin]
token = "{admin}"

[[providers]]
name = "openai"
kind = "openai"
base_url = "{openai}"
api_key_env = "SECURITY_PROVIDER_KEY"
models = ["gpt-*"]

[[providers]]
name = "claude"
kind = "anthropic"
base_url = "{anthropic}"
api_key_env = "SECURITY_PROVIDER_KEY"
models = ["claude-*"]

[[providers]]
name = "leaky"
kind = "openai"
base_url = "{leaky}/v1"
api_key_env = "SECURITY_PROVIDER_KEY"
models = ["leaky-*"]

[[tools]]
name = "pay"
kind = "http"
base_url = "{tool}"
class = "keyed"
timeout = "5s"
redact_headers = ["x-tenant-pin"]

[[tools]]
name = "mail"
kind = "mcp"
base_url = "{mcp}"
class = "keyed"
timeout = "5s"
redact_headers = ["x-tenant-pin"]
"#,
        admin = secrets.admin,
        openai = model.openai_base(),
        anthropic = model.anthropic_base(),
        leaky = leaky.url(),
        tool = tool.url(),
        mcp = mcp.url(),
    );
    let mut sidecar = Sidecar::start(
        &config,
        &[("SECURITY_PROVIDER_KEY", secrets.provider.as_str())],
    )
    .await;
    let bearer = format!("Bearer {}", secrets.agent);
    let cookie = format!("session={}", secrets.agent);
    let agent_auth = [
        ("authorization", bearer.as_str()),
        ("x-api-key", secrets.agent.as_str()),
        ("api-key", secrets.agent.as_str()),
        ("cookie", cookie.as_str()),
        ("proxy-authorization", bearer.as_str()),
        ("outrigger-task-id", "security-task"),
    ];
    // Tools also get credentials of their own kinds: one whose name looks like a
    // secret, and one the tool's configuration names.
    let tool_auth = {
        let mut h = agent_auth.to_vec();
        h.push(("x-auth-token", secrets.agent.as_str()));
        h.push(("x-tenant-pin", secrets.agent.as_str()));
        h
    };
    let mut replies = Vec::new();

    // Model calls in both dialects, streamed and not, and the model list.
    for stream in [false, true] {
        let chat = json!({"model": "gpt-mock", "stream": stream,
                          "messages": [{"role": "user", "content": "hi"}]});
        let r = post_json(&sidecar.url("/v1/chat/completions"), &agent_auth, &chat).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        replies.push(("chat", r));
        let msg = json!({"model": "claude-mock", "stream": stream, "max_tokens": 32,
                         "messages": [{"role": "user", "content": "hi"}]});
        let mut h = agent_auth.to_vec();
        h.push(("anthropic-version", "2023-06-01"));
        let r = post_json(&sidecar.url("/v1/messages"), &h, &msg).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        replies.push(("messages", r));
    }
    let r = send(request(
        Method::GET,
        &sidecar.url("/v1/models"),
        &agent_auth,
        Bytes::new(),
    ))
    .await;
    replies.push(("models", r));

    // An upstream error whose body quotes the request headers (the provider key).
    let leak = json!({"model": "leaky-1", "messages": [{"role": "user", "content": "hi"}]});
    let r = post_json(&sidecar.url("/v1/chat/completions"), &agent_auth, &leak).await;
    assert!(r.status.is_server_error(), "{} {}", r.status, r.text());
    replies.push(("upstream error", r));

    // Tool calls carrying the agent's credentials: executed, replayed, failed.
    let mut h = tool_auth.clone();
    h.push(("idempotency-key", "sec-charge-1"));
    for _ in 0..2 {
        let r = post_json(&sidecar.url("/tools/pay/charge"), &h, &json!({"amount": 5})).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        replies.push(("tool", r));
    }
    let mut h = tool_auth.clone();
    h.push(("idempotency-key", "sec-charge-2"));
    h.push(("x-mock-tool", "fail=after"));
    let r = post_json(&sidecar.url("/tools/pay/charge"), &h, &json!({"amount": 6})).await;
    replies.push(("failing tool", r));

    // An MCP call (SSE answer) with the agent's credentials, and its replay.
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": "a@example.com"},
                   "_meta": {META_KEY: "sec-mail-1"}}});
    for _ in 0..2 {
        let r = post_json(&sidecar.url("/mcp/mail"), &tool_auth, &call).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        replies.push(("mcp", r));
    }

    // Positive controls: the canaries really flowed where they belong, so their
    // absence everywhere else means something.
    let provider_bearer = format!("Bearer {}", secrets.provider);
    let exchanges = model.exchanges();
    assert!(!exchanges.is_empty());
    for ex in &exchanges {
        let key = ex
            .header("authorization")
            .or(ex.header("x-api-key"))
            .unwrap_or_default();
        assert!(
            key == provider_bearer || key == secrets.provider,
            "{} {} carried {key:?}",
            ex.method,
            ex.path
        );
        for (name, value) in &ex.headers {
            assert!(
                !value.contains(&secrets.agent),
                "the agent's credential reached the provider in {name}"
            );
        }
    }
    let leaky_seen = leaky_seen.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(
        leaky_seen.iter().any(|h| h.contains(&secrets.provider)),
        "the leaky upstream got the provider key (so its error body quoted it)"
    );

    let metrics = send(request(
        Method::GET,
        &sidecar.admin_url("/metrics"),
        &[("authorization", &format!("Bearer {}", secrets.admin))],
        Bytes::new(),
    ))
    .await;
    assert_eq!(metrics.status, StatusCode::OK);
    let journal = send(request(
        Method::GET,
        &sidecar.admin_url("/v1/journal"),
        &[("authorization", &format!("Bearer {}", secrets.admin))],
        Bytes::new(),
    ))
    .await;
    assert_eq!(journal.status, StatusCode::OK, "{}", journal.text());

    // Stop the sidecar so every log line and journal page is on disk.
    sidecar.sigterm();
    let status = sidecar.wait_exit(Duration::from_secs(30)).await;
    assert!(status.success(), "{status}");

    let mut leaks = Vec::new();
    for (what, secret) in secrets.all() {
        for (route, r) in &replies {
            if transcript(r).contains(secret) {
                leaks.push(format!(
                    "{what} in the response to a {route} call:\n{}",
                    transcript(r)
                ));
            }
        }
        if metrics.text().contains(secret) {
            leaks.push(format!("{what} in /metrics"));
        }
        if journal.text().contains(secret) {
            leaks.push(format!("{what} in GET /v1/journal"));
        }
        for line in sidecar.logs().lines().filter(|l| l.contains(secret)) {
            leaks.push(format!("{what} in a log line: {line}"));
        }
        for (path, bytes) in files_under(&sidecar.dir.path().join("data")) {
            if contains(&bytes, secret) {
                leaks.push(format!("{what} in {path}"));
            }
        }
    }
    assert!(
        leaks.is_empty(),
        "{} leaks:\n{}",
        leaks.len(),
        leaks.join("\n")
    );
}

/// A tool's `redact_json` keeps the values it points at out of the journaled request;
/// the tool still receives them, and the fingerprint still tells requests apart.
#[tokio::test]
async fn values_a_tool_marks_for_redaction_never_reach_the_journal() {
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let config = format!(
        r#"
[[tools]]
name = "vault"
kind = "http"
base_url = "{tool}"
class = "keyed"
redact_json = ["/card/number", "/cvc"]
"#,
        tool = tool.url(),
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    let number = canary("card");
    let body = json!({"amount": 5, "card": {"number": number, "exp": "12/29"}, "cvc": "987-cvc"});
    let h = [("idempotency-key", "vault-1")];
    let r = post_json(&sidecar.url("/tools/vault/store"), &h, &body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let effects = tool.effects();
    assert_eq!(effects.len(), 1);
    assert!(
        contains(&effects[0].body, &number),
        "the tool receives the values"
    );
    // The same key with another card number is another request: 422, not a replay.
    let other = json!({"amount": 5, "card": {"number": "4000", "exp": "12/29"}, "cvc": "987-cvc"});
    let r = post_json(&sidecar.url("/tools/vault/store"), &h, &other).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.text());

    let record = send(request(
        Method::GET,
        &sidecar.admin_url("/v1/journal/vault%2Fvault-1"),
        &[],
        Bytes::new(),
    ))
    .await;
    assert_eq!(record.status, StatusCode::OK, "{}", record.text());
    let record: serde_json::Value = serde_json::from_slice(&record.body).expect("json");
    let journaled = record["request"].to_string();
    assert!(!journaled.contains(&number), "{journaled}");
    assert!(!journaled.contains("987-cvc"), "{journaled}");
    assert!(journaled.contains("<redacted>"), "{journaled}");
    assert!(
        journaled.contains("12/29"),
        "what is not named is kept: {journaled}"
    );
}

#[tokio::test]
async fn a_provider_answer_that_quotes_the_key_never_reaches_the_agent() {
    // The mock provider's `echo` answers 200 with the request headers as JSON: an
    // upstream that (mis)quotes the credential in a success body.
    let secrets = Secrets::new();
    let model = MockProvider::start(Behaviour::default())
        .await
        .expect("provider");
    let config = format!(
        r#"
[[providers]]
name = "openai"
kind = "openai"
base_url = "{}"
api_key_env = "SECURITY_PROVIDER_KEY"
models = ["*"]
"#,
        model.openai_base()
    );
    let sidecar = Sidecar::start(
        &config,
        &[("SECURITY_PROVIDER_KEY", secrets.provider.as_str())],
    )
    .await;
    let chat = json!({"model": "gpt-mock", "messages": [{"role": "user", "content": "hi"}]});
    // (With `echo` the mock answers 200 whatever `status` says; the error-body case
    // is the leaky upstream of the test above.)
    for spec in ["echo=true"] {
        let r = post_json(
            &sidecar.url("/v1/chat/completions"),
            &[("x-mock", spec)],
            &chat,
        )
        .await;
        let echoed = model.exchanges().last().map(|e| e.response_bytes());
        assert!(
            echoed.is_some_and(|b| contains(&b, &secrets.provider)),
            "{spec}: the upstream's answer quoted the key"
        );
        assert!(
            !transcript(&r).contains(&secrets.provider),
            "{spec}: the provider key reached the agent:\n{}",
            transcript(&r)
        );
    }
    // Streamed, the key is quoted by the first event: the one read before the stream
    // counts as started, which the agent gets with the rest, journaled or not.
    let streamed = json!({"model": "gpt-mock", "stream": true,
                          "messages": [{"role": "user", "content": "hi"}]});
    for key in [None, Some("echo-journaled")] {
        let mut h = vec![("x-mock", "echo=true")];
        if let Some(k) = key {
            h.push(("idempotency-key", k));
        }
        let r = post_json(&sidecar.url("/v1/chat/completions"), &h, &streamed).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        let echoed = model.exchanges().last().map(|e| e.response_bytes());
        assert!(
            echoed.is_some_and(|b| b.starts_with(b"data: {\"received_headers\"")
                && contains(&b, &secrets.provider)),
            "{key:?}: the upstream's first event quoted the key"
        );
        assert!(
            r.text().contains("<redacted>") && r.text().contains("[DONE]"),
            "{key:?}: {}",
            r.text()
        );
        assert!(
            !transcript(&r).contains(&secrets.provider),
            "{key:?}: the provider key reached the agent:\n{}",
            transcript(&r)
        );
        if key.is_some() {
            let stream = r.header("outrigger-stream-key").expect("a stream key");
            for url in [
                sidecar.url(&format!("/v1/streams/{}", stream.replace('/', "%2F"))),
                sidecar.url("/v1/chat/completions"),
            ] {
                let again = if url.ends_with("completions") {
                    post_json(&url, &h, &streamed).await
                } else {
                    get(&url).await
                };
                assert_eq!(again.header("outrigger-replayed"), Some("true"));
                assert!(
                    again.text().contains("<redacted>")
                        && !transcript(&again).contains(&secrets.provider),
                    "the journal kept the key: {}",
                    transcript(&again)
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------
// S3: key exfiltration by redirect
// ---------------------------------------------------------------------------

/// Sends raw HTTP/1.1 bytes and reads the answer until the server closes.
async fn raw_http(addr: SocketAddr, request: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(request.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn the_agent_cannot_aim_the_provider_key_at_another_host() {
    let secrets = Secrets::new();
    let model = MockProvider::start(Behaviour::default())
        .await
        .expect("provider");
    let attacker = MockProvider::start(Behaviour {
        echo_headers: true,
        ..Behaviour::default()
    })
    .await
    .expect("attacker");
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let config = format!(
        r#"
[[providers]]
name = "openai"
kind = "openai"
base_url = "{}"
api_key_env = "SECURITY_PROVIDER_KEY"
models = ["*"]

[[providers]]
name = "claude"
kind = "anthropic"
base_url = "{}"
api_key_env = "SECURITY_PROVIDER_KEY"
models = ["*"]

[[tools]]
name = "t"
kind = "http"
base_url = "{}"
"#,
        model.openai_base(),
        model.anthropic_base(),
        tool.url(),
    );
    let sidecar = Sidecar::start(
        &config,
        &[("SECURITY_PROVIDER_KEY", secrets.provider.as_str())],
    )
    .await;
    let evil = attacker.addr();
    let body =
        json!({"model": "gpt-mock", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let post = |target: &str, host: &str, path_body: &str| {
        format!(
            "POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{path_body}",
            path_body.len()
        )
    };
    let mut answers = Vec::new();
    // Absolute-form request targets naming the attacker.
    for path in ["/v1/chat/completions", "/v1/messages", "/tools/t/x"] {
        let target = format!("http://{evil}{path}");
        answers.push(raw_http(sidecar.data, &post(&target, &evil.to_string(), &body)).await);
    }
    // A Host header naming the attacker on an ordinary request.
    answers.push(
        raw_http(
            sidecar.data,
            &post("/v1/chat/completions", &evil.to_string(), &body),
        )
        .await,
    );
    // A proxy-style CONNECT, and paths that try to smuggle a URL or an authority.
    answers.push(
        raw_http(
            sidecar.data,
            &format!("CONNECT {evil} HTTP/1.1\r\nHost: {evil}\r\nConnection: close\r\n\r\n"),
        )
        .await,
    );
    for path in [
        format!("//{evil}/v1/chat/completions"),
        format!("/v1/chat/completions/../../http://{evil}/v1/chat/completions"),
        format!("/tools/t@{evil}/x"),
        format!("/tools/t/@{evil}/x"),
        format!("/tools/t/..%2f..%2f{evil}/x"),
        format!("/mcp/http://{evil}/mcp"),
        format!("/v1/streams/http://{evil}"),
    ] {
        answers.push(raw_http(sidecar.data, &post(&path, "localhost", &body)).await);
    }
    // A model name that is a URL.
    let url_model = json!({"model": format!("http://{evil}/v1"), "messages": []}).to_string();
    answers.push(
        raw_http(
            sidecar.data,
            &post("/v1/chat/completions", "localhost", &url_model),
        )
        .await,
    );

    assert!(
        attacker.exchanges().is_empty(),
        "the attacker's server was reached: {:?}",
        attacker
            .exchanges()
            .iter()
            .map(|e| (&e.method, &e.path, e.header("authorization")))
            .collect::<Vec<_>>()
    );
    for a in &answers {
        assert!(!a.contains(&secrets.provider), "the key came back:\n{a}");
    }
    // The configured provider, and only it, got the key.
    for ex in model.exchanges() {
        let key = ex
            .header("authorization")
            .or(ex.header("x-api-key"))
            .unwrap_or_default();
        assert!(
            key.ends_with(&secrets.provider),
            "{} {}",
            ex.method,
            ex.path
        );
    }
    for ex in tool.effects() {
        assert!(
            !contains(&ex.body, &secrets.provider),
            "the provider key reached a tool"
        );
    }
}
