//! `cargo xtask test`: everything CI runs, in order, failing on the first failure.
//! `.ci/run` calls exactly this.

use std::process::Command;

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

    step("building the binaries the end-to-end tests run");
    let bins = procs::build_bins("debug", &["outrigger", "outrigger-testing"])?;
    let outrigger = bins.join("outrigger");

    step("the test suite");
    if has_nextest() {
        exec(
            cargo()
                .args([
                    "nextest",
                    "run",
                    "--workspace",
                    "--locked",
                    "--profile",
                    "ci",
                ])
                .env("OUTRIGGER_BIN", &outrigger),
        )?;
        exec(cargo().args(["test", "--workspace", "--locked", "--doc"]))?;
    } else {
        exec(
            cargo()
                .args(["test", "--workspace", "--locked"])
                .env("OUTRIGGER_BIN", &outrigger),
        )?;
    }

    step("the README's first command (demo, once)");
    exec(cargo().args(["xtask", "demo", "--once"]))?;

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
