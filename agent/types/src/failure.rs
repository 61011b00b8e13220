//! Why an attempt failed: the states of the call state machine that a retry
//! policy reasons about (the WIT `failure` variant).

use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Failure {
    /// 429 (or an equivalent), with the upstream's `Retry-After` if it sent one.
    RateLimited {
        #[serde(with = "opt_millis", default)]
        retry_after: Option<Duration>,
    },
    /// A 5xx (or 529) from the upstream.
    ServerError {
        status: u16,
    },
    /// No answer within the deadline.
    Timeout,
    /// The connection failed; `sent` when the request may already have left.
    Connect {
        sent: bool,
    },
    /// The stream broke after it started.
    StreamInterrupted {
        events_delivered: u32,
        inside_tool_call: bool,
    },
    ContextOverflow,
    ContentFiltered,
    ToolParseError,
}

impl Failure {
    /// A short stable name, used as a metric label (`retries by reason`).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::RateLimited { .. } => "rate_limited",
            Self::ServerError { .. } => "server_error",
            Self::Timeout => "timeout",
            Self::Connect { .. } => "connect_error",
            Self::StreamInterrupted { .. } => "stream_interrupted",
            Self::ContextOverflow => "context_overflow",
            Self::ContentFiltered => "content_filtered",
            Self::ToolParseError => "tool_parse_error",
        }
    }

    /// Whether the failed attempt may have reached the upstream (and so may have
    /// had an effect there).
    pub fn may_have_dispatched(&self) -> bool {
        match self {
            Self::Connect { sent } => *sent,
            Self::RateLimited { .. }
            | Self::ServerError { .. }
            | Self::Timeout
            | Self::StreamInterrupted { .. }
            | Self::ContextOverflow
            | Self::ContentFiltered
            | Self::ToolParseError => true,
        }
    }
}

mod opt_millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(d) => s.serialize_some(&u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}
