//! The policy host against real components: the built-ins from `outrigger-builtins`
//! and the misbehaving guest in `tests/guests/misbehave`, built here for wasm32-wasip2
//! the same way the build script builds the plugins.

#![expect(
    clippy::expect_used,
    reason = "a test fails loudly on a broken fixture"
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use outrigger_policy::{
    Binding, BuiltinComponent, Compiler, Hook, MAX_RETRY_DELAY_PARAM, OnError, Options, Registry,
    ReloadOutcome, Runtime, RuntimeOptions, Source,
};
use outrigger_types::{
    AttemptRecord, BudgetDecision, BudgetRequest, CallContext, CallKind, Candidate, CircuitState,
    DecisionSource, DowngradeOption, Failure, FallbackRequest, GpuState, Limits, Modalities,
    PolicyVersion, RetryBudget, RetryDecision, ToolClass, Usage,
};

fn builtins() -> Vec<BuiltinComponent> {
    outrigger_builtins::ALL
        .iter()
        .map(|b| BuiltinComponent {
            name: b.name,
            bytes: b.bytes,
        })
        .collect()
}

fn builtin_version(hook: Hook) -> PolicyVersion {
    let builtin = outrigger_builtins::by_name(hook.as_str()).expect("built-in exists");
    PolicyVersion::new(hook.as_str(), builtin.sha256)
}

/// The misbehaving guest, built once per test run.
fn misbehave() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        // tests run from <target>/<profile>/deps/; build next to the plugins.
        let exe = std::env::current_exe().expect("test executable path");
        let target_dir = exe
            .ancestors()
            .nth(3)
            .map(|t| t.join("wasm-plugins"))
            .expect("target dir");
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .arg("build")
            .arg("--manifest-path")
            .arg(workspace.join("Cargo.toml"))
            .args(["--target", "wasm32-wasip2", "--profile", "plugin"])
            .args(["-p", "outrigger-test-guest-misbehave"])
            .arg("--target-dir")
            .arg(&target_dir);
        for var in [
            "RUSTFLAGS",
            "CARGO_ENCODED_RUSTFLAGS",
            "RUSTC_WORKSPACE_WRAPPER",
            "RUSTC_WRAPPER",
            "CARGO_TARGET_DIR",
        ] {
            cargo.env_remove(var);
        }
        let output = cargo.output().expect("run cargo");
        assert!(
            output.status.success(),
            "building the test guest failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        std::fs::read(target_dir.join("wasm32-wasip2/plugin/outrigger_test_guest_misbehave.wasm"))
            .expect("read the test guest")
    })
}

fn version_of(bytes: &[u8], hook: Hook) -> PolicyVersion {
    use sha2::Digest;
    let hash: String = sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    PolicyVersion::new(hook.as_str(), &hash)
}

struct Fixture {
    registry: Registry,
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new(bindings: Vec<Binding>, tweak: impl FnOnce(&mut Options)) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut options = Options {
            dir: Some(dir.path().join("policies")),
            cache_dir: Some(dir.path().join("cache")),
            bindings,
            deadline: Duration::from_millis(300),
            seed: Some(7),
            ..Options::default()
        };
        std::fs::create_dir_all(dir.path().join("policies")).expect("policy dir");
        tweak(&mut options);
        let registry = Registry::new(options, builtins()).expect("registry");
        Self { registry, dir }
    }

    fn policy_path(&self, stem: &str) -> PathBuf {
        self.dir
            .path()
            .join("policies")
            .join(format!("{stem}.wasm"))
    }

    /// Replaces a policy file the way an operator should: temp file + rename.
    fn install(&self, stem: &str, bytes: &[u8]) {
        let tmp = self
            .dir
            .path()
            .join("policies")
            .join(format!(".{stem}.tmp"));
        std::fs::write(&tmp, bytes).expect("write");
        std::fs::rename(&tmp, self.policy_path(stem)).expect("rename");
    }
}

fn named(hook: Hook, stem: &str) -> Binding {
    Binding {
        hook,
        source: Source::Named(stem.into()),
        params: BTreeMap::new(),
        on_error: OnError::FailOpen,
    }
}

fn ctx(request_id: &str, attempt: u32) -> CallContext {
    CallContext {
        task_id: Some("task-1".into()),
        request_id: request_id.into(),
        kind: CallKind::Model,
        target: "openai".into(),
        model: Some("gpt-4o".into()),
        tool_class: None,
        attempt,
        elapsed: Duration::from_millis(40),
        dispatched: true,
        history: Vec::new(),
        retry_budget: RetryBudget::default(),
        fallbacks: vec!["openai".into(), "anthropic".into()],
    }
}

fn candidate(name: &str) -> Candidate {
    Candidate {
        name: name.into(),
        supports_tools: true,
        supports_streaming: true,
        context_window: 0,
        modalities: Modalities::EMPTY,
        circuit: CircuitState::Closed,
        local: false,
        gpu: None,
        cost_per_mtok_in: 0,
        cost_per_mtok_out: 0,
    }
}

fn fallback_request(request_id: &str, candidates: Vec<Candidate>) -> FallbackRequest {
    FallbackRequest {
        task_id: None,
        request_id: request_id.into(),
        model: "m".into(),
        needs_tools: false,
        streaming: false,
        estimated_tokens: 0,
        modalities: Modalities::TEXT,
        candidates,
    }
}

/// The names of the candidates a fallback decision picked, in its order.
fn names<'a>(request: &'a FallbackRequest, order: &[usize]) -> Vec<&'a str> {
    order
        .iter()
        .map(|&i| request.candidates[i].name.as_str())
        .collect()
}

fn budget_request(request_id: &str, usage: Usage, limits: Limits) -> BudgetRequest {
    BudgetRequest {
        task_id: Some("task-1".into()),
        request_id: request_id.into(),
        model: "big".into(),
        estimated_tokens_in: 100,
        estimated_tokens_out: 0,
        estimated_cost_micros: 100,
        usage,
        limits,
        downgrades: vec![
            DowngradeOption {
                model: "medium".into(),
                cost_per_mtok_in: 5,
                cost_per_mtok_out: 5,
            },
            DowngradeOption {
                model: "small".into(),
                cost_per_mtok_in: 1,
                cost_per_mtok_out: 1,
            },
        ],
    }
}

#[test]
fn builtin_retry_decisions() {
    let f = Fixture::new(Vec::new(), |_| {});
    let r = &f.registry;
    let rate_limited = Failure::RateLimited {
        retry_after: Some(Duration::from_secs(2)),
    };
    let d = r.retry(&ctx("r1", 1), &rate_limited);
    assert_eq!(
        d.value,
        RetryDecision::RetryAfter(Duration::from_millis(2000))
    );
    assert_eq!(d.source, DecisionSource::Policy);
    assert_eq!(d.version, builtin_version(Hook::Retry));

    let give_up = |d: &RetryDecision| matches!(d, RetryDecision::GiveUp(_));
    assert!(give_up(
        &r.retry(&ctx("r2", 1), &Failure::ContentFiltered).value
    ));
    assert!(give_up(
        &r.retry(&ctx("r3", 1), &Failure::ToolParseError).value
    ));
    assert_eq!(
        r.retry(&ctx("r4", 1), &Failure::ContextOverflow).value,
        RetryDecision::FallBack("anthropic".into())
    );
    // A fourth attempt on openai, after one on anthropic: attempts on openai are
    // spent and the only other fallback was tried.
    let mut tried = ctx("r5", 5);
    for target in ["anthropic", "openai", "openai", "openai"] {
        tried.history.push(AttemptRecord {
            target: target.into(),
            failure: Failure::Timeout,
            elapsed: Duration::from_millis(1),
        });
    }
    assert!(give_up(
        &r.retry(&tried, &Failure::ServerError { status: 503 }).value
    ));
    // The target fallen back to gets its own attempts: four on openai, then the
    // first on anthropic is retried.
    let mut fell_back = ctx("r5b", 5);
    fell_back.target = "anthropic".into();
    for _ in 0..4 {
        fell_back.history.push(AttemptRecord {
            target: "openai".into(),
            failure: Failure::Timeout,
            elapsed: Duration::from_millis(1),
        });
    }
    assert!(matches!(
        r.retry(&fell_back, &Failure::RateLimited { retry_after: None }).value,
        RetryDecision::RetryAfter(d) if d <= Duration::from_millis(200)
    ));

    let unsafe_tool = CallContext {
        kind: CallKind::Tool,
        tool_class: Some(ToolClass::Unsafe),
        ..ctx("r6", 1)
    };
    assert!(give_up(&r.retry(&unsafe_tool, &Failure::Timeout).value));
    let before_send = CallContext {
        dispatched: false,
        ..unsafe_tool
    };
    assert!(matches!(
        r.retry(&before_send, &Failure::Connect { sent: false }).value,
        RetryDecision::RetryAfter(d) if d <= Duration::from_millis(200)
    ));

    let no_budget = CallContext {
        retry_budget: RetryBudget {
            available: false,
            ..RetryBudget::default()
        },
        fallbacks: Vec::new(),
        ..ctx("r7", 1)
    };
    assert!(give_up(
        &r.retry(&no_budget, &Failure::ServerError { status: 502 })
            .value
    ));

    for attempt in [1, 2, 3] {
        match r.retry(&ctx("r8", attempt), &Failure::Timeout).value {
            RetryDecision::RetryAfter(d) => {
                assert!(
                    d <= Duration::from_millis(200 << (attempt - 1)),
                    "{attempt}: {d:?}"
                )
            }
            other => panic!("attempt {attempt}: {other:?}"),
        }
    }
}

/// The operator's `max_retry_delay` reaches the retry built-in: a `Retry-After`
/// beyond it is one the built-in does not wait for, so the call falls back on the
/// built-in's own decision instead of the host refusing it and giving up.
#[test]
fn the_retry_builtin_keeps_within_the_hosts_longest_delay() {
    let rate_limited = |secs| Failure::RateLimited {
        retry_after: Some(Duration::from_secs(secs)),
    };
    let explicit = Binding {
        hook: Hook::Retry,
        source: Source::Builtin("retry".into()),
        params: BTreeMap::from([(MAX_RETRY_DELAY_PARAM.to_string(), "60000".to_string())]),
        on_error: OnError::FailOpen,
    };
    // Unbound (the built-in decides) and bound explicitly, even with a parameter
    // that claims a longer maximum.
    for bindings in [Vec::new(), vec![explicit]] {
        let f = Fixture::new(bindings, |o| o.max_retry_delay = Duration::from_secs(10));
        let d = f.registry.retry(&ctx("long", 1), &rate_limited(15));
        assert_eq!(d.value, RetryDecision::FallBack("anthropic".into()));
        assert_eq!(d.source, DecisionSource::Policy);
        assert_eq!(d.version, builtin_version(Hook::Retry));
        let d = f.registry.retry(&ctx("fits", 1), &rate_limited(10));
        assert_eq!(d.value, RetryDecision::RetryAfter(Duration::from_secs(10)));
        let status = f.registry.binding_status(Hook::Retry).expect("status");
        assert_eq!(
            status.params.get(MAX_RETRY_DELAY_PARAM).map(String::as_str),
            Some("10000")
        );
        assert_eq!(status.invalid_decisions, 0);
    }
}

#[test]
fn builtin_fallback_and_budget_decisions() {
    let f = Fixture::new(Vec::new(), |_| {});
    let r = &f.registry;
    let open = Candidate {
        circuit: CircuitState::Open,
        ..candidate("open")
    };
    let half = Candidate {
        circuit: CircuitState::HalfOpen,
        ..candidate("half")
    };
    let sick = Candidate {
        local: true,
        gpu: Some(GpuState::Unhealthy),
        ..candidate("sick-gpu")
    };
    let no_tools = Candidate {
        supports_tools: false,
        ..candidate("no-tools")
    };
    let request = FallbackRequest {
        needs_tools: true,
        ..fallback_request(
            "f1",
            vec![half, candidate("a"), open, sick, no_tools, candidate("b")],
        )
    };
    let d = r.fallback(&request);
    assert_eq!(names(&request, &d.value), ["a", "b", "half"]);
    assert_eq!(d.version, builtin_version(Hook::Fallback));

    // Each candidate's own modalities reach the guest: only those accepting every
    // modality the request uses are kept, and an empty set means unknown.
    let accepts = |name: &str, modalities: &[&str]| Candidate {
        modalities: Modalities::from_names(modalities).unwrap(),
        ..candidate(name)
    };
    let request = FallbackRequest {
        modalities: Modalities::TEXT | Modalities::IMAGE,
        ..fallback_request(
            "f-modalities",
            vec![
                accepts("text-only", &["text"]),
                accepts("vision", &["image", "text"]),
                accepts("unknown", &[]),
                accepts("audio", &["text", "audio"]),
                accepts("all", &["text", "image", "audio"]),
            ],
        )
    };
    assert_eq!(
        names(&request, &r.fallback(&request).value),
        ["vision", "unknown", "all"]
    );
    let documents = FallbackRequest {
        modalities: Modalities::TEXT | Modalities::DOCUMENT,
        ..request.clone()
    };
    assert_eq!(
        names(&documents, &r.fallback(&documents).value),
        ["unknown"]
    );

    let limits = Limits {
        tokens_total: Some(1_000),
        ..Limits::default()
    };
    let used = |tokens_in| Usage {
        tokens_in,
        ..Usage::default()
    };
    assert_eq!(
        r.budget(&budget_request("b1", used(100), limits)).value,
        BudgetDecision::Admit
    );
    assert_eq!(
        r.budget(&budget_request("b2", used(750), limits)).value,
        BudgetDecision::Downgrade("small".into())
    );
    match r.budget(&budget_request("b3", used(950), limits)).value {
        BudgetDecision::Reject(reason) => assert!(reason.contains("tokens_total"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        r.budget(&budget_request("b4", used(0), Limits::default()))
            .value,
        BudgetDecision::Admit
    );
}

#[test]
fn seeded_randomness_makes_decisions_repeatable() {
    let first = Fixture::new(vec![named(Hook::Retry, "jitter")], |o| o.seed = Some(42));
    first.install("jitter", misbehave());
    assert!(first.registry.reload().is_ok());
    let second = Fixture::new(Vec::new(), |o| o.seed = Some(42));
    let jitter = ctx("jitter", 1);
    let a: Vec<_> = (0..5)
        .map(|_| first.registry.retry(&jitter, &Failure::Timeout).value)
        .collect();
    assert!(
        a.windows(2).all(|w| w[0] == w[1]),
        "same seed, same draw: {a:?}"
    );
    // The built-in retry with the same seed: repeatable too.
    let b1 = second.registry.retry(&ctx("x", 3), &Failure::Timeout).value;
    let b2 = second.registry.retry(&ctx("x", 3), &Failure::Timeout).value;
    assert_eq!(b1, b2);
}

#[test]
fn bad_versions_never_replace_a_good_one() {
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |o| {
        o.deadline = Duration::from_millis(100);
        o.memory_limit_bytes = 16 << 20;
    });
    f.install("p", misbehave());
    let good = version_of(misbehave(), Hook::Retry);
    assert!(matches!(
        f.registry.reload().outcome(Hook::Retry),
        Some(ReloadOutcome::Loaded { version, .. }) if *version == good
    ));

    let empty_component = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];
    let core_module = [0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00];
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("not wasm", b"hello".to_vec(), "not a WebAssembly binary"),
        ("core module", core_module.to_vec(), "not a component"),
        ("wrong world", empty_component.to_vec(), "no policy hook"),
        (
            "other hook",
            outrigger_builtins::BUDGET.to_vec(),
            "implements budget but not the retry hook",
        ),
    ];
    for (name, bytes, expected) in cases {
        f.install("p", &bytes);
        let report = f.registry.reload();
        match report.outcome(Hook::Retry) {
            Some(ReloadOutcome::Failed { error, serving }) => {
                assert!(error.contains(expected), "{name}: {error}");
                assert_eq!(serving.as_ref(), Some(&good), "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
        let status = f.registry.binding_status(Hook::Retry).expect("status");
        assert_eq!(status.version.as_ref(), Some(&good), "{name}");
        assert!(status.last_error.is_some(), "{name}");
        assert_eq!(
            f.registry.retry(&ctx("ok", 1), &Failure::Timeout).version,
            good,
            "{name}"
        );
    }

    // Components that trap, loop or blow their memory on every call fail the smoke
    // test and are never published either.
    f.install("p", misbehave());
    for (mode, expected) in [
        ("trap", "trapped"),
        ("loop", "deadline"),
        ("hog", "memory limit"),
        ("invalid", "invalid decision"),
    ] {
        let mut binding = named(Hook::Retry, "p");
        binding.params.insert("mode".into(), mode.into());
        let report = f.registry.reconfigure(vec![binding]).expect("reconfigure");
        match report.outcome(Hook::Retry) {
            Some(ReloadOutcome::Failed { error, .. }) => {
                assert!(error.contains(expected), "{mode}: {error}")
            }
            other => panic!("{mode}: {other:?}"),
        }
        let status = f.registry.binding_status(Hook::Retry).expect("status");
        assert!(
            status.params.is_empty(),
            "{mode}: the good version keeps serving"
        );
    }
    let status = f.registry.binding_status(Hook::Retry).expect("status");
    // Eight refusals, plus the start-up load before the file existed.
    assert_eq!(status.load_errors, 9);
}

/// The call's ids are not in the hook's input: the guest asks the host, and gets
/// the ids of the call it is deciding, never those of the instance's last call.
#[test]
fn a_policy_asks_the_host_for_the_calls_ids() {
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |_| {});
    f.install("p", misbehave());
    assert!(f.registry.reload().is_ok());
    let reason = |ctx: &CallContext| match f.registry.retry(ctx, &Failure::Timeout).value {
        RetryDecision::GiveUp(reason) => reason,
        other => panic!("{other:?}"),
    };
    assert_eq!(reason(&ctx("ids", 1)), r#"task=Some("task-1") request=ids"#);
    let no_task = CallContext {
        task_id: None,
        ..ctx("ids", 1)
    };
    assert_eq!(reason(&no_task), "task=None request=ids");
    assert_eq!(reason(&ctx("ids", 2)), r#"task=Some("task-1") request=ids"#);
}

/// S4: a policy gets no capabilities. The guest asks for the environment, the file
/// system and a loopback socket, and reports what it got.
#[test]
fn a_policy_that_reaches_for_env_files_or_network_gets_nothing() {
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |_| {});
    f.install("p", misbehave());
    assert!(f.registry.reload().is_ok());
    let d = f.registry.retry(&ctx("reach", 1), &Failure::Timeout);
    assert_eq!(d.source, DecisionSource::Policy);
    match d.value {
        RetryDecision::GiveUp(reason) => {
            assert_eq!(reason, "env:none fs:denied net:denied");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn faults_at_call_time_are_contained_and_counted() {
    let f = Fixture::new(
        vec![
            named(Hook::Retry, "p"),
            named(Hook::Fallback, "p"),
            named(Hook::Budget, "p"),
        ],
        |o| {
            o.deadline = Duration::from_millis(100);
            o.memory_limit_bytes = 16 << 20;
        },
    );
    f.install("p", misbehave());
    assert!(f.registry.reload().is_ok());
    let ours = version_of(misbehave(), Hook::Retry);

    let normal = f.registry.retry(&ctx("fine", 1), &Failure::Timeout);
    assert_eq!(
        (normal.source, &normal.version),
        (DecisionSource::Policy, &ours)
    );

    for mode in ["trap", "loop", "hog", "invalid"] {
        let d = f.registry.retry(&ctx(mode, 1), &Failure::Timeout);
        assert_eq!(d.source, DecisionSource::Contained, "{mode}");
        assert_eq!(
            d.version,
            builtin_version(Hook::Retry),
            "{mode}: the built-in decides"
        );
        // The instance that failed is gone; the next call gets a fresh one.
        let after = f.registry.retry(&ctx("fine", 1), &Failure::Timeout);
        assert_eq!(after.source, DecisionSource::Policy, "{mode}");
    }
    let s = f.registry.binding_status(Hook::Retry).expect("status");
    assert_eq!(
        (
            s.traps,
            s.timeouts,
            s.memory_exceeded,
            s.invalid_decisions,
            s.contained
        ),
        (1, 1, 1, 1, 4)
    );
    assert_eq!(s.calls, 9);

    // The guest answers an index past the last candidate: refused, contained.
    let order = f.registry.fallback(&fallback_request(
        "invalid",
        vec![candidate("a"), candidate("b")],
    ));
    assert_eq!(order.source, DecisionSource::Contained);
    assert_eq!(order.value, [0, 1]);
    let budget = f.registry.budget(&budget_request(
        "invalid",
        Usage::default(),
        Limits::default(),
    ));
    assert_eq!(budget.source, DecisionSource::Contained);
    assert_eq!(budget.value, BudgetDecision::Admit);
}

#[test]
fn the_previous_version_decides_before_the_builtin() {
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |_| {});
    f.install("p", outrigger_builtins::RETRY);
    assert!(f.registry.reload().is_ok());
    f.install("p", misbehave());
    assert!(f.registry.reload().is_ok());
    let s = f.registry.binding_status(Hook::Retry).expect("status");
    assert_eq!(s.previous_version, Some(builtin_version(Hook::Retry)));

    let mut params = BTreeMap::new();
    params.insert("delay_ms".to_string(), "5".to_string());
    let mut custom = named(Hook::Retry, "p");
    custom.params = params;
    // Same bytes, new parameters: a new publication whose previous is the misbehave
    // guest without parameters.
    f.registry.reconfigure(vec![custom]).expect("reconfigure");
    let d = f.registry.retry(&ctx("fine", 1), &Failure::Timeout);
    assert_eq!(d.value, RetryDecision::RetryAfter(Duration::from_millis(5)));
    let trapped = f.registry.retry(&ctx("trap", 1), &Failure::Timeout);
    // The previous version is the same guest and traps too; the built-in decides.
    assert_eq!(trapped.version, builtin_version(Hook::Retry));
    assert_eq!(trapped.source, DecisionSource::Contained);
}

/// After a revert, the version reverted from (it failed while it served) is not
/// kept to stand in for the version reverted to.
#[test]
fn a_version_that_failed_never_stands_in_after_a_revert() {
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |_| {});
    f.install("p", outrigger_builtins::RETRY);
    assert!(f.registry.reload().is_ok());
    f.install("p", misbehave());
    assert!(f.registry.reload().is_ok());
    let d = f.registry.retry(&ctx("trap", 1), &Failure::Timeout);
    assert_eq!(
        (d.source, &d.version),
        (DecisionSource::Contained, &builtin_version(Hook::Retry)),
        "v2 traps, v1 stands in"
    );
    // The operator reverts to v1.
    f.install("p", outrigger_builtins::RETRY);
    assert!(
        f.registry
            .reconfigure(vec![named(Hook::Retry, "p")])
            .expect("revert")
            .is_ok()
    );
    let s = f.registry.binding_status(Hook::Retry).expect("status");
    assert_eq!(s.version, Some(builtin_version(Hook::Retry)));
    assert_eq!(
        s.previous_version, None,
        "neither the failed v2 nor v1 itself stands in for v1"
    );

    // A version that served without failing is kept.
    f.install("p", misbehave());
    assert!(f.registry.reload().is_ok());
    let s = f.registry.binding_status(Hook::Retry).expect("status");
    assert_eq!(s.previous_version, Some(builtin_version(Hook::Retry)));
}

/// A fail-closed binding whose policy could not be loaded at all gives the strict
/// decision too: the built-in does not stand in for what the operator wanted closed.
#[test]
fn fail_closed_holds_while_nothing_is_loaded() {
    let f = Fixture::new(
        vec![Binding {
            on_error: OnError::FailClosed,
            ..named(Hook::Budget, "missing")
        }],
        |_| {},
    );
    let b = f
        .registry
        .budget(&budget_request("r", Usage::default(), Limits::default()));
    assert_eq!(b.source, DecisionSource::Contained);
    match b.value {
        BudgetDecision::Reject(reason) => {
            assert!(reason.contains("failing closed"), "{reason}")
        }
        other => panic!("the built-in admitted: {other:?}"),
    }
    let status = f.registry.binding_status(Hook::Budget).expect("status");
    assert_eq!(status.failed_closed, 1, "{status:?}");
}

#[test]
fn fail_closed_gives_the_strict_decision() {
    let closed = |hook| Binding {
        on_error: OnError::FailClosed,
        ..named(hook, "p")
    };
    let f = Fixture::new(
        vec![
            closed(Hook::Retry),
            closed(Hook::Fallback),
            closed(Hook::Budget),
        ],
        |_| {},
    );
    f.install("p", misbehave());
    assert!(f.registry.reload().is_ok());
    let ours = version_of(misbehave(), Hook::Retry);
    let d = f.registry.retry(&ctx("trap", 1), &Failure::Timeout);
    assert_eq!(d.source, DecisionSource::Contained);
    assert_eq!(d.version, ours);
    match d.value {
        RetryDecision::GiveUp(reason) => {
            assert!(
                reason.contains("failing closed") && reason.contains("trapped"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    let b = f.registry.budget(&budget_request(
        "invalid",
        Usage::default(),
        Limits::default(),
    ));
    assert!(matches!(b.value, BudgetDecision::Reject(reason) if reason.contains("failing closed")));
    let o = f.registry.fallback(&fallback_request(
        "trap",
        vec![candidate("x"), candidate("y")],
    ));
    assert_eq!(o.value, [0, 1]);
    assert_eq!(
        f.registry
            .binding_status(Hook::Retry)
            .map(|s| s.failed_closed),
        Some(1)
    );
}

#[test]
fn a_binding_that_cannot_load_at_startup_is_served_by_the_builtin() {
    let f = Fixture::new(vec![named(Hook::Retry, "missing")], |_| {});
    let s = f.registry.binding_status(Hook::Retry).expect("status");
    assert_eq!(s.version, None);
    assert!(
        s.last_error
            .as_deref()
            .is_some_and(|e| e.contains("missing.wasm"))
    );
    let d = f.registry.retry(&ctx("r", 1), &Failure::ContentFiltered);
    assert_eq!(
        (d.source, d.version),
        (DecisionSource::Contained, builtin_version(Hook::Retry))
    );
    // Once the file appears, a reload picks it up.
    f.install("missing", misbehave());
    assert!(f.registry.reload().is_ok());
    assert_eq!(
        f.registry.retry(&ctx("r", 1), &Failure::Timeout).source,
        DecisionSource::Policy
    );
}

#[test]
fn hot_swap_under_load_loses_no_call() {
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |o| {
        o.deadline = Duration::from_secs(2);
    });
    let versions = [
        (outrigger_builtins::RETRY, builtin_version(Hook::Retry)),
        (misbehave(), version_of(misbehave(), Hook::Retry)),
    ];
    f.install("p", versions[0].0);
    assert!(f.registry.reload().is_ok());

    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let (registry, stop, calls) = (f.registry.clone(), stop.clone(), calls.clone());
            let known: Vec<PolicyVersion> = versions.iter().map(|v| v.1.clone()).collect();
            std::thread::spawn(move || {
                let mut mine = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let d = registry.retry(&ctx(&format!("w{i}"), 1), &Failure::Timeout);
                    assert_eq!(d.source, DecisionSource::Policy, "{d:?}");
                    assert!(known.contains(&d.version), "{d:?}");
                    assert!(matches!(d.value, RetryDecision::RetryAfter(_)), "{d:?}");
                    mine += 1;
                }
                calls.fetch_add(mine, Ordering::Relaxed);
                mine
            })
        })
        .collect();
    for round in 1..=10 {
        let (bytes, version) = &versions[round % 2];
        f.install("p", bytes);
        let report = f.registry.reload();
        assert!(report.is_ok(), "{report:?}");
        assert_eq!(
            f.registry
                .retry(&ctx("after", 1), &Failure::Timeout)
                .version,
            *version,
            "round {round}: calls after a swap see the new version"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let per_worker: Vec<u64> = workers
        .into_iter()
        .map(|w| w.join().expect("worker panicked"))
        .collect();
    assert!(per_worker.iter().all(|n| *n > 0), "{per_worker:?}");
    let s = f.registry.binding_status(Hook::Retry).expect("status");
    assert_eq!(
        s.calls,
        calls.load(Ordering::Relaxed) + 10,
        "every call answered"
    );
    assert_eq!(
        (s.traps, s.timeouts, s.contained, s.in_flight),
        (0, 0, 0, 0)
    );
}

#[test]
fn an_in_flight_call_finishes_on_the_version_it_started_on() {
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |o| {
        o.deadline = Duration::from_secs(10);
    });
    f.install("p", misbehave());
    assert!(f.registry.reload().is_ok());
    let old = version_of(misbehave(), Hook::Retry);
    let registry = f.registry.clone();
    let slow = std::thread::spawn(move || {
        let d = registry.retry(&ctx("slow:1500", 1), &Failure::Timeout);
        (d, Instant::now())
    });
    let waiting = Instant::now();
    while f.registry.binding_status(Hook::Retry).map(|s| s.in_flight) != Some(1) {
        assert!(
            waiting.elapsed() < Duration::from_secs(10),
            "the slow call never started"
        );
        std::thread::yield_now();
    }
    f.install("p", outrigger_builtins::RETRY);
    assert!(f.registry.reload().is_ok());
    let swapped = Instant::now();
    assert_eq!(
        f.registry
            .retry(&ctx("new", 1), &Failure::ContentFiltered)
            .version,
        builtin_version(Hook::Retry)
    );
    let (decided, finished) = slow.join().expect("slow call");
    assert!(
        finished > swapped,
        "the slow call was still running at the swap"
    );
    assert_eq!(decided.version, old);
    assert_eq!(decided.source, DecisionSource::Policy);
    assert_eq!(
        decided.value,
        RetryDecision::RetryAfter(Duration::from_millis(1))
    );
}

#[test]
fn a_second_registry_loads_from_the_cache_without_compiling() {
    let dir = tempfile::tempdir().expect("temp dir");
    let options = || Options {
        cache_dir: Some(dir.path().to_path_buf()),
        ..Options::default()
    };
    let first = Registry::new(options(), builtins()).expect("first");
    let cold = first.status();
    assert!(
        cold.iter().all(|s| s.loaded_from_cache == Some(false)),
        "{cold:?}"
    );
    assert_eq!(first.runtime().compilations(), 3, "one per built-in");
    drop(first);
    let second = Registry::new(options(), builtins()).expect("second");
    let warm = second.status();
    assert!(
        warm.iter().all(|s| s.loaded_from_cache == Some(true)),
        "{warm:?}"
    );
    assert_eq!(second.runtime().compilations(), 0);
    let total =
        |s: &[outrigger_policy::BindingStatus]| s.iter().filter_map(|b| b.load_ms).sum::<f64>();
    assert!(
        total(&warm) < total(&cold),
        "cache {} ms vs compile {} ms",
        total(&warm),
        total(&cold)
    );

    // A corrupt artifact is recompiled, not trusted. (Rewritten in place only after
    // every registry that maps it is gone: the host itself only ever renames.)
    drop(second);
    for entry in std::fs::read_dir(dir.path()).expect("cache dir").flatten() {
        std::fs::write(entry.path(), b"garbage").expect("corrupt");
    }
    let third = Registry::new(options(), builtins()).expect("third");
    assert!(
        third
            .status()
            .iter()
            .all(|s| s.loaded_from_cache == Some(false) && s.version.is_some())
    );
    assert_eq!(third.runtime().compilations(), 3);
}

#[test]
fn configuration_errors_are_reported_together() {
    let err = Registry::new(
        Options {
            bindings: vec![
                Binding::builtin(Hook::Retry),
                Binding::builtin(Hook::Retry),
                named(Hook::Budget, "x"),
                Binding {
                    source: Source::Builtin("nope".into()),
                    ..Binding::builtin(Hook::Fallback)
                },
            ],
            ..Options::default()
        },
        builtins(),
    )
    .expect_err("invalid options");
    let message = err.to_string();
    for part in [
        "bound more than once",
        "no policy directory",
        "no built-in policy named \"nope\"",
    ] {
        assert!(message.contains(part), "{message}");
    }
}

/// The epoch clock ticks only while guest code runs: an idle registry stops
/// waking, and a call after a long idle spell still has its deadline enforced.
#[test]
fn the_epoch_clock_rests_while_idle_and_wakes_for_a_call() {
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |_| {});
    let runtime = f.registry.runtime();
    // Wait (bounded) until two readings 200 ms apart agree: the ticker has parked.
    let started = std::time::Instant::now();
    let rested = loop {
        let before = runtime.ticks();
        std::thread::sleep(Duration::from_millis(200));
        let after = runtime.ticks();
        if after == before {
            break after;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the epoch kept advancing with no guest call: {before} -> {after}"
        );
    };
    // A guest that never returns is still stopped at its deadline.
    f.install("p", misbehave());
    let mut binding = named(Hook::Retry, "p");
    binding.params.insert("mode".into(), "loop".into());
    let report = f.registry.reconfigure(vec![binding]).expect("reconfigure");
    match report.outcome(Hook::Retry) {
        Some(ReloadOutcome::Failed { error, .. }) => {
            assert!(error.contains("deadline"), "{error}")
        }
        other => panic!("expected the deadline to stop the smoke test: {other:?}"),
    }
    assert!(runtime.ticks() > rested, "the clock advanced for the call");
}

/// A fixture whose retry hook is the misbehaving guest, loaded, its mode taken from
/// each call's request id.
fn misbehaving_retry() -> Fixture {
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |_| {});
    f.install("p", misbehave());
    let report = f
        .registry
        .reconfigure(vec![named(Hook::Retry, "p")])
        .expect("reconfigure");
    assert!(report.is_ok(), "{report:?}");
    f
}

/// A call whose guest was refused memory but carried on leaves no mark on the
/// instance: a later trap on it is a trap, not a memory blow-up.
#[test]
fn a_refused_allocation_does_not_colour_the_next_fault() {
    let f = misbehaving_retry();
    let d = f.registry.retry(&ctx("reserve", 1), &Failure::Timeout);
    assert_eq!(d.source, DecisionSource::Policy, "the refusal was handled");
    let d = f.registry.retry(&ctx("trap", 1), &Failure::Timeout);
    assert_eq!(d.source, DecisionSource::Contained);
    let status = f.registry.binding_status(Hook::Retry).expect("status");
    assert_eq!((status.traps, status.memory_exceeded), (1, 0), "{status:?}");
}

/// What a log subscriber writes, kept for a test to read.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A policy that logs in a loop writes at most `MAX_LOG_LINES_PER_CALL` lines per
/// call, and the cut is said once per call.
#[test]
fn a_policy_logging_in_a_loop_is_cut_off_per_call() {
    let f = misbehaving_retry();
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        for _ in 0..2 {
            let d = f.registry.retry(&ctx("chatty", 1), &Failure::Timeout);
            assert_eq!(d.source, DecisionSource::Policy);
        }
    });
    let text = String::from_utf8_lossy(&captured.0.lock().expect("log")).into_owned();
    let lines = text.lines().filter(|l| l.contains(" line ")).count();
    let cap = usize::try_from(outrigger_policy::MAX_LOG_LINES_PER_CALL).expect("small");
    assert_eq!(lines, 2 * cap, "{text}");
    assert_eq!(
        text.matches("the rest of this call's are dropped").count(),
        2
    );
}

/// A policy that never returns is stopped at its deadline from the very first load:
/// the registry's start-up smoke tests run before anyone could start a ticker.
#[test]
fn a_looping_policy_cannot_hang_the_start_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies).expect("policy dir");
    std::fs::write(policies.join("p.wasm"), misbehave()).expect("install");
    let mut binding = named(Hook::Retry, "p");
    binding.params.insert("mode".into(), "loop".into());
    let options = Options {
        dir: Some(policies),
        cache_dir: Some(dir.path().join("cache")),
        bindings: vec![binding],
        deadline: Duration::from_millis(100),
        ..Options::default()
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(Registry::new(options, builtins()).map(|r| r.status()));
    });
    let status = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the registry's start-up returned")
        .expect("the registry");
    let retry = status
        .iter()
        .find(|s| s.hook == Hook::Retry)
        .expect("the retry binding");
    assert!(retry.version.is_none(), "{retry:?}");
    let error = retry.last_error.as_deref().unwrap_or_default();
    assert!(error.contains("deadline"), "{error}");
}

/// A runtime compiling in the child `sh -c script` (which gets the memory limit and
/// allocation as `$1` and `$2`), caching under `dir`.
fn child_runtime(program: &str, script: Option<&str>, dir: &Path) -> Runtime {
    child_runtime_within(program, script, dir, outrigger_policy::COMPILE_TIMEOUT)
}

/// [`child_runtime`] whose child may run for `timeout`.
fn child_runtime_within(
    program: &str,
    script: Option<&str>,
    dir: &Path,
    timeout: Duration,
) -> Runtime {
    let args = script
        .map(|s| vec!["-c".into(), s.into(), "sh".into()])
        .unwrap_or_default();
    Runtime::new(RuntimeOptions {
        cache_dir: Some(dir.to_path_buf()),
        compiler: Compiler::Child {
            program: program.into(),
            args,
            timeout,
        },
        ..RuntimeOptions::default()
    })
    .expect("runtime")
}

fn retry_bytes() -> &'static [u8] {
    outrigger_builtins::by_name("retry")
        .expect("built-in exists")
        .bytes
}

#[test]
fn a_child_that_cannot_compile_leaves_it_to_this_process() {
    for (program, script) in [
        ("/nonexistent/outrigger", None),
        ("sh", Some("exit 1")),
        // Exits 0 with something that is not an artifact: wasmtime refuses it.
        ("sh", Some("cat >/dev/null; echo not-an-artifact")),
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        let runtime = child_runtime(program, script, dir.path());
        let loaded = runtime
            .load(retry_bytes(), BTreeMap::new(), "retry")
            .unwrap_or_else(|e| panic!("{program} {script:?}: {e}"));
        assert_eq!(loaded.hooks(), [Hook::Retry], "{program} {script:?}");
        assert!(!loaded.from_cache());
        assert_eq!(runtime.compilations(), 1);
        assert_eq!(runtime.compiled_in_process(), 1, "{program} {script:?}");
        // What this process compiled is cached as before.
        let second = child_runtime(program, script, dir.path());
        let again = second
            .load(retry_bytes(), BTreeMap::new(), "retry")
            .expect("from the cache");
        assert!(again.from_cache(), "{program} {script:?}");
        assert_eq!(second.compilations(), 0);
    }
}

#[test]
fn a_component_the_child_refuses_or_dies_on_fails_the_load() {
    let dir = tempfile::tempdir().expect("temp dir");
    let refuses = child_runtime(
        "sh",
        Some("cat >/dev/null; echo 'no such opcode at offset 12' >&2; exit 3"),
        dir.path(),
    );
    match refuses.load(retry_bytes(), BTreeMap::new(), "retry") {
        Err(outrigger_policy::Error::Compile(message)) => {
            assert_eq!(message, "no such opcode at offset 12");
        }
        other => panic!("expected the child's refusal, got {:?}", other.map(|_| ())),
    }
    assert_eq!(refuses.compiled_in_process(), 0, "never retried in process");

    // A compiler that crashes on a component is not run again inside the sidecar.
    let dies = child_runtime("sh", Some("kill -9 $$"), dir.path());
    match dies.load(retry_bytes(), BTreeMap::new(), "retry") {
        Err(outrigger_policy::Error::Compile(message)) => {
            assert!(message.contains("died on this component"), "{message}");
        }
        other => panic!("expected a compile error, got {:?}", other.map(|_| ())),
    }
    assert_eq!(dies.compiled_in_process(), 0);
    // Nor is one that panics on it (exit status 101).
    let panics = child_runtime(
        "sh",
        Some("cat >/dev/null; echo 'thread main panicked at cranelift' >&2; exit 101"),
        dir.path(),
    );
    match panics.load(retry_bytes(), BTreeMap::new(), "retry") {
        Err(outrigger_policy::Error::Compile(message)) => {
            assert!(message.contains("panicked"), "{message}");
        }
        other => panic!("expected a compile error, got {:?}", other.map(|_| ())),
    }
    assert_eq!(panics.compiled_in_process(), 0, "never retried in process");
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("cache dir").count(),
        0,
        "nothing cached"
    );
}

#[test]
fn what_is_not_a_component_never_reaches_a_compiler() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A child that would fail the test if it ran.
    let runtime = child_runtime("sh", Some("exit 3"), dir.path());
    let not_wasm = runtime.load(b"hello", BTreeMap::new(), "x");
    assert!(matches!(not_wasm, Err(outrigger_policy::Error::NotWasm)));
    let core_module = runtime.load(b"\0asm\x01\0\0\0", BTreeMap::new(), "x");
    assert!(matches!(
        core_module,
        Err(outrigger_policy::Error::NotAComponent)
    ));
    assert_eq!(runtime.compilations(), 0);
}

#[test]
fn an_artifact_this_engine_refuses_is_not_left_in_the_cache() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The child hands back something that is not an artifact; the component is
    // broken, so compiling in process fails too.
    let runtime = child_runtime(
        "sh",
        Some("cat >/dev/null; echo not-an-artifact"),
        dir.path(),
    );
    let broken = b"\0asm\x0d\0\x01\0\x01\x09\0";
    let loaded = runtime.load(broken, BTreeMap::new(), "broken");
    assert!(
        matches!(loaded, Err(outrigger_policy::Error::Compile(_))),
        "{:?}",
        loaded.map(|_| ())
    );
    assert_eq!(runtime.compiled_in_process(), 1);
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("cache dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_load_warms_up_as_many_instances_as_calls_find_ready() {
    for (warm_instances, expect) in [(3, 3), (1, 1), (0, 0)] {
        let runtime = Runtime::new(RuntimeOptions {
            warm_instances,
            ..RuntimeOptions::default()
        })
        .expect("runtime");
        let loaded = runtime
            .load(retry_bytes(), BTreeMap::new(), "retry")
            .expect("load");
        loaded.warm_up().expect("warm up");
        assert_eq!(
            loaded.warm_instances(),
            expect,
            "warm_instances {warm_instances}"
        );
    }
}

/// A compiler that hangs does not hang the load: it is killed at its limit, the
/// load fails naming the limit, and the component is not compiled in process.
#[test]
fn a_compiler_that_hangs_is_killed_at_its_limit() {
    // One that takes its input and hangs; one that never reads it (the write of the
    // component fills the pipe and would block forever).
    for script in ["cat >/dev/null; exec sleep 60", "exec sleep 60"] {
        let dir = tempfile::tempdir().expect("temp dir");
        let runtime =
            child_runtime_within("sh", Some(script), dir.path(), Duration::from_millis(500));
        let started = Instant::now();
        match runtime.load(retry_bytes(), BTreeMap::new(), "retry") {
            Err(outrigger_policy::Error::Compile(message)) => {
                assert!(message.contains("500ms"), "{script}: {message}");
                assert!(message.contains("killed"), "{script}: {message}");
            }
            other => panic!(
                "{script}: expected a compile error, got {:?}",
                other.map(|_| ())
            ),
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{script}: took {:?}",
            started.elapsed()
        );
        assert_eq!(
            runtime.compiled_in_process(),
            0,
            "{script}: never retried in process"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("cache dir").count(),
            0,
            "{script}: nothing cached"
        );
    }
}

/// A component (hand-assembled: no WAT compiler is at hand) of one core module
/// whose start function runs `body` (a code entry: locals, instructions, `end`).
fn component_with_start(body: &[u8]) -> Vec<u8> {
    fn section(id: u8, contents: &[u8]) -> Vec<u8> {
        let len = u8::try_from(contents.len()).expect("a short section");
        assert!(len < 0x80, "one-byte LEB128 length");
        let mut out = vec![id, len];
        out.extend_from_slice(contents);
        out
    }
    let mut code = vec![1, u8::try_from(body.len()).expect("a short body")];
    code.extend_from_slice(body);
    let mut module = b"\0asm\x01\0\0\0".to_vec();
    module.extend(section(1, &[1, 0x60, 0, 0])); // type 0: [] -> []
    module.extend(section(3, &[1, 0])); // function 0: type 0
    module.extend(section(8, &[0])); // start: function 0
    module.extend(section(10, &code));
    let mut component = b"\0asm\x0d\0\x01\0".to_vec();
    component.extend(section(1, &module)); // core module 0
    component.extend(section(2, &[1, 0, 0, 0])); // core instance: instantiate module 0
    component
}

/// A component whose start-up never returns cannot hang a warm-up (and with it a
/// reload): the load deadline stops it even when no call is running, when the
/// epoch ticker rests.
#[test]
fn a_start_function_that_never_returns_cannot_hang_the_warm_up() {
    let runtime = Runtime::new(RuntimeOptions::default()).expect("runtime");
    // The control: a start function that returns warms up.
    let returns = runtime
        .load(
            &component_with_start(&[0, 0x0b]),
            BTreeMap::new(),
            "returns",
        )
        .expect("load");
    returns.warm_up().expect("a start function that returns");
    // loop (br 0) end
    let looping = runtime
        .load(
            &component_with_start(&[0, 0x03, 0x40, 0x0c, 0x00, 0x0b, 0x0b]),
            BTreeMap::new(),
            "loops",
        )
        .expect("load");
    // Let the ticker come to rest.
    let started = Instant::now();
    loop {
        let before = runtime.ticks();
        std::thread::sleep(Duration::from_millis(200));
        if runtime.ticks() == before {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the ticker never rested"
        );
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(looping.warm_up());
    });
    let warmed = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the warm-up returned");
    let took = started.elapsed();
    match warmed {
        Err(outrigger_policy::Fault::Instantiate(message)) => {
            assert!(message.contains("deadline"), "{message}");
            assert!(message.contains("1s"), "{message}");
        }
        other => panic!("expected the start-up deadline to fail the warm-up: {other:?}"),
    }
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// A fixture's loaded misbehaving guest, every call's mode given by its request id.
fn misbehave_loaded(runtime: &Runtime) -> outrigger_policy::Loaded {
    let loaded = runtime
        .load(misbehave(), BTreeMap::new(), "misbehave")
        .expect("load");
    loaded.warm_up().expect("warm up");
    loaded
}

/// The host resources a pooled instance holds do not grow from call to call,
/// whatever the guest does; one that leaks handles is retired before it holds
/// more than `MAX_POOLED_RESOURCES`.
#[test]
fn pooled_instances_hold_a_bounded_number_of_host_resources() {
    let runtime = Runtime::new(RuntimeOptions {
        deadline: Duration::from_millis(500),
        warm_instances: 1,
        ..RuntimeOptions::default()
    })
    .expect("runtime");
    let loaded = misbehave_loaded(&runtime);
    for mode in ["normal", "ids", "reach", "jitter", "chatty"] {
        loaded
            .retry(&ctx(mode, 1), &Failure::Timeout)
            .unwrap_or_else(|f| panic!("{mode}: {f}"));
        let first = loaded.pooled_resources();
        for _ in 0..200 {
            loaded
                .retry(&ctx(mode, 1), &Failure::Timeout)
                .unwrap_or_else(|f| panic!("{mode}: {f}"));
        }
        assert_eq!(loaded.pooled_resources(), first, "{mode}: the table grew");
        assert_eq!(loaded.warm_instances(), 1, "{mode}");
    }
    // A guest that takes a stream handle on every call and never drops it.
    let cap = outrigger_policy::MAX_POOLED_RESOURCES;
    let mut most = 0;
    for n in 0..3 * cap {
        loaded
            .retry(&ctx("leak", 1), &Failure::Timeout)
            .unwrap_or_else(|f| panic!("leak call {n}: {f}"));
        most = most.max(loaded.pooled_resources());
    }
    assert!(most > 1, "the guest leaked no handle: {most}");
    assert!(most <= cap, "a pooled instance held {most} resources");
}

/// What a guest wrote to stderr before it trapped (a Rust panic's message) is
/// part of the fault and of the reload's error.
#[test]
fn a_trap_carries_the_end_of_the_guests_stderr() {
    let runtime = Runtime::new(RuntimeOptions {
        deadline: Duration::from_millis(500),
        ..RuntimeOptions::default()
    })
    .expect("runtime");
    let loaded = misbehave_loaded(&runtime);
    match loaded.retry(&ctx("trap", 1), &Failure::Timeout) {
        Err(outrigger_policy::Fault::Trap(message)) => {
            assert!(message.contains("deliberate trap"), "{message}");
            assert!(message.contains("panicked"), "{message}");
        }
        other => panic!("expected a trap: {other:?}"),
    }
    // A reload whose smoke test traps says why.
    let f = Fixture::new(vec![named(Hook::Retry, "p")], |_| {});
    f.install("p", misbehave());
    let mut binding = named(Hook::Retry, "p");
    binding.params.insert("mode".into(), "trap".into());
    let report = f.registry.reconfigure(vec![binding]).expect("reconfigure");
    match report.outcome(Hook::Retry) {
        Some(ReloadOutcome::Failed { error, .. }) => {
            assert!(error.contains("deliberate trap"), "{error}");
        }
        other => panic!("expected the smoke test to trap: {other:?}"),
    }
}
