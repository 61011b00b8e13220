//! The SDK's numbered examples (`sdk/examples/`), built as components the way a
//! policy author builds them, pass the conformance suite: what they teach is
//! accepted by the host. Each example's file name is its name, so a new example is
//! checked without a change here.
//!
//! They are built next to the built-in plugins (`<target>/wasm-plugins`, profile
//! `plugin`), so the SDK and its dependencies are already compiled for
//! `wasm32-wasip2` there and only the examples themselves compile (seconds).

#![expect(
    clippy::expect_used,
    reason = "a test fails loudly on a missing or broken fixture"
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use outrigger_policy_testkit::{Kit, KitOptions};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The examples' names, from the files in `sdk/examples/`.
fn names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(workspace().join("sdk/examples"))
        .expect("sdk/examples")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .filter_map(|path| Some(path.file_stem()?.to_str()?.to_string()))
        .collect();
    names.sort();
    names
}

/// Builds every example for `wasm32-wasip2` and returns each one's component.
fn build() -> Vec<(String, Vec<u8>)> {
    // Tests run from <target>/<profile>/deps/: build next to the plugins.
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
        .arg(workspace().join("Cargo.toml"))
        .args(["--target", "wasm32-wasip2", "--profile", "plugin"])
        .args(["-p", "outrigger-policy-sdk", "--examples"])
        .arg("--target-dir")
        .arg(&target_dir);
    // The host's flags and wrappers (`cargo clippy` sets one) must not reach a
    // wasm build.
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
        "building the SDK examples failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let built = target_dir.join("wasm32-wasip2/plugin/examples");
    names()
        .into_iter()
        .map(|name| {
            let path = built.join(format!("{name}.wasm"));
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (name, bytes)
        })
        .collect()
}

#[test]
fn every_sdk_example_is_conformant() {
    let examples = build();
    assert!(examples.len() >= 4, "{:?}", names());
    let cache = tempfile::tempdir().expect("temp dir");
    let kit = Kit::new(KitOptions {
        cache_dir: Some(cache.path().to_path_buf()),
        ..KitOptions::default()
    })
    .expect("kit");
    for (name, bytes) in &examples {
        let report = kit.check(bytes, BTreeMap::new());
        assert!(report.passed(), "{name}:\n{report}");
        assert_eq!(report.packages, ["outrigger:policy@0.1.0"], "{name}");
    }
    // Example 1 stays within the host's maximum whatever its parameters allow.
    let (_, jittered) = examples
        .iter()
        .find(|(name, _)| name == "_1_params_and_logging")
        .expect("example 1");
    let generous = BTreeMap::from([("max_attempts".to_string(), "1000000".to_string())]);
    let report = kit.check(jittered, generous);
    assert!(
        report.passed(),
        "_1_params_and_logging, max_attempts 1000000:\n{report}"
    );
}
