//! The data plane's typed options. The binary validates the user's configuration
//! into these; nothing here parses files or reads the environment.

use std::fmt;
use std::time::Duration;

use http::Uri;
use outrigger_types::ToolClass;

/// A credential the sidecar holds on the agent's behalf. Its `Debug` never shows
/// the value, so it cannot leak through a log line by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: String) -> Self {
        Self(value)
    }

    /// The value itself, for the one place that injects it into a request.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// The API dialect a provider speaks (and the data-plane route that reaches it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// OpenAI chat completions: `POST /v1/chat/completions`.
    OpenAi,
    /// Anthropic messages: `POST /v1/messages`.
    Anthropic,
}

impl Dialect {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OpenAi => "openai",
            Self::Anthropic => "anthropic",
        }
    }
}

/// Which model names a provider serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelPattern {
    /// `"*"`: any model.
    Any,
    /// An exact name, or a prefix when it ends in `*` (e.g. `gpt-4o*`).
    Name(String),
}

impl ModelPattern {
    pub fn parse(s: &str) -> Self {
        if s == "*" {
            Self::Any
        } else {
            Self::Name(s.to_string())
        }
    }

    pub fn matches(&self, model: &str) -> bool {
        match self {
            Self::Any => true,
            Self::Name(n) => match n.strip_suffix('*') {
                Some(prefix) => model.starts_with(prefix),
                None => n == model,
            },
        }
    }

    /// Exact names outrank prefixes, which outrank `*`.
    pub fn specificity(&self) -> u8 {
        match self {
            Self::Any => 0,
            Self::Name(n) if n.ends_with('*') => 1,
            Self::Name(_) => 2,
        }
    }
}

impl fmt::Display for ModelPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Any => f.write_str("*"),
            Self::Name(n) => f.write_str(n),
        }
    }
}

/// A model provider the sidecar forwards to.
#[derive(Debug, Clone)]
pub struct Provider {
    pub name: String,
    pub dialect: Dialect,
    /// The base URL in the provider SDK's own convention: OpenAI's includes `/v1`
    /// (`https://api.openai.com/v1`), Anthropic's does not (`https://api.anthropic.com`).
    pub base_url: Uri,
    pub api_key: Option<Secret>,
    pub models: Vec<ModelPattern>,
    pub caps: Capabilities,
}

/// What a provider can do and costs, for fallback and budget decisions.
#[derive(Debug, Clone, Default)]
pub struct Capabilities {
    /// Providers (of the same dialect) to fall back to, in order.
    pub fallbacks: Vec<String>,
    /// The model sent when this provider serves a call as a fallback (the agent's
    /// model name usually means nothing here).
    pub default_model: Option<String>,
    pub supports_tools: bool,
    pub supports_streaming: bool,
    /// Context window in tokens; 0 when unknown.
    pub context_window: u32,
    /// Supported input modalities; empty when unknown (nothing is filtered).
    pub modalities: outrigger_types::Modalities,
    /// Served from this node's GPUs (its health follows theirs).
    pub local: bool,
    /// Micro-dollars per million input / output tokens.
    pub price_in: u64,
    pub price_out: u64,
    /// How an interrupted text-only stream is continued; `None`: it is not.
    pub continuation: Option<Continuation>,
}

/// How a stream interrupted while only text had come is continued at the same
/// provider and stitched into the stream its agent is reading (Anthropic's
/// recipes for resuming a dropped stream; OpenAI's chat completions take the
/// instruction only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continuation {
    /// The text sent so far goes back as the start of the assistant's message, and
    /// the model continues it (Claude models up to 4.5).
    Prefill,
    /// A user message quotes the text sent so far and asks the model to continue
    /// from where it left off (Claude 4.6 and later, which take no prefill, and
    /// OpenAI's chat completions).
    Instruction,
}

impl Capabilities {
    /// Everything supported, nothing known about size or price.
    pub fn permissive() -> Self {
        Self {
            supports_tools: true,
            supports_streaming: true,
            ..Self::default()
        }
    }
}

impl Provider {
    /// What this provider's tokens cost.
    pub fn price(&self) -> crate::resilience::Price {
        crate::resilience::Price {
            per_mtok_in: self.caps.price_in,
            per_mtok_out: self.caps.price_out,
        }
    }

    /// The upstream URI for a data-plane path suffix (`/chat/completions`, `/v1/messages`).
    pub fn url(&self, suffix: &str) -> Result<Uri, http::Error> {
        let path = self.base_url.path().trim_end_matches('/');
        let mut path_and_query = String::with_capacity(path.len() + suffix.len());
        path_and_query.push_str(path);
        path_and_query.push_str(suffix);
        let mut uri = Uri::builder().path_and_query(path_and_query);
        if let Some(scheme) = self.base_url.scheme() {
            uri = uri.scheme(scheme.clone());
        }
        if let Some(authority) = self.base_url.authority() {
            uri = uri.authority(authority.clone());
        }
        uri.build()
    }

    /// The host:port the provider's credentials may be sent to.
    pub fn authority(&self) -> Option<&str> {
        self.base_url.authority().map(|a| a.as_str())
    }
}

/// How a tool is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolKind {
    Http,
    Mcp,
}

/// A tool endpoint the agent reaches through the sidecar.
#[derive(Debug, Clone)]
pub struct Tool {
    pub name: String,
    pub kind: ToolKind,
    pub base_url: Uri,
    pub class: ToolClass,
    /// Refuse calls that carry no idempotency key (400) instead of passing them
    /// through unprotected.
    pub key_required: bool,
    /// Also journal `GET` calls (normally passed through).
    pub journal_get: bool,
    /// How long to wait for the tool's response head before the call is in doubt.
    pub timeout: Duration,
    /// For `probe` tools: the path (relative to `base_url`) that reports whether a
    /// call with a given key happened; `{key}` is replaced with the key.
    pub probe_path: Option<String>,
    /// What of its requests, besides credentials, is kept out of the journal.
    pub redact: crate::redact::Redactions,
}

/// Default of [`Limits::stream_idle_timeout`]: providers send keep-alives (Anthropic a
/// `ping` every few seconds) while they think, so five silent minutes is a stall.
pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// Limits and timeouts of the data plane.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_body_bytes: usize,
    pub connect_timeout: Duration,
    /// Time allowed for an upstream's response head (first byte).
    pub first_byte_timeout: Duration,
    /// The longest a provider's answer may send nothing (not even a keep-alive)
    /// once it started: a stream that stalls is ended with a typed error event.
    pub stream_idle_timeout: Duration,
    /// Longest SSE event accepted from an upstream.
    pub max_event_bytes: usize,
    /// A client connection whose writes make no progress this long (the agent
    /// stopped reading) is closed, releasing its upstream.
    pub client_stall_timeout: Duration,
    /// How long a client may take over a request's head (and, kept alive, wait before
    /// its next one) and pause in the middle of its body before the sidecar gives up on
    /// it; see `server::ConnLimits::read`.
    pub client_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 8 << 20,
            connect_timeout: Duration::from_secs(5),
            first_byte_timeout: Duration::from_secs(120),
            stream_idle_timeout: DEFAULT_STREAM_IDLE_TIMEOUT,
            max_event_bytes: crate::sse::DEFAULT_MAX_EVENT_BYTES,
            client_stall_timeout: Duration::from_secs(30),
            client_read_timeout: crate::server::DEFAULT_CLIENT_READ_TIMEOUT,
        }
    }
}

/// Per-task budget limits and where to downgrade.
#[derive(Debug, Clone, Default)]
pub struct Budget {
    /// Limits every task gets (unlimited by default: then no budget decision is made).
    pub limits: outrigger_types::Limits,
    /// Cheaper models a call may be downgraded to.
    pub downgrades: Vec<String>,
}

/// Tuning of the mechanics policies steer.
#[derive(Debug, Clone, Copy)]
pub struct Resilience {
    pub retry_budget: crate::resilience::retry_budget::Options,
    pub breaker: crate::resilience::breaker::Options,
    pub limiter: crate::resilience::limiter::Options,
    /// The most attempts one call makes, retries and fallbacks included, whatever the
    /// retry policy answers.
    pub max_attempts: u32,
}

/// `resilience.max_attempts` unless configured.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;

impl Default for Resilience {
    fn default() -> Self {
        Self {
            retry_budget: Default::default(),
            breaker: Default::default(),
            limiter: Default::default(),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
        }
    }
}

/// Everything the data plane needs to run.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub providers: Vec<Provider>,
    pub tools: Vec<Tool>,
    pub limits: Limits,
    pub budget: Budget,
    pub resilience: Resilience,
    pub streams: crate::streams::Options,
}

impl Options {
    /// The provider for `model` among those speaking `dialect`: the most specific
    /// pattern wins, then configuration order.
    pub fn provider_for(&self, dialect: Dialect, model: &str) -> Option<&Provider> {
        self.providers
            .iter()
            .filter(|p| p.dialect == dialect)
            .filter_map(|p| {
                p.models
                    .iter()
                    .filter(|m| m.matches(model))
                    .map(ModelPattern::specificity)
                    .max()
                    .map(|s| (s, p))
            })
            .enumerate()
            .max_by_key(|(i, (s, _))| (*s, std::cmp::Reverse(*i)))
            .map(|(_, (_, p))| p)
    }

    /// Every configured model pattern, for "unknown model" messages.
    pub fn known_models(&self, dialect: Dialect) -> Vec<String> {
        self.providers
            .iter()
            .filter(|p| p.dialect == dialect)
            .flat_map(|p| p.models.iter().map(move |m| format!("{m} ({})", p.name)))
            .collect()
    }

    pub fn tool(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(name: &str, dialect: Dialect, models: &[&str]) -> Provider {
        Provider {
            name: name.into(),
            dialect,
            base_url: Uri::from_static("http://127.0.0.1:1/v1"),
            api_key: None,
            models: models.iter().map(|m| ModelPattern::parse(m)).collect(),
            caps: Capabilities::permissive(),
        }
    }

    #[test]
    fn provider_choice_prefers_specific_patterns() {
        let opts = Options {
            providers: vec![
                provider("any", Dialect::OpenAi, &["*"]),
                provider("prefix", Dialect::OpenAi, &["gpt-4o*"]),
                provider("exact", Dialect::OpenAi, &["gpt-4o-mini"]),
                provider("claude", Dialect::Anthropic, &["*"]),
            ],
            ..Options::default()
        };
        let pick = |d, m| opts.provider_for(d, m).map(|p| p.name.as_str());
        assert_eq!(pick(Dialect::OpenAi, "gpt-4o-mini"), Some("exact"));
        assert_eq!(pick(Dialect::OpenAi, "gpt-4o"), Some("prefix"));
        assert_eq!(pick(Dialect::OpenAi, "o3"), Some("any"));
        assert_eq!(pick(Dialect::Anthropic, "gpt-4o"), Some("claude"));
    }

    #[test]
    fn first_configured_wins_a_tie() {
        let opts = Options {
            providers: vec![
                provider("a", Dialect::OpenAi, &["m"]),
                provider("b", Dialect::OpenAi, &["m"]),
            ],
            ..Options::default()
        };
        assert_eq!(
            opts.provider_for(Dialect::OpenAi, "m")
                .map(|p| p.name.as_str()),
            Some("a")
        );
    }

    #[test]
    fn url_joins_base_and_suffix() {
        let p = provider("a", Dialect::OpenAi, &["*"]);
        assert_eq!(
            p.url("/chat/completions").unwrap().to_string(),
            "http://127.0.0.1:1/v1/chat/completions"
        );
        let mut p = p;
        for (base, want) in [
            ("http://127.0.0.1:1/v1/", "http://127.0.0.1:1/v1/messages"),
            (
                "https://api.example:443",
                "https://api.example:443/messages",
            ),
        ] {
            p.base_url = base.parse().unwrap();
            assert_eq!(p.url("/messages").unwrap().to_string(), want);
        }
    }

    #[test]
    fn secret_debug_is_redacted() {
        let s = Secret::new("sk-live".into());
        assert!(!format!("{s:?}").contains("sk-live"));
    }
}
