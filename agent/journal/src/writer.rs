//! The single writer task: every mutation goes through it, so decisions about a key
//! are serialized without locks, and all writes that arrive while a flush runs share
//! the next one (group commit).
//!
//! A batch is appended to the journal's write-ahead log as one frame (and synced, for
//! `Durability::Node`); only then are its waiters answered, and then sled gets its
//! writes, while readers wait for them. Answers that merely read (replay, in flight)
//! wait for the same log write, because they may have read state written earlier in
//! the batch. If the write or the sync fails, the batch's frame is taken back and
//! nothing of it reaches sled, so no reader ever sees a state that was never made
//! durable, and every waiter gets `Error::Unavailable` (fail closed).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;
use growable_bloom_filter::GrowableBloom;
use outrigger_types::IdempotencyKey;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::Error;
use crate::chain::{self, Head, PURGE};
use crate::claims::Claim;
use crate::options::Options;
use crate::record::{Begin, Record, State};
use crate::slots;
use crate::state::{self, Effect, Event};
use crate::stats::{Shared, WriteFault};
use crate::store::{HeldWrite, OwnedWrite, Store, Then, keys};
use crate::stream::{
    StreamBegin, StreamEnd, StreamKey, StreamMeta, StreamRequest, StreamState, chunk,
};
use crate::time::Timestamp;

/// The most expiry-index entries one `reap` call processes, so that a reap after a long
/// downtime does not build one enormous batch.
const REAP_LIMIT: usize = 10_000;

/// The most open streams whose state the writer remembers; past it, it starts over
/// (reading from the store is always correct, only slower). Also the most broken
/// attempts it remembers; past it, the oldest is forgotten first.
const MAX_OPEN_STREAMS: usize = 10_000;

/// The most damaged expiry index entries the writer remembers having logged.
const MAX_DAMAGED_EXPIRIES: usize = 10_000;

pub(crate) type Reply<T> = oneshot::Sender<Result<T, Error>>;

pub(crate) enum Command {
    Begin {
        intent: Box<crate::record::Intent>,
        reply: Reply<Begin>,
    },
    Apply {
        key: IdempotencyKey,
        event: Box<Event>,
        reply: Reply<(Record, Effect)>,
    },
    Read {
        key: IdempotencyKey,
        reply: Reply<Option<Record>>,
    },
    StreamBegin {
        key: StreamKey,
        request: Box<StreamRequest>,
        /// The tag of the attempt it begins, if it begins one.
        tag: u32,
        /// Held until the batch with the start is logged.
        claim: Claim,
        /// `None`: the caller decided attempt 1 itself (the key filter had never seen
        /// the key).
        reply: Option<Reply<StreamBegin>>,
    },
    StreamAppend {
        key: StreamKey,
        attempt: u32,
        /// The sequence number of the first of `events`.
        seq: u64,
        events: Vec<Bytes>,
        durable: bool,
        /// Sent by `stream_append_nowait`: nobody waits, so the writer may hold the
        /// events (see [`Run`]).
        buffered: bool,
        reply: Reply<()>,
    },
    StreamEnd {
        key: StreamKey,
        attempt: u32,
        end: StreamEnd,
        reply: Reply<()>,
    },
    KvPut {
        namespace: String,
        key: String,
        value: Option<Vec<u8>>,
        reply: Reply<()>,
    },
    Reap {
        now: SystemTime,
        reply: Reply<ReapReport>,
    },
}

/// What one `reap` call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReapReport {
    /// Full records turned into tombstones.
    pub tombstoned: u64,
    /// Tombstones forgotten (the key may be used again as new).
    pub purged: u64,
    /// Streams past `stream_retention` whose events were dropped (each kept as
    /// `expired` metadata for as long again).
    pub streams_dropped: u64,
    /// Expired streams forgotten (the key is then unknown).
    pub streams_forgotten: u64,
    /// Records past retention that are still unsettled (in flight, in doubt, waiting
    /// for an operator): kept, and looked at again one retention period later.
    pub deferred: u64,
    /// Records or streams due that could not be read (a damaged record file), and
    /// expiry index entries that could not be parsed: left as they are, for
    /// `journal verify` to name; retention goes on past them.
    pub damaged: u64,
    /// Whether more entries are due than one call processes: call again.
    pub more: bool,
}

/// An answer that waits for the batch's outcome.
type Pending = Box<dyn FnOnce(Result<(), &str>) + Send>;

fn pending<T: Send + 'static>(reply: Reply<T>, value: T) -> Pending {
    Box::new(move |outcome| {
        // A dropped receiver means the caller stopped waiting; nothing to tell it.
        let _ = reply.send(match outcome {
            Ok(()) => Ok(value),
            Err(reason) => Err(Error::Unavailable(reason.to_owned())),
        });
    })
}

/// One group commit being assembled.
#[derive(Default)]
pub(crate) struct Batch {
    writes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    /// The keys of `writes` whose values the store holds rather than gives sled (an
    /// in-flight record's, replaced when the call ends; see `crate::store`).
    held: HashSet<Vec<u8>>,
    records: HashMap<IdempotencyKey, Option<Record>>,
    /// The slot of each record this batch wrote.
    slots: HashMap<IdempotencyKey, u64>,
    streams: HashMap<StreamKey, Option<StreamMeta>>,
    head_before: Head,
    /// Record changes, chained as one log entry at commit.
    changes: Vec<(String, &'static str, chain::Hash)>,
    /// Keys to look at again later, per expiry kind: one index entry per batch, due
    /// when the last of them is.
    expiries: BTreeMap<u8, (Timestamp, Vec<String>)>,
    state_deltas: [i64; 8],
    records_written: u64,
    stream_events: u64,
    /// Streams whose held events ([`Run`]s) or start this batch writes out: if it
    /// fails, they have a hole (or no start) and take no more events.
    runs_written: Vec<(StreamKey, u32)>,
    kv_writes: u64,
    replays: u64,
    /// Some write in the batch must be durable before its waiter is answered.
    needs_flush: bool,
    after_apply: Vec<Pending>,
    after_flush: Vec<Pending>,
    /// A waiter was answered before the batch is applied (a new stream's start).
    answered_early: bool,
    /// The claims of the streams begun in this batch, released when it is dropped
    /// (after it is logged, or failed).
    claims: Vec<Claim>,
    commands: usize,
    /// Of `commands`, the queued text deltas only held in memory (see `Core::hold`).
    held_appends: usize,
}

impl Batch {
    fn new(head: Head) -> Self {
        Self {
            head_before: head,
            ..Self::default()
        }
    }

    fn set(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        if !self.held.is_empty() {
            self.held.remove(&key);
        }
        self.writes.insert(key, value);
    }

    /// Writes a value the store keeps in memory until it is replaced.
    fn hold(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.held.insert(key.clone());
        self.writes.insert(key, Some(value));
    }

    /// The batch's writes for sled and its held values.
    fn take_writes(&mut self) -> (Vec<OwnedWrite>, Vec<HeldWrite>) {
        let writes = std::mem::take(&mut self.writes);
        if self.held.is_empty() {
            return (writes.into_iter().collect(), Vec::new());
        }
        let mut stored = Vec::with_capacity(writes.len());
        let mut held = Vec::with_capacity(self.held.len());
        for (key, value) in writes {
            match value {
                Some(value) if self.held.contains(&key) => held.push((key, value)),
                value => stored.push((key, value)),
            }
        }
        self.held.clear();
        (stored, held)
    }

    fn expire_later(&mut self, kind: u8, due: Timestamp, key: String) {
        let (latest, keys) = self
            .expiries
            .entry(kind)
            .or_insert_with(|| (due, Vec::new()));
        *latest = (*latest).max(due);
        keys.push(key);
    }

    fn delta(&mut self, from: Option<State>, to: Option<State>) {
        if let Some(s) = from {
            self.state_deltas[s.index()] -= 1;
        }
        if let Some(s) = to {
            self.state_deltas[s.index()] += 1;
        }
    }
}

/// A durable record of a call in flight, with its stored bytes: its outcome usually
/// follows within milliseconds, and keeping it saves a read and a decode on the
/// writer's hot path.
struct Hot {
    record: Record,
    slot: u64,
}

/// Lazily journaled events of one stream held by the writer, so that a stream whose
/// events arrive one by one costs one store write per flush interval rather than one
/// per event. A run is written out (as one chunk) with the stream's next awaited
/// append, its end, a new attempt, when it grows past [`RUN_EVENTS`] or
/// [`RUN_BYTES`], and when the flush delay runs out; nobody reads an open stream's
/// events from the journal meanwhile (its live clients read the proxy's hub).
struct Run {
    attempt: u32,
    first_seq: u64,
    events: Vec<Bytes>,
    bytes: usize,
}

/// The most events, and bytes, one [`Run`] holds before it is written out.
const RUN_EVENTS: usize = 1_024;
const RUN_BYTES: usize = 256 * 1024;

/// What the writer owns.
pub(crate) struct Core {
    store: Arc<Store>,
    shared: Arc<Shared>,
    options: Options,
    head: Head,
    /// When lazy writes were first applied without a flush.
    dirty_since: Option<Instant>,
    /// Durable records of calls in flight (updated only after a successful commit).
    hot: HashMap<IdempotencyKey, Hot>,
    /// The current attempt of streams seen open, so that an append (one per upstream
    /// batch) costs no read and decode of the stream's metadata. Updated only after a
    /// successful commit, like `hot`; a stream leaves it when it ends.
    open_streams: HashMap<StreamKey, (u32, Option<u64>)>,
    /// Held lazy events per stream (see [`Run`]).
    runs: HashMap<StreamKey, Run>,
    /// Stream attempts whose held events were lost to a failed write: the rest of
    /// such an attempt is refused, so the journal never serves a stream with a hole.
    broken: HashSet<(StreamKey, u32)>,
    /// `broken` in the order the attempts broke, so that the oldest is forgotten
    /// first when it is full.
    broken_order: VecDeque<(StreamKey, u32)>,
    /// Makes expiry index keys unique within the epoch.
    expiry_ids: u64,
    /// Damaged expiry index entries already logged: each sweep passes over them
    /// again (they are left in place), and one WARN line each is enough.
    damaged_expiries: HashSet<Vec<u8>>,
    /// The failures counted when the newest logged batch was logged: a later flush
    /// makes it durable, which shows writes work again only if no failure was
    /// counted since (see [`Shared::made_durable`]).
    logged_at_errors: u64,
    /// The slot the next new record is written to (see [`crate::slots`]).
    next_slot: u64,
    /// The slot the next new stream's events are written to (see [`keys::Events`]).
    next_events_slot: u64,
    /// Every record and stream key that may be in the store (loaded at open, added to
    /// on each write, never taken from). A key it does not hold is certainly absent,
    /// so a new call or stream costs no read of the store: with random keys, that
    /// read often missed sled's cache and went to disk. A false positive (about 1 %)
    /// costs only that read. Shared with the journal's handles, which ask it whether
    /// a stream key is new (see [`crate::claims`]).
    known: Arc<KnownKeys>,
}

/// The filter of [`Core::known`]: written by the writer, read by any thread.
pub(crate) struct KnownKeys(Mutex<GrowableBloom>);

impl KnownKeys {
    fn new() -> Self {
        Self(Mutex::new(GrowableBloom::new(
            KNOWN_FALSE_POSITIVES,
            KNOWN_INITIAL,
        )))
    }

    fn insert(&self, kind: Known, key: &str) {
        self.lock().insert((kind, key));
    }

    /// `false`: the key has certainly never been written.
    pub(crate) fn may_exist(&self, kind: Known, key: &str) -> bool {
        self.lock().contains((kind, key))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GrowableBloom> {
        crate::store::lock(&self.0)
    }
}

/// What a key in [`Core::known`] names.
#[derive(Clone, Copy, Hash)]
pub(crate) enum Known {
    Record,
    Stream,
}

/// The keys `known` is first sized for; it grows as needed.
const KNOWN_INITIAL: usize = 100_000;
/// The false-positive rate `known` keeps to.
const KNOWN_FALSE_POSITIVES: f64 = 0.01;

/// The record stored for `key`. A record of another key (read through a pointer
/// into a record file that was cut short and then appended to) is an error too.
pub(crate) fn decode_record(key: &str, bytes: &[u8]) -> Result<Record, Error> {
    let rec: Record = serde_json::from_slice(bytes).map_err(|e| Error::Decode {
        what: format!("record {key}"),
        detail: e.to_string(),
    })?;
    if rec.key.as_str() != key {
        return Err(Error::Decode {
            what: format!("record {key}"),
            detail: format!("its slot holds the record of {}", rec.key),
        });
    }
    Ok(rec)
}

pub(crate) fn decode_stream(key: &str, bytes: &[u8]) -> Result<StreamMeta, Error> {
    let meta: StreamMeta = serde_json::from_slice(bytes).map_err(|e| Error::Decode {
        what: format!("stream {key}"),
        detail: e.to_string(),
    })?;
    // Stored under another key (a damaged store), it would be served, or ended at
    // recovery, as this key's.
    if meta.key.as_str() != key {
        return Err(Error::Decode {
            what: format!("stream {key}"),
            detail: format!("its place holds the stream of {}", meta.key),
        });
    }
    Ok(meta)
}

fn encode<T: serde::Serialize>(what: &str, value: &T) -> Result<Vec<u8>, Error> {
    encode_into(what, value, Vec::with_capacity(128))
}

/// Bytes a record's JSON is encoded into at first: a tool call's record with its
/// redacted request and response is 1–3 KB, and growing from serde_json's 128 bytes
/// copied it five times over.
const RECORD_CAPACITY: usize = 2048;

fn encode_into<T: serde::Serialize>(
    what: &str,
    value: &T,
    mut out: Vec<u8>,
) -> Result<Vec<u8>, Error> {
    serde_json::to_writer(&mut out, value)
        .map_err(|e| Error::Storage(format!("cannot encode {what}: {e}")))?;
    Ok(out)
}

impl Core {
    pub(crate) fn new(
        store: Arc<Store>,
        shared: Arc<Shared>,
        options: Options,
        head: Head,
    ) -> Result<Self, Error> {
        let next_slot = slots::next_slot(&store)?;
        let next_events_slot = slots::next_events_slot(&store)?;
        Ok(Self {
            store,
            shared,
            options,
            head,
            dirty_since: None,
            hot: HashMap::new(),
            open_streams: HashMap::new(),
            runs: HashMap::new(),
            broken: HashSet::new(),
            broken_order: VecDeque::new(),
            expiry_ids: 0,
            damaged_expiries: HashSet::new(),
            logged_at_errors: 0,
            next_slot,
            next_events_slot,
            known: Arc::new(KnownKeys::new()),
        })
    }

    /// Notes that a record or stream key is in the store (recovery, and every write).
    pub(crate) fn remember(&mut self, kind: Known, key: &str) {
        self.known.insert(kind, key);
    }

    /// The filter of the keys that may be in the store, for the journal's handles.
    pub(crate) fn known(&self) -> Arc<KnownKeys> {
        Arc::clone(&self.known)
    }

    /// Notes a stream's events slot seen at open, so that no new stream gets it: a
    /// stream begun just before a restart may have a slot and no events yet.
    pub(crate) fn note_events_slot(&mut self, slot: Option<u64>) {
        if let Some(slot) = slot {
            self.next_events_slot = self.next_events_slot.max(slot.saturating_add(1));
        }
    }

    fn may_exist(&self, kind: Known, key: &str) -> bool {
        self.known.may_exist(kind, key)
    }

    pub(crate) fn new_batch(&self) -> Batch {
        Batch::new(self.head)
    }

    fn epoch(&self) -> u64 {
        self.shared.epoch
    }

    pub(crate) fn record(
        &self,
        batch: &Batch,
        key: &IdempotencyKey,
    ) -> Result<Option<Record>, Error> {
        if let Some(overlay) = batch.records.get(key) {
            return Ok(overlay.clone());
        }
        if let Some(hot) = self.hot.get(key) {
            return Ok(Some(hot.record.clone()));
        }
        if !self.may_exist(Known::Record, key.as_str()) {
            return Ok(None);
        }
        let Some(slot) = self.find(key)? else {
            return Ok(None);
        };
        self.store
            .get(&keys::body(slot))?
            .map(|bytes| decode_record(key.as_str(), &bytes))
            .transpose()
    }

    /// The slot of a stored record, if any.
    fn slot(&self, batch: &Batch, key: &IdempotencyKey) -> Result<Option<u64>, Error> {
        if let Some(&slot) = batch.slots.get(key) {
            return Ok(Some(slot));
        }
        if let Some(hot) = self.hot.get(key) {
            return Ok(Some(hot.slot));
        }
        self.find(key)
    }

    /// The slot the store's index names for `key` (the store was migrated at open).
    fn find(&self, key: &IdempotencyKey) -> Result<Option<u64>, Error> {
        let newest = slots::generation(self.next_slot.saturating_sub(1));
        slots::find(&self.store, key.as_str(), newest)
    }

    fn stream(&self, batch: &Batch, key: &StreamKey) -> Result<Option<StreamMeta>, Error> {
        if let Some(overlay) = batch.streams.get(key) {
            return Ok(overlay.clone());
        }
        if !self.may_exist(Known::Stream, key.as_str()) {
            return Ok(None);
        }
        self.store
            .get(&keys::stream(key.as_str()))?
            .map(|bytes| decode_stream(key.as_str(), &bytes))
            .transpose()
    }

    /// Checks a start its caller decided (attempt 1 of a key the filter had never
    /// seen, with no attempt broken). Under the key's claim nothing else can have
    /// begun it, so anything but a new attempt 1 is a bug. A start that is not
    /// written (or not new) leaves its attempt taking no writes, and a later begin of
    /// the key takes the next number (see [`Core::stream_begin`]).
    fn decided_by_caller(&mut self, key: StreamKey, result: Result<StreamBegin, Error>) {
        match result {
            Ok(StreamBegin::New { attempt: 1, .. }) => return,
            Ok(other) => {
                tracing::error!(%key, found = ?other, "a stream begun as new was not new; it goes on unjournaled");
            }
            Err(e) => {
                tracing::warn!(%key, error = %e, "could not journal the start of a stream; it goes on unjournaled");
            }
        }
        self.break_attempt(key, 1);
    }

    /// Refuses more writes to an attempt (see [`Core::check_intact`]). Past
    /// [`MAX_OPEN_STREAMS`] broken attempts the oldest is forgotten (its stream has
    /// most likely ended long ago); the others stay refused.
    fn break_attempt(&mut self, key: StreamKey, attempt: u32) {
        let id = (key, attempt);
        if !self.broken.contains(&id) {
            while self.broken_order.len() >= MAX_OPEN_STREAMS {
                if let Some(oldest) = self.broken_order.pop_front() {
                    self.broken.remove(&oldest);
                }
            }
            self.broken.insert(id.clone());
            self.broken_order.push_back(id);
        }
        self.shared
            .broken_attempts
            .store(self.broken.len(), Ordering::Release);
    }

    /// Writes a new version of a record and its log entry.
    pub(crate) fn write_record(
        &mut self,
        batch: &mut Batch,
        mut rec: Record,
        previous: Option<&Record>,
    ) -> Result<Record, Error> {
        let key = rec.key.as_str().to_owned();
        self.remember(Known::Record, &key);
        // The batch's log entry is appended at commit, right after the current head.
        rec.log_seq = self.head.seq + 1;
        let bytes = encode_into("a record", &rec, Vec::with_capacity(RECORD_CAPACITY))?;
        let digest = chain::sha256(&bytes);
        // A new record gets a slot and an index entry pointing at it; a stored one is
        // rewritten in its slot.
        let stored = match previous {
            Some(_) => self.slot(batch, &rec.key)?,
            None => None,
        };
        let slot = stored.unwrap_or(self.next_slot);
        let body_key = keys::body(slot);
        // Nothing below can fail: the batch never holds half of a record's writes.
        if stored.is_none() {
            self.next_slot += 1;
            batch.set(slots::index_key(&key, slot), Some(keys::pointer(slot)));
        }
        if previous.is_none() {
            // The task index key embeds the slot and the key: it is new.
            if let Some(task) = &rec.task_id {
                batch.set(keys::task(task.as_str(), slot, &key), Some(Vec::new()));
            }
            let due = rec.created_at.saturating_add(self.options.retention);
            batch.expire_later(keys::EXPIRE_RECORD, due, key.clone());
        }
        // An in-flight version is replaced when the call ends: sled need not have it.
        if rec.state.in_flight() {
            batch.hold(body_key, bytes);
        } else {
            batch.set(body_key, Some(bytes));
        }
        batch.slots.insert(rec.key.clone(), slot);
        batch.changes.push((key, rec.state.as_str(), digest));
        batch.delta(previous.map(|p| p.state), Some(rec.state));
        batch.records.insert(rec.key.clone(), Some(rec.clone()));
        batch.records_written += 1;
        batch.needs_flush = true;
        Ok(rec)
    }

    /// Forgets a tombstone: the record and its index go, a `purge` entry stays in the
    /// log so that verification knows the deletion was retention, not tampering.
    fn purge(&mut self, batch: &mut Batch, rec: &Record) -> Result<(), Error> {
        let key = rec.key.as_str();
        let mut removed = Vec::with_capacity(3);
        if let Some(slot) = self.slot(batch, &rec.key)? {
            removed.push(slots::index_key(key, slot));
            removed.push(keys::body(slot));
            if let Some(task) = &rec.task_id {
                removed.push(keys::task(task.as_str(), slot, key));
            }
        }
        for k in removed {
            batch.set(k, None);
        }
        batch
            .changes
            .push((key.to_owned(), PURGE, chain::sha256(b"")));
        batch.delta(Some(rec.state), None);
        batch.records.insert(rec.key.clone(), None);
        batch.needs_flush = true;
        Ok(())
    }

    pub(crate) fn handle(&mut self, cmd: Command, batch: &mut Batch) {
        batch.commands += 1;
        let now = SystemTime::now();
        match cmd {
            Command::Begin { intent, reply } => {
                let result = self.begin(*intent, now, batch);
                settle(batch, reply, result, false);
            }
            Command::Apply { key, event, reply } => {
                let result = self.apply(&key, *event, now, batch);
                settle(batch, reply, result, false);
            }
            Command::Read { key, reply } => {
                let result = self.record(batch, &key);
                settle(batch, reply, result, false);
            }
            Command::StreamBegin {
                key,
                request,
                tag,
                claim,
                reply,
            } => {
                batch.claims.push(claim);
                let result = self
                    .write_run(&key, batch)
                    .and_then(|()| self.stream_begin(&key, *request, tag, now, batch));
                let Some(reply) = reply else {
                    self.decided_by_caller(key, result);
                    return;
                };
                match result {
                    // A new generation is answered before its start is even applied:
                    // the decision is made (every later command sees it), and the
                    // agent's first byte should not wait for sled's inserts. Losing
                    // the start in a crash loses nothing the agent was given (the
                    // first durable event flushes it too), and a generation cut by a
                    // restart is never resumed anyway: the retry starts a fresh one.
                    // If the batch fails, the stream's later writes fail too and it
                    // goes on unjournaled, as it would had the start failed.
                    Ok(begin @ StreamBegin::New { .. }) => {
                        let _ = reply.send(Ok(begin));
                        batch.answered_early = true;
                    }
                    // An existing stream is read by its caller: answered once applied.
                    other => settle(batch, reply, other, true),
                }
            }
            Command::StreamAppend {
                key,
                attempt,
                seq,
                events,
                durable,
                buffered,
                reply,
            } => {
                let result = if buffered && !durable {
                    batch.held_appends += 1;
                    self.hold(key, attempt, seq, events, batch)
                } else {
                    self.write_run(&key, batch).and_then(|()| {
                        self.stream_append(&key, attempt, seq, &events, durable, batch)
                    })
                };
                settle(batch, reply, result, !durable);
            }
            Command::StreamEnd {
                key,
                attempt,
                end,
                reply,
            } => {
                let result = self
                    .write_run(&key, batch)
                    .and_then(|()| self.stream_end(&key, attempt, end, now, batch));
                settle(batch, reply, result, false);
            }
            Command::KvPut {
                namespace,
                key,
                value,
                reply,
            } => {
                batch.set(keys::kv(&namespace, &key), value);
                batch.kv_writes += 1;
                settle(batch, reply, Ok(()), true);
            }
            Command::Reap { now, reply } => {
                let result = self.reap(now, batch);
                settle(batch, reply, result, false);
            }
        }
    }

    fn begin(
        &mut self,
        intent: crate::record::Intent,
        now: SystemTime,
        batch: &mut Batch,
    ) -> Result<Begin, Error> {
        let key = intent.key.clone();
        let current = self.record(batch, &key)?;
        let event = Event::Begin {
            intent: Box::new(intent),
            epoch: self.epoch(),
        };
        let (rec, effect) = state::apply(current.as_ref(), event, now)?;
        let rec = if effect.writes() {
            self.write_record(batch, rec, current.as_ref())?
        } else {
            rec
        };
        Ok(match effect {
            Effect::Execute {
                ticket,
                resend,
                dispatch_write,
            } => Begin::Execute {
                ticket,
                resend,
                dispatch_write,
            },
            Effect::Probe { ticket } => Begin::Probe { ticket },
            Effect::Replay => {
                batch.replays += 1;
                Begin::Replay(rec)
            }
            Effect::InFlight => Begin::InFlight { record: rec },
            Effect::Mismatch => Begin::Mismatch { record: rec },
            Effect::OutcomeUnknown => Begin::OutcomeUnknown { record: rec },
            Effect::Tombstoned => Begin::Tombstoned { record: rec },
            Effect::Recorded | Effect::Unchanged => {
                return Err(Error::Invalid {
                    what: "state machine answer",
                    detail: format!("a request for {key} produced no decision"),
                });
            }
        })
    }

    fn apply(
        &mut self,
        key: &IdempotencyKey,
        event: Event,
        now: SystemTime,
        batch: &mut Batch,
    ) -> Result<(Record, Effect), Error> {
        let current = self.record(batch, key)?;
        let (rec, effect) = state::apply(current.as_ref(), event, now)?;
        let rec = if effect.writes() {
            self.write_record(batch, rec, current.as_ref())?
        } else {
            rec
        };
        Ok((rec, effect))
    }

    fn stream_begin(
        &mut self,
        key: &StreamKey,
        request: StreamRequest,
        tag: u32,
        now: SystemTime,
        batch: &mut Batch,
    ) -> Result<StreamBegin, Error> {
        let now = Timestamp::from_system(now);
        let current = self.stream(batch, key)?;
        let mut meta = match current {
            Some(meta) if meta.request.fingerprint != request.fingerprint => {
                return Ok(StreamBegin::Mismatch { meta });
            }
            Some(meta) if matches!(meta.state, StreamState::Open | StreamState::Completed) => {
                return Ok(StreamBegin::Existing {
                    meta: self.with_last_seq(meta)?,
                });
            }
            Some(mut meta) => {
                meta.attempt = next_attempt(&meta.key, meta.attempt)?;
                meta.state = StreamState::Open;
                meta.end = None;
                meta.epoch = self.epoch();
                meta.updated_at = now;
                meta.request = request;
                meta
            }
            None => {
                let due = now.saturating_add(self.options.stream_retention);
                batch.expire_later(keys::DROP_STREAM, due, key.as_str().to_owned());
                let events_slot = self.next_events_slot;
                self.next_events_slot += 1;
                StreamMeta {
                    v: crate::record::RECORD_VERSION,
                    key: key.clone(),
                    request,
                    attempt: 1,
                    state: StreamState::Open,
                    epoch: self.epoch(),
                    created_at: now,
                    updated_at: now,
                    end: None,
                    last_seq: None,
                    events_slot: Some(events_slot),
                    expired_through: None,
                    tags: Vec::new(),
                }
            }
        };
        // An attempt lost to a failed write may still be generating, unjournaled:
        // the new one gets a number of its own, so that their events never mix.
        while !self.broken.is_empty() && self.broken.contains(&(key.clone(), meta.attempt)) {
            meta.attempt = next_attempt(key, meta.attempt)?;
        }
        let attempt = meta.attempt;
        meta.set_tag(attempt, tag);
        self.write_stream(batch, meta, false)?;
        // Its caller was told before the batch is written (see `StreamBegin`).
        batch.runs_written.push((key.clone(), attempt));
        Ok(StreamBegin::New { attempt, tag })
    }

    fn with_last_seq(&self, mut meta: StreamMeta) -> Result<StreamMeta, Error> {
        meta.last_seq = crate::audit::last_seq(&self.store, meta.events_at(), meta.attempt)?;
        Ok(meta)
    }

    pub(crate) fn write_stream(
        &mut self,
        batch: &mut Batch,
        mut meta: StreamMeta,
        durable: bool,
    ) -> Result<(), Error> {
        meta.last_seq = None;
        let bytes = encode("stream metadata", &meta)?;
        let stream_key = keys::stream(meta.key.as_str());
        self.remember(Known::Stream, meta.key.as_str());
        batch.set(stream_key, Some(bytes));
        batch.streams.insert(meta.key.clone(), Some(meta));
        if durable {
            batch.needs_flush = true;
        }
        Ok(())
    }

    /// The state of `attempt` of an existing stream, which must be its current one,
    /// and the slot its events go to (`None`: under its key).
    fn open_stream_state(
        &self,
        batch: &Batch,
        key: &StreamKey,
        attempt: u32,
    ) -> Result<(StreamState, Option<u64>), Error> {
        if !batch.streams.contains_key(key)
            && let Some(&(current, events_slot)) = self.open_streams.get(key)
        {
            if current != attempt {
                return Err(Error::Stream {
                    key: key.to_string(),
                    detail: format!("attempt {attempt} is not current (attempt {current} is)"),
                });
            }
            return Ok((StreamState::Open, events_slot));
        }
        self.open_stream(batch, key, attempt)
            .map(|meta| (meta.state, meta.events_slot))
    }

    fn open_stream(
        &self,
        batch: &Batch,
        key: &StreamKey,
        attempt: u32,
    ) -> Result<StreamMeta, Error> {
        let meta = self.stream(batch, key)?.ok_or_else(|| Error::Stream {
            key: key.to_string(),
            detail: "unknown stream; call stream_begin first".to_owned(),
        })?;
        if meta.attempt != attempt {
            return Err(Error::Stream {
                key: key.to_string(),
                detail: format!(
                    "attempt {attempt} is not current (attempt {} is)",
                    meta.attempt
                ),
            });
        }
        Ok(meta)
    }

    fn stream_append(
        &mut self,
        key: &StreamKey,
        attempt: u32,
        seq: u64,
        events: &[Bytes],
        durable: bool,
        batch: &mut Batch,
    ) -> Result<(), Error> {
        let events_slot = self.appendable(batch, key, attempt, events)?;
        // One value for all the events of this append (see `stream::chunk`).
        let event_key = keys::event(keys::Events::of(key.as_str(), events_slot), attempt, seq);
        batch.set(event_key, Some(chunk::encode(events)));
        batch.stream_events += events.len() as u64;
        if durable {
            batch.needs_flush = true;
        }
        Ok(())
    }

    /// Refuses an append that is empty or goes to an attempt that is not open; the
    /// slot the stream's events go to.
    fn appendable(
        &self,
        batch: &Batch,
        key: &StreamKey,
        attempt: u32,
        events: &[Bytes],
    ) -> Result<Option<u64>, Error> {
        not_empty(events)?;
        self.check_intact(key, attempt)?;
        let (state, events_slot) = self.open_stream_state(batch, key, attempt)?;
        if state != StreamState::Open {
            return Err(Error::Stream {
                key: key.to_string(),
                detail: format!("attempt {attempt} has ended ({state:?})"),
            });
        }
        Ok(events_slot)
    }

    /// Refuses more of an attempt whose held events were lost.
    fn check_intact(&self, key: &StreamKey, attempt: u32) -> Result<(), Error> {
        if self.broken.contains(&(key.clone(), attempt)) {
            return Err(Error::Unavailable(format!(
                "events of stream {key} attempt {attempt} were lost to a failed journal write"
            )));
        }
        Ok(())
    }

    /// Holds lazily journaled events in the stream's [`Run`]. Nobody waits for the
    /// answer: events it refuses are lost, so their attempt takes no more (no hole).
    fn hold(
        &mut self,
        key: StreamKey,
        attempt: u32,
        seq: u64,
        events: Vec<Bytes>,
        batch: &mut Batch,
    ) -> Result<(), Error> {
        let held = self.hold_in_run(&key, attempt, seq, events, batch);
        // An empty append loses nothing, and an attempt that has ended (or was
        // replaced) takes nothing anyway; breaking it would only send every new
        // stream's start through the writer.
        if let Some(e) = held
            .as_ref()
            .err()
            .filter(|e| !matches!(e, Error::Invalid { .. } | Error::Stream { .. }))
        {
            if !self.broken.contains(&(key.clone(), attempt)) {
                tracing::warn!(%key, attempt, error = %e, "queued stream events could not be held; the attempt takes no more");
            }
            self.break_attempt(key, attempt);
        }
        held
    }

    fn hold_in_run(
        &mut self,
        key: &StreamKey,
        attempt: u32,
        seq: u64,
        events: Vec<Bytes>,
        batch: &mut Batch,
    ) -> Result<(), Error> {
        self.appendable(batch, key, attempt, &events)?;
        let follows = self.runs.get(key).is_some_and(|run| {
            run.attempt == attempt && run.first_seq + run.events.len() as u64 == seq
        });
        if !follows {
            self.write_run(key, batch)?;
        }
        let run = self.runs.entry(key.clone()).or_insert_with(|| Run {
            attempt,
            first_seq: seq,
            events: Vec::new(),
            bytes: 0,
        });
        run.bytes += events.iter().map(Bytes::len).sum::<usize>();
        run.events.extend(events);
        if run.events.len() >= RUN_EVENTS || run.bytes >= RUN_BYTES {
            self.write_run(key, batch)?;
        }
        self.dirty_since.get_or_insert_with(Instant::now);
        Ok(())
    }

    /// Writes out the events held for `key`, if any, into `batch`. Held events that
    /// cannot be written are lost, and their attempt takes no more (no hole).
    fn write_run(&mut self, key: &StreamKey, batch: &mut Batch) -> Result<(), Error> {
        let Some(run) = self.runs.remove(key) else {
            return Ok(());
        };
        let appended =
            self.stream_append(key, run.attempt, run.first_seq, &run.events, false, batch);
        if let Err(e) = &appended {
            tracing::warn!(%key, attempt = run.attempt, error = %e, events = run.events.len(), "dropping held stream events; the attempt takes no more");
            if !matches!(e, Error::Stream { .. }) {
                self.break_attempt(key.clone(), run.attempt);
            }
        }
        match appended {
            Ok(()) => {
                batch.runs_written.push((key.clone(), run.attempt));
                Ok(())
            }
            // The attempt ended, was replaced or had lost events already: these
            // events belong to nothing the journal still serves as open.
            Err(Error::Stream { .. } | Error::Unavailable(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn stream_end(
        &mut self,
        key: &StreamKey,
        attempt: u32,
        end: StreamEnd,
        now: SystemTime,
        batch: &mut Batch,
    ) -> Result<(), Error> {
        // An attempt that lost events may still end as failed or abandoned (so that
        // the key's next begin starts afresh), never as completed.
        if matches!(end, StreamEnd::Completed { .. }) {
            self.check_intact(key, attempt)?;
        }
        let mut meta = self.open_stream(batch, key, attempt)?;
        if meta.state != StreamState::Open {
            if meta.end.as_ref() == Some(&end) {
                return Ok(());
            }
            return Err(Error::Stream {
                key: key.to_string(),
                detail: format!("attempt {attempt} has already ended ({:?})", meta.state),
            });
        }
        meta.state = end.state();
        meta.end = Some(end);
        meta.updated_at = Timestamp::from_system(now);
        self.write_stream(batch, meta, true)
    }

    fn reap(&mut self, now: SystemTime, batch: &mut Batch) -> Result<ReapReport, Error> {
        let now = Timestamp::from_system(now);
        let mut report = ReapReport::default();
        let mut looked_at = 0usize;
        for entry in self
            .store
            .range(keys::EXPIRY, &keys::expiry_end(now.as_micros()))
        {
            if looked_at >= REAP_LIMIT {
                report.more = true;
                break;
            }
            let (index, value) = entry?;
            let (due, kind, due_keys) = match keys::parse_expiry_entry(&index, &value) {
                Ok(parsed) => parsed,
                Err(detail) => {
                    // Left in place: it is evidence for `journal verify`, and the
                    // keys it may name are kept rather than forgotten on a guess.
                    // Not counted against the limit: it adds nothing to the batch.
                    self.damaged_expiry(&index, &detail);
                    report.damaged += 1;
                    continue;
                }
            };
            looked_at += due_keys.len().max(1);
            // When a key of this entry that cannot be read is looked at again.
            let again = now.saturating_add(match kind {
                keys::EXPIRE_RECORD => self.options.retention,
                keys::PURGE_TOMBSTONE => self.options.tombstone_retention,
                _ => self.options.stream_retention,
            });
            let mut damage = Damage {
                kind,
                again,
                report: &mut report,
            };
            match kind {
                keys::EXPIRE_RECORD => {
                    let due = Timestamp::from_micros(due);
                    for key in &due_keys {
                        let expired = self.expire_record(key, due, now, batch, damage.report);
                        damage.pass(expired, key, batch)?;
                    }
                }
                keys::PURGE_TOMBSTONE => {
                    for key in &due_keys {
                        let Ok(id) = IdempotencyKey::new(key.as_str()) else {
                            continue;
                        };
                        let rec = match self.record(batch, &id) {
                            Ok(rec) => rec,
                            Err(e) => {
                                damage.pass(Err(e), key, batch)?;
                                continue;
                            }
                        };
                        if let Some(rec) = rec.filter(|r| r.state == State::Tombstone) {
                            self.purge(batch, &rec)?;
                            damage.report.purged += 1;
                        }
                    }
                }
                keys::DROP_STREAM => {
                    for key in &due_keys {
                        if let Ok(id) = StreamKey::new(key.as_str()) {
                            let dropped = self.drop_stream(id, now, batch, damage.report);
                            damage.pass(dropped, key, batch)?;
                        }
                    }
                }
                // `parse_expiry_entry` lets no other kind through.
                _ => {}
            }
            batch.set(index, None);
        }
        batch.needs_flush = true;
        Ok(report)
    }

    /// Logs a damaged expiry index entry the first time a sweep meets it.
    fn damaged_expiry(&mut self, index: &[u8], detail: &str) {
        if self.damaged_expiries.contains(index) {
            return;
        }
        // Bounded: past it, the entries are still counted and named by `verify`.
        if self.damaged_expiries.len() >= MAX_DAMAGED_EXPIRIES {
            return;
        }
        self.damaged_expiries.insert(index.to_vec());
        tracing::warn!(entry = %hex::encode(index), %detail, "retention passes over a damaged expiry index entry and leaves it in place; `outrigger journal verify` names it");
    }

    fn drop_stream(
        &mut self,
        id: StreamKey,
        now: Timestamp,
        batch: &mut Batch,
        report: &mut ReapReport,
    ) -> Result<(), Error> {
        let key = id.as_str().to_owned();
        match self.stream(batch, &id)? {
            Some(meta) if meta.state == StreamState::Open => {
                let again = now.saturating_add(self.options.stream_retention);
                batch.expire_later(keys::DROP_STREAM, again, key);
                report.deferred += 1;
            }
            // Retention runs from the stream's last change (its last attempt's start
            // or end, or its expiry), not its first attempt: a key retried late is
            // kept as long.
            Some(meta)
                if meta
                    .updated_at
                    .saturating_add(self.options.stream_retention)
                    > now =>
            {
                let again = meta
                    .updated_at
                    .saturating_add(self.options.stream_retention);
                batch.expire_later(keys::DROP_STREAM, again, key);
                report.deferred += 1;
            }
            Some(meta) if meta.state == StreamState::Expired => {
                batch.set(keys::stream(&key), None);
                batch.streams.insert(id, None);
                report.streams_forgotten += 1;
            }
            Some(mut meta) => {
                let events: Vec<Vec<u8>> = self
                    .store
                    .scan_prefix(&keys::events_prefix(meta.events_at()))
                    .map(|e| e.map(|(k, _)| k))
                    .collect::<Result<_, _>>()?;
                for event in events {
                    batch.set(event, None);
                }
                // The metadata stays, expired, for as long again (see
                // `StreamState::Expired`).
                meta.state = StreamState::Expired;
                meta.expired_through = Some(meta.attempt);
                meta.updated_at = now;
                let again = now.saturating_add(self.options.stream_retention);
                batch.expire_later(keys::DROP_STREAM, again, key);
                self.write_stream(batch, meta, false)?;
                report.streams_dropped += 1;
            }
            None => {}
        }
        Ok(())
    }

    /// Looks at a record whose expiry entry, due at `due`, fired.
    fn expire_record(
        &mut self,
        key: &str,
        due: Timestamp,
        now: Timestamp,
        batch: &mut Batch,
        report: &mut ReapReport,
    ) -> Result<(), Error> {
        let Ok(id) = IdempotencyKey::new(key) else {
            return Ok(());
        };
        let Some(current) = self.record(batch, &id)? else {
            return Ok(());
        };
        let expires = current.created_at.saturating_add(self.options.retention);
        if expires > now {
            // Created after the entry was due: the key was purged and used again,
            // and the new record has its own entry. Otherwise retention was raised
            // since the entry was written (across a restart): look again then.
            if current.created_at <= due {
                batch.expire_later(keys::EXPIRE_RECORD, expires, key.to_owned());
            }
            return Ok(());
        }
        let (rec, effect) = state::apply(Some(&current), Event::Expire, now.to_system())?;
        if effect.writes() {
            self.write_record(batch, rec, Some(&current))?;
            let due = now.saturating_add(self.options.tombstone_retention);
            batch.expire_later(keys::PURGE_TOMBSTONE, due, key.to_owned());
            report.tombstoned += 1;
        } else if current.state != State::Tombstone {
            let again = now.saturating_add(self.options.retention);
            batch.expire_later(keys::EXPIRE_RECORD, again, key.to_owned());
            report.deferred += 1;
        }
        Ok(())
    }

    pub(crate) fn put(&self, batch: &mut Batch, key: &[u8], value: &[u8]) {
        batch.set(key.to_vec(), Some(value.to_vec()));
    }

    /// Applies the batch and makes it durable, blocking (used at open).
    pub(crate) fn commit_blocking(&mut self, mut batch: Batch) -> Result<(), Error> {
        self.stage(&mut batch)?;
        let (mut writes, held) = batch.take_writes();
        writes.extend(held.into_iter().map(|(key, value)| (key, Some(value))));
        let wrote = !writes.is_empty();
        self.store.apply(writes)?;
        self.store.flush()?;
        self.shared.flushes.fetch_add(1, Ordering::Relaxed);
        self.count(&batch, wrote);
        Ok(())
    }

    /// Adds the batch's log entry, the new chain head and its expiry index entries
    /// to its writes.
    fn stage(&mut self, batch: &mut Batch) -> Result<(), Error> {
        let at = Timestamp::now();
        if !batch.changes.is_empty() {
            let mut head = self.head;
            let entry = head.append(at, &batch.changes);
            let entry_bytes = encode("a log entry", &entry)?;
            let head_bytes = head.encode()?;
            batch.set(keys::log(entry.seq), Some(entry_bytes));
            batch.set(keys::HEAD.to_vec(), Some(head_bytes));
            self.head = head;
        }
        let expiries = std::mem::take(&mut batch.expiries);
        for (kind, (due, due_keys)) in expiries {
            self.expiry_ids += 1;
            let id = format!("{}-{}", self.shared.epoch, self.expiry_ids);
            let value = encode("an expiry index entry", &due_keys)?;
            batch.set(keys::expiry(due.as_micros(), kind, &id), Some(value));
        }
        Ok(())
    }

    fn count(&self, batch: &Batch, wrote: bool) {
        let s = &self.shared;
        if wrote {
            s.batches.fetch_add(1, Ordering::Relaxed);
        }
        s.records_written
            .fetch_add(batch.records_written, Ordering::Relaxed);
        s.stream_events
            .fetch_add(batch.stream_events, Ordering::Relaxed);
        s.kv_writes.fetch_add(batch.kv_writes, Ordering::Relaxed);
        s.replays.fetch_add(batch.replays, Ordering::Relaxed);
        for (counter, delta) in s.states.iter().zip(batch.state_deltas) {
            counter.fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// Makes lazily applied writes durable (a no-op but for `Durability::Node`), on
    /// the writer's own thread: handing it to a blocking-pool thread costs two thread
    /// wakeups, which at low concurrency is most of the latency.
    fn flush(&self) -> Result<(), String> {
        if self.shared.fault() == Some(WriteFault::FailFlush) {
            return Err("injected write fault: the flush failed".to_owned());
        }
        self.store.flush().map_err(|e| e.to_string())?;
        self.flushed(self.logged_at_errors);
        Ok(())
    }

    /// Counts a successful flush, which made durable the batches logged up to one
    /// logged when `errors` failures had been counted. Only that shows writes work
    /// again: a flush of writes accepted before the last failure does not.
    fn flushed(&self, errors: u64) {
        self.shared.flushes.fetch_add(1, Ordering::Relaxed);
        self.shared.made_durable(errors);
    }

    /// Logs, syncs, answers and applies one batch. Its waiters are answered once the
    /// batch is durable in the write-ahead log, before sled has it: sled's inserts
    /// are half of the writer's time, and readers wait for them (see `Store::log`).
    /// Lazy waiters (whose callers read what they wrote) are answered after. When
    /// `busy`, the inserts run on the store's applier thread while the writer makes
    /// the next batch.
    pub(crate) async fn commit(&mut self, mut batch: Batch, busy: bool) {
        if batch.writes.is_empty() {
            self.count(&batch, false);
            for answer in batch
                .after_apply
                .drain(..)
                .chain(batch.after_flush.drain(..))
            {
                answer(Ok(()));
            }
            return;
        }
        let store = Arc::clone(&self.store);
        // Read before the batch is logged: a failure counted meanwhile (sled refusing
        // an earlier batch on the applier) keeps writes failing after it is durable.
        let errors = self.shared.flush_errors();
        let staged = self.stage(&mut batch).map_err(|e| e.to_string());
        let (writes, held) = batch.take_writes();
        let logged = staged.and_then(|()| {
            if self.shared.fault() == Some(WriteFault::FailApply) {
                return Err("injected write fault: the batch was refused".to_owned());
            }
            let mut logged = store.log(writes, held).map_err(|e| e.to_string())?;
            if batch.needs_flush {
                if self.shared.fault() == Some(WriteFault::FailFlush) {
                    // Dropping the unapplied batch takes its frame back.
                    return Err("injected write fault: the flush failed".to_owned());
                }
                logged.sync().map_err(|e| e.to_string())?;
            }
            Ok(logged)
        });
        let logged = match logged {
            Ok(logged) => logged,
            Err(reason) => {
                // Nothing of the batch reached sled or stays in the log.
                self.shared.flush_failed();
                self.head = batch.head_before;
                tracing::error!(%reason, "journal batch not written; failing its waiters");
                self.lose_runs(&mut batch);
                fail(batch, &reason);
                return;
            }
        };
        self.logged_at_errors = errors;
        if batch.needs_flush {
            self.flushed(errors);
            // Other streams' held events are not in this batch: they still wait for
            // the flush delay, which must go on running for them.
            if self.runs.is_empty() {
                self.dirty_since = None;
            } else {
                self.dirty_since.get_or_insert_with(Instant::now);
            }
        } else {
            self.dirty_since.get_or_insert_with(Instant::now);
        }
        // Counted before anyone is answered: a caller reads the statistics it moved.
        self.count(&batch, true);
        for answer in batch.after_flush.drain(..) {
            answer(Ok(()));
        }
        // The waiters who read what they wrote are answered once sled has it. If sled
        // cannot take it, the batch is still durable in the log (a restart applies
        // it), and the store takes no more writes.
        let after_apply = std::mem::take(&mut batch.after_apply);
        let shared = Arc::clone(&self.shared);
        let then: Then = Box::new(move |outcome| match outcome {
            Ok(()) => {
                for answer in after_apply {
                    answer(Ok(()));
                }
            }
            Err(reason) => {
                shared.flush_failed();
                for answer in after_apply {
                    answer(Err(&reason));
                }
            }
        });
        // Under load, sled's inserts run on the applier thread while the next batch
        // is made; otherwise here (waking no other thread).
        if busy {
            self.shared.handoffs.fetch_add(1, Ordering::Relaxed);
            logged.apply(Some(then));
        } else {
            // `then` has the outcome too.
            let _ = logged.apply_here(Some(then));
        }
        self.remember_in_flight(&mut batch);
        if batch.records_written > 0 {
            self.shared.commits.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Marks the streams whose start or held events a failed batch carried.
    fn lose_runs(&mut self, batch: &mut Batch) {
        for (key, attempt) in std::mem::take(&mut batch.runs_written) {
            tracing::warn!(%key, attempt, "a stream's start or held events were lost to a failed journal write; the attempt takes no more");
            self.break_attempt(key, attempt);
        }
    }

    /// After a successful commit: remembers the open streams and the in-flight
    /// records the batch wrote, and forgets those that ended.
    fn remember_in_flight(&mut self, batch: &mut Batch) {
        for (key, meta) in batch.streams.drain() {
            match meta {
                Some(meta) if meta.state == StreamState::Open => {
                    // Streams cut by a failing journal never end here; bound the map.
                    if self.open_streams.len() >= MAX_OPEN_STREAMS {
                        self.open_streams.clear();
                    }
                    self.open_streams
                        .insert(key, (meta.attempt, meta.events_slot));
                }
                _ => {
                    self.open_streams.remove(&key);
                }
            }
        }
        for (key, record) in batch.records.drain() {
            match record {
                Some(record) if record.state.in_flight() => match batch.slots.get(&key) {
                    Some(&slot) => {
                        self.hot.insert(key, Hot { record, slot });
                    }
                    None => {
                        self.hot.remove(&key);
                    }
                },
                _ => {
                    self.hot.remove(&key);
                }
            }
        }
    }

    pub(crate) fn flush_due(&self) -> Option<Instant> {
        self.dirty_since
            .map(|since| since + self.options.max_batch_delay)
    }

    /// Writes out held stream events and flushes lazy writes whose delay ran out.
    pub(crate) async fn flush_lazy(&mut self) {
        if !self.runs.is_empty() {
            let mut batch = self.new_batch();
            let keys: Vec<StreamKey> = self.runs.keys().cloned().collect();
            for key in keys {
                if let Err(e) = self.write_run(&key, &mut batch) {
                    tracing::warn!(%key, error = %e, "could not write held stream events");
                }
            }
            batch.needs_flush = true;
            self.commit(batch, false).await;
            if self.dirty_since.is_none() {
                return;
            }
        }
        match self.flush() {
            Ok(()) => self.dirty_since = None,
            Err(reason) => {
                self.shared.flush_failed();
                // Try again one delay later; the lazy writes stay applied. Not after a
                // failed sync, which nothing but a restart undoes.
                self.dirty_since = (!self.store.sync_failed()).then(Instant::now);
                tracing::warn!(%reason, "flushing lazy journal writes failed");
            }
        }
    }
}

/// What retention does with the keys of one expiry entry that cannot be read.
struct Damage<'a> {
    kind: u8,
    /// When such a key is due again: one period (of the retention that was due) on.
    again: Timestamp,
    report: &'a mut ReapReport,
}

impl Damage<'_> {
    /// Goes on past a record or stream that cannot be decoded (counted, and left as
    /// it is): one damaged entry must not stop retention for the whole journal. Its
    /// key is kept due again later, so that it is neither forgotten by retention nor
    /// looked at by every sweep.
    fn pass(&mut self, r: Result<(), Error>, key: &str, batch: &mut Batch) -> Result<(), Error> {
        match r {
            Err(e @ Error::Decode { .. }) => {
                tracing::warn!(%key, error = %e, "retention passes over an entry it cannot read and looks again a retention period later; `outrigger journal verify` names it");
                self.report.damaged += 1;
                batch.expire_later(self.kind, self.again, key.to_owned());
                Ok(())
            }
            other => other,
        }
    }
}

/// Refuses an append of no events.
fn not_empty(events: &[Bytes]) -> Result<(), Error> {
    if events.is_empty() {
        return Err(Error::Invalid {
            what: "stream events",
            detail: "an append needs at least one event".to_owned(),
        });
    }
    Ok(())
}

fn settle<T: Send + 'static>(
    batch: &mut Batch,
    reply: Reply<T>,
    result: Result<T, Error>,
    lazy: bool,
) {
    match result {
        Ok(value) if lazy => batch.after_apply.push(pending(reply, value)),
        Ok(value) => batch.after_flush.push(pending(reply, value)),
        // Refusals depend on nothing unflushed being kept; answer at once.
        Err(e) => {
            let _ = reply.send(Err(e));
        }
    }
}

fn fail(mut batch: Batch, reason: &str) {
    for answer in batch
        .after_apply
        .drain(..)
        .chain(batch.after_flush.drain(..))
    {
        answer(Err(reason));
    }
}

/// The single writer task. [`Writer::run`] blocks the thread it runs on for the
/// length of each flush (which every waiter of the batch waits for anyway), so the
/// application gives it a thread of its own, or a multi-threaded runtime; it ends,
/// after a final flush, when every [`crate::Journal`] handle is dropped.
pub struct Writer {
    pub(crate) rx: mpsc::Receiver<Command>,
    pub(crate) core: Core,
    pub(crate) max_batch: usize,
}

impl Writer {
    pub async fn run(mut self) {
        loop {
            let first = match self.core.flush_due() {
                Some(due) => tokio::select! {
                    cmd = self.rx.recv() => cmd,
                    () = tokio::time::sleep_until(due) => {
                        self.core.flush_lazy().await;
                        continue;
                    }
                },
                None => self.rx.recv().await,
            };
            let Some(first) = first else { break };
            // Let the tasks that are ready run first: what they send joins this batch
            // (on one worker thread, the writer would otherwise run after every sender).
            // Queued text deltas share no commit (they are held in memory), so they
            // are taken at once.
            if !matches!(first, Command::StreamAppend { buffered: true, .. }) {
                tokio::task::yield_now().await;
            }
            let mut batch = self.core.new_batch();
            self.core.handle(first, &mut batch);
            while batch.commands < self.max_batch {
                match self.rx.try_recv() {
                    Ok(cmd) => self.core.handle(cmd, &mut batch),
                    Err(_) => break,
                }
            }
            if batch.answered_early {
                // Let the caller answered early go on (a woken task runs after the
                // writer on this thread, so it would otherwise wait for the commit).
                tokio::task::yield_now().await;
            }
            // A batch of several commands means others are asking too: more will
            // come while this one is applied, so sled's inserts go to the applier.
            // Queued text deltas do not count: a lone stream sends its held deltas
            // just before its end, and waking the applier for that one stream costs
            // more than the inserts it would take off this thread.
            let busy = batch.commands - batch.held_appends > 1;
            self.core.commit(batch, busy).await;
        }
        if self.core.dirty_since.is_some() {
            self.core.flush_lazy().await;
        }
    }
}

/// The attempt after `attempt` of `key`'s stream.
fn next_attempt(key: &StreamKey, attempt: u32) -> Result<u32, Error> {
    attempt.checked_add(1).ok_or_else(|| Error::Stream {
        key: key.to_string(),
        detail: format!("it has had {attempt} attempts, the most there can be"),
    })
}

#[cfg(test)]
mod tests {
    use std::error::Error as StdError;

    use outrigger_types::{Fingerprint, RequestId};

    use super::*;
    use crate::Journal;

    type TestResult = Result<(), Box<dyn StdError>>;

    /// A journal whose writer the test runs by hand, one commit at a time, so that it
    /// can change the store between commits.
    struct Driven {
        journal: Journal,
        writer: Writer,
        _dir: tempfile::TempDir,
    }

    impl Driven {
        fn open() -> Result<Self, Box<dyn StdError>> {
            let dir = tempfile::tempdir()?;
            let (journal, writer, _) = Journal::open(Options::new(dir.path()))?;
            Ok(Self {
                journal,
                writer,
                _dir: dir,
            })
        }
    }

    /// Waits for a command, takes every other one queued, and commits them as one
    /// batch.
    async fn commit(writer: &mut Writer) {
        let Some(first) = writer.rx.recv().await else {
            return;
        };
        let mut batch = writer.core.new_batch();
        writer.core.handle(first, &mut batch);
        while let Ok(cmd) = writer.rx.try_recv() {
            writer.core.handle(cmd, &mut batch);
        }
        writer.core.commit(batch, false).await;
    }

    fn request() -> StreamRequest {
        StreamRequest {
            fingerprint: Fingerprint([5; 32]),
            task_id: None,
            request_id: RequestId::from_generated("req-driven".to_owned()),
            provider: "anthropic".to_owned(),
            model: "claude".to_owned(),
            policy_versions: Vec::new(),
        }
    }

    fn event(seq: u64) -> Bytes {
        Bytes::from(format!("data: {{\"seq\":{seq}}}\n\n"))
    }

    fn completed() -> StreamEnd {
        StreamEnd::Completed {
            usage: serde_json::json!({}),
            continued: 0,
        }
    }

    /// Makes the stream's metadata unreadable (the writer then reads it from the
    /// store, and fails), and returns what to put back.
    fn damage_meta(core: &mut Core, key: &StreamKey) -> Result<Vec<u8>, Box<dyn StdError>> {
        let meta_key = keys::stream(key.as_str());
        let meta = core.store.get(&meta_key)?.ok_or("no stream metadata")?;
        core.store.raw_put(&meta_key, b"not json")?;
        core.open_streams.clear();
        Ok(meta)
    }

    /// Begins `key` with event 0 durable.
    async fn begun(j: &Journal, w: &mut Writer, key: &StreamKey) -> TestResult {
        let begun = j.stream_begin(key, request()).await?;
        assert!(
            matches!(begun, StreamBegin::New { attempt: 1, .. }),
            "{begun:?}"
        );
        let (appended, ()) =
            tokio::join!(j.stream_append(key, 1, 0, vec![event(0)], true), commit(w));
        appended?;
        Ok(())
    }

    #[tokio::test]
    async fn queued_events_the_writer_refuses_break_their_attempt() -> TestResult {
        let mut driven = Driven::open()?;
        let Driven {
            journal: j,
            writer: w,
            ..
        } = &mut driven;
        let key = StreamKey::new("chat-refused")?;
        begun(j, w, &key).await?;
        let meta = damage_meta(&mut w.core, &key)?;
        // Nobody waits for this answer: the event is refused, and lost.
        j.stream_append_nowait(&key, 1, 1, vec![event(1)]).await?;
        commit(w).await;
        w.core.store.raw_put(&keys::stream(key.as_str()), &meta)?;
        // The attempt lost event 1: it takes nothing more and never completes.
        j.stream_append_nowait(&key, 1, 2, vec![event(2)]).await?;
        commit(w).await;
        let (end, ()) = tokio::join!(j.stream_end(&key, 1, completed()), commit(w));
        assert!(matches!(end, Err(Error::Unavailable(_))), "{end:?}");
        assert_eq!(j.stream_events(&key, 1, None)?, vec![(0, event(0))]);
        Ok(())
    }

    #[tokio::test]
    async fn held_events_that_cannot_be_written_out_break_their_attempt() -> TestResult {
        let mut driven = Driven::open()?;
        let Driven {
            journal: j,
            writer: w,
            ..
        } = &mut driven;
        let key = StreamKey::new("chat-dropped")?;
        begun(j, w, &key).await?;
        j.stream_append_nowait(&key, 1, 1, vec![event(1)]).await?;
        commit(w).await;
        assert_eq!(w.core.runs.get(&key).map(|r| r.events.len()), Some(1));
        // The next awaited append writes the held event out first, and that fails.
        let meta = damage_meta(&mut w.core, &key)?;
        let (failed, ()) =
            tokio::join!(j.stream_append(&key, 1, 2, vec![event(2)], true), commit(w));
        assert!(matches!(failed, Err(Error::Decode { .. })), "{failed:?}");
        w.core.store.raw_put(&keys::stream(key.as_str()), &meta)?;
        // Event 1 is gone: appending event 2 again must not leave a hole before it.
        let (again, ()) =
            tokio::join!(j.stream_append(&key, 1, 2, vec![event(2)], true), commit(w));
        assert!(matches!(again, Err(Error::Unavailable(_))), "{again:?}");
        let (end, ()) = tokio::join!(j.stream_end(&key, 1, completed()), commit(w));
        assert!(matches!(end, Err(Error::Unavailable(_))), "{end:?}");
        assert_eq!(j.stream_events(&key, 1, None)?, vec![(0, event(0))]);
        Ok(())
    }

    /// Writes are failing after a failed commit until a write made after it is
    /// durable: flushing what was accepted before the failure shows nothing.
    #[tokio::test]
    async fn writes_stay_failing_until_a_write_made_after_the_failure_is_durable() -> TestResult {
        let mut driven = Driven::open()?;
        let Driven {
            journal: j,
            writer: w,
            ..
        } = &mut driven;
        // A lazy write, logged and not yet flushed.
        let (put, ()) = tokio::join!(j.kv_put("ns", "before", b"1".to_vec()), commit(w));
        put?;
        assert!(
            w.core.flush_due().is_some(),
            "the lazy write waits for a flush"
        );
        for fault in [WriteFault::FailApply, WriteFault::FailFlush] {
            j.set_write_fault(Some(fault));
            let (refused, ()) =
                tokio::join!(j.begin(crate::tamper_tests::intent("k1")?), commit(w));
            assert!(matches!(refused, Err(Error::Unavailable(_))), "{refused:?}");
            assert!(j.writes_failing(), "{fault:?}");
        }
        // The disk still refuses batches; the flush of the earlier lazy write works.
        j.set_write_fault(Some(WriteFault::FailApply));
        let flushes = j.stats().flushes;
        w.core.flush_lazy().await;
        assert_eq!(j.stats().flushes, flushes + 1, "the flush succeeded");
        assert!(
            j.writes_failing(),
            "a flush of writes from before the failure"
        );
        j.set_write_fault(None);
        // A write made after the failure is accepted: not durable yet.
        let (put, ()) = tokio::join!(j.kv_put("ns", "after", b"2".to_vec()), commit(w));
        put?;
        assert!(j.writes_failing(), "an accepted write is not a durable one");
        w.core.flush_lazy().await;
        assert!(!j.writes_failing(), "{:?}", j.stats());
        // A durable write made after a failure shows it at once.
        j.set_write_fault(Some(WriteFault::FailFlush));
        let (refused, ()) = tokio::join!(j.begin(crate::tamper_tests::intent("k2")?), commit(w));
        assert!(refused.is_err() && j.writes_failing(), "{refused:?}");
        j.set_write_fault(None);
        let (begun, ()) = tokio::join!(j.begin(crate::tamper_tests::intent("k2")?), commit(w));
        assert!(matches!(begun, Ok(Begin::Execute { .. })), "{begun:?}");
        assert!(!j.writes_failing());
        assert_eq!(j.stats().flush_errors, 3);
        Ok(())
    }

    /// sled panicking while it takes a batch is a failed write like any other: counted,
    /// and the journal reports writes failing (the store takes no more until a
    /// restart).
    #[tokio::test]
    async fn a_panic_while_sled_takes_a_batch_counts_as_a_flush_error() -> TestResult {
        let mut driven = Driven::open()?;
        let Driven {
            journal: j,
            writer: w,
            ..
        } = &mut driven;
        w.core.store.panic_next_apply();
        let (put, ()) = tokio::join!(j.kv_put("ns", "k", b"1".to_vec()), commit(w));
        assert!(matches!(put, Err(Error::Unavailable(_))), "{put:?}");
        assert_eq!(j.stats().flush_errors, 1);
        assert!(j.writes_failing());
        let (refused, ()) = tokio::join!(j.begin(crate::tamper_tests::intent("k1")?), commit(w));
        assert!(matches!(refused, Err(Error::Unavailable(_))), "{refused:?}");
        assert!(j.writes_failing());
        Ok(())
    }

    /// Counts the WARN events on the test's thread whose message holds `needle`.
    struct Warnings {
        needle: &'static str,
        seen: Arc<std::sync::atomic::AtomicUsize>,
    }

    struct Message(String);

    impl tracing::field::Visit for Message {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl tracing::Subscriber for Warnings {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            let mut message = Message(String::new());
            event.record(&mut message);
            if *event.metadata().level() == tracing::Level::WARN && message.0.contains(self.needle)
            {
                self.seen.fetch_add(1, Ordering::SeqCst);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// An expiry index entry retention cannot parse is evidence: left in place,
    /// counted as damaged at every sweep, logged once, and named by `verify`.
    #[tokio::test]
    async fn a_damaged_expiry_entry_is_left_in_place_counted_and_named() -> TestResult {
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let _logs = tracing::subscriber::set_default(Warnings {
            needle: "damaged expiry index entry",
            seen: Arc::clone(&seen),
        });
        let mut driven = Driven::open()?;
        let Driven {
            journal: j,
            writer: w,
            ..
        } = &mut driven;
        let damaged = [
            // A key cut short: no due time, no kind.
            (b"x/\x00".to_vec(), b"[\"k1\"]".to_vec()),
            // A value that is no list of keys.
            (
                keys::expiry(1, keys::EXPIRE_RECORD, "0-a"),
                b"not json".to_vec(),
            ),
            // A kind the journal never writes.
            (keys::expiry(1, b'z', "0-b"), b"[\"k1\"]".to_vec()),
        ];
        for (key, value) in &damaged {
            w.core.store.raw_put(key, value)?;
        }
        // A whole entry beside them, naming a key never written: processed, and gone.
        let whole = keys::expiry(1, keys::EXPIRE_RECORD, "0-c");
        w.core.store.raw_put(&whole, b"[\"k-none\"]")?;
        for sweep in 0..2 {
            let (report, ()) = tokio::join!(j.reap(SystemTime::now()), commit(w));
            let report = report?;
            assert_eq!(report.damaged, 3, "sweep {sweep}: {report:?}");
            assert!(!report.more, "sweep {sweep}: {report:?}");
            for (key, value) in &damaged {
                assert_eq!(
                    w.core.store.get(key)?.as_ref(),
                    Some(value),
                    "sweep {sweep}: {}",
                    hex::encode(key)
                );
            }
            assert_eq!(w.core.store.get(&whole)?, None, "sweep {sweep}");
        }
        assert_eq!(seen.load(Ordering::SeqCst), 3, "each is logged once");
        let report = j.verify()?;
        let named: Vec<serde_json::Value> = report
            .problems
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<_, _>>()?;
        assert_eq!(named.len(), 3, "{named:?}");
        for (problem, (key, _)) in named.iter().zip(&damaged) {
            assert_eq!(problem["problem"], "damaged_expiry_entry", "{problem}");
            assert_eq!(problem["entry"], hex::encode(key), "{problem}");
        }
        Ok(())
    }

    #[tokio::test]
    async fn past_the_bound_the_oldest_broken_attempt_is_forgotten_first() -> TestResult {
        let mut driven = Driven::open()?;
        let core = &mut driven.writer.core;
        let key = |i: usize| StreamKey::new(format!("chat-{i}"));
        for i in 0..=MAX_OPEN_STREAMS {
            core.break_attempt(key(i)?, 1);
        }
        assert_eq!(core.broken.len(), MAX_OPEN_STREAMS);
        assert!(
            core.check_intact(&key(0)?, 1).is_ok(),
            "the oldest is forgotten"
        );
        for i in [1, MAX_OPEN_STREAMS / 2, MAX_OPEN_STREAMS] {
            assert!(
                core.check_intact(&key(i)?, 1).is_err(),
                "attempt {i} forgotten"
            );
        }
        // Breaking one again does not count twice.
        core.break_attempt(key(1)?, 1);
        assert_eq!(core.broken.len(), MAX_OPEN_STREAMS);
        assert!(core.check_intact(&key(1)?, 1).is_err());
        Ok(())
    }
}
