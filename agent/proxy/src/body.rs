//! The body types the data plane speaks, and bounded reading of request bodies.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, Limited};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every response body the sidecar produces.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

pub fn empty() -> Body {
    Empty::<Bytes>::new()
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

/// Streams any body through as a [`Body`].
pub fn stream<B>(b: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed_unsync()
}

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("the request body is larger than {limit} bytes")]
    TooLarge { limit: usize },
    #[error("the client sent no byte of the request body for {idle:?}")]
    TimedOut { idle: Duration },
    #[error("the request body could not be read: {0}")]
    Io(BoxError),
}

/// Reads a client's request body like [`read_limited`], giving up once no byte of it
/// has arrived for `idle`: a client that stalls mid-body does not hold its call (and
/// its connection) open.
pub async fn read_request<B>(body: B, limit: usize, idle: Duration) -> Result<Bytes, ReadError>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    read_limited(IdleLimited::new(body, idle), limit).await
}

/// Reads a whole body, refusing more than `limit` bytes (checked against the
/// declared length first, so an oversized upload is refused before it is read).
pub async fn read_limited<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) => Err(read_error(e, limit)),
    }
}

/// Reads `body` (up to `limit` bytes) until it ends, or until `done` says that what
/// has arrived is enough: asked, with what has arrived and the offset of what is new
/// since it was last asked, whenever a part ends a line (a line feed or a carriage
/// return). The rest is not read.
pub async fn read_until<B>(
    body: B,
    limit: usize,
    done: impl Fn(&[u8], usize) -> bool,
) -> Result<Bytes, ReadError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge { limit });
    }
    let mut body = std::pin::pin!(body);
    let mut read = bytes::BytesMut::new();
    let mut asked = 0;
    while let Some(frame) = body.as_mut().frame().await {
        let frame = frame.map_err(|e| read_error(e.into(), limit))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if read.len() + data.len() > limit {
            return Err(ReadError::TooLarge { limit });
        }
        read.extend_from_slice(&data);
        if data.iter().any(|b| matches!(b, b'\n' | b'\r')) {
            if done(&read, asked) {
                break;
            }
            asked = read.len();
        }
    }
    Ok(read.freeze())
}

fn read_error(e: BoxError, limit: usize) -> ReadError {
    if e.is::<http_body_util::LengthLimitError>() {
        ReadError::TooLarge { limit }
    } else if let Some(IdleTimeout(idle)) = e.downcast_ref() {
        ReadError::TimedOut { idle: *idle }
    } else {
        ReadError::Io(e)
    }
}

/// No frame of a body arrived for this long.
#[derive(Debug, thiserror::Error)]
#[error("no byte arrived for {0:?}")]
struct IdleTimeout(Duration);

/// A body whose next frame fails with [`IdleTimeout`] once it has been awaited for
/// longer than `idle`. The timer is made, and armed, only when a frame is awaited:
/// a body that arrives with its head (most) costs none.
struct IdleLimited<B> {
    inner: B,
    idle: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

impl<B> IdleLimited<B> {
    fn new(inner: B, idle: Duration) -> Self {
        Self {
            inner,
            idle,
            timer: None,
            armed: false,
        }
    }
}

impl<B> HttpBody for IdleLimited<B>
where
    B: HttpBody + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            this.armed = false;
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if !this.armed {
            let deadline = tokio::time::Instant::now() + this.idle;
            match &mut this.timer {
                Some(timer) => timer.as_mut().reset(deadline),
                None => this.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            this.armed = true;
        }
        let Some(timer) = this.timer.as_mut() else {
            return Poll::Pending;
        };
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(IdleTimeout(this.idle).into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Wraps a body so that `guard` lives until the body is finished or dropped (used to
/// keep in-flight gauges and per-request bookkeeping alive for a streamed response).
pub struct Guarded<B, G> {
    inner: B,
    _guard: G,
}

impl<B, G> Guarded<B, G> {
    pub fn new(inner: B, guard: G) -> Self {
        Self {
            inner,
            _guard: guard,
        }
    }
}

impl<B, G> HttpBody for Guarded<B, G>
where
    B: HttpBody + Unpin,
    G: Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Passes a body through unchanged while keeping a copy of its first `limit` bytes;
/// when the body ends, `done` gets the copy, or why there is none. A body dropped
/// before its end (its reader went away) drops `done` uncalled.
pub struct Tee<B, F> {
    inner: B,
    copy: Vec<u8>,
    limit: usize,
    overflow: bool,
    /// Bytes that have passed, and how many the body declared (`Content-Length`).
    seen: u64,
    length: Option<u64>,
    done: Option<F>,
}

impl<B: HttpBody, F> Tee<B, F> {
    pub fn new(inner: B, limit: usize, done: F) -> Self {
        let length = inner.size_hint().exact();
        Self {
            inner,
            copy: Vec::new(),
            limit,
            overflow: false,
            seen: 0,
            length,
            done: Some(done),
        }
    }
}

/// Why a [`Tee`] has no copy for `done`.
#[derive(Debug)]
pub enum TeeEnd {
    /// The body ended whole, longer than the limit.
    TooLong,
    /// The body broke off (the error's message).
    Broke(String),
}

impl<B, F: FnOnce(Result<&[u8], TeeEnd>)> Tee<B, F> {
    fn finish(&mut self) {
        if let Some(done) = self.done.take() {
            if self.overflow {
                done(Err(TeeEnd::TooLong));
            } else {
                done(Ok(&self.copy));
            }
        }
    }
}

impl<B, F> HttpBody for Tee<B, F>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    F: FnOnce(Result<&[u8], TeeEnd>) + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.seen = this.seen.saturating_add(data.len() as u64);
                    if this.copy.len() + data.len() <= this.limit {
                        this.copy.extend_from_slice(data);
                    } else {
                        this.overflow = true;
                    }
                }
                // With a known length the last frame is recognisable: finish before
                // handing it on, so whoever reads the body to its end sees the effect.
                // The declared length counts too: a server that has written that many
                // bytes drops the body without polling it for its end, and an HTTP/2
                // upstream may send its end of stream in a frame of its own, later.
                if this.inner.is_end_stream() || this.length.is_some_and(|n| this.seen >= n) {
                    this.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                let e: BoxError = e.into();
                if let Some(done) = this.done.take() {
                    done(Err(TeeEnd::Broke(e.to_string())));
                }
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                this.finish();
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use futures_util::StreamExt;
    use http_body::Frame;
    use http_body_util::StreamBody;

    use super::*;

    /// A body whose chunks arrive `gap` apart.
    fn paced(
        chunks: &'static [&'static str],
        gap: Duration,
    ) -> impl HttpBody<Data = Bytes, Error = Infallible> + Unpin {
        let frames = futures_util::stream::iter(chunks).then(move |c| async move {
            tokio::time::sleep(gap).await;
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(c.as_bytes())))
        });
        StreamBody::new(Box::pin(frames))
    }

    /// `read_until` stops once `done` says so, asked at each part that ends a line
    /// with everything new since it was last asked (a part that ends none is not
    /// asked about, but is in the next window); the rest of the body, which never
    /// ends here, is not waited for.
    #[tokio::test]
    async fn read_until_stops_once_what_arrived_is_enough() {
        let parts = ["data: {\"id\":", "1}", "\r\r", "never"];
        let frames = futures_util::stream::iter(parts)
            .map(|c| Ok::<_, Infallible>(Frame::data(Bytes::from_static(c.as_bytes()))))
            .chain(futures_util::stream::pending());
        let asked = std::sync::Mutex::new(Vec::new());
        let read = read_until(StreamBody::new(frames), 1 << 10, |read, new| {
            asked
                .lock()
                .unwrap()
                .push(String::from_utf8_lossy(&read[new..]).into_owned());
            read.ends_with(b"\r\r")
        });
        let read = tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .expect("not waiting for the rest")
            .expect("read");
        assert_eq!(&read[..], b"data: {\"id\":1}\r\r");
        assert_eq!(*asked.lock().unwrap(), ["data: {\"id\":1}\r\r"]);
        // Past the limit, it is refused, not cut.
        let big = futures_util::stream::iter(["0123456789\n"; 3])
            .map(|c| Ok::<_, Infallible>(Frame::data(Bytes::from_static(c.as_bytes()))));
        let refused = read_until(StreamBody::new(big), 25, |_, _| false).await;
        assert!(matches!(refused, Err(ReadError::TooLarge { limit: 25 })));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_pauses_past_the_limit_times_out_and_a_steady_one_is_read() {
        let idle = Duration::from_secs(5);
        let got = read_request(
            paced(&["a", "b", "c"], Duration::from_secs(4)),
            1 << 10,
            idle,
        )
        .await
        .expect("each chunk came within the limit");
        assert_eq!(got, "abc");

        let started = tokio::time::Instant::now();
        let err = read_request(paced(&["a", "b"], Duration::from_secs(6)), 1 << 10, idle)
            .await
            .expect_err("the first chunk came too late");
        assert!(
            matches!(err, ReadError::TimedOut { idle: i } if i == idle),
            "{err:?}"
        );
        assert_eq!(started.elapsed(), idle);

        let err = read_request(paced(&["abcd", "efgh"], Duration::from_secs(1)), 6, idle)
            .await
            .expect_err("too large");
        assert!(matches!(err, ReadError::TooLarge { limit: 6 }), "{err:?}");
    }

    /// A tee tells how its body ended: the copy, too long for one, or broken off
    /// (which its reader must not take for a reader that went away).
    #[tokio::test]
    async fn a_tee_says_how_its_body_ended() {
        let ended = |chunks: Vec<Result<&'static str, &'static str>>, limit| async move {
            let frames = futures_util::stream::iter(chunks.into_iter().map(|c| {
                c.map(|s| Frame::data(Bytes::from_static(s.as_bytes())))
                    .map_err(BoxError::from)
            }));
            let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
            let tee = Tee::new(StreamBody::new(frames), limit, {
                let seen = seen.clone();
                move |copy: Result<&[u8], TeeEnd>| {
                    let what = match copy {
                        Ok(bytes) => format!("copy {}", String::from_utf8_lossy(bytes)),
                        Err(TeeEnd::TooLong) => "too long".to_owned(),
                        Err(TeeEnd::Broke(e)) => format!("broke: {e}"),
                    };
                    *seen.lock().unwrap() = Some(what);
                }
            });
            let _ = tee.collect().await;
            seen.lock().unwrap().take()
        };
        assert_eq!(
            ended(vec![Ok("ab"), Ok("c")], 8).await.as_deref(),
            Some("copy abc")
        );
        assert_eq!(
            ended(vec![Ok("ab"), Ok("cd")], 3).await.as_deref(),
            Some("too long")
        );
        assert_eq!(
            ended(vec![Ok("ab"), Err("reset")], 8).await.as_deref(),
            Some("broke: reset")
        );
    }

    /// A body of declared length whose end comes later (an HTTP/2 upstream's end of
    /// stream in a frame of its own) is whole once that many bytes have passed:
    /// a server that wrote them drops it without asking for its end.
    #[tokio::test]
    async fn a_tee_of_a_declared_length_ends_with_its_last_byte() {
        type Frames =
            futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, BoxError>>>;
        struct Declared(StreamBody<Frames>, u64);
        impl HttpBody for Declared {
            type Data = Bytes;
            type Error = BoxError;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
                Pin::new(&mut self.0).poll_frame(cx)
            }
            fn size_hint(&self) -> SizeHint {
                SizeHint::with_exact(self.1)
            }
        }
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(b"ab"))),
            Ok(Frame::data(Bytes::from_static(b"cd"))),
        ];
        let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
        let mut tee = Tee::new(
            Declared(StreamBody::new(futures_util::stream::iter(frames)), 4),
            8,
            {
                let seen = seen.clone();
                move |copy: Result<&[u8], TeeEnd>| {
                    *seen.lock().unwrap() = copy.ok().map(<[u8]>::to_vec);
                }
            },
        );
        for _ in 0..2 {
            let frame = tee.frame().await;
            assert!(frame.is_some_and(|f| f.is_ok()));
        }
        drop(tee);
        assert_eq!(seen.lock().unwrap().as_deref(), Some(&b"abcd"[..]));
    }
}
