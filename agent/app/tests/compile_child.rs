//! The policy compiler in a child process, against this package's real binary: the
//! artifact it hands back is cached, mapped and decides like a component compiled
//! in process, and the child's refusals read as the compiler's.

#![expect(
    clippy::expect_used,
    reason = "a test fails loudly on a broken fixture"
)]

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use outrigger_policy::{Compiler, Hook, Runtime, RuntimeOptions};
use outrigger_types::{CallContext, CallKind, Failure, RetryBudget, RetryDecision};

const BIN: &str = env!("CARGO_BIN_EXE_outrigger");

fn runtime(dir: &std::path::Path) -> Runtime {
    Runtime::new(RuntimeOptions {
        cache_dir: Some(dir.to_path_buf()),
        compiler: Compiler::child(BIN, vec!["compile-policy-child".into()]),
        ..RuntimeOptions::default()
    })
    .expect("runtime")
}

#[test]
fn a_component_compiled_by_the_child_is_cached_and_decides() {
    let dir = tempfile::tempdir().expect("temp dir");
    let runtime = runtime(dir.path());
    let retry = outrigger_builtins::by_name("retry").expect("built-in");
    let loaded = runtime
        .load(retry.bytes, BTreeMap::new(), "retry")
        .expect("compiled by the child");
    assert_eq!(runtime.compilations(), 1);
    assert_eq!(runtime.compiled_in_process(), 0, "the child compiled it");
    assert_eq!(loaded.hooks(), [Hook::Retry]);
    assert!(!loaded.from_cache());

    let ctx = CallContext {
        task_id: Some("task-1".into()),
        request_id: "r1".into(),
        kind: CallKind::Model,
        target: "openai".into(),
        model: Some("gpt-4o".into()),
        tool_class: None,
        attempt: 1,
        elapsed: Duration::from_millis(40),
        dispatched: true,
        history: Vec::new(),
        retry_budget: RetryBudget::default(),
        fallbacks: vec!["openai".into()],
    };
    let rate_limited = Failure::RateLimited {
        retry_after: Some(Duration::from_secs(2)),
    };
    assert_eq!(
        loaded.retry(&ctx, &rate_limited).expect("a decision"),
        RetryDecision::RetryAfter(Duration::from_secs(2))
    );

    // The artifact is in the cache: a second runtime compiles nothing.
    let cached = std::fs::read_dir(dir.path()).expect("cache dir").count();
    assert_eq!(cached, 1);
    let second = self::runtime(dir.path());
    let again = second
        .load(retry.bytes, BTreeMap::new(), "retry")
        .expect("from the cache");
    assert!(again.from_cache());
    assert_eq!(second.compilations(), 0);
}

#[test]
fn the_child_refuses_a_broken_component_with_the_compilers_message() {
    let dir = tempfile::tempdir().expect("temp dir");
    let runtime = runtime(dir.path());
    // A component header followed by a section that is cut short.
    let broken = b"\0asm\x0d\0\x01\0\x01\x09\0";
    match runtime.load(broken, BTreeMap::new(), "broken") {
        Err(outrigger_policy::Error::Compile(message)) => {
            assert!(!message.is_empty());
            assert!(!message.contains("exited with status"), "{message}");
        }
        other => panic!("expected a compile error, got {:?}", other.map(|_| ())),
    }
    assert_eq!(runtime.compiled_in_process(), 0, "not retried in process");
}

#[test]
fn the_child_says_what_is_wrong_with_its_arguments() {
    let run = |args: &[&str]| {
        let mut child = Command::new(BIN)
            .arg("compile-policy-child")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        drop(child.stdin.take().map(|mut s| s.write_all(b"")));
        child.wait_with_output().expect("wait")
    };
    let none = run(&[]);
    assert_eq!(none.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("<memory-limit-bytes> <pooled|on-demand>")
    );
    let bad = run(&["lots", "pooled"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("number of bytes"));
    let empty = run(&["1048576", "on-demand"]);
    assert_eq!(
        empty.status.code(),
        Some(3),
        "empty input is not a component"
    );
    assert!(empty.stdout.is_empty());
}
