use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use outrigger_types::{IdempotencyKey, TaskId};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use crate::Error;
use crate::audit::{Audit, Reader, check_namespace};
use crate::chain::{Head, LogEntry, VerifyReport};
use crate::claims::Claims;
use crate::options::Options;
use crate::record::{
    Begin, Filter, Intent, Record, Resolution, State, StoredResponse, Ticket, TimelineEntry,
};
use crate::slots;
use crate::state::{self, Effect, Event};
use crate::stats::{Shared, Stats, WriteFault};
use crate::store::{Store, keys};
use crate::stream::{StreamBegin, StreamEnd, StreamKey, StreamMeta, StreamRequest, StreamState};
use crate::time::Timestamp;
use crate::writer::{
    Command, Core, Known, KnownKeys, ReapReport, Writer, decode_record, decode_stream,
};

/// The on-disk format this build writes: records in slots, found through an index
/// in generations ([`crate::slots`]), their bytes in files of their own
/// ([`crate::bodies`]), each new stream's events in a slot of their own
/// ([`keys::Events`]), a task's records indexed by slot ([`keys::TASKS`]), and
/// streams past retention kept as `expired` metadata ([`StreamState::Expired`]),
/// each stream attempt with a tag of its own ([`StreamMeta::tags`]).
const FORMAT: &[u8] = b"8";
/// Format 7: a stream's attempts had no tags ([`StreamMeta::tags`]): their event
/// ids name the attempt's number alone. Read as it is.
const FORMAT_7: &[u8] = b"7";
/// Format 6: a stream past retention was deleted whole. Read as it is.
const FORMAT_6: &[u8] = b"6";
/// Format 5: the task index by creation time ([`keys::TASKS_BY_TIME`]). Still read
/// as it is by an audit; opening it moves the task index.
const FORMAT_5: &[u8] = b"5";
/// Format 4: record bodies stored in sled. Still read; each record moves to a file
/// when next written.
const FORMAT_4: &[u8] = b"4";
/// Format 3: the record index by key alone. Opening it moves the index to
/// generations.
const FORMAT_3: &[u8] = b"3";
/// Format 2: stream events stored under the stream's key. Still read; its streams
/// keep that layout (their metadata names no slot), new streams get slots.
const FORMAT_2: &[u8] = b"2";
/// Format 1: each record stored under its key; opening it moves each record to a
/// slot. Opening an older journal marks it format 8, so that an older build refuses
/// it rather than misread it.
const FORMAT_1: &[u8] = b"1";
/// Every format this build reads.
const READABLE: [&[u8]; 8] = [
    FORMAT, FORMAT_7, FORMAT_6, FORMAT_5, FORMAT_4, FORMAT_3, FORMAT_2, FORMAT_1,
];

/// The format the journal in `dir` is marked with (`None`: a new journal), or an
/// error if this build cannot read it (a newer build wrote it).
pub(crate) fn stored_format(store: &Store, dir: &Path) -> Result<Option<Vec<u8>>, Error> {
    match store.get(keys::FORMAT)? {
        Some(format) if !READABLE.contains(&format.as_slice()) => Err(Error::Invalid {
            what: "journal format",
            detail: format!(
                "{} holds journal format {:?}, which this build does not know (it reads \
                 formats 1 to 8; a newer build of outrigger wrote it?): use the build that \
                 wrote it",
                dir.display(),
                String::from_utf8_lossy(&format)
            ),
        }),
        other => Ok(other),
    }
}

/// What opening the journal found and did: the calls a previous process left in
/// flight, by the state they were moved to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// This process's epoch (one more than the previous process's).
    pub epoch: u64,
    pub records: u64,
    /// Claimed but never dispatched: provably not sent; the next request executes.
    pub failed_before_send: Vec<IdempotencyKey>,
    /// Dispatched with no outcome, for tools that may be re-sent or probed.
    pub in_doubt: Vec<IdempotencyKey>,
    /// Dispatched with no outcome, for unsafe tools: an operator decides.
    pub needs_operator: Vec<IdempotencyKey>,
    /// Model streams that were open: their attempts are abandoned.
    pub abandoned_streams: Vec<StreamKey>,
    /// Records that could not be decoded, or whose bytes could not be read from their
    /// record file (left untouched; `verify` names them). A request for such a key is
    /// refused with an error, never executed.
    pub undecodable: Vec<String>,
}

/// A cloneable handle on the journal. Mutations go to the single [`Writer`] task;
/// reads go straight to the store.
#[derive(Clone)]
pub struct Journal {
    inner: Arc<Inner>,
}

struct Inner {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    reader: Reader,
    /// The stream keys whose begin is in progress (see [`crate::claims`]).
    claims: Arc<Claims>,
    /// The keys that may be in the store (the writer's filter).
    known: Arc<KnownKeys>,
}

impl Journal {
    /// Opens (or creates) the journal, starts a new epoch and recovers what the
    /// previous process left in flight. The caller spawns `writer.run()`.
    pub fn open(options: Options) -> Result<(Journal, Writer, Recovery), Error> {
        options.validate()?;
        let store = Arc::new(Store::open(
            &options.dir,
            options.cache_capacity_bytes,
            options.durability,
            true,
        )?);
        // The current format too: a move cut short by a crash is finished.
        if let Some(format) = stored_format(&store, &options.dir)? {
            let moved = slots::migrate(&store, FORMAT)?;
            if moved > 0 {
                tracing::info!(
                    from = %String::from_utf8_lossy(&format),
                    index_entries = moved,
                    "journal moved to format 8 (its record index in generations)"
                );
            }
            let moved = slots::migrate_tasks(&store, FORMAT)?;
            if moved > 0 {
                tracing::info!(
                    from = %String::from_utf8_lossy(&format),
                    task_entries = moved,
                    "journal moved to format 8 (its task index by slot)"
                );
            }
        }
        let previous_epoch = match store.get(keys::EPOCH)? {
            Some(bytes) => {
                u64::from_be_bytes(bytes.as_slice().try_into().map_err(|_| Error::Decode {
                    what: "the journal epoch".to_owned(),
                    detail: format!("{} bytes, expected 8", bytes.len()),
                })?)
            }
            None => 0,
        };
        let epoch = previous_epoch.checked_add(1).ok_or_else(|| Error::Decode {
            what: "the journal epoch".to_owned(),
            detail: "it is the largest there is".to_owned(),
        })?;
        let head = load_head(&store)?;
        let shared = Arc::new(Shared::new(epoch, [0; 8]));
        let mut core = Core::new(
            Arc::clone(&store),
            Arc::clone(&shared),
            options.clone(),
            head,
        )?;
        let (recovery, counts) = recover(&store, &mut core, epoch)?;
        for (counter, count) in shared.states.iter().zip(counts) {
            counter.fetch_add(count, std::sync::atomic::Ordering::Relaxed);
        }
        let (tx, rx) = mpsc::channel(options.max_batch.saturating_mul(4).max(256));
        let journal = Journal {
            inner: Arc::new(Inner {
                tx,
                shared,
                reader: Reader { store },
                claims: Arc::default(),
                known: core.known(),
            }),
        };
        let writer = Writer {
            rx,
            core,
            max_batch: options.max_batch,
        };
        Ok((journal, writer, recovery))
    }

    /// Opens a journal for reading, without changing it: a private copy of `dir` in
    /// the system's temporary directory is read (see [`Audit`]). `Error::Locked` if a
    /// process holds it (read through the admin API instead), `Error::NotFound` if
    /// `dir` holds no journal.
    pub fn open_for_audit(dir: &Path) -> Result<Audit, Error> {
        Audit::open(dir)
    }

    /// Moves a journal aside (`<dir>.corrupt-<unix seconds>`) so that the next open
    /// starts a fresh one; returns the new name. Nothing inside it is changed. The
    /// calls it knew are then unknown to the new journal (a retry of one executes
    /// again): an operator reviews the moved one. `Error::Locked` while a process
    /// holds it; the lock is held while it moves, so no sidecar opens it midway.
    pub fn quarantine(dir: &Path) -> Result<PathBuf, Error> {
        // Written as given (`journal/`, `journal/.`), the new name would be inside
        // the directory itself; without its trailing separators and `.` parts it
        // has a name to put the suffix on, beside it.
        let dir: PathBuf = dir.components().collect();
        let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
            return Err(Error::Invalid {
                what: "journal directory",
                detail: format!(
                    "{} names no directory to move aside (it ends in `..`, or is `.` or \
                     the root): give the journal directory by its name, e.g. \
                     `--journal-dir ./data/journal`",
                    dir.display()
                ),
            });
        };
        // A journal sled cannot open may lack one of its files; with neither, `dir`
        // is no journal (a data directory given by mistake).
        if !dir.join("db").is_file() && !dir.join("conf").is_file() {
            crate::store::check_journal(&dir)?;
        }
        let _lock = dir
            .join("db")
            .is_file()
            .then(|| crate::store::take_lock(&dir))
            .transpose()?;
        let stamp = Timestamp::now().as_micros() / 1_000_000;
        let mut moved = name.to_owned();
        moved.push(format!(".corrupt-{stamp}"));
        let target = parent.join(moved);
        std::fs::rename(&dir, &target)
            .map_err(|e| Error::Storage(format!("cannot move {} aside: {e}", dir.display())))?;
        Ok(target)
    }

    pub fn epoch(&self) -> u64 {
        self.inner.shared.epoch
    }

    pub fn dir(&self) -> &Path {
        self.inner.reader.store.dir()
    }

    async fn call<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<Result<T, Error>>) -> Command,
    ) -> Result<T, Error> {
        let (reply, answer) = oneshot::channel();
        self.send(command(reply)).await?;
        answer
            .await
            .map_err(|_| Error::Unavailable("the journal writer stopped".to_owned()))?
    }

    async fn send(&self, command: Command) -> Result<(), Error> {
        self.inner
            .tx
            .send(command)
            .await
            .map_err(|_| Error::Unavailable("the journal writer is not running".to_owned()))
    }

    /// [`Journal::call`], where an answer the caller went away before receiving is
    /// handed to `unanswered` (on the runtime, after the writer has answered).
    async fn call_settled<T: Send + 'static>(
        &self,
        command: impl FnOnce(oneshot::Sender<Result<T, Error>>) -> Command,
        unanswered: impl FnOnce(T) -> Settle + Send + 'static,
    ) -> Result<T, Error> {
        let (reply, answer) = oneshot::channel();
        self.send(command(reply)).await?;
        let mut pending = Unanswered {
            answer: Some(answer),
            settle: Some(Box::new(unanswered)),
        };
        let result = match pending.answer.as_mut() {
            Some(answer) => answer.await,
            None => return Err(Error::Unavailable("the journal writer stopped".to_owned())),
        };
        // Answered: nothing is left to settle when `pending` drops.
        pending.answer = None;
        result.map_err(|_| Error::Unavailable("the journal writer stopped".to_owned()))?
    }

    async fn event(&self, key: &IdempotencyKey, event: Event) -> Result<(Record, Effect), Error> {
        self.call(|reply| Command::Apply {
            key: key.clone(),
            event: Box::new(event),
            reply,
        })
        .await
    }

    // --- tool calls ---

    /// Decides what to do with a tool request and makes the decision durable.
    ///
    /// If the caller goes away before the answer (its future is dropped), a decision
    /// it never received is settled for it: a call to execute was never sent
    /// (`failed_before_send`), and one to probe goes back in doubt, so the key is not
    /// left in flight until a restart.
    pub async fn begin(&self, intent: Intent) -> Result<Begin, Error> {
        let journal = self.clone();
        self.call_settled(
            |reply| Command::Begin {
                intent: Box::new(intent),
                reply,
            },
            move |begin: Begin| {
                Box::pin(async move {
                    if let Err(e) = journal.unanswered(&begin, UNANSWERED).await {
                        tracing::warn!(error = %e, "could not settle a call whose caller went away");
                    }
                })
            },
        )
        .await
    }

    /// Settles a decision nobody will act on (its caller went away): a call to
    /// execute was never sent (`failed_before_send`), and one to probe goes back in
    /// doubt, so that the key is not left in flight until a restart. The other
    /// decisions changed nothing to settle.
    pub async fn unanswered(&self, begin: &Begin, why: &str) -> Result<(), Error> {
        match begin {
            Begin::Execute { ticket, .. } => self.failed_before_send(ticket, why).await.map(drop),
            Begin::Probe { ticket } => self.in_doubt(ticket, why).await.map(drop),
            Begin::Replay(_)
            | Begin::InFlight { .. }
            | Begin::Mismatch { .. }
            | Begin::OutcomeUnknown { .. }
            | Begin::Tombstoned { .. } => Ok(()),
        }
    }

    /// An unsafe tool's request is about to leave: the second durable write. Until
    /// it is answered the request has not left: a caller that goes away meanwhile
    /// (while the writer's queue is full, or the flush is slow), or a write that
    /// fails, leaves the call recorded `failed_before_send` (queued behind the
    /// dispatched write if that went out: one writer takes commands in order),
    /// not in flight until a restart.
    pub async fn dispatched(&self, ticket: &Ticket) -> Result<(), Error> {
        let mut not_sent = NotSent {
            journal: Some(self.clone()),
            ticket: ticket.clone(),
            why: UNANSWERED,
        };
        let event = Event::Dispatched {
            ticket: ticket.clone(),
        };
        let r = self.event(ticket.key(), event).await.map(drop);
        match &r {
            Ok(()) => not_sent.journal = None,
            Err(_) => not_sent.why = DISPATCH_FAILED,
        }
        r
    }

    /// Records the tool's answer, durably, before the proxy releases it. Returns the
    /// state the status put the call in: `Completed` (2xx, definitive 4xx),
    /// `FailedBeforeSend` (408/409/425/429: not applied), `InDoubt` or
    /// `NeedsOperator` (5xx).
    pub async fn complete(
        &self,
        ticket: &Ticket,
        response: StoredResponse,
    ) -> Result<State, Error> {
        let event = Event::Responded {
            ticket: ticket.clone(),
            response,
        };
        self.event(ticket.key(), event)
            .await
            .map(|(rec, _)| rec.state)
    }

    /// The attempt never reached the tool (connect refused, TLS failure, breaker open).
    /// Returns the state the key rests in: `failed_before_send`, or `in_doubt` when
    /// the attempt was the re-send of one still in doubt.
    pub async fn failed_before_send(&self, ticket: &Ticket, reason: &str) -> Result<State, Error> {
        let event = Event::FailedBeforeSend {
            ticket: ticket.clone(),
            reason: reason.to_owned(),
        };
        self.event(ticket.key(), event)
            .await
            .map(|(rec, _)| rec.state)
    }

    /// The request may have reached the tool and no answer came (timeout, reset).
    /// Returns `InDoubt`, or `NeedsOperator` for unsafe tools.
    pub async fn in_doubt(&self, ticket: &Ticket, cause: &str) -> Result<State, Error> {
        let event = Event::InDoubt {
            ticket: ticket.clone(),
            cause: cause.to_owned(),
        };
        self.event(ticket.key(), event)
            .await
            .map(|(rec, _)| rec.state)
    }

    /// A probe's answer. `found`: the call took effect with this result, answered as
    /// `Begin::Replay`. `None`: it did not; the answer is `Begin::Execute` for the
    /// next attempt (already durable as dispatched).
    pub async fn reconciled(
        &self,
        ticket: &Ticket,
        found: Option<StoredResponse>,
    ) -> Result<Begin, Error> {
        let event = Event::Reconciled {
            ticket: ticket.clone(),
            found,
        };
        let (record, effect) = self.event(ticket.key(), event).await?;
        match effect {
            Effect::Execute {
                ticket,
                resend,
                dispatch_write,
            } => Ok(Begin::Execute {
                ticket,
                resend,
                dispatch_write,
            }),
            _ if record.state == State::Completed => Ok(Begin::Replay(record)),
            other => Err(Error::Invalid {
                what: "reconciliation",
                detail: format!("unexpected {other:?} for {}", record.key),
            }),
        }
    }

    /// An operator's resolution of an in-doubt call, journaled with who, when and why.
    pub async fn resolve(
        &self,
        key: &IdempotencyKey,
        resolution: Resolution,
        actor: &str,
        reason: &str,
    ) -> Result<Record, Error> {
        let event = Event::Resolve {
            key: key.clone(),
            resolution,
            actor: actor.to_owned(),
            reason: reason.to_owned(),
        };
        self.event(key, event).await.map(|(rec, _)| rec)
    }

    /// Waits until the key's call is no longer in flight, at most `timeout` (for
    /// `Prefer: wait=N`). Returns the record as it then is (still in flight if the
    /// time ran out; `None` if the key is unknown). Reads go through the writer, so a
    /// settled answer is durable.
    pub async fn wait_settled(
        &self,
        key: &IdempotencyKey,
        timeout: Duration,
    ) -> Result<Option<Record>, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut commits = self.inner.shared.commits.subscribe();
        loop {
            commits.borrow_and_update();
            let record = self
                .call(|reply| Command::Read {
                    key: key.clone(),
                    reply,
                })
                .await?;
            match &record {
                Some(r) if r.state.in_flight() => {}
                _ => return Ok(record),
            }
            match tokio::time::timeout_at(deadline, commits.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    return Err(Error::Unavailable("the journal writer stopped".to_owned()));
                }
                Err(_) => return Ok(record),
            }
        }
    }

    pub fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, Error> {
        self.inner.reader.get(key)
    }

    pub fn list(&self, filter: &Filter) -> Result<Vec<Record>, Error> {
        self.inner.reader.list(filter)
    }

    /// One page of matching records (see [`crate::Cursor`]).
    pub fn page(&self, filter: &Filter) -> Result<crate::Page, Error> {
        self.inner.reader.page(filter)
    }

    /// Writes the matching records as JSON Lines; returns how many.
    pub fn export(&self, filter: &Filter, out: &mut dyn Write) -> Result<usize, Error> {
        self.inner.reader.export(filter, out)
    }

    /// The hash-chain check of this running journal, tolerant of the writes made
    /// while it reads (see [`crate::Audit::verify`] for a stopped one).
    pub fn verify(&self) -> Result<VerifyReport, Error> {
        self.inner.reader.verify(crate::chain::Mode::Live)
    }

    pub fn timeline(&self, task: &TaskId) -> Result<Vec<TimelineEntry>, Error> {
        self.inner.reader.timeline(task)
    }

    /// Log entries from `from_seq` on, at most `limit`.
    pub fn log_entries(&self, from_seq: u64, limit: usize) -> Result<Vec<LogEntry>, Error> {
        self.inner.reader.log_entries(from_seq, limit)
    }

    /// Whether a commit or flush failed and no write made since has been made
    /// durable: durable writes are being refused now, or have not yet been shown to
    /// work again.
    pub fn writes_failing(&self) -> bool {
        self.inner.shared.failing()
    }

    pub fn stats(&self) -> Stats {
        self.inner
            .shared
            .snapshot(self.inner.reader.store.size_on_disk())
    }

    /// Makes every group commit fail until cleared (tests and drills).
    pub fn set_write_fault(&self, fault: Option<WriteFault>) {
        self.inner.shared.set_fault(fault);
    }

    /// Retention: full records past `retention` become tombstones, tombstones past
    /// `tombstone_retention` are forgotten, streams past `stream_retention` are
    /// dropped. The application calls it periodically (again at once if `more`).
    pub async fn reap(&self, now: SystemTime) -> Result<ReapReport, Error> {
        self.call(|reply| Command::Reap { now, reply }).await
    }

    // --- model streams ---

    /// Starts (or finds) the stream for a model call. A new stream is answered as
    /// soon as the writer has decided it, before its start is applied (every later
    /// command sees it; readers once applied); an existing one once applied. The
    /// start is flushed within `max_batch_delay`, or earlier with the stream's first
    /// durable event: nothing the agent receives depends on it. If its write fails,
    /// the stream's later writes are refused.
    pub async fn stream_begin(
        &self,
        key: &StreamKey,
        request: StreamRequest,
    ) -> Result<StreamBegin, Error> {
        let claim = self.inner.claims.claim(key).await;
        // Drawn here, whoever decides the attempt's number.
        let tag = crate::stream::draw_tag();
        // A key the writer has never written starts at attempt 1, whatever the
        // writer is doing: no other begin of it can come between (the claim, see
        // [`crate::claims`]), so the start is queued without waiting for the writer.
        // Like any new start it is not awaited anyway (see the writer's
        // `StreamBegin`): losing it loses nothing the agent was given. A key the
        // filter may hold (about 1 % of new ones, falsely) is asked through the
        // writer, which reads the store; so is every key once an attempt was lost.
        if self.inner.shared.broken_attempts.load(Ordering::Acquire) == 0
            && !self.inner.known.may_exist(Known::Stream, key.as_str())
        {
            self.inner
                .tx
                .send(Command::StreamBegin {
                    key: key.clone(),
                    request: Box::new(request),
                    tag,
                    claim,
                    reply: None,
                })
                .await
                .map_err(|_| Error::Unavailable("the journal writer is not running".to_owned()))?;
            return Ok(StreamBegin::New { attempt: 1, tag });
        }
        // A new attempt answered to a caller that went away never gets a producer:
        // it is ended for it, or the key's next begins would find it open for ever.
        let (journal, started) = (self.clone(), key.clone());
        self.call_settled(
            |reply| Command::StreamBegin {
                key: key.clone(),
                request: Box::new(request),
                tag,
                claim,
                reply: Some(reply),
            },
            move |begin: StreamBegin| {
                Box::pin(async move {
                    let StreamBegin::New { attempt, .. } = begin else {
                        return;
                    };
                    let end = StreamEnd::abandoned(UNANSWERED_START);
                    if let Err(e) = journal.stream_end(&started, attempt, end).await {
                        tracing::warn!(key = %started, error = %e, "could not end a stream whose caller went away");
                    }
                })
            },
        )
        .await
    }

    /// Journals raw events numbered from `seq` (typically what one upstream frame
    /// carried), stored together as one value. `durable = false` (text deltas):
    /// returns once applied, flushed within `max_batch_delay`. `durable = true`
    /// (complete tool-call blocks, terminal events): returns once flushed, together
    /// with every earlier event.
    pub async fn stream_append(
        &self,
        key: &StreamKey,
        attempt: u32,
        seq: u64,
        events: Vec<Bytes>,
        durable: bool,
    ) -> Result<(), Error> {
        self.call(|reply| Command::StreamAppend {
            key: key.clone(),
            attempt,
            seq,
            events,
            durable,
            buffered: false,
            reply,
        })
        .await
    }

    /// Queues lazily journaled events without waiting for the writer to take them in.
    ///
    /// The writer holds such events per stream and writes them out together: with
    /// the stream's next awaited append, its end or a new attempt, or within
    /// `max_batch_delay`, whichever comes first; until then `stream_events` does not
    /// return them (an open stream's clients read the live hub, not the journal).
    /// Commands reach the single writer in the order they are sent, so events keep
    /// their order, and a later durable write (or `stream_end`) that is awaited is
    /// only acknowledged once these are flushed too. A write that fails is not
    /// reported here; it shows in `Stats`, and the attempt's next awaited call fails.
    /// Waits only when the writer's queue is full (back-pressure).
    pub async fn stream_append_nowait(
        &self,
        key: &StreamKey,
        attempt: u32,
        seq: u64,
        events: Vec<Bytes>,
    ) -> Result<(), Error> {
        self.inner
            .tx
            .send(queued_append(key, attempt, seq, events))
            .await
            .map_err(|_| Error::Unavailable("the journal writer is not running".to_owned()))
    }

    /// Ends an attempt; durable before return.
    pub async fn stream_end(
        &self,
        key: &StreamKey,
        attempt: u32,
        end: StreamEnd,
    ) -> Result<(), Error> {
        self.call(|reply| Command::StreamEnd {
            key: key.clone(),
            attempt,
            end,
            reply,
        })
        .await
    }

    /// The stream's metadata (attempts, how each ended), if the key is known.
    pub fn stream_meta(&self, key: &StreamKey) -> Result<Option<StreamMeta>, Error> {
        self.inner.reader.stream_meta(key)
    }

    /// The events of one attempt in sequence order, after `after_seq` if given.
    pub fn stream_events(
        &self,
        key: &StreamKey,
        attempt: u32,
        after_seq: Option<u64>,
    ) -> Result<Vec<(u64, Bytes)>, Error> {
        self.inner.reader.stream_events(key, attempt, after_seq)
    }

    // --- small persisted state for other components ---

    /// Stores a value; batched like lazy stream events (applied on return, flushed
    /// within `max_batch_delay`).
    pub async fn kv_put(&self, namespace: &str, key: &str, value: Vec<u8>) -> Result<(), Error> {
        self.kv_write(namespace, key, Some(value)).await
    }

    pub async fn kv_delete(&self, namespace: &str, key: &str) -> Result<(), Error> {
        self.kv_write(namespace, key, None).await
    }

    async fn kv_write(
        &self,
        namespace: &str,
        key: &str,
        value: Option<Vec<u8>>,
    ) -> Result<(), Error> {
        check_namespace(namespace)?;
        self.call(|reply| Command::KvPut {
            namespace: namespace.to_owned(),
            key: key.to_owned(),
            value,
            reply,
        })
        .await
    }

    pub fn kv_get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, Error> {
        self.inner.reader.kv_get(namespace, key)
    }

    pub fn kv_scan(&self, namespace: &str) -> Result<Vec<(String, Vec<u8>)>, Error> {
        self.inner.reader.kv_scan(namespace)
    }
}

/// The chain head the previous process left; if the head key is gone, the last log
/// entry (verification reports the loss either way).
fn load_head(store: &Store) -> Result<Head, Error> {
    if let Some(bytes) = store.get(keys::HEAD)? {
        return Head::decode(&bytes);
    }
    let Some(last) = store.scan_prefix(keys::LOG).next_back() else {
        return Ok(Head::default());
    };
    let (_, bytes) = last?;
    let entry: LogEntry = serde_json::from_slice(&bytes).map_err(|e| Error::Decode {
        what: "the last log entry".to_owned(),
        detail: e.to_string(),
    })?;
    let hash = hex::decode(&entry.hash)
        .ok()
        .and_then(|h| <[u8; 32]>::try_from(h).ok())
        .unwrap_or_default();
    Ok(Head {
        seq: entry.seq,
        hash,
    })
}

/// Moves what the previous process left in flight to the states a restart implies,
/// in one durable batch, and counts records per state.
fn recover(store: &Store, core: &mut Core, epoch: u64) -> Result<(Recovery, [i64; 8]), Error> {
    let now = SystemTime::now();
    let stamp = Timestamp::from_system(now);
    let mut recovery = Recovery {
        epoch,
        ..Recovery::default()
    };
    let mut counts = [0i64; 8];
    let mut batch = core.new_batch();
    for entry in slots::scan(store)? {
        let (key, bytes) = entry?;
        recovery.records += 1;
        // Remembered even if unreadable: a later request for the key must read it,
        // fail and be refused, not find the key new and execute it.
        core.remember(Known::Record, &key);
        let rec = match bytes.and_then(|bytes| decode_record(&key, &bytes)) {
            Ok(rec) => rec,
            // Damaged data, as opposed to a store that cannot be read (which stops the
            // open): a damaged record file must not keep the journal from opening.
            Err(e @ Error::Decode { .. }) => {
                tracing::warn!(error = %e, "undecodable journal record left as is");
                recovery.undecodable.push(key);
                continue;
            }
            Err(e) => return Err(e),
        };
        counts[rec.state.index()] += 1;
        let (next, effect) = state::apply(Some(&rec), Event::Restart { epoch }, now)?;
        if !effect.writes() {
            continue;
        }
        match next.state {
            State::FailedBeforeSend => recovery.failed_before_send.push(next.key.clone()),
            State::InDoubt => recovery.in_doubt.push(next.key.clone()),
            State::NeedsOperator => recovery.needs_operator.push(next.key.clone()),
            _ => {}
        }
        core.write_record(&mut batch, next, Some(&rec))?;
    }
    for entry in store.scan_prefix(keys::STREAMS) {
        let (storage_key, bytes) = entry?;
        let key = String::from_utf8_lossy(&storage_key[keys::STREAMS.len()..]).into_owned();
        core.remember(Known::Stream, &key);
        let mut meta = match decode_stream(&key, &bytes) {
            Ok(meta) => meta,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable stream metadata left as is");
                continue;
            }
        };
        core.note_events_slot(meta.events_slot);
        if meta.state != StreamState::Open {
            continue;
        }
        meta.state = StreamState::Abandoned;
        meta.end = Some(StreamEnd::abandoned(
            "restart: the sidecar stopped while the stream was open",
        ));
        meta.updated_at = stamp;
        recovery.abandoned_streams.push(meta.key.clone());
        core.write_stream(&mut batch, meta, true)?;
    }
    core.put(&mut batch, keys::FORMAT, FORMAT);
    core.put(&mut batch, keys::EPOCH, &epoch.to_be_bytes());
    core.commit_blocking(batch)?;
    Ok((recovery, counts))
}

/// The command of a lazily journaled append, whose answer nobody waits for.
fn queued_append(key: &StreamKey, attempt: u32, seq: u64, events: Vec<Bytes>) -> Command {
    let (reply, _ignored) = oneshot::channel();
    Command::StreamAppend {
        key: key.clone(),
        attempt,
        seq,
        events,
        durable: false,
        buffered: true,
        reply,
    }
}

/// Why a call is settled for a caller that went away before the journal answered.
const UNANSWERED: &str = "the caller went away before the journal answered; the call was not sent";

/// Why a stream's attempt is ended when the caller that began it went away before
/// the journal answered.
const UNANSWERED_START: &str =
    "the caller went away before the journal answered; the model was not called";

/// Why a call is settled whose dispatched write failed.
const DISPATCH_FAILED: &str =
    "its dispatched write failed, so the request was not sent; a retry sends it";

/// Records a claimed call `failed_before_send` when dropped armed (`journal` set):
/// its request never left.
struct NotSent {
    journal: Option<Journal>,
    ticket: Ticket,
    why: &'static str,
}

impl Drop for NotSent {
    fn drop(&mut self) {
        let Some(journal) = self.journal.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // The process is stopping: the next start finds the claim and settles it.
            return;
        };
        let (ticket, why) = (self.ticket.clone(), self.why);
        runtime.spawn(async move {
            if let Err(e) = journal.failed_before_send(&ticket, why).await {
                tracing::warn!(key = %ticket.key(), error = %e, "could not settle a call whose request never left");
            }
        });
    }
}

/// What settles an answer nobody received.
type Settle = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A writer's answer the caller may not wait for: dropped unanswered, it is awaited
/// on the runtime and handed to `settle`.
struct Unanswered<T: Send + 'static> {
    answer: Option<oneshot::Receiver<Result<T, Error>>>,
    settle: Option<Box<dyn FnOnce(T) -> Settle + Send>>,
}

impl<T: Send + 'static> Drop for Unanswered<T> {
    fn drop(&mut self) {
        let (Some(answer), Some(settle)) = (self.answer.take(), self.settle.take()) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // The process is stopping: the next start's recovery settles the call.
            return;
        };
        runtime.spawn(async move {
            if let Ok(Ok(value)) = answer.await {
                settle(value).await;
            }
        });
    }
}
