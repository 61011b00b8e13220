//! Tests on the bytes on disk (through the raw store, the only way in besides the
//! writer): tampering, which `verify` must name, and journals in the older format.

use std::error::Error as StdError;
use std::time::{Duration, SystemTime};

use outrigger_types::{Fingerprint, IdempotencyKey, RequestId, TaskId, ToolClass};

use crate::options::Durability;
use crate::store::{Store, keys};
use crate::{
    Begin, Body, Error, Headers, Intent, Journal, KeySource, Options, Problem, RedactedRequest,
    State, StoredResponse,
};

type TestResult = Result<(), Box<dyn StdError>>;

pub(crate) fn intent(key: &str) -> Result<Intent, Box<dyn StdError>> {
    Ok(Intent {
        key: IdempotencyKey::new(key)?,
        fingerprint: Fingerprint([9; 32]),
        tool: "ledger".to_owned(),
        class: ToolClass::Keyed,
        method: "POST".to_owned(),
        target: "http://127.0.0.1:9/entries".to_owned(),
        task_id: Some(TaskId::new("task-1")?),
        request_id: RequestId::from_generated(format!("req-{key}")),
        downstream_key: key.to_owned(),
        request: RedactedRequest::new(Headers::default(), Body::from("{}")),
        policy_versions: Vec::new(),
        model_revision: None,
        derived_from: KeySource::Header,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_each_kind_of_tampering() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let (journal, writer, _) = Journal::open(Options::new(dir.path()))?;
        let task = tokio::spawn(writer.run());
        for key in ["k0", "k1", "k2", "k3"] {
            let Begin::Execute { ticket, .. } = journal.begin(intent(key)?).await? else {
                return Err("a fresh key must execute".into());
            };
            let response = StoredResponse::new(200, Headers::default(), Body::from("{\"id\":1}"));
            journal.complete(&ticket, response).await?;
        }
        let report = journal.verify()?;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!((report.entries, report.records), (8, 4));
        drop(journal);
        task.await?;
    }

    // Log entries: k0 → 1, 2; k1 → 3, 4; k2 → 5, 6; k3 → 7, 8.
    {
        let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
        let k0 = keys::body(crate::slots::slot(&store, "k0")?.ok_or("k0 missing")?);
        let original = String::from_utf8(store.get(&k0)?.ok_or("k0's slot is empty")?)?;
        let edited = original.replace("\"final_status\":200", "\"final_status\":201");
        assert_ne!(original, edited);
        store.raw_put(&k0, edited.as_bytes())?;
        // k1's key still points at its slot, but the slot is gone.
        let k1 = crate::slots::slot(&store, "k1")?.ok_or("k1 missing")?;
        store.raw_remove(&keys::body(k1))?;
        let entry5 = String::from_utf8(store.get(&keys::log(5))?.ok_or("entry 5 missing")?)?;
        let edited5 = entry5.replace("\"dispatched\"", "\"failed_before_send\"");
        assert_ne!(entry5, edited5);
        store.raw_put(&keys::log(5), edited5.as_bytes())?;
        store.raw_remove(&keys::log(7))?;
        store.flush()?;
    }

    let audit = Journal::open_for_audit(dir.path())?;
    let report = audit.verify()?;
    assert_eq!(
        report.problems,
        [
            Problem::EditedEntry {
                seq: 5,
                keys: vec!["k2".to_owned()]
            },
            Problem::MissingEntries { from: 7, to: 7 },
            Problem::EditedRecord {
                key: "k0".to_owned(),
                seq: 2
            },
            Problem::MissingRecord {
                key: "k1".to_owned(),
                seq: 4
            },
        ]
    );
    drop(audit);

    // The sidecar reopened on the tampered journal sees the same, and goes on
    // chaining after the old head.
    let (journal, writer, recovery) = Journal::open(Options::new(dir.path()))?;
    let task = tokio::spawn(writer.run());
    assert!(recovery.undecodable.is_empty());
    assert_eq!(journal.verify()?.problems, report.problems);
    drop(journal);
    task.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_reports_an_entry_forged_past_the_head() -> TestResult {
    let dir = tempfile::tempdir()?;
    completed(dir.path(), &["k0", "k1"]).await?;

    // k0's record edited, and an entry for its new bytes appended after the head,
    // chaining on from it; the head left as it was.
    {
        let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
        let k0 = keys::body(crate::slots::slot(&store, "k0")?.ok_or("k0 missing")?);
        let original = String::from_utf8(store.get(&k0)?.ok_or("k0's slot is empty")?)?;
        let edited = original.replace("\"final_status\":200", "\"final_status\":201");
        assert_ne!(original, edited);
        store.raw_put(&k0, edited.as_bytes())?;
        let head = crate::chain::Head::decode(&store.get(keys::HEAD)?.ok_or("no head")?)?;
        assert_eq!(head.seq, 4);
        let mut forged = head;
        let entry = forged.append(
            crate::Timestamp::now(),
            &[(
                "k0".to_owned(),
                "completed",
                crate::chain::sha256(edited.as_bytes()),
            )],
        );
        store.raw_put(&keys::log(5), &serde_json::to_vec(&entry)?)?;
        store.flush()?;
    }

    let audit = Journal::open_for_audit(dir.path())?;
    assert_eq!(
        audit.verify()?.problems,
        [
            Problem::EntriesPastHead {
                head: 4,
                from: 5,
                to: 5,
                wal_damaged: false
            },
            Problem::EditedRecord {
                key: "k0".to_owned(),
                seq: 2
            },
        ]
    );
    Ok(())
}

/// Options for a journal in `dir` with `Durability::Node`.
fn node_options(dir: &std::path::Path) -> Options {
    Options {
        durability: Durability::Node,
        ..Options::new(dir)
    }
}

/// Executes a fresh `key` and completes it with `status` and `body`.
async fn executed(journal: &Journal, key: &str, status: u16, body: &str) -> TestResult {
    let Begin::Execute { ticket, .. } = journal.begin(intent(key)?).await? else {
        return Err(format!("{key} must execute").into());
    };
    let response = StoredResponse::new(status, Headers::default(), Body::from(body));
    journal.complete(&ticket, response).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_durability_writes_and_reopens() -> TestResult {
    let dir = tempfile::tempdir()?;
    let options = node_options(dir.path());
    let (journal, writer, _) = Journal::open(options.clone())?;
    let task = tokio::spawn(writer.run());
    executed(&journal, "n1", 201, "ok").await?;
    drop(journal);
    task.await?;
    let (journal, writer, _) = Journal::open(options)?;
    let task = tokio::spawn(writer.run());
    let record = journal.get(&IdempotencyKey::new("n1")?)?.ok_or("n1 lost")?;
    assert_eq!(record.final_status, Some(201));
    drop(journal);
    task.await?;
    Ok(())
}

/// On one thread (the writer runs on the test's), so that the injected sync failure
/// reaches the writer's syncs.
#[tokio::test]
async fn a_failed_fdatasync_refuses_writes_until_a_restart() -> TestResult {
    let dir = tempfile::tempdir()?;
    let options = node_options(dir.path());
    {
        let (journal, writer, _) = Journal::open(options.clone())?;
        let task = tokio::spawn(writer.run());
        executed(&journal, "s0", 200, "ok").await?;
        crate::store::sync_fault::set(true);
        let refused = journal.begin(intent("s1")?).await;
        crate::store::sync_fault::set(false);
        assert!(matches!(refused, Err(Error::Unavailable(_))), "{refused:?}");
        // The next sync could succeed without the pages the failed one dropped.
        let again = journal.begin(intent("s1")?).await;
        assert!(
            matches!(&again, Err(Error::Unavailable(reason)) if reason.contains("restarts")),
            "{again:?}"
        );
        assert!(journal.writes_failing());
        drop(journal);
        task.await?;
    }
    let (journal, writer, recovery) = Journal::open(options)?;
    let task = tokio::spawn(writer.run());
    assert!(recovery.failed_before_send.is_empty(), "{recovery:?}");
    let s0 = journal.get(&IdempotencyKey::new("s0")?)?.ok_or("s0 lost")?;
    assert_eq!(s0.state, State::Completed);
    assert!(matches!(
        journal.begin(intent("s1")?).await?,
        Begin::Execute { .. }
    ));
    drop(journal);
    task.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_record_file_leaves_its_records_undecodable_never_executed() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let (journal, writer, _) = Journal::open(Options::new(dir.path()))?;
        let task = tokio::spawn(writer.run());
        for key in ["k0", "k1", "k2"] {
            executed(&journal, key, 200, key).await?;
        }
        drop(journal);
        task.await?;
    }
    // A replayed log gives sled the bodies themselves: write them to their file
    // again, and empty the log, as a long-running sidecar's journal is.
    {
        let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
        for key in ["k0", "k1", "k2"] {
            let slot = keys::body(crate::slots::slot(&store, key)?.ok_or("no slot")?);
            let body = store.get(&slot)?.ok_or("slot empty")?;
            store.apply(vec![(slot, Some(body))])?;
        }
        store.set_wal_rotate_at(1);
        store.apply(vec![(b"m/rotated".to_vec(), None)])?;
    }
    let file = dir.path().join("records").join("00000000");
    let len = std::fs::metadata(&file)?.len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)?
        .set_len(len - 1)?;

    let refused = |journal: Journal, key: &'static str| async move {
        let begun = journal.begin(intent(key)?).await;
        assert!(
            matches!(begun, Err(Error::Decode { .. })),
            "{key}: {begun:?}"
        );
        Ok::<(), Box<dyn StdError>>(())
    };
    {
        // k2's body is cut short: the others are served, k2 is refused, not executed.
        let (journal, writer, recovery) = Journal::open(Options::new(dir.path()))?;
        let task = tokio::spawn(writer.run());
        assert_eq!(recovery.undecodable, ["k2"]);
        refused(journal.clone(), "k2").await?;
        assert!(journal.get(&IdempotencyKey::new("k2")?).is_err());
        assert!(matches!(
            journal.begin(intent("k0")?).await?,
            Begin::Replay(_)
        ));
        let listed: Vec<String> = journal
            .list(&crate::Filter::default())?
            .into_iter()
            .map(|r| r.key.to_string())
            .collect();
        assert_eq!(listed, ["k0", "k1"]);
        let report = journal.verify()?;
        assert!(
            report
                .problems
                .iter()
                .any(|p| matches!(p, Problem::MissingRecord { key, .. } if key == "k2")),
            "{report:?}"
        );
        // A new record goes where k2's last byte was; k2 does not become it.
        executed(&journal, "k3", 200, "k3").await?;
        refused(journal.clone(), "k2").await?;
        drop(journal);
        task.await?;
    }
    // The file gone: each record in it is refused, and a slot that now reads as
    // another key's record (as one written over a cut file may) is refused too.
    std::fs::remove_file(&file)?;
    {
        let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
        let k1 = keys::body(crate::slots::slot(&store, "k1")?.ok_or("no slot")?);
        let k3 = keys::body(crate::slots::slot(&store, "k3")?.ok_or("no slot")?);
        let other = store.get(&k3)?.ok_or("k3 lost")?;
        store.raw_put(&k1, &other)?;
        store.flush()?;
    }
    let (journal, writer, recovery) = Journal::open(Options::new(dir.path()))?;
    let task = tokio::spawn(writer.run());
    assert_eq!(recovery.undecodable, ["k0", "k1", "k2"]);
    for key in ["k0", "k1", "k2"] {
        refused(journal.clone(), key).await?;
    }
    assert!(matches!(
        journal.begin(intent("k3")?).await?,
        Begin::Replay(_)
    ));
    // Retention passes over the damaged records and goes on with the others.
    let later = std::time::SystemTime::now() + Duration::from_secs(400 * 86_400);
    let report = journal.reap(later).await?;
    assert_eq!((report.damaged, report.tombstoned), (3, 1), "{report:?}");
    let k3 = journal.get(&IdempotencyKey::new("k3")?)?.ok_or("k3 lost")?;
    assert_eq!(k3.state, State::Tombstone);
    // They stay, and are not looked at again until a retention period later.
    let report = journal.reap(later).await?;
    assert_eq!(report.damaged, 0, "{report:?}");
    let report = journal
        .reap(later + Options::new(dir.path()).retention + Duration::from_secs(1))
        .await?;
    assert_eq!(report.damaged, 3, "{report:?}");
    for key in ["k0", "k1", "k2"] {
        refused(journal.clone(), key).await?;
    }
    drop(journal);
    task.await?;
    Ok(())
}

/// Rewrites a journal the way format 1 stored it (each record under its own key),
/// format 3 (each record's key pointing at its slot), format 4 (each record's
/// bytes in sled, under its slot) or format 5 (as it is); in each, the task index by
/// creation time.
fn to_format(format: u8, dir: &std::path::Path, record_keys: &[&str]) -> TestResult {
    let store = Store::open(dir, 16 << 20, Durability::Process, false)?;
    for entry in store.scan_prefix(keys::TASKS).collect::<Vec<_>>() {
        let (index, _) = entry?;
        let prefix = &index[..=index.iter().position(|b| *b == 0).ok_or("no task")?];
        let (slot, key) = keys::task_entry(prefix, &index).ok_or("a bad task entry")?;
        let key = std::str::from_utf8(key)?;
        let bytes = store.get(&keys::body(slot))?.ok_or("slot empty")?;
        let record = crate::writer::decode_record(key, &bytes)?;
        let task = record
            .task_id
            .ok_or("a task entry of a record with no task")?;
        store.raw_put(
            &keys::task_by_time(task.as_str(), record.created_at.as_micros(), key),
            &[],
        )?;
        store.raw_remove(&index)?;
    }
    for key in record_keys {
        let slot = crate::slots::slot(&store, key)?.ok_or("record missing")?;
        if format == b'5' {
            continue;
        }
        if format == b'4' {
            let bytes = store.get(&keys::body(slot))?.ok_or("slot empty")?;
            store.raw_put(&keys::body(slot), &bytes)?;
            continue;
        }
        store.raw_remove(&crate::slots::index_key(key, slot))?;
        if format == b'1' {
            let bytes = store.get(&keys::body(slot))?.ok_or("slot empty")?;
            store.raw_put(&keys::record(key), &bytes)?;
            store.raw_remove(&keys::body(slot))?;
        } else {
            store.raw_put(&keys::record(key), &keys::pointer(slot))?;
        }
    }
    store.raw_put(keys::FORMAT, &[format])?;
    store.flush()?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_1_journal_is_read_then_its_records_move_to_slots() -> TestResult {
    an_older_journal_is_read_then_moved_to_the_current_format(b'1', b'1').await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_3_journal_is_read_then_its_index_moves_to_generations() -> TestResult {
    an_older_journal_is_read_then_moved_to_the_current_format(b'3', b'3').await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_4_journal_is_read_with_its_records_in_sled() -> TestResult {
    an_older_journal_is_read_then_moved_to_the_current_format(b'4', b'4').await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_5_journal_is_read_then_its_task_index_moves_to_slots() -> TestResult {
    an_older_journal_is_read_then_moved_to_the_current_format(b'5', b'5').await
}

/// A move cut short by a crash: the format already says 6, some keys are still in the
/// older index. The next open moves the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_to_the_current_format_cut_short_is_finished_at_the_next_open() -> TestResult {
    an_older_journal_is_read_then_moved_to_the_current_format(b'3', b'6').await
}

/// Three calls ("done" and "kept" completed, "cut" left in flight) rewritten the way
/// `format` stored them, the journal then marked `marked`. An offline audit reads it
/// as it is; opening it moves it to format 8 (two keys per frame in tests), and every
/// record reads, replays, verifies and expires as before.
async fn an_older_journal_is_read_then_moved_to_the_current_format(
    format: u8,
    marked: u8,
) -> TestResult {
    let dir = tempfile::tempdir()?;
    let options = Options {
        retention: Duration::from_secs(3600),
        tombstone_retention: Duration::from_secs(86_400),
        ..Options::new(dir.path())
    };
    {
        let (journal, writer, _) = Journal::open(options.clone())?;
        let task = tokio::spawn(writer.run());
        for key in ["done", "kept"] {
            let Begin::Execute { ticket, .. } = journal.begin(intent(key)?).await? else {
                return Err("a fresh key must execute".into());
            };
            let response = StoredResponse::new(200, Headers::default(), Body::from("{\"id\":7}"));
            journal.complete(&ticket, response).await?;
        }
        // Left in flight: the restart below rewrites it.
        journal.begin(intent("cut")?).await?;
        drop(journal);
        task.await?;
    }
    to_format(format, dir.path(), &["done", "kept", "cut"])?;
    {
        let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
        store.raw_put(keys::FORMAT, &[marked])?;
        store.flush()?;
    }
    {
        let audit = Journal::open_for_audit(dir.path())?;
        let done = audit
            .get(&IdempotencyKey::new("done")?)?
            .ok_or("the audit misses a record of the older index")?;
        assert_eq!(done.final_status, Some(200));
        assert_eq!(audit.list(&crate::Filter::default())?.len(), 3);
        assert_eq!(
            crate::audit::tests::paged(|filter| audit.page(filter), 1)?,
            crate::audit::tests::paged(|filter| audit.page(filter), 100)?,
            "pages of one record list each once, in order"
        );
        assert_eq!(
            crate::audit::tests::paged_with(|filter| audit.page(filter), by_task()?, 1)?,
            crate::audit::tests::paged(|filter| audit.page(filter), 100)?,
            "the task's records through the older task index"
        );
        assert!(audit.verify()?.is_clean());
    }

    let start = SystemTime::now();
    let (journal, writer, recovery) = Journal::open(options.clone())?;
    let task = tokio::spawn(writer.run());
    assert_eq!(recovery.records, 3);
    assert!(recovery.undecodable.is_empty());
    assert_eq!(recovery.in_doubt, [IdempotencyKey::new("cut")?]);
    let done = journal
        .get(&IdempotencyKey::new("done")?)?
        .ok_or("done lost")?;
    assert_eq!(
        (done.state, done.final_status),
        (State::Completed, Some(200))
    );
    assert!(matches!(
        journal.begin(intent("kept")?).await?,
        Begin::Replay(_)
    ));
    assert_eq!(journal.list(&crate::Filter::default())?.len(), 3);
    assert_eq!(
        crate::audit::tests::paged_with(|filter| journal.page(filter), by_task()?, 1)?,
        crate::audit::tests::paged(|filter| journal.page(filter), 100)?,
        "the task's records through the moved task index"
    );
    let report = journal.verify()?;
    assert!(report.is_clean(), "{report:?}");
    // Retention rewrites "done" as a tombstone, then forgets it.
    journal.reap(start + Duration::from_secs(2 * 3600)).await?;
    drop(journal);
    task.await?;

    let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
    assert_eq!(store.get(keys::FORMAT)?.as_deref(), Some(&b"8"[..]));
    assert_eq!(
        store.scan_prefix(keys::RECORDS).count(),
        0,
        "the older index is left behind"
    );
    assert_eq!(
        store.scan_prefix(keys::TASKS_BY_TIME).count(),
        0,
        "the older task index is left behind"
    );
    assert_eq!(
        store.scan_prefix(keys::TASKS).count(),
        3,
        "the task index by slot"
    );
    let moved = crate::slots::slot(&store, "done")?.ok_or("a record stays inline")?;
    assert!(
        store
            .get(&crate::slots::index_key("done", moved))?
            .is_some()
    );
    assert!(crate::slots::slot(&store, "cut")?.is_some());
    assert!(store.get(&keys::body(moved))?.is_some());
    drop(store);

    let (journal, writer, _) = Journal::open(options)?;
    let task = tokio::spawn(writer.run());
    let report = journal
        .reap(start + Duration::from_secs(3 * 86_400))
        .await?;
    assert_eq!(report.purged, 2, "the call in doubt outlives retention");
    assert!(journal.verify()?.is_clean());
    drop(journal);
    task.await?;
    let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
    assert_eq!(crate::slots::slot(&store, "done")?, None);
    assert_eq!(store.get(&crate::slots::index_key("done", moved))?, None);
    assert_eq!(
        store.get(&keys::task("task-1", moved, "done"))?,
        None,
        "a purged record's task entry goes with it"
    );
    assert_eq!(
        store.get(&keys::body(moved))?,
        None,
        "a purged record's slot is freed"
    );
    Ok(())
}

/// The filter of task-1's records (every record of [`intent`]).
fn by_task() -> Result<crate::Filter, Box<dyn StdError>> {
    Ok(crate::Filter {
        task: Some(TaskId::new("task-1")?),
        ..crate::Filter::default()
    })
}

/// Records in different index generations: each is found, by the writer and by a
/// reader, however many generations back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_found_across_index_generations() -> TestResult {
    let dir = tempfile::tempdir()?;
    let complete = async |journal: &Journal, key: &str| -> TestResult {
        let Begin::Execute { ticket, .. } = journal.begin(intent(key)?).await? else {
            return Err("a fresh key must execute".into());
        };
        let response = StoredResponse::new(200, Headers::default(), Body::from("{}"));
        journal.complete(&ticket, response).await?;
        Ok(())
    };
    {
        let (journal, writer, _) = Journal::open(Options::new(dir.path()))?;
        let task = tokio::spawn(writer.run());
        complete(&journal, "old").await?;
        complete(&journal, "mid").await?;
        drop(journal);
        task.await?;
    }
    // "mid" moves to the first slot of generation 2, so that new records follow it
    // there, two generations after "old" (generation 0).
    let far = 2 << 16;
    {
        let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
        let slot = crate::slots::slot(&store, "mid")?.ok_or("mid missing")?;
        let bytes = store.get(&keys::body(slot))?.ok_or("slot empty")?;
        store.raw_put(&keys::body(far), &bytes)?;
        store.raw_put(&crate::slots::index_key("mid", far), &keys::pointer(far))?;
        store.raw_remove(&keys::body(slot))?;
        store.raw_remove(&crate::slots::index_key("mid", slot))?;
        store.flush()?;
    }
    let (journal, writer, _) = Journal::open(Options::new(dir.path()))?;
    let task = tokio::spawn(writer.run());
    complete(&journal, "new").await?;
    for key in ["old", "mid", "new"] {
        let key = IdempotencyKey::new(key)?;
        assert!(journal.get(&key)?.is_some(), "{key} not found by a reader");
        let again = Intent {
            key: key.clone(),
            ..intent(key.as_str())?
        };
        assert!(
            matches!(journal.begin(again).await?, Begin::Replay(_)),
            "{key} not found by the writer"
        );
    }
    assert!(journal.verify()?.is_clean());
    drop(journal);
    task.await?;
    let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
    assert_eq!(crate::slots::slot(&store, "new")?, Some(far + 1));
    assert_eq!(crate::slots::slot(&store, "old")?, Some(1));
    Ok(())
}

/// Stray index keys past every generation there is (a damaged store) cost a lookup
/// one probe each, not one per generation up to the one they name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_index_key_does_not_make_a_lookup_probe_every_generation() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let (journal, writer, _) = Journal::open(Options::new(dir.path()))?;
        let task = tokio::spawn(writer.run());
        executed(&journal, "old", 200, "{}").await?;
        drop(journal);
        task.await?;
    }
    {
        let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
        let mut stray = keys::INDEX.to_vec();
        stray.extend_from_slice(&[0xff; 4]);
        stray.extend_from_slice(b"stray");
        store.raw_put(&stray, &keys::pointer(1))?;
        // Too short to name a generation, and sorting after every other entry.
        store.raw_put(b"i/\xff\xff\xff\xff\xff", &keys::pointer(1))?;
        store.raw_put(b"i/\x00\x00\x01", &keys::pointer(1))?;
        store.flush()?;
    }
    let audit = Journal::open_for_audit(dir.path())?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let found = |key: &str| -> Result<bool, String> {
            let key = IdempotencyKey::new(key).map_err(|e| e.to_string())?;
            Ok(audit.get(&key).map_err(|e| e.to_string())?.is_some())
        };
        let _ = tx.send(found("absent").and_then(|a| Ok((a, found("old")?))));
    });
    let found = rx
        .recv_timeout(Duration::from_secs(20))
        .map_err(|_| "a lookup probed every generation up to the stray key's")??;
    assert_eq!(found, (false, true));
    Ok(())
}

#[test]
fn a_journal_of_a_later_format_is_refused_not_misread() -> TestResult {
    let dir = tempfile::tempdir()?;
    drop(Journal::open(Options::new(dir.path()))?);
    let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
    store.raw_put(keys::FORMAT, b"9")?;
    store.flush()?;
    drop(store);
    let Err(e) = Journal::open(Options::new(dir.path())) else {
        return Err("a format-9 journal was opened".into());
    };
    assert!(
        e.to_string()
            .contains("holds journal format \"9\", which this build does not know"),
        "{e}"
    );
    // Nor read by the audit.
    let Err(Error::Invalid { what, detail }) = Journal::open_for_audit(dir.path()) else {
        return Err("the audit read a format-9 journal".into());
    };
    assert_eq!(what, "journal format");
    assert!(
        detail.contains("format \"9\"") && detail.contains("newer build"),
        "{detail}"
    );
    Ok(())
}

fn stream_request() -> crate::StreamRequest {
    crate::StreamRequest {
        fingerprint: Fingerprint([3; 32]),
        task_id: None,
        request_id: RequestId::from_generated("req-stream".to_owned()),
        provider: "openai".to_owned(),
        model: "gpt".to_owned(),
        policy_versions: Vec::new(),
    }
}

fn events(from: u64, n: u64) -> Vec<bytes::Bytes> {
    (from..from + n)
        .map(|i| bytes::Bytes::from(format!("data: {i}\n\n")))
        .collect()
}

/// Rewrites a stream the way format 2 stored it: its events under its key, its
/// metadata naming no slot.
fn to_format_2_stream(store: &Store, key: &str) -> TestResult {
    let raw = store.get(&keys::stream(key))?.ok_or("stream missing")?;
    let mut meta = crate::writer::decode_stream(key, &raw)?;
    let slot = meta.events_slot.take().ok_or("stream not in a slot")?;
    let from = keys::events_prefix(keys::Events::Slot(slot));
    for entry in store.scan_prefix(&from).collect::<Vec<_>>() {
        let (storage_key, value) = entry?;
        let mut old = keys::events_prefix(keys::Events::Key(key));
        old.extend_from_slice(&storage_key[from.len()..]);
        store.raw_put(&old, &value)?;
        store.raw_remove(&storage_key)?;
    }
    store.raw_put(&keys::stream(key), &serde_json::to_vec(&meta)?)?;
    store.raw_put(keys::FORMAT, b"2")?;
    Ok(())
}

fn count_prefix(store: &Store, prefix: &[u8]) -> usize {
    store.scan_prefix(prefix).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn format_2_streams_are_read_under_their_key_and_new_streams_get_slots() -> TestResult {
    let dir = tempfile::tempdir()?;
    let options = Options {
        stream_retention: Duration::from_secs(3600),
        ..Options::new(dir.path())
    };
    let old = crate::StreamKey::new("old")?;
    let begun = crate::StreamKey::new("begun")?;
    let completed = || crate::StreamEnd::Completed {
        usage: serde_json::json!({}),
        continued: 0,
    };
    {
        let (journal, writer, _) = Journal::open(options.clone())?;
        let task = tokio::spawn(writer.run());
        journal.stream_begin(&old, stream_request()).await?;
        journal
            .stream_append(&old, 1, 0, events(0, 4), true)
            .await?;
        journal.stream_end(&old, 1, completed()).await?;
        // Begun just before the stop, with no events yet: its slot must not be reused.
        journal.stream_begin(&begun, stream_request()).await?;
        drop(journal);
        task.await?;
    }
    let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
    to_format_2_stream(&store, "old")?;
    let begun_slot = {
        let raw = store.get(&keys::stream("begun"))?.ok_or("begun missing")?;
        crate::writer::decode_stream("begun", &raw)?
            .events_slot
            .ok_or("a new stream has a slot")?
    };
    store.flush()?;
    drop(store);

    let (journal, writer, _) = Journal::open(options.clone())?;
    let task = tokio::spawn(writer.run());
    let read = journal.stream_events(&old, 1, None)?;
    assert_eq!(
        read,
        events(0, 4)
            .into_iter()
            .enumerate()
            .map(|(i, e)| (i as u64, e))
            .collect::<Vec<_>>()
    );
    assert_eq!(journal.stream_meta(&old)?.and_then(|m| m.last_seq), Some(3));
    assert_eq!(journal.stream_events(&old, 1, Some(1))?.len(), 2);
    let fresh = crate::StreamKey::new("fresh")?;
    journal.stream_begin(&fresh, stream_request()).await?;
    journal
        .stream_append(&fresh, 1, 0, events(0, 3), true)
        .await?;
    journal.stream_end(&fresh, 1, completed()).await?;
    assert_eq!(journal.stream_events(&fresh, 1, None)?.len(), 3);
    let start = SystemTime::now();
    drop(journal);
    task.await?;

    let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
    assert_eq!(store.get(keys::FORMAT)?.as_deref(), Some(&b"8"[..]));
    let raw = store.get(&keys::stream("fresh"))?.ok_or("fresh missing")?;
    let fresh_slot = crate::writer::decode_stream("fresh", &raw)?
        .events_slot
        .ok_or("a new stream has a slot")?;
    // One key's metadata found under another's is refused, not served as its.
    let moved = crate::writer::decode_stream("begun", &raw).expect_err("another key's");
    assert!(
        moved.to_string().contains("holds the stream of fresh"),
        "{moved}"
    );
    assert!(
        fresh_slot > begun_slot,
        "slot {fresh_slot} reused (begun has {begun_slot})"
    );
    assert_eq!(
        count_prefix(&store, &keys::events_prefix(keys::Events::Slot(fresh_slot))),
        1
    );
    assert_eq!(
        count_prefix(&store, &keys::events_prefix(keys::Events::Key("fresh"))),
        0
    );
    assert_eq!(
        count_prefix(&store, &keys::events_prefix(keys::Events::Key("old"))),
        1
    );
    drop(store);

    // Retention drops both layouts' events with their streams.
    let (journal, writer, _) = Journal::open(options)?;
    let task = tokio::spawn(writer.run());
    let report = journal.reap(start + Duration::from_secs(2 * 3600)).await?;
    assert!(report.streams_dropped >= 2, "{report:?}");
    drop(journal);
    task.await?;
    let store = Store::open(dir.path(), 16 << 20, Durability::Process, false)?;
    assert_eq!(
        count_prefix(&store, &keys::events_prefix(keys::Events::Key("old"))),
        0
    );
    assert_eq!(
        count_prefix(&store, &keys::events_prefix(keys::Events::Slot(fresh_slot))),
        0
    );
    // Its metadata stays, expired.
    let old = store.get(&keys::stream("old"))?.ok_or("expired metadata")?;
    let old = crate::writer::decode_stream("old", &old)?;
    assert_eq!(old.state, crate::StreamState::Expired);
    Ok(())
}

/// A journal of `keys`, each completed, left by a stopped sidecar.
async fn completed(dir: &std::path::Path, keys: &[&str]) -> TestResult {
    let (journal, writer, _) = Journal::open(Options::new(dir))?;
    let task = tokio::spawn(writer.run());
    for key in keys {
        let Begin::Execute { ticket, .. } = journal.begin(intent(key)?).await? else {
            return Err("a fresh key must execute".into());
        };
        let response = StoredResponse::new(200, Headers::default(), Body::from("{\"id\":1}"));
        journal.complete(&ticket, response).await?;
    }
    drop(journal);
    task.await?;
    Ok(())
}

fn listed(audit: &crate::Audit) -> Result<Vec<(String, State)>, Box<dyn StdError>> {
    Ok(audit
        .list(&crate::Filter::default())?
        .into_iter()
        .map(|r| (r.key.to_string(), r.state))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_reads_a_copy_changes_no_file_and_holds_no_lock() -> TestResult {
    let dir = tempfile::tempdir()?;
    completed(dir.path(), &["k0", "k1"]).await?;
    let wal = dir.path().join("wal");
    assert!(wal.metadata()?.len() > 0, "the log holds the commits");
    let before = crate::store::snapshot(dir.path());
    {
        let audit = Journal::open_for_audit(dir.path())?;
        assert_eq!(audit.dir(), dir.path());
        assert_eq!(audit.damage(), None);
        assert_eq!(
            listed(&audit)?,
            [
                ("k0".to_owned(), State::Completed),
                ("k1".to_owned(), State::Completed)
            ]
        );
        assert!(audit.verify()?.is_clean());
        // A sidecar (re)starting meanwhile is not kept out.
        crate::store::check_unlocked(dir.path())?;
    }
    assert_eq!(
        crate::store::snapshot(dir.path()),
        before,
        "the audit wrote to the journal's directory"
    );

    // Nor does it create a log that is missing.
    std::fs::remove_file(&wal)?;
    let before = crate::store::snapshot(dir.path());
    drop(Journal::open_for_audit(dir.path())?);
    assert_eq!(crate::store::snapshot(dir.path()), before);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_holds_the_journal_s_lock_while_it_copies_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    completed(dir.path(), &["k0"]).await?;
    // What a sidecar starting meanwhile would find, for each file copied.
    let found = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let journal = dir.path().to_owned();
    let seen = found.clone();
    crate::audit::ON_COPY.set(Some(Box::new(move |file| {
        let locked = matches!(
            crate::store::check_unlocked(&journal),
            Err(Error::Locked { .. })
        );
        seen.borrow_mut().push((file.to_owned(), locked));
    })));
    let audit = Journal::open_for_audit(dir.path());
    crate::audit::ON_COPY.set(None);
    drop(audit?);
    let found = found.borrow();
    assert!(
        found.iter().any(|(file, _)| file.ends_with("db")),
        "{found:?}"
    );
    assert!(found.iter().all(|(_, locked)| *locked), "{found:?}");
    // And lets it go once the copy is made.
    crate::store::check_unlocked(dir.path())?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_log_is_refused_by_the_sidecar_and_read_up_to_the_damage_by_an_audit()
-> TestResult {
    let first = tempfile::tempdir()?;
    // Keys long enough that no timestamp or id in another frame spells one.
    completed(
        first.path(),
        &[
            "damaged-log-k0",
            "damaged-log-k1",
            "damaged-log-k2",
            "damaged-log-k3",
        ],
    )
    .await?;
    let log = std::fs::read(first.path().join("wal"))?;
    // Each frame's span (length, CRC-32, payload); the first that names k3 (its
    // begin) is damaged, with k3's completion, a whole frame, after it.
    let mut frames = Vec::new();
    let mut at = 0;
    while at < log.len() {
        let len = u32::from_le_bytes(log[at..at + 4].try_into()?) as usize;
        frames.push((at, at + 8 + len));
        at += 8 + len;
    }
    let (frame, start) = frames
        .iter()
        .position(|&(s, e)| log[s..e].windows(14).any(|w| w == b"damaged-log-k3"))
        .map(|i| (i, frames[i].0))
        .ok_or("no frame names k3")?;
    let mut damaged = log.clone();
    damaged[start + 8] ^= 0xff;

    // A journal whose sled has nothing yet, as a killed process leaves it.
    let dir = tempfile::tempdir()?;
    drop(Store::open(
        dir.path(),
        16 << 20,
        Durability::Process,
        true,
    )?);
    std::fs::write(dir.path().join("wal"), &damaged)?;
    let before = crate::store::snapshot(dir.path());

    let opened = Journal::open(Options::new(dir.path()));
    let Err(Error::Corrupt { detail, .. }) = &opened else {
        return Err(format!("a damaged log must be refused: {:?}", opened.err()).into());
    };
    assert!(detail.contains(&format!("frame {}", frame + 1)), "{detail}");
    let text = opened.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        text.contains("outrigger journal quarantine --journal-dir") && !text.contains("Journal::"),
        "{text}"
    );

    let audit = Journal::open_for_audit(dir.path())?;
    assert_eq!(
        listed(&audit)?,
        [
            ("damaged-log-k0".to_owned(), State::Completed),
            ("damaged-log-k1".to_owned(), State::Completed),
            ("damaged-log-k2".to_owned(), State::Completed)
        ],
        "what the frames before the damage wrote"
    );
    let damage = audit.damage().ok_or("the damage is reported")?;
    assert_eq!(
        (damage.frame, damage.at, damage.bytes_after),
        (frame + 1, start as u64, (log.len() - start) as u64)
    );
    assert!(
        damage.to_string().contains(&format!("frame {}", frame + 1)),
        "{damage}"
    );
    drop(audit);
    assert_eq!(
        crate::store::snapshot(dir.path()),
        before,
        "neither the sidecar's open nor the audit changed a file"
    );
    Ok(())
}
