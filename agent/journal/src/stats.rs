use std::sync::atomic::{AtomicI64, AtomicU8, AtomicU64, AtomicUsize, Ordering};

use serde::Serialize;
use tokio::sync::watch;

use crate::record::State;

/// A fault injected into the writer (tests and drills): every group commit fails and
/// its waiters get `Error::Unavailable`, as on a full or failing disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteFault {
    /// The batch is refused before anything is applied.
    FailApply,
    /// The batch is applied in memory, then the flush fails: the writer rolls the
    /// batch back so that nobody reads what was never made durable.
    FailFlush,
}

/// How many records are in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StateCounts {
    pub claimed: u64,
    pub dispatched: u64,
    pub completed: u64,
    pub failed_before_send: u64,
    pub in_doubt: u64,
    pub reconciling: u64,
    pub needs_operator: u64,
    pub tombstone: u64,
}

impl StateCounts {
    pub fn get(&self, state: State) -> u64 {
        match state {
            State::Claimed => self.claimed,
            State::Dispatched => self.dispatched,
            State::Completed => self.completed,
            State::FailedBeforeSend => self.failed_before_send,
            State::InDoubt => self.in_doubt,
            State::Reconciling => self.reconciling,
            State::NeedsOperator => self.needs_operator,
            State::Tombstone => self.tombstone,
        }
    }
}

/// Counters since the journal was opened (state counts are totals over the journal).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Stats {
    pub epoch: u64,
    /// Record versions made durable (each begin, dispatch, outcome, resolution, expiry).
    pub records_written: u64,
    pub stream_events: u64,
    pub kv_writes: u64,
    /// Group commits applied.
    pub batches: u64,
    /// Of `batches`, those whose sled inserts were handed to the applier thread (the
    /// writer had other commands at hand); the rest were applied on the writer's own.
    pub handoffs: u64,
    /// Flushes the writer performed (sled's own 500 ms background flush not counted).
    pub flushes: u64,
    pub flush_errors: u64,
    /// Whether writes are failing: a commit or flush failed, and no write made since
    /// has been made durable.
    pub failing: bool,
    /// Requests answered from the journal instead of executed.
    pub replays: u64,
    pub states: StateCounts,
    pub size_on_disk: u64,
}

impl Stats {
    /// Flushes per durable record write: 1.0 means no group commit happened, lower
    /// means concurrent writers shared flushes.
    pub fn flushes_per_record(&self) -> f64 {
        if self.records_written == 0 {
            return 0.0;
        }
        self.flushes as f64 / self.records_written as f64
    }
}

/// State the writer and the handles share.
pub(crate) struct Shared {
    pub(crate) epoch: u64,
    pub(crate) records_written: AtomicU64,
    pub(crate) stream_events: AtomicU64,
    pub(crate) kv_writes: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) handoffs: AtomicU64,
    pub(crate) flushes: AtomicU64,
    flush_errors: AtomicU64,
    /// `flush_errors` as it was when a write was logged that has since been made
    /// durable: writes are failing while `flush_errors` is past it. A flush that only
    /// made writes from before the last failure durable moves it nowhere, so a
    /// failing disk is not reported healthy by the flush of what it took earlier.
    healthy_at: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) states: [AtomicI64; 8],
    fault: AtomicU8,
    /// Bumped after every commit, so waiters re-check the keys they wait for.
    pub(crate) commits: watch::Sender<u64>,
    /// How many stream attempts the writer refuses writes to; while any, every
    /// stream's start is decided by the writer (see [`crate::claims`]).
    pub(crate) broken_attempts: AtomicUsize,
}

impl Shared {
    pub(crate) fn new(epoch: u64, states: [i64; 8]) -> Self {
        Self {
            epoch,
            records_written: AtomicU64::new(0),
            stream_events: AtomicU64::new(0),
            kv_writes: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            handoffs: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            flush_errors: AtomicU64::new(0),
            healthy_at: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            states: states.map(AtomicI64::new),
            fault: AtomicU8::new(0),
            commits: watch::Sender::new(0),
            broken_attempts: AtomicUsize::new(0),
        }
    }

    /// Counts a failed commit, flush or apply: writes are failing from now on.
    pub(crate) fn flush_failed(&self) {
        self.flush_errors.fetch_add(1, Ordering::AcqRel);
    }

    /// The failures counted so far; read before a batch is logged, and handed to
    /// [`Shared::made_durable`] once it is durable.
    pub(crate) fn flush_errors(&self) -> u64 {
        self.flush_errors.load(Ordering::Acquire)
    }

    /// Notes that writes logged when `flush_errors` was `errors` are now durable:
    /// writes are healthy again unless a failure was counted since.
    pub(crate) fn made_durable(&self, errors: u64) {
        self.healthy_at.fetch_max(errors, Ordering::AcqRel);
    }

    /// Whether a failure was counted after the last write that was made durable.
    pub(crate) fn failing(&self) -> bool {
        self.flush_errors.load(Ordering::Acquire) > self.healthy_at.load(Ordering::Acquire)
    }

    pub(crate) fn fault(&self) -> Option<WriteFault> {
        match self.fault.load(Ordering::Acquire) {
            1 => Some(WriteFault::FailApply),
            2 => Some(WriteFault::FailFlush),
            _ => None,
        }
    }

    pub(crate) fn set_fault(&self, fault: Option<WriteFault>) {
        let code = match fault {
            None => 0,
            Some(WriteFault::FailApply) => 1,
            Some(WriteFault::FailFlush) => 2,
        };
        self.fault.store(code, Ordering::Release);
    }

    pub(crate) fn snapshot(&self, size_on_disk: u64) -> Stats {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let state =
            |s: State| u64::try_from(self.states[s.index()].load(Ordering::Relaxed)).unwrap_or(0);
        Stats {
            epoch: self.epoch,
            records_written: load(&self.records_written),
            stream_events: load(&self.stream_events),
            kv_writes: load(&self.kv_writes),
            batches: load(&self.batches),
            handoffs: load(&self.handoffs),
            flushes: load(&self.flushes),
            flush_errors: load(&self.flush_errors),
            failing: self.failing(),
            replays: load(&self.replays),
            states: StateCounts {
                claimed: state(State::Claimed),
                dispatched: state(State::Dispatched),
                completed: state(State::Completed),
                failed_before_send: state(State::FailedBeforeSend),
                in_doubt: state(State::InDoubt),
                reconciling: state(State::Reconciling),
                needs_operator: state(State::NeedsOperator),
                tombstone: state(State::Tombstone),
            },
            size_on_disk,
        }
    }
}
