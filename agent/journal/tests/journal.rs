//! The journal through its public API, on real sled in temporary directories.

use std::error::Error as StdError;
use std::path::Path;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use outrigger_journal::{
    Begin, Body, Error, Filter, Headers, Intent, Journal, KeySource, Options, RedactedRequest,
    Resolution, State, StoredResponse, StreamBegin, StreamEnd, StreamKey, StreamRequest,
    StreamState, WriteFault,
};
use outrigger_types::{Fingerprint, IdempotencyKey, PolicyVersion, RequestId, TaskId, ToolClass};
use tokio::task::JoinHandle;

type TestResult = Result<(), Box<dyn StdError>>;

struct Running {
    journal: Journal,
    writer: JoinHandle<()>,
}

impl Running {
    fn open(options: Options) -> Result<(Self, outrigger_journal::Recovery), Error> {
        let (journal, writer, recovery) = Journal::open(options)?;
        let writer = tokio::spawn(writer.run());
        Ok((Self { journal, writer }, recovery))
    }

    /// Drops every handle and waits for the writer's final flush, as a stopping
    /// sidecar does; the directory can then be opened again.
    async fn stop(self) -> TestResult {
        drop(self.journal);
        self.writer.await?;
        Ok(())
    }
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).unwrap_or_else(|e| panic!("{e}"))
}

fn intent(k: &str, class: ToolClass) -> Intent {
    Intent {
        key: key(k),
        fingerprint: Fingerprint([1; 32]),
        tool: "crm".to_owned(),
        class,
        method: "POST".to_owned(),
        target: "http://127.0.0.1:9/contacts".to_owned(),
        task_id: TaskId::new("task-a").ok(),
        request_id: RequestId::from_generated(format!("req-{k}")),
        downstream_key: format!("down-{k}"),
        request: RedactedRequest::new(
            Headers::redacted([
                ("Authorization".to_owned(), "Bearer sk-secret".to_owned()),
                ("content-type".to_owned(), "application/json".to_owned()),
            ]),
            Body::from("{\"name\":\"Ada\"}"),
        ),
        policy_versions: vec![PolicyVersion::new("retry", "0123456789abcdef99")],
        model_revision: Some("m-2026-01".to_owned()),
        derived_from: KeySource::Header,
    }
}

fn ok(status: u16) -> StoredResponse {
    StoredResponse::new(
        status,
        Headers::redacted([("set-cookie".to_owned(), "s=1".to_owned())]),
        Body::from("{\"id\":42}"),
    )
}

async fn execute(
    journal: &Journal,
    intent: Intent,
) -> Result<outrigger_journal::Ticket, Box<dyn StdError>> {
    match journal.begin(intent).await? {
        Begin::Execute { ticket, .. } => Ok(ticket),
        other => Err(format!("expected Execute, got {other:?}").into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_twenty_requests_one_execution() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let journal = run.journal.clone();
        tasks.push(tokio::spawn(async move {
            journal.begin(intent("same", ToolClass::Keyed)).await
        }));
    }
    let mut tickets = Vec::new();
    let mut in_flight = 0;
    for task in tasks {
        match task.await?? {
            Begin::Execute { ticket, resend, .. } => {
                assert!(!resend);
                tickets.push(ticket);
            }
            Begin::InFlight { record } => {
                assert_eq!(record.state, State::Dispatched);
                in_flight += 1;
            }
            other => return Err(format!("unexpected {other:?}").into()),
        }
    }
    assert_eq!((tickets.len(), in_flight), (1, 19));
    assert_eq!(
        run.journal.complete(&tickets[0], ok(201)).await?,
        State::Completed
    );

    let mut tasks = Vec::new();
    for _ in 0..20 {
        let journal = run.journal.clone();
        tasks.push(tokio::spawn(async move {
            journal.begin(intent("same", ToolClass::Keyed)).await
        }));
    }
    for task in tasks {
        let Begin::Replay(record) = task.await?? else {
            return Err("after completion every request replays".into());
        };
        let response = record.response.ok_or("no stored response")?;
        assert_eq!(response.status, 201);
        assert_eq!(response.body, Body::from("{\"id\":42}"));
        assert_eq!(response.headers.get("set-cookie"), None);
    }
    assert_eq!(run.journal.stats().replays, 20);
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_share_flushes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let before = run.journal.stats();
    let mut tasks = Vec::new();
    for i in 0..64 {
        let journal = run.journal.clone();
        tasks.push(tokio::spawn(async move {
            let ticket = execute(&journal, intent(&format!("gc-{i}"), ToolClass::Keyed))
                .await
                .map_err(|e| e.to_string())?;
            journal
                .complete(&ticket, ok(200))
                .await
                .map_err(|e| e.to_string())
        }));
    }
    for task in tasks {
        assert_eq!(task.await??, State::Completed);
    }
    let stats = run.journal.stats();
    let records = stats.records_written - before.records_written;
    let flushes = stats.flushes - before.flushes;
    assert_eq!(records, 128);
    assert!(flushes < records, "{flushes} flushes for {records} records");
    assert_eq!(stats.states.completed, 64);
    assert_eq!(stats.flush_errors, 0);
    // Shared commits chain several changes per log entry; the chain still verifies.
    let report = run.journal.verify()?;
    assert!(report.is_clean(), "{report:?}");
    assert!(
        report.entries < records,
        "{} entries for {records} changes",
        report.entries
    );
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_that_cannot_write_fails_closed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    for fault in [WriteFault::FailFlush, WriteFault::FailApply] {
        run.journal.set_write_fault(Some(fault));
        let refused = run.journal.begin(intent("f-1", ToolClass::Keyed)).await;
        assert!(
            matches!(refused, Err(Error::Unavailable(_))),
            "{fault:?}: {refused:?}"
        );
        assert_eq!(run.journal.get(&key("f-1"))?, None, "{fault:?}");
        let dispatched = Filter {
            state: Some(State::Dispatched),
            ..Filter::default()
        };
        assert!(run.journal.list(&dispatched)?.is_empty(), "{fault:?}");
        assert_eq!(run.journal.stats().states.dispatched, 0);
    }
    assert_eq!(run.journal.stats().flush_errors, 2);

    // Outcomes fail closed too: the caller must not release a response.
    run.journal.set_write_fault(None);
    let ticket = execute(&run.journal, intent("f-1", ToolClass::Keyed)).await?;
    run.journal.set_write_fault(Some(WriteFault::FailFlush));
    let refused = run.journal.complete(&ticket, ok(200)).await;
    assert!(matches!(refused, Err(Error::Unavailable(_))), "{refused:?}");
    assert_eq!(
        run.journal.get(&key("f-1"))?.map(|r| r.state),
        Some(State::Dispatched)
    );

    run.journal.set_write_fault(None);
    assert_eq!(
        run.journal.complete(&ticket, ok(200)).await?,
        State::Completed
    );
    assert!(run.journal.verify()?.is_clean());
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_flush_failed_is_not_replayed_at_the_next_open() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let (run, _) = Running::open(Options::new(dir.path()))?;
        let ticket = execute(&run.journal, intent("f-2", ToolClass::Keyed)).await?;
        run.journal.set_write_fault(Some(WriteFault::FailFlush));
        let refused = run.journal.complete(&ticket, ok(200)).await;
        assert!(matches!(refused, Err(Error::Unavailable(_))), "{refused:?}");
        run.journal.set_write_fault(None);
        run.stop().await?;
    }
    // The refused outcome was never acknowledged: the write-ahead log replayed at
    // open must not bring it back. The call was sent, so it is in doubt.
    let (run, recovery) = Running::open(Options::new(dir.path()))?;
    assert_eq!(recovery.in_doubt, [key("f-2")]);
    assert_eq!(
        run.journal.get(&key("f-2"))?.map(|r| r.state),
        Some(State::InDoubt)
    );
    assert!(run.journal.verify()?.is_clean());
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_settles_what_was_in_flight() -> TestResult {
    let dir = tempfile::tempdir()?;
    let stream = StreamKey::new("stream-1")?;
    let first_epoch;
    {
        let (run, recovery) = Running::open(Options::new(dir.path()))?;
        first_epoch = recovery.epoch;
        execute(&run.journal, intent("keyed", ToolClass::Keyed)).await?;
        execute(&run.journal, intent("probe", ToolClass::Probe)).await?;
        let unsafe_sent = execute(&run.journal, intent("unsafe-sent", ToolClass::Unsafe)).await?;
        run.journal.dispatched(&unsafe_sent).await?;
        execute(&run.journal, intent("unsafe-claimed", ToolClass::Unsafe)).await?;
        let done = execute(&run.journal, intent("done", ToolClass::Unsafe)).await?;
        run.journal.dispatched(&done).await?;
        run.journal.complete(&done, ok(200)).await?;
        let begun = run.journal.stream_begin(&stream, stream_request(1)).await?;
        assert_eq!(new_attempt(&begun), Some(1));
        run.stop().await?;
    }

    let (run, recovery) = Running::open(Options::new(dir.path()))?;
    assert_eq!(recovery.epoch, first_epoch + 1);
    assert_eq!(recovery.records, 5);
    assert_eq!(recovery.in_doubt, [key("keyed"), key("probe")]);
    assert_eq!(recovery.needs_operator, [key("unsafe-sent")]);
    assert_eq!(recovery.failed_before_send, [key("unsafe-claimed")]);
    assert_eq!(recovery.abandoned_streams, std::slice::from_ref(&stream));

    let state = |k: &str| -> Result<Option<State>, Error> {
        Ok(run.journal.get(&key(k))?.map(|r| r.state))
    };
    assert_eq!(state("keyed")?, Some(State::InDoubt));
    assert_eq!(state("unsafe-sent")?, Some(State::NeedsOperator));
    assert_eq!(state("unsafe-claimed")?, Some(State::FailedBeforeSend));
    assert_eq!(state("done")?, Some(State::Completed));
    let stats = run.journal.stats();
    assert_eq!((stats.states.in_doubt, stats.states.needs_operator), (2, 1));
    assert_eq!(
        (stats.states.failed_before_send, stats.states.completed),
        (1, 1)
    );

    // What each class does with the next request for the same key.
    match run.journal.begin(intent("keyed", ToolClass::Keyed)).await? {
        Begin::Execute { ticket, resend, .. } => {
            assert!(resend);
            assert_eq!(ticket.attempt(), 2);
            assert_eq!(ticket.epoch(), recovery.epoch);
        }
        other => return Err(format!("keyed: {other:?}").into()),
    }
    assert!(matches!(
        run.journal.begin(intent("probe", ToolClass::Probe)).await?,
        Begin::Probe { .. }
    ));
    let Begin::OutcomeUnknown { record } = run
        .journal
        .begin(intent("unsafe-sent", ToolClass::Unsafe))
        .await?
    else {
        return Err("an unsafe in-doubt call must not execute".into());
    };
    assert_eq!(record.state, State::NeedsOperator);
    assert!(record.history.iter().any(|t| t.note.contains("restart")));
    match run
        .journal
        .begin(intent("unsafe-claimed", ToolClass::Unsafe))
        .await?
    {
        Begin::Execute { resend, .. } => assert!(!resend),
        other => return Err(format!("unsafe-claimed: {other:?}").into()),
    }
    assert!(matches!(
        run.journal.begin(intent("done", ToolClass::Unsafe)).await?,
        Begin::Replay(_)
    ));

    let meta = run.journal.stream_meta(&stream)?.ok_or("stream lost")?;
    assert_eq!(meta.state, StreamState::Abandoned);
    assert!(run.journal.verify()?.is_clean());
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_resolve_calls_of_unknown_outcome() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let ticket = execute(&run.journal, intent("wire", ToolClass::Unsafe)).await?;
    run.journal.dispatched(&ticket).await?;
    assert_eq!(
        run.journal.in_doubt(&ticket, "timeout after 30 s").await?,
        State::NeedsOperator
    );

    let refused = run
        .journal
        .resolve(
            &key("wire"),
            Resolution::MarkSucceeded(ok(500)),
            "alice",
            "bank says ok",
        )
        .await;
    assert!(
        matches!(refused, Err(Error::InvalidResolution(_))),
        "{refused:?}"
    );

    let record = run
        .journal
        .resolve(
            &key("wire"),
            Resolution::MarkSucceeded(ok(200)),
            "alice",
            "bank statement shows it",
        )
        .await?;
    assert_eq!(record.state, State::Completed);
    let resolution = record.resolutions.last().ok_or("no resolution journaled")?;
    assert_eq!(
        (
            resolution.actor.as_str(),
            resolution.action.as_str(),
            resolution.from_state
        ),
        ("alice", "mark_succeeded", State::NeedsOperator)
    );
    assert!(matches!(
        run.journal.begin(intent("wire", ToolClass::Unsafe)).await?,
        Begin::Replay(_)
    ));

    // Retry: the next request executes again (claimed; dispatched right before its send).
    let ticket = execute(&run.journal, intent("wire-2", ToolClass::Unsafe)).await?;
    run.journal.dispatched(&ticket).await?;
    run.journal.in_doubt(&ticket, "reset").await?;
    run.journal
        .resolve(
            &key("wire-2"),
            Resolution::Retry,
            "bob",
            "the bank never received it",
        )
        .await?;
    let retry = execute(&run.journal, intent("wire-2", ToolClass::Unsafe)).await?;
    assert_eq!(retry.attempt(), 2);
    let stale = run.journal.complete(&ticket, ok(200)).await;
    assert!(matches!(stale, Err(Error::Stale { .. })), "{stale:?}");
    assert!(run.journal.verify()?.is_clean());
    run.stop().await
}

/// Polls `fut` once (its command reaches the writer, which on this one thread cannot
/// answer yet) and drops it, as a request dropped by a departing agent is.
async fn poll_once_and_drop<F: std::future::Future>(fut: F) {
    let mut fut = std::pin::pin!(fut);
    let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx))).await;
    assert!(
        polled.is_pending(),
        "the writer answered within the first poll"
    );
}

/// Waits (up to 1 s) until `k`'s record is in `want` after more than `after`
/// transitions.
async fn state_becomes(j: &Journal, k: &str, want: State, after: usize) -> bool {
    for _ in 0..200 {
        let record = j.get(&key(k)).ok().flatten();
        if record.is_some_and(|r| r.state == want && r.history.len() > after) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

fn transitions(j: &Journal, k: &str) -> usize {
    j.get(&key(k)).ok().flatten().map_or(0, |r| r.history.len())
}

/// One thread: the writer runs only when the test yields.
#[tokio::test]
async fn a_caller_gone_before_the_journal_answered_leaves_no_key_in_flight() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let j = &run.journal;
    // Gone before its begin was answered: the call it never received was never sent.
    poll_once_and_drop(j.begin(intent("gone", ToolClass::Keyed))).await;
    assert!(state_becomes(j, "gone", State::FailedBeforeSend, 0).await);
    let ticket = execute(j, intent("gone", ToolClass::Keyed)).await?;
    assert_eq!(j.complete(&ticket, ok(200)).await?, State::Completed);
    // Gone before an unsafe call's second write was answered: never sent either.
    let ticket = execute(j, intent("gone-unsafe", ToolClass::Unsafe)).await?;
    let before = transitions(j, "gone-unsafe");
    poll_once_and_drop(j.dispatched(&ticket)).await;
    assert!(state_becomes(j, "gone-unsafe", State::FailedBeforeSend, before).await);
    execute(j, intent("gone-unsafe", ToolClass::Unsafe)).await?;
    // Gone before a probe was answered: back in doubt, to be probed again.
    let ticket = execute(j, intent("gone-probe", ToolClass::Probe)).await?;
    j.in_doubt(&ticket, "timeout").await?;
    let before = transitions(j, "gone-probe");
    poll_once_and_drop(j.begin(intent("gone-probe", ToolClass::Probe))).await;
    // Reconciling, then back in doubt.
    assert!(state_becomes(j, "gone-probe", State::InDoubt, before + 1).await);
    let again = j.begin(intent("gone-probe", ToolClass::Probe)).await?;
    assert!(matches!(again, Begin::Probe { .. }), "{again:?}");
    run.stop().await
}

/// Gone while an unsafe call's second write waited for room in the writer's queue:
/// the write never went out, and the call is settled as never sent all the same
/// (not left claimed until a restart).
#[tokio::test]
async fn a_dispatched_write_dropped_before_it_was_queued_settles_the_call() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let j = &run.journal;
    let ticket = execute(j, intent("queued", ToolClass::Unsafe)).await?;
    let before = transitions(j, "queued");
    // New streams' starts fill the queue (the writer, a task of this thread, does not
    // run until the test yields).
    let mut full = false;
    for i in 0..100_000 {
        let key = StreamKey::new(format!("filler-{i}"))?;
        let mut begin = std::pin::pin!(j.stream_begin(&key, stream_request(1)));
        let polled =
            std::future::poll_fn(|cx| std::task::Poll::Ready(begin.as_mut().poll(cx))).await;
        if polled.is_pending() {
            full = true;
            break;
        }
    }
    assert!(full, "the queue never filled");
    poll_once_and_drop(j.dispatched(&ticket)).await;
    assert!(state_becomes(j, "queued", State::FailedBeforeSend, before).await);
    // Never sent: a retry sends it.
    execute(j, intent("queued", ToolClass::Unsafe)).await?;
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_tools_are_reconciled_before_a_resend() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let ticket = execute(&run.journal, intent("p", ToolClass::Probe)).await?;
    assert_eq!(
        run.journal.complete(&ticket, ok(502)).await?,
        State::InDoubt
    );
    let Begin::Probe { ticket } = run.journal.begin(intent("p", ToolClass::Probe)).await? else {
        return Err("an in-doubt probe call must be probed".into());
    };
    // Meanwhile the key is taken.
    assert!(matches!(
        run.journal.begin(intent("p", ToolClass::Probe)).await?,
        Begin::InFlight { .. }
    ));
    let Begin::Execute { ticket, resend, .. } = run.journal.reconciled(&ticket, None).await? else {
        return Err("a probe that found nothing re-sends".into());
    };
    assert!(resend);
    assert_eq!(ticket.attempt(), 2);
    assert_eq!(
        run.journal.complete(&ticket, ok(200)).await?,
        State::Completed
    );

    let ticket = execute(&run.journal, intent("p2", ToolClass::Probe)).await?;
    run.journal.in_doubt(&ticket, "timeout").await?;
    let Begin::Probe { ticket } = run.journal.begin(intent("p2", ToolClass::Probe)).await? else {
        return Err("an in-doubt probe call must be probed".into());
    };
    let Begin::Replay(record) = run.journal.reconciled(&ticket, Some(ok(201))).await? else {
        return Err("a probe that found the outcome replays it".into());
    };
    assert_eq!(
        (record.state, record.final_status),
        (State::Completed, Some(201))
    );
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_call_in_flight() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let ticket = execute(&run.journal, intent("w", ToolClass::Keyed)).await?;
    let journal = run.journal.clone();
    let waiter = tokio::spawn(async move {
        journal
            .wait_settled(&key("w"), Duration::from_secs(30))
            .await
    });
    run.journal.complete(&ticket, ok(200)).await?;
    let settled = waiter.await??.ok_or("record vanished")?;
    assert_eq!(settled.state, State::Completed);

    execute(&run.journal, intent("w2", ToolClass::Keyed)).await?;
    let still = run
        .journal
        .wait_settled(&key("w2"), Duration::from_millis(20))
        .await?
        .ok_or("record vanished")?;
    assert_eq!(still.state, State::Dispatched);
    assert_eq!(
        run.journal
            .wait_settled(&key("nope"), Duration::from_millis(1))
            .await?,
        None
    );
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_requests_change_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let ticket = execute(&run.journal, intent("m", ToolClass::Keyed)).await?;
    run.journal.complete(&ticket, ok(200)).await?;
    let before = run.journal.get(&key("m"))?;
    let mut other = intent("m", ToolClass::Keyed);
    other.fingerprint = Fingerprint([2; 32]);
    assert!(matches!(
        run.journal.begin(other).await?,
        Begin::Mismatch { .. }
    ));
    assert_eq!(run.journal.get(&key("m"))?, before);
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_tombstones_then_purges() -> TestResult {
    let dir = tempfile::tempdir()?;
    let options = Options {
        retention: Duration::from_secs(3600),
        tombstone_retention: Duration::from_secs(86_400),
        stream_retention: Duration::from_secs(600),
        ..Options::new(dir.path())
    };
    let (run, _) = Running::open(options)?;
    let start = SystemTime::now();
    let ticket = execute(&run.journal, intent("old", ToolClass::Keyed)).await?;
    run.journal.complete(&ticket, ok(200)).await?;
    let parked = execute(&run.journal, intent("parked", ToolClass::Unsafe)).await?;
    run.journal.dispatched(&parked).await?;
    run.journal.in_doubt(&parked, "timeout").await?;
    let stream = StreamKey::new("s-old")?;
    run.journal.stream_begin(&stream, stream_request(1)).await?;
    run.journal
        .stream_append(
            &stream,
            1,
            0,
            vec![Bytes::from_static(b"data: x\n\n")],
            true,
        )
        .await?;
    run.journal
        .stream_end(
            &stream,
            1,
            StreamEnd::Completed {
                usage: serde_json::json!({"output_tokens": 1}),
                continued: 0,
            },
        )
        .await?;

    let nothing_due = run.journal.reap(start).await?;
    assert_eq!((nothing_due.tombstoned, nothing_due.purged), (0, 0));

    let later = start + Duration::from_secs(2 * 3600);
    let report = run.journal.reap(later).await?;
    assert_eq!(
        (report.tombstoned, report.deferred, report.streams_dropped),
        (1, 1, 1)
    );
    let tomb = run.journal.get(&key("old"))?.ok_or("tombstone missing")?;
    assert_eq!(
        (tomb.state, tomb.final_status),
        (State::Tombstone, Some(200))
    );
    assert_eq!(
        tomb.body_digest,
        Some(Body::from("{\"id\":42}").digest_hex())
    );
    assert!(tomb.request.is_none() && tomb.response.is_none());
    assert!(matches!(
        run.journal.begin(intent("old", ToolClass::Keyed)).await?,
        Begin::Tombstoned { .. }
    ));
    assert_eq!(
        run.journal.get(&key("parked"))?.map(|r| r.state),
        Some(State::NeedsOperator),
        "unsettled calls outlive retention"
    );
    // Its events are gone; its metadata stays, expired, with how it ended.
    let expired = run
        .journal
        .stream_meta(&stream)?
        .ok_or("expired metadata")?;
    assert_eq!(expired.state, StreamState::Expired);
    assert!(matches!(expired.end, Some(StreamEnd::Completed { .. })));
    assert!(run.journal.stream_events(&stream, 1, None)?.is_empty());
    assert!(run.journal.verify()?.is_clean());

    let much_later = later + Duration::from_secs(2 * 86_400);
    let report = run.journal.reap(much_later).await?;
    assert_eq!(report.purged, 1);
    assert_eq!(run.journal.get(&key("old"))?, None);
    let verify = run.journal.verify()?;
    assert!(verify.is_clean(), "{verify:?}");
    assert_eq!(run.journal.stats().states.tombstone, 0);
    // A purged key is new again (documented Stripe semantics).
    assert!(matches!(
        run.journal.begin(intent("old", ToolClass::Keyed)).await?,
        Begin::Execute { resend: false, .. }
    ));
    run.stop().await
}

fn stream_request(fp: u8) -> StreamRequest {
    StreamRequest {
        fingerprint: Fingerprint([fp; 32]),
        task_id: TaskId::new("task-a").ok(),
        request_id: RequestId::from_generated("req-s".to_owned()),
        provider: "anthropic".to_owned(),
        model: "claude".to_owned(),
        policy_versions: Vec::new(),
    }
}

fn event(i: u64) -> Bytes {
    Bytes::from(format!(
        "event: content_block_delta\ndata: {{\"i\":{i}}}\n\n"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_appended_together_read_back_one_by_one() -> TestResult {
    let dir = tempfile::tempdir()?;
    let key = StreamKey::new("chat-chunks")?;
    {
        let (run, _) = Running::open(Options::new(dir.path()))?;
        let j = &run.journal;
        j.stream_begin(&key, stream_request(1)).await?;
        // Frames of 3, 1 and 4 events, as an upstream might deliver them.
        j.stream_append(&key, 1, 0, (0..3).map(event).collect(), false)
            .await?;
        j.stream_append(&key, 1, 3, vec![event(3)], false).await?;
        j.stream_append(&key, 1, 4, (4..8).map(event).collect(), true)
            .await?;
        let empty = j.stream_append(&key, 1, 8, Vec::new(), false).await;
        assert!(matches!(empty, Err(Error::Invalid { .. })), "{empty:?}");
        assert_eq!(j.stats().stream_events, 8);
        assert_eq!(j.stream_meta(&key)?.and_then(|m| m.last_seq), Some(7));
        for after in [None, Some(0), Some(1), Some(2), Some(3), Some(5), Some(7)] {
            let got = j.stream_events(&key, 1, after)?;
            let from = after.map_or(0, |a| a + 1);
            let want: Vec<(u64, Bytes)> = (from..8).map(|s| (s, event(s))).collect();
            assert_eq!(got, want, "after {after:?}");
        }
        run.stop().await?;
    }
    // The durable append made all eight durable; they read back the same after a
    // restart, through the audit reader too.
    let audit = Journal::open_for_audit(dir.path())?;
    let all = audit.stream_events(&key, 1, Some(4))?;
    assert_eq!(all, (5..8).map(|s| (s, event(s))).collect::<Vec<_>>());
    assert_eq!(audit.stream_meta(&key)?.and_then(|m| m.last_seq), Some(7));
    Ok(())
}

/// Reads a stream's sequence numbers until `want` of them are there (bounded).
async fn seqs_within(j: &Journal, key: &StreamKey, want: usize) -> Vec<u64> {
    let mut seqs = Vec::new();
    for _ in 0..200 {
        seqs = j
            .stream_events(key, 1, None)
            .unwrap_or_default()
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        if seqs.len() >= want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    seqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_events_are_written_together_by_the_next_durable_append_or_the_delay() -> TestResult
{
    let dir = tempfile::tempdir()?;
    let mut options = Options::new(dir.path());
    options.max_batch_delay = Duration::from_millis(40);
    let (run, _) = Running::open(options)?;
    let j = &run.journal;
    let key = StreamKey::new("chat-held")?;
    j.stream_begin(&key, stream_request(1)).await?;
    for seq in 0..5 {
        j.stream_append_nowait(&key, 1, seq, vec![event(seq)])
            .await?;
    }
    // The durable append writes the held five first: six events, no hole.
    j.stream_append(&key, 1, 5, vec![event(5)], true).await?;
    let all = j.stream_events(&key, 1, None)?;
    assert_eq!(all, (0..6).map(|s| (s, event(s))).collect::<Vec<_>>());

    // Held events with nothing after them arrive within the flush delay.
    for seq in 6..9 {
        j.stream_append_nowait(&key, 1, seq, vec![event(seq)])
            .await?;
    }
    assert_eq!(seqs_within(j, &key, 9).await, (0..9).collect::<Vec<_>>());

    // And the end writes them before the end record.
    for seq in 9..12 {
        j.stream_append_nowait(&key, 1, seq, vec![event(seq)])
            .await?;
    }
    j.stream_end(
        &key,
        1,
        StreamEnd::Completed {
            usage: serde_json::json!({}),
            continued: 0,
        },
    )
    .await?;
    let all = j.stream_events(&key, 1, None)?;
    assert_eq!(all, (0..12).map(|s| (s, event(s))).collect::<Vec<_>>());
    assert_eq!(j.stream_meta(&key)?.and_then(|m| m.last_seq), Some(11));
    assert_eq!(j.stats().stream_events, 12);
    run.stop().await?;
    Ok(())
}

/// A durable write of one stream is no flush of another stream's held deltas: those
/// still arrive within the flush delay, not whenever the writer next hears of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_deltas_arrive_within_the_delay_whatever_other_streams_write() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut options = Options::new(dir.path());
    options.max_batch_delay = Duration::from_millis(100);
    let (run, _) = Running::open(options)?;
    let j = &run.journal;
    let (quiet, busy) = (StreamKey::new("chat-quiet")?, StreamKey::new("chat-busy")?);
    for key in [&quiet, &busy] {
        j.stream_begin(key, stream_request(1)).await?;
        j.stream_append(key, 1, 0, vec![event(0)], true).await?;
    }
    for seq in 1..4 {
        j.stream_append_nowait(&quiet, 1, seq, vec![event(seq)])
            .await?;
    }
    j.stream_append(&busy, 1, 1, vec![event(1)], true).await?;
    assert_eq!(seqs_within(j, &quiet, 4).await, (0..4).collect::<Vec<_>>());
    run.stop().await
}

/// On one thread the writer runs only when this test waits, so what it finds queued
/// is exactly what was sent since: a lone stream's held deltas and its end are one
/// commit that wakes no applier, and two streams' ends at once are handed over.
#[tokio::test]
async fn a_lone_streams_end_with_its_held_deltas_is_applied_on_the_writers_thread() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let j = &run.journal;
    let done = || StreamEnd::Completed {
        usage: serde_json::json!({}),
        continued: 0,
    };
    for n in 0..20 {
        let key = StreamKey::new(format!("chat-lone-{n}"))?;
        j.stream_begin(&key, stream_request(1)).await?;
        j.stream_append(&key, 1, 0, vec![event(0)], true).await?;
        let before = j.stats().handoffs;
        for seq in 1..4 {
            j.stream_append_nowait(&key, 1, seq, vec![event(seq)])
                .await?;
        }
        j.stream_end(&key, 1, done()).await?;
        assert_eq!(
            j.stats().handoffs,
            before,
            "stream {n}'s end woke the applier"
        );
        let all = j.stream_events(&key, 1, None)?;
        assert_eq!(all, (0..4).map(|s| (s, event(s))).collect::<Vec<_>>());
    }

    let (a, b) = (
        StreamKey::new("chat-pair-a")?,
        StreamKey::new("chat-pair-b")?,
    );
    for key in [&a, &b] {
        j.stream_begin(key, stream_request(1)).await?;
        j.stream_append(key, 1, 0, vec![event(0)], true).await?;
    }
    let before = j.stats().handoffs;
    let (ended_a, ended_b) = tokio::join!(j.stream_end(&a, 1, done()), j.stream_end(&b, 1, done()));
    ended_a?;
    ended_b?;
    assert_eq!(
        j.stats().handoffs,
        before + 1,
        "two ends at once are one commit, handed over"
    );
    for key in [&a, &b] {
        assert_eq!(j.stream_meta(key)?.and_then(|m| m.last_seq), Some(0));
    }
    run.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_events_lost_to_a_failed_write_end_the_attempt_instead_of_leaving_a_hole() -> TestResult
{
    let dir = tempfile::tempdir()?;
    let mut options = Options::new(dir.path());
    options.max_batch_delay = Duration::from_millis(20);
    let (run, _) = Running::open(options)?;
    let j = &run.journal;
    let key = StreamKey::new("chat-hole")?;
    j.stream_begin(&key, stream_request(1)).await?;
    j.stream_append(&key, 1, 0, vec![event(0)], true).await?;
    j.set_write_fault(Some(WriteFault::FailFlush));
    j.stream_append_nowait(&key, 1, 1, vec![event(1)]).await?;
    // Let the delay run out: the held event's write fails.
    let mut failed = false;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        if j.stats().flush_errors > 0 {
            failed = true;
            break;
        }
    }
    assert!(failed, "the held event was never written");
    j.set_write_fault(None);
    // The journal works again, but this attempt lost event 1: event 2 is refused, and
    // so is the end, so the stream is never served as complete with a hole.
    let next = j.stream_append(&key, 1, 2, vec![event(2)], true).await;
    assert!(matches!(next, Err(Error::Unavailable(_))), "{next:?}");
    let end = j
        .stream_end(
            &key,
            1,
            StreamEnd::Completed {
                usage: serde_json::json!({}),
                continued: 0,
            },
        )
        .await;
    assert!(matches!(end, Err(Error::Unavailable(_))), "{end:?}");
    assert_eq!(j.stream_events(&key, 1, None)?, vec![(0, event(0))]);
    assert_eq!(
        j.stream_meta(&key)?.map(|m| m.state),
        Some(StreamState::Open)
    );
    // It may still end as abandoned, and the key's next begin then starts afresh
    // rather than finding an attempt that never ends.
    j.stream_end(
        &key,
        1,
        StreamEnd::abandoned("the journal lost events of this attempt"),
    )
    .await?;
    assert_eq!(
        j.stream_meta(&key)?.map(|m| m.state),
        Some(StreamState::Abandoned)
    );
    assert_eq!(
        new_attempt(&j.stream_begin(&key, stream_request(1)).await?),
        Some(2)
    );
    run.stop().await?;
    Ok(())
}

/// Appends past the last one skip the store read for their before-image; a failed
/// flush must still take them back out, and the same events can be appended again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_append_is_rolled_back_and_can_be_appended_again() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let j = &run.journal;
    let key = StreamKey::new("chat-rollback")?;
    j.stream_begin(&key, stream_request(1)).await?;
    j.stream_append(&key, 1, 0, vec![event(0)], true).await?;
    j.stream_append(&key, 1, 1, vec![event(1), event(2)], true)
        .await?;
    j.set_write_fault(Some(WriteFault::FailFlush));
    let failed = j.stream_append(&key, 1, 3, vec![event(3)], true).await;
    assert!(matches!(failed, Err(Error::Unavailable(_))), "{failed:?}");
    j.set_write_fault(None);
    let before: Vec<_> = (0..3).map(|s| (s, event(s))).collect();
    assert_eq!(j.stream_events(&key, 1, None)?, before);
    j.stream_append(&key, 1, 3, vec![event(3)], true).await?;
    j.stream_append(&key, 1, 4, vec![event(4)], true).await?;
    let all: Vec<_> = (0..5).map(|s| (s, event(s))).collect();
    assert_eq!(j.stream_events(&key, 1, None)?, all);
    run.stop().await?;
    Ok(())
}

/// Each attempt draws a tag of its own, which the journal keeps for it across a
/// restart and later attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attempt_keeps_a_tag_of_its_own() -> TestResult {
    let dir = tempfile::tempdir()?;
    let key = StreamKey::new("tagged")?;
    let tag_of = |b: &StreamBegin| match b {
        StreamBegin::New { tag, .. } => Some(*tag),
        _ => None,
    };
    let (first, second);
    {
        let (run, _) = Running::open(Options::new(dir.path()))?;
        let j = &run.journal;
        let begun = j.stream_begin(&key, stream_request(1)).await?;
        first = tag_of(&begun).ok_or("attempt 1 was not new")?;
        j.stream_append(&key, 1, 0, vec![event(0)], true).await?;
        j.stream_end(&key, 1, StreamEnd::abandoned("cut")).await?;
        let begun = j.stream_begin(&key, stream_request(1)).await?;
        assert_eq!(new_attempt(&begun), Some(2));
        second = tag_of(&begun).ok_or("attempt 2 was not new")?;
        assert_ne!(first, second, "two attempts drew one tag");
        assert!(first != 0 && second != 0, "0 means no tag");
        j.stream_append(&key, 2, 0, vec![event(0)], true).await?;
        let meta = j.stream_meta(&key)?.ok_or("meta lost")?;
        assert_eq!(
            (meta.tag(0), meta.tag(1), meta.tag(2), meta.tag(3)),
            (None, Some(first), Some(second), None)
        );
        run.stop().await?;
    }
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let meta = run.journal.stream_meta(&key)?.ok_or("meta lost")?;
    assert_eq!(
        (meta.attempt, meta.tag(1), meta.tag(2)),
        (2, Some(first), Some(second))
    );
    // Stored, and shown by `outrigger journal`, as the event ids show them.
    assert_eq!(
        serde_json::to_value(&meta)?["tags"],
        serde_json::json!([format!("{first:08x}"), format!("{second:08x}")])
    );
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_read_back_in_order_across_a_restart() -> TestResult {
    let dir = tempfile::tempdir()?;
    let key = StreamKey::new("chat-1")?;
    {
        let (run, _) = Running::open(Options::new(dir.path()))?;
        let j = &run.journal;
        assert_eq!(
            new_attempt(&j.stream_begin(&key, stream_request(1)).await?),
            Some(1)
        );
        for seq in 0..5 {
            j.stream_append(&key, 1, seq, vec![event(seq)], false)
                .await?;
        }
        j.stream_append(&key, 1, 5, vec![event(5)], true).await?;
        for seq in 6..9 {
            j.stream_append(&key, 1, seq, vec![event(seq)], false)
                .await?;
        }
        let all = j.stream_events(&key, 1, None)?;
        assert_eq!(
            all.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            (0..9).collect::<Vec<_>>()
        );
        assert_eq!(all[3].1, event(3));
        let tail = j.stream_events(&key, 1, Some(6))?;
        assert_eq!(tail.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [7, 8]);
        assert_eq!(j.stream_meta(&key)?.and_then(|m| m.last_seq), Some(8));
        let wrong = j.stream_append(&key, 2, 9, vec![event(9)], false).await;
        assert!(matches!(wrong, Err(Error::Stream { .. })), "{wrong:?}");
        assert_eq!(j.stats().stream_events, 9);
        run.stop().await?;
    }

    let (run, recovery) = Running::open(Options::new(dir.path()))?;
    let j = &run.journal;
    assert_eq!(recovery.abandoned_streams, std::slice::from_ref(&key));
    let after = j.stream_events(&key, 1, None)?;
    let seqs: Vec<u64> = after.iter().map(|(s, _)| *s).collect();
    // The durable event and everything before it survive; lazy ones after it may be
    // lost only as a suffix, never leaving a hole.
    assert!(seqs.len() >= 6, "{seqs:?}");
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    for (seq, bytes) in &after {
        assert_eq!(bytes, &event(*seq));
    }

    let meta = j.stream_meta(&key)?.ok_or("meta lost")?;
    assert_eq!(meta.state, StreamState::Abandoned);
    assert!(matches!(
        j.stream_begin(&key, stream_request(2)).await?,
        StreamBegin::Mismatch { .. }
    ));
    assert_eq!(
        new_attempt(&j.stream_begin(&key, stream_request(1)).await?),
        Some(2)
    );
    j.stream_append(&key, 2, 0, vec![event(100)], true).await?;
    j.stream_end(
        &key,
        2,
        StreamEnd::Completed {
            usage: serde_json::json!({}),
            continued: 0,
        },
    )
    .await?;
    let StreamBegin::Existing { meta } = j.stream_begin(&key, stream_request(1)).await? else {
        return Err("a completed stream is replayed".into());
    };
    assert_eq!(
        (meta.attempt, meta.state, meta.last_seq),
        (2, StreamState::Completed, Some(0))
    );
    assert_eq!(j.stream_events(&key, 2, None)?, [(0, event(100))]);
    assert_eq!(
        j.stream_events(&key, 1, None)?.len(),
        after.len(),
        "attempts are kept apart"
    );
    run.stop().await
}

/// A reopened journal finds every record and stream it holds: the writer skips the
/// store for keys it has never seen, so what it knows must be loaded whole at open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reopened_journal_finds_every_key_it_holds() -> TestResult {
    let dir = tempfile::tempdir()?;
    let n = 300;
    {
        let (run, _) = Running::open(Options::new(dir.path()))?;
        let j = &run.journal;
        for i in 0..n {
            let ticket = execute(j, intent(&format!("known-{i}"), ToolClass::Keyed)).await?;
            j.complete(&ticket, ok(201)).await?;
            let key = StreamKey::new(format!("known-stream-{i}"))?;
            assert_eq!(
                new_attempt(&j.stream_begin(&key, stream_request(1)).await?),
                Some(1)
            );
            // Ended, so that recovery leaves it as it is.
            let usage = serde_json::json!({});
            j.stream_end(
                &key,
                1,
                StreamEnd::Completed {
                    usage,
                    continued: 0,
                },
            )
            .await?;
        }
        run.stop().await?;
    }
    let (run, recovery) = Running::open(Options::new(dir.path()))?;
    let j = &run.journal;
    assert_eq!(recovery.records, n);
    for i in 0..n {
        match j
            .begin(intent(&format!("known-{i}"), ToolClass::Keyed))
            .await?
        {
            Begin::Replay(rec) => assert_eq!(rec.response.map(|r| r.status), Some(201)),
            other => return Err(format!("known-{i}: expected a replay, got {other:?}").into()),
        }
        let key = StreamKey::new(format!("known-stream-{i}"))?;
        match j.stream_begin(&key, stream_request(1)).await? {
            StreamBegin::Existing { meta } => assert_eq!(meta.state, StreamState::Completed),
            other => return Err(format!("{key}: expected it to exist, got {other:?}").into()),
        }
    }
    // Keys it never held are new, without any read of them.
    execute(j, intent("never-seen", ToolClass::Keyed)).await?;
    let fresh = StreamKey::new("never-seen-stream")?;
    assert_eq!(
        new_attempt(&j.stream_begin(&fresh, stream_request(1)).await?),
        Some(1)
    );
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_values_persist() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let (run, _) = Running::open(Options::new(dir.path()))?;
        run.journal.kv_put("tasks", "t1", b"one".to_vec()).await?;
        run.journal.kv_put("tasks", "t2", b"two".to_vec()).await?;
        run.journal
            .kv_put("tasks2", "t1", b"other".to_vec())
            .await?;
        run.journal.kv_delete("tasks", "t2").await?;
        assert_eq!(run.journal.kv_get("tasks", "t1")?, Some(b"one".to_vec()));
        assert!(run.journal.kv_put("", "x", Vec::new()).await.is_err());
        run.stop().await?;
    }
    let (run, _) = Running::open(Options::new(dir.path()))?;
    assert_eq!(
        run.journal.kv_scan("tasks")?,
        [("t1".to_owned(), b"one".to_vec())]
    );
    assert_eq!(run.journal.kv_scan("tasks2")?.len(), 1);
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_lists_exports_and_tells_a_task_story() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let (run, _) = Running::open(Options::new(dir.path()))?;
        for (k, status) in [("a1", 200), ("a2", 404), ("a3", 503)] {
            let ticket = execute(&run.journal, intent(k, ToolClass::Keyed)).await?;
            run.journal.complete(&ticket, ok(status)).await?;
        }
        let mut other = intent("b1", ToolClass::Keyed);
        other.task_id = Some(TaskId::new("task-b")?);
        other.tool = "mail".to_owned();
        other.request = RedactedRequest::new(Headers::default(), Body::from(vec![0xff, 0xfe]));
        execute(&run.journal, other).await?;

        // A running sidecar's journal cannot be opened offline.
        assert!(matches!(
            Journal::open_for_audit(dir.path()),
            Err(Error::Locked { .. })
        ));
        assert!(matches!(
            Journal::open(Options::new(dir.path())),
            Err(Error::Locked { .. })
        ));
        // Nor moved aside.
        assert!(matches!(
            Journal::quarantine(dir.path()),
            Err(Error::Locked { .. })
        ));
        run.stop().await?;
    }
    let audit = Journal::open_for_audit(dir.path())?;
    let task_a = TaskId::new("task-a")?;
    let by_task = Filter {
        task: Some(task_a.clone()),
        ..Filter::default()
    };
    let listed: Vec<String> = audit
        .list(&by_task)?
        .iter()
        .map(|r| r.key.to_string())
        .collect();
    assert_eq!(listed, ["a1", "a2", "a3"]);
    let in_doubt = Filter {
        state: Some(State::InDoubt),
        ..Filter::default()
    };
    assert_eq!(audit.list(&in_doubt)?.len(), 1, "a3 (503)");
    let dispatched = Filter {
        state: Some(State::Dispatched),
        ..Filter::default()
    };
    // Auditing shows what the stopped sidecar left; recovery runs when it starts.
    assert_eq!(audit.list(&dispatched)?.len(), 1, "b1");
    let mail = Filter {
        tool: Some("mail".to_owned()),
        ..Filter::default()
    };
    assert_eq!(audit.list(&mail)?.len(), 1);
    let future = Filter {
        since: Some(SystemTime::now() + Duration::from_secs(60)),
        ..Filter::default()
    };
    assert!(audit.list(&future)?.is_empty());

    let mut out = Vec::new();
    assert_eq!(audit.export(&Filter::default(), &mut out)?, 4);
    let text = String::from_utf8(out)?;
    assert_eq!(text.lines().count(), 4);
    assert!(
        !text.contains("sk-secret"),
        "a credential reached the export"
    );
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line)?;
        assert_eq!(value["v"], 1);
        assert!(value["history"].as_array().is_some_and(|h| !h.is_empty()));
    }
    assert!(
        text.contains("{\"base64\":\"//4=\"}"),
        "binary bodies are marked"
    );
    assert!(
        text.contains("\"created_at\":\"20"),
        "timestamps are RFC 3339"
    );

    let timeline = audit.timeline(&task_a)?;
    let states: Vec<State> = timeline.iter().map(|e| e.state).collect();
    assert_eq!(states, [State::Completed, State::Completed, State::InDoubt]);
    assert!(
        timeline
            .windows(2)
            .all(|w| w[0].started_at <= w[1].started_at)
    );
    assert_eq!(timeline[1].final_status, Some(404));
    assert!(audit.verify()?.is_clean());

    let entries = audit.log_entries(1, 100)?;
    let keys: Vec<&str> = entries
        .iter()
        .flat_map(|e| e.changes.iter().map(|c| c.key.as_str()))
        .collect();
    assert_eq!(keys, ["a1", "a1", "a2", "a2", "a3", "a3", "b1"]);
    assert!(
        entries
            .windows(2)
            .all(|w| w[1].prev == w[0].hash && w[1].seq == w[0].seq + 1)
    );
    assert_eq!(
        audit
            .log_entries(3, 2)?
            .iter()
            .map(|e| e.seq)
            .collect::<Vec<_>>(),
        [3, 4]
    );
    drop(audit);

    let empty = tempfile::tempdir()?;
    let Err(Error::NotFound { .. }) = Journal::quarantine(empty.path()) else {
        return Err("a directory that holds no journal is not moved".into());
    };
    let moved = Journal::quarantine(dir.path())?;
    assert!(
        !dir.path().exists() && moved.join("db").is_file(),
        "{}",
        moved.display()
    );
    std::fs::remove_dir_all(&moved)?;
    Ok(())
}

#[test]
fn quarantine_moves_the_directory_beside_itself_however_it_is_written() -> TestResult {
    let parent = tempfile::tempdir()?;
    for (name, written) in [("a", "a/"), ("b", "b/."), ("c", "./c//")] {
        let dir = parent.path().join(name);
        drop(Journal::open(Options::new(&dir))?);
        let moved = Journal::quarantine(&parent.path().join(written))?;
        assert_eq!(moved.parent(), Some(parent.path()), "{}", moved.display());
        let moved_name = moved.file_name().and_then(|n| n.to_str()).unwrap_or("");
        assert!(
            moved_name.starts_with(&format!("{name}.corrupt-")),
            "{written}: moved to {}",
            moved.display()
        );
        assert!(!dir.exists() && moved.join("db").is_file());
    }

    // A path with no name to put the suffix on is refused, and nothing moves.
    let dir = parent.path().join("d");
    drop(Journal::open(Options::new(&dir))?);
    let Err(Error::Invalid { detail, .. }) = Journal::quarantine(&dir.join("records/..")) else {
        return Err("a path ending in `..` must be refused".into());
    };
    assert!(detail.contains("--journal-dir"), "{detail}");
    assert!(dir.join("db").is_file());
    Ok(())
}

#[test]
fn opening_nothing_is_a_clear_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("nope");
    let Err(Error::NotFound { detail, .. }) = Journal::open_for_audit(&missing) else {
        return Err("a missing directory must be NotFound".into());
    };
    assert!(detail.contains("does not exist"), "{detail}");
    let Err(Error::NotFound { detail, .. }) = Journal::open_for_audit(dir.path()) else {
        return Err("an empty directory must be NotFound".into());
    };
    assert!(detail.contains("no journal files"), "{detail}");
    assert!(
        Journal::open(Options {
            max_batch: 0,
            ..Options::new(dir.path())
        })
        .is_err()
    );
    assert!(
        !Path::new(&missing).exists(),
        "auditing must not create a journal"
    );
    Ok(())
}

/// A begin of a key the journal holds goes through the writer; when its caller goes
/// away before the answer, a new attempt it never received is ended for it, so the
/// key's next begin does not find it open for ever.
#[tokio::test]
async fn a_new_attempt_its_caller_never_received_is_ended_for_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let key = StreamKey::new("left-early")?;
    let first = run.journal.stream_begin(&key, stream_request(1)).await?;
    assert!(
        matches!(first, StreamBegin::New { attempt: 1, .. }),
        "{first:?}"
    );
    let failed = StreamEnd::Failed {
        reason: "upstream answered 500".to_owned(),
    };
    run.journal.stream_end(&key, 1, failed).await?;
    poll_once_and_drop(run.journal.stream_begin(&key, stream_request(1))).await;
    let mut meta = None;
    for _ in 0..200 {
        meta = run.journal.stream_meta(&key)?;
        if meta
            .as_ref()
            .is_some_and(|m| m.attempt == 2 && m.state == StreamState::Abandoned)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let meta = meta.ok_or("no metadata")?;
    assert_eq!((meta.attempt, meta.state), (2, StreamState::Abandoned));
    let again = run.journal.stream_begin(&key, stream_request(1)).await?;
    assert!(
        matches!(again, StreamBegin::New { attempt: 3, .. }),
        "{again:?}"
    );
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_stream_is_started_once_however_many_ask_at_once() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    for round in 0..20 {
        let key = StreamKey::new(format!("race-{round}"))?;
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (j, key) = (run.journal.clone(), key.clone());
                tokio::spawn(async move { j.stream_begin(&key, stream_request(1)).await })
            })
            .collect();
        let mut new = 0;
        for task in tasks {
            match task.await?? {
                StreamBegin::New { attempt, .. } => {
                    assert_eq!(attempt, 1);
                    new += 1;
                }
                StreamBegin::Existing { meta } => assert_eq!(meta.attempt, 1),
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(new, 1, "round {round}: one generation per key");
    }
    // The start is in the journal ahead of the events appended after it.
    let key = StreamKey::new("fast-then-events")?;
    let begun = run.journal.stream_begin(&key, stream_request(2)).await?;
    assert!(
        matches!(begun, StreamBegin::New { attempt: 1, .. }),
        "{begun:?}"
    );
    run.journal
        .stream_append(&key, 1, 0, vec![event(0)], true)
        .await?;
    let meta = run.journal.stream_meta(&key)?.ok_or("no metadata")?;
    assert_eq!((meta.attempt, meta.state), (1, StreamState::Open));
    assert_eq!(
        run.journal.stream_events(&key, 1, None)?,
        vec![(0, event(0))]
    );
    // Another body under the same key is refused, not started again.
    let again = run.journal.stream_begin(&key, stream_request(3)).await?;
    assert!(matches!(again, StreamBegin::Mismatch { .. }), "{again:?}");
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_answered_before_its_write_failed_takes_no_events() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let j = &run.journal;
    let key = StreamKey::new("chat-early")?;
    // A new stream's start is answered before its batch is applied; that batch fails.
    j.set_write_fault(Some(WriteFault::FailApply));
    assert!(matches!(
        j.stream_begin(&key, stream_request(1)).await?,
        StreamBegin::New { attempt: 1, .. }
    ));
    let mut failed = false;
    for _ in 0..200 {
        if j.stats().flush_errors > 0 {
            failed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(failed, "the start's batch was never written");
    j.set_write_fault(None);
    // The start is not in the journal, so the stream's events are refused (its
    // generation goes on unjournaled) and nothing is ever served for it.
    let append = j.stream_append(&key, 1, 0, vec![event(0)], true).await;
    assert!(append.is_err(), "{append:?}");
    assert_eq!(j.stream_meta(&key)?, None);
    assert!(j.stream_events(&key, 1, None)?.is_empty());
    // The key starts afresh under a number of its own: the lost attempt may still be
    // generating, and its events must never join the new one's.
    assert!(matches!(
        j.stream_begin(&key, stream_request(1)).await?,
        StreamBegin::New { attempt: 2, .. }
    ));
    let late = j.stream_append(&key, 1, 0, vec![event(0)], true).await;
    assert!(late.is_err(), "{late:?}");
    j.stream_append(&key, 2, 0, vec![event(7)], true).await?;
    assert_eq!(j.stream_events(&key, 2, None)?, vec![(0, event(7))]);
    assert!(j.stream_events(&key, 1, None)?.is_empty());
    run.stop().await?;
    Ok(())
}

/// A new key's start is decided without the writer; every begin of the key after it
/// sees that start, whether the writer has written it yet or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_right_after_a_new_start_finds_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let j = &run.journal;
    for i in 0..200 {
        let key = StreamKey::new(format!("back-to-back-{i}"))?;
        assert_eq!(
            new_attempt(&j.stream_begin(&key, stream_request(1)).await?),
            Some(1),
            "{key}"
        );
        match j.stream_begin(&key, stream_request(1)).await? {
            StreamBegin::Existing { meta } => {
                assert_eq!((meta.attempt, meta.state), (1, StreamState::Open), "{key}");
            }
            other => return Err(format!("{key}: begun twice: {other:?}").into()),
        }
        let mismatch = j.stream_begin(&key, stream_request(2)).await?;
        assert!(
            matches!(mismatch, StreamBegin::Mismatch { .. }),
            "{key}: {mismatch:?}"
        );
    }
    run.stop().await
}

/// `verify` on a journal that goes on writing: calls begin and complete, and records
/// become tombstones and are purged, while it reads. A report is a snapshot of no
/// single moment, yet names nothing that was not tampered with.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn verify_is_clean_while_the_journal_writes() -> TestResult {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let dir = tempfile::tempdir()?;
    let (run, _) = Running::open(Options::new(dir.path()))?;
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    for w in 0..6 {
        let journal = run.journal.clone();
        let stop = Arc::clone(&stop);
        let rounds = Arc::clone(&rounds);
        let done = Arc::clone(&done);
        writers.push(tokio::spawn(async move {
            let mut calls = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let k = format!("w{w}-{calls}");
                let ticket = execute(&journal, intent(&k, ToolClass::Keyed))
                    .await
                    .map_err(|e| e.to_string())?;
                journal
                    .complete(&ticket, ok(200))
                    .await
                    .map_err(|e| e.to_string())?;
                calls += 1;
                done.fetch_add(1, Ordering::Relaxed);
                // A few calls per round of `verify`, so that every round overlaps
                // writes and the journal stays small enough to check 50 times.
                while calls >= (rounds.load(Ordering::Relaxed) + 1) * 16
                    && !stop.load(Ordering::Relaxed)
                {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            Ok::<u64, String>(calls)
        }));
    }
    // Retention as if days had passed: each round tombstones what the last created,
    // and the next purges those tombstones.
    let reaper = {
        let journal = run.journal.clone();
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let mut days = 2u64;
            while !stop.load(Ordering::Relaxed) {
                let now = SystemTime::now() + Duration::from_secs(days * 86_400);
                journal.reap(now).await.map_err(|e| e.to_string())?;
                days += 40;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok::<(), String>(())
        })
    };
    for round in 0..50u64 {
        // Each round starts once the writers have made calls since the last one
        // (a fast `verify` would otherwise run its rounds before they got going).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while done.load(Ordering::Relaxed) < round * 24 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "round {round}: the writers made only {} calls",
                done.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let journal = run.journal.clone();
        let report = tokio::task::spawn_blocking(move || journal.verify()).await??;
        assert!(report.is_clean(), "round {round}: {report:?}");
        rounds.fetch_add(1, Ordering::Relaxed);
    }
    stop.store(true, Ordering::Relaxed);
    let mut calls = 0;
    for writer in writers {
        calls += writer.await??;
    }
    reaper.await??;
    assert!(calls > 100, "only {calls} calls ran beside verify");
    let report = run.journal.verify()?;
    assert!(report.is_clean(), "{report:?}");
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_kept_for_its_retention_after_its_last_change() -> TestResult {
    let dir = tempfile::tempdir()?;
    let minutes = |m: u64| Duration::from_secs(60 * m);
    let with_retention = |stream_retention| Options {
        stream_retention,
        ..Options::new(dir.path())
    };
    let start = SystemTime::now();
    let (run, _) = Running::open(with_retention(minutes(10)))?;
    let stream = StreamKey::new("s-late")?;
    run.journal.stream_begin(&stream, stream_request(1)).await?;
    run.journal
        .stream_end(&stream, 1, StreamEnd::abandoned("cut"))
        .await?;
    run.stop().await?;

    // Its drop is due after 10 minutes; the stream must now be kept 20 after it ended.
    let (run, _) = Running::open(with_retention(minutes(20)))?;
    let early = run.journal.reap(start + minutes(11)).await?;
    assert_eq!((early.streams_dropped, early.deferred), (0, 1), "{early:?}");
    assert!(run.journal.stream_meta(&stream)?.is_some());
    let due = run.journal.reap(start + minutes(21)).await?;
    assert_eq!(due.streams_dropped, 1, "{due:?}");
    let expired = run
        .journal
        .stream_meta(&stream)?
        .ok_or("expired metadata")?;
    assert_eq!(expired.state, StreamState::Expired);
    assert_eq!(expired.attempt, 1);
    // Remembered as expired for as long again, then forgotten.
    let kept = run.journal.reap(start + minutes(40)).await?;
    assert_eq!(kept.streams_forgotten, 0, "{kept:?}");
    assert!(run.journal.stream_meta(&stream)?.is_some());
    let forgotten = run.journal.reap(start + minutes(42)).await?;
    assert_eq!(forgotten.streams_forgotten, 1, "{forgotten:?}");
    assert_eq!(run.journal.stream_meta(&stream)?, None);
    run.stop().await
}

/// An expired stream's key still knows its body and its attempts: a different body
/// is a mismatch, the same one begins the next attempt (its events not mixed with
/// the dropped ones), and that attempt is kept its full retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_stream_begins_its_next_attempt_and_keeps_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let minutes = |m: u64| Duration::from_secs(60 * m);
    let options = Options {
        stream_retention: minutes(10),
        ..Options::new(dir.path())
    };
    let start = SystemTime::now();
    let (run, _) = Running::open(options)?;
    let stream = StreamKey::new("s-expires")?;
    run.journal.stream_begin(&stream, stream_request(1)).await?;
    run.journal
        .stream_append(&stream, 1, 0, vec![event(0), event(1)], true)
        .await?;
    run.journal
        .stream_end(
            &stream,
            1,
            StreamEnd::Completed {
                usage: serde_json::Value::Null,
                continued: 0,
            },
        )
        .await?;
    let due = run.journal.reap(start + minutes(11)).await?;
    assert_eq!(due.streams_dropped, 1, "{due:?}");
    assert!(matches!(
        run.journal.stream_begin(&stream, stream_request(2)).await?,
        StreamBegin::Mismatch { .. }
    ));
    assert!(matches!(
        run.journal.stream_begin(&stream, stream_request(1)).await?,
        StreamBegin::New { attempt: 2, .. }
    ));
    run.journal
        .stream_append(&stream, 2, 0, vec![event(7)], true)
        .await?;
    assert!(run.journal.stream_events(&stream, 1, None)?.is_empty());
    assert_eq!(
        run.journal.stream_events(&stream, 2, None)?,
        vec![(0, event(7))]
    );
    let meta = run.journal.stream_meta(&stream)?.ok_or("the stream")?;
    assert!(meta.expired(1) && !meta.expired(2), "{meta:?}");
    // The expired metadata's own drop, due 10 minutes after its expiry, finds the
    // attempt begun since: kept 10 minutes from then.
    let early = run.journal.reap(start + minutes(22)).await?;
    assert_eq!(
        (early.streams_dropped, early.streams_forgotten),
        (0, 0),
        "{early:?}"
    );
    let meta = run.journal.stream_meta(&stream)?.ok_or("the stream")?;
    assert_eq!((meta.state, meta.attempt), (StreamState::Open, 2));
    assert!(run.journal.verify()?.is_clean());
    run.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_retention_was_raised_across_a_restart_still_expires() -> TestResult {
    let dir = tempfile::tempdir()?;
    let hour = Duration::from_secs(3600);
    let with_retention = |retention| Options {
        retention,
        ..Options::new(dir.path())
    };
    let start = SystemTime::now();
    let (run, _) = Running::open(with_retention(hour))?;
    let ticket = execute(&run.journal, intent("k", ToolClass::Keyed)).await?;
    run.journal.complete(&ticket, ok(200)).await?;
    run.stop().await?;

    // Its expiry entry is due after one hour; retention is two hours now.
    let (run, _) = Running::open(with_retention(2 * hour))?;
    let early = run
        .journal
        .reap(start + hour + Duration::from_secs(60))
        .await?;
    assert_eq!(early.tombstoned, 0, "{early:?}");
    assert_eq!(
        run.journal.get(&key("k"))?.map(|r| r.state),
        Some(State::Completed)
    );
    let report = run.journal.reap(start + 3 * hour).await?;
    assert_eq!(report.tombstoned, 1, "{report:?}");
    assert_eq!(
        run.journal.get(&key("k"))?.map(|r| r.state),
        Some(State::Tombstone)
    );
    let verify = run.journal.verify()?;
    assert!(verify.is_clean(), "{verify:?}");
    run.stop().await
}

/// The attempt a begin started, if it started one.
fn new_attempt(begun: &StreamBegin) -> Option<u32> {
    match begun {
        StreamBegin::New { attempt, .. } => Some(*attempt),
        _ => None,
    }
}
