//! Reliability matrix row D2 (a wall-clock jump) at unit level, through the crate's
//! public API: the mechanics that time things (breakers, the retry budget's window,
//! the limiter's queue timeout) run on Tokio's monotonic clock, so a jump of the wall
//! clock cannot reach them; the task tracker is handed the wall clock (tasks outlive
//! restarts, so their start and end must be wall-clock), and a jump of ±1 h must not
//! end a live task as idle or make its recorded timestamps run backwards.
//!
//! The end-to-end rows are in `tests/e2e/matrix.rs`; `docs/reliability.md` maps both.

use std::time::{Duration, SystemTime};

use outrigger_proxy::resilience::breaker::{self, Admission};
use outrigger_proxy::resilience::limiter::{self, Limiter, Rejected};
use outrigger_proxy::resilience::retry_budget;
use outrigger_proxy::resilience::{Breakers, RetryBudgets};
use outrigger_proxy::tasks::{ModelCallSummary, Tasks, TasksOptions};
use outrigger_telemetry::Metrics;
use outrigger_types::{CircuitState, TaskId};

const HOUR: Duration = Duration::from_secs(3600);

/// A fixed wall-clock reading to jump from.
fn wall(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
}

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn tasks(now: SystemTime) -> Result<Tasks, Box<dyn std::error::Error>> {
    Ok(Tasks::open(
        TasksOptions::default(),
        None,
        Metrics::new(),
        None,
        now,
    )?)
}

fn call(at: SystemTime, request_id: &str) -> ModelCallSummary<'_> {
    ModelCallSummary {
        at,
        request_id,
        provider: "p",
        model: "m",
        response_model: Some("m"),
        tokens_in: 10,
        tokens_out: 5,
        retries: 0,
        fallbacks: 0,
        policy_versions: &[],
        replayed: false,
        ok: true,
        interrupted: false,
        charged: None,
    }
}

/// The breaker's penalty, the retry budget's window and the limiter's queue timeout
/// all move with Tokio's clock (paused here) and nothing else: no wall-clock reading
/// takes part, so a wall-clock jump cannot open, close or expire any of them.
#[tokio::test(start_paused = true)]
async fn d2_the_resilience_mechanics_run_on_the_monotonic_clock() {
    let breakers = Breakers::new(breaker::Options {
        consecutive_failures: 1,
        ..breaker::Options::default()
    });
    assert_eq!(breakers.record("p", false, 0.0), CircuitState::Open);
    assert!(matches!(breakers.admit("p"), Admission::Rejected { .. }));
    tokio::time::advance(Duration::from_millis(999)).await;
    assert!(matches!(breakers.admit("p"), Admission::Rejected { .. }));
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(
        breakers.admit("p"),
        Admission::Probe,
        "exactly 1 s of monotonic time"
    );

    let budgets = RetryBudgets::new(retry_budget::Options::default());
    while budgets.try_retry("p") {}
    assert!(!budgets.view("p").available);
    tokio::time::advance(Duration::from_secs(11)).await;
    assert!(
        budgets.view("p").available,
        "the window slid on monotonic time"
    );

    let limiter = Limiter::new(limiter::Options {
        max_concurrency: 1,
        min_concurrency: 1,
        max_queue: 1,
        queue_timeout: Duration::from_secs(5),
    });
    let _held = limiter.acquire("t", 1).await.expect("a slot");
    let started = tokio::time::Instant::now();
    let waited = limiter.acquire("t", 1).await.err();
    assert_eq!(waited, Some(Rejected::QueueTimeout(Duration::from_secs(5))));
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

/// A task that was active a moment ago is not idle because the wall clock jumped an
/// hour forward (an NTP step, a resumed VM): the idle timeout is a duration, and a
/// duration is measured on the monotonic clock.
#[tokio::test]
async fn d2_a_wall_clock_jump_forward_does_not_end_a_live_task_as_idle() -> TestResult {
    let t0 = wall(0);
    let tasks = tasks(t0)?;
    let id = TaskId::new("d2-forward").expect("task id");
    tasks.touch(&id, "r1", t0);
    tasks.model_call(&id, &call(t0, "r1"));
    // No time passes on the monotonic clock; the wall clock now reads an hour later.
    let ended = tasks
        .sweep(t0 + HOUR, Duration::from_secs(30 * 60))
        .await
        .expect("sweep");
    assert!(
        ended.is_empty(),
        "a live task was ended as idle by a wall-clock jump: {:?}",
        ended
            .iter()
            .map(|r| r.task.id.to_string())
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// When the wall clock jumps an hour back, the task's recorded timestamps (its
/// timeline, kept in the journal's store) stay in order and its wall-clock does not
/// go negative or shrink.
#[tokio::test]
async fn d2_task_timestamps_stay_monotonic_when_the_wall_clock_jumps_back() -> TestResult {
    let t0 = wall(HOUR.as_secs());
    let tasks = tasks(t0)?;
    let id = TaskId::new("d2-back").expect("task id");
    tasks.touch(&id, "r1", t0);
    tasks.model_call(&id, &call(t0 + Duration::from_secs(10), "r1"));
    let before = tasks
        .get(&id, t0 + Duration::from_secs(10))
        .expect("task")
        .wall_clock_ms;
    let back = t0 - HOUR;
    tasks.touch(&id, "r2", back);
    tasks.model_call(&id, &call(back, "r2"));
    let report = tasks.get(&id, back).expect("task");
    let doc = serde_json::to_value(&report).expect("json");
    let stamps: Vec<SystemTime> = doc["timeline"]
        .as_array()
        .expect("timeline")
        .iter()
        .filter_map(|e| e["at"].as_str())
        .map(|s| humantime::parse_rfc3339(s).expect("an RFC 3339 time"))
        .collect();
    assert!(stamps.len() >= 3, "{doc}");
    assert!(
        stamps.windows(2).all(|w| w[0] <= w[1]),
        "timeline timestamps ran backwards: {doc}"
    );
    assert!(
        report.wall_clock_ms >= before,
        "wall-clock shrank from {before} ms to {} ms",
        report.wall_clock_ms
    );
    Ok(())
}
