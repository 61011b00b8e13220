//! RFC 9457 problem details: every error the sidecar itself produces is an
//! `application/problem+json` body whose `detail` says what to fix.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::{Map, Value, json};

use crate::body::{Body, full};

/// A problem document under construction.
#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    /// Short, stable slug; the `type` URI is `urn:outrigger:problem:<slug>`.
    pub slug: &'static str,
    pub title: &'static str,
    pub detail: String,
    pub extensions: Map<String, Value>,
    pub headers: Vec<(header::HeaderName, HeaderValue)>,
}

impl Problem {
    pub fn new(
        status: StatusCode,
        slug: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            status,
            slug,
            title,
            detail: detail.into(),
            extensions: Map::new(),
            headers: Vec::new(),
        }
    }

    /// A request body that paused longer than `idle` (`[limits] client_read_timeout`),
    /// on either plane. The connection is closed: the rest of the body is not read.
    pub fn body_timeout(idle: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "body-timeout",
            "Request body too slow",
            format!(
                "No byte of the request body arrived for {} s ([limits] client_read_timeout); \
                 nothing was done with the request. Send the body without pausing, or raise \
                 the limit.",
                idle.as_secs_f64()
            ),
        )
        .header(header::CONNECTION, HeaderValue::from_static("close"))
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extensions.insert(key.to_string(), value.into());
        self
    }

    pub fn header(mut self, name: header::HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    pub fn type_uri(&self) -> String {
        format!("urn:outrigger:problem:{}", self.slug)
    }

    pub fn to_json(&self) -> Value {
        let mut doc = json!({
            "type": self.type_uri(),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let Some(obj) = doc.as_object_mut() {
            for (k, v) in &self.extensions {
                obj.insert(k.clone(), v.clone());
            }
        }
        doc
    }

    pub fn into_response(self) -> Response<Body> {
        let body = Bytes::from(self.to_json().to_string());
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        for (k, v) in self.headers {
            h.append(k, v);
        }
        resp
    }
}
