//! Header hygiene at the two edges of the data plane: what the agent sent that must
//! not travel on, and what the sidecar itself adds.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::options::{Dialect, Secret};

pub const TASK_ID: &str = "outrigger-task-id";
pub const SYNTHETIC: &str = "outrigger-synthetic";
pub const REQUEST_ID: &str = "outrigger-request-id";
pub const REPLAYED: &str = "outrigger-replayed";
/// On model-call answers: the upstream attempts it took (retries and fallbacks included).
pub const ATTEMPTS: &str = "outrigger-attempts";
/// Marks an answer the sidecar's fault injector made up.
pub const FAULT_INJECTED: &str = "outrigger-fault-injected";
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The Anthropic API version a request is sent with when its agent names none.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// Hop-by-hop headers (RFC 9110 §7.6.1 and the obsolete ones still seen), and the
/// proxy authentication of one hop (`Proxy-Authorization`, `Proxy-Authenticate`):
/// never relayed, in either direction.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
];

/// The names a message's `Connection` header lists: hop-by-hop for that message
/// too (RFC 9110 §7.6.1).
fn nominated(h: &HeaderMap) -> Vec<HeaderName> {
    h.get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect()
}

fn is_hop_by_hop(name: &HeaderName, nominated: &[HeaderName]) -> bool {
    HOP_BY_HOP.contains(&name.as_str()) || nominated.contains(name)
}

/// Headers the sidecar sets itself on an upstream request.
fn is_owned(name: &HeaderName) -> bool {
    matches!(name.as_str(), "host" | "content-length") || name.as_str().starts_with("outrigger-")
}

/// Headers carrying the agent's own credentials: never forwarded to a provider,
/// never journaled (a tool, the agent's own service, gets them).
pub fn is_credential(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "authorization" | "x-api-key" | "api-key" | "proxy-authorization" | "cookie"
    )
}

/// Copies the agent's request headers for a provider, without hop-by-hop headers,
/// the sidecar's own, and the agent's credentials. The answer is asked for
/// uncompressed (`Accept-Encoding: identity`, whatever the agent accepts): the
/// sidecar reads it (usage, tool calls, SSE framing, key scrubbing) and journals it.
pub fn forwardable(from: &HeaderMap) -> HeaderMap {
    let hop = nominated(from);
    let mut out = HeaderMap::with_capacity(from.len() + 1);
    for (k, v) in from {
        if !is_hop_by_hop(k, &hop) && !is_owned(k) && !is_credential(k) {
            out.append(k.clone(), v.clone());
        }
    }
    ask_identity(&mut out);
    out
}

/// Asks for an uncompressed answer: one the sidecar reads as it passes.
pub fn ask_identity(headers: &mut HeaderMap) {
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
}

/// Copies the agent's request headers for a tool: everything end to end (the
/// agent's own credentials included: tools are the agent's services), without
/// hop-by-hop headers (the agent's credentials for a proxy among them) and the
/// sidecar's own.
pub fn end_to_end(from: &HeaderMap) -> HeaderMap {
    let hop = nominated(from);
    let mut out = HeaderMap::with_capacity(from.len());
    for (k, v) in from {
        if !is_hop_by_hop(k, &hop) && !is_owned(k) && k.as_str() != IDEMPOTENCY_KEY {
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
                .or_insert(HeaderValue::from_static(ANTHROPIC_VERSION));
        }
    }
}

/// Removes hop-by-hop headers (those its `Connection` header lists among them) from
/// an upstream response before it is relayed or stored.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in nominated(headers) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
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
            ("accept-encoding", "gzip, deflate, br"),
        ] {
            h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        let out = forwardable(&h);
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, vec!["content-type", "x-custom", "accept-encoding"]);
        // A provider's answer is read and journaled: it is asked for uncompressed.
        assert_eq!(out[header::ACCEPT_ENCODING], "identity");
        assert_eq!(
            forwardable(&HeaderMap::new())[header::ACCEPT_ENCODING],
            "identity"
        );
    }

    fn map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        h
    }

    fn names(h: &HeaderMap) -> Vec<&str> {
        h.keys().map(|k| k.as_str()).collect()
    }

    /// RFC 9110 §7.6.1: what `Connection` lists is hop-by-hop, and so is a proxy's
    /// authentication; neither reaches a tool or a provider, nor the agent.
    #[test]
    fn headers_named_in_connection_and_proxy_credentials_stay_on_their_hop() {
        let agent = map(&[
            ("connection", "keep-alive, X-Hop , x-trace-hop"),
            ("x-hop", "1"),
            ("x-trace-hop", "2"),
            ("proxy-authorization", "Basic cHJveHk6cHc="),
            ("authorization", "Bearer agent"),
            ("idempotency-key", "k"),
            ("content-type", "application/json"),
        ]);
        assert_eq!(
            names(&end_to_end(&agent)),
            ["authorization", "content-type"]
        );
        assert_eq!(
            names(&forwardable(&agent)),
            ["idempotency-key", "content-type", "accept-encoding"]
        );

        let mut answer = map(&[
            ("connection", "close, x-upstream-hop"),
            ("x-upstream-hop", "1"),
            ("proxy-authenticate", "Basic realm=\"proxy\""),
            ("transfer-encoding", "chunked"),
            ("www-authenticate", "Bearer realm=\"tool\""),
            ("retry-after", "3"),
        ]);
        strip_hop_by_hop(&mut answer);
        assert_eq!(names(&answer), ["www-authenticate", "retry-after"]);
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
