//! Journaled model calls: relayed, replayed and resumed.
//!
//! A model call gets a stream key when the agent sends an `Idempotency-Key`, or
//! when it carries an `Outrigger-Task-Id` (deterministic replay inside a task; off
//! with `Cache-Control: no-cache` or `[streams] replay_in_task = false`). Without a
//! key the call is relayed as before, gated but not journaled.
//!
//! With a key, the upstream is drained by a producer task into the journal and into
//! a [`Live`] hub that every client of the stream reads from. The client going away
//! does not cancel the generation (bounded by `detach_timeout`); a repeated request
//! with the key, or `GET /v1/streams/{key}` with `Last-Event-ID`, gets the journaled
//! prefix and then the live remainder. Every forwarded event carries
//! `id: <attempt>:<seq>`, so what any client receives is byte-identical to what the
//! first one did. Tool-call blocks and the terminal event are durable before they
//! are forwarded; a break ends the stream with a typed error event.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::upstream_body::UpstreamBody;
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body::{Body as HttpBody, Frame};
use http_body_util::BodyExt;
use outrigger_journal::{Journal, StreamEnd, StreamKey};
use outrigger_types::TaskId;
use tokio::sync::{Notify, watch};

use crate::body::{Body, BoxError};
use crate::events::{Gate, interruption_event};
use crate::keys;
use crate::model::request::ModelRequest;
use crate::options::Dialect;
use crate::sse::Framer;
use crate::{RequestContext, Shared, headers};

/// How journaled streams behave.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Answer a repeated identical model request of a task from the journal.
    pub replay_in_task: bool,
    /// How long a generation keeps being drained after its last client left.
    pub detach_timeout: Duration,
    /// The most bytes one stream may journal (each event counted with
    /// [`EVENT_OVERHEAD`] more); a longer one is cut with an error.
    pub max_stream_bytes: usize,
    /// Cancel the generation when its last client goes away.
    pub cancel_on_disconnect: bool,
    /// The most continuations one generation may take, at a provider that has
    /// `continuation` set.
    pub max_continuations: u32,
}

/// What one stream event costs beyond its bytes (its `id:` line, its place in the
/// hub and in the journal), counted against `[streams] max_stream_bytes`.
const EVENT_OVERHEAD: usize = 64;

impl Default for Options {
    fn default() -> Self {
        Self {
            replay_in_task: true,
            detach_timeout: Duration::from_secs(300),
            max_stream_bytes: 64 << 20,
            cancel_on_disconnect: false,
            max_continuations: 1,
        }
    }
}

/// How a call is keyed.
#[derive(Debug, Clone)]
pub struct Keyed {
    pub key: StreamKey,
    /// Whether an existing completed stream under the key may answer this call.
    pub replayable: bool,
    /// The request's [`fingerprint`], computed once for the key and the journal.
    pub fingerprint: outrigger_types::Fingerprint,
}

/// The stream key of a model call, if it has one (see the module docs).
pub fn key_for(
    h: &HeaderMap,
    ctx: &RequestContext,
    request: &ModelRequest,
    options: &Options,
) -> Result<Option<Keyed>, crate::Error> {
    let dialect = request.dialect.as_str();
    if let Some(v) = h.get(headers::IDEMPOTENCY_KEY) {
        let raw = v.to_str().map_err(|_| crate::Error::BadHeader {
            header: "Idempotency-Key",
            detail: "it is not visible ASCII".into(),
        })?;
        let key = outrigger_types::IdempotencyKey::from_header(raw).map_err(|e| {
            crate::Error::BadHeader {
                header: "Idempotency-Key",
                detail: e.to_string(),
            }
        })?;
        return Ok(Some(Keyed {
            key: stream_key(format!("m/{dialect}/{key}"))?,
            replayable: true,
            fingerprint: fingerprint(request, h)?,
        }));
    }
    let Some(task) = &ctx.task_id else {
        return Ok(None);
    };
    let fingerprint = fingerprint(request, h)?;
    let fp = fingerprint.to_hex();
    let fresh = no_cache(h) || !options.replay_in_task;
    let key = if fresh {
        format!("t/{task}/{dialect}/{}/{}", &fp[..32], ctx.request_id)
    } else {
        format!("t/{task}/{dialect}/{}", &fp[..32])
    };
    Ok(Some(Keyed {
        key: stream_key(key)?,
        replayable: !fresh,
        fingerprint,
    }))
}

fn stream_key(s: String) -> Result<StreamKey, crate::Error> {
    StreamKey::new(s).map_err(|e| crate::Error::BadHeader {
        header: "Idempotency-Key",
        detail: e.to_string(),
    })
}

/// The request's fingerprint: its canonical JSON (key order and whitespace do not
/// matter), for the same dialect, with the headers that change what the provider
/// generates ([`answer_headers`]).
pub fn fingerprint(
    request: &ModelRequest,
    h: &HeaderMap,
) -> Result<outrigger_types::Fingerprint, crate::Error> {
    Ok(keys::http_fingerprint(
        "POST",
        &format!("model:{}", request.dialect.as_str()),
        &answer_headers(request.dialect, h)?,
        Some("application/json"),
        &request.body,
    ))
}

/// The request headers of a dialect that change what its provider generates or how
/// it words it: a beta feature turned on, an API version other than the one sent
/// when none is named. Written as a JSON object of the names present, each with its
/// values sorted (none: the empty string, so that the fingerprint of a request
/// without them is its body's alone). A header's values, repeated or
/// comma-separated, are one set: order, spaces and repeats do not matter. A value
/// that is not visible ASCII is refused: no provider takes one.
fn answer_headers(dialect: Dialect, h: &HeaderMap) -> Result<String, crate::Error> {
    let names: &[&'static str] = match dialect {
        Dialect::OpenAi => &["openai-beta"],
        Dialect::Anthropic => &["anthropic-beta", "anthropic-version"],
    };
    let mut named = serde_json::Map::new();
    for &name in names {
        let mut values = Vec::new();
        for v in h.get_all(name) {
            let v = v.to_str().map_err(|_| crate::Error::BadHeader {
                header: name,
                detail: "it is not visible ASCII".into(),
            })?;
            values.extend(
                v.split(',')
                    .map(str::trim)
                    .filter(|p| !p.is_empty())
                    // The version sent anyway is no other request.
                    .filter(|p| name != "anthropic-version" || *p != headers::ANTHROPIC_VERSION)
                    .map(str::to_owned),
            );
        }
        values.sort_unstable();
        values.dedup();
        if !values.is_empty() {
            named.insert(name.to_owned(), values.into());
        }
    }
    Ok(if named.is_empty() {
        String::new()
    } else {
        serde_json::Value::Object(named).to_string()
    })
}

fn no_cache(h: &HeaderMap) -> bool {
    h.get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|d| {
            matches!(
                d.trim().to_ascii_lowercase().as_str(),
                "no-cache" | "no-store"
            )
        })
}

/// A generation of a stream as its event ids name it: the attempt's number and
/// the tag its start drew (see [`outrigger_journal::StreamMeta::tags`]; none for an
/// attempt begun before tags existed). The tag tells a generation the journal never
/// held from a later one that took its number again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Generation {
    pub attempt: u32,
    pub tag: Option<u32>,
}

impl Generation {
    /// Attempt `attempt` of the stream `meta` describes.
    pub fn of(meta: &outrigger_journal::StreamMeta, attempt: u32) -> Self {
        Self {
            attempt,
            tag: meta.tag(attempt),
        }
    }
}

/// `<attempt>.<tag, 8 hex digits>`, or `<attempt>` for an untagged one.
impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.tag {
            Some(tag) => write!(f, "{}.{tag:08x}", self.attempt),
            None => write!(f, "{}", self.attempt),
        }
    }
}

/// An event id of ours: `<generation>:<seq>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventId {
    pub generation: Generation,
    pub seq: u64,
}

impl std::fmt::Display for EventId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.generation, self.seq)
    }
}

/// The longest `id:` line ours can be (`id: ` + u32 + `.` + 8 hex digits + `:` +
/// u64 + LF).
const ID_LINE_MAX: usize = 4 + 10 + 9 + 1 + 20 + 1;

/// Appends `raw` to `out` with its `id: <generation>:<seq>` line in front,
/// formatted in place.
fn push_with_id(out: &mut BytesMut, generation: Generation, seq: u64, raw: &[u8]) {
    use std::fmt::Write as _;
    out.reserve(raw.len() + ID_LINE_MAX);
    // Writing into a `BytesMut` cannot fail.
    let _ = writeln!(out, "id: {generation}:{seq}");
    out.extend_from_slice(raw);
}

/// The events of one upstream batch, numbered from `first_seq`, with their `id:`
/// lines: written into one buffer and split from it, so a batch costs one
/// allocation, not two per event.
fn with_ids(generation: Generation, first_seq: u64, events: &[Bytes]) -> Vec<Bytes> {
    let total = events.iter().map(|e| e.len() + ID_LINE_MAX).sum();
    let mut buf = BytesMut::with_capacity(total);
    let mut out = Vec::with_capacity(events.len());
    for (seq, ev) in (first_seq..).zip(events) {
        push_with_id(&mut buf, generation, seq, ev);
        out.push(buf.split().freeze());
    }
    out
}

/// The number of a closing error event the journal does not hold (the one added to
/// a replay of an attempt that did not complete, or sent by a generation that ended
/// before its first event or whose producer stopped): never a real event's, so that a
/// client resuming at it has everything and gets `204`, while one resuming at any
/// other number of the attempt gets the event. Numbered after the last journaled
/// event instead, it could not be told from a real event the journal lost (lazy text
/// deltas at a crash), and a client that has it would get it again on every resume.
pub const CLOSING_SEQ: u64 = u64::MAX;

/// A closing error event with its `id:` line ([`CLOSING_SEQ`]).
fn closing(generation: Generation, ev: &[u8]) -> Bytes {
    let mut out = BytesMut::new();
    push_with_id(&mut out, generation, CLOSING_SEQ, ev);
    out.freeze()
}

/// Parses a `Last-Event-ID` of ours (`<attempt>.<tag>:<seq>`, or `<attempt>:<seq>`
/// from an attempt begun before tags existed).
pub fn parse_event_id(v: &str) -> Option<EventId> {
    let (g, s) = v.trim().split_once(':')?;
    let (attempt, tag) = match g.split_once('.') {
        Some((a, t)) if t.len() == 8 && t.bytes().all(|b| b.is_ascii_hexdigit()) => {
            (a, Some(u32::from_str_radix(t, 16).ok()?))
        }
        Some(_) => return None,
        None => (g, None),
    };
    let digits = |x: &str| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit());
    if !digits(attempt) || !digits(s) {
        return None;
    }
    Some(EventId {
        generation: Generation {
            attempt: attempt.parse().ok()?,
            tag,
        },
        seq: s.parse().ok()?,
    })
}

/// The request's `Last-Event-ID`: `None` when absent or empty, an error when it is
/// not one of ours (answering it as absent would send the whole stream again).
pub fn last_event_id(h: &HeaderMap) -> Result<Option<EventId>, crate::Error> {
    let Some(v) = h.get("last-event-id") else {
        return Ok(None);
    };
    let v = v.to_str().unwrap_or("\u{fffd}");
    if v.trim().is_empty() {
        return Ok(None);
    }
    parse_event_id(v).map(Some).ok_or_else(|| crate::Error::BadHeader {
        header: "Last-Event-ID",
        detail: format!(
            "{v:?} is not an event id this sidecar sent; send the `id:` of the last event received (`<attempt>.<tag>:<seq>`), or no header for the whole stream"
        ),
    })
}

/// Where in a live hub a client that last received `seq` goes on.
pub(crate) fn next_index(seq: u64) -> usize {
    seq.checked_add(1)
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(usize::MAX)
}

// === Live ===

/// The in-memory fan-out of one generation: every forwarded event (with its id), and
/// whether the generation is over.
pub struct Live {
    pub key: StreamKey,
    /// The generation it carries, as its event ids name it.
    pub generation: Generation,
    /// The request it generates for (its [`fingerprint`]): a resume naming another
    /// body is refused before the start reaches the journal too.
    fingerprint: Option<outrigger_types::Fingerprint>,
    pub dialect: Dialect,
    events: Mutex<Vec<Bytes>>,
    finished: AtomicBool,
    /// Nothing more will be pushed (the generation may not have finished yet: its
    /// end is being recorded and metered).
    last_in: AtomicBool,
    /// The producer is ending the generation (its upstream read is over): see
    /// [`Live::is_ending`].
    ending: AtomicBool,
    /// The turn ended with a typed error event: see [`Live::is_broken`].
    broken: AtomicBool,
    /// The call asked for a plain answer and has no stream: see [`Live::is_plain`].
    plain: AtomicBool,
    version: watch::Sender<u64>,
    clients: AtomicUsize,
    cancel: Notify,
    cancelled: AtomicBool,
    cancel_on_disconnect: bool,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl Live {
    /// A hub for a new generation of `key`, generating for the request `fingerprint`
    /// identifies.
    pub fn new_for(
        key: &StreamKey,
        generation: Generation,
        fingerprint: outrigger_types::Fingerprint,
        dialect: Dialect,
        options: &Options,
    ) -> Arc<Self> {
        Self::with(
            key.clone(),
            generation,
            Some(fingerprint),
            dialect,
            options.cancel_on_disconnect,
        )
    }

    /// A hub that knows no request (tests).
    #[cfg(test)]
    fn new(
        key: StreamKey,
        generation: Generation,
        dialect: Dialect,
        cancel_on_disconnect: bool,
    ) -> Arc<Self> {
        Self::with(key, generation, None, dialect, cancel_on_disconnect)
    }

    fn with(
        key: StreamKey,
        generation: Generation,
        fingerprint: Option<outrigger_types::Fingerprint>,
        dialect: Dialect,
        cancel_on_disconnect: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            key,
            generation,
            fingerprint,
            dialect,
            events: Mutex::new(Vec::new()),
            finished: AtomicBool::new(false),
            last_in: AtomicBool::new(false),
            ending: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            plain: AtomicBool::new(false),
            version: watch::channel(0).0,
            clients: AtomicUsize::new(0),
            cancel: Notify::new(),
            cancelled: AtomicBool::new(false),
            cancel_on_disconnect,
        })
    }

    pub(crate) fn push(&self, events: impl IntoIterator<Item = Bytes>) {
        if let Ok(mut e) = self.events.lock() {
            e.extend(events);
        }
        self.version.send_modify(|v| *v += 1);
    }

    /// Nothing more will be pushed.
    fn last_is_in(&self) {
        self.last_in.store(true, Ordering::Release);
    }

    /// Whether the generation is ending: its upstream is no longer read, and its
    /// end is being recorded (after the events its clients have). Too late to
    /// cancel it or to attach to it; a turn whose gate an error closed while its
    /// upstream still runs is not ending yet (it is broken: [`Live::is_broken`]).
    pub(crate) fn is_ending(&self) -> bool {
        self.ending.load(Ordering::Acquire)
    }

    /// The producer's upstream read is over: the generation ends.
    pub(crate) fn mark_ending(&self) {
        self.ending.store(true, Ordering::Release);
    }

    /// Whether the turn ended with a typed error event (the provider's, or ours for
    /// a tool call cut short), its clients sent everything they will get, while its
    /// upstream may still be read for the usage that follows. A repeat of the call
    /// is not attached to it (it would read the error again) but waits for its end
    /// and begins afresh; a resume by key still reads it.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// The turn ended with a typed error event (see [`Live::is_broken`]).
    pub(crate) fn mark_broken(&self) {
        self.broken.store(true, Ordering::Release);
    }

    /// Whether this is the hub of a plain (`"stream": false`) call still waiting
    /// for its answer: it carries no events, only its end (which a repeat of the
    /// call waits for, to be answered from the journal) and a cancel. No resume
    /// reads it.
    pub(crate) fn is_plain(&self) -> bool {
        self.plain.load(Ordering::Acquire)
    }

    /// Resolves once the generation is over (its hub closed).
    pub(crate) async fn closed(&self) {
        let mut rx = self.version.subscribe();
        while !self.is_finished() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    fn finish(&self) {
        self.last_in.store(true, Ordering::Release);
        self.ending.store(true, Ordering::Release);
        self.finished.store(true, Ordering::Release);
        self.version.send_modify(|v| *v += 1);
    }

    /// Cancels the generation, unless it is ending (its upstream read is over, a
    /// plain answer is in): whether it did. Decided under the events' lock, as
    /// [`Live::outcome_in`] is, so that a plain answer is either cancelled or
    /// taken, never both.
    pub fn cancel(&self) -> bool {
        let _held = self.events.lock();
        if self.is_ending() {
            return false;
        }
        self.cancelled.store(true, Ordering::Release);
        self.cancel.notify_one();
        true
    }

    /// The call's outcome is in (a plain answer read whole, or a failure before
    /// any stream): it is ending, and a cancel now comes too late; false if a
    /// cancel came first.
    pub(crate) fn outcome_in(&self) -> bool {
        let _held = self.events.lock();
        if self.is_cancelled() {
            return false;
        }
        self.mark_ending();
        true
    }

    /// Whether the generation was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Resolves once the generation is cancelled (at once if it was).
    pub(crate) async fn cancellation(&self) {
        loop {
            let notified = self.cancel.notified();
            if self.is_cancelled() {
                return;
            }
            notified.await;
        }
    }

    /// The call that started the generation no longer counts as its client (it
    /// has attached its response, or the hub is finished).
    pub(crate) fn release_start(&self) {
        self.clients.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether the generation is over (its last event is in the hub).
    fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// How many events the hub holds.
    fn sent(&self) -> usize {
        self.events.lock().map_or(0, |e| e.len())
    }

    fn clients(&self) -> usize {
        self.clients.load(Ordering::Acquire)
    }

    /// Where a client that last received `seq` goes on, refusing an id past what
    /// this generation has sent: no client received it, and waiting for it would
    /// silently skip the events in between.
    pub fn resume_index(&self, seq: u64) -> Result<usize, crate::Error> {
        let from = next_index(seq);
        let sent = self.sent();
        if from > sent {
            return Err(crate::Error::BadHeader {
                header: "Last-Event-ID",
                detail: format!(
                    "{}:{seq} has not been sent yet: this generation has sent {sent} event(s); \
                     send the `id:` of the last event received",
                    self.generation
                ),
            });
        }
        Ok(from)
    }

    /// A body that yields the events from index `from` on, then the live tail.
    pub fn attach(self: &Arc<Self>, from: usize) -> LiveBody {
        self.clients.fetch_add(1, Ordering::AcqRel);
        LiveBody {
            live: self.clone(),
            next: from,
            rx: self.version.subscribe(),
            waiting: None,
        }
    }
}

/// One client of a [`Live`] stream.
pub struct LiveBody {
    live: Arc<Live>,
    next: usize,
    rx: watch::Receiver<u64>,
    waiting: Option<Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
}

impl Drop for LiveBody {
    fn drop(&mut self) {
        let left = self.live.clients.fetch_sub(1, Ordering::AcqRel) - 1;
        if left == 0
            && self.live.cancel_on_disconnect
            && !self.live.finished.load(Ordering::Acquire)
        {
            let _ = self.live.cancel();
        }
    }
}

impl HttpBody for LiveBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            // Mark the current version seen before looking, so a push after the look
            // wakes the wait below.
            this.rx.borrow_and_update();
            let finished = this.live.finished.load(Ordering::Acquire);
            if let Ok(events) = this.live.events.lock()
                && this.next < events.len()
            {
                // Hand over everything available as one frame.
                let mut out = BytesMut::new();
                for e in &events[this.next..] {
                    out.extend_from_slice(e);
                }
                this.next = events.len();
                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
            }
            if finished {
                return Poll::Ready(None);
            }
            let fut = this.waiting.get_or_insert_with(|| {
                let mut rx = this.rx.clone();
                Box::pin(async move {
                    let _ = rx.changed().await;
                })
            });
            match fut.as_mut().poll(cx) {
                Poll::Ready(()) => this.waiting = None,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The live generations of this process.
#[derive(Debug, Default)]
pub struct Registry {
    live: Mutex<HashMap<StreamKey, Arc<Live>>>,
}

impl Registry {
    pub fn get(&self, key: &StreamKey) -> Option<Arc<Live>> {
        self.live.lock().ok()?.get(key).cloned()
    }

    fn insert(&self, live: Arc<Live>) {
        if let Ok(mut m) = self.live.lock() {
            m.insert(live.key.clone(), live);
        }
    }

    /// Ends `live` (its clients see the end) and takes it out of the registry.
    fn close(&self, live: &Live) {
        live.finish();
        if let Ok(mut m) = self.live.lock()
            && m.get(&live.key)
                .is_some_and(|l| std::ptr::eq(Arc::as_ptr(l), live))
        {
            m.remove(&live.key);
        }
    }
}

// === A generation's start ===

/// A journaled generation from its start (the journal's `New`) until it has a
/// stream. Its hub is registered at once, so that a repeat of the request or a
/// resume by key waits for its first events (a plain call's repeat, for its answer)
/// instead of being told it is in progress, and a cancel reaches it. If it never
/// gets a stream (the upstream failed, the sidecar refused it, or the agent went
/// away and the call was dropped), its end is recorded and the hub's clients get a
/// typed error: the key's next request generates afresh instead of waiting on an
/// attempt that never ends.
pub(crate) struct Starting {
    shared: Arc<Shared>,
    journal: Journal,
    key: StreamKey,
    generation: Generation,
    live: Arc<Live>,
    /// The hub is this start's to close (not yet closed, nor handed to a producer).
    holds_hub: bool,
    dialect: Dialect,
    armed: bool,
    /// Why it ends, once disarmed with its end being recorded: what the hub's
    /// clients are told if the call is dropped before the end is written.
    ending: &'static str,
}

impl Starting {
    pub(crate) fn new(
        shared: &Arc<Shared>,
        journal: Journal,
        keyed: &Keyed,
        generation: Generation,
        request: &ModelRequest,
    ) -> Self {
        let key = keyed.key.clone();
        let fingerprint = keyed.fingerprint;
        let live = Live::new_for(
            &key,
            generation,
            fingerprint,
            request.dialect,
            &shared.options.streams,
        );
        live.plain.store(!request.stream, Ordering::Release);
        // The waiting call is a client of its hub: a repeat that attaches and
        // leaves must not cancel it (`cancel_on_disconnect`).
        live.clients.fetch_add(1, Ordering::AcqRel);
        shared.streams.insert(live.clone());
        Self {
            shared: shared.clone(),
            journal,
            key,
            generation,
            live,
            holds_hub: true,
            dialect: request.dialect,
            armed: true,
            ending: CANCELLED,
        }
    }

    pub(crate) fn journal(&self) -> &Journal {
        &self.journal
    }

    pub(crate) fn key(&self) -> &StreamKey {
        &self.key
    }

    pub(crate) fn attempt(&self) -> u32 {
        self.generation.attempt
    }

    /// The call's hub, which a cancel reaches.
    pub(crate) fn live(&self) -> Arc<Live> {
        self.live.clone()
    }

    /// A plain answer was journaled whole: the attempt is over, and its hub closes
    /// with nothing in it.
    pub(crate) fn answered(mut self) {
        self.armed = false;
        self.close(None);
    }

    /// The journal and the registered hub (which names the key and attempt), for the
    /// producer: the generation has its stream (a plain call's hub now carries one).
    /// The call still counts as the hub's client: it attaches
    /// its response, then calls [`Live::release_start`].
    pub(crate) fn started(mut self) -> (Journal, Arc<Live>) {
        self.armed = false;
        self.holds_hub = false;
        self.live.plain.store(false, Ordering::Release);
        (self.journal.clone(), self.live.clone())
    }

    /// Ends the attempt without a stream: recorded as failed (so the key's next
    /// request starts afresh), then the hub's clients told why (a repeat that waited
    /// for a plain answer then finds the attempt over in the journal).
    pub(crate) async fn failed(mut self, reason: &str) {
        if !self.live.outcome_in() {
            // A cancel came first (and was answered `202`): the call ends cancelled.
            return self.cancelled().await;
        }
        self.armed = false;
        self.ending = FAILED;
        let end = StreamEnd::Failed {
            reason: reason.to_string(),
        };
        let _ = self.end(end).await;
        self.close(Some(reason));
    }

    /// Records the attempt's end on a task of its own: the agent going away while
    /// it waits for the journal must not lose it (the key would stay open for ever).
    fn end(&self, end: StreamEnd) -> tokio::task::JoinHandle<()> {
        spawn_end(
            self.journal.clone(),
            self.key.clone(),
            self.generation.attempt,
            end,
        )
    }

    /// The generation was cancelled before it had a stream: its end is recorded
    /// (abandoned, as a cancel after the start is), then its clients get the typed
    /// error event naming the cancel.
    pub(crate) async fn cancelled(mut self) {
        self.armed = false;
        let end = StreamEnd::abandoned(CANCELLED);
        let _ = self.end(end).await;
        self.close(Some(CANCELLED));
    }

    /// Ends the hub, if any: with the typed error event naming `failure` (a
    /// stream's), or empty.
    fn close(&mut self, failure: Option<&str>) {
        if std::mem::take(&mut self.holds_hub) {
            let live = &self.live;
            if let Some(reason) = failure.filter(|_| !live.is_plain()) {
                let ev = interruption_event(self.dialect, reason);
                live.push([closing(self.generation, &ev)]);
            }
            self.shared.streams.close(live);
            live.release_start();
        }
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        if !self.armed {
            // Disarmed with its hub still open: `failed` or `cancelled`, dropped
            // while it recorded the end (the agent went away); its clients must not
            // hang.
            self.close(Some(self.ending));
            return;
        }
        let reason = "the call ended before the model answered (the agent went away)";
        self.close(Some(reason));
        if tokio::runtime::Handle::try_current().is_err() {
            // No runtime: the process is stopping, and the next start's recovery
            // ends the attempt.
            return;
        }
        self.end(StreamEnd::abandoned(reason.to_string()));
    }
}

/// Records the end of `key`'s `attempt` on a task of its own (inside a runtime).
fn spawn_end(
    journal: Journal,
    key: StreamKey,
    attempt: u32,
    end: StreamEnd,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(e) = record_end(&journal, &key, attempt, end).await {
            tracing::warn!(%key, attempt, error = %e, "could not record the end of a model call");
        }
    })
}

/// How long to wait before each new try of an end the journal failed to write.
const END_RETRIES: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_secs(1),
];

/// Records an attempt's end, trying again (three times, within about 1.3 s) when
/// the journal failed to write it: an attempt left open has no producer, and every
/// request with its key would be refused as in progress until a restart.
async fn record_end(
    journal: &Journal,
    key: &StreamKey,
    attempt: u32,
    end: StreamEnd,
) -> Result<(), outrigger_journal::Error> {
    let mut waits = END_RETRIES.iter();
    loop {
        match journal.stream_end(key, attempt, end.clone()).await {
            Err(e) if e.is_write_failure() => match waits.next() {
                Some(wait) => tokio::time::sleep(*wait).await,
                None => return Err(e),
            },
            other => return other,
        }
    }
}

// === The producer ===

/// What the producer needs besides the upstream body.
pub(crate) struct Production {
    pub journal: Journal,
    pub live: Arc<Live>,
    pub gate: Gate,
    pub framer: Framer,
    pub first_events: Vec<Bytes>,
    /// Sees every forwarded event and the end (metering, budget, observation).
    pub observer: Box<dyn crate::relay::StreamObserver>,
    /// The provider's limiter slot, held for the whole generation.
    pub permit: Option<crate::resilience::Permit>,
    /// How an interrupted text-only turn is continued, where its provider allows it.
    pub continuer: Option<crate::stitch::Continuer>,
}

/// The most upstream frames that already arrived taken in as one batch.
const MAX_COALESCED_FRAMES: usize = 64;

/// The reason a generation ends with when its agent cancelled it (the last client
/// left under `cancel_on_disconnect`, or `POST /v1/streams/{key}/cancel`).
pub(crate) const CANCELLED: &str = "cancelled";

/// What a generation's clients are told when it failed before it had a stream and
/// its call went away while the failure was being recorded.
const FAILED: &str = "the model call failed before it answered";

/// How a generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    Completed,
    /// The provider reported an error inside the stream.
    Failed,
    /// It broke off (upstream break, cancel, size or time bound).
    Abandoned(String),
}

/// Events the gate released in one turn, not yet journaled or forwarded.
struct Batch {
    first_seq: u64,
    /// As journaled.
    events: Vec<Bytes>,
    /// As forwarded: each with its `id:`.
    out: Vec<Bytes>,
    /// Journaled durably before it is forwarded (a complete tool-call block).
    durable: bool,
    /// Holds the terminal event.
    terminal: bool,
}

/// A generation's producer: the gate, the journal and the hub, driven by one task.
struct Producer {
    shared: Arc<Shared>,
    journal: Journal,
    live: Arc<Live>,
    gate: Gate,
    framer: Framer,
    observer: Box<dyn crate::relay::StreamObserver>,
    permit: Option<crate::resilience::Permit>,
    /// Raw events framed but not yet passed through the gate.
    scratch: Vec<Bytes>,
    seq: u64,
    bytes: usize,
    journal_ok: bool,
    end_recorded: bool,
    /// Text deltas released to the clients but not yet sent to the journal writer.
    held: Option<Held>,
    /// No block of the stream has been taken in yet.
    at_start: bool,
    /// The generation's interruption event is in the hub.
    interrupted: bool,
    continuer: Option<crate::stitch::Continuer>,
}

/// Why a generation ends whose producer stopped without ending it (it panicked, or
/// its runtime stopped).
const PRODUCER_STOPPED: &str = "the sidecar stopped generating this stream";

impl Drop for Producer {
    /// A producer that stops before [`Producer::finish`] has finished the hub (a panic
    /// on what the upstream sent, the runtime stopping) still ends the generation:
    /// its clients get the typed error event instead of waiting for ever, the key
    /// leaves the registry, and the attempt is recorded abandoned, so that a repeat
    /// generates afresh.
    fn drop(&mut self) {
        if self.live.is_finished() {
            return;
        }
        let live = self.live.clone();
        // Not after an end the clients already have (the terminal event, an error).
        if !(self.interrupted || self.gate.turn.terminal || self.gate.closed()) {
            let ev = interruption_event(live.dialect, PRODUCER_STOPPED);
            live.push([closing(live.generation, &ev)]);
        }
        self.shared.streams.close(&live);
        if self.end_recorded {
            return;
        }
        if tokio::runtime::Handle::try_current().is_err() {
            // The process is stopping: the next start's recovery ends the attempt.
            return;
        }
        let end = StreamEnd::abandoned(PRODUCER_STOPPED);
        spawn_end(
            self.journal.clone(),
            live.key.clone(),
            live.generation.attempt,
            end,
        );
    }
}

/// Text deltas the producer holds before queuing them to the journal writer: each
/// hand-off wakes the writer's thread, which cost more than the writing when a
/// stream's events arrive one frame at a time.
struct Held {
    first_seq: u64,
    events: Vec<Bytes>,
    due: tokio::time::Instant,
}

/// How long text deltas are held before they are queued to the journal writer.
const HOLD: Duration = Duration::from_millis(10);
/// Held deltas are queued at once past this many.
const HOLD_MAX_EVENTS: usize = 256;

/// Starts a generation under its hub and returns at once; the upstream is drained
/// by a task of its own, independent of any client.
///
/// The events already in hand (the first upstream frame's) are released here when
/// nothing has to be made durable first, so that the response's first poll finds
/// them and the first byte does not wait for the producer task to be scheduled.
pub(crate) fn start(shared: &Arc<Shared>, production: Production, upstream: UpstreamBody) {
    let mut producer = Producer::new(shared, production);
    let mut batch = producer.take_in();
    let pending = if batch.durable || batch.terminal || batch.events.is_empty() {
        Some(batch)
    } else {
        let events = std::mem::take(&mut batch.events);
        producer.hold(batch.first_seq, events);
        producer.live.push(batch.out);
        None
    };
    tokio::spawn(producer.run(pending, upstream));
}

impl Producer {
    fn new(shared: &Arc<Shared>, production: Production) -> Self {
        let Production {
            journal,
            live,
            gate,
            framer,
            first_events,
            observer,
            permit,
            continuer,
        } = production;
        Self {
            shared: shared.clone(),
            journal,
            live,
            gate,
            framer,
            observer,
            permit,
            scratch: first_events,
            seq: 0,
            bytes: 0,
            journal_ok: true,
            end_recorded: false,
            held: None,
            at_start: true,
            interrupted: false,
            continuer,
        }
    }

    /// Passes the framed events through the gate: what it releases is one batch,
    /// journaled as one append. Blocks that are only a line ending are dropped.
    fn take_in(&mut self) -> Batch {
        let mut events = Vec::new();
        let mut durable = false;
        for mut raw in self.scratch.drain(..) {
            // A block that is only a line ending (an upstream that pads with blank
            // lines) dispatches nothing to an SSE client: it is not made an event,
            // which would cost an id, a hub slot and a journal record for one byte.
            if raw.iter().all(|b| matches!(b, b'\r' | b'\n')) {
                continue;
            }
            // Each event counts with what it costs beyond its bytes, so that
            // `max_stream_bytes` bounds memory however small the events are.
            self.bytes += raw.len() + EVENT_OVERHEAD;
            if std::mem::take(&mut self.at_start) {
                // A byte order mark opening the stream is dropped: our `id:` line goes
                // first, and behind it the mark would hide the field of the line it
                // starts (`\u{feff}data:`), losing the first event.
                raw = crate::sse::without_bom(raw);
            }
            // The provider's own `id` lines are dropped: coming after ours, they would
            // win, and leave the client a `Last-Event-ID` it cannot resume with.
            let raw = crate::sse::without_field(raw, b"id");
            let mut pass = |gate: &mut Gate, raw| {
                let release = gate.push(raw);
                durable |= release.durable && !release.events.is_empty();
                events.extend(release.events);
            };
            let Some(continuer) = &mut self.continuer else {
                pass(&mut self.gate, raw);
                continue;
            };
            // A continuation's events are renumbered into the turn the agent reads;
            // its `message_start` is not passed on, but its usage counts.
            let (stitched, started) = continuer.take(raw);
            if started.is_some() {
                self.gate.turn.usage = started;
            }
            for raw in stitched {
                pass(&mut self.gate, raw);
            }
        }
        // A terminal event is made durable together with the stream's end record
        // (one flush per stream, before the agent sees the end), and so is anything
        // released with it.
        let terminal = self.gate.turn.terminal;
        let first_seq = self.seq;
        let now = std::time::Instant::now();
        for ev in &events {
            self.observer.on_event(ev, now);
        }
        let out = with_ids(self.live.generation, first_seq, &events);
        self.seq += events.len() as u64;
        Batch {
            first_seq,
            events,
            out,
            durable: durable && !terminal,
            terminal,
        }
    }

    /// Journals a batch, then hands it to the stream's clients; `true` when it held
    /// the terminal event.
    async fn settle(&mut self, mut batch: Batch) -> bool {
        if self.journal_ok && !batch.events.is_empty() {
            // The batch joins what is held; a durable batch takes it all in one append.
            self.hold(batch.first_seq, std::mem::take(&mut batch.events));
            if batch.durable {
                if let Some(held) = self.held.take() {
                    let r = self
                        .journal
                        .stream_append(
                            &self.live.key,
                            self.live.generation.attempt,
                            held.first_seq,
                            held.events,
                            true,
                        )
                        .await;
                    self.journal_result(r);
                }
            } else if self
                .held
                .as_ref()
                .is_some_and(|h| h.events.len() >= HOLD_MAX_EVENTS)
            {
                self.release_held().await;
            }
        }
        if batch.terminal {
            self.release_held().await;
        }
        let key = &self.live.key;
        let attempt = self.live.generation.attempt;
        if batch.terminal && self.journal_ok {
            match self
                .journal
                .stream_end(key, attempt, self.completed())
                .await
            {
                Ok(()) => self.end_recorded = true,
                // Refused (events of the attempt were lost) or not written: `finish`
                // records the attempt abandoned instead.
                Err(e) => {
                    tracing::warn!(%key, error = %e, "could not record the end of a stream");
                    self.journal_ok = false;
                }
            }
        }
        // Broken before its error is out: a repeat that reads the error's hub
        // already finds it so.
        if self.gate.closed() {
            self.live.mark_broken();
        }
        if !batch.out.is_empty() {
            self.live.push(batch.out);
        }
        if batch.terminal || self.gate.closed() {
            // Nothing follows the terminal event, or the typed error that closed the
            // gate: a client that resumes after it is told so at once (`204`), not
            // kept on an empty stream until the generation ends.
            self.live.last_is_in();
        }
        batch.terminal
    }

    /// The end record of a generation that reached its terminal event.
    fn completed(&self) -> StreamEnd {
        StreamEnd::Completed {
            usage: self
                .usage()
                .map(|u| serde_json::json!({"input_tokens": u.input, "output_tokens": u.output}))
                .unwrap_or(serde_json::Value::Null),
            continued: self.continuer.as_ref().map_or(0, |c| c.taken),
        }
    }

    /// The turn's usage, over all its pieces when it was continued.
    fn usage(&self) -> Option<crate::events::ReportedUsage> {
        match &self.continuer {
            Some(c) => c.with_carried(self.gate.turn.usage, self.gate.turn.terminal),
            None => self.gate.turn.usage,
        }
    }

    /// Holds text deltas (numbered from `first_seq`) for the journal.
    fn hold(&mut self, first_seq: u64, events: Vec<Bytes>) {
        match &mut self.held {
            Some(held) => {
                debug_assert_eq!(held.first_seq + held.events.len() as u64, first_seq);
                held.events.extend(events);
            }
            None => {
                self.held = Some(Held {
                    first_seq,
                    events,
                    due: tokio::time::Instant::now() + HOLD,
                });
            }
        }
    }

    /// Queues the held text deltas to the journal writer.
    async fn release_held(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        if !self.journal_ok {
            return;
        }
        let r = self
            .journal
            .stream_append_nowait(
                &self.live.key,
                self.live.generation.attempt,
                held.first_seq,
                held.events,
            )
            .await;
        self.journal_result(r);
    }

    /// A journal write that failed ends this stream's journaling.
    fn journal_result(&mut self, r: Result<(), outrigger_journal::Error>) {
        if let Err(e) = r {
            tracing::warn!(key = %self.live.key, error = %e, "the journal stopped taking this stream; it continues unjournaled");
            self.journal_ok = false;
            self.held = None;
        }
    }

    /// Drains the upstream after `pending` (a batch [`start`] could not settle).
    async fn run(mut self, mut pending: Option<Batch>, mut upstream: UpstreamBody) {
        let max_bytes = self.shared.options.streams.max_stream_bytes;
        let detach = self.shared.options.streams.detach_timeout;
        let mut detached_since: Option<tokio::time::Instant> = None;
        // A break or the end met while taking in a burst, handled on the next turn.
        let mut stashed = None;
        let mut recheck = tokio::time::interval(Duration::from_millis(500));
        recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        recheck.reset();
        let live = self.live.clone();
        // Kept across turns: a timer or waiter made anew each turn cost a timer-wheel
        // insert and removal (or a waiter list entry) per upstream frame.
        let cancelled = live.cancel.notified();
        tokio::pin!(cancelled);
        let mut hold = Deadline::default();
        let mut idle = Deadline::default();
        let ended = 'relay: loop {
            if let Some(batch) = pending.take()
                && self.settle(batch).await
            {
                break 'relay Ended::Completed;
            }
            if self.bytes > max_bytes {
                break 'relay Ended::Abandoned(format!("the stream passed {max_bytes} bytes"));
            }
            // Bound the time a generation runs with nobody listening.
            if live.clients() == 0 {
                detached_since.get_or_insert_with(tokio::time::Instant::now);
            } else {
                detached_since = None;
            }
            idle.set(detached_since.map(|t| t + detach));
            hold.set(self.held.as_ref().map(|h| h.due));
            let frame = match stashed.take() {
                Some(frame) => frame,
                None => tokio::select! {
                    f = upstream.frame() => f,
                    () = &mut hold.sleep, if hold.at.is_some() => {
                        self.release_held().await;
                        continue;
                    }
                    () = &mut cancelled => {
                        break 'relay Ended::Abandoned(CANCELLED.into());
                    }
                    () = &mut idle.sleep, if idle.at.is_some() => {
                        break 'relay Ended::Abandoned(format!("no client for {detach:?}"));
                    }
                    // Re-check the client count now and then.
                    _ = recheck.tick() => continue,
                },
            };
            if live.cancelled.load(Ordering::Acquire) {
                break 'relay Ended::Abandoned(CANCELLED.into());
            }
            let broke = match frame {
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data()
                        && let Err(e) = self.framer.push(&data, &mut self.scratch)
                    {
                        break 'relay self.framing_failed(e).await;
                    }
                    // Take in whatever else has already arrived, so that a burst is
                    // journaled and forwarded as one batch rather than event by event
                    // (the body itself gathers the chunks its connection holds; see
                    // `UpstreamBody::gathering`).
                    for _ in 0..MAX_COALESCED_FRAMES {
                        match upstream.frame().now_or_never() {
                            None => break,
                            Some(Some(Ok(f))) => {
                                if let Ok(data) = f.into_data()
                                    && let Err(e) = self.framer.push(&data, &mut self.scratch)
                                {
                                    break 'relay self.framing_failed(e).await;
                                }
                            }
                            Some(other) => {
                                stashed = Some(other);
                                break;
                            }
                        }
                    }
                    pending = Some(self.take_in());
                    continue;
                }
                Some(Err(e)) => format!("the upstream broke: {e}"),
                None => {
                    // An unterminated tail is an incomplete event: never forwarded.
                    let _incomplete = self.framer.finish(&mut self.scratch);
                    if !self.scratch.is_empty() {
                        pending = Some(self.take_in());
                        continue;
                    }
                    if self.gate.turn.errored {
                        break 'relay Ended::Failed;
                    }
                    "the upstream ended before its final event".to_owned()
                }
            };
            // A text-only turn may be continued at its provider instead (a cancel
            // meanwhile ends it).
            let continued = tokio::select! {
                next = self.continuation(&broke) => next,
                () = &mut cancelled => Err(CANCELLED.to_owned()),
            };
            match continued {
                Ok(next) => {
                    upstream = next;
                    // Its first events, read to see that it answers.
                    pending = Some(self.take_in());
                }
                Err(reason) => break 'relay Ended::Abandoned(reason),
            }
        };
        drop(upstream);
        drop(self.permit.take());
        self.finish(ended).await;
    }

    /// Continues a turn its upstream broke off (`reason`) at its provider, where
    /// that is allowed and only text has come: the continuation's body, or why the
    /// turn is abandoned instead.
    async fn continuation(&mut self, reason: &str) -> Result<UpstreamBody, String> {
        let turn = &self.gate.turn;
        let Some(continuer) = self.continuer.as_mut().filter(|c| {
            c.can_continue()
                && !self.gate.closed()
                && self.gate.held() == 0
                && !turn.inside_tool_call()
                && !turn.terminal
                && turn.finish_reason.is_none()
                && !self.live.is_cancelled()
        }) else {
            return Err(reason.to_owned());
        };
        let metrics = &self.shared.metrics;
        let target = continuer.provider().name.clone();
        let target = target.as_str();
        let failed = |why: String| {
            metrics.stream_continuation(target, false);
            format!("{reason}; continuing it failed: {why}")
        };
        let (req, trimmed) = continuer.request().map_err(|e| failed(e.to_string()))?;
        // Through the provider's breaker and its limiter, like any attempt: an open
        // circuit is not asked, and what the continuation meets is news of the
        // provider to both (a rate limit halves the limiter's concurrency and pauses it
        // for the `Retry-After`). It goes on in the turn's own limiter slot.
        let breakers = &self.shared.breakers;
        let limiter = self.shared.limiters.get(target);
        let pass = breakers.pass(target).map_err(|retry_after| {
            failed(format!(
                "{target}'s circuit is open (for {:.1}s more)",
                retry_after.as_secs_f64()
            ))
        })?;
        let record = |pass: crate::resilience::breaker::Pass<'_>, alive: bool| {
            metrics.breaker_state(target, pass.record(alive, rand::random::<f64>()));
        };
        // An answer: news to the limiter too.
        let heard = |pass: crate::resilience::breaker::Pass<'_>,
                     status: http::StatusCode,
                     headers: &http::HeaderMap,
                     broken: bool| {
            let retry_after = crate::model::attempts::retry_after(headers);
            limiter.observe(status.as_u16(), headers, retry_after);
            record(pass, !broken);
        };
        let limits = &self.shared.options.limits;
        let resp = match self
            .shared
            .upstream
            .send(req, limits.first_byte_timeout)
            .await
        {
            Ok(resp) => resp,
            Err(e) => {
                record(pass, false);
                return Err(failed(e.to_string()));
            }
        };
        let (parts, body) = resp.into_parts();
        if !parts.status.is_success() || !crate::headers::is_event_stream(&parts.headers) {
            // Read as an attempt's answer is (a server error or a 408 is the provider
            // failing; a rate limit, a refusal or a plain answer shows it alive).
            let status = parts.status;
            let broken = crate::model::attempts::answer_says_broken(status, &[]);
            heard(pass, status, &parts.headers, broken);
            return Err(failed(format!(
                "{target} answered {status} (not a stream of events)"
            )));
        }
        let provider = continuer.provider();
        let mut body = UpstreamBody::new(body, provider.api_key.as_ref().map(|k| k.expose()))
            .idle_limit(limits.stream_idle_timeout)
            .gathering();
        // What was left of the broken event is not an event.
        self.framer = crate::sse::Framer::new(limits.max_event_bytes);
        // Like any attempt, the continuation's first bytes must come within
        // `first_byte_timeout`; once the provider is sending (a keep-alive comment
        // while it thinks), its first event may take as long as any later one (the
        // stream's idle limit). One that opens with the provider's error event is no
        // answer.
        let mut deadline = Some(tokio::time::Instant::now() + limits.first_byte_timeout);
        // An event is a block with data: a comment (a keep-alive) is none.
        let is_event = |raw: &Bytes| crate::sse::parse(raw).data.is_some();
        while !self.scratch.iter().any(is_event) {
            let frame = match deadline {
                Some(at) => tokio::time::timeout_at(at, body.frame()).await,
                None => Ok(body.frame().await),
            };
            let why = match frame {
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        if !data.is_empty() {
                            deadline = None;
                        }
                        match self.framer.push(&data, &mut self.scratch) {
                            Ok(()) => continue,
                            Err(e) => e.to_string(),
                        }
                    }
                    Err(_) => continue,
                },
                Ok(Some(Err(e))) => format!("its answer broke before its first event: {e}"),
                Ok(None) => "its answer ended before its first event".to_owned(),
                Err(_) => format!("no event within {:?}", limits.first_byte_timeout),
            };
            self.scratch.clear();
            record(pass, false);
            return Err(failed(why));
        }
        if let Some((raw, error)) = self
            .scratch
            .iter()
            .find(|raw| is_event(raw))
            .and_then(|raw| Some((raw, crate::stitch::error_type(raw)?)))
        {
            // An error event stands for the error status it names (a rate limit
            // event is a 429 to the limiter).
            let status = crate::model::attempts::error_event_status(raw);
            let broken = crate::model::attempts::error_event_says_broken(raw);
            self.scratch.clear();
            heard(pass, status, &parts.headers, broken);
            return Err(failed(format!(
                "its answer opened with an error event ({error})"
            )));
        }
        heard(pass, parts.status, &parts.headers, false);
        metrics.stream_continuation(target, true);
        tracing::info!(key = %self.live.key, provider = %target, %reason, "continuing an interrupted text-only stream");
        continuer.begin(trimmed, self.gate.turn.usage.take());
        Ok(body)
    }

    /// An event passed the size limit: the events framed before it still go out
    /// (they are whole), then the generation is abandoned.
    async fn framing_failed(&mut self, e: crate::sse::EventTooLarge) -> Ended {
        let batch = self.take_in();
        if self.settle(batch).await {
            return Ended::Completed;
        }
        Ended::Abandoned(e.to_string())
    }

    /// Ends the generation: the typed error event of an interruption, the end
    /// record, and the hub's end.
    async fn finish(mut self, mut ended: Ended) {
        self.live.mark_ending();
        // Held deltas go before whatever ends the attempt.
        self.release_held().await;
        let live = self.live.clone();
        if self.gate.closed() && matches!(ended, Ended::Abandoned(_)) {
            // The turn already ended with an error event; what broke off after it
            // (the upstream, a cancel) needs no second one.
            ended = Ended::Failed;
        }
        let end = match &ended {
            Ended::Completed => self.completed(),
            Ended::Failed => StreamEnd::Failed {
                reason:
                    "the turn ended with an error event (the provider's, or a tool call cut short)"
                        .into(),
            },
            Ended::Abandoned(reason) => {
                if self.gate.held() > 0 || self.gate.turn.inside_tool_call() {
                    tracing::info!(key = %live.key, held = self.gate.held(), "dropping a partial tool call at an interruption");
                }
                let ev = interruption_event(live.dialect, reason);
                if self.journal_ok {
                    let r = self
                        .journal
                        .stream_append(
                            &live.key,
                            live.generation.attempt,
                            self.seq,
                            vec![ev.clone()],
                            true,
                        )
                        .await;
                    self.journal_result(r);
                }
                live.push(with_ids(
                    live.generation,
                    self.seq,
                    std::slice::from_ref(&ev),
                ));
                live.last_is_in();
                self.interrupted = true;
                StreamEnd::abandoned(reason.clone())
            }
        };
        // An attempt whose events the journal lost cannot be replayed: it ends as
        // abandoned whatever the agent got, so that the key's next request generates
        // afresh instead of waiting on an attempt that never completes.
        let end = if self.journal_ok {
            end
        } else {
            StreamEnd::Abandoned {
                reason: match &ended {
                    Ended::Abandoned(reason) => {
                        format!("{reason}; the journal lost events of this attempt")
                    }
                    _ => "the journal lost events of this attempt".into(),
                },
                // Its clients were sent events the journal has not: one that has
                // the last of them has everything there was.
                sent_to: (live.sent() as u64).checked_sub(1),
            }
        };
        if !self.end_recorded
            && let Err(e) = record_end(&self.journal, &live.key, live.generation.attempt, end).await
        {
            tracing::warn!(key = %live.key, error = %e, "could not record the end of a stream");
        }
        self.shared.streams.close(&live);
        // Metered over all the pieces of a continued turn.
        self.gate.turn.usage = self.usage();
        let outcome = match &ended {
            Ended::Completed => Ok(()),
            Ended::Failed => Err("the provider reported an error"),
            Ended::Abandoned(reason) => Err(reason.as_str()),
        };
        self.observer.on_end(outcome, Some(&self.gate.turn));
    }
}

/// A timer of the producer's, armed for `at` (when set) and re-armed only when `at`
/// changes.
struct Deadline {
    sleep: Pin<Box<tokio::time::Sleep>>,
    at: Option<tokio::time::Instant>,
}

impl Default for Deadline {
    fn default() -> Self {
        // Not registered with the timer until first polled, which `at` guards.
        Self {
            sleep: Box::pin(tokio::time::sleep(Duration::ZERO)),
            at: None,
        }
    }
}

impl Deadline {
    fn set(&mut self, at: Option<tokio::time::Instant>) {
        if at != self.at {
            if let Some(t) = at {
                self.sleep.as_mut().reset(t);
            }
            self.at = at;
        }
    }
}

// === Answers ===

/// A response streaming `live` from event `from` on.
pub fn live_response(live: &Arc<Live>, from: usize, replayed: bool) -> Response<Body> {
    let mut resp = Response::new(live.attach(from).boxed_unsync());
    sse_headers(resp.headers_mut(), replayed);
    resp
}

/// Whether a journaled event 0 is a plain answer's JSON document: an SSE block
/// starts with a field name (`data:`, `event:`, `id:`) or a comment, never `{`.
fn is_plain_answer(raw: &[u8]) -> bool {
    raw.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// A journaled plain answer, replayed.
pub fn plain_response(body: Bytes) -> Response<Body> {
    let mut resp = Response::new(crate::body::full(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut()
        .insert(headers::REPLAYED, HeaderValue::from_static("true"));
    resp
}

/// A response replaying journaled events of `generation`.
pub fn journal_response(events: Vec<(u64, Bytes)>, generation: Generation) -> Response<Body> {
    let mut out = BytesMut::new();
    for (seq, raw) in events {
        push_with_id(&mut out, generation, seq, &raw);
    }
    let mut resp = Response::new(crate::body::full(out.freeze()));
    sse_headers(resp.headers_mut(), true);
    resp
}

fn sse_headers(h: &mut HeaderMap, replayed: bool) {
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if replayed {
        h.insert(headers::REPLAYED, HeaderValue::from_static("true"));
    }
}

/// The stream key in `Outrigger-Stream-Key`, so a client can resume with
/// `GET /v1/streams/{key}`.
pub fn with_key(mut resp: Response<Body>, key: &StreamKey) -> Response<Body> {
    if let Ok(v) = HeaderValue::from_str(key.as_str()) {
        resp.headers_mut().insert("outrigger-stream-key", v);
    }
    resp
}

/// 204: the stream is over and there is nothing more to send (EventSource stops).
pub fn nothing_more() -> Response<Body> {
    let mut resp = Response::new(crate::body::empty());
    *resp.status_mut() = StatusCode::NO_CONTENT;
    resp
}

/// Records the tool calls of a replayed turn (so derived tool keys match after an
/// agent restart) and returns them.
pub(crate) fn correlate_replay(
    shared: &Shared,
    task: Option<&TaskId>,
    dialect: Dialect,
    events: &[(u64, Bytes)],
) {
    let Some(task) = task else { return };
    let mut gate = Gate::new(dialect);
    for (_, raw) in events {
        gate.push(raw.clone());
    }
    shared.correlator.record(task, gate.turn.completed_calls());
}

/// `GET /v1/streams/{key}` (resume after `Last-Event-ID`, or the whole stream) and
/// `POST /v1/streams/{key}/cancel`.
pub(crate) async fn endpoint(
    shared: &Arc<Shared>,
    req: http::Request<hyper::body::Incoming>,
) -> Result<Response<Body>, crate::Error> {
    let path = req.uri().path().to_string();
    let rest = path.strip_prefix("/v1/streams/").unwrap_or_default();
    // Only a `POST` cancels: a `GET` of a key that ends in `/cancel` (an
    // `Idempotency-Key` of `cancel`, its slashes not encoded) reads that stream.
    let (raw_key, cancel) = match rest.strip_suffix("/cancel") {
        Some(k) if req.method() == http::Method::POST => (k, true),
        _ => (rest, false),
    };
    let key = StreamKey::new(percent_decode(raw_key)).map_err(|_| crate::Error::UnknownStream {
        key: raw_key.to_string(),
    })?;
    let Some(journal) = shared.journal.as_ref() else {
        return Err(crate::Error::Journal(
            outrigger_journal::Error::Unavailable("the journal is not open".into()),
        ));
    };
    let method = req.method().clone();
    if cancel {
        return Ok(cancel_generation(shared, &key));
    }
    if method != http::Method::GET {
        return Err(crate::Error::MethodNotAllowed {
            method: method.to_string(),
            allowed: "GET",
        });
    }
    let last = last_event_id(req.headers())?;
    let resp = serve_attempt(shared, journal, &key, None, last).await?;
    if resp.status() == StatusCode::OK {
        shared
            .metrics
            .replay(outrigger_telemetry::ReplayKind::StreamResume);
    }
    Ok(with_key(resp, &key))
}

/// `POST /v1/streams/{key}/cancel`: `202` when a generation of this process was told
/// to stop; `200` with `"cancelled": false` when there is none, or when it is
/// ending (its upstream read over, its end being recorded: too late to cancel).
fn cancel_generation(shared: &Shared, key: &StreamKey) -> Response<Body> {
    match shared.streams.get(key) {
        Some(live) if live.cancel() => json_response(
            StatusCode::ACCEPTED,
            &serde_json::json!({"key": key, "cancelled": true}),
        ),
        _ => json_response(
            StatusCode::OK,
            &serde_json::json!({"key": key, "cancelled": false,
            "detail": "the stream is not being generated (it is over, or was never here)"}),
        ),
    }
}

/// What a repeated model request with `Last-Event-ID: a:s` gets: the rest of attempt
/// `a` after event `s`, never a new generation (spliced after the client's prefix, it
/// would make a stream no provider sent). See [`serve_attempt`]; `422 key-reused`
/// when the key was used for another request.
pub(crate) async fn resume_repeat(
    shared: &Shared,
    journal: &Journal,
    key: &StreamKey,
    fingerprint: outrigger_types::Fingerprint,
    from: EventId,
) -> Result<Response<Body>, crate::Error> {
    serve_attempt(shared, journal, key, Some(fingerprint), Some(from)).await
}

/// Attempt `a` of a stream after its event `s` (`from`), or its latest attempt
/// whole (`None`): what `GET /v1/streams/{key}` and a repeat with `Last-Event-ID`
/// both get. Live from the hub while this process generates it; otherwise from the
/// journal, ending with the typed error event of an attempt that did not complete
/// (an earlier attempt, whatever is being generated now, is over). `204` when
/// nothing is left after `s`; `410 generation-lost` when the journal does not hold
/// the generation `from` names (no attempt `a`, or one whose tag differs: its start
/// was lost, and a later generation may have taken its number); `404
/// unknown-stream` when the key is unknown (or expired long ago: forgotten), `410
/// stream-expired` for an attempt retention expired. With `fingerprint`, a key
/// recorded for another request is `422 key-reused`.
pub(crate) async fn serve_attempt(
    shared: &Shared,
    journal: &Journal,
    key: &StreamKey,
    fingerprint: Option<outrigger_types::Fingerprint>,
    from: Option<EventId>,
) -> Result<Response<Body>, crate::Error> {
    for round in 1..=50 {
        // A later attempt than the journal shows may have its start decided but not
        // yet applied (and its hub gone already, its producer stopped): looked for
        // again for up to 50 ms before it is called lost.
        let may_look_again = round <= 5;
        let meta = journal.stream_meta(key).map_err(crate::Error::Journal)?;
        if let (Some(fingerprint), Some(meta)) = (fingerprint, &meta)
            && meta.request.fingerprint != fingerprint
        {
            return Err(crate::Error::StreamKeyReused {
                key: key.to_string(),
            });
        }
        // A generation in the hub is the key's latest attempt, served from the hub
        // first: its start may be answered (and its first events relayed) a moment
        // before the writer has applied it. A hub behind the journal's attempt is an
        // earlier one's, still leaving the registry: over, and in the journal. A
        // plain call's hub carries no events: the journal answers for it.
        let live = shared.streams.get(key).filter(|live| {
            !live.is_plain()
                && meta
                    .as_ref()
                    .is_none_or(|m| live.generation.attempt >= m.attempt)
        });
        if let Some(live) = &live {
            // Its start may not be in the journal yet: the hub knows its request.
            if let (Some(fingerprint), Some(own)) = (fingerprint, live.fingerprint)
                && own != fingerprint
            {
                return Err(crate::Error::StreamKeyReused {
                    key: key.to_string(),
                });
            }
            match from {
                None => return Ok(live_response(live, 0, true)),
                Some(id) if id.generation.attempt == live.generation.attempt => {
                    if id.generation != live.generation {
                        return lost(key, id);
                    }
                    // The closing event ends the generation: nothing comes after it.
                    if id.seq == CLOSING_SEQ {
                        return Ok(nothing_more());
                    }
                    let from = live.resume_index(id.seq)?;
                    // A generation whose last event the client has: an empty `200`
                    // would have an event source reconnect for ever.
                    if live.last_in.load(Ordering::Acquire) && from >= live.sent() {
                        return Ok(nothing_more());
                    }
                    return Ok(live_response(live, from, true));
                }
                // A later attempt than any here, or an earlier one (over, and in the
                // journal): the journal says which.
                Some(_) => {}
            }
        }
        let not_there_yet = from.is_some_and(|id| {
            id.seq != CLOSING_SEQ
                && meta
                    .as_ref()
                    .is_some_and(|m| id.generation.attempt > m.attempt)
        });
        if not_there_yet && may_look_again {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let Some(meta) = meta else {
            return Err(crate::Error::UnknownStream {
                key: key.to_string(),
            });
        };
        let (attempt, after) = match from {
            Some(id) => (id.generation.attempt, Some(id.seq)),
            None => (meta.attempt, None),
        };
        if let Some(id) = from {
            if attempt == 0 || attempt > meta.attempt {
                return lost(key, id);
            }
            if Generation::of(&meta, attempt) != id.generation {
                // A plain answer sent no ids, and an untagged id is not one of a
                // tagged attempt's: after any such id, a plain answer has nothing
                // more. A tagged id is of a lost streamed generation.
                if id.generation.tag.is_none() {
                    let events = journal
                        .stream_events(key, attempt, None)
                        .map_err(crate::Error::Journal)?;
                    if let [(0, body)] = events.as_slice()
                        && is_plain_answer(body)
                    {
                        return Ok(nothing_more());
                    }
                }
                return lost(key, id);
            }
        }
        if meta.expired(attempt) {
            return Err(crate::Error::StreamExpired {
                key: key.to_string(),
            });
        }
        if attempt == meta.attempt && meta.state == outrigger_journal::StreamState::Open {
            // Not served from a hub above: its hub is gone (or a newer attempt's has
            // replaced it since `meta` was read) and its end is on the way to the
            // journal. Wait for it, or a replay would end silently, as if whole.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        return from_journal(shared, journal, &meta, attempt, after);
    }
    Err(crate::Error::StreamInProgress {
        key: key.to_string(),
    })
}

/// The answer to a client whose generation (`id`'s) the journal does not hold: no
/// more of it can be sent, and sending another's would splice two generations.
/// A client that has the generation's closing event has all of it: `204`.
fn lost(key: &StreamKey, id: EventId) -> Result<Response<Body>, crate::Error> {
    if id.seq == CLOSING_SEQ {
        return Ok(nothing_more());
    }
    Err(crate::Error::GenerationLost {
        key: key.to_string(),
        id: id.to_string(),
    })
}

/// Attempt `attempt` of the stream `meta` describes after its event `after`, from
/// the journal, ended by the typed error event of an attempt that did not complete;
/// `204` when nothing is left. Retention drops a stream's events and marks it
/// expired in one commit (and forgets it later): a stream expired since `meta` was
/// read is `410 stream-expired` (or, forgotten, `404 unknown-stream`), as it would
/// have been a moment later, not a silent end.
fn from_journal(
    shared: &Shared,
    journal: &Journal,
    meta: &outrigger_journal::StreamMeta,
    attempt: u32,
    after: Option<u64>,
) -> Result<Response<Body>, crate::Error> {
    let key = &meta.key;
    let mut events = journal
        .stream_events(key, attempt, after)
        .map_err(crate::Error::Journal)?;
    // A plain answer (`"stream": false`) is journaled whole as event 0: it is
    // served as the JSON document it is, and has no events to resume after.
    if let [(0, body)] = events.as_slice()
        && is_plain_answer(body)
    {
        return Ok(match after {
            Some(_) => nothing_more(),
            None => plain_response(body.clone()),
        });
    }
    if events.is_empty() {
        match journal.stream_meta(key).map_err(crate::Error::Journal)? {
            None => {
                return Err(crate::Error::UnknownStream {
                    key: key.to_string(),
                });
            }
            Some(now) if now.expired(attempt) => {
                return Err(crate::Error::StreamExpired {
                    key: key.to_string(),
                });
            }
            Some(_) => {}
        }
    }
    // Not to a client that has the closing event already, or the last event its
    // clients were sent where the journal lost some (it has all there was).
    let has_all = match (&meta.end, after) {
        (
            Some(StreamEnd::Abandoned {
                sent_to: Some(last),
                ..
            }),
            Some(after),
        ) => attempt == meta.attempt && after >= *last,
        _ => false,
    };
    if after != Some(CLOSING_SEQ) && !has_all {
        events.extend(ended_short(shared, journal, meta, attempt)?);
    }
    if events.is_empty() {
        return Ok(nothing_more());
    }
    Ok(journal_response(events, Generation::of(meta, attempt)))
}

/// The typed error event that ends the replay of `attempt` when it failed or broke
/// off without one in the journal (the sidecar stopped while generating it, the
/// journal lost its tail, it failed before its first event, or a later attempt
/// replaced it), numbered [`CLOSING_SEQ`]: a resumed client then sees the stream
/// end as interrupted, not as a silent end it could take for a whole answer. It is
/// not journaled.
pub(crate) fn ended_short(
    shared: &Shared,
    journal: &Journal,
    meta: &outrigger_journal::StreamMeta,
    attempt: u32,
) -> Result<Option<(u64, Bytes)>, crate::Error> {
    let (reason, last) = if attempt == meta.attempt {
        let reason = match &meta.end {
            Some(StreamEnd::Failed { reason } | StreamEnd::Abandoned { reason, .. }) => {
                reason.clone()
            }
            Some(StreamEnd::Completed { .. }) | None => return Ok(None),
        };
        let last = match meta.last_seq {
            Some(seq) => journal
                .stream_events(&meta.key, attempt, seq.checked_sub(1))
                .map_err(crate::Error::Journal)?
                .pop(),
            None => None,
        };
        (reason, last)
    } else if attempt < meta.attempt {
        // An earlier attempt ended without completing, or there would be no later one.
        let reason = format!(
            "attempt {attempt} did not complete; the stream went on as attempt {}",
            meta.attempt
        );
        let last = journal
            .stream_events(&meta.key, attempt, None)
            .map_err(crate::Error::Journal)?
            .pop();
        (reason, last)
    } else {
        return Ok(None);
    };
    // The provider's dialect; the events say it when the provider has left the
    // configuration (Anthropic's all name their type).
    let dialect = shared
        .options
        .providers
        .iter()
        .find(|p| p.name == meta.request.provider)
        .map(|p| p.dialect)
        .or_else(|| {
            let (_, raw) = last.as_ref()?;
            Some(if raw.starts_with(b"event:") {
                Dialect::Anthropic
            } else {
                Dialect::OpenAi
            })
        })
        .unwrap_or(Dialect::OpenAi);
    if let Some((_, raw)) = &last
        && crate::events::Turn::new(dialect).observe(raw) == crate::events::Kind::Error
    {
        return Ok(None);
    }
    Ok(Some((CLOSING_SEQ, interruption_event(dialect, &reason))))
}

fn json_response(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(crate::body::full(v.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proxy over `journal`.
    fn proxy(journal: &Journal, options: crate::Options) -> crate::Proxy {
        crate::Proxy::new(
            options,
            crate::Components::new(outrigger_telemetry::Metrics::new(), Some(journal.clone())),
        )
    }

    /// A streamed OpenAI request.
    fn streamed() -> ModelRequest {
        ModelRequest::parse(
            Dialect::OpenAi,
            Bytes::from_static(br#"{"model":"gpt","stream":true,"messages":[]}"#),
        )
        .expect("a request")
    }

    /// The state of `key`'s stream once it is `want`, or after 5 s whatever it is.
    async fn state_within(
        journal: &Journal,
        key: &StreamKey,
        want: outrigger_journal::StreamState,
    ) -> Option<outrigger_journal::StreamState> {
        let mut state = None;
        for _ in 0..500 {
            state = journal.stream_meta(key).expect("readable").map(|m| m.state);
            if state == Some(want) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        state
    }

    /// What the journal records of `request` at its start.
    /// An untagged generation (a hub made by hand, no journaled start).
    fn generation(attempt: u32) -> Generation {
        Generation { attempt, tag: None }
    }

    /// Event `seq` of an untagged generation.
    fn id(attempt: u32, seq: u64) -> EventId {
        EventId {
            generation: generation(attempt),
            seq,
        }
    }

    /// Event `seq` of `live`'s generation.
    fn at(live: &Live, seq: u64) -> EventId {
        EventId {
            generation: live.generation,
            seq,
        }
    }

    /// Event `seq` of `attempt` as the journal holds it (with its tag).
    fn journaled_id(journal: &Journal, key: &StreamKey, attempt: u32, seq: u64) -> EventId {
        let meta = journal
            .stream_meta(key)
            .expect("readable")
            .expect("a journaled stream");
        EventId {
            generation: Generation::of(&meta, attempt),
            seq,
        }
    }

    /// A streamed call of `key` waiting for its first event, as attempt 1 (untagged:
    /// its start is not journaled).
    fn waiting_call(
        shared: &Arc<Shared>,
        journal: &Journal,
        key: &str,
    ) -> (StreamKey, ModelRequest, Starting) {
        let request = streamed();
        let key = StreamKey::new(key.to_owned()).expect("a key");
        let starting = Starting::new(
            shared,
            journal.clone(),
            &keyed_for(&key, &request),
            generation(1),
            &request,
        );
        (key, request, starting)
    }

    /// `key` as a call of `request` would have it.
    fn keyed_for(key: &StreamKey, request: &ModelRequest) -> Keyed {
        Keyed {
            key: key.clone(),
            replayable: true,
            fingerprint: fingerprint(request, &HeaderMap::new()).expect("no headers"),
        }
    }

    /// Begins `key` for `request`, which must start attempt `attempt`: its generation.
    async fn begin_new(
        journal: &Journal,
        key: &StreamKey,
        request: &ModelRequest,
        attempt: u32,
    ) -> Generation {
        match journal.stream_begin(key, stream_request(request)).await {
            Ok(outrigger_journal::StreamBegin::New { attempt: a, tag }) if a == attempt => {
                Generation {
                    attempt,
                    tag: Some(tag),
                }
            }
            other => panic!("not begun as attempt {attempt}: {other:?}"),
        }
    }

    /// [`begin_new`], then waits until the start is applied (it is answered before).
    async fn begin_open(
        journal: &Journal,
        key: &StreamKey,
        request: &ModelRequest,
        attempt: u32,
    ) -> Generation {
        let generation = begin_new(journal, key, request, attempt).await;
        let state = state_within(journal, key, outrigger_journal::StreamState::Open).await;
        assert_eq!(state, Some(outrigger_journal::StreamState::Open));
        generation
    }

    fn stream_request(request: &ModelRequest) -> outrigger_journal::StreamRequest {
        outrigger_journal::StreamRequest {
            fingerprint: fingerprint(request, &HeaderMap::new()).expect("no headers"),
            task_id: None,
            request_id: outrigger_types::RequestId::from_generated("r1".into()),
            provider: "oa".into(),
            model: "gpt".into(),
            policy_versions: Vec::new(),
        }
    }

    #[test]
    fn a_last_event_id_that_is_not_ours_is_refused_not_taken_for_none() {
        let mut h = HeaderMap::new();
        assert!(matches!(last_event_id(&h), Ok(None)));
        h.insert("last-event-id", HeaderValue::from_static(" "));
        assert!(matches!(last_event_id(&h), Ok(None)));
        h.insert("last-event-id", HeaderValue::from_static("2:17"));
        assert!(matches!(last_event_id(&h), Ok(Some(i)) if i == id(2, 17)));
        h.insert("last-event-id", HeaderValue::from_static("2.0000beef:17"));
        let tagged = EventId {
            generation: Generation {
                attempt: 2,
                tag: Some(0xbeef),
            },
            seq: 17,
        };
        assert!(matches!(last_event_id(&h), Ok(Some(i)) if i == tagged));
        assert_eq!(tagged.to_string(), "2.0000beef:17", "as it was sent");
        for bad in [
            "2.beef:17",
            "2.0000beeg:17",
            "2.:17",
            "+2:17",
            "2:-1",
            ":17",
        ] {
            h.insert("last-event-id", HeaderValue::from_static(bad));
            assert!(last_event_id(&h).is_err(), "{bad} is not ours");
        }
        h.insert("last-event-id", HeaderValue::from_static("chatcmpl-9"));
        let e = last_event_id(&h).expect_err("not ours");
        assert!(e.to_string().contains("Last-Event-ID"), "{e}");
    }

    #[test]
    fn a_live_resume_past_what_was_sent_is_refused() {
        let key = StreamKey::new("k".to_owned()).unwrap();
        let live = Live::new(key, generation(1), Dialect::OpenAi, false);
        assert!(live.resume_index(0).is_err(), "nothing sent yet");
        live.push([
            Bytes::from_static(b"data: a\n\n"),
            Bytes::from_static(b"data: b\n\n"),
        ]);
        assert_eq!(live.resume_index(0).unwrap(), 1);
        assert_eq!(
            live.resume_index(1).unwrap(),
            2,
            "all received: the live tail"
        );
        let e = live.resume_index(9).expect_err("not sent");
        assert!(e.to_string().contains("1:9 has not been sent"), "{e}");
    }

    /// A producer of a new journaled OpenAI stream under `key`, its first frames
    /// `first_events`, and the generation's hub.
    async fn producer(
        j: &crate::test_journal::TempJournal,
        key: &str,
        first_events: Vec<Bytes>,
    ) -> (Arc<Shared>, StreamKey, Arc<Live>, Producer) {
        let proxy = proxy(&j.journal, crate::Options::default());
        let shared = proxy.shared.clone();
        let request = streamed();
        let key = StreamKey::new(key.to_owned()).expect("a key");
        let generation = begin_new(&j.journal, &key, &request, 1).await;
        let starting = Starting::new(
            &shared,
            j.journal.clone(),
            &keyed_for(&key, &request),
            generation,
            &request,
        );
        let (journal, live) = starting.started();
        let producer = Producer::new(
            &shared,
            Production {
                journal,
                live: live.clone(),
                gate: Gate::new(Dialect::OpenAi),
                framer: Framer::new(1 << 20),
                first_events,
                observer: Box::new(()),
                permit: None,
                continuer: None,
            },
        );
        (shared, key, live, producer)
    }

    /// A producer that stops without ending its generation (as a panic on what the
    /// upstream sent unwinds it) still ends it: the clients get the typed error event
    /// numbered after the last one sent, the key leaves the registry, and the attempt
    /// is recorded abandoned, so that a repeat generates afresh instead of waiting.
    #[tokio::test]
    async fn a_producer_that_stops_mid_stream_still_ends_its_generation() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let (shared, key, live, mut producer) = producer(
            &j,
            "m/openai/stops",
            vec![Bytes::from_static(
                b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
            )],
        )
        .await;
        let batch = producer.take_in();
        assert!(!producer.settle(batch).await, "not the end");
        assert_eq!(live.sent(), 1);
        drop(producer);
        assert!(live.is_finished(), "the hub is closed");
        assert!(
            shared.streams.get(&key).is_none(),
            "and out of the registry"
        );
        let mut body = live.attach(0);
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
            .await
            .expect("a frame")
            .expect("data")
            .into_data()
            .expect("data");
        let text = String::from_utf8_lossy(&frame);
        let generation = live.generation;
        assert!(generation.tag.is_some(), "a journaled start has a tag");
        assert!(
            text.starts_with(&format!("id: {generation}:0\n"))
                && text.contains(&format!("id: {generation}:{CLOSING_SEQ}\n")),
            "{text}"
        );
        assert!(text.contains(PRODUCER_STOPPED), "{text}");
        let state = state_within(&j.journal, &key, outrigger_journal::StreamState::Abandoned).await;
        assert_eq!(state, Some(outrigger_journal::StreamState::Abandoned));
    }

    /// Blank lines an upstream pads with dispatch nothing: they are not made events
    /// (no id, no hub slot, no journal record), and each event counts its overhead
    /// against `max_stream_bytes`, however small it is.
    #[tokio::test]
    async fn padding_is_not_an_event_and_each_event_counts_its_overhead() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let text = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let (_shared, _key, live, mut producer) = producer(
            &j,
            "m/openai/padded",
            vec![
                Bytes::from_static(text),
                Bytes::from_static(b"\n"),
                Bytes::from_static(b"\r\n"),
                Bytes::from_static(b":\n\n"),
                Bytes::from_static(text),
            ],
        )
        .await;
        let batch = producer.take_in();
        assert_eq!(batch.first_seq, 0);
        assert!(!producer.settle(batch).await, "not the end");
        assert_eq!(live.sent(), 3, "two deltas and a comment; no padding");
        assert_eq!(
            producer.bytes,
            2 * text.len() + 3 + 3 * EVENT_OVERHEAD,
            "each event with its overhead"
        );
    }

    /// A call whose upstream failed records its attempt failed even when its agent
    /// goes away while the journal's queue is full: the write does not go with the
    /// agent's future, or the key would stay open (`409`) until a restart.
    #[tokio::test]
    async fn a_failed_start_is_recorded_even_when_its_agent_leaves_while_the_queue_is_full() {
        let dir = tempfile::tempdir().expect("a directory");
        let (journal, writer, _) =
            outrigger_journal::Journal::open(outrigger_journal::Options::new(dir.path()))
                .expect("a journal");
        let proxy = proxy(&journal, crate::Options::default());
        let shared = proxy.shared.clone();
        let request = streamed();
        let key = StreamKey::new("m/openai/left".to_owned()).expect("a key");
        let generation = begin_new(&journal, &key, &request, 1).await;
        let starting = Starting::new(
            &shared,
            journal.clone(),
            &keyed_for(&key, &request),
            generation,
            &request,
        );
        // The writer is not running yet: starts of other keys fill its queue.
        let mut filled = false;
        for i in 0..100_000 {
            let other = StreamKey::new(format!("filler-{i}")).expect("a key");
            let mut begin = std::pin::pin!(journal.stream_begin(&other, stream_request(&request)));
            let polled = std::future::poll_fn(|cx| Poll::Ready(begin.as_mut().poll(cx))).await;
            if polled.is_pending() {
                filled = true;
                break;
            }
        }
        assert!(filled, "the queue never filled");
        // The agent goes away while the failure waits for room in the queue.
        {
            let mut failed = std::pin::pin!(starting.failed("upstream answered 500"));
            let polled = std::future::poll_fn(|cx| Poll::Ready(failed.as_mut().poll(cx))).await;
            assert!(polled.is_pending(), "the queue is full");
        }
        let writer = tokio::spawn(writer.run());
        let state = state_within(&journal, &key, outrigger_journal::StreamState::Failed).await;
        assert_eq!(state, Some(outrigger_journal::StreamState::Failed));
        drop((proxy, shared, journal));
        let _ = tokio::time::timeout(Duration::from_secs(10), writer).await;
    }

    /// An end the journal failed to write is tried again: written once the journal
    /// recovers, instead of leaving the attempt open (and its key refused) until a
    /// restart.
    #[tokio::test]
    async fn an_end_the_journal_failed_to_write_is_tried_again() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let request = streamed();
        let key = StreamKey::new("m/openai/retried".to_owned()).expect("a key");
        j.journal
            .stream_begin(&key, stream_request(&request))
            .await
            .expect("begun");
        j.journal
            .stream_append(&key, 1, 0, vec![Bytes::from_static(b"data: {}\n\n")], true)
            .await
            .expect("appended");
        j.journal
            .set_write_fault(Some(outrigger_journal::WriteFault::FailFlush));
        let end = StreamEnd::Failed {
            reason: "upstream".into(),
        };
        let once = j.journal.stream_end(&key, 1, end.clone()).await;
        assert!(once.is_err_and(|e| e.is_write_failure()), "the fault holds");
        let recorded = tokio::spawn({
            let (journal, key) = (j.journal.clone(), key.clone());
            async move { record_end(&journal, &key, 1, end).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        j.journal.set_write_fault(None);
        let r = tokio::time::timeout(Duration::from_secs(10), recorded)
            .await
            .expect("within the retries")
            .expect("the task");
        assert!(r.is_ok(), "{r:?}");
        let state = j
            .journal
            .stream_meta(&key)
            .expect("readable")
            .map(|m| m.state);
        assert_eq!(state, Some(outrigger_journal::StreamState::Failed));
    }

    /// A plain call's hub is registered from its start, so that a cancel reaches it
    /// and a repeat waits for its end; it never carries an event (not even the
    /// typed error of a failure: the agent gets that whole).
    #[tokio::test]
    async fn a_plain_calls_hub_carries_only_its_end() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let proxy = proxy(&j.journal, crate::Options::default());
        let shared = proxy.shared.clone();
        let request = ModelRequest::parse(
            Dialect::OpenAi,
            Bytes::from_static(br#"{"model":"gpt","stream":false,"messages":[]}"#),
        )
        .expect("a request");
        let key = StreamKey::new("m/openai/plain".to_owned()).expect("a key");
        let generation = begin_open(&j.journal, &key, &request, 1).await;
        let keyed = keyed_for(&key, &request);
        let starting = Starting::new(&shared, j.journal.clone(), &keyed, generation, &request);
        let live = shared.streams.get(&key).expect("its hub is registered");
        assert!(live.is_plain());
        let repeat = tokio::spawn({
            let live = live.clone();
            async move { live.closed().await }
        });
        tokio::task::yield_now().await;
        assert!(
            !repeat.is_finished(),
            "a repeat waits while it is generated"
        );
        let failing = tokio::spawn(starting.failed("the provider refused"));
        tokio::time::timeout(Duration::from_secs(5), repeat)
            .await
            .expect("the repeat's wait ended")
            .expect("no panic");
        assert_eq!(
            j.journal
                .stream_meta(&key)
                .expect("readable")
                .map(|m| m.state),
            Some(outrigger_journal::StreamState::Failed),
            "its end is journaled before its waiters are let go"
        );
        failing.await.expect("no panic");
        assert_eq!(live.sent(), 0, "no event in a plain call's hub");
        assert!(shared.streams.get(&key).is_none(), "out of the registry");
    }

    /// A cancel and a plain answer read whole race under one lock: whichever comes
    /// first wins, and the other is told so.
    #[test]
    fn a_plain_answer_is_either_cancelled_or_taken() {
        let key = StreamKey::new("m/openai/race".to_owned()).expect("a key");
        let hub = || {
            Live::new_for(
                &key,
                generation(1),
                fingerprint(&streamed(), &HeaderMap::new()).expect("no headers"),
                Dialect::OpenAi,
                &Options::default(),
            )
        };
        let taken = hub();
        assert!(taken.outcome_in());
        assert!(!taken.cancel(), "too late once the answer is in");
        assert!(!taken.is_cancelled());
        let cancelled = hub();
        assert!(cancelled.cancel());
        assert!(!cancelled.outcome_in(), "a cancelled call takes no answer");
        assert!(cancelled.is_cancelled() && !cancelled.is_ending());
    }

    /// Under `cancel_on_disconnect`, a repeat that attaches to a generation still
    /// waiting for its first event and leaves does not cancel it: the call that
    /// started it is a client too, until it attaches its response.
    #[tokio::test]
    async fn a_repeat_that_leaves_does_not_cancel_the_call_it_joined() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let options = crate::Options {
            streams: Options {
                cancel_on_disconnect: true,
                ..Options::default()
            },
            ..crate::Options::default()
        };
        let proxy = proxy(&j.journal, options);
        let shared = proxy.shared.clone();
        let (_, _, starting) = waiting_call(&shared, &j.journal, "m/openai/joined");
        let live = starting.live();
        drop(live.attach(0));
        assert!(!live.is_cancelled(), "the waiting call is still there");
        let (_journal, live) = starting.started();
        let own = live.attach(0);
        live.release_start();
        drop(live.attach(0));
        assert!(!live.is_cancelled(), "its own response is attached");
        drop(own);
        assert!(live.is_cancelled(), "its last client left");
    }

    /// A generation of this process that has ended, resumed at its last event, has
    /// nothing more: `204`, not an empty `200` (which an event source reconnects to).
    #[tokio::test]
    async fn an_ended_hub_resumed_at_its_last_event_is_no_content() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let proxy = proxy(&j.journal, crate::Options::default());
        let shared = proxy.shared.clone();
        let key = StreamKey::new("m/openai/ended".to_owned()).expect("a key");
        let live = Live::new(key.clone(), generation(1), Dialect::OpenAi, false);
        shared.streams.insert(live.clone());
        live.push(with_ids(
            generation(1),
            0,
            &[
                Bytes::from_static(b"data: a\n\n"),
                Bytes::from_static(b"data: [DONE]\n\n"),
            ],
        ));
        let status = |from| {
            let (shared, journal, key) = (shared.clone(), j.journal.clone(), key.clone());
            async move {
                serve_attempt(&shared, &journal, &key, None, Some(from))
                    .await
                    .expect("an answer")
                    .status()
            }
        };
        assert_eq!(
            status(id(1, 0)).await,
            StatusCode::OK,
            "the last event is left"
        );
        assert_eq!(status(id(1, 1)).await, StatusCode::OK, "still generating");
        live.finish();
        assert_eq!(status(id(1, 0)).await, StatusCode::OK);
        assert_eq!(status(id(1, 1)).await, StatusCode::NO_CONTENT);
    }

    /// Once the producer has settled its terminal event (or the typed error that
    /// closed the gate, or its interruption event), a client resuming at that
    /// event is told there is nothing more at once, while the generation's end is
    /// still being recorded and metered: `204`, not an empty `200`.
    #[tokio::test]
    async fn a_hub_is_over_for_its_clients_once_its_last_event_is_in() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let text = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let done = b"data: [DONE]\n\n";
        let (shared, key, live, mut generation) =
            producer(&j, "m/openai/last", vec![Bytes::from_static(text)]).await;
        let batch = generation.take_in();
        assert!(!generation.settle(batch).await);
        assert!(!live.last_in.load(Ordering::Acquire));
        generation.scratch.push(Bytes::from_static(done));
        let batch = generation.take_in();
        assert!(generation.settle(batch).await, "the terminal event");
        assert!(!live.is_finished(), "its end is metered first");
        assert!(shared.streams.get(&key).is_some(), "not yet closed");
        let served = serve_attempt(&shared, &j.journal, &key, None, Some(at(&live, 1)))
            .await
            .expect("an answer");
        assert_eq!(served.status(), StatusCode::NO_CONTENT);
        generation.finish(Ended::Completed).await;
        assert!(shared.streams.get(&key).is_none(), "closed by finish");

        // An interrupted generation: its typed error event goes in, and the hub is
        // over for its clients before the end is recorded and the hub closed.
        let (shared, key, live, mut generation) =
            producer(&j, "m/openai/cut", vec![Bytes::from_static(text)]).await;
        let batch = generation.take_in();
        assert!(!generation.settle(batch).await);
        let ended = generation.finish(Ended::Abandoned("the upstream broke".into()));
        tokio::pin!(ended);
        for _ in 0..1000 {
            if live.last_in.load(Ordering::Acquire)
                || futures_util::poll!(ended.as_mut()).is_ready()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(!live.is_finished(), "its end is being recorded");
        assert!(shared.streams.get(&key).is_some());
        assert_eq!(live.sent(), 2, "the text and the typed error");
        let served = serve_attempt(&shared, &j.journal, &key, None, Some(at(&live, 1)))
            .await
            .expect("an answer");
        assert_eq!(served.status(), StatusCode::NO_CONTENT);
        ended.await;
    }

    /// The provider's error event ends the turn for its clients: the hub is broken
    /// (a repeat of the call waits for its end, see `model`), but not ending while
    /// its upstream is still read for the usage that follows.
    #[tokio::test]
    async fn an_error_event_breaks_the_turn_before_its_upstream_ends() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let text = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let error = b"data: {\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}\n\n";
        let (_shared, _key, live, mut generation) =
            producer(&j, "m/openai/broken", vec![Bytes::from_static(text)]).await;
        let batch = generation.take_in();
        assert!(!generation.settle(batch).await);
        assert!(!live.is_broken(), "text alone breaks nothing");
        generation.scratch.push(Bytes::from_static(error));
        let batch = generation.take_in();
        assert!(
            !generation.settle(batch).await,
            "an error is not the terminal event"
        );
        assert!(live.is_broken(), "the error ended the turn");
        assert!(!live.is_ending(), "its upstream is still read");
        generation.finish(Ended::Failed).await;
        assert!(live.is_ending());
    }

    /// A cancel reaches a generation whose upstream is still read (even with its last
    /// event out), not one that is ending (its end being recorded): that one is
    /// answered `"cancelled": false`.
    #[tokio::test]
    async fn a_generation_that_is_ending_is_not_cancelled() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let proxy = proxy(&j.journal, crate::Options::default());
        let shared = proxy.shared.clone();
        let key = StreamKey::new("m/openai/ending".to_owned()).expect("a key");
        let running = Live::new(key.clone(), generation(1), Dialect::OpenAi, false);
        shared.streams.insert(running.clone());
        let answer = cancel_generation(&shared, &key);
        assert_eq!(answer.status(), StatusCode::ACCEPTED);
        assert!(running.is_cancelled());

        let ending = Live::new(key.clone(), generation(2), Dialect::OpenAi, false);
        ending.push([Bytes::from_static(b"id: 2:0\ndata: [DONE]\n\n")]);
        ending.last_is_in();
        assert_eq!(
            cancel_generation(&shared, &key).status(),
            StatusCode::ACCEPTED,
            "its last event is out, its upstream still read: it can be cancelled"
        );
        ending.mark_ending();
        shared.streams.insert(ending.clone());
        let answer = cancel_generation(&shared, &key);
        assert_eq!(answer.status(), StatusCode::OK);
        let body = http_body_util::BodyExt::collect(answer.into_body())
            .await
            .expect("a body")
            .to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(body["cancelled"], false, "{body}");
    }

    /// A resume of an attempt whose end is not yet in the journal, while a newer
    /// attempt's hub has already replaced its own, waits for that end: it is served
    /// ending with the typed error, not cut silently as if whole.
    #[tokio::test]
    async fn a_resume_of_an_attempt_a_newer_hub_replaced_waits_for_its_end() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let proxy = proxy(&j.journal, crate::Options::default());
        let shared = proxy.shared.clone();
        let request = streamed();
        let key = StreamKey::new("m/openai/superseded".to_owned()).expect("a key");
        begin_open(&j.journal, &key, &request, 1).await;
        let text = Bytes::from_static(
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
        );
        j.journal
            .stream_append(&key, 1, 0, vec![text.clone(), text], true)
            .await
            .expect("appended");
        // Attempt 2's hub is registered; attempt 1's end has not reached the journal.
        shared.streams.insert(Live::new(
            key.clone(),
            generation(2),
            Dialect::OpenAi,
            false,
        ));
        let resume = tokio::spawn({
            let (shared, journal, key) = (shared.clone(), j.journal.clone(), key.clone());
            let from = journaled_id(&journal, &key, 1, 0);
            async move { serve_attempt(&shared, &journal, &key, None, Some(from)).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!resume.is_finished(), "it waits for attempt 1's end");
        j.journal
            .stream_end(&key, 1, StreamEnd::abandoned("the upstream broke"))
            .await
            .expect("ended");
        let served = resume.await.expect("joined").expect("an answer");
        assert_eq!(served.status(), StatusCode::OK);
        let body = http_body_util::BodyExt::collect(served.into_body())
            .await
            .expect("a body")
            .to_bytes();
        let body = String::from_utf8_lossy(&body);
        let first = journaled_id(&j.journal, &key, 1, 1);
        assert!(body.starts_with(&format!("id: {first}\n")), "{body}");
        assert!(
            body.contains("the upstream broke"),
            "ends with the typed error: {body}"
        );
    }

    /// A hub still in the registry for an attempt the journal has moved past is not
    /// served as the key's current attempt.
    #[tokio::test]
    async fn a_hub_behind_the_journals_attempt_is_not_the_current_one() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let proxy = proxy(&j.journal, crate::Options::default());
        let shared = proxy.shared.clone();
        let request = streamed();
        let key = StreamKey::new("m/openai/moved-on".to_owned()).expect("a key");
        for attempt in 1..=2 {
            begin_new(&j.journal, &key, &request, attempt).await;
            if attempt == 1 {
                let failed = StreamEnd::Failed {
                    reason: "upstream".into(),
                };
                j.journal.stream_end(&key, 1, failed).await.expect("ended");
            }
        }
        // Attempt 2's start is answered before it is written: wait until it is.
        let state = state_within(&j.journal, &key, outrigger_journal::StreamState::Open).await;
        assert_eq!(state, Some(outrigger_journal::StreamState::Open));
        // Attempt 1's hub, not yet removed; attempt 2 has not registered its own.
        shared.streams.insert(Live::new(
            key.clone(),
            generation(1),
            Dialect::OpenAi,
            false,
        ));
        let served = serve_attempt(&shared, &j.journal, &key, None, None).await;
        assert!(
            matches!(served, Err(crate::Error::StreamInProgress { .. })),
            "{:?}",
            served.map(|r| r.status())
        );
    }

    /// A proxy over `j`'s journal, and a stream under `key` whose attempt 1
    /// completed: `data: a`, then `[DONE]`.
    async fn completed_stream(
        j: &crate::test_journal::TempJournal,
        key: &str,
    ) -> (Arc<Shared>, StreamKey) {
        let proxy = proxy(&j.journal, crate::Options::default());
        let shared = proxy.shared.clone();
        let request = streamed();
        let key = StreamKey::new(key.to_owned()).expect("a key");
        begin_open(&j.journal, &key, &request, 1).await;
        let events = vec![
            Bytes::from_static(b"data: a\n\n"),
            Bytes::from_static(b"data: [DONE]\n\n"),
        ];
        j.journal
            .stream_append(&key, 1, 0, events, true)
            .await
            .expect("appended");
        let done = StreamEnd::Completed {
            usage: serde_json::Value::Null,
            continued: 0,
        };
        j.journal.stream_end(&key, 1, done).await.expect("ended");
        (shared, key)
    }

    /// A completed stream that retention expires between the read of its metadata
    /// and the read of its events is expired (`410`), not over (`204`); once retention
    /// forgets it, it is unknown (`404`).
    #[tokio::test]
    async fn a_stream_expired_between_two_reads_is_expired_not_over() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let (shared, key) = completed_stream(&j, "m/openai/dropped").await;
        let meta = j
            .journal
            .stream_meta(&key)
            .expect("readable")
            .expect("known");
        let served = from_journal(&shared, &j.journal, &meta, 1, Some(0)).expect("served");
        assert_eq!(served.status(), StatusCode::OK, "the last event is left");

        let later = std::time::SystemTime::now() + Duration::from_secs(400 * 24 * 3600);
        let reaped = j.journal.reap(later).await.expect("reaped");
        assert_eq!(reaped.streams_dropped, 1, "{reaped:?}");
        for after in [None, Some(0)] {
            let served = from_journal(&shared, &j.journal, &meta, 1, after);
            assert!(
                matches!(served, Err(crate::Error::StreamExpired { .. })),
                "{after:?}: {:?}",
                served.map(|r| r.status())
            );
        }
        // Read now, the stream is expired too; once forgotten, it is unknown.
        let first = EventId {
            generation: Generation::of(&meta, 1),
            seq: 0,
        };
        for from in [None, Some(first)] {
            let served = serve_attempt(&shared, &j.journal, &key, None, from).await;
            assert!(
                matches!(served, Err(crate::Error::StreamExpired { .. })),
                "{from:?}: {:?}",
                served.map(|r| r.status())
            );
        }
        let forgotten = j
            .journal
            .reap(later + Duration::from_secs(400 * 24 * 3600))
            .await
            .expect("reaped");
        assert_eq!(forgotten.streams_forgotten, 1, "{forgotten:?}");
        let served = from_journal(&shared, &j.journal, &meta, 1, None);
        assert!(
            matches!(served, Err(crate::Error::UnknownStream { .. })),
            "{:?}",
            served.map(|r| r.status())
        );
    }

    /// A client's event id whose generation the journal does not hold (its start
    /// lost, and the number taken again by a later generation) is refused with
    /// `410 generation-lost`, never answered with that later generation's events;
    /// a client that has the closing event has everything (`204`).
    #[tokio::test]
    async fn a_resume_of_a_generation_the_journal_never_held_is_refused_not_spliced() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let (shared, key) = completed_stream(&j, "m/openai/lost").await;
        let held = journaled_id(&j.journal, &key, 1, 0);
        let tag = held.generation.tag.expect("a tagged attempt");
        let status = |from: EventId| {
            let (shared, journal, key) = (shared.clone(), j.journal.clone(), key.clone());
            async move {
                match serve_attempt(&shared, &journal, &key, None, Some(from)).await {
                    Ok(resp) => Ok(resp.status()),
                    Err(e) => Err(e.to_problem().status),
                }
            }
        };
        assert_eq!(status(held).await, Ok(StatusCode::OK), "its own id");
        let other_tag = EventId {
            generation: Generation {
                attempt: 1,
                tag: Some(tag ^ 1),
            },
            seq: 0,
        };
        for lost in [other_tag, id(1, 0), id(2, 0), id(0, 0)] {
            assert_eq!(status(lost).await, Err(StatusCode::GONE), "{lost}");
        }
        let served = serve_attempt(&shared, &j.journal, &key, None, Some(other_tag)).await;
        assert!(
            matches!(served, Err(crate::Error::GenerationLost { .. })),
            "{:?}",
            served.map(|r| r.status())
        );
        let closing = EventId {
            seq: CLOSING_SEQ,
            ..other_tag
        };
        assert_eq!(status(closing).await, Ok(StatusCode::NO_CONTENT));

        // The same against a generation being generated here.
        let running = Generation {
            attempt: 2,
            tag: Some(7),
        };
        let live = Live::new(key.clone(), running, Dialect::OpenAi, false);
        live.push(with_ids(running, 0, &[Bytes::from_static(b"data: b\n\n")]));
        shared.streams.insert(live.clone());
        assert_eq!(status(at(&live, 0)).await, Ok(StatusCode::OK));
        let elsewhere = EventId {
            generation: Generation {
                attempt: 2,
                tag: Some(8),
            },
            seq: 0,
        };
        for lost in [elsewhere, id(2, 0), id(3, 0)] {
            assert_eq!(status(lost).await, Err(StatusCode::GONE), "{lost}");
        }
    }

    /// A generation whose start is not in the journal yet is known by its hub,
    /// which knows its request: a resume naming another body under the key is
    /// `422 key-reused`, as it is once the start is in.
    #[tokio::test]
    async fn a_resume_naming_another_body_is_refused_before_the_start_is_journaled() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let proxy = proxy(&j.journal, crate::Options::default());
        let shared = proxy.shared.clone();
        let (key, request, starting) = waiting_call(&shared, &j.journal, "m/openai/not-yet");
        let live = starting.live();
        live.push(with_ids(
            generation(1),
            0,
            &[Bytes::from_static(b"data: a\n\n")],
        ));
        let other = ModelRequest::parse(
            Dialect::OpenAi,
            Bytes::from_static(
                br#"{"model":"gpt","stream":true,"messages":[{"role":"user","content":"x"}]}"#,
            ),
        )
        .expect("a request");
        let served = serve_attempt(
            &shared,
            &j.journal,
            &key,
            Some(fingerprint(&other, &HeaderMap::new()).expect("no headers")),
            Some(id(1, 0)),
        )
        .await;
        assert!(
            matches!(served, Err(crate::Error::StreamKeyReused { .. })),
            "{:?}",
            served.map(|r| r.status())
        );
        let served = serve_attempt(
            &shared,
            &j.journal,
            &key,
            Some(fingerprint(&request, &HeaderMap::new()).expect("no headers")),
            Some(id(1, 0)),
        )
        .await
        .expect("its own body");
        assert_eq!(served.status(), StatusCode::OK);
        starting.answered();
    }

    /// Retention expired attempt 1; a repeat then began attempt 2. A client that
    /// resumes attempt 1 is told it expired (`410`), not that it did not complete.
    #[tokio::test]
    async fn an_expired_attempt_stays_expired_after_the_next_one_began() {
        let j = crate::test_journal::TempJournal::open().expect("a journal");
        let (shared, key) = completed_stream(&j, "m/openai/expired-then-again").await;
        let request = streamed();
        let later = std::time::SystemTime::now() + Duration::from_secs(400 * 24 * 3600);
        let reaped = j.journal.reap(later).await.expect("reaped");
        assert_eq!(reaped.streams_dropped, 1, "{reaped:?}");
        begin_open(&j.journal, &key, &request, 2).await;
        j.journal
            .stream_end(&key, 2, StreamEnd::abandoned("cut"))
            .await
            .expect("ended");
        for from in [0, 1].map(|seq| journaled_id(&j.journal, &key, 1, seq)) {
            let served = serve_attempt(&shared, &j.journal, &key, None, Some(from)).await;
            assert!(
                matches!(served, Err(crate::Error::StreamExpired { .. })),
                "{from:?}: {:?}",
                served.map(|r| r.status())
            );
        }
        // Attempt 2 is not expired: it ends with its typed error.
        let served = serve_attempt(&shared, &j.journal, &key, None, None)
            .await
            .expect("served");
        assert_eq!(served.status(), StatusCode::OK);
    }

    #[test]
    fn the_last_possible_event_id_resumes_past_the_end() {
        assert_eq!(next_index(4), 5);
        assert_eq!(next_index(u64::MAX), usize::MAX);
    }

    #[test]
    fn the_headers_that_change_an_answer_are_in_its_fingerprint() {
        let anthropic = ModelRequest::parse(
            Dialect::Anthropic,
            Bytes::from_static(br#"{"model":"claude","max_tokens":9,"messages":[]}"#),
        )
        .expect("a request");
        let with = |request: &ModelRequest, pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (name, value) in pairs {
                h.append(*name, HeaderValue::from_static(value));
            }
            fingerprint(request, &h).expect("visible ASCII")
        };
        let bare = with(&anthropic, &[]);
        assert_eq!(
            bare,
            keys::http_fingerprint(
                "POST",
                "model:anthropic",
                "",
                Some("application/json"),
                &anthropic.body
            ),
            "without them, the body's alone"
        );
        assert_eq!(
            with(&anthropic, &[("anthropic-version", "2023-06-01")]),
            bare,
            "the version sent when none is named is no other request"
        );
        let beta = with(
            &anthropic,
            &[
                ("anthropic-beta", "a-1,b-2"),
                ("anthropic-version", "2023-06-01"),
            ],
        );
        assert_ne!(beta, bare);
        assert_ne!(beta, with(&anthropic, &[("anthropic-beta", "a-1")]));
        assert_ne!(
            beta,
            with(
                &anthropic,
                &[
                    ("anthropic-beta", "a-1,b-2"),
                    ("anthropic-version", "2024-01-01")
                ]
            )
        );
        assert_eq!(
            beta,
            with(
                &anthropic,
                &[
                    ("anthropic-version", "2023-06-01"),
                    ("anthropic-beta", " b-2 "),
                    ("anthropic-beta", "a-1, b-2"),
                ]
            ),
            "a set: order, spaces and repeats do not matter"
        );
        assert_ne!(
            with(&anthropic, &[("anthropic-beta", "x&anthropic-version=y")]),
            with(
                &anthropic,
                &[("anthropic-beta", "x"), ("anthropic-version", "y")]
            ),
            "a value cannot pass for another header"
        );
        assert_eq!(
            with(
                &anthropic,
                &[("user-agent", "x"), ("openai-beta", "assistants=v2")]
            ),
            bare,
            "other headers, and another dialect's, are not in it"
        );
        assert_ne!(
            with(&streamed(), &[("openai-beta", "assistants=v2")]),
            with(&streamed(), &[]),
            "OpenAI's beta header"
        );
        let mut h = HeaderMap::new();
        h.insert(
            "anthropic-beta",
            HeaderValue::from_bytes(b"caf\xe9").expect("obs-text"),
        );
        assert!(
            matches!(
                fingerprint(&anthropic, &h),
                Err(crate::Error::BadHeader {
                    header: "anthropic-beta",
                    ..
                })
            ),
            "a value that is not visible ASCII is refused"
        );
    }
}
