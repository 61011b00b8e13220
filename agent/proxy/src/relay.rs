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
use crate::events::{Gate, Turn, interruption_event};
use crate::options::Dialect;
use crate::sse::Framer;

/// Observes a relayed stream (for metrics and metering); called on the poll path,
/// so implementations must be cheap.
pub trait StreamObserver: Send + Unpin + 'static {
    fn on_event(&mut self, raw: &Bytes, at: Instant);
    /// The stream ended: `Ok` when the upstream finished, `Err` with a description
    /// when it broke; `turn` is what the gate followed of it.
    fn on_end(&mut self, outcome: Result<(), &str>, turn: Option<&Turn>);
}

impl StreamObserver for Box<dyn StreamObserver> {
    fn on_event(&mut self, raw: &Bytes, at: Instant) {
        (**self).on_event(raw, at);
    }
    fn on_end(&mut self, outcome: Result<(), &str>, turn: Option<&Turn>) {
        (**self).on_end(outcome, turn);
    }
}

impl StreamObserver for () {
    fn on_event(&mut self, _: &Bytes, _: Instant) {}
    fn on_end(&mut self, _: Result<(), &str>, _: Option<&Turn>) {}
}

pub struct SseRelay<B, O: StreamObserver> {
    upstream: B,
    framer: Framer,
    ready: VecDeque<Bytes>,
    scratch: Vec<Bytes>,
    observer: O,
    done: bool,
    /// Holds back parts of tool calls; an interruption then ends the stream with a
    /// typed error event instead of half a tool call.
    gate: Option<Gate>,
}

impl<B, O: StreamObserver> SseRelay<B, O> {
    pub fn new(upstream: B, max_event: usize, observer: O) -> Self {
        Self {
            upstream,
            framer: Framer::new(max_event),
            ready: VecDeque::new(),
            scratch: Vec::new(),
            observer,
            done: false,
            gate: None,
        }
    }

    /// Gates tool calls (see [`Gate`]) for a provider of `dialect`.
    pub fn gated(mut self, dialect: Dialect) -> Self {
        self.gate = Some(Gate::new(dialect));
        self
    }

    fn release(&mut self, events: Vec<Bytes>, now: Instant) {
        for ev in events {
            match &mut self.gate {
                Some(gate) => {
                    for out in gate.push(ev).events {
                        self.observer.on_event(&out, now);
                        self.ready.push_back(out);
                    }
                }
                None => {
                    self.observer.on_event(&ev, now);
                    self.ready.push_back(ev);
                }
            }
        }
    }

    /// Ends an interrupted stream: the gate's held parts are dropped and a typed error
    /// event closes the stream; without a gate the error goes to the client as is.
    fn interrupt(&mut self, detail: &str, e: BoxError) -> Option<BoxError> {
        self.done = true;
        self.observer
            .on_end(Err(detail), self.gate.as_ref().map(|g| &g.turn));
        match &self.gate {
            // A turn already ended by an error event needs no second one.
            Some(gate) if !gate.turn.terminal && !gate.closed() => {
                self.ready
                    .push_back(interruption_event(gate.turn.dialect(), detail));
                None
            }
            Some(_) => None,
            None => Some(e),
        }
    }
}

impl<B, O: StreamObserver> Drop for SseRelay<B, O> {
    /// An agent that leaves after its turn's terminal event reached it, before the
    /// upstream's end of the body, had the whole turn: it ends as complete, with the
    /// usage the turn reported, not as a stream cut short.
    fn drop(&mut self) {
        if !self.done
            && self.ready.is_empty()
            && let Some(gate) = &self.gate
            && gate.turn.terminal
            && !gate.turn.errored
        {
            self.done = true;
            self.observer.on_end(Ok(()), Some(&gate.turn));
        }
    }
}

impl<B, O: StreamObserver> SseRelay<B, O> {
    /// Continues a stream whose first events were already read (to make sure it
    /// started before committing to it).
    pub fn resume(upstream: B, framer: Framer, first: Vec<Bytes>, observer: O) -> Self {
        Self {
            upstream,
            framer,
            ready: VecDeque::new(),
            // Released (through the gate, if any) on the first poll.
            scratch: first,
            observer,
            done: false,
            gate: None,
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
            if !this.scratch.is_empty() {
                let events: Vec<Bytes> = this.scratch.drain(..).collect();
                this.release(events, Instant::now());
                continue;
            }
            match Pin::new(&mut this.upstream).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: nothing to relay
                    };
                    if let Err(e) = this.framer.push(&data, &mut this.scratch) {
                        // The events framed before the one too large are whole.
                        let events: Vec<Bytes> = this.scratch.drain(..).collect();
                        this.release(events, Instant::now());
                        let detail = e.to_string();
                        if let Some(e) = this.interrupt(&detail, Box::new(e)) {
                            return Poll::Ready(Some(Err(e)));
                        }
                        continue;
                    }
                    let events: Vec<Bytes> = this.scratch.drain(..).collect();
                    this.release(events, Instant::now());
                }
                Poll::Ready(Some(Err(e))) => {
                    let e: BoxError = e.into();
                    let detail = format!("the upstream broke: {e}");
                    if let Some(e) = this.interrupt(&detail, e) {
                        return Poll::Ready(Some(Err(e)));
                    }
                }
                Poll::Ready(None) => {
                    let tail = this.framer.finish(&mut this.scratch);
                    let events: Vec<Bytes> = this.scratch.drain(..).collect();
                    this.release(events, Instant::now());
                    // A turn the provider (or the gate) ended with an error event is
                    // over: no second error event.
                    let complete = this
                        .gate
                        .as_ref()
                        .is_none_or(|g| g.turn.terminal || g.turn.errored);
                    if complete {
                        this.done = true;
                        if let Some(tail) = tail.filter(|_| this.gate.is_none()) {
                            this.ready.push_back(tail);
                        }
                        this.observer
                            .on_end(Ok(()), this.gate.as_ref().map(|g| &g.turn));
                    } else {
                        let _ = this
                            .interrupt("the upstream ended before its final event", "eof".into());
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.ready.is_empty()
    }
}
