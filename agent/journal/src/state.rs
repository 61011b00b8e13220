//! The pure state machine of one idempotency key (durability.md §6.2 and §6.5).
//!
//! `apply` takes the current record and an event and returns the next record plus the
//! effect: what the caller must do, and whether the record changed (only then is it
//! written). It performs no I/O and reads no clock, so every cell of the reference
//! tables is a table row below.

use std::time::SystemTime;

use outrigger_types::{IdempotencyKey, RequestId, ToolClass};

use crate::Error;
use crate::record::{
    Attempt, Intent, RECORD_VERSION, Record, Resolution, ResolutionEntry, State, StatusMeaning,
    StoredResponse, Ticket, Transition,
};
use crate::time::Timestamp;

/// Something that happens to a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A request arrived (`Journal::begin`).
    Begin { intent: Box<Intent>, epoch: u64 },
    /// An unsafe tool's request is about to leave (its second durable write).
    Dispatched { ticket: Ticket },
    /// The tool answered; the status decides what the answer means.
    Responded {
        ticket: Ticket,
        response: StoredResponse,
    },
    /// The attempt provably never reached the tool.
    FailedBeforeSend { ticket: Ticket, reason: String },
    /// The request may have reached the tool and no answer came.
    InDoubt { ticket: Ticket, cause: String },
    /// A probe tool answered whether the in-doubt call took effect.
    Reconciled {
        ticket: Ticket,
        found: Option<StoredResponse>,
    },
    /// An operator resolved an in-doubt call.
    Resolve {
        key: IdempotencyKey,
        resolution: Resolution,
        actor: String,
        reason: String,
    },
    /// The journal was reopened by a new process (epoch).
    Restart { epoch: u64 },
    /// Retention passed.
    Expire,
}

/// What applying an event asks of the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Send the request under this ticket. `dispatch_write`: the attempt rests at
    /// `claimed` (the record's class is `unsafe`), and its `Dispatched` must be
    /// durable before the send.
    Execute {
        ticket: Ticket,
        resend: bool,
        dispatch_write: bool,
    },
    /// Probe the tool under this ticket, then report `Reconciled`.
    Probe { ticket: Ticket },
    /// Answer from the stored response.
    Replay,
    /// Another attempt owns the key.
    InFlight,
    /// Same key, different fingerprint.
    Mismatch,
    /// In doubt and must not be re-sent.
    OutcomeUnknown,
    /// Only a tombstone remains.
    Tombstoned,
    /// The record changed; nothing else to do.
    Recorded,
    /// The event was already applied (or asks for nothing): the record is unchanged.
    Unchanged,
}

impl Effect {
    /// Whether the returned record differs from the current one and must be written.
    pub fn writes(&self) -> bool {
        matches!(
            self,
            Effect::Execute { .. } | Effect::Probe { .. } | Effect::Recorded
        )
    }
}

/// Applies `event` to the record of a key (`None`: the key is unknown).
pub fn apply(
    current: Option<&Record>,
    event: Event,
    now: SystemTime,
) -> Result<(Record, Effect), Error> {
    let now = Timestamp::from_system(now);
    let Some(current) = current else {
        return match event {
            Event::Begin { intent, epoch } => Ok(create(*intent, epoch, now)),
            Event::Dispatched { ticket }
            | Event::Responded { ticket, .. }
            | Event::FailedBeforeSend { ticket, .. }
            | Event::InDoubt { ticket, .. }
            | Event::Reconciled { ticket, .. } => Err(Error::UnknownKey(ticket.key().clone())),
            Event::Resolve { key, .. } => Err(Error::UnknownKey(key)),
            Event::Restart { .. } | Event::Expire => Err(Error::Invalid {
                what: "event",
                detail: "restart and expiry apply to existing records only".to_owned(),
            }),
        };
    };
    let mut rec = current.clone();
    let effect = match event {
        Event::Begin { intent, epoch } => begin(&mut rec, *intent, epoch, now),
        Event::Dispatched { ticket } => {
            check_ticket(&rec, &ticket)?;
            match rec.state {
                State::Claimed => {
                    let note = format!("attempt {} dispatched", rec.attempt);
                    dispatch(&mut rec, now, note);
                    Effect::Recorded
                }
                State::Dispatched => Effect::Unchanged,
                _ => return Err(stale(&rec, &ticket)),
            }
        }
        Event::Responded {
            ticket,
            mut response,
        } => {
            check_ticket(&rec, &ticket)?;
            response.scrub();
            let status = response.status;
            match (StatusMeaning::of(status), rec.state) {
                (
                    StatusMeaning::Definitive,
                    State::Claimed
                    | State::Dispatched
                    | State::InDoubt
                    | State::Reconciling
                    | State::NeedsOperator,
                ) => {
                    let note = if rec.state == State::Dispatched || rec.state == State::Claimed {
                        format!("status {status}")
                    } else {
                        format!("late reply: status {status}")
                    };
                    complete(&mut rec, response, now, note);
                    Effect::Recorded
                }
                (StatusMeaning::Definitive, State::Completed) => Effect::Unchanged,
                // Told again about a re-send that did not apply, while an earlier
                // attempt keeps the key in doubt: already recorded.
                (StatusMeaning::NotApplied, State::InDoubt) if current_not_applied(&rec) => {
                    Effect::Unchanged
                }
                (
                    StatusMeaning::NotApplied,
                    State::Claimed
                    | State::Dispatched
                    | State::InDoubt
                    | State::Reconciling
                    | State::NeedsOperator,
                ) => {
                    failed_before_send(
                        &mut rec,
                        now,
                        format!("status {status}: the tool did not apply the request"),
                    );
                    Effect::Recorded
                }
                (StatusMeaning::NotApplied, State::FailedBeforeSend) => Effect::Unchanged,
                (StatusMeaning::Ambiguous, State::Claimed | State::Dispatched) => {
                    in_doubt(&mut rec, now, &format!("status {status}"));
                    Effect::Recorded
                }
                (
                    StatusMeaning::Ambiguous,
                    State::InDoubt | State::NeedsOperator | State::Reconciling,
                ) => Effect::Unchanged,
                _ => return Err(stale(&rec, &ticket)),
            }
        }
        Event::FailedBeforeSend { ticket, reason } => {
            check_ticket(&rec, &ticket)?;
            match rec.state {
                State::Claimed | State::Dispatched => {
                    failed_before_send(&mut rec, now, reason);
                    Effect::Recorded
                }
                State::FailedBeforeSend => Effect::Unchanged,
                _ => return Err(stale(&rec, &ticket)),
            }
        }
        Event::InDoubt { ticket, cause } => {
            check_ticket(&rec, &ticket)?;
            match rec.state {
                State::Claimed | State::Dispatched | State::Reconciling => {
                    in_doubt(&mut rec, now, &cause);
                    Effect::Recorded
                }
                State::InDoubt | State::NeedsOperator => Effect::Unchanged,
                _ => return Err(stale(&rec, &ticket)),
            }
        }
        Event::Reconciled { ticket, found } => {
            check_ticket(&rec, &ticket)?;
            match (rec.state, found) {
                (State::Reconciling, Some(mut response)) => {
                    response.scrub();
                    let note = format!("reconciled: the probe found status {}", response.status);
                    complete(&mut rec, response, now, note);
                    Effect::Recorded
                }
                (State::Reconciling, None) => {
                    // The probe asks by the downstream key, which every attempt sent.
                    clear_doubt(&mut rec, "reconciled: the probe found no effect");
                    end_attempt(&mut rec, now, "reconciled: the probe found no effect");
                    let request_id = rec
                        .attempts
                        .last()
                        .map(|a| a.request_id.clone())
                        .unwrap_or_else(|| rec.request_id.clone());
                    new_attempt(
                        &mut rec,
                        request_id,
                        ticket.epoch(),
                        now,
                        "re-send: the probe found no effect",
                    )
                }
                (State::Completed, Some(_)) => Effect::Unchanged,
                _ => return Err(stale(&rec, &ticket)),
            }
        }
        Event::Resolve {
            key: _,
            resolution,
            actor,
            reason,
        } => {
            resolve(&mut rec, resolution, actor, reason, now)?;
            Effect::Recorded
        }
        Event::Restart { epoch: _ } => match rec.state {
            State::Claimed => {
                failed_before_send(
                    &mut rec,
                    now,
                    "restart: the intent was claimed but never dispatched".to_owned(),
                );
                Effect::Recorded
            }
            State::Dispatched => {
                in_doubt(&mut rec, now, "restart: dispatched, no outcome recorded");
                Effect::Recorded
            }
            State::Reconciling => {
                in_doubt(&mut rec, now, "restart during reconciliation");
                Effect::Recorded
            }
            State::InDoubt if rec.class == ToolClass::Unsafe => {
                park(&mut rec, now);
                Effect::Recorded
            }
            _ => Effect::Unchanged,
        },
        Event::Expire => match rec.state {
            State::Completed | State::FailedBeforeSend => {
                tombstone(&mut rec, now);
                Effect::Recorded
            }
            _ => Effect::Unchanged,
        },
    };
    Ok((rec, effect))
}

fn create(mut intent: Intent, epoch: u64, now: Timestamp) -> (Record, Effect) {
    intent.request.scrub();
    let mut rec = Record {
        v: RECORD_VERSION,
        key: intent.key,
        state: State::Claimed,
        fingerprint: intent.fingerprint,
        tool: intent.tool,
        class: intent.class,
        method: intent.method,
        target: intent.target,
        task_id: intent.task_id,
        request_id: intent.request_id.clone(),
        downstream_key: intent.downstream_key,
        derived_from: intent.derived_from,
        policy_versions: intent.policy_versions,
        model_revision: intent.model_revision,
        epoch,
        created_at: now,
        updated_at: now,
        attempt: 1,
        attempts: vec![Attempt {
            n: 1,
            request_id: intent.request_id,
            claimed_at: now,
            dispatched_at: None,
            ended_at: None,
            outcome: None,
        }],
        history: Vec::new(),
        resolutions: Vec::new(),
        request: Some(intent.request),
        response: None,
        final_status: None,
        body_digest: None,
        log_seq: 0,
    };
    set_state(&mut rec, State::Claimed, now, "intent recorded".to_owned());
    if rec.class != ToolClass::Unsafe {
        dispatch(&mut rec, now, "attempt 1 dispatched".to_owned());
    }
    let ticket = Ticket::new(rec.key.clone(), 1, epoch);
    let dispatch_write = rec.state == State::Claimed;
    (
        rec,
        Effect::Execute {
            ticket,
            resend: false,
            dispatch_write,
        },
    )
}

fn begin(rec: &mut Record, intent: Intent, epoch: u64, now: Timestamp) -> Effect {
    if rec.fingerprint != intent.fingerprint {
        return Effect::Mismatch;
    }
    match rec.state {
        State::Claimed | State::Dispatched | State::Reconciling => Effect::InFlight,
        State::Completed => Effect::Replay,
        State::Tombstone => Effect::Tombstoned,
        State::NeedsOperator => Effect::OutcomeUnknown,
        State::FailedBeforeSend => {
            merge_policy_versions(rec, &intent);
            new_attempt(
                rec,
                intent.request_id,
                epoch,
                now,
                "new attempt: the previous one did not take effect",
            )
        }
        State::InDoubt => match rec.class {
            ToolClass::Keyed | ToolClass::Idempotent => {
                merge_policy_versions(rec, &intent);
                new_attempt(
                    rec,
                    intent.request_id,
                    epoch,
                    now,
                    "re-send with the same downstream key after in doubt",
                )
            }
            ToolClass::Probe => {
                rec.epoch = epoch;
                set_state(
                    rec,
                    State::Reconciling,
                    now,
                    format!("probing attempt {} by downstream key", rec.attempt),
                );
                Effect::Probe {
                    ticket: Ticket::new(rec.key.clone(), rec.attempt, epoch),
                }
            }
            ToolClass::Unsafe => Effect::OutcomeUnknown,
        },
    }
}

fn merge_policy_versions(rec: &mut Record, intent: &Intent) {
    for v in &intent.policy_versions {
        if !rec.policy_versions.contains(v) {
            rec.policy_versions.push(v.clone());
        }
    }
    if intent.model_revision.is_some() {
        rec.model_revision.clone_from(&intent.model_revision);
    }
}

/// Starts attempt n+1. Unsafe tools stop at CLAIMED (their dispatch is a second write
/// right before the send); every other class is dispatched in the same write.
fn new_attempt(
    rec: &mut Record,
    request_id: RequestId,
    epoch: u64,
    now: Timestamp,
    why: &str,
) -> Effect {
    let resend = rec.state != State::FailedBeforeSend;
    rec.attempt += 1;
    rec.epoch = epoch;
    rec.attempts.push(Attempt {
        n: rec.attempt,
        request_id,
        claimed_at: now,
        dispatched_at: None,
        ended_at: None,
        outcome: None,
    });
    let n = rec.attempt;
    if rec.class == ToolClass::Unsafe {
        set_state(
            rec,
            State::Claimed,
            now,
            format!("attempt {n} claimed: {why}"),
        );
    } else {
        dispatch(rec, now, format!("attempt {n} dispatched: {why}"));
    }
    Effect::Execute {
        ticket: Ticket::new(rec.key.clone(), n, epoch),
        resend,
        dispatch_write: rec.state == State::Claimed,
    }
}

/// How an attempt's `outcome` starts when it ended in doubt, and when it did not
/// take effect.
const IN_DOUBT: &str = "in doubt: ";
const NOT_APPLIED: &str = "not applied: ";

/// The current attempt has ended as not applied.
fn current_not_applied(rec: &Record) -> bool {
    rec.current_attempt()
        .and_then(|a| a.outcome.as_deref())
        .is_some_and(|o| o.starts_with(NOT_APPLIED))
}

fn ended_in_doubt(a: &Attempt) -> bool {
    a.outcome
        .as_deref()
        .is_some_and(|o| o.starts_with(IN_DOUBT))
}

fn set_state(rec: &mut Record, state: State, now: Timestamp, note: String) {
    rec.state = state;
    rec.updated_at = now;
    rec.history.push(Transition {
        at: now,
        state,
        note,
    });
    bound(rec);
}

/// The most attempts and transitions one record keeps. A key retried for hours
/// (a tool that keeps answering 429) would otherwise grow its record, which is
/// written whole at every change, without end.
const KEPT_ATTEMPTS: usize = 64;
const KEPT_TRANSITIONS: usize = 128;
/// The note of the transition that stands for those dropped.
const DROPPED: &str = "earlier transitions dropped to keep the record bounded";

/// Keeps a record within [`KEPT_ATTEMPTS`] and [`KEPT_TRANSITIONS`]: the first
/// attempt, every attempt still in doubt and the newest stay; so do the first
/// transition and the newest, with one standing for those dropped between.
fn bound(rec: &mut Record) {
    while rec.attempts.len() > KEPT_ATTEMPTS {
        let last = rec.attempts.len() - 1;
        let Some(i) = (1..last).find(|&i| !ended_in_doubt(&rec.attempts[i])) else {
            break;
        };
        rec.attempts.remove(i);
    }
    if rec.history.len() > KEPT_TRANSITIONS {
        let excess = rec.history.len() - KEPT_TRANSITIONS;
        let marked = rec.history.get(1).is_some_and(|t| t.note == DROPPED);
        if marked {
            rec.history.drain(2..2 + excess);
        } else {
            let first = rec.history.drain(1..2 + excess).next();
            if let Some(first) = first {
                rec.history.insert(
                    1,
                    Transition {
                        note: DROPPED.to_owned(),
                        ..first
                    },
                );
            }
        }
    }
}

fn dispatch(rec: &mut Record, now: Timestamp, note: String) {
    if let Some(a) = rec.current_attempt_mut() {
        a.dispatched_at = Some(now);
    }
    set_state(rec, State::Dispatched, now, note);
}

fn end_attempt(rec: &mut Record, now: Timestamp, outcome: &str) {
    if let Some(a) = rec.current_attempt_mut() {
        if a.ended_at.is_none() {
            a.ended_at = Some(now);
        }
        a.outcome = Some(outcome.to_owned());
    }
}

fn complete(rec: &mut Record, response: StoredResponse, now: Timestamp, note: String) {
    end_attempt(rec, now, &format!("completed: status {}", response.status));
    rec.final_status = Some(response.status);
    rec.body_digest = Some(response.body.digest_hex());
    rec.response = Some(response);
    set_state(rec, State::Completed, now, note);
}

/// The current attempt did not take effect. When an earlier attempt is still in
/// doubt (this one was its re-send), the key stays in doubt: that attempt may have
/// executed, and only a probe, an operator or the tool's answer can say otherwise.
fn failed_before_send(rec: &mut Record, now: Timestamp, reason: String) {
    end_attempt(rec, now, &format!("{NOT_APPLIED}{reason}"));
    match rec
        .attempts
        .iter()
        .rev()
        .skip(1)
        .find(|a| ended_in_doubt(a))
    {
        Some(earlier) => {
            let note = format!("{reason}; attempt {} is still in doubt", earlier.n);
            set_state(rec, State::InDoubt, now, note);
        }
        None => set_state(rec, State::FailedBeforeSend, now, reason),
    }
}

/// Marks every attempt still in doubt as not applied (a probe found no effect of
/// the downstream key, or an operator said the call did not take effect).
fn clear_doubt(rec: &mut Record, why: &str) {
    for a in rec.attempts.iter_mut().filter(|a| ended_in_doubt(a)) {
        let was = a.outcome.take().unwrap_or_default();
        a.outcome = Some(format!("{NOT_APPLIED}{why} (was {was})"));
    }
}

fn in_doubt(rec: &mut Record, now: Timestamp, cause: &str) {
    end_attempt(rec, now, &format!("{IN_DOUBT}{cause}"));
    set_state(rec, State::InDoubt, now, cause.to_owned());
    if rec.class == ToolClass::Unsafe {
        park(rec, now);
    }
}

fn park(rec: &mut Record, now: Timestamp) {
    set_state(
        rec,
        State::NeedsOperator,
        now,
        "unsafe tool: never re-sent automatically; resolve it through the admin API".to_owned(),
    );
}

fn resolve(
    rec: &mut Record,
    resolution: Resolution,
    actor: String,
    reason: String,
    now: Timestamp,
) -> Result<(), Error> {
    // Not while a probe runs: what it finds (the call did happen) would be lost to
    // a `retry`, and the call run again. A probe ends within the tool's timeout.
    if !matches!(rec.state, State::InDoubt | State::NeedsOperator) {
        return Err(Error::NotResolvable {
            key: rec.key.clone(),
            state: rec.state,
        });
    }
    if actor.trim().is_empty() {
        return Err(Error::InvalidResolution(
            "the actor is empty; say who resolves the call".to_owned(),
        ));
    }
    match &resolution {
        Resolution::MarkSucceeded(r) if !(200..300).contains(&r.status) => {
            return Err(Error::InvalidResolution(format!(
                "mark_succeeded needs a 2xx response, got {}",
                r.status
            )));
        }
        Resolution::MarkFailed(r) if !(400..600).contains(&r.status) => {
            return Err(Error::InvalidResolution(format!(
                "mark_failed needs a 4xx or 5xx response (400-599), got {}",
                r.status
            )));
        }
        Resolution::MarkSucceeded(_) | Resolution::MarkFailed(_) | Resolution::Retry => {}
    }
    let action = resolution.as_str();
    rec.resolutions.push(ResolutionEntry {
        at: now,
        actor: actor.clone(),
        reason: reason.clone(),
        action: action.to_owned(),
        from_state: rec.state,
    });
    let note = format!("resolved by {actor}: {action} ({reason})");
    match resolution {
        Resolution::MarkSucceeded(mut response) | Resolution::MarkFailed(mut response) => {
            response.scrub();
            complete(rec, response, now, note);
        }
        Resolution::Retry => {
            clear_doubt(rec, &note);
            failed_before_send(rec, now, note);
        }
    }
    Ok(())
}

fn tombstone(rec: &mut Record, now: Timestamp) {
    rec.request = None;
    rec.response = None;
    rec.method.clear();
    rec.target.clear();
    rec.downstream_key.clear();
    rec.policy_versions.clear();
    rec.model_revision = None;
    rec.attempts.clear();
    rec.resolutions.clear();
    rec.history.clear();
    set_state(
        rec,
        State::Tombstone,
        now,
        "retention passed: key, fingerprint, final status and body digest kept".to_owned(),
    );
}

fn check_ticket(rec: &Record, ticket: &Ticket) -> Result<(), Error> {
    if ticket.key() != &rec.key {
        return Err(Error::Invalid {
            what: "ticket",
            detail: format!("ticket for {} applied to {}", ticket.key(), rec.key),
        });
    }
    if ticket.attempt() == rec.attempt && ticket.epoch() == rec.epoch {
        Ok(())
    } else {
        Err(stale(rec, ticket))
    }
}

fn stale(rec: &Record, ticket: &Ticket) -> Error {
    Error::Stale {
        key: rec.key.clone(),
        attempt: ticket.attempt(),
        state: rec.state,
        current: rec.attempt,
    }
}

#[cfg(test)]
mod tests;
