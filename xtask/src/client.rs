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
    wait_for(client, url, timeout, |status| status == 200, "200").await
}

/// Polls `url` until it answers at all (any status: the server is up) or `timeout`
/// passes.
pub async fn wait_answering(
    client: &HttpClient,
    url: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    wait_for(client, url, timeout, |_| true, "at all").await
}

async fn wait_for(
    client: &HttpClient,
    url: &str,
    timeout: Duration,
    accept: impl Fn(u16) -> bool,
    what: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(r) = send(client, Method::GET, url, &[], Bytes::new()).await
            && accept(r.status)
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!("{url} did not answer {what} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A server that answers every request 404, as the mock tool's status route does
    /// for a key it never saw.
    async fn not_found_server() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf).await;
                let _ = conn
                    .write_all(
                        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                    )
                    .await;
            }
        });
        format!("http://{addr}/status/none-ready")
    }

    #[tokio::test]
    async fn a_404_is_an_answer_but_not_ready() {
        let url = not_found_server().await;
        let c = client();
        wait_answering(&c, &url, Duration::from_secs(5))
            .await
            .expect("a 404 is an answer");
        let e = wait_ready(&c, &url, Duration::from_millis(200))
            .await
            .expect_err("a 404 is not 200");
        assert!(e.to_string().contains("did not answer 200"), "{e}");
    }
}
