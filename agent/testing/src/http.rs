//! A tiny loopback HTTP server harness shared by the mocks.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

pub fn json_response(status: u16, value: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(full(value.to_string()));
    *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// Marks a response that should not be sent: the connection is dropped instead, so
/// the client sees the connection close before any answer (a reset).
#[derive(Debug, Clone, Copy)]
pub struct Abort;

pub fn abort() -> Response<Body> {
    let mut resp = Response::new(full(Bytes::new()));
    resp.extensions_mut().insert(Abort);
    resp
}

#[derive(Debug)]
struct Aborted;

impl std::fmt::Display for Aborted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped on purpose")
    }
}

impl std::error::Error for Aborted {}

/// A running loopback server; stops when dropped.
pub struct Server {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
}

impl Server {
    /// Serves `handler` on `addr` (use `127.0.0.1:0` for an ephemeral port).
    pub async fn start<H, F>(addr: SocketAddr, handler: H) -> std::io::Result<Server>
    where
        H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
        F: Future<Output = Response<Body>> + Send + 'static,
    {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (stop, mut stopped) = watch::channel(false);
        let handler = Arc::new(handler);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = stopped.changed() => break,
                };
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let handler = handler.clone();
                let mut stopped = stopped.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let fut = handler(req);
                        async move {
                            let resp = fut.await;
                            if resp.extensions().get::<Abort>().is_some() {
                                Err(Aborted)
                            } else {
                                Ok(resp)
                            }
                        }
                    });
                    let builder =
                        hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = stopped.changed() => {}
                    }
                });
            }
        });
        Ok(Server { addr, stop })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// Reads a whole request body (mocks only ever get small bodies).
pub async fn read_body(body: Incoming) -> Bytes {
    body.collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default()
}

/// Sends one `POST` with `headers` (`name: value` lines) and `body` over a fresh
/// connection and returns the whole raw answer (tests of the mocks themselves).
#[cfg(test)]
pub(crate) async fn raw_post(addr: SocketAddr, path: &str, headers: &[&str], body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut req = format!("POST {path} HTTP/1.1\r\nhost: mock\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str(&format!(
        "content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    ));
    conn.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    conn.read_to_string(&mut out).await.expect("read");
    out
}
