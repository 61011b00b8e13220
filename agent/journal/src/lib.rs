//! The side-effect journal: the reason a tool call is never performed twice because
//! of a retry, a crash or a restarted agent, and the record an operator reads after an
//! incident.
//!
//! Invariants:
//! - **Intent before effect.** `begin` returns `Execute` only once the intent (and,
//!   except for unsafe tools, the dispatch) is durable; an unsafe tool's `dispatched`
//!   write is durable before its send. If the journal cannot write, every waiter gets
//!   [`Error::Unavailable`] and nothing is executed (fail closed).
//! - **Outcome before release.** `complete` returns once the outcome is durable, and a
//!   replayed answer is only handed out once what it read is durable.
//! - **One decision-maker per key.** A single [`Writer`] task applies every change
//!   through the pure state machine in `state`, so concurrent requests with one key
//!   get exactly one `Execute`; writes that queue while a flush runs share the next
//!   flush (group commit), one atomic batch per commit.
//! - **In doubt is explicit.** A call that may have reached the tool without an
//!   answer is `in_doubt`; its tool class decides: keyed and idempotent tools are
//!   re-sent with the same downstream key, probe tools are asked first, unsafe tools
//!   wait for an operator (`needs_operator`). A restart (new epoch) turns dispatched
//!   calls into in-doubt ones and claimed-but-unsent ones into `failed_before_send`.
//! - **Tamper-evident.** Every commit that changes records appends one entry to a
//!   hash-chained log, listing each change (key, new state or purge, digest of the
//!   stored record); [`Journal::verify`] names edited and deleted entries and records,
//!   and legitimate expiry is logged, so it is not reported.
//! - **Secrets never land.** Credential headers are dropped again here even though
//!   the proxy redacts first: an append-only log cannot take a leaked secret back.
//! - **Only `store.rs` names sled**; nothing sled-typed is public, so the engine can
//!   be replaced (durability.md §8.2.7).
//!
//! Shaped like a restate component: [`Options`], a service ([`Writer`]), a cloneable
//! handle ([`Journal`]) and one [`Error`]. Reads (`get`, `list`, `verify`, streams, kv)
//! go straight to the store (waiting only until sled has the commits already logged)
//! and never queue behind the writer; an offline [`Audit`]
//! offers the same reads on a private copy of a journal directory no process holds,
//! so that reading never changes what an operator reviews.

mod audit;
mod bodies;
mod chain;
mod claims;
mod error;
mod journal;
mod options;
mod record;
mod slots;
mod state;
mod stats;
mod store;
mod stream;
#[cfg(test)]
mod tamper_tests;
mod time;
mod writer;

pub use audit::{Audit, Cursor, Page};
pub use chain::{Change, LogEntry, Problem, VerifyReport};
pub use error::{Corruption, Error};
pub use journal::{Journal, Recovery};
pub use options::{Durability, Options};
pub use record::{
    Attempt, Begin, Body, Filter, Headers, Intent, KeySource, RECORD_VERSION, Record,
    RedactedRequest, Resolution, ResolutionEntry, State, StatusMeaning, StoredResponse, Ticket,
    TimelineEntry, Transition,
};
pub use stats::{StateCounts, Stats, WriteFault};
pub use store::WalDamage;
pub use stream::{StreamBegin, StreamEnd, StreamKey, StreamMeta, StreamRequest, StreamState};
pub use time::Timestamp;
pub use writer::{ReapReport, Writer};
