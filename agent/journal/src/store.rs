//! The only module that names sled: one `Db`, one tree, prefixed keys, and the
//! journal's own write-ahead log that makes each group commit atomic and durable.
//! Nothing sled-typed leaves this file, so the engine can be swapped (redb, fjall)
//! without touching the state machine or the writer.
//!
//! Why a log of our own: sled's `flush` hands the write to its thread pool and waits
//! on a condition variable (waking every idle pool thread), then `sync_file_range`s;
//! on a 2-core machine that is 0.3–0.4 ms per flush, twice per tool call. Every batch
//! applied to sled is first appended here as one frame (length, CRC-32, the writes),
//! with one `write`: once it returns, the batch survives a killed process
//! (`Durability::Process`); `Durability::Node` adds an `fdatasync` of the log. sled
//! itself is flushed only when the log is rotated (and by its own background
//! flusher). At open, the log's frames are applied again in order, which is
//! idempotent (each write is a whole value or a removal), and a torn last frame (a
//! batch whose write never returned, so was never acknowledged) is dropped. A bad
//! frame with a whole frame after it is no torn write (frames are appended one after
//! the other, and a sync makes every earlier one durable too) but damage: the
//! journal is then `Error::Corrupt`, and nothing is applied or emptied (the log is
//! checked before sled opens, so no file changes). A private copy opened for an
//! audit applies the frames before the damage instead, and says where it is.
//!
//! A failed `fdatasync` (of the log, sled's file or the record files) is never
//! retried: Linux may drop the pages it could not write and report the next sync as
//! a success. The store then takes no more writes and never empties its log until
//! the process restarts and replays what the disk really holds.
//!
//! A logged batch is given to sled afterwards, in order, on an applier thread of
//! the store's own when the writer has more waiting (sled's inserts then run beside
//! the making of the next batch), or on the writer's thread when it has not. Every
//! read first waits until sled has every batch logged so far, so nobody reads around
//! a write whose caller was answered.
//!
//! Some writes are *held*: logged like the others, but kept in memory instead of
//! given to sled, because the writer will replace them soon (a call's record while
//! it is in flight, rewritten when it ends). Reads see them as if they were in sled.
//! sled gets a held value only if the log is rotated before it is replaced, and a
//! restart applies the log's frames whole. Why: sled rewrites a leaf of up to 16
//! values every tenth change to it, so each record written to it costs several
//! times its size on disk, and a call's in-flight version is half of its bytes.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use crate::Error;
use crate::bodies::Bodies;
use crate::options::Durability;

/// sled's own message when its `flock` on the db file fails.
const SLED_LOCK_MESSAGE: &str = "could not acquire lock";

/// The write-ahead log's file in the journal directory.
const WAL_FILE: &str = "wal";
/// Past this size the log is rotated: sled is flushed and the log emptied.
const WAL_ROTATE_BYTES: u64 = 16 << 20;
/// A frame starts with the payload's length and its CRC-32, both little-endian u32.
const FRAME_HEADER: usize = 8;
const OP_PUT: u8 = b'p';
const OP_REMOVE: u8 = b'd';

pub(crate) struct Store {
    db: sled::Db,
    /// Record bodies, outside sled (see [`crate::bodies`]).
    bodies: Arc<Bodies>,
    /// A second handle on sled's data file, for `fdatasync` in `Durability::Node`.
    sync_file: Option<File>,
    wal: Mutex<Wal>,
    progress: Arc<Progress>,
    /// The applier thread and the queue of logged batches it gives sled.
    applier: Option<(Sender<Handoff>, JoinHandle<()>)>,
    durability: Durability,
    dir: PathBuf,
    /// Last, so it is dropped after `db`: see [`Released`].
    _released: Released,
}

/// Waits, when the store is dropped, until sled has let go of its data file's lock.
///
/// sled's I/O threads can hold the file for a few milliseconds after the last
/// handle on the database is dropped, and opening the journal again in that window
/// fails with [`Error::Locked`], as if another process held it (a drill, or a test,
/// that reopens the journal in the same process).
struct Released {
    db_file: PathBuf,
}

/// How long a dropped store waits for sled to release its lock.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl Drop for Released {
    fn drop(&mut self) {
        let started = std::time::Instant::now();
        while started.elapsed() < RELEASE_WAIT {
            match File::open(&self.db_file).map(|f| f.try_lock()) {
                // Unlocked (the probe's lock goes with `f`), or nothing to wait for.
                Ok(Ok(())) | Err(_) | Ok(Err(std::fs::TryLockError::Error(_))) => return,
                Ok(Err(std::fs::TryLockError::WouldBlock)) => {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
            }
        }
        tracing::warn!(file = %self.db_file.display(), "sled still holds the journal's lock after it was closed");
    }
}

/// A key and its new value (`None` removes the key).
pub(crate) type OwnedWrite = (Vec<u8>, Option<Vec<u8>>);

/// A key and a value the store holds in memory instead of giving sled (see the
/// module's documentation).
pub(crate) type HeldWrite = (Vec<u8>, Vec<u8>);

/// Called once sled has a batch, or with why it could not take it.
pub(crate) type Then = Box<dyn FnOnce(Result<(), String>) + Send>;

/// A logged batch on its way to sled.
struct Handoff {
    seq: u64,
    writes: Vec<OwnedWrite>,
    /// Values kept in memory instead (see the module's documentation).
    held: Vec<HeldWrite>,
    then: Option<Then>,
}

/// How far sled has come behind the log, shared by the applier and the readers.
#[derive(Default)]
struct Progress {
    /// The number of the last batch appended to the log.
    logged: AtomicU64,
    /// The number of the last batch sled has; readers wait on `moved` for it.
    applied: Mutex<u64>,
    moved: Condvar,
    /// Set when sled failed to take a batch, or a failed append could not be taken
    /// back out of the log: later batches are refused (rather than land behind a
    /// torn frame that replay would stop at).
    failed: Mutex<Option<String>>,
    /// Held values of landed batches, which reads see over sled's.
    held: Mutex<BTreeMap<Vec<u8>, Vec<u8>>>,
    /// Makes the next batch given to sled panic (tests).
    #[cfg(test)]
    panic_next: std::sync::atomic::AtomicBool,
}

/// A batch appended to the write-ahead log and not yet handed to sled; see
/// [`Store::log`]. Dropped unapplied, its frame is taken back.
pub(crate) struct Logged<'s> {
    store: &'s Store,
    wal: MutexGuard<'s, Wal>,
    /// Taken by [`Logged::apply`].
    writes: Option<(Vec<OwnedWrite>, Vec<HeldWrite>)>,
    seq: u64,
    /// Where the frame starts in the log.
    start: u64,
}

/// The write-ahead log. Only the writer appends; the lock keeps `Store` shareable.
struct Wal {
    file: File,
    /// Bytes of whole frames in the file; the next frame goes here.
    len: u64,
    /// Rotate past this many bytes.
    rotate_at: u64,
    /// The frame being built, reused.
    frame: Vec<u8>,
    /// Why a sync failed: what the disk holds is unknown, so the log takes no more
    /// frames and is never emptied (see the module's documentation).
    sync_failed: Option<String>,
}

/// A key/value pair read from the store.
pub(crate) type Entry = (Vec<u8>, Vec<u8>);

/// A key and its value, or why the value could not be read (a record body).
pub(crate) type Resolved = (Vec<u8>, Result<Vec<u8>, Error>);

/// An entry whose value could be read, or the error.
fn resolved(item: Result<Resolved, Error>) -> Result<Entry, Error> {
    let (key, value) = item?;
    Ok((key, value?))
}

/// How [`Store::open_in`] opens a journal directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The sidecar's journal, created if missing.
    Create,
    /// An existing journal (tests that edit one).
    Existing,
    /// A private copy of a journal, for reading (an audit): a damaged write-ahead
    /// log is read up to the damage instead of refused, and nothing is synced.
    Copy,
}

/// A damaged frame in a journal's write-ahead log with whole frames after it
/// (damage, not a torn last write), found by an audit: the frames before it were
/// read, nothing from it on was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalDamage {
    /// The damaged frame's number, counting from 1.
    pub frame: usize,
    /// Where it starts, in bytes from the start of the log.
    pub at: u64,
    /// The log's bytes from the damaged frame on, none of them applied.
    pub bytes_after: u64,
}

impl std::fmt::Display for WalDamage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "its write-ahead log is damaged at frame {} (byte {}) with whole frames after it: \
             the {} frame(s) before it were read, the {} byte(s) from it on were not, so what \
             they wrote is missing here or shows an older state",
            self.frame,
            self.at,
            self.frame - 1,
            self.bytes_after
        )
    }
}

impl Store {
    /// Opens (or, with `create`, creates) the journal in `dir`. A journal held by
    /// another process is `Error::Locked`; a directory without a journal is
    /// `Error::NotFound` when `create` is false.
    pub(crate) fn open(
        dir: &Path,
        cache_capacity: u64,
        durability: Durability,
        create: bool,
    ) -> Result<Self, Error> {
        let mode = if create { Mode::Create } else { Mode::Existing };
        Self::open_in(dir, cache_capacity, durability, mode).map(|(store, _)| store)
    }

    /// Opens a private copy of a journal for reading (see [`crate::Audit`]). A damaged
    /// write-ahead log is applied up to the damage, which is returned, where the
    /// sidecar refuses it: nothing of the copy is served.
    pub(crate) fn open_copy(dir: &Path) -> Result<(Self, Option<WalDamage>), Error> {
        Self::open_in(dir, 16 << 20, Durability::Process, Mode::Copy)
    }

    fn open_in(
        dir: &Path,
        cache_capacity: u64,
        durability: Durability,
        mode: Mode,
    ) -> Result<(Self, Option<WalDamage>), Error> {
        let db_file = dir.join("db");
        if mode == Mode::Create {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::Storage(format!(
                    "cannot create the journal directory {}: {e}",
                    dir.display()
                ))
            })?;
        } else {
            check_journal(dir)?;
        }
        // sled reports a held lock as a generic I/O error; asking first gives the
        // caller a distinguishable answer (the CLI falls back to the admin API).
        if db_file.is_file() {
            check_unlocked(dir)?;
        }
        // The log is read and checked before sled opens: a damaged one leaves every
        // file as it was.
        let wal_path = dir.join(WAL_FILE);
        let log = match std::fs::read(&wal_path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                return Err(Error::Storage(format!(
                    "cannot read {}: {e}",
                    wal_path.display()
                )));
            }
        };
        let parsed = frames(&log);
        let damage = parsed.damaged_at.map(|at| WalDamage {
            frame: parsed.frames.len() + 1,
            at: at as u64,
            bytes_after: (log.len() - at) as u64,
        });
        if let Some(damage) = &damage
            && mode != Mode::Copy
        {
            return Err(Error::Corrupt {
                dir: dir.to_owned(),
                kind: crate::error::Corruption::DamagedWal,
                detail: format!(
                    "frame {} of its write-ahead log {}, at byte {}, is damaged and whole \
                     frames follow it: damage, not a torn last write; nothing of the log was \
                     applied",
                    damage.frame,
                    wal_path.display(),
                    damage.at
                ),
            });
        }
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(cache_capacity)
            .flush_every_ms(Some(500))
            .mode(sled::Mode::HighThroughput)
            .open()
            .map_err(|e| open_error(dir, e))?;
        let sync_file = match durability {
            Durability::Process => None,
            Durability::Node => Some(File::open(&db_file).map_err(|e| {
                Error::Storage(format!(
                    "cannot open {} for fdatasync: {e}",
                    db_file.display()
                ))
            })?),
        };
        let wal = Wal::open(dir)?;
        let mut store = Self {
            db,
            bodies: Arc::new(Bodies::open(dir, mode == Mode::Create)?),
            sync_file,
            wal: Mutex::new(wal),
            progress: Arc::new(Progress::default()),
            applier: None,
            durability,
            dir: dir.to_owned(),
            _released: Released {
                db_file: db_file.clone(),
            },
        };
        store.recover(&parsed, log.len(), mode != Mode::Copy)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let (db, bodies) = (store.db.clone(), Arc::clone(&store.bodies));
        let progress = Arc::clone(&store.progress);
        let thread = std::thread::Builder::new()
            .name("outrigger-journal-apply".to_owned())
            .spawn(move || run_applier(&db, &bodies, &progress, &rx))
            .map_err(|e| Error::Storage(format!("cannot start the journal's applier: {e}")))?;
        store.applier = Some((tx, thread));
        Ok((store, damage))
    }

    /// Applies the log's whole frames again (those before a damaged frame, in a
    /// copy), makes sled durable (with `sync`), and empties the log.
    fn recover(&self, log: &Log<'_>, log_len: usize, sync: bool) -> Result<(), Error> {
        let mut wal = self.wal();
        if log_len == 0 {
            return Ok(());
        }
        // Held writes are applied like the others: sled gets everything at open.
        // Record bodies are given to sled itself, as every format reads them there
        // (they move to files when next written).
        for writes in &log.frames {
            apply_writes(&self.db, &self.bodies, writes.iter().copied(), true)?;
        }
        if log.damaged_at.is_none() && log.whole < log_len {
            tracing::warn!(
                dropped_bytes = log_len - log.whole,
                "the journal's write-ahead log ends in a torn frame (a batch that was never acknowledged); dropped"
            );
        }
        // A real sync whatever the mode: the log may hold batches a `Durability::Node`
        // sidecar acknowledged as durable, and once it is emptied only sled has them.
        if sync {
            self.sync_db(true)?;
        }
        wal.truncate()?;
        tracing::info!(
            batches = log.frames.len(),
            "journal write-ahead log replayed"
        );
        Ok(())
    }

    fn wal(&self) -> std::sync::MutexGuard<'_, Wal> {
        self.wal.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// sled's flush, plus an `fdatasync` of its file and of the record files for
    /// `Durability::Node` (or with `always`): what must hold before the log may be
    /// emptied.
    fn sync_db(&self, always: bool) -> Result<(), Error> {
        self.db.flush().map_err(storage)?;
        let opened;
        let file = match &self.sync_file {
            Some(file) => file,
            None if always => {
                let db_file = &self._released.db_file;
                opened = File::open(db_file).map_err(|e| {
                    Error::Storage(format!(
                        "cannot open {} for fdatasync: {e}",
                        db_file.display()
                    ))
                })?;
                &opened
            }
            None => return Ok(()),
        };
        self.bodies.sync()?;
        sync_data(file).map_err(|e| Error::Storage(format!("fdatasync of the journal failed: {e}")))
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Waits until sled has every batch logged so far: a reader never misses a write
    /// whose waiter was answered before the read began.
    fn settled(&self) {
        self.wait_applied(self.progress.logged.load(Ordering::SeqCst));
    }

    fn wait_applied(&self, target: u64) {
        let mut applied = lock(&self.progress.applied);
        while *applied < target {
            applied = self
                .progress
                .moved
                .wait(applied)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        self.settled();
        if let Some(value) = lock(&self.progress.held).get(key) {
            return Ok(Some(value.clone()));
        }
        match self.db.get(key).map_err(storage)? {
            Some(value) => self.bodies.resolve(key, value.to_vec()).map(Some),
            None => Ok(None),
        }
    }

    /// sled's entries, each record body read from its file (or why it could not be).
    fn stored<I>(
        &self,
        entries: I,
    ) -> impl DoubleEndedIterator<Item = Result<Resolved, Error>> + use<I>
    where
        I: DoubleEndedIterator<Item = sled::Result<(sled::IVec, sled::IVec)>>,
    {
        let bodies = Arc::clone(&self.bodies);
        entries.map(move |item| {
            let (key, value) = entry(item)?;
            let value = bodies.resolve(&key, value);
            Ok((key, value))
        })
    }

    /// Every entry whose key starts with `prefix`, in key order.
    pub(crate) fn scan_prefix(
        &self,
        prefix: &[u8],
    ) -> impl DoubleEndedIterator<Item = Result<Entry, Error>> + use<> {
        self.scan_prefix_each(prefix).map(resolved)
    }

    /// [`Store::scan_prefix`], where a value that cannot be read (a record body whose
    /// file is damaged) is the error of its own entry, and the scan goes on.
    pub(crate) fn scan_prefix_each(
        &self,
        prefix: &[u8],
    ) -> impl DoubleEndedIterator<Item = Result<Resolved, Error>> + use<> {
        self.settled();
        let held = self.held_in(|key| key.starts_with(prefix), prefix);
        Merged::new(self.stored(self.db.scan_prefix(prefix)), held)
    }

    /// The last key that starts with `prefix`; its value is not read.
    pub(crate) fn last_key(&self, prefix: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        self.settled();
        let held = lock(&self.progress.held)
            .range(prefix.to_vec()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .last()
            .map(|(key, _)| key.clone());
        let stored = self
            .db
            .scan_prefix(prefix)
            .keys()
            .next_back()
            .transpose()
            .map_err(storage)?
            .map(|key| key.to_vec());
        Ok(held.max(stored))
    }

    /// Entries with `start <= key < end`, in key order.
    pub(crate) fn range(
        &self,
        start: &[u8],
        end: &[u8],
    ) -> impl DoubleEndedIterator<Item = Result<Entry, Error>> + use<> {
        self.range_each(start, end).map(resolved)
    }

    /// [`Store::range`], where a value that cannot be read (a record body whose file
    /// is damaged) is the error of its own entry, and the range goes on.
    pub(crate) fn range_each(
        &self,
        start: &[u8],
        end: &[u8],
    ) -> impl DoubleEndedIterator<Item = Result<Resolved, Error>> + use<> {
        self.settled();
        let held = self.held_in(|key| key < end, start);
        Merged::new(
            self.stored(self.db.range(start.to_vec()..end.to_vec())),
            held,
        )
    }

    /// Entries with `start <= key`, in key order.
    pub(crate) fn range_from(
        &self,
        start: &[u8],
    ) -> impl DoubleEndedIterator<Item = Result<Entry, Error>> + use<> {
        self.settled();
        let held = self.held_in(|_| true, start);
        Merged::new(self.stored(self.db.range(start.to_vec()..)), held).map(resolved)
    }

    /// The held values from `start` on while `within`, in key order.
    fn held_in(&self, within: impl Fn(&[u8]) -> bool, start: &[u8]) -> VecDeque<Entry> {
        let held = lock(&self.progress.held);
        if held.is_empty() {
            return VecDeque::new();
        }
        held.range(start.to_vec()..)
            .take_while(|(key, _)| within(key))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect()
    }

    /// Applies all writes, atomically across a crash (all or nothing: the batch is one
    /// frame of the write-ahead log when this returns), and waits until sled has
    /// them. `None` removes the key. [`Store::flush`] makes it durable for
    /// `Durability::Node`.
    pub(crate) fn apply(&self, writes: Vec<OwnedWrite>) -> Result<(), Error> {
        self.log(writes, Vec::new())?
            .apply_here(None)
            .map_err(Error::Storage)
    }

    /// Appends the writes to the write-ahead log as one frame (with one `write`): once
    /// this returns, the batch survives a killed process, and once [`Logged::sync`]
    /// returns, a lost node. [`Logged::apply`] hands it to the applier thread, which
    /// gives sled the writes; readers wait for every logged batch to be in sled, so
    /// a waiter can be answered as soon as its batch is logged. `held` values are
    /// logged too but kept in memory, not given to sled, until a later write of the
    /// same key (see the module's documentation); their keys are not in `writes`.
    pub(crate) fn log(
        &self,
        writes: Vec<OwnedWrite>,
        held: Vec<HeldWrite>,
    ) -> Result<Logged<'_>, Error> {
        let mut wal = self.wal();
        if let Some(reason) = lock(&self.progress.failed).clone() {
            return Err(Error::Storage(reason));
        }
        if wal.len >= wal.rotate_at {
            self.rotate(&mut wal);
        }
        if let Some(reason) = &wal.sync_failed {
            return Err(Error::Storage(reason.clone()));
        }
        let mut frame = std::mem::take(&mut wal.frame);
        frame.clear();
        frame.extend_from_slice(&[0; FRAME_HEADER]);
        for (key, value) in &writes {
            push_write(&mut frame, key, value.as_deref());
        }
        for (key, value) in &held {
            push_write(&mut frame, key, Some(value));
        }
        seal(&mut frame)?;
        let start = wal.len;
        let appended = wal.append(&frame);
        wal.frame = frame;
        if let Err(e) = appended {
            self.take_back(&mut wal, start);
            return Err(e);
        }
        let seq = self.progress.logged.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Logged {
            store: self,
            wal,
            writes: Some((writes, held)),
            seq,
            start,
        })
    }

    /// Empties the log once sled has everything in it and is durable: the held
    /// values too, which sled gets now.
    fn rotate(&self, wal: &mut Wal) {
        self.settled();
        if lock(&self.progress.failed).is_some() || wal.sync_failed.is_some() {
            return;
        }
        // Readers wait on the lock meanwhile rather than find a held value nowhere.
        {
            let mut held = lock(&self.progress.held);
            if let Err(e) = apply_writes(
                &self.db,
                &self.bodies,
                held.iter().map(|(k, v)| (k.as_slice(), Some(v.as_slice()))),
                false,
            ) {
                tracing::warn!(error = %e, "giving sled the journal's held writes to rotate its log failed; trying again later");
                return;
            }
            held.clear();
        }
        // A real sync whatever the mode, as at open: once the log is empty only sled
        // and the record files hold its batches, and a rotation is rare (one per
        // `WAL_ROTATE_BYTES` of log), so a `Durability::Process` journal pays a few
        // milliseconds there for records that a power cut cannot leave half written
        // long after they were settled.
        match self.sync_db(true) {
            Ok(()) => match wal.truncate() {
                // No frame can write to a generation retention has emptied.
                Ok(()) => self.bodies.drop_empty(|generation| {
                    let first = u64::from(generation) << crate::slots::GENERATION_BITS;
                    let end = (u64::from(generation) + 1) << crate::slots::GENERATION_BITS;
                    self.db
                        .range(keys::body(first)..keys::body(end))
                        .next()
                        .is_none()
                }),
                Err(e) => {
                    tracing::warn!(error = %e, "emptying the journal's write-ahead log failed; trying again later");
                }
            },
            // Not tried again: a sync after a failed one may report a success for
            // pages that were never written. The log, the only sure copy, stays.
            Err(e) => {
                wal.fail_sync(&format!(
                    "flushing the journal to rotate its log failed ({e})"
                ));
            }
        }
    }

    /// Cuts the log back to `len` bytes; if it cannot be, the store takes no more.
    fn take_back(&self, wal: &mut Wal, len: u64) {
        if let Err(reason) = wal.take_back(len) {
            tracing::error!("{reason}");
            *lock(&self.progress.failed) = Some(reason);
        }
    }

    fn hand_off(&self, handoff: Handoff) {
        let handoff = match &self.applier {
            Some((tx, _)) => match tx.send(handoff) {
                Ok(()) => return,
                Err(std::sync::mpsc::SendError(handoff)) => handoff,
            },
            None => handoff,
        };
        // No applier (it panicked): apply here rather than leave readers waiting.
        let _ = land_caught(&self.db, &self.bodies, &self.progress, handoff);
    }

    /// Makes every applied write durable: already so for `Durability::Process` (the
    /// log's frames are in the page cache once written); `Durability::Node` adds an
    /// `fdatasync` of the log. Once a sync failed, every later one fails too.
    pub(crate) fn flush(&self) -> Result<(), Error> {
        self.sync_log(&mut self.wal())
    }

    fn sync_log(&self, wal: &mut Wal) -> Result<(), Error> {
        if let Some(reason) = &wal.sync_failed {
            return Err(Error::Storage(reason.clone()));
        }
        match self.durability {
            Durability::Process => Ok(()),
            Durability::Node => sync_data(&wal.file).map_err(|e| {
                Error::Storage(wal.fail_sync(&format!(
                    "fdatasync of the journal's write-ahead log failed ({e})"
                )))
            }),
        }
    }

    /// Whether a failed sync stopped the store's writes until a restart.
    pub(crate) fn sync_failed(&self) -> bool {
        self.wal().sync_failed.is_some()
    }

    pub(crate) fn size_on_disk(&self) -> u64 {
        self.db.size_on_disk().unwrap_or(0) + self.bodies.size_on_disk()
    }
}

impl Logged<'_> {
    /// Makes the batch durable for `Durability::Node` (`fdatasync` of the log); for
    /// `Durability::Process` it already is. If the sync fails, the store takes no
    /// more writes (see the module's documentation); dropping the batch then takes
    /// its frame back as for any refused batch.
    pub(crate) fn sync(&mut self) -> Result<(), Error> {
        self.store.sync_log(&mut self.wal)
    }

    /// Hands the batch to the applier; `then` is called once sled has it.
    pub(crate) fn apply(mut self, then: Option<Then>) {
        let handoff = self.handoff(then);
        self.store.hand_off(handoff);
    }

    /// Gives sled the batch on the calling thread, after the batches before it; `then`
    /// is called once sled has it, with the outcome this returns. Cheaper than
    /// [`Logged::apply`] when nothing else is waiting to be logged meanwhile: no
    /// other thread is woken.
    pub(crate) fn apply_here(mut self, then: Option<Then>) -> Result<(), String> {
        let handoff = self.handoff(then);
        self.store.wait_applied(handoff.seq - 1);
        let store = self.store;
        land_caught(&store.db, &store.bodies, &store.progress, handoff)
    }

    fn handoff(&mut self, then: Option<Then>) -> Handoff {
        let (writes, held) = self.writes.take().unwrap_or_default();
        Handoff {
            seq: self.seq,
            writes,
            held,
            then,
        }
    }
}

impl Drop for Logged<'_> {
    /// A batch dropped unapplied was refused (its sync failed, or a fault was
    /// injected): its frame must not be replayed at the next open, and readers must
    /// not wait for it.
    fn drop(&mut self) {
        if self.writes.take().is_some() {
            let start = self.start;
            self.store.take_back(&mut self.wal, start);
            self.store.hand_off(Handoff {
                seq: self.seq,
                writes: Vec::new(),
                held: Vec::new(),
                then: None,
            });
        }
    }
}

impl Drop for Store {
    /// Lets the applier give sled what is queued, then stops it.
    fn drop(&mut self) {
        if let Some((tx, thread)) = self.applier.take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

/// The applier thread: gives sled each logged batch, in order. sled's inserts are
/// half of the journal writer's time; here they run beside it.
fn run_applier(db: &sled::Db, bodies: &Bodies, progress: &Progress, rx: &Receiver<Handoff>) {
    while let Ok(handoff) = rx.recv() {
        let _ = land_caught(db, bodies, progress, handoff);
    }
}

/// [`land`], on any thread. If it panics, the batch counts as landed, so that
/// readers do not wait forever for it, and the store takes no more writes: the
/// batch stays in the log, which a restart applies again. Its `then` is called
/// with the failure like that of any batch sled could not take, so that the
/// writer counts it (a panic must not leave the journal looking healthy).
fn land_caught(
    db: &sled::Db,
    bodies: &Bodies,
    progress: &Progress,
    mut handoff: Handoff,
) -> Result<(), String> {
    let seq = handoff.seq;
    // Kept out of the unwind: if sled panics, `then` still hears of it.
    let then = handoff.then.take();
    let landed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        land(db, bodies, progress, handoff)
    }));
    let outcome = landed.unwrap_or_else(|_| {
        let reason = "the journal failed while applying a batch; no further writes are \
                      accepted until the sidecar restarts and replays its write-ahead log"
            .to_owned();
        tracing::error!("{reason}");
        *lock(&progress.failed) = Some(reason.clone());
        {
            let mut applied = lock(&progress.applied);
            *applied = (*applied).max(seq);
        }
        progress.moved.notify_all();
        Err(reason)
    });
    if let Some(then) = then {
        then(outcome.clone());
    }
    outcome
}

/// Gives sled one batch (unless an earlier one failed), lets readers in, and returns
/// the outcome (for the batch's `then`, which [`land_caught`] calls).
fn land(
    db: &sled::Db,
    bodies: &Bodies,
    progress: &Progress,
    handoff: Handoff,
) -> Result<(), String> {
    let Handoff {
        seq,
        writes,
        held,
        then: _,
    } = handoff;
    let earlier = lock(&progress.failed).clone();
    #[cfg(test)]
    if progress.panic_next.swap(false, Ordering::SeqCst) {
        panic!("injected: sled panicked while taking a batch");
    }
    let outcome = match earlier {
        Some(reason) => Err(reason),
        None => apply_writes(
            db,
            bodies,
            writes.iter().map(|(k, v)| (k.as_slice(), v.as_deref())),
            false,
        )
        .map(|()| hold(progress, &writes, held))
        .map_err(|e| {
            // Part of the batch may be in sled now. Its frame stays in the log, so
            // a restart completes it; until then nothing more is written.
            let reason = format!(
                "the journal could not apply a batch ({e}); no further writes are accepted \
                 until the sidecar restarts and replays its write-ahead log"
            );
            tracing::error!("{reason}");
            *lock(&progress.failed) = Some(reason.clone());
            reason
        }),
    };
    {
        let mut applied = lock(&progress.applied);
        debug_assert_eq!(*applied + 1, seq, "batches reach sled in log order");
        *applied = seq;
    }
    progress.moved.notify_all();
    outcome
}

/// Keeps a landed batch's held values, and forgets those its other writes replace.
fn hold(progress: &Progress, writes: &[OwnedWrite], held: Vec<HeldWrite>) {
    let mut map = lock(&progress.held);
    if !map.is_empty() {
        for (key, _) in writes {
            map.remove(key);
        }
    }
    map.extend(held);
}

/// Sled's entries in key order with the held values over them (a held value
/// replaces sled's under the same key), from either end.
struct Merged<I> {
    sled: I,
    held: VecDeque<Resolved>,
    /// An entry taken from sled's front (or back) and not yet returned.
    front: Option<Resolved>,
    back: Option<Resolved>,
}

impl<I> Merged<I>
where
    I: DoubleEndedIterator<Item = Result<Resolved, Error>>,
{
    fn new(sled: I, held: VecDeque<Entry>) -> Self {
        Self {
            sled,
            held: held.into_iter().map(|(k, v)| (k, Ok(v))).collect(),
            front: None,
            back: None,
        }
    }

    fn sled_front(&mut self) -> Option<Result<Resolved, Error>> {
        if let Some(e) = self.front.take() {
            return Some(Ok(e));
        }
        match self.sled.next() {
            Some(item) => Some(item),
            None => self.back.take().map(Ok),
        }
    }

    fn sled_back(&mut self) -> Option<Result<Resolved, Error>> {
        if let Some(e) = self.back.take() {
            return Some(Ok(e));
        }
        match self.sled.next_back() {
            Some(item) => Some(item),
            None => self.front.take().map(Ok),
        }
    }
}

impl<I> Iterator for Merged<I>
where
    I: DoubleEndedIterator<Item = Result<Resolved, Error>>,
{
    type Item = Result<Resolved, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        let stored = match self.sled_front() {
            Some(Ok(e)) => e,
            Some(Err(e)) => return Some(Err(e)),
            None => return self.held.pop_front().map(Ok),
        };
        let Some(held) = self.held.front() else {
            return Some(Ok(stored));
        };
        match stored.0.cmp(&held.0) {
            std::cmp::Ordering::Less => Some(Ok(stored)),
            // The held value replaces sled's.
            std::cmp::Ordering::Equal => self.held.pop_front().map(Ok),
            std::cmp::Ordering::Greater => {
                self.front = Some(stored);
                self.held.pop_front().map(Ok)
            }
        }
    }
}

impl<I> DoubleEndedIterator for Merged<I>
where
    I: DoubleEndedIterator<Item = Result<Resolved, Error>>,
{
    fn next_back(&mut self) -> Option<Self::Item> {
        let stored = match self.sled_back() {
            Some(Ok(e)) => e,
            Some(Err(e)) => return Some(Err(e)),
            None => return self.held.pop_back().map(Ok),
        };
        let Some(held) = self.held.back() else {
            return Some(Ok(stored));
        };
        match stored.0.cmp(&held.0) {
            std::cmp::Ordering::Greater => Some(Ok(stored)),
            std::cmp::Ordering::Equal => self.held.pop_back().map(Ok),
            std::cmp::Ordering::Less => {
                self.back = Some(stored);
                self.held.pop_back().map(Ok)
            }
        }
    }
}

/// Opens `path` for reading and writing, creating it if missing.
pub(crate) fn open_read_write(path: &Path) -> Result<File, Error> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| Error::Storage(format!("cannot open {}: {e}", path.display())))
}

/// `fdatasync`s `file`. Tests can make it fail on their thread ([`sync_fault`]).
pub(crate) fn sync_data(file: &File) -> std::io::Result<()> {
    #[cfg(test)]
    if sync_fault::ARMED.get() {
        return Err(std::io::Error::other("injected fdatasync failure"));
    }
    file.sync_data()
}

/// `fdatasync`s a record file (see [`crate::bodies`]). Tests can make these fail
/// alone ([`sync_record_file`]), or with every other sync ([`sync_fault`]).
pub(crate) fn sync_record_data(file: &File) -> std::io::Result<()> {
    #[cfg(test)]
    if sync_record_file::ARMED.get() {
        return Err(std::io::Error::other(
            "injected fdatasync failure of a record file",
        ));
    }
    sync_data(file)
}

/// Makes every `fdatasync` of the journal's files on the calling thread fail (tests).
#[cfg(test)]
pub(crate) mod sync_fault {
    thread_local! {
        pub(super) static ARMED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    pub(crate) fn set(armed: bool) {
        ARMED.set(armed);
    }
}

/// Makes the `fdatasync` of the record files, and of no other file, fail on the
/// calling thread (tests): sled's file and the log sync as usual.
#[cfg(test)]
pub(crate) mod sync_record_file {
    thread_local! {
        pub(super) static ARMED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    pub(crate) fn set(armed: bool) {
        ARMED.set(armed);
    }
}

/// Locks `m`, taking a poisoned lock as it is (the journal's locks all do).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `Error::NotFound` unless `dir` holds a journal's files.
pub(crate) fn check_journal(dir: &Path) -> Result<(), Error> {
    if !dir.is_dir() {
        return Err(Error::NotFound {
            dir: dir.to_owned(),
            detail: "the directory does not exist".to_owned(),
        });
    }
    if !dir.join("db").is_file() || !dir.join("conf").is_file() {
        return Err(Error::NotFound {
            dir: dir.to_owned(),
            detail: "it holds no journal files (expected `db` and `conf`); \
                     is this the sidecar's journal directory?"
                .to_owned(),
        });
    }
    Ok(())
}

/// `Error::Locked` if a process holds the journal in `dir` (sled's `flock` on its
/// data file). The probe's own lock is let go at once.
pub(crate) fn check_unlocked(dir: &Path) -> Result<(), Error> {
    take_lock(dir).map(drop)
}

/// Takes the journal's lock, held until the returned file is closed:
/// `Error::Locked` if a process holds it.
pub(crate) fn take_lock(dir: &Path) -> Result<File, Error> {
    let db_file = dir.join("db");
    let file = File::open(&db_file)
        .map_err(|e| Error::Storage(format!("cannot open {}: {e}", db_file.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::Locked {
            dir: dir.to_owned(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(Error::Storage(format!(
            "cannot check the lock on {}: {e}",
            db_file.display()
        ))),
    }
}

fn open_error(dir: &Path, e: sled::Error) -> Error {
    match e {
        sled::Error::Io(io) if io.to_string().contains(SLED_LOCK_MESSAGE) => Error::Locked {
            dir: dir.to_owned(),
        },
        sled::Error::Corruption { .. } => Error::Corrupt {
            dir: dir.to_owned(),
            detail: e.to_string(),
            kind: crate::error::Corruption::Store,
        },
        other => Error::Storage(format!(
            "cannot open the journal in {}: {other}",
            dir.display()
        )),
    }
}

fn storage(e: sled::Error) -> Error {
    Error::Storage(e.to_string())
}

impl Wal {
    fn open(dir: &Path) -> Result<Self, Error> {
        let path = dir.join(WAL_FILE);
        let existed = path.exists();
        let file = open_read_write(&path)?;
        if !existed {
            // The new file's name must survive too.
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| Error::Storage(format!("cannot sync {}: {e}", dir.display())))?;
        }
        Ok(Self {
            file,
            len: 0,
            rotate_at: WAL_ROTATE_BYTES,
            frame: Vec::new(),
            sync_failed: None,
        })
    }

    /// Notes a failed sync for good (see the module's documentation); returns why.
    fn fail_sync(&mut self, what: &str) -> String {
        let reason = format!(
            "{what}; what the disk holds is unknown, so the journal takes no more writes \
             until the sidecar restarts and replays its write-ahead log"
        );
        tracing::error!("{reason}");
        self.sync_failed.get_or_insert(reason).clone()
    }

    /// Writes `frame` at the end. A write that fails must be taken back
    /// ([`Store::take_back`]), so no torn frame stays in front of later ones.
    fn append(&mut self, frame: &[u8]) -> Result<(), Error> {
        let start = self.len;
        match self.file.write_all_at(frame, start) {
            Ok(()) => {
                self.len = start + frame.len() as u64;
                Ok(())
            }
            Err(e) => Err(Error::Storage(format!(
                "writing the journal's write-ahead log failed: {e}"
            ))),
        }
    }

    /// Cuts the log back to `len` bytes (the frames before a failed batch); says why
    /// it could not.
    fn take_back(&mut self, len: u64) -> Result<(), String> {
        self.file.set_len(len).map_err(|e| {
            format!(
                "the journal's write-ahead log could not be cut back after a failed write ({e}); \
                 no further writes are accepted until the sidecar restarts"
            )
        })?;
        self.len = len;
        Ok(())
    }

    fn truncate(&mut self) -> Result<(), Error> {
        self.file.set_len(0).map_err(|e| {
            Error::Storage(format!(
                "emptying the journal's write-ahead log failed: {e}"
            ))
        })?;
        self.len = 0;
        Ok(())
    }
}

/// Appends one write to a frame: op, key length, key, and for a put the value's
/// length and the value (lengths little-endian u32). `None` removes the key.
fn push_write(frame: &mut Vec<u8>, key: &[u8], value: Option<&[u8]>) {
    frame.push(if value.is_some() { OP_PUT } else { OP_REMOVE });
    frame.extend_from_slice(&len32(key.len()).to_le_bytes());
    frame.extend_from_slice(key);
    if let Some(value) = value {
        frame.extend_from_slice(&len32(value.len()).to_le_bytes());
        frame.extend_from_slice(value);
    }
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Fills in the frame's header: the payload's length and CRC-32.
fn seal(frame: &mut [u8]) -> Result<(), Error> {
    let payload_len = u32::try_from(frame.len() - FRAME_HEADER)
        .map_err(|_| Error::Storage("a journal batch over 4 GiB cannot be written".to_owned()))?;
    let crc = crc32fast::hash(&frame[FRAME_HEADER..]);
    frame[..4].copy_from_slice(&payload_len.to_le_bytes());
    frame[4..FRAME_HEADER].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// What a write-ahead log holds.
struct Log<'a> {
    /// The writes of the whole, intact frames at its start.
    frames: Vec<Vec<Write<'a>>>,
    /// How many bytes those frames span.
    whole: usize,
    /// Where a damaged frame starts, if one has a whole frame after it.
    damaged_at: Option<usize>,
}

/// The writes of the whole, intact frames at the start of `bytes`. Reading stops
/// at the first frame that is cut short, fails its CRC or does not parse: the torn
/// tail of a write that never returned, which is dropped. Unless a whole frame
/// follows it: frames are appended one by one, each once the one before is written
/// whole, so a bad frame with a whole one after it is damage, and dropping it with
/// everything after it could take sled back to older values (a completed call back
/// to claimed, executed again). Where the bad frame starts is then `damaged_at`.
fn frames(bytes: &[u8]) -> Log<'_> {
    let mut frames = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let Some((writes, end)) = frame_at(bytes, at) else {
            // Past a bad frame whose header is whole and whose length fits, the next
            // frame would start right after it; anything inside it is its payload
            // (which may hold any bytes). Otherwise its length cannot be trusted.
            let next = declared_end(bytes, at).unwrap_or(at + 1);
            let damaged =
                (next..bytes.len()).any(|o| frame_at(bytes, o).is_some_and(|(w, _)| !w.is_empty()));
            return Log {
                frames,
                whole: at,
                damaged_at: damaged.then_some(at),
            };
        };
        frames.push(writes);
        at = end;
    }
    Log {
        frames,
        whole: at,
        damaged_at: None,
    }
}

/// The end of the frame starting at `at` if its header is whole and its length fits
/// in `bytes`.
fn declared_end(bytes: &[u8], at: usize) -> Option<usize> {
    let header = bytes.get(at..at.checked_add(FRAME_HEADER)?)?;
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let end = (at + FRAME_HEADER).checked_add(len)?;
    (end <= bytes.len()).then_some(end)
}

/// The writes of the whole, intact frame starting at `at`, and where it ends.
fn frame_at(bytes: &[u8], at: usize) -> Option<(Vec<Write<'_>>, usize)> {
    let end = declared_end(bytes, at)?;
    let payload = &bytes[at + FRAME_HEADER..end];
    // Parsed first: a stray offset fails that within a few bytes, cheaper than a CRC.
    let writes = parse(payload)?;
    let crc = u32::from_le_bytes(bytes[at + 4..at + FRAME_HEADER].try_into().ok()?);
    (crc32fast::hash(payload) == crc).then_some((writes, end))
}

type Write<'a> = (&'a [u8], Option<&'a [u8]>);

/// The writes of a frame's payload, or `None` when it does not parse.
fn parse(payload: &[u8]) -> Option<Vec<Write<'_>>> {
    fn take<'a>(rest: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, tail) = rest.split_at_checked(n)?;
        *rest = tail;
        Some(head)
    }
    let mut out = Vec::new();
    let mut rest = payload;
    while let Some((&op, tail)) = rest.split_first() {
        rest = tail;
        let key_len = u32::from_le_bytes(take(&mut rest, 4)?.try_into().ok()?) as usize;
        let key = take(&mut rest, key_len)?;
        let value = match op {
            OP_PUT => {
                let value_len = u32::from_le_bytes(take(&mut rest, 4)?.try_into().ok()?) as usize;
                Some(take(&mut rest, value_len)?)
            }
            OP_REMOVE => None,
            _ => return None,
        };
        out.push((key, value));
    }
    Some(out)
}

/// Applies a batch's writes to sled, in order. The frame makes the batch atomic
/// across a crash, so sled gets the writes one by one: its `apply_batch` rolls its I/O
/// buffer twice per batch (two `sync_file_range`s on its thread pool), whatever the
/// flush policy.
/// Record bodies go to their files first (one `write` per file per batch), and sled
/// gets the pointers to them; with `inline`, sled gets the bodies themselves.
fn apply_writes<'a>(
    db: &sled::Db,
    bodies: &Bodies,
    writes: impl IntoIterator<Item = Write<'a>>,
    inline: bool,
) -> Result<(), Error> {
    let writes: Vec<Write<'a>> = writes.into_iter().collect();
    let to_files = |key: &[u8]| !inline && Bodies::holds(key);
    let to_append: Vec<(&[u8], &[u8])> = writes
        .iter()
        .filter_map(|&(key, value)| Some((key, value?)).filter(|_| to_files(key)))
        .collect();
    let mut pointers = bodies.append_all(&to_append)?.into_iter();
    for (key, value) in writes {
        match value {
            Some(_) if to_files(key) => {
                let pointer = pointers
                    .next()
                    .ok_or_else(|| Error::Storage("a record body was not appended".to_owned()))?;
                db.insert(key, pointer).map(drop)
            }
            Some(value) => db.insert(key, value).map(drop),
            None => db.remove(key).map(drop),
        }
        .map_err(storage)?;
    }
    Ok(())
}

fn entry(item: sled::Result<(sled::IVec, sled::IVec)>) -> Result<Entry, Error> {
    item.map(|(k, v)| (k.to_vec(), v.to_vec())).map_err(storage)
}

/// The key layout. Integers are big-endian so that range scans run in numeric order;
/// ids that precede another field are followed by a 0 byte, which none of them can
/// contain, so a prefix scan never runs into a longer id.
pub(crate) mod keys {
    pub(crate) const FORMAT: &[u8] = b"m/format";
    pub(crate) const EPOCH: &[u8] = b"m/epoch";
    pub(crate) const HEAD: &[u8] = b"m/head";
    /// The record index of formats 1 to 3, by key alone (see [`crate::slots`]).
    pub(crate) const RECORDS: &[u8] = b"r/";
    /// The record index since format 4: `i/{generation}{key}`.
    pub(crate) const INDEX: &[u8] = b"i/";
    pub(crate) const BODIES: &[u8] = b"R/";
    /// The first key after every `R/` key.
    pub(crate) const BODIES_END: &[u8] = b"R0";
    pub(crate) const LOG: &[u8] = b"l/";
    pub(crate) const EXPIRY: &[u8] = b"x/";
    pub(crate) const STREAMS: &[u8] = b"s/";
    /// Stream events by slot (format 3): `E/{slot}{attempt}{seq}`.
    pub(crate) const EVENT_SLOTS: &[u8] = b"E/";

    pub(crate) const EXPIRE_RECORD: u8 = b'r';
    pub(crate) const PURGE_TOMBSTONE: u8 = b't';
    pub(crate) const DROP_STREAM: u8 = b's';

    fn join(parts: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        for p in parts {
            out.extend_from_slice(p);
        }
        out
    }

    pub(crate) fn record(key: &str) -> Vec<u8> {
        join(&[RECORDS, key.as_bytes()])
    }

    /// A record's index entry (format 4): its generation (big-endian), then its key.
    pub(crate) fn index(generation: u32, key: &str) -> Vec<u8> {
        join(&[INDEX, &generation.to_be_bytes(), key.as_bytes()])
    }

    pub(crate) fn index_generation(storage_key: &[u8]) -> Option<u32> {
        let raw = storage_key.strip_prefix(INDEX)?.get(..4)?;
        Some(u32::from_be_bytes(raw.try_into().ok()?))
    }

    /// The record key of an index entry.
    pub(crate) fn index_entry_key(storage_key: &[u8]) -> Option<&[u8]> {
        storage_key.strip_prefix(INDEX)?.get(4..)
    }

    /// Where a record's bytes live in format 2: `R/` and its slot. Slots are handed
    /// out in creation order, so new records (and their updates while in flight) land
    /// in the tree's last leaves, which stay cached however large the journal grows.
    pub(crate) fn body(slot: u64) -> Vec<u8> {
        join(&[BODIES, &slot.to_be_bytes()])
    }

    pub(crate) fn body_slot(storage_key: &[u8]) -> Option<u64> {
        let raw = storage_key.strip_prefix(BODIES)?;
        Some(u64::from_be_bytes(raw.try_into().ok()?))
    }

    /// The index value that points a record key at its slot: `@` and the slot. A
    /// format-1 record is stored inline under its key instead (JSON, starting `{`).
    pub(crate) fn pointer(slot: u64) -> Vec<u8> {
        join(&[b"@", &slot.to_be_bytes()])
    }

    pub(crate) fn parse_pointer(value: &[u8]) -> Option<u64> {
        let raw = value.strip_prefix(b"@")?;
        Some(u64::from_be_bytes(raw.try_into().ok()?))
    }

    pub(crate) fn log(seq: u64) -> Vec<u8> {
        join(&[LOG, &seq.to_be_bytes()])
    }

    pub(crate) fn log_seq(storage_key: &[u8]) -> Option<u64> {
        let raw = storage_key.strip_prefix(LOG)?;
        Some(u64::from_be_bytes(raw.try_into().ok()?))
    }

    /// The task index of formats 1 to 5: `t/{task}\0{created µs}{key}`, in order
    /// of creation time, which is not the listings' order (see [`TASKS`]).
    pub(crate) const TASKS_BY_TIME: &[u8] = b"t/";
    /// The task index since format 6: `T/{task}\0{slot}{key}`, in the listings'
    /// order, so that a page of a task's records starts with one seek.
    pub(crate) const TASKS: &[u8] = b"T/";

    pub(crate) fn task_by_time_prefix(task: &str) -> Vec<u8> {
        join(&[TASKS_BY_TIME, task.as_bytes(), &[0]])
    }

    #[cfg(test)]
    pub(crate) fn task_by_time(task: &str, created_us: u64, key: &str) -> Vec<u8> {
        join(&[
            &task_by_time_prefix(task),
            &created_us.to_be_bytes(),
            key.as_bytes(),
        ])
    }

    /// The task and the record key behind an entry of the older task index.
    pub(crate) fn task_by_time_entry(storage_key: &[u8]) -> Option<(&[u8], &[u8])> {
        let raw = storage_key.strip_prefix(TASKS_BY_TIME)?;
        let end = raw.iter().position(|b| *b == 0)?;
        Some((&raw[..end], raw.get(end + 1 + 8..)?))
    }

    pub(crate) fn task_prefix(task: &str) -> Vec<u8> {
        join(&[TASKS, task.as_bytes(), &[0]])
    }

    pub(crate) fn task(task: &str, slot: u64, key: &str) -> Vec<u8> {
        join(&[&task_prefix(task), &slot.to_be_bytes(), key.as_bytes()])
    }

    /// The slot and the record key behind a task-index entry of `prefix` (the
    /// task's [`task_prefix`]).
    pub(crate) fn task_entry<'a>(prefix: &[u8], storage_key: &'a [u8]) -> Option<(u64, &'a [u8])> {
        let raw = storage_key.strip_prefix(prefix)?;
        let slot = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
        Some((slot, &raw[8..]))
    }

    /// An expiry index entry: due time, kind, then an id that makes the key unique;
    /// the value lists the keys to look at.
    pub(crate) fn expiry(due_us: u64, kind: u8, id: &str) -> Vec<u8> {
        join(&[EXPIRY, &due_us.to_be_bytes(), &[kind], id.as_bytes()])
    }

    /// The first expiry key that is due after `now_us`.
    pub(crate) fn expiry_end(now_us: u64) -> Vec<u8> {
        join(&[EXPIRY, &now_us.saturating_add(1).to_be_bytes()])
    }

    /// `(due, kind)` of an expiry entry.
    pub(crate) fn parse_expiry(storage_key: &[u8]) -> Option<(u64, u8)> {
        let raw = storage_key.strip_prefix(EXPIRY)?;
        let due = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
        let kind = *raw.get(8)?;
        Some((due, kind))
    }

    /// `(due, kind, keys)` of a whole expiry entry, or why it is damaged: a key
    /// that does not parse, a kind this build never writes, or a value that is not
    /// the list of keys. Retention leaves a damaged entry in place, and `verify`
    /// names it.
    pub(crate) fn parse_expiry_entry(
        storage_key: &[u8],
        value: &[u8],
    ) -> Result<(u64, u8, Vec<String>), String> {
        let (due, kind) = parse_expiry(storage_key)
            .ok_or_else(|| "its key holds no due time and kind".to_owned())?;
        if ![EXPIRE_RECORD, PURGE_TOMBSTONE, DROP_STREAM].contains(&kind) {
            return Err(format!("its kind {kind:#04x} is none the journal writes"));
        }
        let due_keys: Vec<String> = serde_json::from_slice(value)
            .map_err(|e| format!("its value is not a list of keys: {e}"))?;
        Ok((due, kind, due_keys))
    }

    pub(crate) fn stream(key: &str) -> Vec<u8> {
        join(&[STREAMS, key.as_bytes()])
    }

    /// Where a stream's events are stored: in its slot, numbered in creation order
    /// (format 3: a new stream's events land in the newest leaves, as records do in
    /// theirs), or under its key (streams begun under an older format).
    #[derive(Debug, Clone, Copy)]
    pub(crate) enum Events<'a> {
        Key(&'a str),
        Slot(u64),
    }

    impl<'a> Events<'a> {
        /// The events of stream `key`, whose metadata names `slot` (or none).
        pub(crate) fn of(key: &'a str, slot: Option<u64>) -> Self {
            slot.map_or(Events::Key(key), Events::Slot)
        }
    }

    pub(crate) fn events_prefix(at: Events<'_>) -> Vec<u8> {
        match at {
            Events::Key(key) => join(&[b"e/", key.as_bytes(), &[0]]),
            Events::Slot(slot) => join(&[EVENT_SLOTS, &slot.to_be_bytes()]),
        }
    }

    pub(crate) fn attempt_prefix(at: Events<'_>, attempt: u32) -> Vec<u8> {
        join(&[&events_prefix(at), &attempt.to_be_bytes()])
    }

    pub(crate) fn event(at: Events<'_>, attempt: u32, seq: u64) -> Vec<u8> {
        join(&[&attempt_prefix(at, attempt), &seq.to_be_bytes()])
    }

    /// The slot an `E/` event key belongs to.
    pub(crate) fn events_slot(storage_key: &[u8]) -> Option<u64> {
        let raw = storage_key.strip_prefix(EVENT_SLOTS)?.get(..8)?;
        Some(u64::from_be_bytes(raw.try_into().ok()?))
    }

    pub(crate) fn event_seq(storage_key: &[u8]) -> Option<u64> {
        let tail = storage_key.len().checked_sub(8)?;
        Some(u64::from_be_bytes(
            storage_key.get(tail..)?.try_into().ok()?,
        ))
    }

    pub(crate) fn kv_prefix(namespace: &str) -> Vec<u8> {
        join(&[b"k/", namespace.as_bytes(), &[0]])
    }

    pub(crate) fn kv(namespace: &str, key: &str) -> Vec<u8> {
        join(&[&kv_prefix(namespace), key.as_bytes()])
    }
}

/// Raw access for tests that tamper with the bytes on disk.
#[cfg(test)]
impl Store {
    pub(crate) fn set_wal_rotate_at(&self, bytes: u64) {
        self.wal().rotate_at = bytes;
    }

    /// Makes the next batch given to sled panic.
    pub(crate) fn panic_next_apply(&self) {
        self.progress.panic_next.store(true, Ordering::SeqCst);
    }

    pub(crate) fn raw_put(&self, key: &[u8], value: &[u8]) -> Result<(), Error> {
        self.db.insert(key, value).map(drop).map_err(storage)
    }

    pub(crate) fn raw_remove(&self, key: &[u8]) -> Result<(), Error> {
        self.db.remove(key).map(drop).map_err(storage)
    }
}

/// Every file under `dir` with its bytes (tests that check nothing was written).
#[cfg(test)]
pub(crate) fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else {
                let bytes = std::fs::read(&path).unwrap();
                out.insert(path.strip_prefix(dir).unwrap().to_owned(), bytes);
            }
        }
    }
    out
}

#[cfg(test)]
mod wal_tests {
    use super::*;

    fn open(dir: &Path) -> Store {
        Store::open(dir, 1 << 20, Durability::Process, true).unwrap()
    }

    fn put(store: &Store, key: &str, value: &str) {
        store.apply(vec![(key.into(), Some(value.into()))]).unwrap();
    }

    fn get(store: &Store, key: &str) -> Option<String> {
        store
            .get(key.as_bytes())
            .unwrap()
            .map(|v| String::from_utf8(v).unwrap())
    }

    /// The log of three batches written into `dir`, and where each frame ends.
    fn three_batches(dir: &Path) -> (Vec<u8>, Vec<usize>) {
        let store = open(dir);
        let mut ends = Vec::new();
        put(&store, "a", "1");
        ends.push(store.wal().len as usize);
        store
            .apply(vec![
                (b"b".to_vec(), Some(b"2".to_vec())),
                (b"a".to_vec(), None),
            ])
            .unwrap();
        ends.push(store.wal().len as usize);
        put(&store, "c", "3");
        ends.push(store.wal().len as usize);
        let bytes = std::fs::read(dir.join(WAL_FILE)).unwrap();
        assert_eq!(bytes.len(), ends[2]);
        (bytes, ends)
    }

    /// A journal whose sled files hold nothing, with `log` as its write-ahead log:
    /// what a killed process leaves when sled had not flushed yet.
    fn reopen_with_log(log: &[u8]) -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()));
        std::fs::write(dir.path().join(WAL_FILE), log).unwrap();
        let store = open(dir.path());
        (dir, store)
    }

    #[test]
    fn the_log_is_applied_again_at_open_in_order() {
        let first = tempfile::tempdir().unwrap();
        let (log, _) = three_batches(first.path());
        let (dir, store) = reopen_with_log(&log);
        assert_eq!(get(&store, "a"), None, "the removal replays after the put");
        assert_eq!(get(&store, "b").as_deref(), Some("2"));
        assert_eq!(get(&store, "c").as_deref(), Some("3"));
        assert_eq!(
            std::fs::metadata(dir.path().join(WAL_FILE)).unwrap().len(),
            0,
            "once sled holds the batches the log is emptied"
        );
        // Replaying over a journal that already holds the batches changes nothing.
        drop(store);
        std::fs::write(dir.path().join(WAL_FILE), &log).unwrap();
        let store = open(dir.path());
        assert_eq!(get(&store, "a"), None);
        assert_eq!(get(&store, "c").as_deref(), Some("3"));
    }

    #[test]
    fn a_torn_or_corrupt_last_frame_is_dropped_and_the_rest_kept() {
        let first = tempfile::tempdir().unwrap();
        let (log, ends) = three_batches(first.path());
        let cut = &log[..ends[1] + (ends[2] - ends[1]) / 2];
        let (_dir, store) = reopen_with_log(cut);
        assert_eq!(get(&store, "b").as_deref(), Some("2"));
        assert_eq!(
            get(&store, "c"),
            None,
            "the torn batch was never acknowledged"
        );

        let mut flipped = log.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0xff;
        let (_dir, store) = reopen_with_log(&flipped);
        assert_eq!(get(&store, "b").as_deref(), Some("2"));
        assert_eq!(
            get(&store, "c"),
            None,
            "a frame that fails its CRC is not applied"
        );
    }

    #[test]
    fn a_damaged_frame_with_whole_frames_after_it_is_corruption_not_a_torn_tail() {
        let first = tempfile::tempdir().unwrap();
        let (log, ends) = three_batches(first.path());
        // A byte of the second frame's payload; then its length, now past the end.
        let mut payload = log.clone();
        payload[ends[0] + FRAME_HEADER + 1] ^= 0xff;
        let mut length = log.clone();
        length[ends[0] + 3] = 0x7f;
        for damaged in [payload, length] {
            let dir = tempfile::tempdir().unwrap();
            drop(open(dir.path()));
            std::fs::write(dir.path().join(WAL_FILE), &damaged).unwrap();
            let before = snapshot(dir.path());
            let opened = Store::open(dir.path(), 1 << 20, Durability::Process, true);
            let Err(Error::Corrupt { detail, .. }) = &opened else {
                panic!("{:?}", opened.err());
            };
            assert!(
                detail.contains("frame 2 of its write-ahead log"),
                "{detail}"
            );
            assert_eq!(
                snapshot(dir.path()),
                before,
                "the log is kept as it was, and sled was not opened"
            );
            let store = Store::open(dir.path(), 1 << 20, Durability::Process, false);
            assert!(store.is_err(), "nothing of the log was applied meanwhile");

            // A copy opened for reading applies the frames before the damage.
            let (store, damage) = Store::open_copy(dir.path()).unwrap();
            assert_eq!(get(&store, "a").as_deref(), Some("1"));
            assert_eq!(get(&store, "b"), None);
            assert_eq!(
                damage,
                Some(WalDamage {
                    frame: 2,
                    at: ends[0] as u64,
                    bytes_after: (damaged.len() - ends[0]) as u64,
                })
            );
        }
        // A torn last frame with zeros after it (a size extended before the data
        // reached the disk) is still a torn tail.
        let mut torn = log[..ends[1] + (ends[2] - ends[1]) / 2].to_vec();
        torn.extend([0; 64]);
        let (_dir, store) = reopen_with_log(&torn);
        assert_eq!(get(&store, "b").as_deref(), Some("2"));
        assert_eq!(get(&store, "c"), None);
    }

    #[test]
    fn replaying_the_log_syncs_sled_for_real_before_emptying_it_whatever_the_mode() {
        let first = tempfile::tempdir().unwrap();
        let (log, _) = three_batches(first.path());
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()));
        let wal = dir.path().join(WAL_FILE);
        std::fs::write(&wal, &log).unwrap();
        // The log may hold batches a `Durability::Node` sidecar acknowledged.
        sync_fault::set(true);
        let opened = Store::open(dir.path(), 1 << 20, Durability::Process, false);
        sync_fault::set(false);
        assert!(
            opened.is_err(),
            "the log was emptied without a real sync of sled"
        );
        assert_eq!(std::fs::read(&wal).unwrap(), log, "the log is kept");
        drop(opened);
        let store = Store::open(dir.path(), 1 << 20, Durability::Process, false).unwrap();
        assert_eq!(get(&store, "b").as_deref(), Some("2"));
        assert_eq!(get(&store, "c").as_deref(), Some("3"));
        assert_eq!(std::fs::metadata(&wal).unwrap().len(), 0);
    }

    #[test]
    fn a_failed_sync_at_rotation_is_not_retried_and_keeps_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20, Durability::Node, true).unwrap();
        put(&store, "a", "1");
        let logged = std::fs::read(dir.path().join(WAL_FILE)).unwrap();
        store.set_wal_rotate_at(1);
        sync_fault::set(true);
        let refused = store.apply(vec![(b"b".to_vec(), Some(b"2".to_vec()))]);
        sync_fault::set(false);
        assert!(refused.is_err(), "a batch was logged after a failed sync");
        // A second sync could report a success for pages the first could not write.
        let again = store.apply(vec![(b"b".to_vec(), Some(b"2".to_vec()))]);
        let reason = again
            .expect_err("writes went on after a failed sync")
            .to_string();
        assert!(reason.contains("restarts"), "{reason}");
        assert!(store.flush().is_err());
        assert_eq!(
            std::fs::read(dir.path().join(WAL_FILE)).unwrap(),
            logged,
            "the log was emptied or written to"
        );
        assert_eq!(get(&store, "a").as_deref(), Some("1"), "reads go on");
        drop(store);
        let store = Store::open(dir.path(), 1 << 20, Durability::Node, false).unwrap();
        assert_eq!(get(&store, "a").as_deref(), Some("1"));
        put(&store, "b", "2");
        assert_eq!(get(&store, "b").as_deref(), Some("2"));
    }

    #[test]
    fn a_failed_sync_of_the_record_file_written_at_rotation_keeps_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let wal = dir.path().join(WAL_FILE);
        let store = open(dir.path());
        // A held record body: its record file is written only when the log rotates.
        let body = keys::body(0);
        let record = b"{\"key\":\"k0\"}".to_vec();
        store
            .log(Vec::new(), vec![(body.clone(), record.clone())])
            .unwrap()
            .apply_here(None)
            .unwrap();
        let logged = std::fs::read(&wal).unwrap();
        store.set_wal_rotate_at(1);
        sync_record_file::set(true);
        let refused = store.apply(vec![(b"b".to_vec(), Some(b"2".to_vec()))]);
        sync_record_file::set(false);
        let reason = refused
            .expect_err("the log was emptied before the record file was synced")
            .to_string();
        assert!(
            reason.contains("rotate") && reason.contains("records"),
            "{reason}"
        );
        let again = store.apply(vec![(b"b".to_vec(), Some(b"2".to_vec()))]);
        assert!(again.is_err(), "a sync after a failed one was trusted");
        assert_eq!(std::fs::read(&wal).unwrap(), logged, "the log is kept");
        assert_eq!(
            store.get(&body).unwrap(),
            Some(record.clone()),
            "reads go on"
        );
        drop(store);
        // A restart replays the log, which still holds the record.
        let store = Store::open(dir.path(), 1 << 20, Durability::Process, false).unwrap();
        assert_eq!(store.get(&body).unwrap(), Some(record));
        assert_eq!(get(&store, "b"), None, "the refused batch was never logged");
        put(&store, "b", "2");
        assert_eq!(get(&store, "b").as_deref(), Some("2"));
    }

    #[test]
    fn a_rotation_syncs_sled_and_the_record_files_for_real_whatever_the_mode() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        put(&store, "a", "1");
        let logged = std::fs::read(dir.path().join(WAL_FILE)).unwrap();
        store.set_wal_rotate_at(1);
        sync_fault::set(true);
        let refused = store.apply(vec![(b"b".to_vec(), Some(b"2".to_vec()))]);
        sync_fault::set(false);
        assert!(
            refused.is_err(),
            "the log was emptied without a real sync of sled"
        );
        assert_eq!(
            std::fs::read(dir.path().join(WAL_FILE)).unwrap(),
            logged,
            "the log was emptied or written to"
        );
    }

    #[test]
    fn a_panic_while_sled_takes_a_batch_strands_no_reader_and_stops_writes() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(open(dir.path()));
        put(&store, "a", "1");
        store.progress.panic_next.store(true, Ordering::SeqCst);
        let logged = store
            .log(vec![(b"b".to_vec(), Some(b"2".to_vec()))], Vec::new())
            .unwrap();
        let landed =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| logged.apply_here(None)));
        // A reader on another thread, so that one stranded fails the test rather than
        // hangs it.
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = Arc::clone(&store);
        let reading = std::thread::spawn(move || tx.send(get(&reader, "a")));
        let read = rx.recv_timeout(std::time::Duration::from_secs(5));
        assert_eq!(
            read.ok().flatten().as_deref(),
            Some("1"),
            "the reader was stranded"
        );
        reading.join().unwrap().unwrap();
        assert!(matches!(landed, Ok(Err(_))), "the panic went on up");
        let refused = store.apply(vec![(b"c".to_vec(), Some(b"3".to_vec()))]);
        assert!(refused.is_err(), "writes went on after a failed batch");
        // The batch stays in the log: a restart gives it to sled.
        let store = Arc::into_inner(store).unwrap();
        drop(store);
        let store = open(dir.path());
        assert_eq!(get(&store, "b").as_deref(), Some("2"));
        put(&store, "c", "3");
        assert_eq!(get(&store, "c").as_deref(), Some("3"));
    }

    #[test]
    fn the_log_is_rotated_once_sled_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        store.set_wal_rotate_at(1_024);
        let value = "v".repeat(300);
        for i in 0..20 {
            put(&store, &format!("k{i}"), &value);
            let on_disk = std::fs::metadata(dir.path().join(WAL_FILE)).unwrap().len();
            assert!(
                on_disk < 1_024 + 400,
                "log of {on_disk} bytes after batch {i}"
            );
        }
        drop(store);
        // Nothing in the log any more, yet every batch is there.
        std::fs::write(dir.path().join(WAL_FILE), b"").unwrap();
        let store = open(dir.path());
        for i in 0..20 {
            assert_eq!(
                get(&store, &format!("k{i}")).as_deref(),
                Some(value.as_str())
            );
        }
    }

    #[test]
    fn a_reader_waits_for_a_logged_batch_to_be_applied() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let logged = store
            .log(vec![(b"k".to_vec(), Some(b"v".to_vec()))], Vec::new())
            .unwrap();
        std::thread::scope(|scope| {
            let reader = scope.spawn(|| get(&store, "k"));
            // Long enough for a reader that does not wait to read the old value.
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(!reader.is_finished(), "the reader did not wait");
            logged.apply(None);
            assert_eq!(reader.join().unwrap().as_deref(), Some("v"));
        });
    }

    #[test]
    fn a_batch_dropped_unapplied_leaves_no_frame() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        put(&store, "a", "1");
        let before = store.wal().len;
        drop(
            store
                .log(vec![(b"b".to_vec(), Some(b"2".to_vec()))], Vec::new())
                .unwrap(),
        );
        assert_eq!(store.wal().len, before);
        drop(store);
        let store = open(dir.path());
        assert_eq!(get(&store, "a").as_deref(), Some("1"));
        assert_eq!(get(&store, "b"), None);
    }

    #[test]
    fn batches_reach_sled_in_log_order_on_either_thread() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        for i in 0..10u32 {
            // A large batch for the applier, then a small one applied here at once:
            // the small one must still land last.
            let mut large: Vec<OwnedWrite> = (0..2_000)
                .map(|j| (format!("filler-{j}").into_bytes(), Some(b"x".to_vec())))
                .collect();
            large.push((b"k".to_vec(), Some(format!("large-{i}").into_bytes())));
            store.log(large, Vec::new()).unwrap().apply(None);
            let small = format!("small-{i}");
            store
                .log(
                    vec![(b"k".to_vec(), Some(small.clone().into_bytes()))],
                    Vec::new(),
                )
                .unwrap()
                .apply_here(None)
                .unwrap();
            // Give an applier that ran late the time to overwrite it.
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert_eq!(get(&store, "k"), Some(small), "round {i}");
        }
    }

    fn held(pairs: &[(&str, &str)]) -> Vec<HeldWrite> {
        pairs
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect()
    }

    fn keys_and_values(entries: impl Iterator<Item = Result<Entry, Error>>) -> Vec<String> {
        entries
            .map(|e| {
                let (k, v) = e.unwrap();
                format!(
                    "{}={}",
                    String::from_utf8(k).unwrap(),
                    String::from_utf8(v).unwrap()
                )
            })
            .collect()
    }

    #[test]
    fn held_values_are_read_over_sleds_but_not_given_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        for (k, v) in [("p/a", "1"), ("p/c", "3"), ("p/e", "5")] {
            put(&store, k, v);
        }
        store
            .log(
                Vec::new(),
                held(&[("p/b", "2h"), ("p/c", "3h"), ("p/f", "6h")]),
            )
            .unwrap()
            .apply(None);
        assert_eq!(get(&store, "p/c").as_deref(), Some("3h"));
        assert_eq!(store.db.get(b"p/b").unwrap(), None, "sled got a held value");
        let all = ["p/a=1", "p/b=2h", "p/c=3h", "p/e=5", "p/f=6h"];
        assert_eq!(keys_and_values(store.scan_prefix(b"p/")), all);
        let mut reversed = all.to_vec();
        reversed.reverse();
        assert_eq!(keys_and_values(store.scan_prefix(b"p/").rev()), reversed);
        assert_eq!(
            keys_and_values(store.range(b"p/b", b"p/e")),
            ["p/b=2h", "p/c=3h"]
        );
        assert_eq!(
            keys_and_values(store.range_from(b"p/d")),
            ["p/e=5", "p/f=6h"]
        );
        // From both ends at once, meeting in the middle.
        let mut both = store.scan_prefix(b"p/");
        let mut met = Vec::new();
        while let (Some(front), back) = (both.next(), both.next_back()) {
            met.push(front);
            met.extend(back);
        }
        let mut met = keys_and_values(met.into_iter());
        met.sort();
        assert_eq!(met, all);

        // A later write of a held key replaces it, in sled.
        put(&store, "p/b", "2");
        assert_eq!(get(&store, "p/b").as_deref(), Some("2"));
        assert_eq!(store.db.get(b"p/b").unwrap().as_deref(), Some(&b"2"[..]));
        assert_eq!(lock(&store.progress.held).len(), 2);
    }

    #[test]
    fn held_values_survive_a_restart_and_reach_sled_at_rotation() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(dir.path());
            store
                .log(Vec::new(), held(&[("h", "1")]))
                .unwrap()
                .apply_here(None)
                .unwrap();
        }
        // The log's frames are applied whole at open.
        let store = open(dir.path());
        assert_eq!(store.db.get(b"h").unwrap().as_deref(), Some(&b"1"[..]));
        store
            .log(Vec::new(), held(&[("h", "2")]))
            .unwrap()
            .apply_here(None)
            .unwrap();
        store.set_wal_rotate_at(1);
        put(&store, "other", "x");
        assert_eq!(store.wal().len, {
            let mut frame = vec![0; FRAME_HEADER];
            push_write(&mut frame, b"other", Some(b"x"));
            frame.len() as u64
        });
        assert_eq!(store.db.get(b"h").unwrap().as_deref(), Some(&b"2"[..]));
        assert!(lock(&store.progress.held).is_empty());
        assert_eq!(get(&store, "h").as_deref(), Some("2"));
    }

    fn set_body(store: &Store, slot: u64, value: Option<&[u8]>) {
        store
            .apply(vec![(keys::body(slot), value.map(<[u8]>::to_vec))])
            .unwrap();
    }

    #[test]
    fn record_bodies_live_in_their_files_and_sled_keeps_pointers() {
        let dir = tempfile::tempdir().unwrap();
        let value = br#"{"key":"k","state":"completed"}"#.to_vec();
        {
            let store = open(dir.path());
            set_body(&store, 5, Some(&value));
            let raw = store.db.get(keys::body(5)).unwrap().unwrap();
            assert_eq!(raw.len(), 17, "sled holds the record itself");
            assert_eq!(store.get(&keys::body(5)).unwrap(), Some(value.clone()));
            let scanned: Vec<_> = store
                .scan_prefix(keys::BODIES)
                .map(|e| e.unwrap().1)
                .collect();
            assert_eq!(scanned, std::slice::from_ref(&value));
            let file = dir.path().join("records").join("00000000");
            assert_eq!(std::fs::metadata(&file).unwrap().len(), value.len() as u64);
        }
        // Replayed from the write-ahead log at open, the body is given to sled itself
        // (any format reads it; an older build's journal stays readable by it), and
        // the file is not appended to again.
        let store = open(dir.path());
        assert_eq!(store.get(&keys::body(5)).unwrap(), Some(value.clone()));
        assert_eq!(
            store.db.get(keys::body(5)).unwrap().as_deref(),
            Some(value.as_slice())
        );
        let file = dir.path().join("records").join("00000000");
        assert_eq!(std::fs::metadata(&file).unwrap().len(), value.len() as u64);
        // A pointer to a file that is gone is an error naming it, and no file is made.
        let mut pointer = vec![0xFF];
        pointer.extend_from_slice(&9u32.to_be_bytes());
        pointer.extend_from_slice(&0u64.to_be_bytes());
        pointer.extend_from_slice(&2u32.to_be_bytes());
        store.raw_put(&keys::body(9 << 16), &pointer).unwrap();
        let err = store.get(&keys::body(9 << 16)).unwrap_err().to_string();
        assert!(err.contains("00000009"), "{err}");
        assert!(!dir.path().join("records").join("00000009").exists());
        // One batch, bodies of two generations and a plain write between them.
        store
            .apply(vec![
                (keys::body(7), Some(b"seven".to_vec())),
                (b"plain".to_vec(), Some(b"p".to_vec())),
                (keys::body(1 << 16), Some(b"gen-one".to_vec())),
                (keys::body(8), Some(b"eight".to_vec())),
            ])
            .unwrap();
        for (slot, body) in [(7, "seven"), (1 << 16, "gen-one"), (8, "eight")] {
            assert_eq!(store.get(&keys::body(slot)).unwrap(), Some(body.into()));
        }
        assert_eq!(get(&store, "plain").as_deref(), Some("p"));
        let gen_one = dir.path().join("records").join("00000001");
        assert_eq!(std::fs::metadata(gen_one).unwrap().len(), 7);
        // A value stored inline (as by format 4) is read as it is.
        store.raw_put(&keys::body(6), b"{}").unwrap();
        assert_eq!(store.get(&keys::body(6)).unwrap(), Some(b"{}".to_vec()));
    }

    /// A pointer's bytes: tag, generation, offset, length.
    fn pointer_bytes(generation: u32, offset: u64, len: u32) -> Vec<u8> {
        let mut pointer = vec![0xFF];
        pointer.extend_from_slice(&generation.to_be_bytes());
        pointer.extend_from_slice(&offset.to_be_bytes());
        pointer.extend_from_slice(&len.to_be_bytes());
        pointer
    }

    #[test]
    fn only_record_bodies_are_read_as_pointers_and_only_within_their_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        set_body(&store, 1, Some(br#"{"key":"k"}"#));
        // A stream event or a kv value may be any bytes, a pointer's among them.
        let lookalike = pointer_bytes(0, 0, 2);
        for key in [
            keys::event(keys::Events::Slot(1), 1, 0),
            keys::kv("ns", "k"),
        ] {
            store
                .apply(vec![(key.clone(), Some(lookalike.clone()))])
                .unwrap();
            assert_eq!(store.get(&key).unwrap(), Some(lookalike.clone()));
            let scanned: Vec<_> = store.scan_prefix(&key).map(|e| e.unwrap().1).collect();
            assert_eq!(scanned, std::slice::from_ref(&lookalike));
        }
        // A damaged pointer to a record: an error, with nothing allocated for it.
        store
            .raw_put(&keys::body(2), &pointer_bytes(0, 0, u32::MAX))
            .unwrap();
        let err = store.get(&keys::body(2)).unwrap_err().to_string();
        assert!(err.contains("past the end of the file"), "{err}");
        store
            .raw_put(&keys::body(3), &pointer_bytes(0, u64::MAX, 2))
            .unwrap();
        let err = store.get(&keys::body(3)).unwrap_err().to_string();
        assert!(err.contains("past the end of the file"), "{err}");
    }

    #[test]
    fn a_generation_emptied_by_retention_loses_its_file_at_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let file = |g: &str| dir.path().join("records").join(g);
        for slot in [1, 1 << 16, 2 << 16] {
            set_body(&store, slot, Some(b"{}"));
        }
        set_body(&store, 1, None);
        store.set_wal_rotate_at(1);
        put(&store, "other", "x");
        // Found empty once: kept, for a reader that took a pointer just before.
        assert!(file("00000000").exists());
        put(&store, "other", "y");
        assert!(
            !file("00000000").exists(),
            "an emptied generation keeps its file"
        );
        assert!(file("00000001").exists());
        assert!(file("00000002").exists(), "the newest generation is kept");
        assert_eq!(
            store.get(&keys::body(1 << 16)).unwrap(),
            Some(b"{}".to_vec())
        );
    }
}
