//! A minimal HTTP client for xtask (demo requests, readiness polls, load).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector)
}

pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub async fn send(
    client: &HttpClient,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> anyhow::Result<Reply> {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client.request(req.body(Full::new(body))?).await?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    })
}

/// Sends a request and calls `on_chunk` for each body chunk as it arrives.
pub async fn stream(
    client: &HttpClient,
    url: &str,
    headers: &[(&str, &str)],
    body: Bytes,
    mut on_chunk: impl FnMut(&[u8]),
) -> anyhow::Result<u16> {
    let mut req = Request::builder().method(Method::POST).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client.request(req.body(Full::new(body))?).await?;
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            on_chunk(&data);
        }
    }
    Ok(status)
}

/// Polls `url` until it answers 200 or `timeout` passes.
pub async fn wait_ready(client: &HttpClient, url: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(r) = send(client, Method::GET, url, &[], Bytes::new()).await
            && r.status == 200
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!("{url} did not answer 200 within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
