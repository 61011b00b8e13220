//! The smallest useful HTTP proxy: every request forwarded to one upstream and the
//! response streamed back, nothing else. The benchmark's floor for what relaying
//! costs, measured in the same run as the sidecar.

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::http::{BoxError, Server, full, read_body};

pub async fn start(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<Server> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector);
    Server::start(listen, move |req: Request<hyper::body::Incoming>| {
        let client = client.clone();
        async move {
            let (mut parts, body) = req.into_parts();
            let body = read_body(body).await;
            let pq = parts
                .uri
                .path_and_query()
                .map(|p| p.as_str())
                .unwrap_or("/");
            parts.uri = match format!("http://{upstream}{pq}").parse() {
                Ok(u) => u,
                Err(_) => return hyper::Response::new(full("bad uri")),
            };
            parts.headers.remove(hyper::header::HOST);
            let req = Request::from_parts(parts, Full::new(body));
            match client.request(req).await {
                Ok(resp) => resp.map(|b| b.map_err(BoxError::from).boxed_unsync()),
                Err(e) => {
                    let mut r = hyper::Response::new(full(e.to_string()));
                    *r.status_mut() = hyper::StatusCode::BAD_GATEWAY;
                    r
                }
            }
        }
    })
    .await
}
