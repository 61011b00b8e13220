//! The harness: runs the real `outrigger` binary as a child process on loopback,
//! with a temporary data directory, and talks HTTP to it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustix::process::{Pid, Signal, kill_process};

/// Path of the `outrigger` binary: `OUTRIGGER_BIN`, or built once with cargo.
pub fn outrigger_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(p) = std::env::var("OUTRIGGER_BIN") {
            return PathBuf::from(p);
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--quiet", "-p", "outrigger", "--bin", "outrigger"])
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the outrigger binary failed");
        // target/<profile>/deps/e2e-<hash> → target/<profile>/outrigger
        let exe = std::env::current_exe().expect("test executable path");
        let dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target profile directory");
        dir.join("outrigger")
    })
}

/// A running sidecar; killed when dropped.
pub struct Sidecar {
    child: Option<Child>,
    pub data: SocketAddr,
    pub admin: SocketAddr,
    pub dir: tempfile::TempDir,
    config_path: PathBuf,
    env: Vec<(String, String)>,
    /// How long start-up may take (cold WebAssembly compiles are slow).
    ready_within: Duration,
}

impl Sidecar {
    /// Starts `outrigger serve` with `config` (TOML; listeners default to port 0) and
    /// extra environment variables.
    pub async fn start(config: &str, env: &[(&str, &str)]) -> Sidecar {
        Self::start_within(config, env, Duration::from_secs(60)).await
    }

    /// As [`Sidecar::start`], allowing `ready_within` for start-up.
    pub async fn start_within(
        config: &str,
        env: &[(&str, &str)],
        ready_within: Duration,
    ) -> Sidecar {
        let dir = tempfile::tempdir().expect("temp dir");
        let data_dir = dir.path().join("data");
        let mut text = String::new();
        if !config.contains("[listen]") {
            text.push_str("[listen]\ndata = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n");
        }
        // The journal goes in the test's own directory, never the working one: a
        // `[journal]` section without a `dir` gets this one too.
        let journal_dir = format!("dir = {:?}\n", data_dir.display().to_string());
        let config = match config.split_once("[journal]\n") {
            None => {
                text.push_str(&format!("[journal]\n{journal_dir}"));
                config.to_string()
            }
            Some((before, section))
                if !section
                    .split("\n[")
                    .next()
                    .is_some_and(|s| s.starts_with("dir = ") || s.contains("\ndir = ")) =>
            {
                format!("{before}[journal]\n{journal_dir}{section}")
            }
            Some(_) => config.to_string(),
        };
        text.push_str(&config);
        let config_path = dir.path().join("outrigger.toml");
        std::fs::write(&config_path, text).expect("write config");
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut sidecar = Sidecar {
            child: None,
            data: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            dir,
            config_path,
            env,
            ready_within,
        };
        sidecar.spawn().await;
        sidecar
    }

    /// (Re)starts the process on the same config and data directory.
    pub async fn spawn(&mut self) {
        let ready = self.dir.path().join("ready.json");
        let _ = std::fs::remove_file(&ready);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("log file");
        let mut cmd = Command::new(outrigger_bin());
        cmd.arg("serve")
            .arg("--config")
            .arg(&self.config_path)
            .arg("--ready-file")
            .arg(&ready)
            .env_remove("OPENAI_API_KEY")
            .env_remove("ANTHROPIC_API_KEY")
            .env(
                "OUTRIGGER_LOG_LEVEL",
                "info,outrigger=debug,outrigger_proxy=debug",
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn outrigger");
        let deadline = Instant::now() + self.ready_within;
        loop {
            if let Ok(text) = std::fs::read_to_string(&ready)
                && let Ok(doc) = serde_json::from_str::<serde_json::Value>(&text)
            {
                self.data = doc["data"]
                    .as_str()
                    .unwrap_or_default()
                    .parse()
                    .expect("data addr");
                self.admin = doc["admin"]
                    .as_str()
                    .unwrap_or_default()
                    .parse()
                    .expect("admin addr");
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "outrigger exited during start-up ({status}):\n{}",
                    self.logs()
                );
            }
            assert!(
                Instant::now() < deadline,
                "outrigger did not become ready:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.child = Some(child);
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("outrigger.log")
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.data)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("running")
    }

    /// Sends SIGTERM (graceful drain).
    pub fn sigterm(&self) {
        self.signal(Signal::TERM);
    }

    /// Sends SIGHUP (reload the policies).
    pub fn sighup(&self) {
        self.signal(Signal::HUP);
    }

    fn signal(&self, signal: Signal) {
        let child = self.child.as_ref().expect("running");
        kill_process(Pid::from_child(child), signal).expect("the signal is sent");
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the process to exit on its own.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().expect("running");
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "outrigger did not exit in {timeout:?}:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A response read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub fn request(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Request<Full<Bytes>> {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.body(Full::new(body.into())).expect("request")
}

/// Sends a request and reads the whole response (30 s limit).
pub async fn send(req: Request<Full<Bytes>>) -> Reply {
    let resp = tokio::time::timeout(Duration::from_secs(30), client().request(req))
        .await
        .expect("response within 30 s")
        .expect("response");
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(Duration::from_secs(30), body.collect())
        .await
        .expect("body within 30 s")
        .expect("body")
        .to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn post_json(url: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> Reply {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    send(request(Method::POST, url, &h, body.to_string())).await
}

pub async fn get(url: &str) -> Reply {
    send(request(Method::GET, url, &[], Bytes::new())).await
}

/// A GET that may find nothing listening yet.
pub async fn try_get(url: &str) -> Option<Reply> {
    let req = request(Method::GET, url, &[], Bytes::new());
    let resp = tokio::time::timeout(Duration::from_secs(5), client().request(req))
        .await
        .ok()?
        .ok()?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.ok()?.to_bytes();
    Some(Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// Opens a request and returns the response head with the body still streaming.
pub async fn open(req: Request<Full<Bytes>>) -> http::Response<Incoming> {
    tokio::time::timeout(Duration::from_secs(30), client().request(req))
        .await
        .expect("response head within 30 s")
        .expect("response")
}

/// Reads the next data frame of a streaming body (None at the end).
pub async fn next_chunk(body: &mut Incoming) -> Option<Result<Bytes, String>> {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), body.frame()).await {
            Err(_) => return Some(Err("no frame within 30 s".into())),
            Ok(None) => return None,
            Ok(Some(Err(e))) => return Some(Err(e.to_string())),
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    return Some(Ok(d));
                }
            }
        }
    }
}

/// Polls `check` every 20 ms until it holds or `timeout` passes.
pub async fn eventually(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The attempt and sequence number an event's `id:` line names (`<attempt>.<tag>:<seq>`),
/// its tag left out.
pub fn id_of(ev: &str) -> Option<(u32, u64)> {
    let id = ev.lines().next()?.strip_prefix("id: ")?;
    let (generation, seq) = id.split_once(':')?;
    let attempt = generation.split_once('.').map_or(generation, |(a, _)| a);
    Some((attempt.parse().ok()?, seq.parse().ok()?))
}

/// Whether `ev` opens with the id of event `seq` of attempt `attempt` (whatever its
/// tag).
pub fn has_id(ev: &str, attempt: u32, seq: u64) -> bool {
    id_of(ev) == Some((attempt, seq))
}

/// The generation (`<attempt>.<tag>`) an event's `id:` line names.
pub fn generation_of(ev: &str) -> String {
    ev.lines()
        .next()
        .and_then(|l| l.strip_prefix("id: "))
        .and_then(|id| id.split_once(':'))
        .map(|(g, _)| g.to_owned())
        .unwrap_or_else(|| panic!("no id: {ev:?}"))
}
