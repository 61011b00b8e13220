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

    /// Matching records in the listing's order (see [`Cursor`]), after
    /// `filter.after`, at most `filter.limit`. Records are read and decoded one by
    /// one until the page is full, so a page costs what it holds (and what the
    /// filter passes over), not the journal's size. Undecodable records (and those
    /// whose record file is damaged) are skipped with a warning (`verify` names
    /// them), so that one damaged record cannot hide all the others.
    pub(crate) fn page(&self, filter: &Filter) -> Result<Page, Error> {
        let limit = filter.limit.unwrap_or(usize::MAX);
        if limit == 0 {
            return Ok(Page {
                records: Vec::new(),
                next: filter.after.clone(),
            });
        }
        let mut records = Vec::new();
        let mut last = None;
        self.each(filter, |position, record| {
            records.push(record);
            last = Some(position);
            Ok(records.len() < limit)
        })?;
        let next = last.filter(|_| records.len() == limit).map(Cursor);
        Ok(Page { records, next })
    }

    pub(crate) fn list(&self, filter: &Filter) -> Result<Vec<Record>, Error> {
        Ok(self.page(filter)?.records)
    }

    /// Writes the matching records as JSON Lines as they are read; returns how many.
    pub(crate) fn export(&self, filter: &Filter, out: &mut dyn Write) -> Result<usize, Error> {
        let limit = filter.limit.unwrap_or(usize::MAX);
        let mut written = 0;
        if limit == 0 {
            return Ok(0);
        }
        self.each(filter, |_, record| {
            let line = serde_json::to_writer(&mut *out, &record)
                .and_then(|()| out.write_all(b"\n").map_err(serde_json::Error::io));
            line.map_err(|e| Error::Storage(format!("cannot write the export: {e}")))?;
            written += 1;
            Ok(written < limit)
        })?;
        Ok(written)
    }

    /// Calls `f` with each matching record after `filter.after`, in order, until it
    /// answers `false`.
    fn each(
        &self,
        filter: &Filter,
        mut f: impl FnMut(Position, Record) -> Result<bool, Error>,
    ) -> Result<(), Error> {
        let after = filter.after.as_ref().map(|cursor| &cursor.0);
        let mut offer = |position: Position, record: Result<Record, Error>| match record {
            Ok(record) if filter.matches(&record) => f(position, record),
            Ok(_) => Ok(true),
            Err(e @ Error::Decode { .. }) => {
                tracing::warn!(at = ?position, error = %e, "skipping an undecodable journal record");
                Ok(true)
            }
            Err(e) => Err(e),
        };
        if let Some(task) = &filter.task {
            return self.each_of_task(task.as_str(), after, offer);
        }
        // Format-1 records, stored under their keys (an older journal read as it is).
        if !matches!(after, Some(Position::Slot(_))) {
            let start = match after {
                Some(Position::Inline(key)) => keys::record(key),
                _ => keys::RECORDS.to_vec(),
            };
            for entry in self.store.range_from(&start).take_while(|e| {
                e.as_ref()
                    .map_or(true, |(k, _)| k.starts_with(keys::RECORDS))
            }) {
                let (storage_key, value) = entry?;
                // A pointer of the older index: its record is read by its slot below.
                if keys::parse_pointer(&value).is_some() {
                    continue;
                }
                let key = String::from_utf8_lossy(&storage_key[keys::RECORDS.len()..]).into_owned();
                if matches!(after, Some(Position::Inline(k)) if *k == key) {
                    continue;
                }
                let record = decode_listed(&value).and_then(|record| {
                    if record.key.as_str() == key {
                        Ok(record)
                    } else {
                        Err(Error::Decode {
                            what: format!("record {key}"),
                            detail: format!("it holds the record of {}", record.key),
                        })
                    }
                });
                if !offer(Position::Inline(key), record)? {
                    return Ok(());
                }
            }
        }
        // The others by slot, read in their order on disk from where the page starts.
        let from = match after {
            Some(Position::Slot(slot)) => match slot.checked_add(1) {
                Some(from) => from,
                None => return Ok(()),
            },
            _ => 0,
        };
        for entry in self.store.range_each(&keys::body(from), keys::BODIES_END) {
            let (storage_key, bytes) = entry?;
            let Some(slot) = keys::body_slot(&storage_key) else {
                continue;
            };
            let record = match bytes.and_then(|bytes| decode_listed(&bytes)) {
                // A record is read from a slot only if its key's index entry points
                // there: a slot no key names (left by damage) lists nothing.
                Ok(record) if !slots::points_at(&self.store, record.key.as_str(), slot)? => {
                    continue;
                }
                record => record,
            };
            if !offer(Position::Slot(slot), record)? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// [`Reader::each`] for a task's records, found through its index, which is in
    /// the listings' order: a page starts with one seek and reads what it holds.
    /// Entries of the older index (by creation time; a journal of format 5 or older
    /// read as it is, or one whose move was cut short) are located and put in order
    /// first, and merged in.
    fn each_of_task(
        &self,
        task: &str,
        after: Option<&Position>,
        mut offer: impl FnMut(Position, Result<Record, Error>) -> Result<bool, Error>,
    ) -> Result<(), Error> {
        let mut older = Vec::new();
        for entry in self.store.scan_prefix(&keys::task_by_time_prefix(task)) {
            let (index, _) = entry?;
            #[cfg(test)]
            TASK_ENTRIES.set(TASK_ENTRIES.get() + 1);
            let Some((_, key)) = keys::task_by_time_entry(&index) else {
                continue;
            };
            let key = String::from_utf8_lossy(key).into_owned();
            match slots::locate(&self.store, &key)? {
                Some(slots::Found::Slot(slot)) => older.push((Position::Slot(slot), key)),
                Some(slots::Found::Inline(_)) => {
                    older.push((Position::Inline(key.clone()), key));
                }
                None => {}
            }
        }
        older.retain(|(position, _)| after.is_none_or(|after| position > after));
        older.sort_unstable();
        let mut older = older.into_iter().peekable();

        let prefix = keys::task_prefix(task);
        let from = match after {
            Some(Position::Slot(slot)) => slot.checked_add(1),
            Some(Position::Inline(_)) | None => Some(0),
        };
        let newer = from
            .map(|from| self.store.range_from(&keys::task(task, from, "")))
            .into_iter()
            .flatten()
            .take_while(|e| e.as_ref().map_or(true, |(k, _)| k.starts_with(&prefix)))
            .filter_map(|entry| {
                #[cfg(test)]
                TASK_ENTRIES.set(TASK_ENTRIES.get() + 1);
                match entry {
                    Ok((index, _)) => keys::task_entry(&prefix, &index).map(|(slot, key)| {
                        Ok((
                            Position::Slot(slot),
                            String::from_utf8_lossy(key).into_owned(),
                        ))
                    }),
                    Err(e) => Some(Err(e)),
                }
            });
        let mut newer = newer.peekable();
        let mut last: Option<Position> = None;
        loop {
            let from_older = match (older.peek(), newer.peek()) {
                (None, None) => return Ok(()),
                (Some((o, _)), Some(Ok((n, _)))) => o <= n,
                (Some(_), None) => true,
                (None | Some(_), Some(_)) => false,
            };
            let next = if from_older {
                older.next().map(Ok)
            } else {
                newer.next()
            };
            let Some(next) = next else {
                return Ok(());
            };
            let (position, key) = next?;
            // One record in both indexes (damage): listed once.
            if last.as_ref() == Some(&position) {
                continue;
            }
            last = Some(position.clone());
            let bytes = match &position {
                Position::Slot(slot) => self.store.get(&keys::body(*slot)),
                Position::Inline(_) => self
                    .store
                    .get(&keys::record(&key))
                    .map(|bytes| bytes.filter(|b| keys::parse_pointer(b).is_none())),
            };
            let record = match bytes {
                // A record read must carry the key it was read for.
                Ok(Some(bytes)) => decode_listed(&bytes)
                    .map(|record| (record.key.as_str() == key).then_some(record)),
                Ok(None) => Ok(None),
                Err(e) => Err(e),
            };
            let go_on = match record {
                Ok(Some(record)) => offer(position, Ok(record))?,
                Ok(None) => true,
                Err(e) => offer(position, Err(e))?,
            };
            if !go_on {
                return Ok(());
            }
        }
    }

    /// The hash-chain check. On a running journal ([`chain::Mode::Live`]) it reads
    /// while the writer goes on writing, and no write waits for it: the chain is
    /// checked up to the head read first, and a record that changed since is checked
    /// against the entries written since (see [`chain::verify`]), so a busy journal is
    /// not reported as tampered with. On a stopped one the whole log is checked.
    pub(crate) fn verify(&self, mode: chain::Mode) -> Result<VerifyReport, Error> {
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
        let mut report = chain::verify(log, records, head, mode, |after| {
            log_from(&self.store, after.saturating_add(1))
        })?;
        // The writer only writes whole entries, so a damaged one is damage whether or
        // not the journal is running.
        for entry in self.store.scan_prefix(keys::EXPIRY) {
            let (key, value) = entry?;
            if let Err(detail) = keys::parse_expiry_entry(&key, &value) {
                report.problems.push(chain::Problem::DamagedExpiryEntry {
                    entry: hex::encode(&key),
                    detail,
                });
            }
        }
        Ok(report)
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

/// Where a record is in the order listings follow: records of a format-1 journal
/// stored under their keys (an older journal read as it is) in key order, then the
/// others by slot, that is in the order the journal created them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Position {
    Inline(String),
    Slot(u64),
}

/// Where a page of a listing ended: [`Filter::after`] on the next request goes on
/// from there. Records created meanwhile come later in the order, so paging until a
/// page comes back without a `next` returns every record once. As text (the admin
/// API's `next` and `after`), a slot number, or `k:` and a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor(Position);

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Position::Slot(slot) => write!(f, "{slot}"),
            Position::Inline(key) => write!(f, "k:{key}"),
        }
    }
}

impl std::str::FromStr for Cursor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(key) = s.strip_prefix("k:") {
            return Ok(Self(Position::Inline(key.to_owned())));
        }
        s.parse()
            .map(|slot| Self(Position::Slot(slot)))
            .map_err(|_| format!("{s:?} is not a cursor (the `next` of a page before)"))
    }
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub records: Vec<Record>,
    /// Set when the page is full: where the next one starts (it may be empty).
    pub next: Option<Cursor>,
}

/// A listed record's bytes, decoded.
fn decode_listed(bytes: &[u8]) -> Result<Record, Error> {
    #[cfg(test)]
    DECODED.set(DECODED.get() + 1);
    serde_json::from_slice(bytes).map_err(|e| Error::Decode {
        what: "a listed record".to_owned(),
        detail: e.to_string(),
    })
}

#[cfg(test)]
thread_local! {
    /// Records decoded by listings on this thread.
    pub(crate) static DECODED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Task-index entries read by listings on this thread.
    pub(crate) static TASK_ENTRIES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Called with each file an audit copies on this thread, before it is copied.
    pub(crate) static ON_COPY: std::cell::RefCell<Option<CopyHook>> =
        const { std::cell::RefCell::new(None) };
}

#[cfg(test)]
pub(crate) type CopyHook = Box<dyn FnMut(&Path)>;

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
/// the original is never written (a read-only mount will do). The journal's lock is
/// held while it is copied, so that a sidecar starting meanwhile (which replays the
/// log and empties it) cannot leave a torn copy: such a sidecar waits for the lock,
/// for 5 s at most, so a copy that takes longer leaves it without its journal. The cost is
/// the copy: as much free space as the journal takes, and the time to copy it.
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
        // Held until the copy is made: `Error::Locked` if a process holds it.
        let lock = store::take_lock(dir)?;
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
        drop(lock);
        let (store, damage) = Store::open_copy(&journal).map_err(|e| match e {
            Error::Corrupt { detail, kind, .. } => Error::Corrupt {
                dir: dir.to_owned(),
                detail,
                kind,
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

    /// One page of matching records (see [`Cursor`]).
    pub fn page(&self, filter: &Filter) -> Result<Page, Error> {
        self.reader.page(filter)
    }

    /// Writes the matching records as JSON Lines; returns how many.
    pub fn export(&self, filter: &Filter, out: &mut dyn Write) -> Result<usize, Error> {
        self.reader.export(filter, out)
    }

    /// The hash-chain check of a journal no process writes: the whole log, an entry
    /// past the head being a problem (see [`crate::Problem::EntriesPastHead`]).
    pub fn verify(&self) -> Result<VerifyReport, Error> {
        self.reader.verify(chain::Mode::Stopped {
            wal_damaged: self.damage.is_some(),
        })
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
            #[cfg(test)]
            ON_COPY.with_borrow_mut(|hook| hook.as_mut().map(|hook| hook(&path)));
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
    first
        .checked_add(chunk::count(&v)?.saturating_sub(1))
        .map(Some)
        .ok_or_else(|| Error::Decode {
            what: "a stream event chunk".to_owned(),
            detail: "its event numbers run past the largest".to_owned(),
        })
}

/// The sequence number of the first event stored under an event key.
fn first_seq_of(storage_key: &[u8]) -> Result<u64, Error> {
    keys::event_seq(storage_key).ok_or_else(|| Error::Decode {
        what: "a stream event key".to_owned(),
        detail: format!("{} bytes, too short", storage_key.len()),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::error::Error as StdError;

    use super::*;
    use crate::{Begin, Body, Headers, Journal, Options, StoredResponse};

    type TestResult<T = ()> = Result<T, Box<dyn StdError>>;

    /// The keys of every record, paged through `limit` at a time (the cursor going
    /// through its text form, as over the admin API).
    pub(crate) fn paged(
        page: impl Fn(&Filter) -> Result<Page, Error>,
        limit: usize,
    ) -> TestResult<Vec<String>> {
        paged_with(page, Filter::default(), limit)
    }

    pub(crate) fn paged_with(
        page: impl Fn(&Filter) -> Result<Page, Error>,
        mut filter: Filter,
        limit: usize,
    ) -> TestResult<Vec<String>> {
        filter.limit = Some(limit);
        let mut keys = Vec::new();
        loop {
            let got = page(&filter)?;
            assert!(got.records.len() <= limit);
            keys.extend(got.records.iter().map(|r| r.key.to_string()));
            match got.next {
                Some(next) => filter.after = Some(next.to_string().parse()?),
                None => return Ok(keys),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_page_decodes_what_it_holds_and_pages_list_every_record_once() -> TestResult {
        let dir = tempfile::tempdir()?;
        let (journal, writer, _) = Journal::open(Options::new(dir.path()))?;
        let task = tokio::spawn(writer.run());
        let total = 10_000;
        for batch in 0..total / 500 {
            let mut calls = tokio::task::JoinSet::new();
            for i in batch * 500..(batch + 1) * 500 {
                let journal = journal.clone();
                let mut intent = crate::tamper_tests::intent(&format!("k{i:05}"))?;
                if i % 3 == 0 {
                    intent.task_id = Some(TaskId::new("every-third")?);
                }
                calls.spawn(async move {
                    let Ok(Begin::Execute { ticket, .. }) = journal.begin(intent).await else {
                        return Err("a fresh key must execute".to_owned());
                    };
                    let response = StoredResponse::new(200, Headers::default(), Body::from("{}"));
                    journal
                        .complete(&ticket, response)
                        .await
                        .map_err(|e| e.to_string())
                });
            }
            while let Some(done) = calls.join_next().await {
                done??;
            }
        }

        // One record asked for, about one decoded: at the start, and from a cursor
        // in the middle.
        DECODED.set(0);
        let first = journal.page(&Filter {
            limit: Some(1),
            ..Filter::default()
        })?;
        assert_eq!(first.records.len(), 1);
        assert!(
            (1..=2).contains(&DECODED.get()),
            "{} records decoded",
            DECODED.get()
        );
        let half = journal.page(&Filter {
            limit: Some(total / 2),
            ..Filter::default()
        })?;
        DECODED.set(0);
        let middle = journal.page(&Filter {
            limit: Some(1),
            after: half.next,
            ..Filter::default()
        })?;
        assert_eq!(middle.records.len(), 1);
        assert!(
            (1..=2).contains(&DECODED.get()),
            "{} records decoded",
            DECODED.get()
        );

        // Every record once, in the order of one listing of them all, whatever the
        // page size; a task's records likewise.
        let all: Vec<String> = journal
            .list(&Filter::default())?
            .iter()
            .map(|r| r.key.to_string())
            .collect();
        assert_eq!(all.len(), total);
        let unique: std::collections::HashSet<&String> = all.iter().collect();
        assert_eq!(unique.len(), total);
        assert_eq!(paged(|f| journal.page(f), 1000)?, all);
        assert_eq!(paged(|f| journal.page(f), 777)?, all);
        let by_task = Filter {
            task: Some(TaskId::new("every-third")?),
            ..Filter::default()
        };
        let in_task: Vec<String> = journal
            .list(&by_task)?
            .iter()
            .map(|r| r.key.to_string())
            .collect();
        assert_eq!(in_task.len(), total.div_ceil(3));
        assert_eq!(
            paged_with(|f| journal.page(f), by_task.clone(), 101)?,
            in_task
        );

        // A task's page seeks to where it starts: one record asked for from a
        // cursor in the middle reads about one index entry, not the task's index.
        let task_half = journal.page(&Filter {
            limit: Some(in_task.len() / 2),
            ..by_task.clone()
        })?;
        TASK_ENTRIES.set(0);
        DECODED.set(0);
        let middle = journal.page(&Filter {
            limit: Some(1),
            after: task_half.next,
            ..by_task
        })?;
        assert_eq!(
            middle
                .records
                .iter()
                .map(|r| r.key.to_string())
                .collect::<Vec<_>>(),
            [in_task[in_task.len() / 2].clone()]
        );
        let read = TASK_ENTRIES.get();
        assert!((1..=2).contains(&read), "{read} task-index entries read");
        assert!(
            (1..=2).contains(&DECODED.get()),
            "{} records decoded",
            DECODED.get()
        );
        drop(journal);
        task.await?;
        Ok(())
    }
}
