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
use hyper_util::client::legacy::connect::{HttpConnector, capture_connection};
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

    /// Sends `req` and waits up to `timeout` for the response head. A `timeout`
    /// that ends before the request had a connection (a connect slower than it,
    /// whatever `connect_timeout` allows) is a [`Error::Connect`]: nothing was sent.
    pub async fn send(
        &self,
        mut req: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, Error> {
        let target = req.uri().authority().cloned();
        let authority = || target.as_ref().map(|a| a.to_string()).unwrap_or_default();
        // Set once the request has a connection (new or pooled): before that, not a
        // byte of it can have left. `connect_timeout` bounds only the TCP connect, not
        // the DNS lookup before it or the TLS handshake after it, so a timeout of any
        // length can end before there is a connection.
        let connection = capture_connection(&mut req);
        match tokio::time::timeout(timeout, self.client().request(req)).await {
            Err(_) if connection.connection_metadata().is_none() => Err(Error::Connect {
                authority: authority(),
                detail: format!("no connection within {timeout:?}"),
            }),
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
        // Without a timer the idle timeout is never enforced: idle connections
        // would only be dropped when a checkout happened to find them expired.
        .pool_timer(hyper_util::rt::TokioTimer::new())
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

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::net::{TcpListener, TcpSocket, TcpStream};

    use super::*;

    fn get(addr: SocketAddr) -> Request<Full<Bytes>> {
        let mut req = Request::new(Full::new(Bytes::new()));
        *req.uri_mut() = format!("http://{addr}/").parse().expect("a URI");
        req
    }

    /// A tool `timeout` shorter than `connect_timeout` that ends while the connect
    /// is still going is a connect failure (nothing was sent), not a timeout after
    /// the send; one that ends while the answer is awaited is a timeout.
    #[tokio::test]
    async fn a_timeout_before_the_connection_is_a_connect_failure() {
        // A listener that never accepts, its backlog full: a further connect hangs
        // (the kernel drops its SYN).
        let socket = TcpSocket::new_v4().expect("a socket");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bound");
        let full = socket.listen(1).expect("listening");
        let addr = full.local_addr().expect("an address");
        let mut held = Vec::new();
        while let Ok(Ok(stream)) =
            tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await
        {
            held.push(stream);
            assert!(held.len() < 64, "the backlog never filled");
        }
        let upstream = Upstream::new(Duration::from_secs(30));
        let e = upstream
            .send(get(addr), Duration::from_millis(300))
            .await
            .expect_err("no connection");
        assert!(matches!(e, Error::Connect { .. }), "{e:?}");
        assert!(!e.may_have_been_sent());

        // Connected, then silence: the request may have been processed.
        let silent = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("listening");
        let addr = silent.local_addr().expect("an address");
        let accepting = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok((stream, _)) = silent.accept().await {
                kept.push(stream);
            }
        });
        let e = upstream
            .send(get(addr), Duration::from_millis(300))
            .await
            .expect_err("no answer");
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        assert!(e.may_have_been_sent());
        accepting.abort();
        drop((full, held));
    }

    /// `connect_timeout` bounds the TCP connect only: a TLS handshake that never
    /// finishes outlasts it, and a timeout that ends there, however long, is a
    /// connect failure (nothing was sent).
    #[tokio::test]
    async fn a_handshake_that_never_finishes_is_a_connect_failure() {
        let silent = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("listening");
        let addr = silent.local_addr().expect("an address");
        let accepting = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok((stream, _)) = silent.accept().await {
                kept.push(stream);
            }
        });
        let upstream = Upstream::new(Duration::from_millis(100));
        let mut req = get(addr);
        *req.uri_mut() = format!("https://{addr}/").parse().expect("a URI");
        let e = upstream
            .send(req, Duration::from_millis(400))
            .await
            .expect_err("no handshake");
        assert!(matches!(e, Error::Connect { .. }), "{e:?}");
        assert!(!e.may_have_been_sent());
        accepting.abort();
    }
}
