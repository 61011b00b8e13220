//! Serving HTTP on a listener with a graceful drain: on shutdown, stop accepting,
//! let in-flight requests finish until the drain deadline, then cut what is left.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::body::Body;

/// How a drain went.
#[derive(Debug, Clone, Copy)]
pub struct Drained {
    /// Whether every connection finished before the deadline.
    pub complete: bool,
    pub took: Duration,
}

/// Serves `handler` on `listener` until `shutdown` resolves, then drains for up to
/// `drain_deadline`.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    drain_deadline: Duration,
) -> Drained
where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let handler = Arc::new(handler);
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        let svc = service_fn(move |req| {
            let fut = handler(req, peer);
            async move { Ok::<_, Infallible>(fut.await) }
        });
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn.into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let started = Instant::now();
    let complete = tokio::time::timeout(drain_deadline, graceful.shutdown())
        .await
        .is_ok();
    Drained {
        complete,
        took: started.elapsed(),
    }
}
