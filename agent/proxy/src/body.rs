//! The body types the data plane speaks, and bounded reading of request bodies.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

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
    #[error("the request body could not be read: {0}")]
    Io(BoxError),
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
        Err(e) => {
            if e.is::<http_body_util::LengthLimitError>() {
                Err(ReadError::TooLarge { limit })
            } else {
                Err(ReadError::Io(e))
            }
        }
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
/// when the body ends cleanly, `done` gets the copy (if it was not cut short).
pub struct Tee<B, F> {
    inner: B,
    copy: Vec<u8>,
    limit: usize,
    overflow: bool,
    done: Option<F>,
}

impl<B, F> Tee<B, F> {
    pub fn new(inner: B, limit: usize, done: F) -> Self {
        Self {
            inner,
            copy: Vec::new(),
            limit,
            overflow: false,
            done: Some(done),
        }
    }
}

impl<B, F: FnOnce(&[u8])> Tee<B, F> {
    fn finish(&mut self) {
        if let Some(done) = self.done.take()
            && !self.overflow
        {
            done(&self.copy);
        }
    }
}

impl<B, F> HttpBody for Tee<B, F>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    F: FnOnce(&[u8]) + Unpin,
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
                    if this.copy.len() + data.len() <= this.limit {
                        this.copy.extend_from_slice(data);
                    } else {
                        this.overflow = true;
                    }
                }
                // With a known length the last frame is recognisable: finish before
                // handing it on, so whoever reads the body to its end sees the effect.
                if this.inner.is_end_stream() {
                    this.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.done = None;
                Poll::Ready(Some(Err(e.into())))
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
