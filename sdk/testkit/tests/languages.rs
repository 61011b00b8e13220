//! The example policies in other languages — Python (`examples/policies/python`),
//! JavaScript (`examples/policies/js`) and a third-party Rust crate
//! (`examples/policies/rust`) — on the host the sidecar runs: each passes `check`
//! (which runs the conformance suite), replays its `scenario.toml`, and makes the
//! decisions it exists for.
//!
//! The components are built by `examples/policies/build-all.sh DIR`; CI runs it and
//! sets `OUTRIGGER_EXAMPLE_POLICIES=DIR`. Without that variable these tests build
//! nothing: they print that they were skipped and pass. A Python or JavaScript
//! component takes seconds to compile, so one kit serves the whole process with its
//! default on-disk cache of compiled components (keyed by content hash and engine):
//! each component is compiled once, and every later load deserializes it.

#![expect(
    clippy::expect_used,
    reason = "a test fails loudly on a missing or broken fixture"
)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use outrigger_policy::{Hook, Loaded};
use outrigger_policy_testkit::{Kit, KitOptions, Scenario};
use outrigger_types::{
    BudgetDecision, BudgetRequest, CallContext, CallKind, DowngradeOption, Failure, Limits,
    RetryBudget, RetryDecision, ToolClass, Usage,
};

const DIR_VAR: &str = "OUTRIGGER_EXAMPLE_POLICIES";

/// One kit (engine, epoch thread, cache) for every test of the process.
fn kit() -> &'static Kit {
    static KIT: OnceLock<Kit> = OnceLock::new();
    KIT.get_or_init(|| Kit::new(KitOptions::default()).expect("kit"))
}

/// The built component `file`, or `None` (after saying so) when the examples were
/// not built for this run.
fn example(file: &str) -> Option<Vec<u8>> {
    let dir = std::env::var_os(DIR_VAR).filter(|dir| !dir.is_empty());
    let Some(dir) = dir else {
        // Straight to stderr: the harness captures `println!` of a passing test, and
        // a skip should show in CI's log.
        let _ = writeln!(
            std::io::stderr(),
            "skipped: {DIR_VAR} is not set (build the examples with \
             examples/policies/build-all.sh DIR, then set {DIR_VAR}=DIR)"
        );
        return None;
    };
    let path = PathBuf::from(dir).join(file);
    match std::fs::read(&path) {
        Ok(bytes) => Some(bytes),
        Err(e) => panic!(
            "{}: {e}; {DIR_VAR} is set, so examples/policies/build-all.sh should have built it",
            path.display()
        ),
    }
}

fn params<const N: usize>(pairs: [(&str, &str); N]) -> BTreeMap<String, String> {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Valid, exactly one hook, conformant with default parameters and with
/// `configured` ones.
fn assert_conformant(bytes: &[u8], hook: Hook, configured: BTreeMap<String, String>) {
    let report = kit().check(bytes, BTreeMap::new());
    assert!(report.passed(), "{report}");
    assert_eq!(report.hooks, [hook]);
    assert_eq!(report.packages, ["outrigger:policy@0.1.0"]);
    let conformance = report.conformance.as_ref().expect("conformance ran");
    assert!(conformance.outcomes.len() >= 7, "{conformance}");
    println!(
        "{hook} policy: {} bytes, loaded in {:.1} ms (from cache: {:?}), {} checks",
        report.size_bytes,
        report.load_ms.unwrap_or_default(),
        report.from_cache,
        conformance.outcomes.len()
    );
    let loaded = kit().load(bytes, configured).expect("loads");
    let configured = kit().conformance(&loaded);
    assert!(configured.passed(), "with its parameters:\n{configured}");
}

/// Every step of `examples/policies/<folder>/scenario.toml` decides as it expects.
fn assert_scenario_passes(bytes: &[u8], folder: &str) -> Scenario {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/policies")
        .join(folder)
        .join("scenario.toml");
    let text = std::fs::read_to_string(&path).expect("the example's scenario");
    let scenario = Scenario::from_toml(&text).expect("the scenario parses");
    let report = kit()
        .run_scenario(bytes, &scenario)
        .expect("the scenario runs");
    assert_eq!(report.steps.len(), scenario.steps.len());
    assert!(report.passed(), "{}:\n{report}", path.display());
    scenario
}

fn downgrade(model: &str, per_mtok_in: u64, per_mtok_out: u64) -> DowngradeOption {
    DowngradeOption {
        model: model.into(),
        cost_per_mtok_in: per_mtok_in,
        cost_per_mtok_out: per_mtok_out,
    }
}

/// A call of 500 prompt tokens for a task with a 10 000-token limit that has used
/// `used_in` so far: the projection is `used_in + 500` of 10 000.
fn budget_at(used_in: u64) -> BudgetRequest {
    BudgetRequest {
        task_id: Some("task-1".into()),
        request_id: "call-1".into(),
        model: "big".into(),
        estimated_tokens_in: 500,
        estimated_tokens_out: 0,
        estimated_cost_micros: 1_500,
        usage: Usage {
            tokens_in: used_in,
            ..Usage::default()
        },
        limits: Limits {
            tokens_total: Some(10_000),
            ..Limits::default()
        },
        // The cheapest is neither first nor last.
        downgrades: vec![
            downgrade("medium", 1_000_000, 4_000_000),
            downgrade("small", 150_000, 600_000),
            downgrade("mini", 400_000, 1_600_000),
        ],
    }
}

fn reject_reason(loaded: &Loaded, request: &BudgetRequest) -> String {
    match loaded.budget(request) {
        Ok(BudgetDecision::Reject(reason)) => reason,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn python_budget_policy_downgrades_past_80_and_rejects_past_100_percent() {
    let Some(bytes) = example("budget_py.wasm") else {
        return;
    };
    let scenario_params = params([("downgrade_at", "0.8"), ("reject_at", "1.0")]);
    assert_conformant(&bytes, Hook::Budget, scenario_params.clone());
    let scenario = assert_scenario_passes(&bytes, "python");
    assert_eq!(scenario.params, scenario_params);

    let defaults = kit().load(&bytes, BTreeMap::new()).expect("loads");
    assert_eq!(
        defaults.budget(&budget_at(7_400)),
        Ok(BudgetDecision::Admit)
    );
    // Exactly 80 % is not past 80 %.
    assert_eq!(
        defaults.budget(&budget_at(7_500)),
        Ok(BudgetDecision::Admit)
    );
    assert_eq!(
        defaults.budget(&budget_at(7_600)),
        Ok(BudgetDecision::Downgrade("small".into()))
    );
    assert_eq!(
        defaults.budget(&budget_at(9_500)),
        Ok(BudgetDecision::Downgrade("small".into()))
    );
    let reason = reject_reason(&defaults, &budget_at(9_600));
    assert!(
        reason.contains("tokens_total limit") && reason.contains("10100 of 10000"),
        "{reason}"
    );

    // The cheapest model is never the one asked for.
    let mut on_small = budget_at(7_600);
    on_small.model = "small".into();
    assert_eq!(
        defaults.budget(&on_small),
        Ok(BudgetDecision::Downgrade("mini".into()))
    );
    // Past 100 % of the cost, nothing cheaper offered: refused, naming the cost.
    let cost = BudgetRequest {
        usage: Usage {
            cost_micros: 999_000,
            ..Usage::default()
        },
        limits: Limits {
            cost_micros: Some(1_000_000),
            ..Limits::default()
        },
        downgrades: Vec::new(),
        ..budget_at(0)
    };
    let reason = reject_reason(&defaults, &cost);
    assert!(reason.starts_with("cost limit"), "{reason}");

    // The thresholds come from the binding's parameters.
    let strict = kit()
        .load(
            &bytes,
            params([("downgrade_at", "0.5"), ("reject_at", "0.7")]),
        )
        .expect("loads");
    assert_eq!(strict.budget(&budget_at(4_400)), Ok(BudgetDecision::Admit));
    assert_eq!(
        strict.budget(&budget_at(5_600)),
        Ok(BudgetDecision::Downgrade("small".into()))
    );
    assert!(reject_reason(&strict, &budget_at(6_600)).contains("tokens_total"));
    // A parameter that does not parse keeps its default rather than failing calls.
    let typo = kit()
        .load(&bytes, params([("downgrade_at", "eighty percent")]))
        .expect("loads");
    assert_eq!(typo.budget(&budget_at(7_400)), Ok(BudgetDecision::Admit));
    assert_eq!(
        typo.budget(&budget_at(7_600)),
        Ok(BudgetDecision::Downgrade("small".into()))
    );
}

fn failed_call(failure_target: &str, fallbacks: &[&str]) -> CallContext {
    CallContext {
        task_id: Some("task-1".into()),
        request_id: "call-1".into(),
        kind: CallKind::Model,
        target: failure_target.into(),
        model: Some("gpt-4o".into()),
        tool_class: None,
        attempt: 1,
        elapsed: Duration::from_millis(300),
        dispatched: true,
        history: Vec::new(),
        retry_budget: RetryBudget::default(),
        fallbacks: fallbacks.iter().map(|f| (*f).to_string()).collect(),
    }
}

fn give_up_reason(decision: Result<RetryDecision, outrigger_policy::Fault>) -> String {
    match decision {
        Ok(RetryDecision::GiveUp(reason)) => reason,
        other => panic!("expected a give-up, got {other:?}"),
    }
}

#[test]
fn javascript_retry_policy_routes_by_failure() {
    let Some(bytes) = example("retry_js.wasm") else {
        return;
    };
    let configured = params([("long_context_target", "long-context")]);
    assert_conformant(&bytes, Hook::Retry, configured.clone());
    assert_scenario_passes(&bytes, "js");

    let policy = kit().load(&bytes, configured).expect("loads");
    let call = failed_call("primary", &["backup", "long-context"]);

    // Context overflow goes to the long-context target, not to the first fallback.
    assert_eq!(
        policy.retry(&call, &Failure::ContextOverflow),
        Ok(RetryDecision::FallBack("long-context".into()))
    );
    // Without a long-context target configured there is nowhere it would fit.
    let unconfigured = kit().load(&bytes, BTreeMap::new()).expect("loads");
    let reason = give_up_reason(unconfigured.retry(&call, &Failure::ContextOverflow));
    assert!(reason.contains("long_context_target"), "{reason}");

    // Content filtered: given up at once, with fallbacks and budget to spare.
    let reason = give_up_reason(policy.retry(&call, &Failure::ContentFiltered));
    assert!(reason.contains("content filtered"), "{reason}");

    // 429 with Retry-After: waits exactly that long; beyond the policy's maximum
    // (30 s by default) it moves to the next fallback instead.
    let retry_after = |ms| Failure::RateLimited {
        retry_after: Some(Duration::from_millis(ms)),
    };
    assert_eq!(
        policy.retry(&call, &retry_after(1_500)),
        Ok(RetryDecision::RetryAfter(Duration::from_millis(1_500)))
    );
    assert_eq!(
        policy.retry(&call, &retry_after(45_000)),
        Ok(RetryDecision::FallBack("backup".into()))
    );
    // Without Retry-After: jittered backoff under the first ceiling (250 ms).
    match policy.retry(&call, &Failure::RateLimited { retry_after: None }) {
        Ok(RetryDecision::RetryAfter(delay)) => {
            assert!(delay <= Duration::from_millis(250), "{delay:?}");
        }
        other => panic!("expected a backoff, got {other:?}"),
    }
    // An unsafe tool call that may have reached the tool is never sent again.
    let payment = CallContext {
        kind: CallKind::Tool,
        tool_class: Some(ToolClass::Unsafe),
        model: None,
        ..failed_call("payments", &[])
    };
    let reason = give_up_reason(policy.retry(&payment, &Failure::ServerError { status: 502 }));
    assert!(reason.contains("not re-sending"), "{reason}");
}

#[test]
fn rust_example_retries_within_the_call_deadline() {
    let Some(bytes) = example("deadline_retry.wasm") else {
        return;
    };
    assert_conformant(&bytes, Hook::Retry, params([("deadline_ms", "10000")]));
    assert_scenario_passes(&bytes, "rust");

    let policy = kit().load(&bytes, BTreeMap::new()).expect("loads");
    let at = |elapsed_ms| CallContext {
        elapsed: Duration::from_millis(elapsed_ms),
        ..failed_call("primary", &["backup"])
    };
    let late_retry_after = Failure::RateLimited {
        retry_after: Some(Duration::from_secs(9)),
    };
    match policy.retry(&at(200), &Failure::ServerError { status: 503 }) {
        Ok(RetryDecision::RetryAfter(delay)) => {
            assert!(delay <= Duration::from_millis(100), "{delay:?}");
        }
        other => panic!("expected a backoff, got {other:?}"),
    }
    assert_eq!(
        policy.retry(&at(4_500), &late_retry_after),
        Ok(RetryDecision::FallBack("backup".into()))
    );
    let reason = give_up_reason(policy.retry(&at(9_200), &Failure::Timeout));
    assert!(reason.contains("no time"), "{reason}");

    // A longer deadline from config makes the same Retry-After fit.
    let patient = kit()
        .load(&bytes, params([("deadline_ms", "30000")]))
        .expect("loads");
    assert_eq!(
        patient.retry(&at(4_500), &late_retry_after),
        Ok(RetryDecision::RetryAfter(Duration::from_secs(9)))
    );
}
