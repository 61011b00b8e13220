//! Header hygiene at the two edges of the data plane: what the agent sent that must
//! not travel on, and what the sidecar itself adds.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::options::{Dialect, Secret};

pub const TASK_ID: &str = "outrigger-task-id";
pub const REQUEST_ID: &str = "outrigger-request-id";
pub const REPLAYED: &str = "outrigger-replayed";
/// On model-call answers: the upstream attempts it took (retries and fallbacks included).
pub const ATTEMPTS: &str = "outrigger-attempts";
/// Marks an answer the sidecar's fault injector made up.
pub const FAULT_INJECTED: &str = "outrigger-fault-injected";
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus the ones the sidecar owns.
fn is_hop_or_owned(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    ) || name.as_str().starts_with("outrigger-")
}

/// Headers carrying the agent's own credentials: never forwarded, never journaled.
pub fn is_credential(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "authorization" | "x-api-key" | "api-key" | "proxy-authorization" | "cookie"
    )
}

/// Copies the agent's request headers for an upstream request, without hop-by-hop
/// headers, the sidecar's own, and the agent's credentials.
pub fn forwardable(from: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(from.len());
    for (k, v) in from {
        if !is_hop_or_owned(k) && !is_credential(k) {
            out.append(k.clone(), v.clone());
        }
    }
    out
}

/// Copies the agent's request headers for a tool: everything end to end (the
/// agent's own credentials included: tools are the agent's services), without
/// hop-by-hop headers and the sidecar's own.
pub fn end_to_end(from: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(from.len());
    for (k, v) in from {
        if !is_hop_or_owned(k) && k.as_str() != IDEMPOTENCY_KEY {
            out.append(k.clone(), v.clone());
        }
    }
    out
}

/// Injects the provider's credential the way its API expects it.
pub fn inject_credential(headers: &mut HeaderMap, dialect: Dialect, key: Option<&Secret>) {
    let Some(key) = key else { return };
    match dialect {
        Dialect::OpenAi => {
            if let Ok(mut v) = HeaderValue::from_str(&format!("Bearer {}", key.expose())) {
                v.set_sensitive(true);
                headers.insert(header::AUTHORIZATION, v);
            }
        }
        Dialect::Anthropic => {
            if let Ok(mut v) = HeaderValue::from_str(key.expose()) {
                v.set_sensitive(true);
                headers.insert(HeaderName::from_static("x-api-key"), v);
            }
            headers
                .entry(HeaderName::from_static("anthropic-version"))
                .or_insert(HeaderValue::from_static("2023-06-01"));
        }
    }
}

/// Removes hop-by-hop headers from an upstream response before it is relayed.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ] {
        headers.remove(name);
    }
}

pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim_start().get(.."text/event-stream".len()))
        .is_some_and(|v| v.eq_ignore_ascii_case("text/event-stream"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_and_hop_by_hop_are_not_forwarded() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "Bearer agent"),
            ("x-api-key", "agent"),
            ("connection", "keep-alive"),
            ("outrigger-task-id", "t1"),
            ("content-type", "application/json"),
            ("x-custom", "1"),
        ] {
            h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        let out = forwardable(&h);
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, vec!["content-type", "x-custom"]);
    }

    #[test]
    fn injection_per_dialect() {
        let key = Secret::new("pk-1".into());
        let mut h = HeaderMap::new();
        inject_credential(&mut h, Dialect::OpenAi, Some(&key));
        assert_eq!(h["authorization"], "Bearer pk-1");
        let mut h = HeaderMap::new();
        inject_credential(&mut h, Dialect::Anthropic, Some(&key));
        assert_eq!(h["x-api-key"], "pk-1");
        assert_eq!(h["anthropic-version"], "2023-06-01");
    }
}
