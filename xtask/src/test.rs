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

    step("prerequisites of the examples (python3 with venv, node and npm)");
    prerequisites()?;
    step("the example agent's Python environment (examples/agent/setup.sh)");
    exec(Command::new("bash").arg(procs::root().join("examples/agent/setup.sh")))?;
    step("the example policies in Python, JavaScript and Rust (examples/policies/build-all.sh)");
    let examples = procs::target_dir().join("example-policies");
    exec(
        Command::new("bash")
            .arg(procs::root().join("examples/policies/build-all.sh"))
            .arg(&examples),
    )?;

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
    exec(cargo().args(["xtask", "demo", "--once"]))?;

    step("all checks passed");
    Ok(())
}

/// The examples need python3 (with venv), node and npm. On a Debian-like machine
/// where they are missing and apt-get may run (root, or sudo without a password),
/// they are installed; anywhere else the step fails saying what to install.
fn prerequisites() -> anyhow::Result<()> {
    let works = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let missing = || {
        let mut m = Vec::new();
        if !works("python3", &["-c", "import venv, ensurepip"]) {
            m.push("python3-venv");
        }
        if !works("node", &["--version"]) {
            m.push("nodejs");
        }
        if !works("npm", &["--version"]) {
            m.push("npm");
        }
        m
    };
    let packages = missing();
    if packages.is_empty() {
        return Ok(());
    }
    let root = works("sh", &["-c", "[ \"$(id -u)\" = 0 ]"]);
    let sudo = !root && works("sudo", &["-n", "true"]);
    if !works("apt-get", &["--version"]) || !(root || sudo) {
        anyhow::bail!(
            "missing {}: install them (Debian/Ubuntu: apt-get install {}) and run again",
            packages.join(", "),
            packages.join(" ")
        );
    }
    let apt = |args: &[&str]| {
        let mut cmd = if sudo {
            let mut c = Command::new("sudo");
            c.arg("-n").arg("apt-get");
            c
        } else {
            Command::new("apt-get")
        };
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        exec(&mut cmd)
    };
    apt(&["update", "-q"])?;
    let mut install = vec![
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        "python3",
        "python3-venv",
    ];
    install.extend(packages.iter().filter(|p| **p != "python3-venv"));
    apt(&install)?;
    let still = missing();
    anyhow::ensure!(
        still.is_empty(),
        "still missing after apt-get: {}",
        still.join(", ")
    );
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
