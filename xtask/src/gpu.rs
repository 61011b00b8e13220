//! `cargo xtask gpu-check`: checks Outrigger's GPU health reporting against a real
//! NVIDIA GPU in a few minutes, read-only (no reset, no mode change, no counter clear).
//!
//! 1. builds `outrigger` in release (skip with `--skip-build`; `--prepare-only` builds
//!    and stops, so the GPU machine only runs the binary);
//! 2. records `nvidia-smi` baselines, when it is installed, for cross-checks;
//! 3. runs `outrigger gpu`, `outrigger gpu --json` and `outrigger gpu --self-test --json`
//!    and checks them, and against `nvidia-smi`;
//! 4. runs `outrigger gpu --json` with a library path that does not exist (the "no
//!    NVML" path must still work on a GPU machine);
//! 5. starts `outrigger serve` and scrapes `/healthz`, `/readyz`, `/v1/gpu` and
//!    `/metrics` twice (skip with `--no-serve`);
//! 6. prints a summary, writes every artefact and `summary.json` to the output
//!    directory (`--out`, default `target/gpu-check`), and fails on any failed check.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
const SELF_TEST_TIMEOUT: Duration = Duration::from_secs(180);
const SERVE_STARTUP: Duration = Duration::from_secs(30);
const SCRAPE_GAP: Duration = Duration::from_secs(15);
const ADMIN_ADDRESS: &str = "127.0.0.1:7071";

/// Tolerances of the cross-checks against `nvidia-smi`.
const TEMPERATURE_TOLERANCE_C: f64 = 3.0;
const POWER_TOLERANCE_RATIO: f64 = 0.15;
const POWER_TOLERANCE_FLOOR_W: f64 = 10.0;

const SMI_FIELDS: &str = "uuid,name,temperature.gpu,power.draw,power.limit,memory.total,memory.used,\
utilization.gpu,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Pass,
    Warn,
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Self::Pass => "PASS",
            Self::Warn => "WARN",
            Self::Fail => "FAIL",
        }
    }
}

#[derive(Debug)]
struct Check {
    step: &'static str,
    name: String,
    status: Status,
    detail: String,
}

#[derive(Debug, Default)]
struct Summary {
    checks: Vec<Check>,
}

impl Summary {
    fn record(
        &mut self,
        step: &'static str,
        name: impl Into<String>,
        status: Status,
        detail: impl Into<String>,
    ) {
        let check = Check {
            step,
            name: name.into(),
            status,
            detail: detail.into(),
        };
        println!(
            "{} {}/{}: {}",
            check.status.as_str(),
            check.step,
            check.name,
            check.detail
        );
        self.checks.push(check);
    }

    fn failures(&self) -> usize {
        self.checks
            .iter()
            .filter(|c| c.status == Status::Fail)
            .count()
    }

    fn to_json(&self, elapsed: Duration) -> Value {
        json!({
            "passed": self.failures() == 0,
            "elapsed_s": elapsed.as_secs_f64(),
            "checks": self.checks.iter().map(|c| json!({
                "step": c.step,
                "name": c.name,
                "status": c.status.as_str(),
                "detail": c.detail,
            })).collect::<Vec<_>>(),
        })
    }
}

#[derive(Debug)]
struct Args {
    prepare_only: bool,
    skip_build: bool,
    serve: bool,
    binary: Option<PathBuf>,
    out: Option<PathBuf>,
    expect_gpus: Option<usize>,
}

const USAGE: &str = "usage: cargo xtask gpu-check [--prepare-only] [--skip-build] [--binary PATH] \
[--out DIR] [--no-serve] [--expect-gpus N]";

fn parse_args(args: &[String]) -> Result<Args> {
    let mut parsed = Args {
        prepare_only: false,
        skip_build: false,
        serve: true,
        binary: None,
        out: None,
        expect_gpus: None,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .cloned()
                .with_context(|| format!("{name} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--prepare-only" => parsed.prepare_only = true,
            "--skip-build" => parsed.skip_build = true,
            "--no-serve" => parsed.serve = false,
            "--binary" => parsed.binary = Some(PathBuf::from(value("--binary")?)),
            "--out" => parsed.out = Some(PathBuf::from(value("--out")?)),
            "--expect-gpus" => {
                let count = value("--expect-gpus")?;
                parsed.expect_gpus = Some(
                    count
                        .parse()
                        .with_context(|| format!("--expect-gpus {count}: not a number"))?,
                );
            }
            "-h" | "--help" => bail!("{USAGE}"),
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    Ok(parsed)
}

/// Entry point, called by `xtask`'s `main` for `gpu-check`.
pub fn gpu_check(args: &[String]) -> Result<()> {
    let args = parse_args(args)?;
    let started = Instant::now();
    let root = workspace_root()?;
    let binary = if args.skip_build {
        match args.binary.clone() {
            Some(binary) => binary,
            None => crate::procs::target_dir()?
                .join("release")
                .join("outrigger"),
        }
    } else {
        build(&root)?
    };
    if args.prepare_only {
        println!("prepared {}", binary.display());
        return Ok(());
    }
    anyhow::ensure!(
        binary.is_file(),
        "{} does not exist; build it first (cargo xtask gpu-check --prepare-only)",
        binary.display()
    );
    let out = match args.out.clone() {
        Some(out) => out,
        None => crate::procs::target_dir()?.join("gpu-check"),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    println!(
        "GPU check of {} (artefacts in {})",
        binary.display(),
        out.display()
    );

    let mut summary = Summary::default();
    let smi = nvidia_smi(&out, &mut summary);
    let expected = args.expect_gpus.or(smi.as_ref().map(Vec::len));
    let uuids: Vec<String> = smi
        .as_ref()
        .map(|gpus| gpus.iter().map(|gpu| gpu.uuid.clone()).collect())
        .unwrap_or_default();

    check_text(&binary, &out, &uuids, &mut summary)?;
    let reported = check_json(&binary, &out, expected, &uuids, &mut summary)?;
    // Without nvidia-smi, the service is checked against what the CLI reported.
    let uuids = if uuids.is_empty() { reported } else { uuids };
    check_self_test(&binary, &out, smi.as_deref(), &mut summary)?;
    check_missing_library(&binary, &out, &mut summary)?;
    if args.serve {
        check_serve(&binary, &out, &uuids, &mut summary)?;
    }

    let elapsed = started.elapsed();
    let report = summary.to_json(elapsed);
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    let failed = summary.failures();
    let warned = summary
        .checks
        .iter()
        .filter(|c| c.status == Status::Warn)
        .count();
    println!(
        "\nGPU check: {} checks, {failed} failed, {warned} warnings, {:.0} s",
        summary.checks.len(),
        elapsed.as_secs_f64()
    );
    if failed > 0 {
        let mut lines = String::new();
        for check in summary.checks.iter().filter(|c| c.status == Status::Fail) {
            let _ = writeln!(lines, "  {}/{}: {}", check.step, check.name, check.detail);
        }
        bail!("{failed} GPU check(s) failed:\n{lines}");
    }
    Ok(())
}

fn workspace_root() -> Result<PathBuf> {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .context("xtask lives inside the workspace")
}

/// `cargo build --release -p outrigger`; returns the executable cargo reports.
fn build(root: &Path) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    println!("building outrigger (release)…");
    let output = Command::new(cargo)
        .args([
            "build",
            "--release",
            "-p",
            "outrigger",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo build")?;
    anyhow::ensure!(
        output.status.success(),
        "cargo build --release -p outrigger failed"
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|message| {
            message["reason"] == "compiler-artifact" && message["target"]["name"] == "outrigger"
        })
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .context("cargo built no outrigger executable")
}

struct Output {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs a command to completion, killing it after `limit`.
fn run(command: &mut Command, limit: Duration) -> Result<Output> {
    let described = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {described}"))?;
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{described} did not finish within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// Reads a pipe on its own thread, so a chatty child cannot block on a full pipe.
fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    })
}

/// One GPU as `nvidia-smi --query-gpu` sees it.
#[derive(Debug)]
struct SmiGpu {
    uuid: String,
    temperature_c: Option<f64>,
    power_w: Option<f64>,
    memory_total_mib: Option<f64>,
}

fn nvidia_smi(out: &Path, summary: &mut Summary) -> Option<Vec<SmiGpu>> {
    let query = run(
        Command::new("nvidia-smi").args([
            &format!("--query-gpu={SMI_FIELDS}"),
            "--format=csv,noheader,nounits",
        ]),
        COMMAND_TIMEOUT,
    );
    let output = match query {
        Ok(output) if output.status.success() => output,
        Ok(output) => {
            summary.record(
                "baseline",
                "nvidia-smi",
                Status::Warn,
                format!("exit {}: {}", output.status, output.stderr.trim()),
            );
            return None;
        }
        Err(error) => {
            summary.record(
                "baseline",
                "nvidia-smi",
                Status::Warn,
                format!("not available, cross-checks skipped: {error:#}"),
            );
            return None;
        }
    };
    let _ = std::fs::write(
        out.join("nvidia-smi-query.csv"),
        format!("{SMI_FIELDS}\n{}", output.stdout),
    );
    if let Ok(details) = run(
        Command::new("nvidia-smi").args([
            "-q",
            "-d",
            "ECC,TEMPERATURE,POWER,CLOCK,PERFORMANCE,PAGE_RETIREMENT,ROW_REMAPPER",
        ]),
        COMMAND_TIMEOUT,
    ) {
        let _ = std::fs::write(out.join("nvidia-smi-q.txt"), details.stdout);
    }
    let number = |field: Option<&&str>| field.and_then(|value| value.trim().parse::<f64>().ok());
    let gpus: Vec<SmiGpu> = output
        .stdout
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            SmiGpu {
                uuid: fields
                    .first()
                    .map(|uuid| (*uuid).to_owned())
                    .unwrap_or_default(),
                temperature_c: number(fields.get(2)),
                power_w: number(fields.get(3)),
                memory_total_mib: number(fields.get(5)),
            }
        })
        .collect();
    summary.record(
        "baseline",
        "nvidia-smi",
        Status::Pass,
        format!(
            "{} GPU(s): {}",
            gpus.len(),
            gpus.iter()
                .map(|g| g.uuid.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    Some(gpus)
}

fn check_text(binary: &Path, out: &Path, uuids: &[String], summary: &mut Summary) -> Result<()> {
    let output = run(Command::new(binary).arg("gpu"), COMMAND_TIMEOUT)?;
    std::fs::write(out.join("outrigger-gpu.txt"), &output.stdout)?;
    print!("{}", output.stdout);
    let status = if output.status.success() {
        Status::Pass
    } else {
        Status::Warn
    };
    summary.record(
        "cli",
        "outrigger gpu",
        status,
        format!("exit {}", output.status),
    );
    let missing: Vec<&String> = uuids
        .iter()
        .filter(|uuid| !output.stdout.contains(uuid.as_str()))
        .collect();
    if !uuids.is_empty() {
        let (status, detail) = if missing.is_empty() {
            (Status::Pass, "every nvidia-smi UUID is listed".to_owned())
        } else {
            (Status::Fail, format!("not listed: {missing:?}"))
        };
        summary.record("cli", "text lists GPUs", status, detail);
    }
    if output.stdout.starts_with("no NVML") {
        summary.record(
            "cli",
            "text reports NVML",
            Status::Fail,
            output.stdout.lines().next().unwrap_or_default(),
        );
    }
    Ok(())
}

fn parse_json(
    step: &'static str,
    name: &str,
    output: &Output,
    summary: &mut Summary,
) -> Option<Value> {
    match serde_json::from_str::<Value>(&output.stdout) {
        Ok(value) => Some(value),
        Err(error) => {
            summary.record(
                step,
                name,
                Status::Fail,
                format!(
                    "not JSON ({error}); exit {}; stderr: {}",
                    output.status,
                    output.stderr.trim()
                ),
            );
            None
        }
    }
}

fn check_json(
    binary: &Path,
    out: &Path,
    expected: Option<usize>,
    uuids: &[String],
    summary: &mut Summary,
) -> Result<Vec<String>> {
    let output = run(
        Command::new(binary).args(["gpu", "--json"]),
        COMMAND_TIMEOUT,
    )?;
    std::fs::write(out.join("outrigger-gpu.json"), &output.stdout)?;
    let Some(snapshot) = parse_json("cli", "outrigger gpu --json", &output, summary) else {
        return Ok(Vec::new());
    };
    let nvml = snapshot["nvml"]["status"].as_str().unwrap_or("missing");
    let (status, detail) = if nvml == "up" {
        (
            Status::Pass,
            format!("driver {}", snapshot["nvml"]["driver_version"]),
        )
    } else {
        (
            Status::Fail,
            format!("NVML {nvml}: {}", snapshot["nvml"]["reason"]),
        )
    };
    summary.record("cli", "nvml up", status, detail);

    let gpus = snapshot["gpus"].as_array().cloned().unwrap_or_default();
    if let Some(expected) = expected {
        let status = if gpus.len() == expected {
            Status::Pass
        } else {
            Status::Fail
        };
        summary.record(
            "cli",
            "gpu count",
            status,
            format!("{} reported, {expected} expected", gpus.len()),
        );
    }
    let reported: Vec<&str> = gpus.iter().filter_map(|gpu| gpu["uuid"].as_str()).collect();
    if !uuids.is_empty() {
        let same = uuids.iter().all(|uuid| reported.contains(&uuid.as_str()));
        let status = if same { Status::Pass } else { Status::Fail };
        summary.record(
            "cli",
            "uuids match nvidia-smi",
            status,
            format!("{reported:?}"),
        );
    }
    for gpu in &gpus {
        let uuid = gpu["uuid"].as_str().unwrap_or("?");
        let state = gpu["state"].as_str().unwrap_or("missing");
        let reasons: Vec<&str> = gpu["reasons"]
            .as_array()
            .map(|reasons| reasons.iter().filter_map(|r| r["code"].as_str()).collect())
            .unwrap_or_default();
        let status = match state {
            "healthy" => Status::Pass,
            "degraded" => Status::Warn,
            _ => Status::Fail,
        };
        summary.record(
            "cli",
            format!("state {uuid}"),
            status,
            format!("{state} {reasons:?}"),
        );
        let absent = gpu["signals"]["absent"]
            .as_array()
            .map(Vec::len)
            .unwrap_or(0);
        summary.record(
            "cli",
            format!("absent signals {uuid}"),
            Status::Pass,
            format!("{absent}: {}", gpu["signals"]["absent"]),
        );
    }
    let ready = snapshot["ready"].as_bool() == Some(true);
    summary.record(
        "cli",
        "ready",
        if ready { Status::Pass } else { Status::Fail },
        snapshot["ready_reason"].as_str().unwrap_or_default(),
    );
    Ok(reported.into_iter().map(str::to_owned).collect())
}

fn check_self_test(
    binary: &Path,
    out: &Path,
    smi: Option<&[SmiGpu]>,
    summary: &mut Summary,
) -> Result<()> {
    let output = run(
        Command::new(binary).args(["gpu", "--self-test", "--json"]),
        SELF_TEST_TIMEOUT,
    )?;
    std::fs::write(out.join("self-test.json"), &output.stdout)?;
    let Some(report) = parse_json(
        "self-test",
        "outrigger gpu --self-test --json",
        &output,
        summary,
    ) else {
        return Ok(());
    };
    for check in report["checks"].as_array().cloned().unwrap_or_default() {
        let status = match check["status"].as_str() {
            Some("pass") => Status::Pass,
            Some("warn") => Status::Warn,
            _ => Status::Fail,
        };
        let name = match check["gpu"].as_str() {
            Some(gpu) => format!("{} {gpu}", check["name"].as_str().unwrap_or("?")),
            None => check["name"].as_str().unwrap_or("?").to_owned(),
        };
        summary.record(
            "self-test",
            name,
            status,
            check["detail"].as_str().unwrap_or_default(),
        );
    }
    let passed = report["passed"].as_bool() == Some(true);
    summary.record(
        "self-test",
        "verdict",
        if passed { Status::Pass } else { Status::Fail },
        format!(
            "sample cost {}, RSS {} KiB, {} ms",
            report["sample_cost"], report["rss_kib"], report["elapsed_ms"]
        ),
    );

    let Some(smi) = smi else {
        return Ok(());
    };
    for device in report["devices"].as_array().cloned().unwrap_or_default() {
        let uuid = device["uuid"].as_str().unwrap_or("?");
        let Some(reference) = smi.iter().find(|gpu| gpu.uuid == uuid) else {
            summary.record(
                "cross-check",
                format!("present {uuid}"),
                Status::Fail,
                "not in nvidia-smi",
            );
            continue;
        };
        let sample = &device["sample"];
        if let (Some(ours), Some(theirs)) =
            (sample["temperature_c"].as_f64(), reference.temperature_c)
        {
            let close = (ours - theirs).abs() <= TEMPERATURE_TOLERANCE_C;
            summary.record(
                "cross-check",
                format!("temperature {uuid}"),
                if close { Status::Pass } else { Status::Fail },
                format!("{ours} °C vs nvidia-smi {theirs} °C"),
            );
        }
        if let (Some(milliwatts), Some(theirs)) = (sample["power_mw"].as_f64(), reference.power_w) {
            let ours = milliwatts / 1000.0;
            let tolerance = (theirs * POWER_TOLERANCE_RATIO).max(POWER_TOLERANCE_FLOOR_W);
            let close = (ours - theirs).abs() <= tolerance;
            summary.record(
                "cross-check",
                format!("power {uuid}"),
                if close { Status::Pass } else { Status::Warn },
                format!("{ours:.1} W vs nvidia-smi {theirs:.1} W (±{tolerance:.1} W)"),
            );
        }
        if let (Some(bytes), Some(mib)) = (
            sample["memory_total_bytes"].as_f64(),
            reference.memory_total_mib,
        ) {
            let ours = bytes / 1_048_576.0;
            let close = (ours - mib).abs() <= mib * 0.01;
            summary.record(
                "cross-check",
                format!("memory total {uuid}"),
                if close { Status::Pass } else { Status::Fail },
                format!("{ours:.0} MiB vs nvidia-smi {mib:.0} MiB"),
            );
        }
    }
    Ok(())
}

fn check_missing_library(binary: &Path, out: &Path, summary: &mut Summary) -> Result<()> {
    let missing = out.join("missing").join("libnvidia-ml.so.1");
    let output = run(
        Command::new(binary)
            .args(["gpu", "--json", "--nvml-library"])
            .arg(&missing),
        COMMAND_TIMEOUT,
    )?;
    let Some(snapshot) = parse_json("negative", "missing library", &output, summary) else {
        return Ok(());
    };
    let status = snapshot["nvml"]["status"].as_str().unwrap_or("missing");
    summary.record(
        "negative",
        "missing library",
        if status == "unavailable" {
            Status::Pass
        } else {
            Status::Fail
        },
        format!("{status}: {}", snapshot["nvml"]["reason"]),
    );
    Ok(())
}

/// A minimal HTTP/1.1 GET against the admin plane (status, body).
fn get(path: &str) -> Result<(u16, String)> {
    let mut stream = TcpStream::connect(ADMIN_ADDRESS)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {ADMIN_ADDRESS}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text.as_str(), ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no HTTP status in {head:?}"))?;
    let chunked = head.lines().any(|line| {
        line.to_ascii_lowercase().starts_with("transfer-encoding:")
            && line.to_ascii_lowercase().contains("chunked")
    });
    Ok((
        status,
        if chunked {
            dechunk(body)
        } else {
            body.to_owned()
        },
    ))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// Kills the server when the check ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn metric_value(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|line| line.starts_with(name) && line[name.len()..].starts_with([' ', '{']))
        .and_then(|line| line.split_whitespace().last())
        .and_then(|value| value.parse().ok())
}

fn check_serve(binary: &Path, out: &Path, uuids: &[String], summary: &mut Summary) -> Result<()> {
    let workdir = out.join("serve");
    std::fs::create_dir_all(&workdir)?;
    let log = std::fs::File::create(out.join("serve.log"))?;
    let child = Command::new(binary)
        .arg("serve")
        .current_dir(&workdir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting outrigger serve")?;
    let _server = Server(child);

    let deadline = Instant::now() + SERVE_STARTUP;
    loop {
        if let Ok((200, _)) = get("/healthz") {
            break;
        }
        if Instant::now() >= deadline {
            summary.record(
                "serve",
                "healthz",
                Status::Fail,
                format!(
                    "no 200 within {} s (see serve.log)",
                    SERVE_STARTUP.as_secs()
                ),
            );
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    summary.record("serve", "healthz", Status::Pass, "200");
    if let Err(error) = scrape(out, uuids, summary) {
        summary.record("serve", "scrape", Status::Fail, format!("{error:#}"));
    }
    Ok(())
}

/// Reads the admin plane of a running sidecar.
fn scrape(out: &Path, uuids: &[String], summary: &mut Summary) -> Result<()> {
    // The first GPU round runs right after start; give it a moment to land.
    let deadline = Instant::now() + Duration::from_secs(10);
    let gpu = loop {
        let (status, body) = get("/v1/gpu")?;
        let value: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        if status != 200 || value["rounds"].as_u64().unwrap_or(0) >= 1 || Instant::now() >= deadline
        {
            break (status, value);
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    std::fs::write(
        out.join("serve-v1-gpu.json"),
        serde_json::to_string_pretty(&gpu.1)?,
    )?;
    let listed: Vec<&str> = gpu.1["gpus"]
        .as_array()
        .map(|gpus| gpus.iter().filter_map(|g| g["uuid"].as_str()).collect())
        .unwrap_or_default();
    let complete = gpu.0 == 200 && uuids.iter().all(|uuid| listed.contains(&uuid.as_str()));
    summary.record(
        "serve",
        "/v1/gpu",
        if complete { Status::Pass } else { Status::Fail },
        format!("{} nvml {} gpus {listed:?}", gpu.0, gpu.1["nvml"]["status"]),
    );

    let (ready, body) = get("/readyz")?;
    summary.record(
        "serve",
        "readyz",
        if ready == 200 {
            Status::Pass
        } else {
            Status::Fail
        },
        format!("{ready} {}", body.trim()),
    );

    let (status, first) = get("/metrics")?;
    std::thread::sleep(SCRAPE_GAP);
    let (_, second) = get("/metrics")?;
    std::fs::write(out.join("metrics-1.txt"), &first)?;
    std::fs::write(out.join("metrics-2.txt"), &second)?;
    summary.record(
        "serve",
        "metrics",
        if status == 200 {
            Status::Pass
        } else {
            Status::Fail
        },
        format!("{status}, {} lines", first.lines().count()),
    );
    let up = metric_value(&second, "outrigger_gpu_nvml_up");
    summary.record(
        "serve",
        "outrigger_gpu_nvml_up",
        if up == Some(1.0) {
            Status::Pass
        } else {
            Status::Fail
        },
        format!("{up:?}"),
    );
    for uuid in uuids {
        let labelled = second.contains(&format!("hw_id=\"{uuid}\""))
            && second.lines().any(|line| line.starts_with("hw_status{"));
        summary.record(
            "serve",
            format!("hw_status {uuid}"),
            if labelled { Status::Pass } else { Status::Fail },
            "hw_status with hw_id = the GPU UUID",
        );
    }
    let rounds = |text: &str| metric_value(text, "outrigger_gpu_sample_rounds_total");
    let (before, after) = (rounds(&first), rounds(&second));
    let grew = matches!((before, after), (Some(b), Some(a)) if a > b);
    summary.record(
        "serve",
        "sampling continues",
        if grew { Status::Pass } else { Status::Fail },
        format!(
            "outrigger_gpu_sample_rounds_total {before:?} → {after:?} over {} s",
            SCRAPE_GAP.as_secs()
        ),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments() -> Result<()> {
        let args = parse_args(&[
            "--skip-build".into(),
            "--expect-gpus".into(),
            "1".into(),
            "--no-serve".into(),
        ])?;
        assert!(args.skip_build && !args.serve && !args.prepare_only);
        assert_eq!(args.expect_gpus, Some(1));
        assert!(parse_args(&["--expect-gpus".into()]).is_err());
        assert!(parse_args(&["--bogus".into()]).is_err());
        Ok(())
    }

    #[test]
    fn metrics_and_chunks() {
        let text = "# HELP x\noutrigger_gpu_nvml_up 1\noutrigger_gpu_nvml_up_extra 5\nhw_status{hw_id=\"GPU-1\"} 0\n";
        assert_eq!(metric_value(text, "outrigger_gpu_nvml_up"), Some(1.0));
        assert_eq!(metric_value(text, "hw_status"), Some(0.0));
        assert_eq!(metric_value(text, "missing"), None);
        assert_eq!(
            dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
            "hello world"
        );
    }
}
