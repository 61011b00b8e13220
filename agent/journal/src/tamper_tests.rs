//! Tampering with the bytes on disk (through the raw store, the only way in besides
//! the writer) and checking that `verify` names each change.

use std::error::Error as StdError;

use outrigger_types::{Fingerprint, IdempotencyKey, RequestId, TaskId, ToolClass};

use crate::options::Durability;
use crate::store::{Store, keys};
use crate::{
    Begin, Body, Headers, Intent, Journal, KeySource, Options, Problem, RedactedRequest,
    StoredResponse,
};

type TestResult = Result<(), Box<dyn StdError>>;

fn intent(key: &str) -> Result<Intent, Box<dyn StdError>> {
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
        let k0 = keys::record("k0");
        let original = String::from_utf8(store.get(&k0)?.ok_or("k0 missing")?)?;
        let edited = original.replace("\"final_status\":200", "\"final_status\":201");
        assert_ne!(original, edited);
        store.raw_put(&k0, edited.as_bytes())?;
        store.raw_remove(&keys::record("k1"))?;
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
async fn node_durability_writes_and_reopens() -> TestResult {
    let dir = tempfile::tempdir()?;
    let options = Options {
        durability: Durability::Node,
        ..Options::new(dir.path())
    };
    let (journal, writer, _) = Journal::open(options.clone())?;
    let task = tokio::spawn(writer.run());
    let Begin::Execute { ticket, .. } = journal.begin(intent("n1")?).await? else {
        return Err("a fresh key must execute".into());
    };
    let response = StoredResponse::new(201, Headers::default(), Body::from("ok"));
    journal.complete(&ticket, response).await?;
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
