//! The attempt loop on paused time, against a scripted transport and a decider that
//! behaves like the built-in retry policy (the real `.wasm` is tested in the policy
//! crate; here only the mechanics are under test).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use http_body_util::Full;
use outrigger_types::{
    BudgetDecision, BudgetRequest, Decided, DecisionSource, FallbackRequest, PolicyVersion,
};

use super::*;
use crate::options::{Capabilities, Dialect, ModelPattern};
use crate::resilience::{breaker, limiter, retry_budget};

/// A scripted answer: status and headers.
type Reply = (u16, Vec<(&'static str, &'static str)>);

/// A scripted "status" that never answers.
const HANG: u16 = 0;

/// Answers from a script; counts what was sent.
struct Script {
    replies: Mutex<VecDeque<Reply>>,
    /// Used when the script runs out.
    default: u16,
    sent: AtomicU32,
    sent_to: Mutex<Vec<String>>,
}

impl Script {
    fn new(replies: Vec<Reply>, default: u16) -> Self {
        Self {
            replies: Mutex::new(replies.into()),
            default,
            sent: AtomicU32::new(0),
            sent_to: Mutex::new(Vec::new()),
        }
    }
}

impl Transport for Script {
    type Body = Full<Bytes>;
    fn send(
        &self,
        req: Request<Full<Bytes>>,
        _timeout: Duration,
    ) -> impl Future<Output = Result<Response<Full<Bytes>>, upstream::Error>> + Send {
        self.sent.fetch_add(1, Ordering::SeqCst);
        self.sent_to.lock().unwrap().push(
            req.uri()
                .authority()
                .map(|a| a.to_string())
                .unwrap_or_default(),
        );
        let (status, headers) = self
            .replies
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or((self.default, vec![]));
        async move {
            if status == HANG {
                std::future::pending::<()>().await;
            }
            let mut resp = Response::new(Full::new(Bytes::from_static(b"{}")));
            *resp.status_mut() = StatusCode::from_u16(status).unwrap();
            for (k, v) in headers {
                resp.headers_mut().insert(k, v.parse().unwrap());
            }
            Ok(resp)
        }
    }
}

/// Retries rate limits after their Retry-After, 5xx after 10 ms, up to 4 attempts;
/// falls back on context overflow.
struct LikeBuiltin;

fn decided<T>(value: T) -> Decided<T> {
    Decided {
        value,
        version: PolicyVersion::new("retry", "test"),
        source: DecisionSource::Policy,
    }
}

impl Decider for LikeBuiltin {
    fn retry(&self, ctx: &CallContext, failure: &Failure) -> Decided<RetryDecision> {
        if ctx.attempt >= 4 || !ctx.retry_budget.available {
            return decided(RetryDecision::GiveUp("enough".into()));
        }
        decided(match failure {
            Failure::RateLimited {
                retry_after: Some(d),
            } => RetryDecision::RetryAfter(*d),
            Failure::ContextOverflow => match ctx.fallbacks.first() {
                Some(f) => RetryDecision::FallBack(f.clone()),
                None => RetryDecision::GiveUp("no long-context fallback".into()),
            },
            _ => RetryDecision::RetryAfter(Duration::from_millis(10)),
        })
    }
    fn fallback(&self, req: &FallbackRequest) -> Decided<Vec<usize>> {
        decided((0..req.candidates.len()).collect())
    }
    fn budget(&self, _: &BudgetRequest) -> Decided<BudgetDecision> {
        decided(BudgetDecision::Admit)
    }
}

fn provider(name: &str, port: u16) -> Provider {
    Provider {
        name: name.into(),
        dialect: Dialect::OpenAi,
        base_url: format!("http://127.0.0.1:{port}/v1").parse().unwrap(),
        api_key: None,
        models: vec![ModelPattern::Any],
        caps: Capabilities::permissive(),
    }
}

struct Rig {
    breakers: Breakers,
    limiters: Limiters,
    budgets: RetryBudgets,
}

impl Rig {
    fn new() -> Self {
        Self {
            breakers: Breakers::new(breaker::Options::default()),
            limiters: Limiters::new(limiter::Options::default()),
            budgets: RetryBudgets::new(retry_budget::Options::default()),
        }
    }

    fn mechanics<'a>(&'a self, t: &'a Script, d: &'a dyn Decider) -> Mechanics<'a, Script> {
        Mechanics {
            transport: t,
            decider: d,
            breakers: &self.breakers,
            limiters: &self.limiters,
            budgets: &self.budgets,
            first_byte_timeout: Duration::from_secs(30),
            stream_idle_timeout: Duration::from_secs(300),
            max_event_bytes: 1 << 20,
            max_attempts: crate::options::DEFAULT_MAX_ATTEMPTS,
            task_retries: None,
            metrics: None,
            faults: None,
        }
    }
}

fn build(p: &Provider) -> Result<Request<Full<Bytes>>, crate::Error> {
    let mut req = Request::new(Full::new(Bytes::from_static(b"{}")));
    *req.uri_mut() = p
        .url("/chat/completions")
        .map_err(|e| crate::Error::BuildRequest(e.to_string()))?;
    Ok(req)
}

fn plan<'a>(order: Vec<&'a Provider>) -> Plan<'a> {
    Plan {
        task_id: Some("t"),
        request_id: "r",
        model: "m",
        stream: false,
        order,
        build: &build,
        estimated_tokens: 10,
    }
}

#[tokio::test(start_paused = true)]
async fn a_429_with_retry_after_2_waits_2_seconds_then_succeeds() {
    let rig = Rig::new();
    let script = Script::new(vec![(429, vec![("retry-after", "2")])], 200);
    let p = provider("a", 1);
    let started = tokio::time::Instant::now();
    let mut trail = Trail::default();
    let result = run(
        &rig.mechanics(&script, &LikeBuiltin),
        &plan(vec![&p]),
        &mut trail,
    )
    .await;
    assert!(result.is_ok());
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    assert_eq!((trail.attempts, trail.retries), (2, 1));
    assert_eq!(
        trail.history[0].failure,
        Failure::RateLimited {
            retry_after: Some(Duration::from_secs(2))
        }
    );
    assert_eq!(
        trail.policy_versions,
        vec![PolicyVersion::new("retry", "test")]
    );
}

#[tokio::test(start_paused = true)]
async fn under_total_failure_at_concurrency_50_retries_stay_within_the_budget() {
    // A breaker that never trips, to see the retry budget alone (with the default
    // breaker even fewer requests go out: it opens after 5 failures).
    let rig = Rig {
        breakers: Breakers::new(breaker::Options {
            consecutive_failures: u32::MAX,
            ..breaker::Options::default()
        }),
        ..Rig::new()
    };
    let script = Script::new(vec![], 503);
    let p = provider("a", 1);
    let metrics = outrigger_telemetry::Metrics::new();
    let mech = Mechanics {
        metrics: Some(&metrics),
        ..rig.mechanics(&script, &LikeBuiltin)
    };
    let calls = (0..50).map(|_| async {
        let mut trail = Trail::default();
        let r = run(&mech, &plan(vec![&p]), &mut trail).await;
        assert!(r.is_err());
        (trail.retries, trail.retry_budget_exhausted)
    });
    let ended = futures_util::future::join_all(calls).await;
    let retries: u32 = ended.iter().map(|(r, _)| r).sum();
    // 20 % of 50 requests = 10 retries in the window (the floor is 3).
    assert_eq!(retries, 10);
    assert_eq!(
        script.sent.load(Ordering::SeqCst),
        60,
        "50 originals + 10 retries"
    );
    // Every call but those that used up their own attempts (at most 10 / 3) was
    // stopped by the spent budget, and each such call is counted once.
    let stopped = ended.iter().filter(|(_, spent)| *spent).count();
    assert!(stopped >= 47, "{stopped} calls stopped by the budget");
    let line = format!("outrigger_retry_budget_exhausted_total{{target=\"a\"}} {stopped}");
    assert!(metrics.encode().contains(&line), "{}", metrics.encode());
}

#[tokio::test(start_paused = true)]
async fn rate_limits_never_open_the_breaker() {
    let rig = Rig::new();
    let script = Script::new(vec![], 429);
    let p = provider("a", 1);
    let mech = rig.mechanics(&script, &crate::decider::NoPolicy);
    for _ in 0..20 {
        let _ = run(&mech, &plan(vec![&p]), &mut Trail::default()).await;
    }
    assert_eq!(
        rig.breakers.state("a"),
        outrigger_types::CircuitState::Closed
    );
    assert_eq!(
        script.sent.load(Ordering::SeqCst),
        20,
        "every call was sent"
    );
}

#[tokio::test(start_paused = true)]
async fn the_breaker_opens_then_a_probe_half_opens_it() {
    let rig = Rig::new();
    let script = Script::new(vec![], 503);
    let p = provider("a", 1);
    let mech = rig.mechanics(&script, &Never);
    for _ in 0..5 {
        let _ = run(&mech, &plan(vec![&p]), &mut Trail::default()).await;
    }
    assert_eq!(rig.breakers.state("a"), outrigger_types::CircuitState::Open);
    // While open, nothing is sent: the call fails fast.
    let before = script.sent.load(Ordering::SeqCst);
    match run(&mech, &plan(vec![&p]), &mut Trail::default()).await {
        Err(Ended::Error {
            error: crate::Error::CircuitOpen { .. },
            ..
        }) => {}
        _ => panic!("expected a fast circuit-open failure"),
    }
    assert_eq!(script.sent.load(Ordering::SeqCst), before);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        rig.breakers.state("a"),
        outrigger_types::CircuitState::HalfOpen
    );
    // The probe succeeds: closed again.
    script.replies.lock().unwrap().push_back((200, vec![]));
    assert!(
        run(&mech, &plan(vec![&p]), &mut Trail::default())
            .await
            .is_ok()
    );
    assert_eq!(
        rig.breakers.state("a"),
        outrigger_types::CircuitState::Closed
    );
}

/// Gives up at once.
struct Never;

impl Decider for Never {
    fn retry(&self, _: &CallContext, _: &Failure) -> Decided<RetryDecision> {
        decided(RetryDecision::GiveUp("no".into()))
    }
    fn fallback(&self, req: &FallbackRequest) -> Decided<Vec<usize>> {
        decided((0..req.candidates.len()).collect())
    }
    fn budget(&self, _: &BudgetRequest) -> Decided<BudgetDecision> {
        decided(BudgetDecision::Admit)
    }
}

/// A rig whose breaker opens at the first failure, with a retry budget that never
/// runs out.
fn trips_at_once(limits: limiter::Options) -> Rig {
    Rig {
        breakers: Breakers::new(breaker::Options {
            consecutive_failures: 1,
            ..breaker::Options::default()
        }),
        limiters: Limiters::new(limits),
        budgets: RetryBudgets::new(retry_budget::Options {
            min_retries: 1_000,
            ..retry_budget::Options::default()
        }),
    }
}

#[tokio::test(start_paused = true)]
async fn a_probe_answered_with_a_429_closes_the_circuit_and_the_call_goes_on() {
    struct AtOnce;
    impl Decider for AtOnce {
        fn retry(&self, _: &CallContext, _: &Failure) -> Decided<RetryDecision> {
            decided(RetryDecision::RetryAfter(Duration::ZERO))
        }
        fn fallback(&self, req: &FallbackRequest) -> Decided<Vec<usize>> {
            decided((0..req.candidates.len()).collect())
        }
        fn budget(&self, _: &BudgetRequest) -> Decided<BudgetDecision> {
            decided(BudgetDecision::Admit)
        }
    }
    let rig = trips_at_once(limiter::Options::default());
    let script = Script::new(vec![(503, vec![]), (429, vec![])], 200);
    let p = provider("a", 1);
    let mech = rig.mechanics(&script, &AtOnce);
    // A 503 opens the circuit; the call's retries are refused by it, unsent.
    assert!(
        run(&mech, &plan(vec![&p]), &mut Trail::default())
            .await
            .is_err()
    );
    assert_eq!(script.sent.load(Ordering::SeqCst), 1);
    assert_eq!(rig.breakers.state("a"), outrigger_types::CircuitState::Open);
    // After the penalty the probe gets a 429: the provider is alive, the circuit
    // closes and the retry goes through.
    tokio::time::advance(Duration::from_secs(1)).await;
    let mut trail = Trail::default();
    let result = run(&mech, &plan(vec![&p]), &mut trail).await;
    assert!(result.is_ok(), "{:?}", trail.history);
    assert_eq!(script.sent.load(Ordering::SeqCst), 3);
    assert_eq!(
        trail.history.iter().map(|a| &a.failure).collect::<Vec<_>>(),
        vec![&Failure::RateLimited { retry_after: None }],
        "no attempt was refused by the circuit"
    );
    assert_eq!(
        rig.breakers.state("a"),
        outrigger_types::CircuitState::Closed
    );
}

/// A trail says whether an attempt is out at the provider: while it waits for an
/// answer (a call dropped then is charged for it), not once it has ended, and never
/// for a call the open circuit refused.
#[tokio::test(start_paused = true)]
async fn a_trail_says_whether_an_attempt_is_out() {
    let rig = trips_at_once(limiter::Options::default());
    let script = Script::new(vec![(503, vec![]), (HANG, vec![])], 200);
    let (a, mut b) = (provider("a", 1), provider("b", 1));
    b.caps.price_in = 3_000_000;
    let mech = rig.mechanics(&script, &Never);
    let mut ended = Trail::default();
    assert!(run(&mech, &plan(vec![&a]), &mut ended).await.is_err());
    assert_eq!(ended.attempts, 1);
    assert_eq!(ended.in_flight, None, "its attempt ended");
    let mut refused = Trail::default();
    assert!(run(&mech, &plan(vec![&a]), &mut refused).await.is_err());
    assert_eq!(refused.attempts, 1);
    assert_eq!(refused.in_flight, None, "the open circuit refused it");
    assert_eq!(script.sent.load(Ordering::SeqCst), 1);
    let mut dropped = Trail::default();
    let waited = tokio::time::timeout(
        Duration::from_secs(1),
        run(&mech, &plan(vec![&b]), &mut dropped),
    )
    .await;
    assert!(waited.is_err(), "the provider never answers");
    assert_eq!(
        dropped.in_flight,
        Some(b.price()),
        "dropped while its request was out, at b's prices"
    );
    assert_eq!(script.sent.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn a_probe_whose_call_is_dropped_is_given_back() {
    let rig = trips_at_once(limiter::Options::default());
    let script = Script::new(vec![(503, vec![]), (HANG, vec![])], 200);
    let p = provider("a", 1);
    let mech = rig.mechanics(&script, &Never);
    assert!(
        run(&mech, &plan(vec![&p]), &mut Trail::default())
            .await
            .is_err()
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    // The probe never answers, and its caller goes away.
    let probe = tokio::time::timeout(
        Duration::from_secs(5),
        run(&mech, &plan(vec![&p]), &mut Trail::default()),
    )
    .await;
    assert!(probe.is_err(), "the probe never answered");
    assert_eq!(script.sent.load(Ordering::SeqCst), 2);
    tokio::time::advance(Duration::from_secs(1)).await;
    // The next call is the probe.
    let next = run(&mech, &plan(vec![&p]), &mut Trail::default()).await;
    assert!(next.is_ok(), "the next call was let through as the probe");
    assert_eq!(script.sent.load(Ordering::SeqCst), 3);
    assert_eq!(
        rig.breakers.state("a"),
        outrigger_types::CircuitState::Closed
    );
}

#[tokio::test(start_paused = true)]
async fn a_call_the_limiter_refuses_tells_the_breaker_nothing() {
    let rig = trips_at_once(limiter::Options {
        max_concurrency: 1,
        max_queue: 0,
        ..limiter::Options::default()
    });
    let script = Script::new(vec![(503, vec![])], 200);
    let p = provider("a", 1);
    let mech = rig.mechanics(&script, &Never);
    assert!(
        run(&mech, &plan(vec![&p]), &mut Trail::default())
            .await
            .is_err()
    );
    assert_eq!(rig.breakers.state("a"), outrigger_types::CircuitState::Open);
    let held = rig.limiters.get("a").acquire("other", 0).await.unwrap();
    tokio::time::advance(Duration::from_secs(1)).await;
    // The probe is refused by the full queue: nothing reached the provider.
    match run(&mech, &plan(vec![&p]), &mut Trail::default()).await {
        Err(Ended::Error {
            error: crate::Error::Overloaded { .. },
            ..
        }) => {}
        _ => panic!("expected the limiter's refusal"),
    }
    assert_eq!(script.sent.load(Ordering::SeqCst), 1);
    assert_eq!(
        rig.breakers.state("a"),
        outrigger_types::CircuitState::HalfOpen,
        "a local refusal neither closes the circuit nor holds its probe"
    );
    drop(held);
    assert!(
        run(&mech, &plan(vec![&p]), &mut Trail::default())
            .await
            .is_ok()
    );
    assert_eq!(
        rig.breakers.state("a"),
        outrigger_types::CircuitState::Closed
    );
}

#[tokio::test(start_paused = true)]
async fn a_task_with_no_retries_left_is_not_retried() {
    // A provider budget that never runs out: only the task's limit stops retries.
    let rig = Rig {
        budgets: RetryBudgets::new(retry_budget::Options {
            min_retries: 1_000,
            ..retry_budget::Options::default()
        }),
        ..Rig::new()
    };
    let ledger = crate::resilience::Ledger::default();
    let script = Script::new(vec![], 503);
    let p = provider("a", 1);
    // Two calls of one task, retrying at once, share its two retries.
    let mech = Mechanics {
        task_retries: Some(TaskRetries {
            ledger: &ledger,
            task: "t",
            max: Some(2),
        }),
        ..rig.mechanics(&script, &LikeBuiltin)
    };
    let (mut a, mut b) = (Trail::default(), Trail::default());
    let (pa, pb) = (plan(vec![&p]), plan(vec![&p]));
    let (ra, rb) = tokio::join!(run(&mech, &pa, &mut a), run(&mech, &pb, &mut b));
    assert!(ra.is_err() && rb.is_err());
    assert_eq!(a.retries + b.retries, 2);
    assert_eq!(script.sent.load(Ordering::SeqCst), 4);
    assert_eq!(ledger.usage("t").retries, 2);
    for trail in [&a, &b] {
        let why = trail.gave_up.as_deref().expect("a reason");
        assert!(why.contains("[budget] retries"), "{why}");
    }
    // Without a limit the task's retries are counted all the same.
    let mech = Mechanics {
        task_retries: Some(TaskRetries {
            ledger: &ledger,
            task: "u",
            max: None,
        }),
        ..rig.mechanics(&script, &LikeBuiltin)
    };
    let mut trail = Trail::default();
    assert!(run(&mech, &plan(vec![&p]), &mut trail).await.is_err());
    assert_eq!(ledger.usage("u").retries, trail.retries);
    assert_eq!(trail.retries, 3);
}

#[tokio::test(start_paused = true)]
async fn a_policy_that_never_gives_up_stops_at_max_attempts() {
    // Retrying every 6 s, a lone call never exhausts a budget of 3 retries per 10 s
    // window: only the attempt ceiling ends it.
    struct Always;
    impl Decider for Always {
        fn retry(&self, _: &CallContext, _: &Failure) -> Decided<RetryDecision> {
            decided(RetryDecision::RetryAfter(Duration::from_secs(6)))
        }
        fn fallback(&self, req: &FallbackRequest) -> Decided<Vec<usize>> {
            decided((0..req.candidates.len()).collect())
        }
        fn budget(&self, _: &BudgetRequest) -> Decided<BudgetDecision> {
            decided(BudgetDecision::Admit)
        }
    }
    let rig = Rig {
        breakers: Breakers::new(breaker::Options {
            consecutive_failures: 1_000,
            ..breaker::Options::default()
        }),
        ..Rig::new()
    };
    let script = Script::new(vec![], 503);
    let p = provider("a", 1);
    let mech = Mechanics {
        max_attempts: 7,
        ..rig.mechanics(&script, &Always)
    };
    let mut trail = Trail::default();
    let ended = tokio::time::timeout(
        Duration::from_secs(3_600),
        run(&mech, &plan(vec![&p]), &mut trail),
    )
    .await
    .expect("the call ends by itself");
    assert!(
        matches!(ended, Err(Ended::Answer { .. })),
        "the last 503 is passed on"
    );
    assert_eq!(script.sent.load(Ordering::SeqCst), 7);
    assert_eq!((trail.attempts, trail.retries), (7, 6));
    assert!(!trail.retry_budget_exhausted);
    let why = trail.gave_up.expect("a reason");
    assert!(why.contains("resilience.max_attempts"), "{why}");
}

#[tokio::test(start_paused = true)]
async fn context_overflow_falls_back_to_the_next_target() {
    let rig = Rig::new();
    let script = Script::new(vec![], 200);
    // The first target answers 400 context_length_exceeded.
    struct Overflow(Script);
    impl Transport for Overflow {
        type Body = Full<Bytes>;
        fn send(
            &self,
            req: Request<Full<Bytes>>,
            _t: Duration,
        ) -> impl Future<Output = Result<Response<Full<Bytes>>, upstream::Error>> + Send {
            let port = req.uri().port_u16();
            self.0.sent_to.lock().unwrap().push(format!("{port:?}"));
            async move {
                let (status, body): (u16, &'static [u8]) = if port == Some(1) {
                    (400, br#"{"error":{"code":"context_length_exceeded"}}"#)
                } else {
                    (200, b"{}")
                };
                let mut resp = Response::new(Full::new(Bytes::from_static(body)));
                *resp.status_mut() = StatusCode::from_u16(status).unwrap();
                Ok(resp)
            }
        }
    }
    let t = Overflow(script);
    let (a, b) = (provider("small", 1), provider("long", 2));
    let mech = Mechanics {
        transport: &t,
        decider: &LikeBuiltin,
        breakers: &rig.breakers,
        limiters: &rig.limiters,
        budgets: &rig.budgets,
        first_byte_timeout: Duration::from_secs(30),
        stream_idle_timeout: Duration::from_secs(300),
        max_event_bytes: 1 << 20,
        max_attempts: crate::options::DEFAULT_MAX_ATTEMPTS,
        task_retries: None,
        metrics: None,
        faults: None,
    };
    let mut trail = Trail::default();
    let ok = run(&mech, &plan(vec![&a, &b]), &mut trail).await;
    match ok {
        Ok(s) => assert_eq!(s.provider.name, "long"),
        Err(_) => panic!("expected the fallback to succeed"),
    }
    assert_eq!((trail.attempts, trail.fallbacks, trail.retries), (2, 1, 0));
    assert_eq!(
        rig.breakers.state("small"),
        outrigger_types::CircuitState::Closed,
        "an overflow is not the target's fault"
    );
}

#[test]
fn failures_are_classified_from_status_and_body() {
    let cases: &[(u16, &str, Option<Failure>)] = &[
        (429, "", Some(Failure::RateLimited { retry_after: None })),
        (503, "", Some(Failure::ServerError { status: 503 })),
        (
            529,
            "overloaded",
            Some(Failure::ServerError { status: 529 }),
        ),
        (408, "", Some(Failure::Timeout)),
        (
            400,
            r#"{"error":{"code":"context_length_exceeded"}}"#,
            Some(Failure::ContextOverflow),
        ),
        (
            400,
            r#"{"error":{"message":"prompt is too long: 250000 tokens"}}"#,
            Some(Failure::ContextOverflow),
        ),
        (
            400,
            r#"{"error":{"code":"content_policy_violation"}}"#,
            Some(Failure::ContentFiltered),
        ),
        (400, r#"{"error":{"message":"bad field"}}"#, None),
        (401, "", None),
        (404, "", None),
    ];
    for (status, body, want) in cases {
        assert_eq!(
            &classify(
                StatusCode::from_u16(*status).unwrap(),
                None,
                body.as_bytes()
            ),
            want,
            "{status} {body}"
        );
    }
}

#[test]
fn retry_after_forms() {
    let mut h = HeaderMap::new();
    h.insert("retry-after", "2".parse().unwrap());
    assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
    h.insert("retry-after-ms", "1500".parse().unwrap());
    assert_eq!(retry_after(&h), Some(Duration::from_millis(1500)));
    let mut h = HeaderMap::new();
    h.insert(
        "retry-after",
        "Sun, 06 Nov 1994 08:49:37 GMT".parse().unwrap(),
    );
    assert_eq!(retry_after(&h), Some(Duration::ZERO), "a date in the past");
    h.insert("retry-after", "soon".parse().unwrap());
    assert_eq!(retry_after(&h), None);
    h.insert("retry-after", "-3".parse().unwrap());
    assert_eq!(retry_after(&h), None);
}

/// Whatever a provider (or anything between) writes, a wait is a number the clock can
/// hold, and never above the cap (a day): no panic, no pause for weeks.
#[test]
fn retry_after_is_capped_and_never_panics() {
    let cap = crate::resilience::limiter::MAX_PROVIDER_WAIT;
    for (name, value) in [
        ("retry-after-ms", "inf"),
        ("retry-after-ms", "1e300"),
        ("retry-after", "1e30"),
        ("retry-after", "inf"),
        ("retry-after", "172800"),
        ("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT"),
    ] {
        let mut h = HeaderMap::new();
        h.insert(name, value.parse().unwrap());
        assert_eq!(retry_after(&h), Some(cap), "{name}: {value}");
    }
    let mut h = HeaderMap::new();
    h.insert("retry-after-ms", "NaN".parse().unwrap());
    assert_eq!(retry_after(&h), None);
}

/// A streamed body from a script: its frames, then its end, or (`hang`) nothing more
/// for ever.
struct Frames {
    frames: VecDeque<Bytes>,
    hang: bool,
}

impl HttpBody for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        match self.frames.pop_front() {
            Some(data) => std::task::Poll::Ready(Some(Ok(http_body::Frame::data(data)))),
            None if self.hang => std::task::Poll::Pending,
            None => std::task::Poll::Ready(None),
        }
    }
}

/// Answers each request with the next scripted SSE body (200, `text/event-stream`).
struct Streams {
    bodies: Mutex<VecDeque<Frames>>,
    sent: AtomicU32,
}

impl Streams {
    fn new(bodies: Vec<(Vec<&'static str>, bool)>) -> Self {
        Self {
            bodies: Mutex::new(
                bodies
                    .into_iter()
                    .map(|(frames, hang)| Frames {
                        frames: frames.into_iter().map(Bytes::from).collect(),
                        hang,
                    })
                    .collect(),
            ),
            sent: AtomicU32::new(0),
        }
    }
}

impl Transport for Streams {
    type Body = Frames;
    fn send(
        &self,
        _req: Request<Full<Bytes>>,
        _timeout: Duration,
    ) -> impl Future<Output = Result<Response<Frames>, upstream::Error>> + Send {
        self.sent.fetch_add(1, Ordering::SeqCst);
        let body = self.bodies.lock().unwrap().pop_front().unwrap_or(Frames {
            frames: VecDeque::new(),
            hang: false,
        });
        async move {
            let mut resp = Response::new(body);
            resp.headers_mut()
                .insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
            Ok(resp)
        }
    }
}

fn streams_mechanics<'a>(rig: &'a Rig, t: &'a Streams) -> Mechanics<'a, Streams> {
    Mechanics {
        transport: t,
        decider: &LikeBuiltin,
        breakers: &rig.breakers,
        limiters: &rig.limiters,
        budgets: &rig.budgets,
        first_byte_timeout: Duration::from_secs(30),
        stream_idle_timeout: Duration::from_secs(300),
        max_event_bytes: 1 << 20,
        max_attempts: crate::options::DEFAULT_MAX_ATTEMPTS,
        task_retries: None,
        metrics: None,
        faults: None,
    }
}

fn stream_plan<'a>(order: Vec<&'a Provider>) -> Plan<'a> {
    Plan {
        stream: true,
        ..plan(order)
    }
}

/// Everything a stream's success gives the agent: its first events, then the rest
/// of the body through the same framer.
async fn whole_stream<B>(s: Success<'_, B>) -> String
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    let Success {
        mut body,
        framer,
        first_events,
        ..
    } = s;
    let mut framer = framer.expect("a stream");
    let mut events = first_events;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("data").into_data() {
            framer.push(&data, &mut events).expect("framed");
        }
    }
    let tail = framer.finish(&mut events);
    events.extend(tail);
    events.iter().map(|e| String::from_utf8_lossy(e)).collect()
}

/// The first events are read through the key's scrubber like the rest of the body,
/// so a key quoted in the first event, or split between the first two frames, never
/// gets out.
#[tokio::test(start_paused = true)]
async fn a_key_quoted_in_the_first_event_or_split_across_frames_is_scrubbed() {
    let rig = Rig::new();
    let mut p = provider("a", 1);
    p.api_key = Some(crate::options::Secret::new("pk-canary-123".into()));
    let script = Streams::new(vec![
        (
            vec![
                "data: {\"echo\":\"Bearer pk-canary-123\"}\n\ndata: {\"k\":\"pk-ca",
                "nary-123\"}\n\ndata: [DONE]\n\n",
            ],
            false,
        ),
        (
            vec![
                "data: {\"echo\":\"Bearer pk-ca",
                "nary-123\"}\n\ndata: [DONE]\n\n",
            ],
            false,
        ),
    ]);
    let mech = streams_mechanics(&rig, &script);
    let first = run(&mech, &stream_plan(vec![&p]), &mut Trail::default()).await;
    let whole = whole_stream(first.ok().expect("a stream")).await;
    assert_eq!(
        whole,
        "data: {\"echo\":\"Bearer <redacted>\"}\n\ndata: {\"k\":\"<redacted>\"}\n\ndata: [DONE]\n\n"
    );
    let second = run(&mech, &stream_plan(vec![&p]), &mut Trail::default()).await;
    let whole = whole_stream(second.ok().expect("a stream")).await;
    assert_eq!(
        whole,
        "data: {\"echo\":\"Bearer <redacted>\"}\n\ndata: [DONE]\n\n"
    );
}

/// A comment (`: keep-alive`, `: OPENROUTER PROCESSING`) is no event: it does not
/// start the stream (a cut after it is retried invisibly); the comments before the
/// first event of the stream that starts go out with it, byte for byte. Silence
/// past the first-byte timeout is retried too.
#[tokio::test(start_paused = true)]
async fn a_comment_is_not_the_first_event() {
    let rig = Rig::new();
    let p = provider("a", 1);
    let script = Streams::new(vec![
        (vec![], true),
        (vec![": keep-alive\n\n"], false),
        (
            vec![
                ": OPENROUTER PROCESSING\n\n",
                ": OPENROUTER PROCESSING\n\ndata: {\"n\":1}\n\n",
                "data: [DONE]\n\n",
            ],
            false,
        ),
    ]);
    let mech = streams_mechanics(&rig, &script);
    let started = tokio::time::Instant::now();
    let mut trail = Trail::default();
    let ok = run(&mech, &stream_plan(vec![&p]), &mut trail).await;
    assert_eq!(trail.attempts, 3);
    assert_eq!(trail.history[0].failure, Failure::Timeout);
    assert!(matches!(
        trail.history[1].failure,
        Failure::StreamInterrupted {
            events_delivered: 0,
            ..
        }
    ));
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(30) + Duration::from_millis(20)
    );
    let whole = whole_stream(ok.ok().expect("a stream")).await;
    assert_eq!(
        whole,
        ": OPENROUTER PROCESSING\n\n: OPENROUTER PROCESSING\n\ndata: {\"n\":1}\n\ndata: [DONE]\n\n"
    );
}

/// Once the provider sends comments (a keep-alive while it thinks), its first event
/// may take longer than the first-byte timeout: a re-send would pay for the prompt
/// twice. (Only silence as long as `stream_idle_timeout` ends it.)
#[tokio::test(start_paused = true)]
async fn comments_keep_a_slow_first_event_waiting_past_the_first_byte_timeout() {
    let rig = Rig::new();
    let p = provider("a", 1);
    let script = Streams::new(vec![(vec![": keep-alive\n\n"], true)]);
    let mech = Mechanics {
        stream_idle_timeout: Duration::from_secs(3_600),
        ..streams_mechanics(&rig, &script)
    };
    let mut trail = Trail::default();
    let waited = tokio::time::timeout(
        Duration::from_secs(300),
        run(&mech, &stream_plan(vec![&p]), &mut trail),
    )
    .await;
    assert!(
        waited.is_err(),
        "still waiting for the first event after 300 s"
    );
    assert_eq!(script.sent.load(Ordering::SeqCst), 1);
}

/// A stream whose first event is the provider's error is an error answer: retried
/// invisibly when its error is retryable, passed on as it came when it is not.
#[tokio::test(start_paused = true)]
async fn a_first_event_that_is_an_error_is_classified_and_retried() {
    let rig = Rig::new();
    let openai = provider("a", 1);
    let mut anthropic = provider("b", 2);
    anthropic.dialect = Dialect::Anthropic;
    let cases: [(&Provider, &'static str, Failure); 3] = [
        (
            &openai,
            ": hi\n\ndata: {\"error\":{\"message\":\"busy\",\"type\":\"server_error\",\"code\":null}}\n\n",
            Failure::ServerError { status: 500 },
        ),
        // OpenAI names a rate limit in `code`; its `type` is what was limited.
        (
            &openai,
            "data: {\"error\":{\"message\":\"slow down\",\"type\":\"tokens\",\"code\":\"rate_limit_exceeded\"}}\n\n",
            Failure::RateLimited { retry_after: None },
        ),
        (
            &anthropic,
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
            Failure::ServerError { status: 529 },
        ),
    ];
    for (p, error, failure) in cases {
        let script = Streams::new(vec![
            (vec![error], false),
            (vec!["data: {\"n\":1}\n\ndata: [DONE]\n\n"], false),
        ]);
        let mech = streams_mechanics(&rig, &script);
        let mut trail = Trail::default();
        let ok = run(&mech, &stream_plan(vec![p]), &mut trail).await;
        assert_eq!(trail.attempts, 2, "{error}");
        assert_eq!(trail.history[0].failure, failure);
        let whole = whole_stream(ok.ok().expect("a stream")).await;
        assert_eq!(whole, "data: {\"n\":1}\n\ndata: [DONE]\n\n");
    }
    // The agent's own mistake is not retried: the answer is passed on as it came.
    let refused = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"invalid_request_error\",\"message\":\"no\"}}\n\n";
    let script = Streams::new(vec![(vec![refused], false)]);
    let mech = streams_mechanics(&rig, &script);
    let mut trail = Trail::default();
    match run(&mech, &stream_plan(vec![&anthropic]), &mut trail).await {
        Err(Ended::Answer {
            status,
            parts,
            body,
            failure,
            ..
        }) => {
            assert_eq!(parts.status, StatusCode::OK, "passed on as it came");
            assert_eq!(status, StatusCode::BAD_REQUEST, "what it stands for");
            assert_eq!(body, refused.as_bytes());
            assert_eq!(failure, None);
        }
        _ => panic!("expected the error answer"),
    }
    assert_eq!(trail.attempts, 1);
}

/// A turn that opens with a tool call (OpenAI sends the call in its first chunk) has
/// every event held by the gate until the call completes: a break or a stall before
/// then reached nothing of the agent, and is retried like one before the first event.
#[tokio::test(start_paused = true)]
async fn a_break_inside_the_tool_call_a_turn_opens_with_is_retried_invisibly() {
    let rig = Rig::new();
    let mut p = provider("a", 1);
    p.caps.price_out = 5_000_000;
    let call = "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"pay\",\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n";
    let part = "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{}\"}}]},\"finish_reason\":null}]}\n\n";
    let finish = "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n";
    let done = "data: [DONE]\n\n";
    let script = Streams::new(vec![
        // Ends inside the call.
        (vec![call, part], false),
        // Goes quiet inside the call, its connection open.
        (vec![call], true),
        (vec![call, part, finish, done], false),
    ]);
    let mech = streams_mechanics(&rig, &script);
    let started = tokio::time::Instant::now();
    let mut trail = Trail::default();
    let ok = run(&mech, &stream_plan(vec![&p]), &mut trail).await;
    assert_eq!(trail.attempts, 3);
    for h in &trail.history[..2] {
        assert_eq!(
            h.failure,
            Failure::StreamInterrupted {
                events_delivered: 0,
                inside_tool_call: true
            }
        );
    }
    // Each is billed (generated, never seen), at its provider's prices.
    assert_eq!(trail.unseen, vec![p.price(); 2]);
    assert!(
        started.elapsed() >= mech.stream_idle_timeout,
        "the stall ended at the idle limit"
    );
    let whole = whole_stream(ok.ok().expect("a stream")).await;
    assert_eq!(whole, [call, part, finish, done].concat());
}

/// Once the gate lets something through, the attempt is the agent's: a text turn
/// starts at its first event, as before.
#[tokio::test(start_paused = true)]
async fn a_text_turn_starts_at_its_first_event() {
    let rig = Rig::new();
    let p = provider("a", 1);
    let text = "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\n";
    let script = Streams::new(vec![(vec![text], true)]);
    let mech = streams_mechanics(&rig, &script);
    let mut trail = Trail::default();
    let ok = tokio::time::timeout(
        Duration::from_secs(1),
        run(&mech, &stream_plan(vec![&p]), &mut trail),
    )
    .await
    .expect("started at once");
    assert_eq!(trail.attempts, 1);
    let s = ok.ok().expect("a stream");
    assert_eq!(s.first_events.len(), 1);
}

/// What a continuation meets is read as an attempt's answer is: a server error, a
/// 408 or an overloaded stream is the provider failing; a rate limit or a refused
/// request shows it alive.
#[test]
fn answers_and_opening_error_events_say_whether_the_provider_is_broken() {
    for (status, broken) in [
        (500, true),
        (529, true),
        (408, true),
        (429, false),
        (400, false),
        (401, false),
        // A plain answer where a stream was asked for: the provider is alive.
        (200, false),
    ] {
        let status = StatusCode::from_u16(status).expect("a status");
        assert_eq!(answer_says_broken(status, &[]), broken, "{status}");
    }
    let event = |kind: &str| {
        format!(
            "event: error\ndata: {{\"type\":\"error\",\"error\":{{\"type\":\"{kind}\",\"message\":\"m\"}}}}\n\n"
        )
    };
    assert!(error_event_says_broken(
        event("overloaded_error").as_bytes()
    ));
    assert!(error_event_says_broken(event("api_error").as_bytes()));
    assert!(!error_event_says_broken(
        event("rate_limit_error").as_bytes()
    ));
    assert!(!error_event_says_broken(
        event("invalid_request_error").as_bytes()
    ));
}
