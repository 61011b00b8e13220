//! The drill's HTTP client, on both planes: one hyper client, every exchange bounded
//! by a deadline, and a reply that keeps its timing (head and last byte) because the
//! drill's figures are measured from the agent's side of the wire.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

/// One request as the drill sends it.
#[derive(Debug, Clone)]
pub struct Call {
    pub method: Method,
    pub url: String,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    pub timeout: Duration,
    /// Counts the body frames as they arrive, so a scenario can act mid-stream.
    pub frames: Option<Arc<AtomicUsize>>,
}

impl Call {
    pub fn new(method: Method, url: impl Into<String>) -> Self {
        Self {
            method,
            url: url.into(),
            headers: Vec::new(),
            body: Bytes::new(),
            timeout: Duration::from_secs(30),
            frames: None,
        }
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    pub fn json(mut self, value: &serde_json::Value) -> Self {
        self.body = Bytes::from(value.to_string());
        self.header("content-type", "application/json")
    }
}

/// A response read to its end (or to the error that ended it).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// From the send to the last byte (or the body error).
    pub elapsed: Duration,
    /// When the body broke off (connection reset, deadline) instead of ending.
    pub body_error: Option<String>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Why no response head came back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failed {
    pub detail: String,
    pub after: Duration,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (after {:?})", self.detail, self.after)
    }
}

/// A pooled client; cheap to clone.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Http {
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        Self {
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(5))
                .build(connector),
        }
    }

    /// Sends `call` and reads the whole answer within `call.timeout`.
    pub async fn send(&self, call: Call) -> Result<Reply, Failed> {
        let started = Instant::now();
        let failed = |detail: String| Failed {
            detail,
            after: started.elapsed(),
        };
        let mut builder = Request::builder().method(call.method).uri(&call.url);
        for (k, v) in &call.headers {
            builder = builder.header(k.as_str(), v.as_str());
        }
        let req = builder
            .body(Full::new(call.body))
            .map_err(|e| failed(format!("cannot build the request to {}: {e}", call.url)))?;
        let deadline = started + call.timeout;
        let resp = match tokio::time::timeout_at(deadline, self.client.request(req)).await {
            Err(_) => {
                return Err(failed(format!(
                    "no response head within {:?}",
                    call.timeout
                )));
            }
            Ok(Err(e)) => return Err(failed(describe(&e))),
            Ok(Ok(resp)) => resp,
        };
        let (parts, mut body) = resp.into_parts();
        let mut buf = BytesMut::new();
        let mut body_error = None;
        loop {
            match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    body_error = Some(format!("the body did not end within {:?}", call.timeout));
                    break;
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    body_error = Some(describe(&e));
                    break;
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        buf.extend_from_slice(&data);
                        if let Some(n) = &call.frames {
                            n.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body: buf.freeze(),
            elapsed: started.elapsed(),
            body_error,
        })
    }
}

/// An error with its sources, on one line (hyper's own message is terse).
fn describe(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The operator's side: the admin plane of the sidecar under drill, which moves
/// to a new address when the drill restarts the sidecar.
#[derive(Clone)]
pub struct Admin {
    http: Http,
    base: Arc<std::sync::Mutex<String>>,
    token: Option<String>,
}

impl Admin {
    pub fn new(http: Http, addr: std::net::SocketAddr, token: Option<String>) -> Self {
        Self {
            http,
            base: Arc::new(std::sync::Mutex::new(format!("http://{addr}"))),
            token,
        }
    }

    /// Points this handle (and every clone of it) at a restarted sidecar.
    pub fn moved_to(&self, addr: std::net::SocketAddr) {
        if let Ok(mut b) = self.base.lock() {
            *b = format!("http://{addr}");
        }
    }

    fn url(&self, path: &str) -> String {
        let base = self.base.lock().map(|b| b.clone()).unwrap_or_default();
        format!("{base}{path}")
    }

    fn call(&self, method: Method, path: &str) -> Call {
        let mut call = Call::new(method, self.url(path));
        call.timeout = Duration::from_secs(10);
        match &self.token {
            Some(t) => call.header("authorization", format!("Bearer {t}")),
            None => call,
        }
    }

    pub async fn get(&self, path: &str) -> Result<Reply, Failed> {
        self.http.send(self.call(Method::GET, path)).await
    }

    /// `GET path` answered 2xx, as JSON.
    pub async fn get_json(&self, path: &str) -> Result<serde_json::Value, String> {
        let reply = self
            .get(path)
            .await
            .map_err(|e| format!("GET {path}: {e}"))?;
        if !reply.status.is_success() {
            return Err(format!("GET {path}: {} {}", reply.status, reply.text()));
        }
        serde_json::from_slice(&reply.body).map_err(|e| format!("GET {path}: not JSON ({e})"))
    }

    pub async fn post(&self, path: &str, body: &serde_json::Value) -> Result<Reply, Failed> {
        self.http
            .send(self.call(Method::POST, path).json(body))
            .await
    }

    /// `POST path` answered 2xx, as JSON.
    pub async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, String> {
        let reply = self
            .post(path, body)
            .await
            .map_err(|e| format!("POST {path}: {e}"))?;
        if !reply.status.is_success() {
            return Err(format!("POST {path}: {} {}", reply.status, reply.text()));
        }
        serde_json::from_slice(&reply.body).map_err(|e| format!("POST {path}: not JSON ({e})"))
    }
}
