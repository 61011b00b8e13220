//! The test kit against the real built-in components.

#![expect(
    clippy::expect_used,
    reason = "a test fails loudly on a broken fixture"
)]

use std::collections::BTreeMap;
use std::path::Path;

use outrigger_policy::Hook;
use outrigger_policy_testkit::{Kit, KitOptions, Scenario};

fn kit(cache: &Path) -> Kit {
    Kit::new(KitOptions {
        cache_dir: Some(cache.to_path_buf()),
        ..KitOptions::default()
    })
    .expect("kit")
}

#[test]
fn every_builtin_is_conformant() {
    let cache = tempfile::tempdir().expect("temp dir");
    let kit = kit(cache.path());
    for builtin in outrigger_builtins::ALL {
        let report = kit.check(builtin.bytes, BTreeMap::new());
        assert!(report.passed(), "{}:\n{report}", builtin.name);
        assert_eq!(report.hooks.len(), 1, "{}", builtin.name);
        assert_eq!(report.hooks[0].as_str(), builtin.name);
        assert_eq!(report.packages, ["outrigger:policy@0.1.0"]);
        assert_eq!(report.content_hash.as_deref(), Some(builtin.sha256));
        let conformance = report.conformance.as_ref().expect("conformance ran");
        assert!(conformance.outcomes.len() >= 7, "{}", builtin.name);
    }
    // Checked again, it comes from the compiled-artifact cache.
    let again = kit.check(outrigger_builtins::RETRY, BTreeMap::new());
    assert_eq!(again.from_cache, Some(true));
}

#[test]
fn check_explains_what_is_not_a_policy() {
    let cache = tempfile::tempdir().expect("temp dir");
    let kit = kit(cache.path());
    let cases: [(&[u8], &str); 3] = [
        (b"definitely not wasm", "not a WebAssembly binary"),
        (
            &[0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00],
            "not a component",
        ),
        (
            &[0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00],
            "exports none of",
        ),
    ];
    for (bytes, expected) in cases {
        let report = kit.check(bytes, BTreeMap::new());
        assert!(!report.valid && !report.passed());
        let error = report.error.unwrap_or_default();
        assert!(error.contains(expected), "{error}");
    }
}

#[test]
fn a_policy_that_breaks_the_rules_fails_conformance() {
    // The retry built-in with a cap beyond the host's maximum retry delay: its
    // decisions are refused, and the report says which and why.
    let cache = tempfile::tempdir().expect("temp dir");
    let kit = Kit::new(KitOptions {
        cache_dir: Some(cache.path().to_path_buf()),
        max_retry_delay: std::time::Duration::from_millis(100),
        ..KitOptions::default()
    })
    .expect("kit");
    let report = kit.check(outrigger_builtins::RETRY, BTreeMap::new());
    assert!(report.valid);
    assert!(!report.passed());
    let conformance = report.conformance.expect("ran");
    let failure = conformance.failures().next().expect("a failure");
    assert_eq!(failure.hook, Hook::Retry);
    assert!(
        failure
            .failure
            .as_deref()
            .is_some_and(|f| f.contains("exceeds the host maximum")),
        "{failure:?}"
    );
}

#[test]
fn the_example_scenario_replays_on_the_builtins() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/policies/scenarios/builtins.toml");
    let text = std::fs::read_to_string(&path).expect("example scenario");
    let scenario = Scenario::from_toml(&text).expect("parses");
    let cache = tempfile::tempdir().expect("temp dir");
    let kit = kit(cache.path());
    for builtin in outrigger_builtins::ALL {
        let report = kit.run_scenario(builtin.bytes, &scenario).expect("runs");
        assert_eq!(report.steps.len(), scenario.steps.len());
        for step in &report.steps {
            if step.hook.as_str() == builtin.name {
                assert!(step.problem.is_none(), "{}: {report}", builtin.name);
            } else {
                assert!(
                    step.problem
                        .as_deref()
                        .is_some_and(|p| p.contains("does not implement")),
                    "{}: {step:?}",
                    builtin.name
                );
            }
        }
    }
    let retry = kit
        .run_scenario(outrigger_builtins::RETRY, &scenario)
        .expect("runs");
    assert!(
        retry.steps[0].decision.contains("retry_after 2000 ms"),
        "{retry}"
    );
}

#[test]
fn scenario_errors_name_the_problem() {
    let missing_hook = "[[step]]\nname = \"x\"\n";
    let err = Scenario::from_toml(missing_hook).expect_err("no hook");
    assert!(err.to_string().contains("exactly one of"), "{err}");
    let unknown = "[[step]]\nretry = { failure = { kind = \"meteor\" } }\n";
    assert!(Scenario::from_toml(unknown).is_err());
    let expectation = "[[step]]\nretry = { failure = { kind = \"content_filtered\" } }\nexpect = { decision = \"retry_after\" }\n";
    let scenario = Scenario::from_toml(expectation).expect("parses");
    let cache = tempfile::tempdir().expect("temp dir");
    let report = kit(cache.path())
        .run_scenario(outrigger_builtins::RETRY, &scenario)
        .expect("runs");
    assert!(!report.passed());
    assert_eq!(
        report.steps[0].problem.as_deref(),
        Some("expected retry_after")
    );
}
