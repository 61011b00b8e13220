//! One row per cell of durability.md §6.5 and per transition of §6.2.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outrigger_types::{Fingerprint, IdempotencyKey, PolicyVersion, RequestId, ToolClass};
use proptest::prelude::*;

use super::{Effect, Event, apply};
use crate::Error;
use crate::record::{
    Body, Headers, Intent, KeySource, Record, RedactedRequest, Resolution, State, StoredResponse,
    Ticket,
};

const EPOCH: u64 = 7;

fn key() -> IdempotencyKey {
    IdempotencyKey::new("k-1").unwrap_or_else(|e| panic!("{e}"))
}

fn intent(class: ToolClass, fp: u8) -> Intent {
    Intent {
        key: key(),
        fingerprint: Fingerprint([fp; 32]),
        tool: "payments".to_owned(),
        class,
        method: "POST".to_owned(),
        target: "http://127.0.0.1:9/charge".to_owned(),
        task_id: None,
        request_id: RequestId::from_generated("req-1".to_owned()),
        downstream_key: "down-1".to_owned(),
        request: RedactedRequest::new(
            Headers::redacted([
                ("authorization".to_owned(), "Bearer secret".to_owned()),
                ("content-type".to_owned(), "application/json".to_owned()),
            ]),
            Body::from("{\"amount\":1}"),
        ),
        policy_versions: vec![PolicyVersion::host_default("retry")],
        model_revision: None,
        derived_from: KeySource::Header,
    }
}

fn response(status: u16) -> StoredResponse {
    StoredResponse::new(status, Headers::default(), Body::from("{\"ok\":true}"))
}

/// One step of a script; ticket-carrying steps use the latest ticket the journal issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Begin,
    BeginOther,
    Dispatched,
    Respond(u16),
    FailPre,
    Doubt,
    Found(u16),
    NotFound,
    Succeeded,
    Failed(u16),
    Retry,
    Restart,
    Expire,
    /// Responds with the ticket of the previous attempt.
    StaleRespond,
}

struct Driver {
    class: ToolClass,
    record: Option<Record>,
    ticket: Option<Ticket>,
    clock: u64,
}

impl Driver {
    fn new(class: ToolClass) -> Self {
        Self {
            class,
            record: None,
            ticket: None,
            clock: 1_000,
        }
    }

    fn event(&self, step: Step) -> Event {
        let ticket = self
            .ticket
            .clone()
            .unwrap_or_else(|| Ticket::new(key(), 1, EPOCH));
        let resolve = |resolution| Event::Resolve {
            key: key(),
            resolution,
            actor: "ops@example".to_owned(),
            reason: "checked the ledger".to_owned(),
        };
        match step {
            Step::Begin => Event::Begin {
                intent: Box::new(intent(self.class, 1)),
                epoch: EPOCH,
            },
            Step::BeginOther => Event::Begin {
                intent: Box::new(intent(self.class, 2)),
                epoch: EPOCH,
            },
            Step::Dispatched => Event::Dispatched { ticket },
            Step::Respond(status) => Event::Responded {
                ticket,
                response: response(status),
            },
            Step::FailPre => Event::FailedBeforeSend {
                ticket,
                reason: "connection refused".to_owned(),
            },
            Step::Doubt => Event::InDoubt {
                ticket,
                cause: "timeout".to_owned(),
            },
            Step::Found(status) => Event::Reconciled {
                ticket,
                found: Some(response(status)),
            },
            Step::NotFound => Event::Reconciled {
                ticket,
                found: None,
            },
            Step::Succeeded => resolve(Resolution::MarkSucceeded(response(200))),
            Step::Failed(status) => resolve(Resolution::MarkFailed(response(status))),
            Step::Retry => resolve(Resolution::Retry),
            Step::Restart => Event::Restart { epoch: EPOCH + 1 },
            Step::Expire => Event::Expire,
            Step::StaleRespond => Event::Responded {
                ticket: Ticket::new(key(), ticket.attempt().saturating_sub(1), ticket.epoch()),
                response: response(200),
            },
        }
    }

    fn now(&mut self) -> SystemTime {
        self.clock += 1;
        UNIX_EPOCH + Duration::from_secs(self.clock)
    }

    fn step(&mut self, step: Step) -> Result<Effect, Error> {
        let event = self.event(step);
        let now = self.now();
        let (record, effect) = apply(self.record.as_ref(), event, now)?;
        if let Effect::Execute { ticket, .. } | Effect::Probe { ticket } = &effect {
            self.ticket = Some(ticket.clone());
        }
        self.record = Some(record);
        Ok(effect)
    }

    fn run(&mut self, steps: &[Step]) -> Result<Effect, Error> {
        let mut last = Effect::Unchanged;
        for step in steps {
            last = self.step(*step)?;
        }
        Ok(last)
    }
}

/// The effect's name, for table comparison (tickets are checked separately).
fn name(effect: &Effect) -> &'static str {
    match effect {
        Effect::Execute { resend: false, .. } => "execute",
        Effect::Execute { resend: true, .. } => "execute(resend)",
        Effect::Probe { .. } => "probe",
        Effect::Replay => "replay",
        Effect::InFlight => "in_flight",
        Effect::Mismatch => "mismatch",
        Effect::OutcomeUnknown => "outcome_unknown",
        Effect::Tombstoned => "tombstoned",
        Effect::Recorded => "recorded",
        Effect::Unchanged => "unchanged",
    }
}

use Step::*;
use ToolClass::{Idempotent, Keyed, Probe, Unsafe};

/// durability.md §6.5: (class, steps to reach the state, state reached, answer to the
/// same request, answer to a different request).
#[test]
fn responses_per_state() {
    let rows: &[(ToolClass, &[Step], Option<State>, &str)] = &[
        // ABSENT
        (Keyed, &[], None, "execute"),
        (Unsafe, &[], None, "execute"),
        // CLAIMED (unsafe, before its dispatch write) / DISPATCHED: in flight
        (Unsafe, &[Begin], Some(State::Claimed), "in_flight"),
        (Keyed, &[Begin], Some(State::Dispatched), "in_flight"),
        (
            Unsafe,
            &[Begin, Dispatched],
            Some(State::Dispatched),
            "in_flight",
        ),
        // FAILED_PRE_SEND: executes again as new
        (
            Keyed,
            &[Begin, FailPre],
            Some(State::FailedBeforeSend),
            "execute",
        ),
        (
            Unsafe,
            &[Begin, FailPre],
            Some(State::FailedBeforeSend),
            "execute",
        ),
        // COMPLETED (2xx or stored 4xx): replay
        (
            Keyed,
            &[Begin, Respond(201)],
            Some(State::Completed),
            "replay",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Respond(404)],
            Some(State::Completed),
            "replay",
        ),
        // IN_DOUBT, keyed / idempotent: re-send with the same downstream key
        (
            Keyed,
            &[Begin, Doubt],
            Some(State::InDoubt),
            "execute(resend)",
        ),
        (
            Idempotent,
            &[Begin, Respond(502)],
            Some(State::InDoubt),
            "execute(resend)",
        ),
        // IN_DOUBT / RECONCILING, probe
        (Probe, &[Begin, Doubt], Some(State::InDoubt), "probe"),
        (
            Probe,
            &[Begin, Doubt, Begin],
            Some(State::Reconciling),
            "in_flight",
        ),
        // NEEDS_OPERATOR (unsafe): outcome unknown, never re-sent
        (
            Unsafe,
            &[Begin, Dispatched, Doubt],
            Some(State::NeedsOperator),
            "outcome_unknown",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Restart],
            Some(State::NeedsOperator),
            "outcome_unknown",
        ),
        // TOMBSTONE
        (
            Keyed,
            &[Begin, Respond(200), Expire],
            Some(State::Tombstone),
            "tombstoned",
        ),
    ];
    for (class, steps, state, same) in rows {
        let label = format!("{class:?} {steps:?}");
        let mut setup = Driver::new(*class);
        setup
            .run(steps)
            .unwrap_or_else(|e| panic!("{label}: setup failed: {e}"));
        assert_eq!(
            setup.record.as_ref().map(|r| r.state),
            *state,
            "{label}: state"
        );

        let mut same_request = Driver {
            record: setup.record.clone(),
            ticket: setup.ticket.clone(),
            ..Driver::new(*class)
        };
        let effect = same_request
            .step(Begin)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(name(&effect), *same, "{label}: same request");

        if setup.record.is_some() {
            let mut other = Driver {
                record: setup.record.clone(),
                ..Driver::new(*class)
            };
            let effect = other
                .step(BeginOther)
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            assert_eq!(name(&effect), "mismatch", "{label}: different request");
            assert_eq!(
                other.record, setup.record,
                "{label}: a mismatch changes nothing"
            );
        }
    }
}

/// durability.md §6.2: (class, steps, state reached, current attempt, last effect).
#[test]
fn transitions() {
    let rows: &[(ToolClass, &[Step], State, u32, &str)] = &[
        (Keyed, &[Begin], State::Dispatched, 1, "execute"),
        (Unsafe, &[Begin], State::Claimed, 1, "execute"),
        (
            Unsafe,
            &[Begin, Dispatched],
            State::Dispatched,
            1,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, Respond(200)],
            State::Completed,
            1,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, Respond(422)],
            State::Completed,
            1,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, Respond(429)],
            State::FailedBeforeSend,
            1,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, Respond(408)],
            State::FailedBeforeSend,
            1,
            "recorded",
        ),
        (Keyed, &[Begin, Respond(503)], State::InDoubt, 1, "recorded"),
        (
            Unsafe,
            &[Begin, Dispatched, Respond(500)],
            State::NeedsOperator,
            1,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, FailPre],
            State::FailedBeforeSend,
            1,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, FailPre, Begin],
            State::Dispatched,
            2,
            "execute",
        ),
        (
            Unsafe,
            &[Begin, FailPre, Begin],
            State::Claimed,
            2,
            "execute",
        ),
        (
            Keyed,
            &[Begin, Doubt, Begin],
            State::Dispatched,
            2,
            "execute(resend)",
        ),
        (
            Idempotent,
            &[Begin, Doubt, Begin, Respond(200)],
            State::Completed,
            2,
            "recorded",
        ),
        (
            Probe,
            &[Begin, Doubt, Begin],
            State::Reconciling,
            1,
            "probe",
        ),
        (
            Probe,
            &[Begin, Doubt, Begin, Found(201)],
            State::Completed,
            1,
            "recorded",
        ),
        (
            Probe,
            &[Begin, Doubt, Begin, NotFound],
            State::Dispatched,
            2,
            "execute(resend)",
        ),
        (
            Probe,
            &[Begin, Doubt, Begin, Doubt],
            State::InDoubt,
            1,
            "recorded",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Doubt],
            State::NeedsOperator,
            1,
            "recorded",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Doubt, Succeeded],
            State::Completed,
            1,
            "recorded",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Doubt, Failed(502)],
            State::Completed,
            1,
            "recorded",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Doubt, Retry],
            State::FailedBeforeSend,
            1,
            "recorded",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Doubt, Retry, Begin],
            State::Claimed,
            2,
            "execute",
        ),
        (
            Keyed,
            &[Begin, Doubt, Succeeded],
            State::Completed,
            1,
            "recorded",
        ),
        // A re-send that never took effect leaves the key in doubt: attempt 1 may
        // have executed. The next request re-sends again.
        (
            Keyed,
            &[Begin, Doubt, Begin, FailPre],
            State::InDoubt,
            2,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, Doubt, Begin, Respond(429)],
            State::InDoubt,
            2,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, Doubt, Begin, FailPre, Begin],
            State::Dispatched,
            3,
            "execute(resend)",
        ),
        (
            Keyed,
            &[Begin, FailPre, Begin, FailPre],
            State::FailedBeforeSend,
            2,
            "recorded",
        ),
        // A probe that found no effect of the downstream key clears every attempt.
        (
            Probe,
            &[Begin, Doubt, Begin, NotFound, FailPre],
            State::FailedBeforeSend,
            2,
            "recorded",
        ),
        // So does an operator's retry.
        (
            Keyed,
            &[Begin, Doubt, Begin, FailPre, Retry],
            State::FailedBeforeSend,
            2,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, Doubt, Retry, Begin, FailPre],
            State::FailedBeforeSend,
            2,
            "recorded",
        ),
        // A late reply in the same process settles the doubt.
        (
            Keyed,
            &[Begin, Doubt, Respond(200)],
            State::Completed,
            1,
            "recorded",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Doubt, Respond(200)],
            State::Completed,
            1,
            "recorded",
        ),
        // Restart (a new epoch) at each in-flight state.
        (Keyed, &[Begin, Restart], State::InDoubt, 1, "recorded"),
        (
            Unsafe,
            &[Begin, Restart],
            State::FailedBeforeSend,
            1,
            "recorded",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Restart],
            State::NeedsOperator,
            1,
            "recorded",
        ),
        (
            Probe,
            &[Begin, Doubt, Begin, Restart],
            State::InDoubt,
            1,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, Respond(200), Restart],
            State::Completed,
            1,
            "unchanged",
        ),
        // Retention.
        (
            Keyed,
            &[Begin, Respond(200), Expire],
            State::Tombstone,
            1,
            "recorded",
        ),
        (
            Keyed,
            &[Begin, FailPre, Expire],
            State::Tombstone,
            1,
            "recorded",
        ),
        (Keyed, &[Begin, Expire], State::Dispatched, 1, "unchanged"),
        (
            Unsafe,
            &[Begin, Dispatched, Doubt, Expire],
            State::NeedsOperator,
            1,
            "unchanged",
        ),
    ];
    for (class, steps, state, attempt, effect) in rows {
        let label = format!("{class:?} {steps:?}");
        let mut d = Driver::new(*class);
        let last = d.run(steps).unwrap_or_else(|e| panic!("{label}: {e}"));
        let rec = d
            .record
            .as_ref()
            .unwrap_or_else(|| panic!("{label}: no record"));
        assert_eq!(rec.state, *state, "{label}: state");
        assert_eq!(rec.attempt, *attempt, "{label}: attempt");
        assert_eq!(name(&last), *effect, "{label}: effect");
        assert_eq!(
            rec.history.last().map(|t| t.state),
            Some(rec.state),
            "{label}: history ends in the current state"
        );
    }
}

/// Whether an attempt takes the second durable write (`dispatched`) follows the
/// class the record was made with, whatever class the request names now: a tool
/// reclassified from `unsafe` after its record was made still gets the write before
/// its send, so a crash before it stays provably "never sent" and one after it in
/// doubt. (class of the record, class of the request, steps, dispatch write)
#[test]
fn the_dispatch_write_follows_the_records_class() {
    let rows: &[(ToolClass, ToolClass, &[Step], bool)] = &[
        (Unsafe, Unsafe, &[], true),
        (Keyed, Keyed, &[], false),
        (Unsafe, Unsafe, &[Begin, FailPre], true),
        (Unsafe, Keyed, &[Begin, FailPre], true),
        (Unsafe, Idempotent, &[Begin, Dispatched, Doubt, Retry], true),
        (Keyed, Unsafe, &[Begin, FailPre], false),
        (Keyed, Unsafe, &[Begin, Doubt], false),
        (Probe, Unsafe, &[Begin, Doubt, Begin, NotFound], false),
    ];
    for (made, now, steps, dispatch) in rows {
        let label = format!("{made:?} then {now:?} {steps:?}");
        let mut d = Driver::new(*made);
        let mut last = d
            .run(steps)
            .unwrap_or_else(|e| panic!("{label}: setup failed: {e}"));
        if !steps.ends_with(&[NotFound]) {
            d.class = *now;
            last = d.step(Begin).unwrap_or_else(|e| panic!("{label}: {e}"));
        }
        let Effect::Execute { dispatch_write, .. } = last else {
            panic!("{label}: expected an execute, got {last:?}");
        };
        assert_eq!(dispatch_write, *dispatch, "{label}");
        let state = d.record.as_ref().map(|r| r.state);
        let rests = if *dispatch {
            State::Claimed
        } else {
            State::Dispatched
        };
        assert_eq!(state, Some(rests), "{label}: state");
    }
}

/// Events that must be refused: (class, setup, refused step, error).
#[test]
fn refusals() {
    let rows: &[(ToolClass, &[Step], Step, &str)] = &[
        (Keyed, &[Begin, Doubt, Begin], StaleRespond, "stale"),
        (Keyed, &[Begin, Respond(200)], FailPre, "stale"),
        (Keyed, &[Begin, Respond(200)], Succeeded, "not_resolvable"),
        (Keyed, &[Begin], Retry, "not_resolvable"),
        (
            Unsafe,
            &[Begin, Dispatched, Doubt],
            Failed(200),
            "invalid_resolution",
        ),
        // Not an HTTP error status: replayed, it could read as a success.
        (
            Unsafe,
            &[Begin, Dispatched, Doubt],
            Failed(600),
            "invalid_resolution",
        ),
        (
            Unsafe,
            &[Begin, Dispatched, Doubt],
            Failed(1000),
            "invalid_resolution",
        ),
        (Keyed, &[], Respond(200), "unknown_key"),
        (Keyed, &[], Succeeded, "unknown_key"),
        (Probe, &[Begin, Doubt, Begin, NotFound], NotFound, "stale"),
        // Not while a probe runs: what it finds would be lost.
        (Probe, &[Begin, Doubt, Begin], Retry, "not_resolvable"),
        (Probe, &[Begin, Doubt, Begin], Succeeded, "not_resolvable"),
    ];
    for (class, setup, step, want) in rows {
        let label = format!("{class:?} {setup:?} then {step:?}");
        let mut d = Driver::new(*class);
        d.run(setup).unwrap_or_else(|e| panic!("{label}: {e}"));
        let before = d.record.clone();
        let got = match d.step(*step) {
            Ok(effect) => panic!("{label}: accepted with {effect:?}"),
            Err(Error::Stale { .. }) => "stale",
            Err(Error::NotResolvable { .. }) => "not_resolvable",
            Err(Error::InvalidResolution(_)) => "invalid_resolution",
            Err(Error::UnknownKey(_)) => "unknown_key",
            Err(other) => panic!("{label}: unexpected {other}"),
        };
        assert_eq!(got, *want, "{label}");
        assert_eq!(d.record, before, "{label}: a refusal changes nothing");
    }
}

#[test]
fn secrets_are_dropped_and_resolutions_journaled() -> Result<(), Error> {
    let mut d = Driver::new(Unsafe);
    d.run(&[Begin, Dispatched, Doubt, Succeeded])?;
    let rec = d.record.as_ref().ok_or(Error::UnknownKey(key()))?;
    let request = rec.request.as_ref().ok_or(Error::UnknownKey(key()))?;
    assert_eq!(request.headers.get("authorization"), None);
    assert_eq!(
        request.headers.get("content-type"),
        Some("application/json")
    );
    let resolution = rec.resolutions.last().ok_or(Error::UnknownKey(key()))?;
    assert_eq!(resolution.actor, "ops@example");
    assert_eq!(resolution.action, "mark_succeeded");
    assert_eq!(resolution.from_state, State::NeedsOperator);
    assert_eq!(rec.final_status, Some(200));
    Ok(())
}

#[test]
fn tombstones_keep_only_the_audit_minimum() -> Result<(), Error> {
    let mut d = Driver::new(Keyed);
    d.run(&[Begin, Respond(201), Expire])?;
    let rec = d.record.as_ref().ok_or(Error::UnknownKey(key()))?;
    assert_eq!(rec.state, State::Tombstone);
    assert_eq!(rec.final_status, Some(201));
    assert_eq!(rec.fingerprint, Fingerprint([1; 32]));
    assert_eq!(
        rec.body_digest.as_deref(),
        Some(Body::from("{\"ok\":true}").digest_hex().as_str())
    );
    assert!(rec.request.is_none() && rec.response.is_none());
    assert!(rec.target.is_empty() && rec.attempts.is_empty());
    Ok(())
}

fn any_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        Just(Begin),
        Just(BeginOther),
        Just(Dispatched),
        prop::sample::select(vec![200u16, 201, 404, 408, 429, 500, 503]).prop_map(Respond),
        Just(FailPre),
        Just(Doubt),
        Just(Found(200)),
        Just(NotFound),
        Just(Succeeded),
        Just(Failed(502)),
        Just(Retry),
        Just(Restart),
        Just(Expire),
        Just(StaleRespond),
    ]
}

fn any_class() -> impl Strategy<Value = ToolClass> {
    prop::sample::select(vec![Keyed, Idempotent, Probe, Unsafe])
}

proptest! {
    /// Applying the same event twice leaves the record as applying it once did: the
    /// second application is refused or changes nothing (and asks for no write).
    #[test]
    fn applying_twice_equals_applying_once(
        class in any_class(),
        steps in prop::collection::vec(any_step(), 0..24),
        last in any_step(),
    ) {
        let mut d = Driver::new(class);
        for step in steps {
            // Refused steps are part of the exploration; they leave the record as is.
            let _ = d.step(step);
        }
        let event = d.event(last);
        let now = d.now();
        if let Ok((once, first)) = apply(d.record.as_ref(), event.clone(), now) {
            // A refusal of the repeat leaves the record as it was, too.
            if let Ok((twice, second)) = apply(Some(&once), event, now) {
                prop_assert_eq!(&twice, &once);
                prop_assert!(!second.writes(), "second application wrote: {:?} after {:?}", second, first);
            }
            // Whatever happened, a live record's history ends in its state.
            prop_assert_eq!(once.history.last().map(|t| t.state), Some(once.state));
        }
    }

    /// No sequence of events makes an unsafe tool's call go out twice without an
    /// operator: every Execute after the first follows a provable non-send or a retry
    /// resolution.
    #[test]
    fn unsafe_tools_are_never_resent_automatically(
        steps in prop::collection::vec(any_step(), 0..32),
    ) {
        let mut d = Driver::new(Unsafe);
        for step in steps {
            let before = d.record.as_ref().map(|r| r.state);
            if let Ok(Effect::Execute { resend, .. }) = d.step(step) {
                prop_assert!(!resend);
                prop_assert!(matches!(before, None | Some(State::FailedBeforeSend)), "executed from {:?}", before);
            }
        }
    }
}

/// A key retried for hours keeps a bounded record: the first attempt, any still in
/// doubt and the newest, and the first and newest transitions with one standing for
/// those dropped; the state machine works on as before.
#[test]
fn a_key_retried_without_end_keeps_a_bounded_record() {
    let mut d = Driver::new(Keyed);
    let mut steps = vec![Begin, FailPre, Begin, Doubt];
    for _ in 0..200 {
        steps.extend([Begin, Respond(429)]);
    }
    d.run(&steps).expect("every step applies");
    let rec = d.record.as_ref().expect("a record");
    assert_eq!(rec.attempt, 202);
    assert_eq!(rec.state, State::InDoubt, "attempt 2 is still in doubt");
    assert_eq!(rec.attempts.len(), 64);
    assert_eq!(rec.attempts[0].n, 1, "the first attempt stays");
    assert_eq!(rec.attempts[1].n, 2, "and the one in doubt");
    assert_eq!(
        rec.attempts.last().map(|a| a.n),
        Some(202),
        "and the newest"
    );
    assert_eq!(rec.history.len(), 128);
    assert!(
        rec.history[1].note.contains("dropped"),
        "{:?}",
        rec.history[1]
    );
    assert_eq!(
        rec.history
            .iter()
            .filter(|t| t.note.contains("dropped"))
            .count(),
        1
    );
    // The next request re-sends, as for any key in doubt.
    let effect = d.step(Begin).expect("begin");
    assert_eq!(name(&effect), "execute(resend)");
    assert_eq!(d.record.as_ref().map(|r| r.attempts.len()), Some(64));
}
