//! Serving HTTP on a listener with a graceful drain: on shutdown, stop accepting,
//! let in-flight requests finish until the drain deadline, then cut what is left.
//! Connections can be given limits: a client that stops reading does not get to hold
//! its upstream stream (and its memory) open for ever, and one that sends its request
//! slowly, or nothing, does not get to hold a connection.

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
use hyper_util::rt::{TokioIo, TokioTimer};
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
    serve_with_limits(
        listener,
        handler,
        shutdown,
        drain_deadline,
        ConnLimits::default(),
        None,
        nothing_else,
    )
    .await
}

/// What a client connection may take from the sidecar.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// A write to the client that makes no progress this long (the client stopped
    /// reading) closes the connection; the request's upstream is then released like on
    /// any disconnect.
    pub write_stall: Option<Duration>,
    /// The time a client has to send a request's head: from the connection's start
    /// (its first byte, then the whole head; each may take this long) and, on a kept-alive
    /// connection, from the end of the previous answer. A connection past it is closed.
    /// Bodies are bounded by their reader (`body::read_request`).
    pub read: Option<Duration>,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            write_stall: None,
            read: Some(DEFAULT_CLIENT_READ_TIMEOUT),
        }
    }
}

/// [`ConnLimits::read`] unless configured.
pub const DEFAULT_CLIENT_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// [`serve`], with connections held to `limits`. With `workers`, each connection is
/// served on the next worker thread instead of the caller's runtime; the workers stop
/// once the drain is over. The drain also waits, within its deadline, for `settled`:
/// work that outlives its connection (calls whose agents went away).
pub async fn serve_with_limits<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    drain_deadline: Duration,
    limits: ConnLimits,
    workers: Option<Workers>,
    settled: impl Future<Output = ()>,
) -> Drained
where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let handler = Arc::new(handler);
    let graceful = GracefulShutdown::new();
    // Off the workers, every task a connection runs on (the connection's own, and
    // one per HTTP/2 stream) is kept in one set, cut at the drain deadline; on a
    // worker they are spawned on its runtime, and cut with it.
    let tasks = Tasks(workers.is_none().then(Arc::default));
    let mut builder = auto::Builder::new(tasks.clone());
    if let Some(read) = limits.read {
        // hyper starts this clock when it waits for a head, idle keep-alive included.
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(read);
    }
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
            let io = TokioIo::new(ClientConn::new(stream, limits));
            let conn = builder.serve_connection_with_upgrades(io, svc).into_owned();
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
        };
        let Some(workers) = &workers else {
            hyper::rt::Executor::execute(&tasks, serve_one(stream));
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
    // What is left past the deadline is cut: here, and with the workers (whose
    // threads are waited for off this runtime's threads).
    tasks.cut().await;
    if let Some(workers) = workers {
        let _ = tokio::task::spawn_blocking(move || drop(workers)).await;
    }
    Drained {
        complete,
        took: started.elapsed(),
    }
}

/// hyper's executor: spawns on the current runtime, as `TokioExecutor` does, and
/// with a set, into it, so that a drain can cut what is left (see
/// [`Tasks::cut`]).
#[derive(Clone, Default)]
struct Tasks(Option<Arc<std::sync::Mutex<tokio::task::JoinSet<()>>>>);

impl<F> hyper::rt::Executor<F> for Tasks
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        let Some(set) = &self.0 else {
            tokio::spawn(fut);
            return;
        };
        let mut set = set
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Finished tasks are reaped as new ones come, so the set stays small.
        while set.try_join_next().is_some() {}
        set.spawn(async move {
            fut.await;
        });
    }
}

impl Tasks {
    /// Aborts every task in the set and waits until each has been dropped,
    /// including any a task spawned while the set was being cut.
    async fn cut(&self) {
        let Some(set) = &self.0 else { return };
        loop {
            let mut cut = std::mem::take(
                &mut *set
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            if cut.is_empty() {
                return;
            }
            cut.abort_all();
            while cut.join_next().await.is_some() {}
        }
    }
}

/// A client connection whose writes fail with `TimedOut` once one has been pending
/// (the peer's receive window full) for longer than the write-stall limit, and whose
/// reads fail so when its protocol is still not known at the read limit from its
/// start (hyper's head timer only starts once it is: after a byte that is not the
/// HTTP/2 preface's, or the whole preface).
pub struct ClientConn<S> {
    inner: S,
    limit: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
    armed: bool,
    /// Until the protocol is known: when the connection is given up, and on what.
    first_byte: Option<(Pin<Box<Sleep>>, Duration)>,
    /// How many bytes read so far match the HTTP/2 preface.
    preface_seen: usize,
}

/// What an HTTP/2 client sends first; until its bytes stop matching it (or it is
/// all there) the protocol is not known, and hyper's head timer has not started.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl<S> ClientConn<S> {
    pub fn new(inner: S, limits: ConnLimits) -> Self {
        Self {
            inner,
            limit: limits.write_stall,
            timer: None,
            armed: false,
            first_byte: limits
                .read
                .map(|read| (Box::pin(tokio::time::sleep(read)), read)),
            preface_seen: 0,
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

impl<S: AsyncRead + Unpin> AsyncRead for ClientConn<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let Some((deadline, read)) = &mut this.first_byte else {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        };
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                // Known once a byte differs from the HTTP/2 preface (HTTP/1), or the
                // whole preface is there (HTTP/2, whose connections no head timer
                // bounds after it).
                let read = &buf.filled()[before..];
                let expected = &H2_PREFACE[this.preface_seen..];
                let n = read.len().min(expected.len());
                if read[..n] != expected[..n] || this.preface_seen + n == H2_PREFACE.len() {
                    this.first_byte = None;
                } else {
                    this.preface_seen += n;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                this.first_byte = None;
                Poll::Ready(Err(e))
            }
            Poll::Pending => match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client sent nothing for {read:?}"),
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ClientConn<S> {
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

    /// A request still running at the drain deadline is cut there: its handler is
    /// dropped and its client sees the connection close, for connections served
    /// on the caller's runtime (the admin plane) as for the workers', over HTTP/1
    /// and HTTP/2 (whose streams hyper runs as tasks of their own).
    #[tokio::test]
    async fn a_request_still_running_at_the_drain_deadline_is_cut() {
        for (on_workers, http2) in [(false, false), (false, true), (true, false), (true, true)] {
            let workers = on_workers.then(|| Workers::start(1).expect("a worker"));
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
            let addr = listener.local_addr().expect("an address");
            let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
            let started_tx = std::sync::Mutex::new(Some(started_tx));
            let (dropped_tx, dropped_rx) = std::sync::mpsc::channel::<()>();
            let dropped_tx = std::sync::Mutex::new(dropped_tx);
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(serve_with_limits(
                listener,
                move |_req, _peer| {
                    if let Some(tx) = started_tx.lock().expect("lock").take() {
                        let _ = tx.send(());
                    }
                    // Disconnected once the handler is dropped.
                    let held = dropped_tx.lock().expect("lock").clone();
                    async move {
                        let _held = held;
                        std::future::pending::<Response<Body>>().await
                    }
                },
                async move {
                    let _ = stop_rx.await;
                },
                Duration::from_millis(100),
                ConnLimits::default(),
                workers,
                std::future::ready(()),
            ));
            let tcp = TcpStream::connect(addr).await.expect("connect");
            let request = move || {
                Request::get(format!("http://{addr}/"))
                    .body(http_body_util::Empty::<bytes::Bytes>::new())
                    .expect("a request")
            };
            let (answer, conn) = if http2 {
                let (mut send, conn) = hyper::client::conn::http2::handshake(
                    hyper_util::rt::TokioExecutor::new(),
                    TokioIo::new(tcp),
                )
                .await
                .expect("an HTTP/2 handshake");
                let answer = tokio::spawn(async move { send.send_request(request()).await });
                (answer, tokio::spawn(async move { conn.await.is_ok() }))
            } else {
                let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                    .await
                    .expect("an HTTP/1 handshake");
                let answer = tokio::spawn(async move { send.send_request(request()).await });
                (answer, tokio::spawn(async move { conn.await.is_ok() }))
            };
            let case = format!("workers {on_workers}, HTTP/2 {http2}");
            started_rx.await.expect("the request reached the handler");
            let _ = stop_tx.send(());
            let drained = tokio::time::timeout(Duration::from_secs(5), server)
                .await
                .expect("the drain ends at its deadline")
                .expect("the server task");
            assert!(!drained.complete, "{case}: the request did not finish");
            assert_eq!(
                dropped_rx.try_recv(),
                Err(std::sync::mpsc::TryRecvError::Disconnected),
                "{case}: the handler was dropped before the drain returned"
            );
            let answered = tokio::time::timeout(Duration::from_secs(5), answer)
                .await
                .expect("the connection is closed, not left open")
                .expect("the client task");
            assert!(answered.is_err(), "{case}: no answer came: {answered:?}");
            let _ = tokio::time::timeout(Duration::from_secs(5), conn).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_pending_past_the_limit_fails_and_one_that_progresses_does_not() {
        // A pipe with 16 bytes of room stands in for a client's full receive window.
        let (client, mut peer) = tokio::io::duplex(16);
        let limits = ConnLimits {
            write_stall: Some(Duration::from_secs(2)),
            read: None,
        };
        let mut conn = ClientConn::new(client, limits);
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
        let mut conn = ClientConn::new(conn.inner, limits);
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

    #[tokio::test(start_paused = true)]
    async fn a_client_that_sends_nothing_is_given_up_and_one_that_starts_is_not() {
        use tokio::io::AsyncReadExt;
        let limits = ConnLimits {
            write_stall: None,
            read: Some(Duration::from_secs(3)),
        };
        let (client, _peer) = tokio::io::duplex(64);
        let mut conn = ClientConn::new(client, limits);
        let started = tokio::time::Instant::now();
        let err = conn
            .read(&mut [0u8; 8])
            .await
            .expect_err("nothing was sent");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(3));

        // The start of the HTTP/2 preface does not tell the protocol yet.
        let (client, mut peer) = tokio::io::duplex(64);
        let mut conn = ClientConn::new(client, limits);
        peer.write_all(b"PRI * HT").await.expect("write");
        assert_eq!(conn.read(&mut [0u8; 8]).await.expect("read"), 8);
        let err = conn
            .read(&mut [0u8; 8])
            .await
            .expect_err("half a preface is not a protocol");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);

        // Once a byte has told it, waiting is hyper's business (its head timer).
        let (client, mut peer) = tokio::io::duplex(64);
        let mut conn = ClientConn::new(client, limits);
        tokio::time::sleep(Duration::from_secs(2)).await;
        peer.write_all(b"G").await.expect("write");
        assert_eq!(conn.read(&mut [0u8; 8]).await.expect("read"), 1);
        let waited = tokio::time::timeout(Duration::from_secs(60), conn.read(&mut [0u8; 8])).await;
        assert!(
            waited.is_err(),
            "a started connection is not cut by the first-byte limit"
        );
    }
}
