//! The only module that names sled: one `Db`, one tree, prefixed keys (so that each
//! group commit is a single atomic `apply_batch`), and the flush that makes a batch
//! durable. Nothing sled-typed leaves this file, so the engine can be swapped (redb,
//! fjall) without touching the state machine or the writer.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::Error;
use crate::options::Durability;

/// sled's own message when its `flock` on the db file fails.
const SLED_LOCK_MESSAGE: &str = "could not acquire lock";

pub(crate) struct Store {
    db: sled::Db,
    /// A second handle on sled's data file, for `fdatasync` in `Durability::Node`.
    sync_file: Option<File>,
    dir: PathBuf,
}

/// A key/value pair read from the store.
pub(crate) type Entry = (Vec<u8>, Vec<u8>);

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
        let db_file = dir.join("db");
        if create {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::Storage(format!(
                    "cannot create the journal directory {}: {e}",
                    dir.display()
                ))
            })?;
        } else {
            if !dir.is_dir() {
                return Err(Error::NotFound {
                    dir: dir.to_owned(),
                    detail: "the directory does not exist".to_owned(),
                });
            }
            if !db_file.is_file() || !dir.join("conf").is_file() {
                return Err(Error::NotFound {
                    dir: dir.to_owned(),
                    detail: "it holds no journal files (expected `db` and `conf`); \
                             is this the sidecar's journal directory?"
                        .to_owned(),
                });
            }
        }
        // sled reports a held lock as a generic I/O error; asking first gives the
        // caller a distinguishable answer (the CLI falls back to the admin API).
        if db_file.is_file() {
            check_unlocked(dir, &db_file)?;
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
        Ok(Self {
            db,
            sync_file,
            dir: dir.to_owned(),
        })
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        self.db
            .get(key)
            .map(|v| v.map(|v| v.to_vec()))
            .map_err(storage)
    }

    /// Every entry whose key starts with `prefix`, in key order.
    pub(crate) fn scan_prefix(
        &self,
        prefix: &[u8],
    ) -> impl DoubleEndedIterator<Item = Result<Entry, Error>> + use<> {
        self.db.scan_prefix(prefix).map(entry)
    }

    /// Entries with `start <= key < end`, in key order.
    pub(crate) fn range(
        &self,
        start: &[u8],
        end: &[u8],
    ) -> impl DoubleEndedIterator<Item = Result<Entry, Error>> + use<> {
        self.db.range(start.to_vec()..end.to_vec()).map(entry)
    }

    /// Entries with `start <= key`, in key order.
    pub(crate) fn range_from(
        &self,
        start: &[u8],
    ) -> impl DoubleEndedIterator<Item = Result<Entry, Error>> + use<> {
        self.db.range(start.to_vec()..).map(entry)
    }

    /// Applies all writes atomically (all or nothing, also across a crash). `None`
    /// removes the key. In memory only until `flush`.
    pub(crate) fn apply<'a>(
        &self,
        writes: impl IntoIterator<Item = (&'a [u8], Option<&'a [u8]>)>,
    ) -> Result<(), Error> {
        let mut batch = sled::Batch::default();
        for (key, value) in writes {
            match value {
                Some(value) => batch.insert(key, value),
                None => batch.remove(key),
            }
        }
        self.db.apply_batch(batch).map_err(storage)
    }

    /// Makes every applied write durable. Blocking: sled writes its buffers and calls
    /// `sync_file_range`; `Durability::Node` adds an `fdatasync` of the data file.
    pub(crate) fn flush(&self) -> Result<(), Error> {
        self.db.flush().map_err(storage)?;
        if let Some(file) = &self.sync_file {
            file.sync_data()
                .map_err(|e| Error::Storage(format!("fdatasync of the journal failed: {e}")))?;
        }
        Ok(())
    }

    pub(crate) fn size_on_disk(&self) -> u64 {
        self.db.size_on_disk().unwrap_or(0)
    }
}

fn check_unlocked(dir: &Path, db_file: &Path) -> Result<(), Error> {
    let file = File::open(db_file)
        .map_err(|e| Error::Storage(format!("cannot open {}: {e}", db_file.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::Locked {
            dir: dir.to_owned(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(Error::Storage(format!(
            "cannot check the lock on {}: {e}",
            db_file.display()
        ))),
    }
    // The probe lock is released when `file` is closed here.
}

fn open_error(dir: &Path, e: sled::Error) -> Error {
    match e {
        sled::Error::Io(io) if io.to_string().contains(SLED_LOCK_MESSAGE) => Error::Locked {
            dir: dir.to_owned(),
        },
        sled::Error::Corruption { .. } => Error::Corrupt {
            dir: dir.to_owned(),
            detail: e.to_string(),
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
    pub(crate) const RECORDS: &[u8] = b"r/";
    pub(crate) const LOG: &[u8] = b"l/";
    pub(crate) const EXPIRY: &[u8] = b"x/";
    pub(crate) const STREAMS: &[u8] = b"s/";

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

    pub(crate) fn log(seq: u64) -> Vec<u8> {
        join(&[LOG, &seq.to_be_bytes()])
    }

    pub(crate) fn log_seq(storage_key: &[u8]) -> Option<u64> {
        let raw = storage_key.strip_prefix(LOG)?;
        Some(u64::from_be_bytes(raw.try_into().ok()?))
    }

    pub(crate) fn task_prefix(task: &str) -> Vec<u8> {
        join(&[b"t/", task.as_bytes(), &[0]])
    }

    pub(crate) fn task(task: &str, created_us: u64, key: &str) -> Vec<u8> {
        join(&[
            &task_prefix(task),
            &created_us.to_be_bytes(),
            key.as_bytes(),
        ])
    }

    /// The record key behind a task-index entry.
    pub(crate) fn task_entry_key<'a>(task: &str, storage_key: &'a [u8]) -> Option<&'a [u8]> {
        storage_key.get(task_prefix(task).len() + 8..)
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

    pub(crate) fn stream(key: &str) -> Vec<u8> {
        join(&[STREAMS, key.as_bytes()])
    }

    pub(crate) fn events_prefix(key: &str) -> Vec<u8> {
        join(&[b"e/", key.as_bytes(), &[0]])
    }

    pub(crate) fn attempt_prefix(key: &str, attempt: u32) -> Vec<u8> {
        join(&[&events_prefix(key), &attempt.to_be_bytes()])
    }

    pub(crate) fn event(key: &str, attempt: u32, seq: u64) -> Vec<u8> {
        join(&[&attempt_prefix(key, attempt), &seq.to_be_bytes()])
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
    pub(crate) fn raw_put(&self, key: &[u8], value: &[u8]) -> Result<(), Error> {
        self.db.insert(key, value).map(drop).map_err(storage)
    }

    pub(crate) fn raw_remove(&self, key: &[u8]) -> Result<(), Error> {
        self.db.remove(key).map(drop).map_err(storage)
    }
}
