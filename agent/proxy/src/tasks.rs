//! Task tracking: what each task (the calls carrying one `Outrigger-Task-Id`) did,
//! what went wrong, and whether it recovered.
//!
//! The data plane reports each call as it finishes; the tracker keeps per-task
//! counters and an ordered timeline in memory and writes changed tasks to the
//! journal's kv store (`tasks` namespace) when [`Tasks::persist`] runs and at once
//! when a task ends, so tasks, their start times and their faults survive a restart.
//! A task that was open when the sidecar stopped is charged a `sidecar_restart` fault
//! when the next process opens the tracker, and its wall-clock includes the downtime.
//!
//! **Recovery.** A task that had a fault (an interrupted stream, an in-doubt tool
//! call, a sidecar restart, replays that show the agent restarted or retried) has
//! recovered only if it ended with outcome `success` and its journal shows every side
//! effect exactly once (see [`check_side_effects`] for the exact rule). "HTTP 200" is
//! not the test: the journal is.
//!
//! **Bounded.** At most [`TasksOptions::max_tasks`] tasks are kept: a new one beyond
//! it makes room by forgetting the task that ended longest ago, else the open task
//! idle longest, so an agent that sends a fresh task id per request cannot grow
//! memory without bound.
//!
//! Nothing here runs on a timer of its own: the application calls [`Tasks::sweep`]
//! (idle expiry, retention) and [`Tasks::persist`] periodically.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use outrigger_journal::{Filter, Journal, Record, State, TimelineEntry, Timestamp};
use outrigger_telemetry::Metrics;
use outrigger_telemetry::slo::{ObjectKind, SloEvent, Slos};
use outrigger_telemetry::spans::{self, TaskSpan};
use outrigger_types::{Cause, Outcome, PolicyVersion, TaskId, ToolClass};
use serde::{Deserialize, Serialize};

use crate::resilience::Price;

/// The kv namespace tasks persist under.
pub const NAMESPACE: &str = "tasks";
/// The persisted task format; bumped on any incompatible change.
pub const TASK_VERSION: u32 = 1;
/// Timeline entries kept per task; older ones are dropped (and counted).
const TIMELINE_CAP: usize = 512;
/// Journal records of a task a report lists, oldest first: a task with more says
/// so (`journal_capped`), and the journal's own listing pages through them all.
/// Small under test, so the cap is reached cheaply.
const REPORT_JOURNAL_CAP: usize = if cfg!(test) { 4 } else { 1_000 };
/// Journal records of a task its recovery verdict reads, at most: past it the
/// verdict cannot prove every side effect happened once, and says so.
const SIDE_EFFECTS_CAP: usize = if cfg!(test) { 8 } else { 10_000 };

/// Everything that can go wrong in task tracking.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no task {0} is known (it never made a call, or its record expired)")]
    UnknownTask(TaskId),
    #[error("the task store failed: {0}")]
    Store(#[from] outrigger_journal::Error),
    #[error("task {key} could not be encoded: {detail}")]
    Encode { key: String, detail: String },
}

/// How a task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskOutcome {
    /// The agent says the task did what it was for.
    Success,
    /// The agent says it did not.
    Failure,
    /// The agent gave the task up (excluded from task SLOs as a client cancel).
    Cancelled,
    /// No call arrived for the idle timeout.
    IdleTimeout,
}

impl TaskOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Failure => "failure",
            Self::Cancelled => "cancelled",
            Self::IdleTimeout => "idle_timeout",
        }
    }
}

/// Something that went wrong inside a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// A model stream broke before its terminal event.
    StreamInterrupted,
    /// A tool call may have reached the tool and no answer came.
    ToolInDoubt,
    /// The sidecar stopped while the task was open.
    SidecarRestart,
    /// The agent repeated calls it had already made (answered from the journal): it
    /// restarted, or retried after losing an answer. One fault per run of replays.
    AgentReplay,
}

impl FaultKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::StreamInterrupted => "stream_interrupted",
            Self::ToolInDoubt => "tool_in_doubt",
            Self::SidecarRestart => "sidecar_restart",
            Self::AgentReplay => "agent_replay",
        }
    }
}

/// Per-provider (optionally per-model) prices, in micro-dollars per million tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prices {
    by_target: HashMap<String, Price>,
}

impl Prices {
    /// Sets the price of `provider`, or of `model` on `provider` (which wins).
    pub fn set(
        &mut self,
        provider: &str,
        model: Option<&str>,
        per_mtok_in: u64,
        per_mtok_out: u64,
    ) {
        let key = match model {
            Some(m) => format!("{provider}/{m}"),
            None => provider.to_owned(),
        };
        self.by_target.insert(
            key,
            Price {
                per_mtok_in,
                per_mtok_out,
            },
        );
    }

    /// Micro-dollars for the tokens; 0 when no price is known.
    pub fn cost(&self, provider: &str, model: &str, tokens_in: u64, tokens_out: u64) -> u64 {
        self.by_target
            .get(&format!("{provider}/{model}"))
            .or_else(|| self.by_target.get(provider))
            .map_or(0, |price| price.cost(tokens_in, tokens_out))
    }
}

/// How the tracker runs.
#[derive(Debug, Clone)]
pub struct TasksOptions {
    pub prices: Prices,
    /// How long an ended task stays listed (and stored) after it ended.
    pub retention: Duration,
    /// The most tasks kept. A new task beyond it makes room by forgetting one: the
    /// task that ended longest ago, or, with none ended, the open task idle longest.
    /// It bounds the memory of an agent that sends a fresh task id per request.
    pub max_tasks: usize,
}

impl Default for TasksOptions {
    fn default() -> Self {
        Self {
            prices: Prices::default(),
            retention: Duration::from_secs(24 * 60 * 60),
            max_tasks: 10_000,
        }
    }
}

/// One finished model call, as the data plane reports it.
#[derive(Debug, Clone, Copy)]
pub struct ModelCallSummary<'a> {
    pub at: SystemTime,
    pub request_id: &'a str,
    /// The provider (target) that finally served it.
    pub provider: &'a str,
    /// The model the agent asked for.
    pub model: &'a str,
    /// The model the provider reports (the model revision), when it said.
    pub response_model: Option<&'a str>,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub retries: u32,
    pub fallbacks: u32,
    /// The policy versions that decided the call.
    pub policy_versions: &'a [PolicyVersion],
    /// Answered from the journal (a resumed stream or a repeated request).
    pub replayed: bool,
    /// Completed without error.
    pub ok: bool,
    /// A stream that broke before its terminal event (recorded as a fault).
    pub interrupted: bool,
    /// What the budget ledger has charged the task so far, this call included.
    pub charged: Option<outrigger_types::Usage>,
}

/// What became of a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallOutcome {
    /// The tool answered and the answer is journaled (2xx or a definitive failure).
    Completed,
    /// Provably not executed (refused before sending, the tool said 408/409/425/429).
    NotExecuted,
    /// Sent, no answer: in doubt (recorded as a fault).
    InDoubt,
    /// The sidecar refused it (bad request, key misuse, journal unavailable).
    Refused,
}

/// One finished tool call, as the data plane reports it.
#[derive(Debug, Clone, Copy)]
pub struct ToolCallSummary<'a> {
    pub at: SystemTime,
    pub request_id: &'a str,
    pub tool: &'a str,
    pub key: Option<&'a str>,
    pub outcome: ToolCallOutcome,
    /// Answered from the journal instead of executed.
    pub replayed: bool,
    pub retries: u32,
}

/// Counts of faults by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Faults {
    pub stream_interrupted: u32,
    pub tool_in_doubt: u32,
    pub sidecar_restarts: u32,
    pub agent_replays: u32,
}

impl Faults {
    pub fn total(&self) -> u32 {
        self.stream_interrupted
            .saturating_add(self.tool_in_doubt)
            .saturating_add(self.sidecar_restarts)
            .saturating_add(self.agent_replays)
    }

    fn add(&mut self, kind: FaultKind) {
        let slot = match kind {
            FaultKind::StreamInterrupted => &mut self.stream_interrupted,
            FaultKind::ToolInDoubt => &mut self.tool_in_doubt,
            FaultKind::SidecarRestart => &mut self.sidecar_restarts,
            FaultKind::AgentReplay => &mut self.agent_replays,
        };
        *slot = slot.saturating_add(1);
    }
}

/// One entry of a task's timeline, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum TimelineEvent {
    Started {
        at: Timestamp,
        request_id: String,
    },
    ModelCall {
        at: Timestamp,
        request_id: String,
        provider: String,
        model: String,
        ok: bool,
        replayed: bool,
        retries: u32,
        fallbacks: u32,
        tokens_in: u64,
        tokens_out: u64,
    },
    ToolCall {
        at: Timestamp,
        request_id: String,
        tool: String,
        key: Option<String>,
        outcome: ToolCallOutcome,
        replayed: bool,
    },
    Fault {
        at: Timestamp,
        kind: FaultKind,
    },
    /// Progress after faults: the task moved on (a fresh call succeeded).
    Recovered {
        at: Timestamp,
        faults: u32,
    },
    /// A call arrived after the task had ended (counted, the task stays ended).
    AfterEnd {
        at: Timestamp,
        request_id: String,
    },
    Ended {
        at: Timestamp,
        outcome: TaskOutcome,
    },
}

impl TimelineEvent {
    pub fn at(&self) -> Timestamp {
        match self {
            Self::Started { at, .. }
            | Self::ModelCall { at, .. }
            | Self::ToolCall { at, .. }
            | Self::Fault { at, .. }
            | Self::Recovered { at, .. }
            | Self::AfterEnd { at, .. }
            | Self::Ended { at, .. } => *at,
        }
    }
}

/// A side effect that happened more than once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Duplicate {
    pub tool: String,
    pub keys: Vec<String>,
    pub why: String,
}

/// What the journal says about a task's side effects.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SideEffects {
    /// Journal records (idempotency keys) of the task.
    pub keys: u32,
    /// Keys with a definitive, journaled outcome.
    pub completed: u32,
    pub duplicated: Vec<Duplicate>,
    /// Requested side effects that never happened: keys left `failed_before_send`
    /// with no completed record of the same request under another key.
    pub lost: Vec<String>,
    /// Keys whose outcome is still unknown or in flight.
    pub unresolved: Vec<String>,
    /// The task has more journal records than a verdict reads (the first
    /// 10,000 were checked): exactly once cannot be proven.
    #[serde(default)]
    pub capped: bool,
}

impl SideEffects {
    pub fn exactly_once(&self) -> bool {
        self.duplicated.is_empty()
            && self.lost.is_empty()
            && self.unresolved.is_empty()
            && !self.capped
    }
}

/// The verdict on a task that had a fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryVerdict {
    pub succeeded: bool,
    /// Why, in words.
    pub reason: String,
    /// `None` when no journal was available to check (the verdict is then failed).
    pub side_effects: Option<SideEffects>,
}

/// Everything tracked about one task (the persisted form, `"v": 1`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub v: u32,
    pub id: TaskId,
    /// The request that opened the task.
    pub first_request_id: String,
    pub started_at: Timestamp,
    pub last_activity: Timestamp,
    pub ended_at: Option<Timestamp>,
    pub outcome: Option<TaskOutcome>,
    pub model_calls: u32,
    pub tool_calls: u32,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_micros: u64,
    pub retries: u32,
    pub fallbacks: u32,
    pub replays: u32,
    pub faults: Faults,
    /// Faults after which the task made progress again (a fresh call succeeded).
    pub recoveries: u32,
    /// Faults not yet followed by progress.
    pub open_faults: u32,
    /// The model revision the provider last reported.
    pub model_revision: Option<String>,
    /// Every policy version that decided one of the task's model calls.
    #[serde(default)]
    pub policy_versions: Vec<PolicyVersion>,
    /// What the budget ledger charged the task (estimates for calls whose usage the
    /// provider did not report, retries): what its budget counts after a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charged: Option<outrigger_types::Usage>,
    pub recovery: Option<RecoveryVerdict>,
    pub timeline: Vec<TimelineEvent>,
    /// Timeline entries dropped to keep the last [`TIMELINE_CAP`].
    pub timeline_dropped: u32,
    /// Inside a run of replayed calls (one `agent_replay` fault per run).
    #[serde(default)]
    in_replay_run: bool,
    /// Drill or probe traffic (`Outrigger-Synthetic: true`): the call that opened the
    /// task was synthetic and no call since was not. Left out of the task SLO
    /// metrics.
    #[serde(default)]
    pub synthetic: bool,
}

impl Task {
    fn new(id: TaskId, request_id: &str, at: Timestamp) -> Self {
        let mut task = Self {
            v: TASK_VERSION,
            id,
            first_request_id: request_id.to_owned(),
            started_at: at,
            last_activity: at,
            ended_at: None,
            outcome: None,
            model_calls: 0,
            tool_calls: 0,
            tokens_in: 0,
            tokens_out: 0,
            cost_micros: 0,
            retries: 0,
            fallbacks: 0,
            replays: 0,
            faults: Faults::default(),
            recoveries: 0,
            open_faults: 0,
            model_revision: None,
            policy_versions: Vec::new(),
            charged: None,
            recovery: None,
            timeline: Vec::new(),
            timeline_dropped: 0,
            in_replay_run: false,
            synthetic: false,
        };
        task.push(TimelineEvent::Started {
            at,
            request_id: request_id.to_owned(),
        });
        task
    }

    /// Wall-clock from the first call to the end (or to `now` while open), downtime
    /// included.
    /// A `now` before the last activity (the wall clock stepped back) counts as the
    /// last activity, so the figure never shrinks.
    pub fn wall_clock(&self, now: Timestamp) -> Duration {
        self.ended_at
            .unwrap_or_else(|| now.max(self.last_activity))
            .since(self.started_at)
    }

    fn push(&mut self, event: TimelineEvent) {
        if self.timeline.len() >= TIMELINE_CAP {
            self.timeline.remove(0);
            self.timeline_dropped = self.timeline_dropped.saturating_add(1);
        }
        self.timeline.push(event);
    }

    fn fault(&mut self, kind: FaultKind, at: Timestamp) {
        self.faults.add(kind);
        self.open_faults = self.open_faults.saturating_add(1);
        self.push(TimelineEvent::Fault { at, kind });
    }

    /// How much a full tracker wants to keep the task: any open task over an ended
    /// one; among open tasks the most recently active, among ended ones the most
    /// recently ended.
    fn keep_rank(&self) -> (bool, Timestamp) {
        (
            self.ended_at.is_none(),
            self.ended_at.unwrap_or(self.last_activity),
        )
    }

    fn activity(&mut self, at: Timestamp) {
        self.last_activity = self.last_activity.max(at);
    }

    /// A call finished: replay runs and recoveries are decided here.
    fn progress(&mut self, replayed: bool, ok: bool, at: Timestamp) {
        if replayed {
            self.replays = self.replays.saturating_add(1);
            // Calls include this one, replays too: more calls than replays means a
            // fresh call came before, so the agent is repeating itself.
            let had_fresh_calls = self.model_calls.saturating_add(self.tool_calls) > self.replays;
            if !self.in_replay_run && had_fresh_calls {
                self.fault(FaultKind::AgentReplay, at);
            }
            self.in_replay_run = true;
            return;
        }
        self.in_replay_run = false;
        if ok && self.open_faults > 0 {
            self.recoveries = self.recoveries.saturating_add(self.open_faults);
            self.push(TimelineEvent::Recovered {
                at,
                faults: self.open_faults,
            });
            self.open_faults = 0;
        }
    }
}

/// A task without its timeline, for `GET /v1/tasks`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TaskSummary {
    pub id: TaskId,
    pub started_at: Timestamp,
    pub last_activity: Timestamp,
    pub ended_at: Option<Timestamp>,
    pub outcome: Option<TaskOutcome>,
    pub wall_clock_ms: u64,
    pub model_calls: u32,
    pub tool_calls: u32,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_micros: u64,
    pub retries: u32,
    pub fallbacks: u32,
    pub replays: u32,
    pub faults: u32,
    pub recoveries: u32,
    /// `None` until the task ends, and for tasks without faults.
    pub recovered: Option<bool>,
}

/// A task with its timeline and the journal's view of its tool calls, for
/// `GET /v1/tasks/{id}` and the answer to `POST /v1/tasks/{id}/end`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TaskReport {
    #[serde(flatten)]
    pub task: Task,
    pub wall_clock_ms: u64,
    /// The task's journaled tool calls, oldest first: at most the first 1,000.
    pub journal: Vec<TimelineEntry>,
    /// The task has more journaled tool calls than `journal` lists.
    pub journal_capped: bool,
}

/// Reads what the journal knows about a task's side effects, and decides whether
/// each happened exactly once:
///
/// - **unresolved**: a record still `in_doubt`, `needs_operator`, `reconciling`,
///   `claimed` or `dispatched` — its effect is unknown;
/// - **duplicated (sent twice)**: an `unsafe`-class record with more than one
///   dispatched attempt, beyond those an operator explicitly allowed with a `retry`
///   resolution (the journal never does this itself; if it shows, something bypassed
///   it);
/// - **duplicated (two keys)**: two or more records of the task for the same tool
///   with the same request fingerprint (method, path, query, body — the key is not
///   part of it) that both took effect (completed with a 2xx status). Tools declared
///   `idempotent` are exempt: repeating them is harmless by declaration. A task that
///   really means to perform the same request twice must make the requests differ;
/// - **lost**: a record left `failed_before_send` (provably never executed) with no
///   record of the same tool and fingerprint that completed — the side effect the
///   agent asked for never happened.
///
/// Records completed with a definitive non-2xx answer (the tool refused) count as
/// completed: the agent got the tool's answer, exactly once.
pub fn check_side_effects(records: &[Record]) -> SideEffects {
    let mut out = SideEffects {
        keys: u32::try_from(records.len()).unwrap_or(u32::MAX),
        ..SideEffects::default()
    };
    let took_effect = |r: &Record| {
        matches!(r.state, State::Completed | State::Tombstone)
            && r.final_status.is_some_and(|s| (200..300).contains(&s))
    };
    let mut effects: BTreeMap<(&str, String), Vec<&Record>> = BTreeMap::new();
    for r in records {
        match r.state {
            State::Completed | State::Tombstone => {
                out.completed = out.completed.saturating_add(1);
            }
            State::InDoubt
            | State::NeedsOperator
            | State::Reconciling
            | State::Claimed
            | State::Dispatched => out.unresolved.push(r.key.to_string()),
            State::FailedBeforeSend => {}
        }
        if r.class == ToolClass::Unsafe {
            let sent = r
                .attempts
                .iter()
                .filter(|a| a.dispatched_at.is_some())
                .count();
            let allowed = 1 + r.resolutions.iter().filter(|x| x.action == "retry").count();
            if sent > allowed {
                out.duplicated.push(Duplicate {
                    tool: r.tool.clone(),
                    keys: vec![r.key.to_string()],
                    why: format!("an unsafe call was sent {sent} times"),
                });
            }
        }
        if took_effect(r) && r.class != ToolClass::Idempotent {
            effects
                .entry((r.tool.as_str(), r.fingerprint.to_hex()))
                .or_default()
                .push(r);
        }
    }
    for ((tool, _), group) in &effects {
        if group.len() > 1 {
            out.duplicated.push(Duplicate {
                tool: (*tool).to_owned(),
                keys: group.iter().map(|r| r.key.to_string()).collect(),
                why: format!("the same request took effect under {} keys", group.len()),
            });
        }
    }
    for r in records
        .iter()
        .filter(|r| r.state == State::FailedBeforeSend)
    {
        let done_elsewhere = records.iter().any(|other| {
            other.tool == r.tool
                && other.fingerprint == r.fingerprint
                && matches!(other.state, State::Completed | State::Tombstone)
        });
        if !done_elsewhere {
            out.lost.push(r.key.to_string());
        }
    }
    out
}

/// Decides recovery for a task that had faults.
fn verdict(outcome: TaskOutcome, side_effects: Option<SideEffects>) -> RecoveryVerdict {
    let reason = match (&side_effects, outcome) {
        (_, o) if o != TaskOutcome::Success => format!("the task ended {}", o.as_str()),
        (None, _) => "no journal to check the side effects against".to_owned(),
        (Some(s), _) if !s.duplicated.is_empty() => {
            format!("{} side effect(s) duplicated", s.duplicated.len())
        }
        (Some(s), _) if !s.lost.is_empty() => format!("{} side effect(s) lost", s.lost.len()),
        (Some(s), _) if !s.unresolved.is_empty() => {
            format!("{} side effect(s) still unresolved", s.unresolved.len())
        }
        (Some(s), _) if s.capped => format!(
            "more than {SIDE_EFFECTS_CAP} journal records: not all side effects could be checked"
        ),
        (Some(s), _) => format!(
            "completed; {} side effect(s), each exactly once",
            s.completed
        ),
    };
    let succeeded = outcome == TaskOutcome::Success
        && side_effects.as_ref().is_some_and(SideEffects::exactly_once);
    RecoveryVerdict {
        succeeded,
        reason,
        side_effects,
    }
}

/// What [`Tasks::side_effects_if_open`] found.
enum Open {
    Ended(Box<Task>),
    /// Open, with its journal's side effects (`None`: no journal).
    Open(Option<SideEffects>),
}

struct Entry {
    task: Task,
    dirty: bool,
    /// The last activity on the monotonic clock: idleness is a duration, and a step
    /// of the wall clock (NTP, a resumed VM) must not end a live task.
    seen: tokio::time::Instant,
    /// Calls of the task under way (see [`InFlight`]): a task waiting on a long
    /// stream is not idle.
    in_flight: u32,
}

/// A call of a task under way, from its arrival until its response body is done
/// (or dropped): the idle sweep leaves the task alone meanwhile, and its idleness
/// counts from the end of its last call, not the start.
#[must_use = "the call is under way until this is dropped"]
pub struct InFlight {
    tasks: Tasks,
    id: TaskId,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight").field("task", &self.id).finish()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(entry) = self.tasks.lock().get_mut(&self.id) {
            entry.in_flight = entry.in_flight.saturating_sub(1);
            entry.seen = tokio::time::Instant::now();
        }
    }
}

/// The task tracker. Cheap to clone.
#[derive(Clone)]
pub struct Tasks {
    inner: Arc<Inner>,
}

struct Inner {
    options: TasksOptions,
    journal: Option<Journal>,
    metrics: Metrics,
    slos: Option<Arc<Slos>>,
    tasks: Mutex<HashMap<TaskId, Entry>>,
    /// Tasks forgotten to make room, still to be deleted from the store (the data
    /// plane cannot wait for the store; [`Tasks::persist`] deletes them).
    forgotten: Mutex<Vec<TaskId>>,
    /// How many tasks were forgotten to make room (the first is logged at WARN).
    forgotten_total: std::sync::atomic::AtomicU64,
    changed: tokio::sync::Notify,
    /// Held while tasks are copied and written to the store: each writer copies the
    /// tasks it writes after taking it, so the store is written in the order the
    /// copies were taken and an older copy (an open task, copied by a persist) never
    /// lands after a newer one (its end).
    saving: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Tasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tasks").finish_non_exhaustive()
    }
}

impl Tasks {
    /// Loads the tasks a previous process persisted; those it left open are charged
    /// a `sidecar_restart` fault now. Without a journal, tasks live in memory only.
    pub fn open(
        options: TasksOptions,
        journal: Option<Journal>,
        metrics: Metrics,
        slos: Option<Arc<Slos>>,
        now: SystemTime,
    ) -> Result<Self, Error> {
        let mut stored = Vec::new();
        if let Some(j) = &journal {
            for (key, bytes) in j.kv_scan(NAMESPACE)? {
                match serde_json::from_slice::<Task>(&bytes) {
                    Ok(task) => stored.push(task),
                    // One unreadable task must not keep the sidecar from starting.
                    Err(e) => {
                        tracing::warn!(task = %key, error = %e, "a persisted task could not be decoded; skipped");
                    }
                }
            }
        }
        // A previous process may have kept more (a larger cap): those kept are the
        // ones `make_room` would keep (`Task::keep_rank`).
        let max = options.max_tasks.max(1);
        let mut forgotten = Vec::new();
        if stored.len() > max {
            stored.sort_by_key(|t| std::cmp::Reverse(t.keep_rank()));
            forgotten = stored.split_off(max).into_iter().map(|t| t.id).collect();
            for _ in &forgotten {
                metrics.task_forgotten();
            }
            tracing::warn!(
                forgotten = forgotten.len(),
                max_tasks = max,
                "more tasks were stored than [tasks] max_tasks allows: the oldest are forgotten"
            );
        }
        let at = Timestamp::from_system(now);
        let seen = tokio::time::Instant::now();
        let tasks = stored
            .into_iter()
            .map(|mut task| {
                let reopened = task.ended_at.is_none();
                if reopened {
                    let at = at.max(task.last_activity);
                    task.fault(FaultKind::SidecarRestart, at);
                }
                let entry = Entry {
                    task,
                    dirty: reopened,
                    seen,
                    in_flight: 0,
                };
                (entry.task.id.clone(), entry)
            })
            .collect();
        let tracker = Self {
            inner: Arc::new(Inner {
                options,
                journal,
                metrics,
                slos,
                tasks: Mutex::new(HashMap::new()),
                forgotten_total: std::sync::atomic::AtomicU64::new(forgotten.len() as u64),
                forgotten: Mutex::new(forgotten),
                changed: tokio::sync::Notify::new(),
                saving: tokio::sync::Mutex::new(()),
            }),
        };
        *tracker.lock() = tasks;
        Ok(tracker)
    }

    /// Forgets one task: the one that ended longest ago, or with none ended the
    /// open task idle longest. Its stored copy goes at the next [`Tasks::persist`].
    fn make_room(&self, tasks: &mut HashMap<TaskId, Entry>) {
        // A task with a call under way is forgotten last: its call's report would
        // start it afresh, and its guard would count down a newer entry's calls.
        let victim = tasks
            .values()
            .min_by_key(|e| (e.in_flight > 0, e.task.keep_rank(), e.seen))
            .map(|e| e.task.id.clone());
        let Some(id) = victim.and_then(|id| tasks.remove(&id).map(|e| e.task.id)) else {
            return;
        };
        self.inner.metrics.task_forgotten();
        let before = self
            .inner
            .forgotten_total
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if before == 0 {
            tracing::warn!(task = %id, max_tasks = self.inner.options.max_tasks,
                "the task tracker is full: the oldest tasks are forgotten to make room (further ones are logged at debug)");
        } else {
            tracing::debug!(task = %id, "task forgotten to make room");
        }
        self.inner
            .forgotten
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(id);
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<TaskId, Entry>> {
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the open task `id` (created on its first call). An ended task's
    /// books are final: a call that arrives after its end is noted in its timeline,
    /// and `f` does not run. `synthetic` is said by a call as it arrives (`None`
    /// for the reports that follow): a task opened by synthetic traffic is
    /// synthetic until a call that is not arrives.
    fn with_task(
        &self,
        id: &TaskId,
        request_id: &str,
        at: SystemTime,
        synthetic: Option<bool>,
        f: impl FnOnce(&mut Task, Timestamp),
    ) {
        let at = Timestamp::from_system(at);
        let mut tasks = self.lock();
        if !tasks.contains_key(id) && tasks.len() >= self.inner.options.max_tasks.max(1) {
            self.make_room(&mut tasks);
        }
        let entry = tasks.entry(id.clone()).or_insert_with(|| Entry {
            task: Task {
                synthetic: synthetic == Some(true),
                ..Task::new(id.clone(), request_id, at)
            },
            dirty: true,
            seen: tokio::time::Instant::now(),
            in_flight: 0,
        });
        entry.dirty = true;
        entry.seen = tokio::time::Instant::now();
        if synthetic.is_some() {
            entry.in_flight = entry.in_flight.saturating_add(1);
        }
        // Stamps never run backwards within a task, whatever the wall clock does.
        let at = at.max(entry.task.last_activity);
        if entry.task.ended_at.is_some() {
            // One note per late call: its arrival and its report carry the same
            // request id.
            let noted = entry.task.timeline.iter().rev().any(
                |e| matches!(e, TimelineEvent::AfterEnd { request_id: r, .. } if r == request_id),
            );
            if !noted {
                entry.task.push(TimelineEvent::AfterEnd {
                    at,
                    request_id: request_id.to_owned(),
                });
            }
        } else {
            entry.task.activity(at);
            if synthetic == Some(false) {
                entry.task.synthetic = false;
            }
            f(&mut entry.task, at);
        }
        drop(tasks);
        self.inner.changed.notify_one();
    }

    /// Resolves when a task changed since the last call: the owner then calls
    /// [`Tasks::persist`] (soon, so a crash loses little; debounced, so a busy
    /// sidecar does not save on every call).
    pub async fn changed(&self) {
        self.inner.changed.notified().await;
    }

    /// A request of the task arrived and was answered at once (creates the task on
    /// its first call).
    pub fn touch(&self, task: &TaskId, request_id: &str, now: SystemTime) {
        drop(self.arrived(task, request_id, false, now));
    }

    /// A request of the task arrived, drill or probe traffic if `synthetic`
    /// (creates the task on its first call). The call is under way until the
    /// returned guard drops.
    pub fn arrived(
        &self,
        task: &TaskId,
        request_id: &str,
        synthetic: bool,
        now: SystemTime,
    ) -> InFlight {
        self.with_task(task, request_id, now, Some(synthetic), |_, _| ());
        InFlight {
            tasks: self.clone(),
            id: task.clone(),
        }
    }

    /// A model call of the task finished.
    pub fn model_call(&self, task: &TaskId, call: &ModelCallSummary<'_>) {
        let cost = self.inner.options.prices.cost(
            call.provider,
            call.response_model.unwrap_or(call.model),
            call.tokens_in,
            call.tokens_out,
        );
        self.with_task(task, call.request_id, call.at, None, |t, at| {
            t.model_calls = t.model_calls.saturating_add(1);
            t.tokens_in = t.tokens_in.saturating_add(call.tokens_in);
            t.tokens_out = t.tokens_out.saturating_add(call.tokens_out);
            t.cost_micros = t.cost_micros.saturating_add(cost);
            t.retries = t.retries.saturating_add(call.retries);
            t.fallbacks = t.fallbacks.saturating_add(call.fallbacks);
            if let Some(charged) = call.charged {
                t.charged = Some(charged);
            }
            if let Some(m) = call.response_model {
                t.model_revision = Some(m.to_owned());
            }
            for v in call.policy_versions {
                // Bounded: a task sees a handful of versions unless policies are
                // swapped all day.
                if !t.policy_versions.contains(v) && t.policy_versions.len() < 32 {
                    t.policy_versions.push(v.clone());
                }
            }
            t.push(TimelineEvent::ModelCall {
                at,
                request_id: call.request_id.to_owned(),
                provider: call.provider.to_owned(),
                model: call.model.to_owned(),
                ok: call.ok,
                replayed: call.replayed,
                retries: call.retries,
                fallbacks: call.fallbacks,
                tokens_in: call.tokens_in,
                tokens_out: call.tokens_out,
            });
            if call.interrupted {
                t.fault(FaultKind::StreamInterrupted, at);
            }
            t.progress(call.replayed, call.ok && !call.interrupted, at);
        });
    }

    /// A tool call of the task finished.
    pub fn tool_call(&self, task: &TaskId, call: &ToolCallSummary<'_>) {
        self.with_task(task, call.request_id, call.at, None, |t, at| {
            t.tool_calls = t.tool_calls.saturating_add(1);
            t.retries = t.retries.saturating_add(call.retries);
            t.push(TimelineEvent::ToolCall {
                at,
                request_id: call.request_id.to_owned(),
                tool: call.tool.to_owned(),
                key: call.key.map(str::to_owned),
                outcome: call.outcome,
                replayed: call.replayed,
            });
            if call.outcome == ToolCallOutcome::InDoubt {
                t.fault(FaultKind::ToolInDoubt, at);
            }
            t.progress(
                call.replayed,
                call.outcome == ToolCallOutcome::Completed,
                at,
            );
        });
    }

    /// A fault the data plane saw outside the summaries above.
    pub fn fault(&self, task: &TaskId, request_id: &str, kind: FaultKind, now: SystemTime) {
        self.with_task(task, request_id, now, None, |t, at| t.fault(kind, at));
    }

    /// Ends the task (`POST /v1/tasks/{id}/end`, or idle expiry): decides recovery
    /// from the journal, records its metrics, SLO event and `invoke_agent` span, and
    /// persists the task. Ending an ended task returns it unchanged, also when two
    /// ends race (the idle sweep and the agent, a retried request): only the one
    /// that ended it records anything. A task ended as idle ends at its last
    /// activity: the idle period is not part of its wall-clock.
    pub async fn end(
        &self,
        id: &TaskId,
        outcome: TaskOutcome,
        now: SystemTime,
    ) -> Result<TaskReport, Error> {
        self.end_if(id, outcome, now, None)
            .await?
            .ok_or_else(|| Error::UnknownTask(id.clone()))
    }

    /// Ends a task the sweep found idle, if it still is when it is closed: a call
    /// may have arrived since (`None` then).
    async fn end_idle(
        &self,
        id: &TaskId,
        now: SystemTime,
        idle_timeout: Duration,
    ) -> Result<Option<TaskReport>, Error> {
        self.end_if(id, TaskOutcome::IdleTimeout, now, Some(idle_timeout))
            .await
    }

    /// [`Tasks::end`], only if the task is still idle for `idle_for` when given
    /// (see [`Tasks::close`]).
    async fn end_if(
        &self,
        id: &TaskId,
        outcome: TaskOutcome,
        now: SystemTime,
        idle_for: Option<Duration>,
    ) -> Result<Option<TaskReport>, Error> {
        let at = Timestamp::from_system(now);
        match self.side_effects_if_open(id)? {
            Open::Ended(task) => Ok(Some(self.report(*task, at))),
            Open::Open(side_effects) => self.close(id, outcome, at, side_effects, idle_for).await,
        }
    }

    /// The first half of [`Tasks::end`]: the task as it is if it has ended, else
    /// what its journal says about its side effects. The journal is read without
    /// holding the lock (it is a disk scan), so another end may come between this
    /// and [`Tasks::close`].
    fn side_effects_if_open(&self, id: &TaskId) -> Result<Open, Error> {
        {
            let tasks = self.lock();
            let entry = tasks
                .get(id)
                .ok_or_else(|| Error::UnknownTask(id.clone()))?;
            if entry.task.ended_at.is_some() {
                return Ok(Open::Ended(Box::new(entry.task.clone())));
            }
        }
        Ok(Open::Open(match &self.inner.journal {
            Some(j) => {
                // One record past the cap tells that there are more.
                let records = j.list(&Filter {
                    task: Some(id.clone()),
                    limit: Some(SIDE_EFFECTS_CAP + 1),
                    ..Filter::default()
                })?;
                let read = records.len().min(SIDE_EFFECTS_CAP);
                let mut effects = check_side_effects(&records[..read]);
                effects.capped = records.len() > SIDE_EFFECTS_CAP;
                Some(effects)
            }
            None => None,
        }))
    }

    /// The second half of [`Tasks::end`]: ends the task unless another end came
    /// first, and only then records and saves it. With `idle_for`, only a task with
    /// no call under way and none for that long is ended (`None` otherwise).
    async fn close(
        &self,
        id: &TaskId,
        outcome: TaskOutcome,
        at: Timestamp,
        side_effects: Option<SideEffects>,
        idle_for: Option<Duration>,
    ) -> Result<Option<TaskReport>, Error> {
        let (task, ended_here) = {
            let mut tasks = self.lock();
            let entry = tasks
                .get_mut(id)
                .ok_or_else(|| Error::UnknownTask(id.clone()))?;
            if idle_for.is_some_and(|idle| entry.in_flight > 0 || entry.seen.elapsed() <= idle) {
                return Ok(None);
            }
            let t = &mut entry.task;
            // Another end may have come first while the journal was read.
            let ended_here = t.ended_at.is_none();
            if ended_here {
                // An idle task ends at its last activity, or at what happened to it
                // since (the restart that charged it a fault), whichever is later.
                let latest = t.timeline.last().map_or(t.last_activity, TimelineEvent::at);
                let at = match outcome {
                    TaskOutcome::IdleTimeout => t.last_activity.max(latest),
                    _ => at.max(t.last_activity).max(latest),
                };
                t.ended_at = Some(at);
                t.outcome = Some(outcome);
                t.push(TimelineEvent::Ended { at, outcome });
                // Faults recorded while the journal was read are judged too.
                if t.faults.total() > 0 {
                    t.recovery = Some(verdict(outcome, side_effects));
                }
                entry.dirty = true;
            }
            (entry.task.clone(), ended_here)
        };
        if ended_here {
            // Observed before it is saved: a failed save is retried by the next
            // persist (the task stays dirty), and the end must be counted once.
            self.observe_end(&task);
            let _saving = self.inner.saving.lock().await;
            // The task as it is now (a persist may have written an older copy
            // while this waited). One forgotten meanwhile is not written back: its
            // stored copy is being deleted.
            let latest = self.lock().get(id).map(|e| e.task.clone());
            if let Some(latest) = latest {
                self.save(&latest).await?;
            }
        }
        Ok(Some(self.report(task, at)))
    }

    fn observe_end(&self, task: &Task) {
        let (Some(ended_at), Some(outcome)) = (task.ended_at, task.outcome) else {
            return;
        };
        let wall_clock = task.wall_clock(ended_at);
        // A task its agent gave up was neither recovered nor failed to recover: its
        // verdict stays in its report, but no recovery is counted either way.
        let recovered = match outcome {
            TaskOutcome::Cancelled => None,
            _ => task.recovery.as_ref().map(|r| r.succeeded),
        };
        let versions = task
            .policy_versions
            .iter()
            .map(PolicyVersion::as_str)
            .collect::<Vec<_>>()
            .join(",");
        let m = &self.inner.metrics;
        // Drill and probe tasks say nothing about the agents' tasks: they stay out of
        // the task SLO metrics (their span and report are kept).
        if !task.synthetic {
            m.task_ended(wall_clock, outcome.as_str(), recovered);
            if let Some(ok) = recovered {
                m.recovery(ok);
            }
        }
        if let Some(slos) = &self.inner.slos {
            let duplicated = task
                .recovery
                .as_ref()
                .and_then(|r| r.side_effects.as_ref())
                .is_some_and(|s| !s.duplicated.is_empty());
            let slo_outcome = match (outcome, recovered) {
                _ if task.synthetic => Outcome::Excluded(outrigger_types::Exclusion::Synthetic),
                (TaskOutcome::Cancelled, _) => {
                    Outcome::Excluded(outrigger_types::Exclusion::ClientCancelled)
                }
                (_, Some(false)) if duplicated => Outcome::Bad(Cause::Release),
                (_, Some(false)) => Outcome::Bad(Cause::Unknown),
                _ => Outcome::Good,
            };
            let mut event = SloEvent::new(ObjectKind::Tasks, slo_outcome, ended_at.to_system());
            event.wall_clock = Some(wall_clock);
            event.recovered = recovered;
            slos.record(&event);
        }
        spans::emit_task(&TaskSpan {
            task_id: task.id.as_str(),
            request_id: &task.first_request_id,
            started_at: task.started_at.to_system(),
            ended_at: ended_at.to_system(),
            outcome: outcome.as_str(),
            recovered,
            faults: task.faults.total(),
            model_calls: task.model_calls,
            tool_calls: task.tool_calls,
            tokens_in: task.tokens_in,
            tokens_out: task.tokens_out,
            model_revision: task.model_revision.as_deref(),
            policy_versions: (!versions.is_empty()).then_some(versions.as_str()),
            gpu_id: None,
        });
    }

    fn report(&self, task: Task, now: Timestamp) -> TaskReport {
        // A page, not the task's whole history: one record past the cap tells that
        // there are more.
        let mut records = self
            .inner
            .journal
            .as_ref()
            .and_then(|j| {
                j.list(&Filter {
                    task: Some(task.id.clone()),
                    limit: Some(REPORT_JOURNAL_CAP + 1),
                    ..Filter::default()
                })
                .ok()
            })
            .unwrap_or_default();
        let journal_capped = records.len() > REPORT_JOURNAL_CAP;
        records.truncate(REPORT_JOURNAL_CAP);
        TaskReport {
            wall_clock_ms: u64::try_from(task.wall_clock(now).as_millis()).unwrap_or(u64::MAX),
            task,
            journal: records.iter().map(TimelineEntry::of).collect(),
            journal_capped,
        }
    }

    /// Ends tasks idle for longer than `idle_timeout` (outcome `idle_timeout`) and
    /// forgets ended tasks past retention. Returns the tasks it ended.
    pub async fn sweep(
        &self,
        now: SystemTime,
        idle_timeout: Duration,
    ) -> Result<Vec<TaskReport>, Error> {
        let at = Timestamp::from_system(now);
        // Held until the expired tasks' stored copies are deleted: a persist that
        // copied one of them before it was forgotten must not write it back after.
        let saving = self.inner.saving.lock().await;
        let (idle, expired): (Vec<TaskId>, Vec<TaskId>) = {
            let mut tasks = self.lock();
            let idle = tasks
                .values()
                .filter(|e| e.task.ended_at.is_none())
                .filter(|e| e.in_flight == 0 && e.seen.elapsed() > idle_timeout)
                .map(|e| e.task.id.clone())
                .collect();
            let expired: Vec<TaskId> = tasks
                .values()
                .filter(|e| {
                    e.task
                        .ended_at
                        .is_some_and(|end| at.since(end) > self.inner.options.retention)
                })
                .map(|e| e.task.id.clone())
                .collect();
            for id in &expired {
                tasks.remove(id);
            }
            (idle, expired)
        };
        if let Some(j) = &self.inner.journal {
            for id in &expired {
                j.kv_delete(NAMESPACE, id.as_str()).await?;
            }
        }
        drop(saving);
        let mut ended = Vec::with_capacity(idle.len());
        for id in idle {
            match self.end_idle(&id, now, idle_timeout).await {
                Ok(Some(report)) => ended.push(report),
                // A call arrived since the task was found idle.
                Ok(None) => {}
                // Forgotten meanwhile to make room for a new task.
                Err(Error::UnknownTask(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(ended)
    }

    /// Writes the tasks changed since the last call, and deletes from the store
    /// those forgotten to make room. Returns how many tasks it wrote.
    pub async fn persist(&self) -> Result<usize, Error> {
        let written = self.persist_changed().await?;
        self.delete_forgotten().await?;
        Ok(written)
    }

    async fn delete_forgotten(&self) -> Result<(), Error> {
        let forgotten = std::mem::take(
            &mut *self
                .inner
                .forgotten
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let Some(j) = &self.inner.journal else {
            return Ok(());
        };
        // As in the sweep: no copy taken before a task was forgotten lands after its
        // deletion.
        let _saving = self.inner.saving.lock().await;
        for (i, id) in forgotten.iter().enumerate() {
            // Back since it was forgotten: its new record is saved instead.
            if self.lock().contains_key(id) {
                continue;
            }
            if let Err(e) = j.kv_delete(NAMESPACE, id.as_str()).await {
                self.inner
                    .forgotten
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .extend_from_slice(&forgotten[i..]);
                return Err(e.into());
            }
        }
        Ok(())
    }

    async fn persist_changed(&self) -> Result<usize, Error> {
        let _saving = self.inner.saving.lock().await;
        let changed: Vec<Task> = {
            let mut tasks = self.lock();
            tasks
                .values_mut()
                .filter(|e| e.dirty)
                .map(|e| {
                    e.dirty = false;
                    e.task.clone()
                })
                .collect()
        };
        let mut written = 0;
        for task in &changed {
            if let Err(e) = self.save(task).await {
                // Write it again next time.
                for t in &changed {
                    if let Some(entry) = self.lock().get_mut(&t.id) {
                        entry.dirty = true;
                    }
                }
                return Err(e);
            }
            written += 1;
        }
        Ok(written)
    }

    async fn save(&self, task: &Task) -> Result<(), Error> {
        let Some(j) = &self.inner.journal else {
            return Ok(());
        };
        let bytes = serde_json::to_vec(task).map_err(|e| Error::Encode {
            key: task.id.to_string(),
            detail: e.to_string(),
        })?;
        j.kv_put(NAMESPACE, task.id.as_str(), bytes).await?;
        Ok(())
    }

    /// What each open task has spent so far, with its wall-clock: the budget
    /// ledger is seeded from it when the data plane starts, so a task loaded after a
    /// restart keeps the budget it had used instead of starting over.
    pub fn spent(&self, now: SystemTime) -> Vec<(TaskId, outrigger_types::Usage, Duration)> {
        let now = Timestamp::from_system(now);
        self.lock()
            .values()
            .filter(|e| e.task.ended_at.is_none())
            .map(|e| {
                let t = &e.task;
                // What the ledger charged; a task stored before it was kept, what
                // the provider reported.
                let usage = t.charged.unwrap_or(outrigger_types::Usage {
                    tokens_in: t.tokens_in,
                    tokens_out: t.tokens_out,
                    cost_micros: t.cost_micros,
                    calls: t.model_calls,
                    retries: t.retries,
                    ..outrigger_types::Usage::default()
                });
                (t.id.clone(), usage, t.wall_clock(now))
            })
            .collect()
    }

    /// Every known task, newest first.
    pub fn list(&self, now: SystemTime) -> Vec<TaskSummary> {
        let now = Timestamp::from_system(now);
        let tasks = self.lock();
        let mut out: Vec<TaskSummary> = tasks
            .values()
            .map(|e| {
                let t = &e.task;
                TaskSummary {
                    id: t.id.clone(),
                    started_at: t.started_at,
                    last_activity: t.last_activity,
                    ended_at: t.ended_at,
                    outcome: t.outcome,
                    wall_clock_ms: u64::try_from(t.wall_clock(now).as_millis()).unwrap_or(u64::MAX),
                    model_calls: t.model_calls,
                    tool_calls: t.tool_calls,
                    tokens_in: t.tokens_in,
                    tokens_out: t.tokens_out,
                    cost_micros: t.cost_micros,
                    retries: t.retries,
                    fallbacks: t.fallbacks,
                    replays: t.replays,
                    faults: t.faults.total(),
                    recoveries: t.recoveries,
                    recovered: t.recovery.as_ref().map(|r| r.succeeded),
                }
            })
            .collect();
        out.sort_by(|a, b| b.started_at.cmp(&a.started_at).then(a.id.cmp(&b.id)));
        out
    }

    /// One task with its timeline and journaled tool calls.
    pub fn get(&self, id: &TaskId, now: SystemTime) -> Option<TaskReport> {
        let task = self.lock().get(id).map(|e| e.task.clone())?;
        Some(self.report(task, Timestamp::from_system(now)))
    }
}

#[cfg(test)]
mod tests {
    use outrigger_journal::{Begin, Headers, Intent, KeySource, RedactedRequest, StoredResponse};
    use outrigger_types::{Fingerprint, IdempotencyKey, RequestId};

    use super::*;
    use crate::test_journal::TempJournal;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn task() -> TaskId {
        match TaskId::new("task-1") {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        }
    }

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    /// Journals one tool call of `task-1` and drives it to `end`.
    async fn tool_call(
        journal: &Journal,
        key: &str,
        body: &str,
        class: ToolClass,
        end: State,
    ) -> TestResult {
        let intent = Intent {
            key: IdempotencyKey::new(key)?,
            fingerprint: Fingerprint(sha(body)),
            tool: "payments".into(),
            class,
            method: "POST".into(),
            target: "/charges".into(),
            task_id: Some(task()),
            request_id: RequestId::from_generated(format!("req-{key}")),
            downstream_key: key.into(),
            request: RedactedRequest::new(Headers::default(), body),
            policy_versions: Vec::new(),
            model_revision: None,
            derived_from: KeySource::Header,
        };
        let Begin::Execute { ticket, .. } = journal.begin(intent).await? else {
            return Err("expected to execute".into());
        };
        match end {
            State::Completed => {
                journal
                    .complete(&ticket, StoredResponse::new(201, Headers::default(), "{}"))
                    .await?;
            }
            State::FailedBeforeSend => {
                journal
                    .failed_before_send(&ticket, "connect refused")
                    .await?;
            }
            State::InDoubt => {
                journal.in_doubt(&ticket, "timeout").await?;
            }
            other => return Err(format!("no test path to {other}").into()),
        }
        Ok(())
    }

    fn sha(body: &str) -> [u8; 32] {
        // Distinct bodies, distinct fingerprints: a cheap stand-in for SHA-256.
        let mut out = [0u8; 32];
        for (i, b) in body.bytes().enumerate() {
            out[i % 32] ^= b.wrapping_add(u8::try_from(i % 251).unwrap_or(0));
        }
        out
    }

    fn tools_summary(
        at: SystemTime,
        key: &str,
        outcome: ToolCallOutcome,
        replayed: bool,
    ) -> ToolCallSummary<'_> {
        ToolCallSummary {
            at,
            request_id: "req",
            tool: "payments",
            key: Some(key),
            outcome,
            replayed,
            retries: 0,
        }
    }

    fn model(
        at: SystemTime,
        ok: bool,
        interrupted: bool,
        replayed: bool,
    ) -> ModelCallSummary<'static> {
        ModelCallSummary {
            at,
            request_id: "req-m",
            provider: "openai",
            model: "gpt-4o",
            response_model: Some("gpt-4o-2024-08-06"),
            tokens_in: 1000,
            tokens_out: 500,
            retries: 1,
            fallbacks: 0,
            policy_versions: &[],
            replayed,
            ok,
            interrupted,
            charged: None,
        }
    }

    fn tracker(journal: Option<Journal>, metrics: Metrics) -> Result<Tasks, Error> {
        let mut prices = Prices::default();
        prices.set("openai", None, 2_500_000, 10_000_000);
        Tasks::open(
            TasksOptions {
                prices,
                ..TasksOptions::default()
            },
            journal,
            metrics,
            None,
            t(0),
        )
    }

    #[tokio::test]
    async fn a_task_that_recovered_cleanly_is_a_recovery() -> TestResult {
        let j = TempJournal::open()?;
        let metrics = Metrics::new();
        let tasks = tracker(Some(j.journal.clone()), metrics.clone())?;
        let id = task();
        tasks.touch(&id, "req-0", t(0));
        tool_call(
            &j.journal,
            "k1",
            "charge 5",
            ToolClass::Keyed,
            State::Completed,
        )
        .await?;
        tasks.tool_call(
            &id,
            &tools_summary(t(1), "k1", ToolCallOutcome::Completed, false),
        );
        tasks.model_call(&id, &model(t(2), false, true, false));
        tasks.model_call(&id, &model(t(3), true, false, false));
        tool_call(
            &j.journal,
            "k2",
            "charge 7",
            ToolClass::Keyed,
            State::Completed,
        )
        .await?;
        tasks.tool_call(
            &id,
            &tools_summary(t(4), "k2", ToolCallOutcome::Completed, false),
        );

        let report = tasks.end(&id, TaskOutcome::Success, t(10)).await?;
        let task = &report.task;
        assert_eq!(task.faults.stream_interrupted, 1);
        assert_eq!(task.recoveries, 1);
        assert_eq!((task.model_calls, task.tool_calls), (2, 2));
        assert_eq!(
            (task.tokens_in, task.tokens_out, task.retries),
            (2000, 1000, 2)
        );
        // 2000 × $2.50/M + 1000 × $10/M = 5000 + 10000 micro-dollars.
        assert_eq!(task.cost_micros, 15_000);
        assert_eq!(report.wall_clock_ms, 10_000);
        let verdict = task.recovery.as_ref().ok_or("no verdict")?;
        assert!(verdict.succeeded, "{verdict:?}");
        assert_eq!(verdict.side_effects.as_ref().map(|s| s.completed), Some(2));
        assert_eq!(
            report.journal.len(),
            2,
            "the journal's view of the task's tool calls"
        );
        let kinds: Vec<&str> = task
            .timeline
            .iter()
            .map(|e| match e {
                TimelineEvent::Started { .. } => "started",
                TimelineEvent::ModelCall { .. } => "model",
                TimelineEvent::ToolCall { .. } => "tool",
                TimelineEvent::Fault { .. } => "fault",
                TimelineEvent::Recovered { .. } => "recovered",
                TimelineEvent::AfterEnd { .. } => "after_end",
                TimelineEvent::Ended { .. } => "ended",
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "started",
                "tool",
                "model",
                "fault",
                "model",
                "recovered",
                "tool",
                "ended"
            ]
        );
        let text = metrics.encode();
        assert!(
            text.contains("outrigger_task_recoveries_total{result=\"success\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "outrigger_task_duration_seconds_count{outcome=\"success\",recovered=\"true\"} 1"
            ),
            "{text}"
        );

        // Ending again changes nothing.
        let again = tasks.end(&id, TaskOutcome::Failure, t(20)).await?;
        assert_eq!(again.task.outcome, Some(TaskOutcome::Success));
        Ok(())
    }

    #[tokio::test]
    async fn a_duplicated_side_effect_fails_the_recovery() -> TestResult {
        let j = TempJournal::open()?;
        let metrics = Metrics::new();
        let tasks = tracker(Some(j.journal.clone()), metrics.clone())?;
        let id = task();
        tool_call(
            &j.journal,
            "k1",
            "charge 5",
            ToolClass::Keyed,
            State::Completed,
        )
        .await?;
        tasks.tool_call(
            &id,
            &tools_summary(t(1), "k1", ToolCallOutcome::Completed, false),
        );
        tasks.fault(&id, "req", FaultKind::SidecarRestart, t(2));
        // After the restart the agent sends the same charge under a new key.
        tool_call(
            &j.journal,
            "k1-again",
            "charge 5",
            ToolClass::Keyed,
            State::Completed,
        )
        .await?;
        tasks.tool_call(
            &id,
            &tools_summary(t(3), "k1-again", ToolCallOutcome::Completed, false),
        );

        let report = tasks.end(&id, TaskOutcome::Success, t(4)).await?;
        let verdict = report.task.recovery.ok_or("no verdict")?;
        assert!(!verdict.succeeded);
        let effects = verdict.side_effects.ok_or("not checked")?;
        assert_eq!(effects.duplicated.len(), 1);
        assert_eq!(effects.duplicated[0].keys, ["k1", "k1-again"]);
        assert!(verdict.reason.contains("duplicated"), "{}", verdict.reason);
        let text = metrics.encode();
        assert!(
            text.contains("outrigger_task_recoveries_total{result=\"failure\"} 1"),
            "{text}"
        );
        Ok(())
    }

    #[tokio::test]
    async fn lost_unresolved_and_idempotent_repeats() -> TestResult {
        let j = TempJournal::open()?;
        let tasks = tracker(Some(j.journal.clone()), Metrics::new())?;
        let id = task();
        tasks.touch(&id, "req", t(0));
        tasks.fault(&id, "req", FaultKind::ToolInDoubt, t(1));
        // Never sent, never redone: lost.
        tool_call(
            &j.journal,
            "k-lost",
            "refund 3",
            ToolClass::Keyed,
            State::FailedBeforeSend,
        )
        .await?;
        // Never sent, but redone under another key: not lost.
        tool_call(
            &j.journal,
            "k-retry-1",
            "refund 4",
            ToolClass::Keyed,
            State::FailedBeforeSend,
        )
        .await?;
        tool_call(
            &j.journal,
            "k-retry-2",
            "refund 4",
            ToolClass::Keyed,
            State::Completed,
        )
        .await?;
        // Sent with no answer: unresolved.
        tool_call(
            &j.journal,
            "k-doubt",
            "refund 5",
            ToolClass::Keyed,
            State::InDoubt,
        )
        .await?;
        // The same upsert twice: harmless by declaration.
        tool_call(
            &j.journal,
            "k-up-1",
            "set x",
            ToolClass::Idempotent,
            State::Completed,
        )
        .await?;
        tool_call(
            &j.journal,
            "k-up-2",
            "set x",
            ToolClass::Idempotent,
            State::Completed,
        )
        .await?;

        let report = tasks.end(&id, TaskOutcome::Success, t(5)).await?;
        let verdict = report.task.recovery.ok_or("no verdict")?;
        let effects = verdict.side_effects.ok_or("not checked")?;
        assert_eq!(effects.lost, ["k-lost"]);
        assert_eq!(effects.unresolved, ["k-doubt"]);
        assert!(effects.duplicated.is_empty(), "{:?}", effects.duplicated);
        assert_eq!((effects.keys, effects.completed), (6, 3));
        assert!(!verdict.succeeded);
        Ok(())
    }

    #[tokio::test]
    async fn a_failed_task_never_counts_as_recovered_and_faultless_tasks_have_no_verdict()
    -> TestResult {
        let j = TempJournal::open()?;
        let tasks = tracker(Some(j.journal.clone()), Metrics::new())?;
        let failed = task();
        tasks.model_call(&failed, &model(t(0), false, true, false));
        let report = tasks.end(&failed, TaskOutcome::Failure, t(1)).await?;
        let verdict = report.task.recovery.ok_or("no verdict")?;
        assert!(!verdict.succeeded);
        assert_eq!(verdict.reason, "the task ended failure");

        let clean = TaskId::new("task-2")?;
        tasks.model_call(&clean, &model(t(0), true, false, false));
        assert_eq!(
            tasks
                .end(&clean, TaskOutcome::Success, t(1))
                .await?
                .task
                .recovery,
            None
        );
        assert!(matches!(
            tasks
                .end(&TaskId::new("nope")?, TaskOutcome::Success, t(1))
                .await,
            Err(Error::UnknownTask(_))
        ));
        Ok(())
    }

    #[tokio::test]
    async fn replays_mark_an_agent_restart_once_per_run() -> TestResult {
        let tasks = tracker(None, Metrics::new())?;
        let id = task();
        tasks.model_call(&id, &model(t(0), true, false, false));
        tasks.tool_call(
            &id,
            &tools_summary(t(1), "k1", ToolCallOutcome::Completed, false),
        );
        // The agent restarts and walks the same trajectory: answered from the journal.
        tasks.model_call(&id, &model(t(2), true, false, true));
        tasks.tool_call(
            &id,
            &tools_summary(t(3), "k1", ToolCallOutcome::Completed, true),
        );
        tasks.model_call(&id, &model(t(4), true, false, false));
        let report = tasks.get(&id, t(5)).ok_or("unknown task")?;
        assert_eq!(report.task.replays, 2);
        assert_eq!(report.task.faults.agent_replays, 1);
        assert_eq!(report.task.recoveries, 1);
        // Without a journal the side effects cannot be checked: not a recovery.
        let ended = tasks.end(&id, TaskOutcome::Success, t(6)).await?;
        let verdict = ended.task.recovery.ok_or("no verdict")?;
        assert!(!verdict.succeeded && verdict.side_effects.is_none());
        Ok(())
    }

    #[tokio::test]
    async fn tasks_survive_a_restart_with_the_downtime_counted() -> TestResult {
        let j = TempJournal::open()?;
        let first = tracker(Some(j.journal.clone()), Metrics::new())?;
        let id = task();
        first.model_call(&id, &model(t(0), true, false, false));
        assert_eq!(first.persist().await?, 1);
        assert_eq!(first.persist().await?, 0, "nothing changed since");
        drop(first);

        // The next process finds the task open: the restart is a fault.
        let second = Tasks::open(
            TasksOptions::default(),
            Some(j.journal.clone()),
            Metrics::new(),
            None,
            t(600),
        )?;
        let report = second.get(&id, t(600)).ok_or("task lost in the restart")?;
        assert_eq!(report.task.faults.sidecar_restarts, 1);
        assert_eq!(report.task.model_calls, 1);
        second.model_call(&id, &model(t(610), true, false, false));
        let ended = second.end(&id, TaskOutcome::Success, t(620)).await?;
        assert_eq!(
            ended.wall_clock_ms, 620_000,
            "wall-clock includes the downtime"
        );
        assert!(ended.task.recovery.is_some_and(|r| r.succeeded));
        let third = Tasks::open(
            TasksOptions::default(),
            Some(j.journal.clone()),
            Metrics::new(),
            None,
            t(700),
        )?;
        let stored = third.get(&id, t(700)).ok_or("ended task not persisted")?;
        assert_eq!(
            stored.task.faults.sidecar_restarts, 1,
            "an ended task is not charged again"
        );
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn sweep_ends_idle_tasks_and_forgets_old_ones() -> TestResult {
        let j = TempJournal::open()?;
        let tasks = tracker(Some(j.journal.clone()), Metrics::new())?;
        let idle = task();
        let busy = TaskId::new("task-busy")?;
        tasks.touch(&idle, "r1", t(0));
        tasks.touch(&busy, "r2", t(0));
        // Idleness is measured on the monotonic clock (paused here), not on the wall
        // clock the calls carry.
        tokio::time::advance(Duration::from_secs(250)).await;
        tasks.touch(&busy, "r3", t(250));
        tokio::time::advance(Duration::from_secs(51)).await;
        let ended = tasks.sweep(t(301), Duration::from_secs(300)).await?;
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].task.id, idle);
        assert_eq!(ended[0].task.outcome, Some(TaskOutcome::IdleTimeout));
        assert_eq!(tasks.list(t(301)).len(), 2);
        // A day after it ended, the idle task is forgotten, here and in the store.
        tasks
            .sweep(t(301 + 86_401), Duration::from_secs(1_000_000))
            .await?;
        assert!(tasks.get(&idle, t(0)).is_none());
        assert!(j.journal.kv_get(NAMESPACE, idle.as_str())?.is_none());
        Ok(())
    }

    /// The idle sweep and the agent's own end (or a retried one) race: the task is
    /// ended, counted, observed and saved once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_racing_ends_count_the_task_once() -> TestResult {
        let j = TempJournal::open()?;
        let metrics = Metrics::new();
        let tasks = tracker(Some(j.journal.clone()), metrics.clone())?;
        const ROUNDS: u32 = 200;
        let runtime = tokio::runtime::Handle::current();
        for round in 0..ROUNDS {
            let id = TaskId::new(format!("race-{round}"))?;
            tasks.fault(&id, "req", FaultKind::SidecarRestart, t(0));
            // Two threads of their own, released together: the race is real.
            let barrier = Arc::new(std::sync::Barrier::new(2));
            let ends: Vec<_> = [TaskOutcome::Success, TaskOutcome::IdleTimeout]
                .into_iter()
                .map(|outcome| {
                    let (tasks, id, barrier) = (tasks.clone(), id.clone(), barrier.clone());
                    let runtime = runtime.clone();
                    tokio::task::spawn_blocking(move || {
                        barrier.wait();
                        runtime.block_on(tasks.end(&id, outcome, t(10)))
                    })
                })
                .collect();
            let mut outcomes = Vec::new();
            for end in ends {
                outcomes.push(end.await??.task.outcome);
            }
            assert!(
                outcomes[0] == outcomes[1],
                "both callers see the one end: {outcomes:?}"
            );
        }
        let text = metrics.encode();
        let counted: f64 = text
            .lines()
            .filter(|l| l.starts_with("outrigger_task_duration_seconds_count{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        let verdicts: f64 = text
            .lines()
            .filter(|l| l.starts_with("outrigger_task_recoveries_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert_eq!(
            (counted, verdicts),
            (f64::from(ROUNDS), f64::from(ROUNDS)),
            "{text}"
        );
        Ok(())
    }

    /// Both ends read the journal before either closes the task (the interleaving
    /// the race above hits by chance): the second finds it ended and records
    /// nothing.
    #[tokio::test]
    async fn an_end_that_lost_the_race_records_nothing() -> TestResult {
        let j = TempJournal::open()?;
        let metrics = Metrics::new();
        let tasks = tracker(Some(j.journal.clone()), metrics.clone())?;
        let id = task();
        tasks.fault(&id, "req", FaultKind::SidecarRestart, t(0));
        let (Open::Open(first), Open::Open(second)) = (
            tasks.side_effects_if_open(&id)?,
            tasks.side_effects_if_open(&id)?,
        ) else {
            return Err("the task was open".into());
        };
        let at = Timestamp::from_system(t(10));
        let won = tasks
            .close(&id, TaskOutcome::Success, at, first, None)
            .await?
            .ok_or("ended")?;
        let lost = tasks
            .close(&id, TaskOutcome::IdleTimeout, at, second, None)
            .await?
            .ok_or("answered")?;
        assert_eq!(lost.task, won.task, "the second end changes nothing");
        let text = metrics.encode();
        assert!(
            text.contains(
                "outrigger_task_duration_seconds_count{outcome=\"success\",recovered=\"true\"} 1"
            ),
            "{text}"
        );
        assert!(!text.contains("outcome=\"idle_timeout\""), "{text}");
        assert!(
            text.contains("outrigger_task_recoveries_total{result=\"success\"} 1"),
            "{text}"
        );
        Ok(())
    }

    /// A task its agent cancelled had faults, but cancelling is neither a recovery
    /// nor a failed one: no recovery is counted, and its duration is labelled
    /// `recovered="none"`.
    #[tokio::test]
    async fn a_cancelled_task_counts_no_recovery() -> TestResult {
        let j = TempJournal::open()?;
        let metrics = Metrics::new();
        let tasks = tracker(Some(j.journal.clone()), metrics.clone())?;
        let id = task();
        tasks.model_call(&id, &model(t(0), false, true, false));
        let report = tasks.end(&id, TaskOutcome::Cancelled, t(5)).await?;
        let verdict = report.task.recovery.ok_or("no verdict")?;
        assert_eq!(verdict.reason, "the task ended cancelled");
        let text = metrics.encode();
        assert!(!text.contains("outrigger_task_recoveries_total{"), "{text}");
        assert!(
            text.contains(
                "outrigger_task_duration_seconds_count{outcome=\"cancelled\",recovered=\"none\"} 1"
            ),
            "{text}"
        );
        Ok(())
    }

    /// What the ledger charged a task (an estimate where the provider reported no
    /// usage) is what its budget counts after a restart, not the reported tokens.
    #[tokio::test]
    async fn a_restarted_task_keeps_what_the_ledger_charged_it() -> TestResult {
        let j = TempJournal::open()?;
        let first = tracker(Some(j.journal.clone()), Metrics::new())?;
        let id = task();
        let charged = outrigger_types::Usage {
            tokens_in: 4000,
            tokens_out: 1024,
            cost_micros: 20_240,
            calls: 2,
            retries: 1,
            ..outrigger_types::Usage::default()
        };
        // No usage reported: the call's tokens are unknown, its estimate charged.
        first.model_call(
            &id,
            &ModelCallSummary {
                tokens_in: 0,
                tokens_out: 0,
                charged: Some(charged),
                ..model(t(0), true, false, false)
            },
        );
        first.persist().await?;
        drop(first);
        let second = tracker(Some(j.journal.clone()), Metrics::new())?;
        let spent = second.spent(t(1));
        assert_eq!(spent.len(), 1);
        assert_eq!(spent[0].1, charged);
        Ok(())
    }

    /// A task's spend before a restart still counts against its budget: the data
    /// plane's ledger starts from what the loaded task had used.
    #[tokio::test]
    async fn a_restarted_task_keeps_its_spend_in_the_budget_ledger() -> TestResult {
        let j = TempJournal::open()?;
        let first = tracker(Some(j.journal.clone()), Metrics::new())?;
        let id = task();
        first.model_call(&id, &model(t(0), true, false, false));
        first.persist().await?;
        drop(first);

        let metrics = Metrics::new();
        let second = tracker(Some(j.journal.clone()), metrics.clone())?;
        let proxy = crate::Proxy::new(
            crate::Options::default(),
            crate::Components {
                tasks: Some(second),
                ..crate::Components::new(metrics, None)
            },
        );
        let spent = proxy.shared.ledger.committed(id.as_str());
        // 1000 × $2.50/M + 500 × $10/M = 2500 + 5000 micro-dollars.
        assert_eq!(
            (
                spent.tokens_in,
                spent.tokens_out,
                spent.cost_micros,
                spent.calls,
                spent.retries
            ),
            (1000, 500, 7500, 1, 1)
        );
        Ok(())
    }

    /// A task opened by synthetic traffic (a drill, a probe) stays out of the task
    /// SLO metrics; a task that also carries real traffic does not.
    #[tokio::test]
    async fn synthetic_tasks_stay_out_of_the_task_metrics() -> TestResult {
        let j = TempJournal::open()?;
        let metrics = Metrics::new();
        let tasks = tracker(Some(j.journal.clone()), metrics.clone())?;
        let drill = TaskId::new("drill")?;
        drop(tasks.arrived(&drill, "r1", true, t(0)));
        tasks.model_call(&drill, &model(t(1), false, true, false));
        drop(tasks.arrived(&drill, "r2", true, t(2)));
        let report = tasks.end(&drill, TaskOutcome::Failure, t(3)).await?;
        assert!(report.task.synthetic);
        let text = metrics.encode();
        assert!(
            !text.contains("outrigger_task_duration_seconds_count{"),
            "{text}"
        );
        assert!(!text.contains("outrigger_task_recoveries_total{"), "{text}");

        // Opened by a probe, then used by the agent: a real task.
        let real = task();
        drop(tasks.arrived(&real, "r3", true, t(0)));
        drop(tasks.arrived(&real, "r4", false, t(1)));
        tasks.model_call(&real, &model(t(1), true, false, false));
        let report = tasks.end(&real, TaskOutcome::Success, t(2)).await?;
        assert!(!report.task.synthetic);
        let text = metrics.encode();
        assert!(
            text.contains(
                "outrigger_task_duration_seconds_count{outcome=\"success\",recovered=\"none\"} 1"
            ),
            "{text}"
        );
        assert!(!text.contains("outcome=\"failure\""), "{text}");
        Ok(())
    }

    /// A task with a call under way is not idle, however long the call takes (a
    /// long stream); its idleness counts from the end of that call.
    #[tokio::test(start_paused = true)]
    async fn a_task_with_a_call_in_flight_is_not_idle() -> TestResult {
        let tasks = tracker(None, Metrics::new())?;
        let id = task();
        let call = tasks.arrived(&id, "r1", false, t(0));
        tokio::time::advance(Duration::from_secs(31 * 60)).await;
        let ended = tasks
            .sweep(t(31 * 60), Duration::from_secs(30 * 60))
            .await?;
        assert!(ended.is_empty(), "ended mid-call: {ended:?}");
        drop(call);
        tokio::time::advance(Duration::from_secs(29 * 60)).await;
        let ended = tasks
            .sweep(t(60 * 60), Duration::from_secs(30 * 60))
            .await?;
        assert!(
            ended.is_empty(),
            "idle counts from the call's end: {ended:?}"
        );
        tokio::time::advance(Duration::from_secs(2 * 60)).await;
        let ended = tasks
            .sweep(t(62 * 60), Duration::from_secs(30 * 60))
            .await?;
        assert_eq!(ended.len(), 1);
        Ok(())
    }

    /// A call that arrives after the sweep found its task idle, before the sweep
    /// closes it, keeps the task open.
    #[tokio::test(start_paused = true)]
    async fn a_task_found_idle_is_not_ended_once_a_call_has_arrived() -> TestResult {
        let tasks = tracker(None, Metrics::new())?;
        let id = task();
        tasks.touch(&id, "r1", t(0));
        tokio::time::advance(Duration::from_secs(31 * 60)).await;
        let idle = Duration::from_secs(30 * 60);
        // Found idle; then the agent's call arrives before the close.
        let call = tasks.arrived(&id, "r2", false, t(31 * 60));
        let closed = tasks.end_idle(&id, std::time::UNIX_EPOCH, idle).await?;
        assert!(closed.is_none(), "ended mid-call: {closed:?}");
        drop(call);
        let closed = tasks.end_idle(&id, std::time::UNIX_EPOCH, idle).await?;
        assert!(closed.is_none(), "its call ended a moment ago");
        tokio::time::advance(Duration::from_secs(31 * 60)).await;
        let closed = tasks.end_idle(&id, std::time::UNIX_EPOCH, idle).await?;
        assert_eq!(
            closed.and_then(|r| r.task.outcome),
            Some(TaskOutcome::IdleTimeout)
        );
        Ok(())
    }

    /// A full tracker forgets an open task with no call under way before one with a
    /// call in flight, however long ago that call began.
    #[tokio::test(start_paused = true)]
    async fn a_full_tracker_forgets_a_task_with_a_call_under_way_last() -> TestResult {
        let options = TasksOptions {
            max_tasks: 2,
            ..TasksOptions::default()
        };
        let tasks = Tasks::open(options, None, Metrics::new(), None, t(0))?;
        let busy = TaskId::new("busy")?;
        let quiet = TaskId::new("quiet")?;
        let _call = tasks.arrived(&busy, "r1", false, t(0));
        tokio::time::advance(Duration::from_secs(60)).await;
        tasks.touch(&quiet, "r2", t(60));
        tokio::time::advance(Duration::from_secs(60)).await;
        tasks.touch(&task(), "r3", t(120));
        assert!(
            tasks.get(&busy, t(120)).is_some(),
            "the task with a call was forgotten"
        );
        assert!(tasks.get(&quiet, t(120)).is_none());
        Ok(())
    }

    /// A task its agent never ended is ended by the sweep at its last activity: the
    /// idle timeout it waited out is not part of its wall-clock.
    #[tokio::test(start_paused = true)]
    async fn an_idle_task_ends_at_its_last_activity() -> TestResult {
        let metrics = Metrics::new();
        let tasks = tracker(None, metrics.clone())?;
        let id = task();
        tasks.touch(&id, "r1", t(0));
        tasks.model_call(&id, &model(t(60), true, false, false));
        tokio::time::advance(Duration::from_secs(31 * 60)).await;
        let ended = tasks
            .sweep(t(60 + 31 * 60), Duration::from_secs(30 * 60))
            .await?;
        let [report] = ended.as_slice() else {
            return Err(format!("expected one idle task, got {}", ended.len()).into());
        };
        assert_eq!(report.task.outcome, Some(TaskOutcome::IdleTimeout));
        assert_eq!(report.task.ended_at, Some(Timestamp::from_system(t(60))));
        assert_eq!(report.wall_clock_ms, 60_000);
        let text = metrics.encode();
        assert!(
            text.contains(
                "outrigger_task_duration_seconds_sum{outcome=\"idle_timeout\",recovered=\"none\"} 60"
            ),
            "{text}"
        );
        Ok(())
    }

    /// An ended task's books are final: a late call is noted, and changes nothing
    /// else (no calls, tokens, cost, faults or recoveries).
    #[tokio::test]
    async fn calls_after_the_end_are_noted_and_change_nothing_else() -> TestResult {
        let tasks = tracker(None, Metrics::new())?;
        let id = task();
        tasks.model_call(&id, &model(t(0), false, true, false));
        let ended = tasks.end(&id, TaskOutcome::Failure, t(5)).await?.task;
        tasks.touch(&id, "late-1", t(6));
        tasks.model_call(
            &id,
            &ModelCallSummary {
                request_id: "late-2",
                ..model(t(7), false, true, false)
            },
        );
        tasks.model_call(
            &id,
            &ModelCallSummary {
                request_id: "late-3",
                ..model(t(8), true, false, false)
            },
        );
        tasks.tool_call(
            &id,
            &ToolCallSummary {
                request_id: "late-4",
                ..tools_summary(t(9), "k9", ToolCallOutcome::InDoubt, false)
            },
        );
        tasks.fault(&id, "late-5", FaultKind::SidecarRestart, t(10));
        let after = tasks.get(&id, t(11)).ok_or("task lost")?.task;
        let late = after.timeline.len() - ended.timeline.len();
        assert_eq!(late, 5, "each late call noted: {:?}", after.timeline);
        assert!(
            after.timeline[ended.timeline.len()..]
                .iter()
                .all(|e| matches!(e, TimelineEvent::AfterEnd { .. }))
        );
        let mut unchanged = after.clone();
        unchanged.timeline = ended.timeline.clone();
        assert_eq!(unchanged, ended);
        Ok(())
    }

    /// A late call is noted once, though both its arrival and its end reach the
    /// tracker.
    #[tokio::test]
    async fn a_late_call_is_noted_once() -> TestResult {
        let tasks = tracker(None, Metrics::new())?;
        let id = task();
        tasks.touch(&id, "req-0", t(0));
        tasks.end(&id, TaskOutcome::Success, t(1)).await?;
        let call = tasks.arrived(&id, "req-m", false, t(2));
        tasks.model_call(&id, &model(t(3), true, false, false));
        drop(call);
        let after = tasks.get(&id, t(4)).ok_or("task lost")?.task;
        let late: Vec<&TimelineEvent> = after
            .timeline
            .iter()
            .filter(|e| matches!(e, TimelineEvent::AfterEnd { .. }))
            .collect();
        assert_eq!(late.len(), 1, "{:?}", after.timeline);
        Ok(())
    }

    /// With `max_tasks` tasks kept, a new one makes room: the task that ended
    /// longest ago goes first, then the open task idle longest; the store forgets
    /// them too, and a restart keeps no more than the cap.
    #[tokio::test(start_paused = true)]
    async fn the_tracker_keeps_at_most_max_tasks() -> TestResult {
        let j = TempJournal::open()?;
        let options = || TasksOptions {
            max_tasks: 3,
            ..TasksOptions::default()
        };
        let metrics = Metrics::new();
        let tasks = Tasks::open(
            options(),
            Some(j.journal.clone()),
            metrics.clone(),
            None,
            t(0),
        )?;
        let id = |n: &str| TaskId::new(format!("cap-{n}"));
        let step = Duration::from_secs(1);
        for (i, n) in ["a", "b", "c"].into_iter().enumerate() {
            tasks.touch(&id(n)?, "r", t(i as u64));
            tokio::time::advance(step).await;
        }
        tasks.end(&id("c")?, TaskOutcome::Success, t(3)).await?;
        tasks.end(&id("b")?, TaskOutcome::Success, t(4)).await?;
        tasks.persist().await?;
        // Full: the task that ended first (c) goes.
        tasks.touch(&id("d")?, "r", t(5));
        tokio::time::advance(step).await;
        // Then b, the only ended one left.
        tasks.touch(&id("e")?, "r", t(6));
        tokio::time::advance(step).await;
        // None ended: a, idle longest, goes (d and e came later).
        tasks.touch(&id("d")?, "r", t(7));
        tasks.touch(&id("f")?, "r", t(8));
        let mut kept: Vec<String> = tasks
            .list(t(9))
            .into_iter()
            .map(|s| s.id.to_string())
            .collect();
        kept.sort();
        assert_eq!(kept, ["cap-d", "cap-e", "cap-f"]);
        let forgotten =
            "outrigger_telemetry_dropped_total{signal=\"tasks\",reason=\"tracker_full\"}";
        let text = metrics.encode();
        assert!(text.contains(&format!("{forgotten} 3")), "{text}");
        assert!(matches!(
            tasks.end(&id("a")?, TaskOutcome::Success, t(9)).await,
            Err(Error::UnknownTask(_))
        ));
        tasks.persist().await?;
        let mut stored: Vec<String> = j
            .journal
            .kv_scan(NAMESPACE)?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        stored.sort();
        assert_eq!(stored, ["cap-d", "cap-e", "cap-f"]);

        // A smaller cap after a restart keeps the newest.
        let metrics = Metrics::new();
        let fewer = Tasks::open(
            TasksOptions {
                max_tasks: 2,
                ..options()
            },
            Some(j.journal.clone()),
            metrics.clone(),
            None,
            t(10),
        )?;
        let mut kept: Vec<String> = fewer
            .list(t(10))
            .into_iter()
            .map(|s| s.id.to_string())
            .collect();
        kept.sort();
        assert_eq!(kept, ["cap-d", "cap-f"], "e was active least recently");
        let text = metrics.encode();
        assert!(text.contains(&format!("{forgotten} 1")), "{text}");
        fewer.persist().await?;
        assert_eq!(j.journal.kv_scan(NAMESPACE)?.len(), 2, "e's copy is gone");
        Ok(())
    }

    /// A report lists a bounded part of a task's journal and says when there is
    /// more; a verdict reads a bounded part too, and then cannot call the recovery
    /// a success.
    #[tokio::test]
    async fn reports_and_verdicts_read_a_bounded_part_of_the_journal() -> TestResult {
        let j = TempJournal::open()?;
        let tasks = tracker(Some(j.journal.clone()), Metrics::new())?;
        let id = task();
        tasks.fault(&id, "req", FaultKind::ToolInDoubt, t(0));
        for i in 0..=SIDE_EFFECTS_CAP {
            tool_call(
                &j.journal,
                &format!("k{i}"),
                &format!("charge {i}"),
                ToolClass::Keyed,
                State::Completed,
            )
            .await?;
        }
        let report = tasks.get(&id, t(1)).ok_or("no task")?;
        assert_eq!(report.journal.len(), REPORT_JOURNAL_CAP);
        assert!(report.journal_capped);
        assert_eq!(report.journal[0].key.as_str(), "k0", "oldest first");

        let ended = tasks.end(&id, TaskOutcome::Success, t(2)).await?;
        let verdict = ended.task.recovery.ok_or("no verdict")?;
        let effects = verdict.side_effects.as_ref().ok_or("not checked")?;
        assert!(effects.capped);
        assert_eq!(effects.keys as usize, SIDE_EFFECTS_CAP);
        assert!(!verdict.succeeded, "{verdict:?}");
        assert!(verdict.reason.contains("not all"), "{}", verdict.reason);
        Ok(())
    }

    /// A persist that copied a task while it was open and wrote it after the task's
    /// end was saved must not bring the open copy back: the end is what the store
    /// keeps, and the next process does not reopen the task.
    #[tokio::test]
    async fn a_persist_racing_an_end_leaves_the_end_stored() -> TestResult {
        let j = TempJournal::open()?;
        let tasks = tracker(Some(j.journal.clone()), Metrics::new())?;
        let (a, b) = (TaskId::new("race-a")?, TaskId::new("race-b")?);
        tasks.touch(&a, "r1", t(0));
        tasks.touch(&b, "r2", t(0));
        let mut persist = std::pin::pin!(tasks.persist());
        // The persist starts writing one of the two changed tasks and waits on the
        // store, with its copies of both still open.
        std::future::poll_fn(|cx| {
            assert!(persist.as_mut().poll(cx).is_pending());
            std::task::Poll::Ready(())
        })
        .await;
        let (persisted, end_a, end_b) = tokio::join!(
            persist,
            tasks.end(&a, TaskOutcome::Success, t(5)),
            tasks.end(&b, TaskOutcome::Success, t(5)),
        );
        persisted?;
        end_a?;
        end_b?;
        for (key, bytes) in j.journal.kv_scan(NAMESPACE)? {
            let stored: Task = serde_json::from_slice(&bytes)?;
            assert!(stored.ended_at.is_some(), "{key} was stored open");
        }
        Ok(())
    }

    /// A sweep that forgets tasks past retention while a persist is writing copies
    /// of them waits for it, and deletes after it: no copy is written back once
    /// its task's stored copy is deleted.
    #[tokio::test]
    async fn a_sweep_racing_a_persist_leaves_no_expired_task_stored() -> TestResult {
        let j = TempJournal::open()?;
        let tasks = tracker(Some(j.journal.clone()), Metrics::new())?;
        let ids = [TaskId::new("old-a")?, TaskId::new("old-b")?];
        for id in &ids {
            tasks.touch(id, "r", t(0));
            tasks.end(id, TaskOutcome::Success, t(1)).await?;
        }
        // Their ends are saved and they are still to persist.
        let mut persist = std::pin::pin!(tasks.persist());
        std::future::poll_fn(|cx| {
            assert!(persist.as_mut().poll(cx).is_pending());
            std::task::Poll::Ready(())
        })
        .await;
        let long_after = t(10) + TasksOptions::default().retention;
        let mut sweep = std::pin::pin!(tasks.sweep(long_after, Duration::from_secs(60)));
        std::future::poll_fn(|cx| {
            assert!(sweep.as_mut().poll(cx).is_pending());
            std::task::Poll::Ready(())
        })
        .await;
        for id in &ids {
            assert!(
                tasks.get(id, long_after).is_some(),
                "{id} was forgotten while a persist was writing it"
            );
        }
        let (swept, persisted) = tokio::join!(sweep, persist);
        swept?;
        persisted?;
        for id in &ids {
            assert!(
                tasks.get(id, long_after).is_none(),
                "{id} is past retention"
            );
        }
        let stored = j.journal.kv_scan(NAMESPACE)?;
        assert!(stored.is_empty(), "{} tasks stored", stored.len());
        Ok(())
    }

    /// Trimming many stored tasks to the cap at start-up keeps the most recently
    /// active, whatever their ids: 20,000 stored tasks opened with a cap of 100 keep
    /// the 100 last active. The time bound is loose on purpose (a loaded test
    /// machine must not fail it): it catches a start-up that stalls, not the
    /// difference between one sort and a scan per task.
    #[tokio::test]
    async fn trimming_stored_tasks_at_start_up_keeps_the_most_recent() -> TestResult {
        let j = TempJournal::open()?;
        let many = Tasks::open(
            TasksOptions::default(),
            Some(j.journal.clone()),
            Metrics::new(),
            None,
            t(0),
        )?;
        // Ids in the reverse order of their activity.
        for i in 0..20_000u64 {
            many.touch(&TaskId::new(format!("bulk-{:05}", 20_000 - i))?, "r", t(i));
        }
        many.persist().await?;
        let started = std::time::Instant::now();
        let few = Tasks::open(
            TasksOptions {
                max_tasks: 100,
                ..TasksOptions::default()
            },
            Some(j.journal.clone()),
            Metrics::new(),
            None,
            t(30_000),
        )?;
        let took = started.elapsed();
        let kept = few.list(t(30_000));
        assert_eq!(kept.len(), 100);
        assert!(
            kept.iter().all(|s| s.id.as_str() <= "bulk-00100"),
            "the most recently active (the lowest ids) are kept"
        );
        assert!(took < Duration::from_secs(20), "{took:?}");
        Ok(())
    }

    /// A task reopened after a restart and then ended as idle ends no earlier than the
    /// restart's fault: its timeline never goes back in time.
    #[tokio::test(start_paused = true)]
    async fn an_idle_end_after_a_restart_comes_after_the_restart() -> TestResult {
        let j = TempJournal::open()?;
        let id = task();
        let before = tracker(Some(j.journal.clone()), Metrics::new())?;
        before.touch(&id, "r1", t(10));
        before.persist().await?;
        let after = Tasks::open(
            TasksOptions::default(),
            Some(j.journal.clone()),
            Metrics::new(),
            None,
            t(100),
        )?;
        tokio::time::advance(Duration::from_secs(31 * 60)).await;
        let ended = after
            .sweep(t(100 + 31 * 60), Duration::from_secs(30 * 60))
            .await?;
        let [report] = ended.as_slice() else {
            return Err(format!("expected one idle task, got {}", ended.len()).into());
        };
        assert_eq!(report.task.ended_at, Some(Timestamp::from_system(t(100))));
        let stamps: Vec<Timestamp> = report.task.timeline.iter().map(TimelineEvent::at).collect();
        assert!(stamps.windows(2).all(|w| w[0] <= w[1]), "{stamps:?}");
        Ok(())
    }

    #[test]
    fn prices_prefer_the_model_then_the_provider() {
        let mut prices = Prices::default();
        prices.set("openai", None, 1_000_000, 2_000_000);
        prices.set("openai", Some("gpt-4o-mini"), 150_000, 600_000);
        assert_eq!(
            prices.cost("openai", "gpt-4o", 1_000_000, 1_000_000),
            3_000_000
        );
        assert_eq!(prices.cost("openai", "gpt-4o-mini", 1_000_000, 0), 150_000);
        assert_eq!(prices.cost("anthropic", "x", 1_000_000, 1_000_000), 0);
    }
}
