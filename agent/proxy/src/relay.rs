//! Relaying an upstream SSE stream to the agent event by event.
//!
//! [`SseRelay`] is a body that polls the upstream body directly (no task, no
//! channel): each poll forwards the events completed by the bytes that have arrived,
//! so nothing is buffered beyond one incomplete event, and dropping the relay (the
//! agent went away) drops the upstream body, which closes that upstream connection
//! instead of returning a half-read one to the pool.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};

use crate::body::BoxError;
use crate::sse::Framer;

/// Observes a relayed stream (for metrics and metering); called on the poll path,
/// so implementations must be cheap.
pub trait StreamObserver: Send + Unpin + 'static {
    fn on_event(&mut self, raw: &Bytes, at: Instant);
    /// The stream ended: `Ok` when the upstream finished, `Err` with a description
    /// when it broke.
    fn on_end(&mut self, outcome: Result<(), &str>);
}

impl StreamObserver for () {
    fn on_event(&mut self, _: &Bytes, _: Instant) {}
    fn on_end(&mut self, _: Result<(), &str>) {}
}

pub struct SseRelay<B, O> {
    upstream: B,
    framer: Framer,
    ready: VecDeque<Bytes>,
    scratch: Vec<Bytes>,
    observer: O,
    done: bool,
}

impl<B, O> SseRelay<B, O> {
    pub fn new(upstream: B, max_event: usize, observer: O) -> Self {
        Self {
            upstream,
            framer: Framer::new(max_event),
            ready: VecDeque::new(),
            scratch: Vec::new(),
            observer,
            done: false,
        }
    }
}

impl<B, O: StreamObserver> SseRelay<B, O> {
    /// Continues a stream whose first events were already read (to make sure it
    /// started before committing to it).
    pub fn resume(upstream: B, framer: Framer, first: Vec<Bytes>, mut observer: O) -> Self {
        let now = Instant::now();
        for ev in &first {
            observer.on_event(ev, now);
        }
        Self {
            upstream,
            framer,
            ready: first.into(),
            scratch: Vec::new(),
            observer,
            done: false,
        }
    }
}

impl<B, O> HttpBody for SseRelay<B, O>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    O: StreamObserver,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            if let Some(ev) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(ev))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.upstream).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: nothing to relay
                    };
                    if let Err(e) = this.framer.push(&data, &mut this.scratch) {
                        this.done = true;
                        this.observer.on_end(Err("event too large"));
                        return Poll::Ready(Some(Err(Box::new(e))));
                    }
                    let now = Instant::now();
                    for ev in this.scratch.drain(..) {
                        this.observer.on_event(&ev, now);
                        this.ready.push_back(ev);
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.done = true;
                    let e: BoxError = e.into();
                    this.observer.on_end(Err("upstream stream broke"));
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    let tail = this.framer.finish(&mut this.scratch);
                    let now = Instant::now();
                    for ev in this.scratch.drain(..) {
                        this.observer.on_event(&ev, now);
                        this.ready.push_back(ev);
                    }
                    if let Some(tail) = tail {
                        this.ready.push_back(tail);
                    }
                    this.observer.on_end(Ok(()));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.ready.is_empty()
    }
}
