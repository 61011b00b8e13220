//! The one HTTP client the data plane uses to reach providers and tools, with the
//! distinction that matters for safe retries: did the request possibly leave?

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Why an upstream exchange failed before a response head arrived.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The connection could not be made: the request provably never left.
    #[error("could not connect to {authority}: {detail}")]
    Connect { authority: String, detail: String },
    /// The connection broke after the request may have been written.
    #[error("the connection to {authority} failed after the request was sent: {detail}")]
    AfterSend { authority: String, detail: String },
    /// No response head within the deadline (the request may have been processed).
    #[error("{authority} sent no response within {timeout:?}")]
    Timeout {
        authority: String,
        timeout: Duration,
    },
}

impl Error {
    /// Whether the request may have reached the upstream.
    pub fn may_have_been_sent(&self) -> bool {
        match self {
            Self::Connect { .. } => false,
            Self::AfterSend { .. } | Self::Timeout { .. } => true,
        }
    }
}

/// A pooled HTTP/1.1 + HTTP/2 client for `http` and `https` upstreams: one pool per
/// data-plane worker (made on the worker's first use), so a worker's upstream
/// connections are driven by the worker itself.
#[derive(Clone)]
pub struct Upstream {
    clients: Arc<[OnceLock<Pooled>]>,
    connect_timeout: Duration,
}

type Pooled = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Pools kept apart: the main runtime's and 64 workers'; more workers share.
const SLOTS: usize = 65;

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream").finish_non_exhaustive()
    }
}

impl Upstream {
    pub fn new(connect_timeout: Duration) -> Self {
        Self {
            clients: (0..SLOTS).map(|_| OnceLock::new()).collect(),
            connect_timeout,
        }
    }

    /// The calling worker's pool.
    fn client(&self) -> &Pooled {
        let slot = crate::workers::slot() % self.clients.len();
        self.clients[slot].get_or_init(|| pooled(self.connect_timeout))
    }

    /// Sends `req` and waits up to `timeout` for the response head.
    pub async fn send(
        &self,
        req: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, Error> {
        let target = req.uri().authority().cloned();
        let authority = || target.as_ref().map(|a| a.to_string()).unwrap_or_default();
        match tokio::time::timeout(timeout, self.client().request(req)).await {
            Err(_) => Err(Error::Timeout {
                authority: authority(),
                timeout,
            }),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => {
                let detail = error_chain(&e);
                let authority = authority();
                if e.is_connect() {
                    Err(Error::Connect { authority, detail })
                } else {
                    Err(Error::AfterSend { authority, detail })
                }
            }
        }
    }
}

fn pooled(connect_timeout: Duration) -> Pooled {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(https)
}

/// The error and its sources, as one line (hyper's top-level messages are terse).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let m = inner.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        src = inner.source();
    }
    s
}
