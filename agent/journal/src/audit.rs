//! Reading the journal: by the live sidecar (through [`crate::Journal`]) and offline
//! (through [`Audit`], on a private copy of a journal directory no process holds).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use outrigger_types::{IdempotencyKey, TaskId};

use crate::Error;
use crate::chain::{self, Head, LogEntry, VerifyReport};
use crate::record::{Filter, Record, TimelineEntry};
use crate::slots;
use crate::store::{self, Store, WalDamage, keys};
use crate::stream::{StreamKey, StreamMeta, chunk};
use crate::writer::{decode_record, decode_stream};

/// Reads go straight to the store: they never queue behind the writer, and wait only
/// until sled has every commit already logged (see `Store::log`). Answers that
/// release a side effect's outcome go through the writer.
#[derive(Clone)]
pub(crate) struct Reader {
    pub(crate) store: Arc<Store>,
}

impl Reader {
    pub(crate) fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, Error> {
        slots::read(&self.store, key.as_str())?
            .map(|bytes| decode_record(key.as_str(), &bytes))
            .transpose()
    }

    /// Matching records, oldest first. Undecodable records (and those whose record
    /// file is damaged) are skipped with a warning (`verify` names them), so that one
    /// damaged record cannot hide all the others.
    pub(crate) fn list(&self, filter: &Filter) -> Result<Vec<Record>, Error> {
        let mut out = Vec::new();
        let mut keep = |key: &str, bytes: Result<Vec<u8>, Error>| {
            match bytes.and_then(|bytes| decode_record(key, &bytes)) {
                Ok(rec) if filter.matches(&rec) => out.push(rec),
                Ok(_) => {}
                Err(e @ Error::Decode { .. }) => {
                    tracing::warn!(error = %e, "skipping an undecodable journal record");
                }
                Err(e) => return Err(e),
            }
            Ok(())
        };
        if let Some(task) = &filter.task {
            let prefix = keys::task_prefix(task.as_str());
            for entry in self.store.scan_prefix(&prefix) {
                let (index, _) = entry?;
                let Some(key) = keys::task_entry_key(task.as_str(), &index) else {
                    continue;
                };
                let key = String::from_utf8_lossy(key);
                if let Some(bytes) = slots::read(&self.store, &key).transpose() {
                    keep(&key, bytes)?;
                }
            }
        } else {
            for entry in slots::scan(&self.store)? {
                let (key, bytes) = entry?;
                keep(&key, bytes)?;
            }
        }
        out.sort_by(|a, b| (a.created_at, &a.key).cmp(&(b.created_at, &b.key)));
        if let Some(limit) = filter.limit {
            out.truncate(limit);
        }
        Ok(out)
    }

    pub(crate) fn export(&self, filter: &Filter, out: &mut dyn Write) -> Result<usize, Error> {
        let records = self.list(filter)?;
        for rec in &records {
            serde_json::to_writer(&mut *out, rec)
                .map_err(|e| Error::Storage(format!("cannot write the export: {e}")))?;
            out.write_all(b"\n")
                .map_err(|e| Error::Storage(format!("cannot write the export: {e}")))?;
        }
        Ok(records.len())
    }

    /// The hash-chain check. It reads while the writer goes on writing, and no
    /// write waits for it: the chain is checked up to the head read first, and a
    /// record that changed since is checked against the entries written since (see
    /// [`chain::verify`]), so a busy journal is not reported as tampered with.
    pub(crate) fn verify(&self) -> Result<VerifyReport, Error> {
        let head = self
            .store
            .get(keys::HEAD)?
            .map(|bytes| Head::decode(&bytes))
            .transpose()?;
        let log = log_from(&self.store, 1);
        // A record whose bytes cannot be read is reported as missing.
        let records = slots::scan(&self.store)?.filter_map(|entry| match entry {
            Ok((key, Ok(bytes))) => Some(Ok((key, bytes))),
            Ok((key, Err(e @ Error::Decode { .. }))) => {
                tracing::warn!(%key, error = %e, "a journal record cannot be read");
                None
            }
            Ok((_, Err(e))) | Err(e) => Some(Err(e)),
        });
        chain::verify(log, records, head, |after| {
            log_from(&self.store, after.saturating_add(1))
        })
    }

    /// Log entries from `from_seq` on, at most `limit` (for archiving the chain or
    /// inspecting it after `verify` named a sequence number).
    pub(crate) fn log_entries(&self, from_seq: u64, limit: usize) -> Result<Vec<LogEntry>, Error> {
        self.store
            .range_from(&keys::log(from_seq))
            .take_while(|e| e.as_ref().map_or(true, |(k, _)| k.starts_with(keys::LOG)))
            .take(limit)
            .map(|entry| {
                let (key, bytes) = entry?;
                serde_json::from_slice(&bytes).map_err(|e| Error::Decode {
                    what: format!("log entry {:?}", keys::log_seq(&key)),
                    detail: e.to_string(),
                })
            })
            .collect()
    }

    pub(crate) fn timeline(&self, task: &TaskId) -> Result<Vec<TimelineEntry>, Error> {
        let filter = Filter {
            task: Some(task.clone()),
            ..Filter::default()
        };
        Ok(self.list(&filter)?.iter().map(TimelineEntry::of).collect())
    }

    pub(crate) fn stream_meta(&self, key: &StreamKey) -> Result<Option<StreamMeta>, Error> {
        let Some(bytes) = self.store.get(&keys::stream(key.as_str()))? else {
            return Ok(None);
        };
        let mut meta = decode_stream(key.as_str(), &bytes)?;
        meta.last_seq = last_seq(&self.store, meta.events_at(), meta.attempt)?;
        Ok(Some(meta))
    }

    pub(crate) fn stream_events(
        &self,
        key: &StreamKey,
        attempt: u32,
        after_seq: Option<u64>,
    ) -> Result<Vec<(u64, Bytes)>, Error> {
        // The stream's metadata says where its events are; no stream, no events.
        let Some(bytes) = self.store.get(&keys::stream(key.as_str()))? else {
            return Ok(Vec::new());
        };
        let meta = decode_stream(key.as_str(), &bytes)?;
        let events_at = meta.events_at();
        let prefix = keys::attempt_prefix(events_at, attempt);
        let first = match after_seq {
            Some(seq) => match seq.checked_add(1) {
                Some(next) => next,
                None => return Ok(Vec::new()),
            },
            None => 0,
        };
        // The chunk holding `first` starts at or before it: begin at the last chunk
        // key not above it.
        let at = keys::event(events_at, attempt, first);
        let start = match self.store.range(&prefix, &at).next_back() {
            Some(entry) => entry?.0,
            None => prefix.clone(),
        };
        let mut out = Vec::new();
        for entry in self
            .store
            .range_from(&start)
            .take_while(|e| e.as_ref().map_or(true, |(k, _)| k.starts_with(&prefix)))
        {
            let (k, v) = entry?;
            let seq = first_seq_of(&k)?;
            out.extend(
                chunk::decode(seq, Bytes::from(v))?
                    .into_iter()
                    .filter(|(seq, _)| *seq >= first),
            );
        }
        Ok(out)
    }

    pub(crate) fn kv_get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, Error> {
        check_namespace(namespace)?;
        self.store.get(&keys::kv(namespace, key))
    }

    pub(crate) fn kv_scan(&self, namespace: &str) -> Result<Vec<(String, Vec<u8>)>, Error> {
        check_namespace(namespace)?;
        let prefix = keys::kv_prefix(namespace);
        self.store
            .scan_prefix(&prefix)
            .map(|entry| {
                let (k, v) = entry?;
                Ok((String::from_utf8_lossy(&k[prefix.len()..]).into_owned(), v))
            })
            .collect()
    }
}

pub(crate) fn check_namespace(namespace: &str) -> Result<(), Error> {
    if namespace.is_empty() || !namespace.chars().all(|c| c.is_ascii_graphic()) {
        return Err(Error::Invalid {
            what: "kv namespace",
            detail: format!("{namespace:?} must be non-empty visible ASCII"),
        });
    }
    Ok(())
}

/// A read-only view of a journal directory that no process holds: a stopped
/// sidecar's, one moved aside (`<dir>.corrupt-<unix seconds>`), a backup.
///
/// sled has no read-only open, and opening a journal replays its write-ahead log
/// into sled and empties it. So the directory is copied first (into the system's
/// temporary directory, removed when the audit is dropped) and the copy is opened:
/// the original is never written (a read-only mount will do), and its lock is held
/// only for a moment, to see whether a process has it. The cost is the copy: as much free
/// space as the journal takes, and the time to copy it.
///
/// A damaged write-ahead log (a bad frame with whole frames after it, which the
/// sidecar refuses) is read up to the damage, reported by [`Audit::damage`].
pub struct Audit {
    reader: Reader,
    damage: Option<WalDamage>,
    dir: PathBuf,
    /// After `reader`, so that sled is closed before its copy is removed.
    _copy: tempfile::TempDir,
}

impl Audit {
    pub(crate) fn open(dir: &Path) -> Result<Self, Error> {
        store::check_journal(dir)?;
        store::check_unlocked(dir)?;
        let copy = tempfile::Builder::new()
            .prefix("outrigger-audit-")
            .tempdir()
            .map_err(|e| {
                Error::Storage(format!(
                    "cannot create a temporary directory to copy the journal into: {e}"
                ))
            })?;
        let journal = copy.path().join("journal");
        copy_dir(dir, &journal)?;
        // A sidecar that started meanwhile may have changed the files midway.
        store::check_unlocked(dir)?;
        let (store, damage) = Store::open_copy(&journal).map_err(|e| match e {
            Error::Corrupt { detail, .. } => Error::Corrupt {
                dir: dir.to_owned(),
                detail,
            },
            other => other,
        })?;
        crate::journal::stored_format(&store, dir)?;
        Ok(Self {
            reader: Reader {
                store: Arc::new(store),
            },
            damage,
            dir: dir.to_owned(),
            _copy: copy,
        })
    }

    /// The directory read (not its copy).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The damage found in the write-ahead log, if any: what was read stops there.
    pub fn damage(&self) -> Option<&WalDamage> {
        self.damage.as_ref()
    }

    pub fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, Error> {
        self.reader.get(key)
    }

    pub fn list(&self, filter: &Filter) -> Result<Vec<Record>, Error> {
        self.reader.list(filter)
    }

    /// Writes the matching records as JSON Lines; returns how many.
    pub fn export(&self, filter: &Filter, out: &mut dyn Write) -> Result<usize, Error> {
        self.reader.export(filter, out)
    }

    pub fn verify(&self) -> Result<VerifyReport, Error> {
        self.reader.verify()
    }

    pub fn timeline(&self, task: &TaskId) -> Result<Vec<TimelineEntry>, Error> {
        self.reader.timeline(task)
    }

    pub fn log_entries(&self, from_seq: u64, limit: usize) -> Result<Vec<LogEntry>, Error> {
        self.reader.log_entries(from_seq, limit)
    }

    pub fn stream_meta(&self, key: &StreamKey) -> Result<Option<StreamMeta>, Error> {
        self.reader.stream_meta(key)
    }

    pub fn stream_events(
        &self,
        key: &StreamKey,
        attempt: u32,
        after_seq: Option<u64>,
    ) -> Result<Vec<(u64, Bytes)>, Error> {
        self.reader.stream_events(key, attempt, after_seq)
    }
}

/// Copies the directory `from` (files and directories; a journal holds nothing
/// else) to `to`, which must not exist.
fn copy_dir(from: &Path, to: &Path) -> Result<(), Error> {
    let failed = |path: &Path, e: std::io::Error| {
        Error::Storage(format!("cannot copy {} to read it: {e}", path.display()))
    };
    std::fs::create_dir(to).map_err(|e| failed(to, e))?;
    for entry in std::fs::read_dir(from).map_err(|e| failed(from, e))? {
        let entry = entry.map_err(|e| failed(from, e))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(|e| failed(&path, e))?;
        if kind.is_dir() {
            copy_dir(&path, &to.join(entry.file_name()))?;
        } else if kind.is_file() {
            std::fs::copy(&path, to.join(entry.file_name())).map_err(|e| failed(&path, e))?;
        }
    }
    Ok(())
}

/// The log's entries from `seq` on, read lazily.
fn log_from(store: &Store, seq: u64) -> chain::Entries<'static> {
    Box::new(
        store
            .range_from(&keys::log(seq))
            .take_while(|e| e.as_ref().map_or(true, |(k, _)| k.starts_with(keys::LOG)))
            .map(|entry| {
                let (key, bytes) = entry?;
                let seq = keys::log_seq(&key).ok_or_else(|| Error::Decode {
                    what: "a log key".to_owned(),
                    detail: format!("{} bytes, expected 10", key.len()),
                })?;
                Ok((seq, bytes))
            }),
    )
}

/// The highest sequence number stored for an attempt, if any event is.
pub(crate) fn last_seq(
    store: &Store,
    at: keys::Events<'_>,
    attempt: u32,
) -> Result<Option<u64>, Error> {
    let Some(entry) = store
        .scan_prefix(&keys::attempt_prefix(at, attempt))
        .next_back()
    else {
        return Ok(None);
    };
    let (k, v) = entry?;
    let first = first_seq_of(&k)?;
    Ok(Some(first + chunk::count(&v)?.saturating_sub(1)))
}

/// The sequence number of the first event stored under an event key.
fn first_seq_of(storage_key: &[u8]) -> Result<u64, Error> {
    keys::event_seq(storage_key).ok_or_else(|| Error::Decode {
        what: "a stream event key".to_owned(),
        detail: format!("{} bytes, too short", storage_key.len()),
    })
}
