//! A loopback OTLP/HTTP trace collector: decodes every `POST /v1/traces` and hands
//! the request over, so tests check the spans a sidecar really exported.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value::Value};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

pub use opentelemetry_proto::tonic::common::v1::any_value::Value as AttributeValue;

/// One export as received: the path it was posted to and the decoded request.
pub type Export = (String, ExportTraceServiceRequest);

/// The collector; dropping it leaves the listener running until the runtime ends.
pub struct Collector {
    /// Base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub endpoint: String,
    received: mpsc::UnboundedReceiver<Export>,
}

impl Collector {
    pub async fn start() -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, received) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let tx = tx.clone();
                        async move { Ok::<_, Infallible>(receive(req, &tx).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Self {
            endpoint: format!("http://{addr}"),
            received,
        })
    }

    /// The next export, or `None` when none arrives within `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Option<Export> {
        tokio::time::timeout(timeout, self.received.recv())
            .await
            .ok()
            .flatten()
    }

    /// Every span received until `done` holds for the spans so far, or `timeout`.
    pub async fn spans_until(
        &mut self,
        timeout: Duration,
        done: impl Fn(&[Span]) -> bool,
    ) -> Vec<Span> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut spans = Vec::new();
        while !done(&spans) {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let Some((_, request)) = self.next(left).await else {
                break;
            };
            for rs in request.resource_spans {
                for ss in rs.scope_spans {
                    spans.extend(ss.spans);
                }
            }
        }
        spans
    }
}

async fn receive(
    req: Request<Incoming>,
    tx: &mpsc::UnboundedSender<Export>,
) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let status = match ExportTraceServiceRequest::decode(body) {
        Ok(decoded) => {
            let _ = tx.send((path, decoded));
            http::StatusCode::OK
        }
        Err(_) => http::StatusCode::BAD_REQUEST,
    };
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/x-protobuf"),
    );
    resp
}

/// The value of attribute `key`, if present.
pub fn attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

/// A string attribute value, for comparisons.
pub fn text(s: &str) -> Value {
    Value::StringValue(s.to_owned())
}
