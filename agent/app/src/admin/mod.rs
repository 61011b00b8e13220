//! The admin plane: health, readiness, metrics and the operator API, on its own
//! listener (never the data port).
//!
//! When a bearer token is configured every route but `/healthz` and `/readyz`
//! requires it, and routes that change state additionally refuse peers that are not
//! on loopback, whatever token they present.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use outrigger_proxy::body::{Body, full};
use outrigger_proxy::options::Secret;
use outrigger_proxy::problem::Problem;
use outrigger_telemetry::Metrics;
use serde_json::json;

mod faults;
mod journal;
mod tasks;
pub use faults::Faults;
pub use journal::{MAX_PAGE, filter_from, parse_time};

/// What `/readyz` reports on. Each component flips its own flag.
#[derive(Debug, Default)]
pub struct Readiness {
    pub started: AtomicBool,
    /// What start-up is doing while `started` is false.
    pub phase: std::sync::Mutex<String>,
    pub draining: AtomicBool,
    /// Set while the journal is open and its writer runs.
    pub journal: AtomicBool,
    /// Why the journal is not open, when that needs an operator (it is corrupt).
    pub journal_problem: std::sync::Mutex<Option<String>>,
    /// Set while every policy binding has a version serving it.
    pub policies: AtomicBool,
    /// Why the GPUs make this node not ready, if they do (`None`: ready).
    pub gpu: std::sync::Mutex<Option<String>>,
}

impl Readiness {
    /// Says what start-up is doing now (`/readyz` reports it until started).
    pub fn set_phase(&self, phase: impl Into<String>) {
        if let Ok(mut p) = self.phase.lock() {
            *p = phase.into();
        }
    }

    /// The verdict and the reasons it is not ready, if any.
    pub fn check(&self) -> (bool, Vec<String>) {
        let mut reasons = Vec::new();
        if !self.started.load(Ordering::Acquire) {
            let phase = self.phase.lock().map(|p| p.clone()).unwrap_or_default();
            reasons.push(if phase.is_empty() {
                "starting".to_string()
            } else {
                format!("starting: {phase}")
            });
            // The journal and the policies are not up yet by design; what start-up
            // does now says more than their flags.
            return (false, reasons);
        }
        if self.draining.load(Ordering::Acquire) {
            reasons.push("draining: shutting down".to_string());
        }
        if !self.journal.load(Ordering::Acquire) {
            let problem = self.journal_problem.lock().ok().and_then(|p| p.clone());
            reasons.push(match problem {
                Some(why) => format!("journal: {why}"),
                None => "journal: not writable (see the log)".to_string(),
            });
        }
        if !self.policies.load(Ordering::Acquire) {
            reasons.push(
                "policies: a binding has no loaded version (see GET /v1/policies)".to_string(),
            );
        }
        if let Ok(g) = self.gpu.lock()
            && let Some(why) = g.as_ref()
        {
            reasons.push(format!("gpu: {why}"));
        }
        (reasons.is_empty(), reasons)
    }
}

/// Everything the admin routes read.
pub struct Admin {
    pub readiness: Arc<Readiness>,
    pub metrics: Metrics,
    pub token: Option<Secret>,
    pub journal: Option<outrigger_journal::Journal>,
    pub faults: Faults,
    pub policies: outrigger_policy::Registry,
    pub policy_faults: crate::policies::FaultCounters,
    pub gpu: tokio::sync::watch::Receiver<Arc<outrigger_gpu::Snapshot>>,
    pub tasks: Option<outrigger_proxy::tasks::Tasks>,
    pub slos: Arc<outrigger_telemetry::slo::Slos>,
    /// `[limits] client_read_timeout`: the longest pause in a request body.
    pub read_timeout: std::time::Duration,
}

impl Admin {
    /// Reads a request's body, at most `limit` bytes of it, or says why it cannot.
    async fn read_body(&self, req: Request<Incoming>, limit: usize) -> Result<Bytes, Problem> {
        use outrigger_proxy::body::{ReadError, read_request};
        read_request(req.into_body(), limit, self.read_timeout)
            .await
            .map_err(|e| match e {
                ReadError::TooLarge { limit } => Problem::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body-too-large",
                    "Request body too large",
                    format!("The admin API reads at most {limit} bytes of a request body."),
                ),
                ReadError::TimedOut { idle } => Problem::body_timeout(idle),
                ReadError::Io(e) => Problem::new(
                    StatusCode::BAD_REQUEST,
                    "unreadable-body",
                    "Unreadable request body",
                    e.to_string(),
                ),
            })
    }

    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let path = req.uri().path().to_string();
        let method = req.method().clone();
        if !matches!(path.as_str(), "/healthz" | "/readyz")
            && let Some(problem) = self.authorize(&req, peer)
        {
            return problem.into_response();
        }
        match (&method, path.as_str()) {
            (&Method::GET, "/v1/policies") => {
                return json_response(StatusCode::OK, &json!({"bindings": self.policies.status()}));
            }
            (&Method::POST, "/v1/policies/reload") => {
                let report = crate::policies::reload(
                    &self.policies,
                    &self.metrics,
                    &self.readiness,
                    "admin API",
                )
                .await;
                let status = if report.error.is_some() {
                    // The reload itself failed (it panicked): the host's fault, not
                    // the policies'.
                    StatusCode::INTERNAL_SERVER_ERROR
                } else if report.is_ok() {
                    StatusCode::OK
                } else {
                    StatusCode::UNPROCESSABLE_ENTITY
                };
                return json_response(
                    status,
                    &json!({"ok": report.is_ok(), "report": report, "bindings": self.policies.status()}),
                );
            }
            (&Method::GET, "/v1/gpu") => {
                let snap = self.gpu.borrow().clone();
                return json_response(StatusCode::OK, &json!(*snap));
            }
            (_, "/v1/slo") => return tasks::slo(&self.slos, &method),
            (_, "/v1/policies" | "/v1/gpu") => return method_not_allowed("GET"),
            (_, "/v1/policies/reload") => return method_not_allowed("POST"),
            _ => {}
        }
        if path == "/v1/tasks" || path.starts_with("/v1/tasks/") {
            let body = match self.read_body(req, 1 << 16).await {
                Ok(b) => b,
                Err(problem) => return problem.into_response(),
            };
            return tasks::handle(self.tasks.as_ref(), &method, &path, body).await;
        }
        if path == "/v1/slo/maintenance" {
            return match self.read_body(req, 1 << 12).await {
                Ok(body) => tasks::maintenance(&self.slos, &method, &body),
                Err(problem) => problem.into_response(),
            };
        }
        if path == "/v1/faults" {
            return match method {
                Method::GET => self.faults.get(),
                Method::POST => match self.read_body(req, 1 << 16).await {
                    Ok(body) => self.faults.set(self.journal.as_ref(), &body),
                    Err(problem) => problem.into_response(),
                },
                _ => method_not_allowed("GET, POST"),
            };
        }
        if path == "/v1/journal" || path.starts_with("/v1/journal/") {
            let query = req.uri().query().unwrap_or_default().to_string();
            let body = match self.read_body(req, 1 << 20).await {
                Ok(b) => b,
                Err(problem) => return problem.into_response(),
            };
            return journal::handle(self.journal.as_ref(), &method, &path, &query, body).await;
        }
        // A `HEAD` is answered as its `GET` (hyper leaves out the body).
        match (method, path.as_str()) {
            (Method::GET | Method::HEAD, "/healthz") => {
                json_response(StatusCode::OK, &json!({"status": "ok"}))
            }
            (Method::GET | Method::HEAD, "/readyz") => {
                let (mut ready, mut reasons) = self.readiness.check();
                if self
                    .journal
                    .as_ref()
                    .is_some_and(outrigger_journal::Journal::writes_failing)
                {
                    ready = false;
                    reasons.push(
                        "journal: writes are failing; side-effecting tool calls are refused \
                         (see outrigger_journal_flush_errors)"
                            .to_string(),
                    );
                }
                let status = if ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                json_response(status, &json!({"ready": ready, "reasons": reasons}))
            }
            (Method::GET, "/metrics") => {
                if let Some(journal) = &self.journal {
                    self.metrics.journal(&journal.stats());
                }
                self.policy_faults.sync(&self.policies, &self.metrics);
                let mut text = self.metrics.encode();
                let snap = self.gpu.borrow().clone();
                append_samples(&mut text, &snap.metrics());
                let mut resp = Response::new(full(Bytes::from(text)));
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static(
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    ),
                );
                resp
            }
            (_, "/healthz" | "/readyz") => method_not_allowed("GET, HEAD"),
            (_, "/metrics") => method_not_allowed("GET"),
            _ => Problem::new(
                StatusCode::NOT_FOUND,
                "no-route",
                "No such admin route",
                format!(
                    "The admin plane serves nothing at {path}; see the README's admin API list."
                ),
            )
            .into_response(),
        }
    }

    fn authorize<B>(&self, req: &Request<B>, peer: SocketAddr) -> Option<Problem> {
        authorize(self.token.as_ref(), req, peer)
    }
}

/// The admin plane from the moment its port is bound: while the sidecar starts (the
/// journal opening, or waiting for another process's lock on it; policies
/// compiling) it answers `/healthz` and `/readyz` (not ready: `starting`, and why),
/// and every other route `503 starting` after the same authorization; once started,
/// every route is the [`Admin`]'s.
pub struct Plane {
    readiness: Arc<Readiness>,
    token: Option<Secret>,
    serving: std::sync::OnceLock<Arc<Admin>>,
}

impl Plane {
    pub fn starting(readiness: Arc<Readiness>, token: Option<Secret>) -> Self {
        Self {
            readiness,
            token,
            serving: std::sync::OnceLock::new(),
        }
    }

    /// Hands every route to `admin` from now on.
    pub fn serve(&self, admin: Arc<Admin>) {
        let _ = self.serving.set(admin);
    }

    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        if let Some(admin) = self.serving.get() {
            return admin.handle(req, peer).await;
        }
        let path = req.uri().path();
        let method = req.method();
        match (method, path) {
            (&Method::GET | &Method::HEAD, "/healthz") => {
                json_response(StatusCode::OK, &json!({"status": "ok"}))
            }
            (&Method::GET | &Method::HEAD, "/readyz") => {
                let (ready, reasons) = self.readiness.check();
                let status = if ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                json_response(status, &json!({"ready": ready, "reasons": reasons}))
            }
            (_, "/healthz" | "/readyz") => method_not_allowed("GET, HEAD"),
            _ => {
                if let Some(problem) = authorize(self.token.as_ref(), &req, peer) {
                    return problem.into_response();
                }
                let (_, reasons) = self.readiness.check();
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "starting",
                    "The sidecar is starting",
                    format!(
                        "The admin plane serves {path} once the sidecar has started; GET /readyz \
                         says what it is waiting for ({}).",
                        reasons.join("; ")
                    ),
                )
                .header(header::RETRY_AFTER, HeaderValue::from_static("1"))
                .into_response()
            }
        }
    }
}

/// Refuses a request the admin plane must not serve: a change of state from a peer
/// off loopback, or any route but health and readiness without the configured token.
fn authorize<B>(token: Option<&Secret>, req: &Request<B>, peer: SocketAddr) -> Option<Problem> {
    let mutating = !matches!(*req.method(), Method::GET | Method::HEAD);
    if mutating && !is_loopback(peer) {
        return Some(Problem::new(
            StatusCode::FORBIDDEN,
            "admin-loopback-only",
            "Loopback only",
            "Routes that change state are only served to clients on the same host (loopback).",
        ));
    }
    let token = token?;
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            // The scheme is case-insensitive (RFC 9110 §11.1).
            let (scheme, token) = v.split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then_some(token.trim())
        });
    if presented.is_some_and(|p| constant_time_eq(p.as_bytes(), token.expose().as_bytes())) {
        None
    } else {
        Some(
            Problem::new(
                StatusCode::UNAUTHORIZED,
                "admin-token-required",
                "Admin token required",
                "Send the admin token as `Authorization: Bearer <token>`.",
            )
            .header(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")),
        )
    }
}

/// Adds GPU samples to an OpenMetrics exposition (before its `# EOF`).
fn append_samples(text: &mut String, samples: &[outrigger_gpu::MetricSample]) {
    use std::fmt::Write;
    let eof = text.rfind("# EOF").unwrap_or(text.len());
    let tail = text.split_off(eof);
    let mut seen = std::collections::HashSet::new();
    for s in samples {
        let family = s.family();
        if seen.insert(family) {
            let kind = match s.kind {
                outrigger_gpu::MetricKind::Gauge => "gauge",
                outrigger_gpu::MetricKind::Counter => "counter",
            };
            let _ = writeln!(text, "# HELP {family} {}", s.help);
            let _ = writeln!(text, "# TYPE {family} {kind}");
        }
        let labels: Vec<String> = s
            .labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
            .collect();
        if labels.is_empty() {
            let _ = writeln!(text, "{} {}", s.name, s.value);
        } else {
            let _ = writeln!(text, "{}{{{}}} {}", s.name, labels.join(","), s.value);
        }
    }
    text.push_str(if tail.is_empty() { "# EOF\n" } else { &tail });
}

fn is_loopback(peer: SocketAddr) -> bool {
    match peer.ip() {
        std::net::IpAddr::V4(v4) => v4.is_loopback(),
        std::net::IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(full(Bytes::from(value.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// `405` for a route that answers other methods (`allowed`, also sent as `Allow`).
pub(crate) fn method_not_allowed(allowed: &'static str) -> Response<Body> {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        format!("Use {allowed}."),
    )
    .header(header::ALLOW, HeaderValue::from_static(allowed))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_detection_covers_mapped_v6() {
        for (addr, want) in [
            ("127.0.0.1:1", true),
            ("[::1]:1", true),
            ("[::ffff:127.0.0.1]:1", true),
            ("10.0.0.1:1", false),
            ("[::ffff:10.0.0.1]:1", false),
        ] {
            assert_eq!(is_loopback(addr.parse().unwrap()), want, "{addr}");
        }
    }

    #[test]
    fn readiness_reasons() {
        let r = Readiness::default();
        r.journal.store(true, Ordering::Release);
        r.policies.store(true, Ordering::Release);
        assert_eq!(r.check(), (false, vec!["starting".to_string()]));
        r.started.store(true, Ordering::Release);
        assert_eq!(r.check(), (true, vec![]));
        r.draining.store(true, Ordering::Release);
        assert!(!r.check().0);

        let r = Readiness::default();
        r.started.store(true, Ordering::Release);
        r.policies.store(true, Ordering::Release);
        assert_eq!(
            r.check(),
            (
                false,
                vec!["journal: not writable (see the log)".to_string()]
            )
        );
        *r.journal_problem.lock().unwrap() = Some("corrupt (…)".to_string());
        assert_eq!(r.check(), (false, vec!["journal: corrupt (…)".to_string()]));
    }

    #[test]
    fn gpu_metric_families_are_contiguous_in_the_exposition() {
        let backend = outrigger_gpu::FakeBackend::with_gpus(2);
        backend.push_event(outrigger_gpu::Event::Xid {
            uuid: outrigger_gpu::fake_uuid(1),
            xid: Some(94),
        });
        let snapshot = outrigger_gpu::probe(&backend, &outrigger_gpu::Options::default());
        let mut text =
            "# TYPE outrigger_http_inflight gauge\noutrigger_http_inflight 0\n# EOF\n".to_owned();
        append_samples(&mut text, &snapshot.metrics());
        assert!(text.ends_with("\n# EOF\n"), "{text}");

        // Every sample line belongs to the family of the last # TYPE line, and each
        // family has one # TYPE line.
        let mut families: Vec<&str> = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let family = rest.split(' ').next().unwrap_or_default();
                assert!(!families.contains(&family), "{family} twice:\n{text}");
                families.push(family);
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                let family = families.last().copied().unwrap_or_default();
                assert!(
                    name == family || name.strip_suffix("_total") == Some(family),
                    "{name} is not in family {family}:\n{text}"
                );
            }
        }
        for family in ["outrigger_gpu_health_state", "hw_status", "hw_errors"] {
            assert!(families.contains(&family), "{family} missing:\n{text}");
        }
    }

    #[test]
    fn token_compare() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
