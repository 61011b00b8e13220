//! `GET /v1/models`.

use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Method, Response, StatusCode, header};
use serde_json::json;

use super::build_request;
use crate::Shared;
use crate::body::{self, Body};
use crate::options::Dialect;

/// `GET /v1/models`: the configured models in OpenAI's list shape; providers that
/// serve `*` contribute what their own `/models` endpoint lists.
pub async fn list(shared: &Shared, agent_headers: &http::HeaderMap) -> Response<Body> {
    let mut data = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for p in &shared.options.providers {
        for m in &p.models {
            if let crate::options::ModelPattern::Name(name) = m
                && !name.ends_with('*')
                && seen.insert(name.clone())
            {
                data.push(json!({"id": name, "object": "model", "owned_by": p.name}));
            }
        }
    }
    for p in &shared.options.providers {
        if !p.models.contains(&crate::options::ModelPattern::Any) {
            continue;
        }
        let suffix = match p.dialect {
            Dialect::OpenAi => "/models",
            Dialect::Anthropic => "/v1/models",
        };
        let Ok(req) = build_request(p, suffix, Method::GET, agent_headers, Bytes::new()) else {
            continue;
        };
        let started = Instant::now();
        match shared
            .upstream
            .send(req, shared.options.limits.connect_timeout)
            .await
        {
            Ok(resp) if resp.status().is_success() => {
                // A provider that stalls after its head does not hold the listing.
                let read = body::read_limited(resp.into_body(), 4 << 20);
                let bytes = tokio::time::timeout(shared.options.limits.connect_timeout, read)
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or_default();
                let listed: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
                for m in listed["data"].as_array().into_iter().flatten() {
                    if let Some(id) = m["id"].as_str()
                        && seen.insert(id.to_string())
                    {
                        data.push(json!({"id": id, "object": "model", "owned_by": p.name}));
                    }
                }
            }
            Ok(resp) => {
                tracing::warn!(provider = %p.name, status = resp.status().as_u16(), "listing models failed")
            }
            Err(e) => {
                tracing::warn!(provider = %p.name, error = %e, took = ?started.elapsed(), "listing models failed")
            }
        }
    }
    let mut resp = Response::new(body::full(
        json!({"object": "list", "data": data}).to_string(),
    ));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    *resp.status_mut() = StatusCode::OK;
    resp
}
