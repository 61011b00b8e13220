//! A real crash: a child process journals, then aborts without any shutdown (no
//! final flush, no destructors), like `kill -9`. Every write acknowledged as durable
//! must be there when the journal is reopened.

use std::error::Error as StdError;
use std::path::Path;
use std::process::Command;

use bytes::Bytes;
use outrigger_journal::{
    Begin, Body, Headers, Intent, Journal, KeySource, Options, RedactedRequest, State, StreamKey,
    StreamRequest, StreamState,
};
use outrigger_types::{Fingerprint, IdempotencyKey, RequestId, TaskId, ToolClass};

type TestResult = Result<(), Box<dyn StdError>>;

const DIR_VAR: &str = "OUTRIGGER_JOURNAL_CRASH_DIR";

fn intent(key: &str, class: ToolClass) -> Result<Intent, Box<dyn StdError>> {
    Ok(Intent {
        key: IdempotencyKey::new(key)?,
        fingerprint: Fingerprint([3; 32]),
        tool: "orders".to_owned(),
        class,
        method: "POST".to_owned(),
        target: "http://127.0.0.1:9/orders".to_owned(),
        task_id: Some(TaskId::new("crash-task")?),
        request_id: RequestId::from_generated(format!("req-{key}")),
        downstream_key: key.to_owned(),
        request: RedactedRequest::new(Headers::default(), Body::from("{}")),
        policy_versions: Vec::new(),
        model_revision: None,
        derived_from: KeySource::Header,
    })
}

fn stream_request() -> StreamRequest {
    StreamRequest {
        fingerprint: Fingerprint([4; 32]),
        task_id: None,
        request_id: RequestId::from_generated("req-s".to_owned()),
        provider: "openai".to_owned(),
        model: "gpt".to_owned(),
        policy_versions: Vec::new(),
    }
}

fn event(seq: u64) -> Bytes {
    Bytes::from(format!("data: {{\"seq\":{seq}}}\n\n"))
}

async fn journal_then_abort(dir: &Path) -> TestResult {
    let (journal, writer, _) = Journal::open(Options::new(dir))?;
    tokio::spawn(writer.run());
    for (key, class) in [("keyed", ToolClass::Keyed), ("unsafe", ToolClass::Unsafe)] {
        let Begin::Execute { ticket, .. } = journal.begin(intent(key, class)?).await? else {
            return Err("a fresh key must execute".into());
        };
        if class == ToolClass::Unsafe {
            journal.dispatched(&ticket).await?;
        }
    }
    journal.begin(intent("claimed", ToolClass::Unsafe)?).await?;
    let stream = StreamKey::new("s")?;
    journal.stream_begin(&stream, stream_request()).await?;
    for seq in 0..4 {
        journal
            .stream_append(&stream, 1, seq, vec![event(seq)], false)
            .await?;
    }
    journal
        .stream_append(&stream, 1, 4, vec![event(4)], true)
        .await?;
    for seq in 5..8 {
        journal
            .stream_append(&stream, 1, seq, vec![event(seq)], false)
            .await?;
    }
    std::fs::write(dir.join("acknowledged"), b"")?;
    std::process::abort();
}

#[test]
#[ignore = "the child process of kill_mid_flight_keeps_every_acknowledged_write"]
fn crash_child() -> TestResult {
    let dir = std::env::var(DIR_VAR)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(journal_then_abort(Path::new(&dir)))
}

#[test]
fn kill_mid_flight_keeps_every_acknowledged_write() -> TestResult {
    let dir = tempfile::tempdir()?;
    let status = Command::new(std::env::current_exe()?)
        .args(["--ignored", "--exact", "crash_child", "--test-threads=1"])
        .env(DIR_VAR, dir.path())
        .output()?;
    assert!(
        !status.status.success(),
        "the child must die by abort: {status:?}"
    );
    assert!(
        dir.path().join("acknowledged").exists(),
        "the child died before its writes were acknowledged: {}",
        String::from_utf8_lossy(&status.stderr)
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let (journal, writer, recovery) = Journal::open(Options::new(dir.path()))?;
        let writer = tokio::spawn(writer.run());
        assert_eq!(recovery.in_doubt, [IdempotencyKey::new("keyed")?]);
        assert_eq!(recovery.needs_operator, [IdempotencyKey::new("unsafe")?]);
        assert_eq!(
            recovery.failed_before_send,
            [IdempotencyKey::new("claimed")?]
        );
        let state = |k: &str| -> Result<Option<State>, Box<dyn StdError>> {
            Ok(journal.get(&IdempotencyKey::new(k)?)?.map(|r| r.state))
        };
        assert_eq!(state("keyed")?, Some(State::InDoubt));
        assert_eq!(state("unsafe")?, Some(State::NeedsOperator));

        let stream = StreamKey::new("s")?;
        let meta = journal.stream_meta(&stream)?.ok_or("the stream was lost")?;
        assert_eq!(meta.state, StreamState::Abandoned);
        let seqs: Vec<u64> = journal
            .stream_events(&stream, 1, None)?
            .into_iter()
            .map(|(seq, bytes)| {
                assert_eq!(bytes, event(seq));
                seq
            })
            .collect();
        assert!(
            seqs.len() >= 5,
            "the durable event (4) and all before it: {seqs:?}"
        );
        assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>(), "no holes");
        assert!(journal.verify()?.is_clean());
        drop(journal);
        writer.await?;
        Ok(())
    })
}
