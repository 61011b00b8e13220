//! A model provider's answer body as the data plane reads it: with the provider's
//! key scrubbed out, and cut after N events when a `stream_cut` fault was drawn.
//!
//! Scrubbing sits here, under everything that reads an answer: the attempt loop wraps
//! the body as soon as the response head arrives, so the error body it classifies,
//! the first events it waits for, and then the relay, the stream producer that
//! journals and the plain-body tee all read one scrubber, in order. An upstream that
//! quotes the key it was sent — in an error or a success, streamed or not, in its
//! first event or its last — never gets it to the agent or into the journal. A key
//! split across two frames is caught by holding back the end of a frame that could
//! be the start of the key; SSE frames end in a newline, which no key contains, so
//! events are never delayed. Without a key the body passes through untouched.
//!
//! A body that goes quiet is cut (see [`UpstreamBody::idle_limit`]): an upstream
//! that stalls mid-stream, its connection still open, would otherwise hold the
//! agent (and a journaled generation) forever.
//!
//! A stream's body also gathers (see [`UpstreamBody::gathering`]): hyper hands over a
//! chunked body one chunk per poll, each decoded by the connection's own task, so a
//! burst of events would otherwise be relayed, journaled and written to the agent's
//! socket one event at a time (one `writev` per event).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use memchr::memmem;

use crate::body::BoxError;

/// What replaces a quoted key.
pub const REDACTED: &[u8] = b"<redacted>";

/// The upstream body of a model call (hyper's body; tests give it a scripted one).
pub struct UpstreamBody<B = Incoming> {
    inner: Option<B>,
    scrub: Option<Scrub>,
    cut: Option<Cut>,
    gather: Option<Gather>,
    idle: Option<Idle>,
}

/// The body went quiet: nothing arrived for `limit` after it had started.
#[derive(Debug, thiserror::Error)]
#[error("the upstream went quiet: nothing arrived for {limit:?} (limits.stream_idle_timeout)")]
pub struct Stalled {
    pub limit: Duration,
}

/// How long the body may send nothing once it has started. The timer is not reset
/// per chunk (a timer-wheel update each): it fires at most once per `limit`, and
/// when data came in since, it is moved to `limit` after the last of it.
struct Idle {
    limit: Duration,
    /// When the last data arrived (`None`: none yet; the first byte has a timeout
    /// of its own).
    last: Option<tokio::time::Instant>,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Idle {
    fn data(&mut self) {
        self.last = Some(tokio::time::Instant::now());
    }

    /// Whether the body has been quiet for the limit; otherwise the timer is set to
    /// wake `cx` when it may have been.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(last) = self.last else {
            return false;
        };
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(last + self.limit)));
        loop {
            if timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let due = last + self.limit;
            if tokio::time::Instant::now() >= due {
                return true;
            }
            timer.as_mut().reset(due);
        }
    }
}

/// Most bytes gathered into one frame.
const GATHER_LIMIT: usize = 32 * 1024;
/// Turns of the scheduler a chunk waits for the next one. hyper's connection task
/// needs two to decode and hand over the next chunk it holds.
const GATHER_ROUNDS: u8 = 2;
/// Most frames passed on as they come after a gathering attempt found nothing more.
const GATHER_MAX_BACKOFF: u32 = 32;

/// Frames the connection already holds, taken in before the first of them is passed
/// on. After a chunk arrives the body yields (it wakes itself and returns `Pending`),
/// which lets the connection's task decode the next chunk it has already read; when
/// [`GATHER_ROUNDS`] yields find nothing, what was gathered goes out at once. Nothing
/// waits on the network: a chunk is held only for those turns of the scheduler. The
/// first frame of a body is never held (time to first byte), and when yields keep
/// finding nothing (events that arrive apart) the body stops trying for a while,
/// doubling the pause up to [`GATHER_MAX_BACKOFF`] frames, so spaced events pay for
/// almost none.
#[derive(Default)]
struct Gather {
    /// Data taken in and not yet passed on.
    pending: BytesMut,
    /// Chunks in `pending`.
    chunks: u32,
    /// A frame has been passed on.
    started: bool,
    /// Yields since the last chunk was taken in.
    idle_rounds: u8,
    /// Frames to pass on as they come before gathering again.
    skip: u32,
    backoff: u32,
    /// The end of the body (or its error), met while data was pending: reported after it.
    end: Option<Option<BoxError>>,
}

struct Cut {
    /// Events still to let through.
    left: u32,
    after_events: u32,
    /// The last allowed event went through: the next poll ends with an error.
    done: bool,
}

impl<B> UpstreamBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    /// `key`: the credential sent to this upstream, scrubbed from what it answers.
    pub fn new(body: B, key: Option<&str>) -> Self {
        Self {
            inner: Some(body),
            scrub: key.filter(|k| !k.is_empty()).map(Scrub::new),
            cut: None,
            gather: None,
            idle: None,
        }
    }

    /// Cuts the body with [`Stalled`] when it sends nothing for `limit` once it has
    /// started sending (keep-alive comments and pings count: the provider is there).
    pub fn idle_limit(mut self, limit: Duration) -> Self {
        self.idle = Some(Idle {
            limit,
            last: None,
            timer: None,
        });
        self
    }

    /// Cuts the body after `after` more events (an injected `stream_cut` fault).
    pub fn cut_after(mut self, after: Option<u32>) -> Self {
        self.cut = after.map(|n| Cut {
            left: n,
            after_events: n,
            done: false,
        });
        self
    }

    /// Gathers the chunks the connection already holds into one frame (streams).
    pub fn gathering(mut self) -> Self {
        self.gather = Some(Gather::default());
        self
    }

    /// The next data to pass on: gathered, or as it comes.
    fn next_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BoxError>>> {
        let Some(mut g) = self.gather.take() else {
            return self.next_chunk(cx);
        };
        let polled = self.gather_next(&mut g, cx);
        self.gather = Some(g);
        polled
    }

    fn gather_next(
        &mut self,
        g: &mut Gather,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, BoxError>>> {
        if let Some(end) = g.end.take() {
            return Poll::Ready(end.map(Err));
        }
        match self.next_chunk(cx) {
            Poll::Ready(Some(Ok(data))) => {
                if !g.started {
                    g.started = true;
                    return Poll::Ready(Some(Ok(data)));
                }
                if g.skip > 0 && g.pending.is_empty() {
                    g.skip -= 1;
                    return Poll::Ready(Some(Ok(data)));
                }
                g.pending.extend_from_slice(&data);
                g.chunks += 1;
                g.idle_rounds = 0;
                if g.pending.len() >= GATHER_LIMIT {
                    return Poll::Ready(Some(Ok(g.release())));
                }
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Pending if g.pending.is_empty() => Poll::Pending,
            Poll::Pending => {
                g.idle_rounds += 1;
                if g.idle_rounds < GATHER_ROUNDS {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                if g.chunks > 1 {
                    g.backoff = 0;
                } else {
                    // Nothing followed the chunk: events are arriving apart.
                    g.backoff = (g.backoff * 2).clamp(1, GATHER_MAX_BACKOFF);
                    g.skip = g.backoff;
                }
                Poll::Ready(Some(Ok(g.release())))
            }
            Poll::Ready(end) => {
                if g.pending.is_empty() {
                    return Poll::Ready(end);
                }
                g.end = Some(end.and_then(Result::err));
                Poll::Ready(Some(Ok(g.release())))
            }
        }
    }

    /// The next chunk's data after scrubbing, or what ended the body.
    fn next_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BoxError>>> {
        loop {
            let Some(body) = self.inner.as_mut() else {
                return Poll::Ready(None);
            };
            let data = match Pin::new(body).poll_frame(cx) {
                Poll::Pending => {
                    if let Some(idle) = self.idle.as_mut()
                        && idle.expired(cx)
                    {
                        // Dropping the body closes its connection.
                        self.inner = None;
                        let limit = idle.limit;
                        self.idle = None;
                        return Poll::Ready(Some(Err(Box::new(Stalled { limit }))));
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(None) => {
                    self.inner = None;
                    let tail = self.scrub.as_mut().map(Scrub::finish).unwrap_or_default();
                    return Poll::Ready((!tail.is_empty()).then_some(Ok(tail)));
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        if let Some(idle) = self.idle.as_mut() {
                            idle.data();
                        }
                        data
                    }
                    Err(_) => continue, // trailers: nothing to relay
                },
            };
            let data = match self.scrub.as_mut() {
                Some(s) => s.push(data),
                None => data,
            };
            if !data.is_empty() {
                return Poll::Ready(Some(Ok(data)));
            }
        }
    }
}

impl<B> HttpBody for UpstreamBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(cut) = &this.cut
            && (cut.done || cut.left == 0)
        {
            // Dropping the upstream body closes its connection, as a real cut would.
            this.inner = None;
            return Poll::Ready(Some(Err(format!(
                "fault injected: the stream was cut after {} events",
                cut.after_events
            )
            .into())));
        }
        let data = match this.next_data(cx) {
            Poll::Ready(Some(Ok(data))) => data,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        let Some(cut) = this.cut.as_mut() else {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        };
        match boundary(&data, cut.left) {
            Ok(end) => {
                cut.left = 0;
                cut.done = true;
                Poll::Ready(Some(Ok(Frame::data(data.slice(..end)))))
            }
            Err(seen) => {
                cut.left -= seen;
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        let cut_pending = self.cut.as_ref().is_some_and(|c| c.done);
        let held = self.scrub.as_ref().is_some_and(|s| !s.held.is_empty());
        let gathered = self
            .gather
            .as_ref()
            .is_some_and(|g| !g.pending.is_empty() || g.end.is_some());
        !cut_pending
            && !held
            && !gathered
            && self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.inner, &self.scrub, &self.cut, &self.gather) {
            (Some(b), None, None, None) => b.size_hint(),
            _ => SizeHint::default(),
        }
    }
}

impl Gather {
    fn release(&mut self) -> Bytes {
        self.chunks = 0;
        self.pending.split().freeze()
    }
}

/// Where the `left`-th blank-line event boundary ends in `data`, if within it;
/// otherwise how many boundaries `data` holds.
fn boundary(data: &[u8], left: u32) -> Result<usize, u32> {
    let mut seen = 0;
    let mut i = 0;
    while i + 1 < data.len() {
        let end = if data[i] == b'\n' && data[i + 1] == b'\n' {
            Some(i + 2)
        } else if data[i..].starts_with(b"\r\n\r\n") {
            Some(i + 4)
        } else {
            None
        };
        match end {
            Some(end) => {
                seen += 1;
                if seen == left {
                    return Ok(end);
                }
                i = end;
            }
            None => i += 1,
        }
    }
    Err(seen)
}

/// Replaces a secret in a byte stream cut into arbitrary frames.
struct Scrub {
    finder: memmem::Finder<'static>,
    /// The end of the last frame that may be the start of the secret.
    held: BytesMut,
}

impl Scrub {
    fn new(secret: &str) -> Self {
        Self {
            finder: memmem::Finder::new(secret.as_bytes()).into_owned(),
            held: BytesMut::new(),
        }
    }

    fn secret(&self) -> &[u8] {
        self.finder.needle()
    }

    /// The bytes that can be released after `data`.
    fn push(&mut self, data: Bytes) -> Bytes {
        if self.held.is_empty() && self.finder.find(&data).is_none() {
            let hold = self.partial_suffix(&data);
            if hold == 0 {
                return data; // the common case: no copy
            }
            self.held.extend_from_slice(&data[data.len() - hold..]);
            return data.slice(..data.len() - hold);
        }
        let mut all = std::mem::take(&mut self.held);
        all.extend_from_slice(&data);
        let mut out = self.replace(&all);
        let hold = self.partial_suffix(&out);
        self.held = out.split_off(out.len() - hold);
        out.freeze()
    }

    /// Whatever is still held, at the end of the body.
    fn finish(&mut self) -> Bytes {
        std::mem::take(&mut self.held).freeze()
    }

    fn replace(&self, data: &[u8]) -> BytesMut {
        let mut out = BytesMut::with_capacity(data.len());
        let mut rest = data;
        while let Some(at) = self.finder.find(rest) {
            out.extend_from_slice(&rest[..at]);
            out.extend_from_slice(REDACTED);
            rest = &rest[at + self.secret().len()..];
        }
        out.extend_from_slice(rest);
        out
    }

    /// The length of the longest suffix of `data` that is a proper prefix of the secret.
    fn partial_suffix(&self, data: &[u8]) -> usize {
        let secret = self.secret();
        let longest = secret.len().saturating_sub(1).min(data.len());
        (1..=longest)
            .rev()
            .find(|&n| data[data.len() - n..] == secret[..n])
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    use proptest::prelude::*;

    use super::*;

    /// A body answering from a script: data, `None` for one `Pending`, or an error.
    struct Scripted(VecDeque<Option<Result<Bytes, &'static str>>>);

    impl HttpBody for Scripted {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            match self.0.pop_front() {
                None => Poll::Ready(None),
                Some(None) => Poll::Pending,
                Some(Some(Ok(data))) => Poll::Ready(Some(Ok(Frame::data(data)))),
                Some(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            }
        }
    }

    fn data(text: &str) -> Option<Result<Bytes, &'static str>> {
        Some(Ok(Bytes::copy_from_slice(text.as_bytes())))
    }

    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What a gathering body gives for `script`, polled to its end: each frame (or
    /// error) and the wakes it asked for while holding data back.
    fn gathered(
        script: Vec<Option<Result<Bytes, &'static str>>>,
    ) -> (Vec<Result<Bytes, String>>, usize) {
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let mut body = UpstreamBody::new(Scripted(script.into()), None).gathering();
        let mut out = Vec::new();
        for _ in 0..10_000 {
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(None) => return (out, wakes.0.load(Ordering::Relaxed)),
                Poll::Ready(Some(Ok(frame))) => {
                    out.push(Ok(frame.into_data().expect("data")));
                }
                Poll::Ready(Some(Err(e))) => out.push(Err(e.to_string())),
                // The script's own `Pending`s need no wake: it is polled again anyway.
                Poll::Pending => {}
            }
        }
        panic!("the body never ended");
    }

    fn texts(frames: &[Result<Bytes, String>]) -> Vec<String> {
        frames
            .iter()
            .map(|f| match f {
                Ok(b) => String::from_utf8_lossy(b).into_owned(),
                Err(e) => format!("error: {e}"),
            })
            .collect()
    }

    /// A body fed by a channel: a provider whose connection stays open while it
    /// sends nothing.
    struct Fed(tokio::sync::mpsc::Receiver<Bytes>);

    impl HttpBody for Fed {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0.poll_recv(cx).map(|d| d.map(|d| Ok(Frame::data(d))))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_goes_quiet_is_cut_at_the_idle_limit_and_one_that_trickles_is_not() {
        use http_body_util::BodyExt;
        let limit = Duration::from_secs(30);
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        // A keep-alive every 20 s keeps the body going past the limit; then nothing.
        tokio::spawn(async move {
            for i in 0..4 {
                if i > 0 {
                    tokio::time::sleep(Duration::from_secs(20)).await;
                }
                tx.send(Bytes::from_static(b": keep-alive\n\n")).await.ok();
            }
            // Held open, silent, until the test ends.
            tokio::time::sleep(Duration::from_secs(3_600)).await;
            drop(tx);
        });
        let mut body = UpstreamBody::new(Fed(rx), None).idle_limit(limit);
        let start = tokio::time::Instant::now();
        for _ in 0..4 {
            let frame = body.frame().await.expect("a frame").expect("data");
            assert_eq!(
                frame.into_data().expect("data").as_ref(),
                b": keep-alive\n\n"
            );
        }
        assert_eq!(start.elapsed(), Duration::from_secs(60));
        let quiet = body.frame().await.expect("an error").expect_err("cut");
        assert_eq!(start.elapsed(), Duration::from_secs(90), "{quiet}");
        assert!(
            quiet.to_string().contains("nothing arrived for 30s")
                && quiet.to_string().contains("limits.stream_idle_timeout"),
            "{quiet}"
        );
        assert!(body.frame().await.is_none(), "nothing after the cut");
    }

    /// Before its first byte a body waits as long as it must: the first byte has a
    /// timeout of its own (`first_byte_timeout`), which may be the longer.
    #[tokio::test(start_paused = true)]
    async fn the_idle_limit_starts_with_the_first_data() {
        use http_body_util::BodyExt;
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(100)).await;
            tx.send(Bytes::from_static(b"data: {}\n\n")).await.ok();
        });
        let mut body = UpstreamBody::new(Fed(rx), None).idle_limit(Duration::from_secs(10));
        let frame = body.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().expect("data").as_ref(), b"data: {}\n\n");
    }

    #[test]
    fn chunks_the_connection_holds_go_out_as_one_frame_after_the_first() {
        let (frames, wakes) = gathered(vec![data("a"), data("b"), data("c"), data("d")]);
        assert_eq!(texts(&frames), ["a", "bcd"]);
        // One yield per chunk taken in, then the end releases them.
        assert_eq!(wakes, 3);
    }

    #[test]
    fn a_chunk_nothing_follows_goes_out_after_the_yields_and_spaced_ones_pass_straight() {
        let (frames, wakes) = gathered(vec![
            data("a"),
            data("b"),
            None,
            None,
            data("c"),
            None,
            data("d"),
            data("e"),
        ]);
        // "b" waited GATHER_ROUNDS yields for nothing; then "c" passed straight on (the
        // back-off), and "d" and "e", arriving together, were gathered again.
        assert_eq!(texts(&frames), ["a", "b", "c", "de"]);
        assert_eq!(wakes, usize::from(GATHER_ROUNDS) + 2);
    }

    #[test]
    fn the_end_or_an_error_comes_after_the_gathered_data() {
        let (frames, _) = gathered(vec![data("a"), data("b"), data("c"), Some(Err("reset"))]);
        assert_eq!(texts(&frames), ["a", "bc", "error: reset"]);
        let (frames, _) = gathered(vec![data("a"), data("b")]);
        assert_eq!(texts(&frames), ["a", "b"]);
    }

    #[test]
    fn a_gathered_frame_stops_at_the_limit() {
        let big = Bytes::from(vec![b'x'; GATHER_LIMIT / 2 + 1]);
        let (frames, _) = gathered(vec![
            data("a"),
            Some(Ok(big.clone())),
            Some(Ok(big.clone())),
            Some(Ok(big.clone())),
        ]);
        let sizes: Vec<usize> = frames.iter().map(|f| f.as_ref().unwrap().len()).collect();
        assert_eq!(sizes, [1, 2 * big.len(), big.len()]);
    }

    proptest! {
        /// Whatever the timing, the bytes go out whole and in order, the first chunk
        /// alone, and no frame is empty.
        #[test]
        fn gathering_keeps_every_byte_in_order(
            steps in proptest::collection::vec(
                prop_oneof![
                    3 => proptest::collection::vec(any::<u8>(), 1..3000).prop_map(Some),
                    1 => Just(None),
                ],
                0..60,
            )
        ) {
            let script: Vec<_> = steps
                .iter()
                .map(|s| s.as_ref().map(|b| Ok(Bytes::copy_from_slice(b))))
                .collect();
            let want: Vec<u8> = steps.iter().flatten().flatten().copied().collect();
            let first = steps.iter().flatten().next().cloned();
            let (frames, _) = gathered(script);
            let frames: Vec<Bytes> = frames.into_iter().map(|f| f.unwrap()).collect();
            prop_assert!(frames.iter().all(|f| !f.is_empty()));
            prop_assert_eq!(frames.first().map(|f| f.to_vec()), first);
            prop_assert_eq!(frames.concat(), want);
        }
    }

    fn scrub_all(secret: &str, frames: &[&[u8]]) -> Vec<u8> {
        let mut s = Scrub::new(secret);
        let mut out = Vec::new();
        for f in frames {
            out.extend_from_slice(&s.push(Bytes::copy_from_slice(f)));
        }
        out.extend_from_slice(&s.finish());
        out
    }

    #[test]
    fn a_secret_is_replaced_wherever_the_frames_split_it() {
        let text = b"data: {\"echo\":\"Bearer pk-canary-123\"}\n\n".as_slice();
        let want = b"data: {\"echo\":\"Bearer <redacted>\"}\n\n".to_vec();
        for cut in 0..=text.len() {
            let (a, b) = text.split_at(cut);
            assert_eq!(scrub_all("pk-canary-123", &[a, b]), want, "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = text.chunks(1).collect();
        assert_eq!(scrub_all("pk-canary-123", &bytes), want);
        assert_eq!(scrub_all("k", &[b"kkk"]), b"<redacted><redacted><redacted>");
    }

    #[test]
    fn text_without_the_secret_is_passed_on_without_delay() {
        let mut s = Scrub::new("pk-canary-123");
        let event = Bytes::from_static(b"data: {\"x\":\"pk-canary\"}\n\n");
        assert_eq!(s.push(event.clone()), event);
        // A frame ending in what may be the secret's start waits for the next one.
        assert_eq!(s.push(Bytes::from_static(b"ab pk-ca")), "ab ".as_bytes());
        assert_eq!(s.push(Bytes::from_static(b"t\n")), "pk-cat\n".as_bytes());
        assert!(s.finish().is_empty());
    }

    #[test]
    fn boundaries_count_blank_lines() {
        assert_eq!(boundary(b"data: a\n\ndata: b\n\n", 1), Ok(9));
        assert_eq!(boundary(b"data: a\n\ndata: b\n\n", 2), Ok(18));
        assert_eq!(boundary(b"data: a\n\ndata: b\n\n", 3), Err(2));
        assert_eq!(boundary(b"data: a\r\n\r\n", 1), Ok(11));
        assert_eq!(boundary(b"data: a", 1), Err(0));
    }
}
