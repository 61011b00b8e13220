//! The hash-chained log that makes edits and deletions visible.
//!
//! Every group commit that changes records appends one entry
//! `{seq, at, changes: [{key, kind, digest}], prev, hash}`: `kind` is the record's new
//! state (or `purge`), `digest` the SHA-256 of the record's stored bytes, and
//! `hash = SHA-256(prev || seq || at || changes)`. One entry per commit rather than per
//! change keeps the chain's cost per call near zero under load (the entry is one more
//! key in a batch that is written anyway). Records point at the entry of their latest
//! change (`log_seq`). `verify` walks the log and the records and names every broken
//! link, gap, edited entry, edited record and missing record, with keys and sequence
//! numbers.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::Error;
use crate::time::Timestamp;

/// The `kind` of a change that records a purge (the key was forgotten by retention).
pub(crate) const PURGE: &str = "purge";

pub(crate) type Hash = [u8; 32];

pub(crate) fn sha256(bytes: &[u8]) -> Hash {
    Sha256::digest(bytes).into()
}

/// One record change inside a log entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub key: String,
    /// The record's new state, or `purge`.
    pub kind: String,
    /// Hex SHA-256 of the record's stored bytes.
    pub digest: String,
}

/// One entry of the log, as stored (JSON, hex hashes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    pub seq: u64,
    pub at: Timestamp,
    pub changes: Vec<Change>,
    pub prev: String,
    pub hash: String,
}

impl LogEntry {
    fn compute_hash(&self) -> Option<Hash> {
        let prev: Hash = hex::decode(&self.prev).ok()?.try_into().ok()?;
        let mut changes = Vec::with_capacity(self.changes.len());
        for c in &self.changes {
            let digest: Hash = hex::decode(&c.digest).ok()?.try_into().ok()?;
            changes.push((c.key.as_str(), c.kind.as_str(), digest));
        }
        Some(link(&prev, self.seq, self.at, &changes))
    }

    fn keys(&self) -> Vec<String> {
        self.changes.iter().map(|c| c.key.clone()).collect()
    }
}

fn link(prev: &Hash, seq: u64, at: Timestamp, changes: &[(&str, &str, Hash)]) -> Hash {
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes();
    let mut h = Sha256::new();
    h.update(prev);
    h.update(seq.to_be_bytes());
    h.update(at.as_micros().to_be_bytes());
    h.update(len(changes.len()));
    for (key, kind, digest) in changes {
        h.update(len(key.len()));
        h.update(key.as_bytes());
        h.update(len(kind.len()));
        h.update(kind.as_bytes());
        h.update(digest);
    }
    h.finalize().into()
}

/// The end of the chain: the last sequence number and its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Head {
    pub(crate) seq: u64,
    pub(crate) hash: Hash,
}

#[derive(Serialize, Deserialize)]
struct HeadRepr {
    seq: u64,
    hash: String,
}

impl Head {
    /// Appends an entry with these changes after this head and moves the head to it.
    pub(crate) fn append(
        &mut self,
        at: Timestamp,
        changes: &[(String, &'static str, Hash)],
    ) -> LogEntry {
        let seq = self.seq + 1;
        let borrowed: Vec<(&str, &str, Hash)> = changes
            .iter()
            .map(|(key, kind, digest)| (key.as_str(), *kind, *digest))
            .collect();
        let hash = link(&self.hash, seq, at, &borrowed);
        let entry = LogEntry {
            seq,
            at,
            changes: changes
                .iter()
                .map(|(key, kind, digest)| Change {
                    key: key.clone(),
                    kind: (*kind).to_owned(),
                    digest: hex::encode(digest),
                })
                .collect(),
            prev: hex::encode(self.hash),
            hash: hex::encode(hash),
        };
        *self = Head { seq, hash };
        entry
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>, Error> {
        serde_json::to_vec(&HeadRepr {
            seq: self.seq,
            hash: hex::encode(self.hash),
        })
        .map_err(|e| Error::Storage(format!("cannot encode the log head: {e}")))
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, Error> {
        let bad = |detail: String| Error::Decode {
            what: "the log head".to_owned(),
            detail,
        };
        let repr: HeadRepr = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        let hash = hex::decode(&repr.hash)
            .ok()
            .and_then(|h| Hash::try_from(h).ok())
            .ok_or_else(|| bad("the hash is not 64 hex digits".to_owned()))?;
        Ok(Head {
            seq: repr.seq,
            hash,
        })
    }
}

/// What `verify` found. Clean when `problems` is empty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    pub entries: u64,
    pub records: u64,
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// One sign of tampering (or of storage damage).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "problem", rename_all = "snake_case")]
pub enum Problem {
    /// The entry's contents no longer match its own hash (or it cannot be read), or,
    /// for the newest entry, the hash the chain's head recorded for it; `keys` are the
    /// keys it names.
    EditedEntry { seq: u64, keys: Vec<String> },
    /// The entry does not link to the hash of the entry before it.
    BrokenLink { seq: u64, keys: Vec<String> },
    /// Entries `from..=to` are gone (the records they vouched for show up as edited
    /// or unlogged).
    MissingEntries { from: u64, to: u64 },
    /// The log ends before the head the writer recorded: its last entries are gone.
    TruncatedLog { head: u64, last: u64 },
    /// The record's bytes differ from what its latest log entry says.
    EditedRecord { key: String, seq: u64 },
    /// The log says the record exists, but it is gone (and was not purged).
    MissingRecord { key: String, seq: u64 },
    /// A record that no log entry mentions.
    UnloggedRecord { key: String },
    /// Log entries `from..=to` come after the head the writer recorded, in a journal
    /// no process holds. An entry and the head are written in one batch, so a stopped
    /// journal has none past its head: they were added since, and vouch for nothing.
    /// `wal_damaged`: the write-ahead log was damaged and read only up to the damage,
    /// which can leave the head older than entries sled already held, so they may be
    /// genuine (and are then used as a running journal's entries written since are).
    EntriesPastHead {
        head: u64,
        from: u64,
        to: u64,
        wal_damaged: bool,
    },
    /// An expiry index entry that cannot be parsed (`entry`: its storage key, in
    /// hex): retention leaves it in place and passes over it, so whatever it named
    /// is not expired through it.
    DamagedExpiryEntry { entry: String, detail: String },
}

/// What `verify` may assume about the journal it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// A running journal, written while it is read: entries past the head read first
    /// were written meanwhile, and vouch for records that changed meanwhile.
    Live,
    /// A journal no process holds (an audit's copy): the whole log is walked and an
    /// entry past the head is a problem. `wal_damaged`: its log was read up to damage.
    Stopped { wal_damaged: bool },
}

/// A key's change in the log.
struct Latest {
    seq: u64,
    kind: String,
    digest: String,
}

/// An entry whose contents match its own hash: its sequence number and keys.
type Intact = (u64, Vec<String>);

/// Log entries as `(seq from the storage key, stored bytes)`, in order.
pub(crate) type Entries<'a> = Box<dyn Iterator<Item = Result<(u64, Vec<u8>), Error>> + 'a>;

/// Checks the chain. `log` yields the stored entries in order; `records` yields
/// `(key, stored bytes)`; `head` is the head the writer recorded, read before either.
///
/// A running journal ([`Mode::Live`]) goes on writing while this reads, so what it
/// reads is no snapshot: records are read after the log and may be newer than it.
/// The chain is checked up to `head` (entries past it are not walked), and a record
/// that its latest entry up to `head` does not vouch for, or that is gone, is looked
/// up in the entries written since: `later(head.seq)`, read once the records have
/// been (so it holds every change they can show), and used only as far as it chains
/// on from `head`. A record that one of them vouches for (or purged) changed while
/// this ran, which is no problem. A running journal that had no head yet when it was
/// read had written nothing: its check starts from the empty chain, and every entry
/// the walk finds was written since.
///
/// A stopped journal ([`Mode::Stopped`]) changes under nobody: an entry and the head
/// are written in one batch, so an entry past the head was added since, by someone
/// other than the writer (one chaining on from the head is as easy to forge as a
/// record). The whole log is walked, entries past the head are reported, and none of
/// them vouches for a record, unless the log was damaged (see
/// [`Problem::EntriesPastHead`]).
pub(crate) fn verify<'a>(
    log: impl Iterator<Item = Result<(u64, Vec<u8>), Error>>,
    records: impl Iterator<Item = Result<(String, Vec<u8>), Error>>,
    head: Option<Head>,
    mode: Mode,
    later: impl FnOnce(u64) -> Entries<'a>,
) -> Result<VerifyReport, Error> {
    // Without this, the walk would take entries written after the (absent) head was
    // read as the chain to check, and report their records, read earlier, missing.
    let head = match mode {
        Mode::Live => Some(head.unwrap_or_default()),
        Mode::Stopped { .. } => head,
    };
    let mut report = VerifyReport {
        entries: 0,
        records: 0,
        problems: Vec::new(),
    };
    let mut latest: HashMap<String, Latest> = HashMap::new();
    let mut prev_hash = Hash::default();
    let mut expected = 1u64;
    // The last entry whose contents match its own hash, and its keys: the head must
    // name that hash too.
    let mut last_intact: Option<Intact> = None;
    // What the walk had reached at the head: the last sequence number, and the last
    // intact entry with its hash.
    let mut at_head: Option<(u64, Option<Intact>, Hash)> = None;
    // Entries past the head (a stopped journal's): the first and the last.
    let mut past: Option<(u64, u64)> = None;
    for item in log {
        let (seq, bytes) = item?;
        if let Some(head) = head
            && seq > head.seq
        {
            if mode == Mode::Live {
                break;
            }
            if at_head.is_none() {
                at_head = Some((expected - 1, last_intact.take(), prev_hash));
            }
            past = Some((past.map_or(seq, |(from, _)| from), seq));
        }
        report.entries += 1;
        let Ok(entry) = serde_json::from_slice::<LogEntry>(&bytes) else {
            report.problems.push(Problem::EditedEntry {
                seq,
                keys: Vec::new(),
            });
            expected = seq + 1;
            prev_hash = Hash::default();
            last_intact = None;
            continue;
        };
        let gap = seq != expected;
        if gap {
            report.problems.push(Problem::MissingEntries {
                from: expected,
                to: seq.saturating_sub(1),
            });
        }
        let computed = entry.compute_hash();
        if entry.seq != seq || computed.map(hex::encode).as_deref() != Some(entry.hash.as_str()) {
            report.problems.push(Problem::EditedEntry {
                seq,
                keys: entry.keys(),
            });
            last_intact = None;
        } else {
            if !gap && entry.prev != hex::encode(prev_hash) {
                report.problems.push(Problem::BrokenLink {
                    seq,
                    keys: entry.keys(),
                });
            }
            last_intact = Some((seq, entry.keys()));
        }
        prev_hash = hex::decode(&entry.hash)
            .ok()
            .and_then(|h| Hash::try_from(h).ok())
            .unwrap_or_default();
        expected = seq + 1;
        if past.is_some() {
            continue;
        }
        for change in entry.changes {
            latest.insert(
                change.key,
                Latest {
                    seq,
                    kind: change.kind,
                    digest: change.digest,
                },
            );
        }
    }
    if let Some(head) = head {
        let (last, last_intact, prev_hash) =
            at_head.unwrap_or((expected - 1, last_intact, prev_hash));
        if let Some((from, to)) = past {
            report.problems.push(Problem::EntriesPastHead {
                head: head.seq,
                from,
                to,
                wal_damaged: mode == (Mode::Stopped { wal_damaged: true }),
            });
        }
        if head.seq > last {
            report.problems.push(Problem::TruncatedLog {
                head: head.seq,
                last,
            });
        }
        // The newest entry has no successor whose link would break if it were edited
        // and hashed again: the head's hash is what vouches for it.
        if let Some((seq, keys)) = last_intact
            && seq == head.seq
            && prev_hash != head.hash
        {
            report.problems.push(Problem::EditedEntry { seq, keys });
        }
    }

    // Records the log up to the head does not vouch for: `(key, digest, latest seq)`.
    let mut unvouched: Vec<(String, String, Option<u64>)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for item in records {
        let (key, bytes) = item?;
        report.records += 1;
        let digest = hex::encode(sha256(&bytes));
        match latest.get(&key) {
            Some(l) if l.kind != PURGE && l.digest == digest => {}
            l => unvouched.push((key.clone(), digest, l.map(|l| l.seq))),
        }
        seen.insert(key);
    }
    let mut missing: Vec<(&String, &Latest)> = latest
        .iter()
        .filter(|(key, l)| l.kind != PURGE && !seen.contains(*key))
        .collect();
    missing.sort_by_key(|(_, l)| l.seq);

    // A stopped journal's entries past the head vouch for nothing, unless its log
    // was damaged: then they may be genuine, and are reported as such.
    let vouching = mode != Mode::Stopped { wal_damaged: false };
    let since = match head {
        Some(head) if vouching && (!unvouched.is_empty() || !missing.is_empty()) => {
            let wanted = unvouched
                .iter()
                .map(|(key, _, _)| key.as_str())
                .chain(missing.iter().map(|(key, _)| key.as_str()))
                .collect();
            changes_since(head, later(head.seq), &wanted)?
        }
        _ => HashMap::new(),
    };
    for (key, digest, seq) in unvouched {
        let changes = since.get(&key).map(Vec::as_slice).unwrap_or_default();
        if changes
            .iter()
            .any(|c| c.kind != PURGE && c.digest == digest)
        {
            continue;
        }
        match changes.last().map(|c| c.seq).or(seq) {
            Some(seq) => report.problems.push(Problem::EditedRecord { key, seq }),
            None => report.problems.push(Problem::UnloggedRecord { key }),
        }
    }
    for (key, l) in missing {
        let purged = since
            .get(key)
            .is_some_and(|changes| changes.iter().any(|c| c.kind == PURGE));
        if !purged {
            report.problems.push(Problem::MissingRecord {
                key: key.clone(),
                seq: l.seq,
            });
        }
    }
    Ok(report)
}

/// The changes of the `wanted` keys in the entries after `head`, in order, as far as those entries chain on from it: an entry that does
/// not (edited, or out of place) and every one after it vouch for nothing here.
fn changes_since(
    head: Head,
    entries: Entries<'_>,
    wanted: &std::collections::HashSet<&str>,
) -> Result<HashMap<String, Vec<Latest>>, Error> {
    let mut out: HashMap<String, Vec<Latest>> = HashMap::new();
    let mut prev = head;
    for item in entries {
        let (seq, bytes) = item?;
        let Ok(entry) = serde_json::from_slice::<LogEntry>(&bytes) else {
            break;
        };
        let Some(hash) = entry.compute_hash() else {
            break;
        };
        if seq != prev.seq + 1
            || entry.seq != seq
            || entry.prev != hex::encode(prev.hash)
            || entry.hash != hex::encode(hash)
        {
            break;
        }
        prev = Head { seq, hash };
        for change in entry.changes {
            if wanted.contains(change.key.as_str()) {
                out.entry(change.key).or_default().push(Latest {
                    seq,
                    kind: change.kind,
                    digest: change.digest,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Log = Vec<(u64, Vec<u8>)>;
    type Records = Vec<(String, Vec<u8>)>;

    fn chain(n: u64) -> (Log, Records, Head) {
        let mut head = Head::default();
        let mut log = Vec::new();
        let mut records = Vec::new();
        for i in 0..n {
            let key = format!("k{i}");
            let bytes = format!("record {i}").into_bytes();
            let changes = [(key.clone(), "completed", sha256(&bytes))];
            let entry = head.append(Timestamp::from_micros(i), &changes);
            log.push((entry.seq, serde_json::to_vec(&entry).unwrap_or_default()));
            records.push((key, bytes));
        }
        (log, records, head)
    }

    fn check(
        log: &[(u64, Vec<u8>)],
        records: &[(String, Vec<u8>)],
        head: Head,
    ) -> Result<VerifyReport, Error> {
        verify(
            log.iter().cloned().map(Ok),
            records.iter().cloned().map(Ok),
            Some(head),
            Mode::Stopped { wal_damaged: false },
            |_| Box::new(std::iter::empty()),
        )
    }

    #[test]
    fn a_clean_chain_verifies() -> Result<(), Error> {
        let (log, records, head) = chain(5);
        let report = check(&log, &records, head)?;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!((report.entries, report.records), (5, 5));
        Ok(())
    }

    #[test]
    fn an_entry_may_carry_several_changes_of_one_key() -> Result<(), Error> {
        let mut head = Head::default();
        let claimed = b"claimed".to_vec();
        let completed = b"completed".to_vec();
        let entry = head.append(
            Timestamp::from_micros(1),
            &[
                ("k".to_owned(), "dispatched", sha256(&claimed)),
                ("k".to_owned(), "completed", sha256(&completed)),
            ],
        );
        let log = vec![(
            1,
            serde_json::to_vec(&entry).map_err(|e| Error::Storage(e.to_string()))?,
        )];
        let report = check(&log, &[("k".to_owned(), completed)], head)?;
        assert!(report.is_clean(), "{report:?}");
        let report = check(&log, &[("k".to_owned(), claimed)], head)?;
        assert_eq!(
            report.problems,
            [Problem::EditedRecord {
                key: "k".to_owned(),
                seq: 1
            }]
        );
        Ok(())
    }

    /// [`verify`] with the chain checked up to `head`, and `later` as the entries
    /// written since.
    fn check_up_to(
        log: &[(u64, Vec<u8>)],
        records: &[(String, Vec<u8>)],
        head: Head,
        later: Log,
    ) -> Result<VerifyReport, Error> {
        verify(
            log.iter().cloned().map(Ok),
            records.iter().cloned().map(Ok),
            Some(head),
            Mode::Live,
            move |after| Box::new(later.into_iter().filter(move |(s, _)| *s > after).map(Ok)),
        )
    }

    #[test]
    fn a_stopped_journal_s_entries_past_the_head_are_reported_and_vouch_for_nothing()
    -> Result<(), Error> {
        // A record edited, and an entry for its new bytes appended after the head,
        // chaining on from it; the head left as it was.
        let (mut log, mut records, head) = chain(4);
        records[1].1 = b"record 1, edited".to_vec();
        let mut forged_head = head;
        let forged = forged_head.append(
            Timestamp::from_micros(9),
            &[("k1".to_owned(), "completed", sha256(&records[1].1))],
        );
        log.push((
            5,
            serde_json::to_vec(&forged).map_err(|e| Error::Storage(e.to_string()))?,
        ));
        let stopped = |wal_damaged| {
            let later = log.clone();
            verify(
                log.iter().cloned().map(Ok),
                records.iter().cloned().map(Ok),
                Some(head),
                Mode::Stopped { wal_damaged },
                move |after| Box::new(later.into_iter().filter(move |(s, _)| *s > after).map(Ok)),
            )
        };
        let report = stopped(false)?;
        assert_eq!(report.entries, 5);
        assert_eq!(
            report.problems,
            [
                Problem::EntriesPastHead {
                    head: 4,
                    from: 5,
                    to: 5,
                    wal_damaged: false
                },
                Problem::EditedRecord {
                    key: "k1".to_owned(),
                    seq: 2
                },
            ]
        );

        // Read up to a damaged log, the head may be older than what sled held: the
        // entries past it are reported as such, and vouch as a running journal's do.
        let report = stopped(true)?;
        assert_eq!(
            report.problems,
            [Problem::EntriesPastHead {
                head: 4,
                from: 5,
                to: 5,
                wal_damaged: true
            }]
        );

        // A running journal: an entry written meanwhile.
        let report = check_up_to(&log, &records, head, log.clone())?;
        assert!(report.is_clean(), "{report:?}");

        // The newest entry up to the head is still checked against the head's hash.
        let mut edited = log.clone();
        let mut entry: LogEntry =
            serde_json::from_slice(&edited[3].1).map_err(|e| Error::Storage(e.to_string()))?;
        entry.at = Timestamp::from_micros(99);
        entry.hash = entry.compute_hash().map(hex::encode).unwrap_or_default();
        edited[3].1 = serde_json::to_vec(&entry).map_err(|e| Error::Storage(e.to_string()))?;
        let report = verify(
            edited.iter().cloned().map(Ok),
            records.iter().cloned().map(Ok),
            Some(head),
            Mode::Stopped { wal_damaged: false },
            |_| Box::new(std::iter::empty()),
        )?;
        assert!(
            report.problems.contains(&Problem::EditedEntry {
                seq: 4,
                keys: vec!["k3".to_owned()]
            }),
            "{report:?}"
        );
        Ok(())
    }

    #[test]
    fn changes_after_the_head_are_vouched_for_by_the_entries_written_since() -> Result<(), Error> {
        // Read while two more calls were journaled: the head says 4, the log and the
        // records already hold 6.
        let (log, records, _) = chain(6);
        let (_, _, head) = chain(4);
        let report = check_up_to(&log, &records, head, log.clone())?;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!((report.entries, report.records), (4, 6));

        // Nothing written since vouches for them.
        let unlogged = [
            Problem::UnloggedRecord {
                key: "k4".to_owned(),
            },
            Problem::UnloggedRecord {
                key: "k5".to_owned(),
            },
        ];
        let report = check_up_to(&log, &records, head, Vec::new())?;
        assert_eq!(report.problems, unlogged);

        // An entry since that does not chain on from the head vouches for nothing,
        // and neither does any after it.
        let mut forged = log.clone();
        let mut entry: LogEntry =
            serde_json::from_slice(&forged[4].1).map_err(|e| Error::Storage(e.to_string()))?;
        entry.changes[0].digest = hex::encode(sha256(b"forged"));
        forged[4].1 = serde_json::to_vec(&entry).map_err(|e| Error::Storage(e.to_string()))?;
        let mut recs = records.clone();
        recs[4].1 = b"forged".to_vec();
        let report = check_up_to(&forged, &recs, head, forged.clone())?;
        assert_eq!(report.problems, unlogged);

        // A record purged since is not missing; one that was not is.
        let mut head5 = head;
        let purge = head5.append(
            Timestamp::from_micros(9),
            &[("k1".to_owned(), PURGE, sha256(b""))],
        );
        let mut purged = log[..4].to_vec();
        purged.push((
            5,
            serde_json::to_vec(&purge).map_err(|e| Error::Storage(e.to_string()))?,
        ));
        let mut recs = records[..4].to_vec();
        recs.remove(1);
        let report = check_up_to(&purged, &recs, head, purged.clone())?;
        assert!(report.is_clean(), "{report:?}");
        let report = check_up_to(&purged, &recs, head, Vec::new())?;
        assert_eq!(
            report.problems,
            [Problem::MissingRecord {
                key: "k1".to_owned(),
                seq: 2
            }]
        );
        Ok(())
    }

    #[test]
    fn a_running_journal_read_before_its_first_write_checks_from_the_empty_chain()
    -> Result<(), Error> {
        // No head when it was read; the log already holds two entries when walked,
        // and the records were read before either was written.
        let (log, records, _) = chain(2);
        let live = |records: &[(String, Vec<u8>)], later: Log| {
            verify(
                log.iter().cloned().map(Ok),
                records.iter().cloned().map(Ok),
                None,
                Mode::Live,
                move |after| Box::new(later.into_iter().filter(move |(s, _)| *s > after).map(Ok)),
            )
        };
        let report = live(&[], log.clone())?;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!((report.entries, report.records), (0, 0));

        // Records read once written are vouched for by the entries since.
        let report = live(&records, log.clone())?;
        assert!(report.is_clean(), "{report:?}");

        // An edited one still is not.
        let mut edited = records.clone();
        edited[1].1 = b"edited".to_vec();
        let report = live(&edited, log.clone())?;
        assert_eq!(
            report.problems,
            [Problem::EditedRecord {
                key: "k1".to_owned(),
                seq: 2
            }]
        );
        Ok(())
    }

    #[test]
    fn each_kind_of_tampering_is_named() -> Result<(), Error> {
        let (log, records, head) = chain(6);

        // An entry edited and re-hashed by the editor: the next link breaks.
        let mut edited = log.clone();
        let mut entry: LogEntry =
            serde_json::from_slice(&edited[2].1).map_err(|e| Error::Storage(e.to_string()))?;
        entry.changes[0].kind = "failed_before_send".to_owned();
        entry.hash = entry.compute_hash().map(hex::encode).unwrap_or_default();
        edited[2].1 = serde_json::to_vec(&entry).map_err(|e| Error::Storage(e.to_string()))?;
        let report = check(&edited, &records, head)?;
        assert_eq!(
            report.problems,
            [Problem::BrokenLink {
                seq: 4,
                keys: vec!["k3".to_owned()]
            }]
        );

        // An entry edited without fixing its hash.
        let mut edited = log.clone();
        entry.hash = "00".repeat(32);
        edited[2].1 = serde_json::to_vec(&entry).map_err(|e| Error::Storage(e.to_string()))?;
        let report = check(&edited, &records, head)?;
        assert!(
            report.problems.contains(&Problem::EditedEntry {
                seq: 3,
                keys: vec!["k2".to_owned()]
            }),
            "{report:?}"
        );

        // A deleted entry: a gap, and its record is no longer vouched for.
        let mut deleted = log.clone();
        deleted.remove(1);
        let report = check(&deleted, &records, head)?;
        assert_eq!(
            report.problems,
            [
                Problem::MissingEntries { from: 2, to: 2 },
                Problem::UnloggedRecord {
                    key: "k1".to_owned()
                },
            ]
        );

        // The last entry deleted.
        let report = check(&log[..5], &records, head)?;
        assert!(
            report
                .problems
                .contains(&Problem::TruncatedLog { head: 6, last: 5 }),
            "{report:?}"
        );

        // The newest entry and its record edited consistently, the entry hashed
        // again: no later link breaks, but the head names the old hash.
        let mut edited = log.clone();
        let mut recs = records.clone();
        recs[5].1 = b"record 5, edited".to_vec();
        let mut entry: LogEntry =
            serde_json::from_slice(&edited[5].1).map_err(|e| Error::Storage(e.to_string()))?;
        entry.changes[0].digest = hex::encode(sha256(&recs[5].1));
        entry.hash = entry.compute_hash().map(hex::encode).unwrap_or_default();
        edited[5].1 = serde_json::to_vec(&entry).map_err(|e| Error::Storage(e.to_string()))?;
        let report = check(&edited, &recs, head)?;
        assert_eq!(
            report.problems,
            [Problem::EditedEntry {
                seq: 6,
                keys: vec!["k5".to_owned()]
            }]
        );

        // An edited record and a deleted record.
        let mut recs = records.clone();
        recs[0].1 = b"record 0, edited".to_vec();
        recs.remove(4);
        let report = check(&log, &recs, head)?;
        assert_eq!(
            report.problems,
            [
                Problem::EditedRecord {
                    key: "k0".to_owned(),
                    seq: 1
                },
                Problem::MissingRecord {
                    key: "k4".to_owned(),
                    seq: 5
                },
            ]
        );
        Ok(())
    }
}
