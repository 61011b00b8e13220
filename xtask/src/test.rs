//! `cargo xtask test` (the README's `./x test`): everything CI runs, in order, failing
//! on the first failure. `.ci/run` calls exactly this, through `./x`.

use std::process::Command;

use crate::prereq;
use crate::procs::run as exec;
use crate::procs::{self, cargo};

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let quick = args.iter().any(|a| a == "--quick");
    if let Some(other) = args.iter().find(|a| *a != "--quick") {
        anyhow::bail!("unknown argument {other:?}; usage: cargo xtask test [--quick]");
    }
    if !quick {
        step("formatting");
        exec(cargo().args(["fmt", "--all", "--", "--check"]))?;
        step("lints");
        exec(cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ]))?;
    }

    step("prerequisites of the examples (python3 with venv, Node.js 20 and npm)");
    let env = prereq::ensure()?;
    step("the example agent's Python environment (examples/agent/setup.sh)");
    exec(Command::new("bash").arg(procs::root().join("examples/agent/setup.sh")))?;
    step("the example policies in Python, JavaScript and Rust (examples/policies/build-all.sh)");
    let examples = procs::target_dir()?.join("example-policies");
    env.build_policies(&examples)?;

    step("building the binaries the end-to-end tests run");
    let bins = procs::build_bins("debug", &["outrigger", "outrigger-testing"])?;
    let outrigger = bins.join("outrigger");
    let with_examples = |cmd: &mut Command| {
        cmd.env("OUTRIGGER_BIN", &outrigger)
            .env("OUTRIGGER_EXAMPLE_POLICIES", &examples)
            .env("OUTRIGGER_REQUIRE_EXAMPLES", "1");
    };

    step("the test suite");
    if has_nextest() {
        let mut cmd = cargo();
        cmd.args([
            "nextest",
            "run",
            "--workspace",
            "--locked",
            "--profile",
            "ci",
        ]);
        with_examples(&mut cmd);
        exec(&mut cmd)?;
        exec(cargo().args(["test", "--workspace", "--locked", "--doc"]))?;
    } else {
        let mut cmd = cargo();
        cmd.args(["test", "--workspace", "--locked"]);
        with_examples(&mut cmd);
        exec(&mut cmd)?;
    }

    step("the README's first command (demo, once)");
    exec(Command::new(procs::root().join("x")).args(["demo", "--once"]))?;

    step("all checks passed");
    Ok(())
}

fn has_nextest() -> bool {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["nextest", "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn step(s: &str) {
    eprintln!("\n\x1b[1m=== {s}\x1b[0m");
}
