//! The data plane's errors and their one mapping to HTTP problem documents.

use http::{HeaderValue, StatusCode, header};

use crate::body::ReadError;
use crate::problem::Problem;
use crate::upstream;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the request body is not valid JSON: {0}")]
    MalformedJson(String),
    #[error("{0}")]
    InvalidRequest(String),
    #[error("header {header}: {detail}")]
    BadHeader {
        header: &'static str,
        detail: String,
    },
    #[error("no provider serves model {model:?}")]
    UnknownModel { model: String, known: Vec<String> },
    #[error("the request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("method {method} is not allowed here")]
    MethodNotAllowed {
        method: String,
        allowed: &'static str,
    },
    #[error("no route for {path}")]
    NotFound { path: String },
    #[error("no tool named {tool:?} is configured")]
    UnknownTool { tool: String, known: Vec<String> },
    #[error("could not read the request body: {0}")]
    ReadBody(String),
    #[error("the client sent no byte of the request body for {idle:?}")]
    BodyTimeout { idle: std::time::Duration },
    #[error("upstream {target}: {source}")]
    Upstream {
        target: String,
        #[source]
        source: upstream::Error,
    },
    #[error("could not build the upstream request: {0}")]
    BuildRequest(String),
    #[error("tool {tool} requires an idempotency key")]
    MissingKey { tool: String },
    #[error("journal: {0}")]
    Journal(outrigger_journal::Error),
    #[error("no candidate can serve model {model}")]
    NoCandidate { model: String },
    #[error("the circuit to {target} is open")]
    CircuitOpen {
        target: String,
        retry_after: std::time::Duration,
    },
    #[error("{target} is at capacity: {detail}")]
    Overloaded { target: String, detail: String },
    #[error("the stream from {target} broke: {detail}")]
    StreamBroke { target: String, detail: String },
    #[error("the task's budget does not admit this call: {reason}")]
    BudgetExceeded { reason: String },
    #[error("stream key {key} was first used for a different request")]
    StreamKeyReused { key: String },
    #[error("stream {key} is still being generated")]
    StreamInProgress { key: String },
    #[error("the model call {key} was cancelled before it answered")]
    Cancelled { key: String },
    #[error("no stream {key}")]
    UnknownStream { key: String },
    #[error("stream {key} is past retention: its events are gone")]
    StreamExpired { key: String },
    #[error("the journal does not hold the generation of stream {key} that event {id} belongs to")]
    GenerationLost { key: String, id: String },
}

impl From<ReadError> for Error {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::TooLarge { limit } => Self::BodyTooLarge { limit },
            ReadError::TimedOut { idle } => Self::BodyTimeout { idle },
            ReadError::Io(e) => Self::ReadBody(e.to_string()),
        }
    }
}

impl Error {
    /// The problem document the agent receives. Every variant is spelled out so
    /// that adding one forces a decision about its status and wording.
    pub fn to_problem(&self) -> Problem {
        match self {
            Self::MalformedJson(detail) => Problem::new(
                StatusCode::BAD_REQUEST,
                "malformed-json",
                "Malformed JSON",
                format!("The request body is not valid JSON ({detail}). Send a JSON object."),
            ),
            Self::InvalidRequest(detail) => Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "Invalid request",
                detail.clone(),
            ),
            Self::BadHeader { header, detail } => Problem::new(
                StatusCode::BAD_REQUEST,
                "bad-header",
                "Invalid header",
                format!("Header {header} is invalid: {detail}."),
            )
            .with("header", *header),
            Self::UnknownModel { model, known } => {
                let detail = if known.is_empty() {
                    format!(
                        "No provider serves model {model:?}: no provider of this API is configured. \
                         Set OPENAI_API_KEY or ANTHROPIC_API_KEY, or add a [[providers]] entry to the config."
                    )
                } else {
                    format!(
                        "No provider serves model {model:?}. Configured models: {}.",
                        known.join(", ")
                    )
                };
                Problem::new(StatusCode::NOT_FOUND, "unknown-model", "Unknown model", detail)
                    .with("model", model.as_str())
                    .with("configured_models", known.clone())
            }
            Self::BodyTooLarge { limit } => Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "Request body too large",
                format!(
                    "The request body is larger than the configured limit of {limit} bytes \
                     ([limits] max_body_bytes). Send a smaller body or raise the limit."
                ),
            )
            .with("limit_bytes", *limit),
            Self::MethodNotAllowed { method, allowed } => Problem::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
                format!("{method} is not supported on this route; use {allowed}."),
            )
            .header(header::ALLOW, HeaderValue::from_static(allowed)),
            Self::NotFound { path } => Problem::new(
                StatusCode::NOT_FOUND,
                "no-route",
                "No such route",
                format!(
                    "Nothing is served at {path}. The data plane serves POST /v1/chat/completions, \
                     POST /v1/messages, GET /v1/models, GET /v1/streams/{{key}}, \
                     /tools/{{tool}}/… and POST /mcp/{{server}}."
                ),
            ),
            Self::UnknownTool { tool, known } => Problem::new(
                StatusCode::NOT_FOUND,
                "unknown-tool",
                "Unknown tool",
                format!(
                    "No tool named {tool:?} is configured. Configured tools: {}.",
                    if known.is_empty() { "none".to_string() } else { known.join(", ") }
                ),
            ),
            Self::ReadBody(detail) => Problem::new(
                StatusCode::BAD_REQUEST,
                "unreadable-body",
                "Unreadable request body",
                format!("The request body could not be read: {detail}."),
            ),
            Self::BodyTimeout { idle } => Problem::body_timeout(*idle),
            Self::Upstream { target, source } => {
                let (status, slug, title) = match source {
                    upstream::Error::Timeout { .. } => {
                        (StatusCode::GATEWAY_TIMEOUT, "upstream-timeout", "Upstream timeout")
                    }
                    upstream::Error::Connect { .. } => {
                        (StatusCode::BAD_GATEWAY, "upstream-unreachable", "Upstream unreachable")
                    }
                    upstream::Error::AfterSend { .. } => {
                        (StatusCode::BAD_GATEWAY, "upstream-failed", "Upstream failed")
                    }
                };
                Problem::new(status, slug, title, format!("Upstream {target}: {source}."))
                    .with("target", target.as_str())
            }
            Self::MissingKey { tool } => Problem::new(
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "Idempotency-Key required",
                format!(
                    "Tool {tool} requires an idempotency key: send an `Idempotency-Key` header, or \
                     an `Outrigger-Task-Id` with the model's tool-call id (`Outrigger-Tool-Call-Id`)."
                ),
            )
            .with("tool", tool.as_str()),
            Self::Journal(e) => journal_problem(e),
            Self::NoCandidate { model } => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no-candidate",
                "No provider can serve this call now",
                format!(
                    "No configured provider can serve model {model:?} for this request now: the \
                     fallback policy filtered every candidate (open circuits, unhealthy GPUs, or \
                     missing capabilities such as tools or context size). Retry later."
                ),
            )
            .header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            Self::CircuitOpen { target, retry_after } => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "circuit-open",
                "Upstream circuit open",
                format!(
                    "Calls to {target} are paused after repeated failures; the next probe goes out \
                     in {:.1} s.",
                    retry_after.as_secs_f64()
                ),
            )
            .header(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after.as_secs().max(1)),
            ),
            Self::Overloaded { target, detail } => Problem::new(
                StatusCode::TOO_MANY_REQUESTS,
                "overloaded",
                "Upstream at capacity",
                format!("{target} is at capacity ({detail}); retry later."),
            )
            .header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            Self::StreamBroke { target, detail } => Problem::new(
                StatusCode::BAD_GATEWAY,
                "stream-broke",
                "Upstream stream broke",
                format!("The stream from {target} broke before anything was relayed: {detail}."),
            ),
            Self::StreamKeyReused { key } => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "key-reused",
                "Idempotency-Key reused with a different request",
                format!(
                    "Stream key {key} was first used for a different model request. Use a new \
                     Idempotency-Key for a new request."
                ),
            ),
            Self::StreamInProgress { key } => Problem::new(
                StatusCode::CONFLICT,
                "request-in-progress",
                "The model call is still running",
                format!(
                    "An identical model call ({key}) is still being answered. Retry in a moment \
                     to get its result."
                ),
            )
            .header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            Self::Cancelled { key } => Problem::new(
                StatusCode::CONFLICT,
                "cancelled",
                "The model call was cancelled",
                format!(
                    "The model call {key} was cancelled (POST /v1/streams/{{key}}/cancel) \
                     before it answered. Repeat the request to generate afresh."
                ),
            )
            // The OpenAI and Anthropic SDKs retry a 409 on their own unless told not
            // to: a cancel they undid at once would be billed again.
            .header(
                http::HeaderName::from_static("x-should-retry"),
                HeaderValue::from_static("false"),
            ),
            Self::UnknownStream { key } => Problem::new(
                StatusCode::NOT_FOUND,
                "unknown-stream",
                "No such stream",
                format!(
                    "No journaled stream {key}: it never existed here or is past retention \
                     ([journal] stream_retention, 6 h by default)."
                ),
            ),
            Self::StreamExpired { key } => Problem::new(
                StatusCode::GONE,
                "stream-expired",
                "Stream expired",
                format!(
                    "The journaled stream {key} is past retention ([journal] \
                     stream_retention, 6 h by default): its events are gone and cannot be \
                     resumed. Repeat the request without Last-Event-ID to generate afresh."
                ),
            ),
            Self::GenerationLost { key, id } => Problem::new(
                StatusCode::GONE,
                "generation-lost",
                "Stream generation lost",
                format!(
                    "Event {id} belongs to a generation of stream {key} that the journal \
                     does not hold: its start was lost (a failed journal write, or the \
                     sidecar stopped before it was written), or the key was forgotten and \
                     used again. No more of it can be sent. Repeat the request without \
                     Last-Event-ID for a new generation, and drop what was received of \
                     this one."
                ),
            ),
            Self::BudgetExceeded { reason } => Problem::new(
                StatusCode::TOO_MANY_REQUESTS,
                "budget-exceeded",
                "Task budget exceeded",
                format!(
                    "The task's budget does not admit this call: {reason}. End the task or raise \
                     its limits ([budget] in the config)."
                ),
            ),
            Self::BuildRequest(detail) => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "bad-upstream-request",
                "Could not build the upstream request",
                detail.clone(),
            ),
        }
    }
}

/// Journal failures at the edge. Unavailable is the fail-closed case: 503 with
/// Retry-After, and the call was not executed.
fn journal_problem(e: &outrigger_journal::Error) -> Problem {
    use outrigger_journal::Error as J;
    match e {
        J::Unavailable(detail) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "journal-unavailable",
            "The journal cannot write",
            format!(
                "The side-effect journal cannot record this call ({detail}), so it was not \
                 executed. Retry later with the same idempotency key."
            ),
        )
        .header(header::RETRY_AFTER, HeaderValue::from_static("1")),
        J::Stale { .. } => Problem::new(
            StatusCode::CONFLICT,
            "request-in-progress",
            "The call moved on",
            format!("{e}. Retry with the same key to see its current state."),
        )
        .header(header::RETRY_AFTER, HeaderValue::from_static("1")),
        J::Locked { .. }
        | J::NotFound { .. }
        | J::Corrupt { .. }
        | J::Storage(_)
        | J::Decode { .. }
        | J::UnknownKey(_)
        | J::NotResolvable { .. }
        | J::InvalidResolution(_)
        | J::Stream { .. }
        | J::Invalid { .. } => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "journal-error",
            "Journal error",
            format!("The side-effect journal failed ({e}); the call was not executed."),
        )
        .header(header::RETRY_AFTER, HeaderValue::from_static("1")),
    }
}
