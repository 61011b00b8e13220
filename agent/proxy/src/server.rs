//! Serving HTTP on a listener with a graceful drain: on shutdown, stop accepting,
//! let in-flight requests finish until the drain deadline, then cut what is left.
//! Connections can be given a write-stall limit: a client that stops reading does
//! not get to hold its upstream stream (and its memory) open for ever.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;

use crate::body::Body;
use crate::workers::Workers;

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
    let nothing_else = std::future::ready(());
    serve_with_stall_limit(
        listener,
        handler,
        shutdown,
        drain_deadline,
        None,
        None,
        nothing_else,
    )
    .await
}

/// [`serve`], with connections closed when a write to the client makes no progress
/// for `stall_limit` (the client stopped reading): the request's upstream is then
/// released like on any disconnect. With `workers`, each connection is served on the
/// next worker thread instead of the caller's runtime; the workers stop once the
/// drain is over. The drain also waits, within its deadline, for `settled`: work
/// that outlives its connection (calls whose agents went away).
pub async fn serve_with_stall_limit<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    drain_deadline: Duration,
    stall_limit: Option<Duration>,
    workers: Option<Workers>,
    settled: impl Future<Output = ()>,
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
        // The same for either runtime: the connection, watched by the drain.
        let watcher = graceful.watcher();
        let builder = builder.clone();
        let serve_one = async move |stream: TcpStream| {
            let io = TokioIo::new(StallLimited::new(stream, stall_limit));
            let conn = builder.serve_connection_with_upgrades(io, svc).into_owned();
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
        };
        let Some(workers) = &workers else {
            tokio::spawn(serve_one(stream));
            continue;
        };
        // The socket leaves this runtime's reactor and joins the worker's.
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, %peer, "cannot hand a connection to a worker");
                continue;
            }
        };
        workers.next().spawn(async move {
            match TcpStream::from_std(stream) {
                Ok(stream) => serve_one(stream).await,
                Err(e) => tracing::warn!(error = %e, %peer, "a worker cannot take a connection"),
            }
        });
    }
    drop(listener);
    let started = Instant::now();
    let drained = async {
        graceful.shutdown().await;
        settled.await;
    };
    let complete = tokio::time::timeout(drain_deadline, drained).await.is_ok();
    // What is left past the deadline is cut with the workers.
    drop(workers);
    Drained {
        complete,
        took: started.elapsed(),
    }
}

/// A connection whose writes fail with `TimedOut` once one has been pending (the
/// peer's receive window full) for longer than the limit.
pub struct StallLimited<S> {
    inner: S,
    limit: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl<S> StallLimited<S> {
    pub fn new(inner: S, limit: Option<Duration>) -> Self {
        Self {
            inner,
            limit,
            timer: None,
            armed: false,
        }
    }

    /// Called when a write is pending: starts the clock on the first such call and
    /// fails the write once the limit has passed with no progress.
    fn stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let Some(limit) = self.limit else {
            return Poll::Pending;
        };
        let deadline = tokio::time::Instant::now() + limit;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            timer.as_mut().reset(deadline);
            self.armed = true;
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.armed = false;
                Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client read nothing for {limit:?}"),
                ))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn progressed<T>(
        &mut self,
        result: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        match result {
            Poll::Ready(r) => {
                self.armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => self.stalled(cx).map(Err),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for StallLimited<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallLimited<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.progressed(r, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.progressed(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_flush(cx);
        this.progressed(r, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_write_pending_past_the_limit_fails_and_one_that_progresses_does_not() {
        // A pipe with 16 bytes of room stands in for a client's full receive window.
        let (client, mut peer) = tokio::io::duplex(16);
        let mut conn = StallLimited::new(client, Some(Duration::from_secs(2)));
        conn.write_all(&[0; 16])
            .await
            .expect("room for the first bytes");
        let started = tokio::time::Instant::now();
        let err = conn
            .write_all(&[0; 16])
            .await
            .expect_err("the peer reads nothing");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(2));

        // A reader that drains slowly (1 s per 16 bytes) is never cut.
        let mut conn = StallLimited::new(conn.inner, Some(Duration::from_secs(2)));
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            let mut total = 0;
            while total < 16 * 6 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                total += tokio::io::AsyncReadExt::read(&mut peer, &mut buf)
                    .await
                    .expect("read");
            }
            total
        });
        conn.write_all(&[0; 16 * 5])
            .await
            .expect("a slow reader keeps the connection");
        drop(conn);
        assert!(reader.await.expect("reader") >= 16 * 5);
    }
}
