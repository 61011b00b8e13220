//! `outrigger drill`: fault drills against a real sidecar, each ending in a record of
//! detection, drain, in-flight outcomes, recovery, consistency and error budget.
//!
//! The drill runs this same binary as `outrigger serve` in a child process, on a
//! configuration derived from the user's (loopback listeners, a journal and policy
//! directory of its own), one fresh sidecar per scenario. It then plays both sides:
//! the agent on the data plane (model and tool calls, retried as an agent would,
//! with the same keys) and the operator on the admin plane (faults in, faults out,
//! readiness and metrics watched, in-doubt calls resolved after asking the tool).
//! It is shaped so because only a real process can be killed mid-call, and only the
//! wire shows what an agent would have seen.
//!
//! Invariants: a drill refuses non-loopback upstreams unless told otherwise (it
//! injects faults and performs real side effects); it never breaks a real GPU (the
//! GPU scenario needs the NVML stub); every request it sends is accounted for in
//! the record; a scenario passes only on evidence (a check that could not be made
//! is a violation or a stated skip, never a silent pass).

mod agent;
mod child;
mod http;
mod ledger;
mod observe;
mod record;
mod scenarios;
mod setup;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use record::{Build, Record, Verdict};
use scenarios::Scenario;

/// `outrigger drill` arguments.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A scenario name, a comma-separated list of them, or `all`: rate_limit_storm,
    /// stream_cut_text, stream_cut_tool_call, tool_reset_after_effect, policy_hot_swap,
    /// gpu_unhealthy, journal_write_failure, sidecar_restart.
    #[arg(long, default_value = "all")]
    pub scenario: String,
    /// The configuration to drill (as for `serve`); without it the embedded defaults.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Where the records go: `<scenario>.json`, `<scenario>.md`, `summary.md`, `logs/`.
    #[arg(long, default_value = "./outrigger-drills")]
    pub out: PathBuf,
    /// Drill providers and tools that are not on loopback (real side effects!).
    #[arg(long)]
    pub allow_remote: bool,
    /// A stub `libnvidia-ml.so` for the GPU scenario (skipped without it).
    #[arg(long)]
    pub nvml_stub: Option<PathBuf>,
}

/// Everything that can stop a drill.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The arguments or the configuration cannot be drilled (exit 2).
    #[error("{0}")]
    Usage(String),
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the sidecar could not be started: {0}")]
    Start(String),
    /// The sidecar under drill did not answer as the drill needs it to.
    #[error("{0}")]
    Sidecar(String),
}

impl Error {
    pub fn io(action: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Runs the drill; the exit status is 0 when every scenario that ran passed, 1 when
/// one failed, 2 for usage or configuration errors.
pub fn run(args: Args) -> ExitCode {
    let env: Vec<(String, String)> = std::env::vars().collect();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outrigger drill: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(drive(&args, env)) {
        Ok(records) => {
            let failed = records.iter().any(|r| r.verdict == Verdict::Fail);
            eprintln!(
                "outrigger drill: {} passed, {} failed, {} skipped; records in {}",
                records
                    .iter()
                    .filter(|r| r.verdict == Verdict::Pass)
                    .count(),
                records
                    .iter()
                    .filter(|r| r.verdict == Verdict::Fail)
                    .count(),
                records
                    .iter()
                    .filter(|r| r.verdict == Verdict::Skipped)
                    .count(),
                args.out.display()
            );
            if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("outrigger drill: {e}");
            match e {
                Error::Usage(_) => ExitCode::from(2),
                Error::Io { .. } | Error::Start(_) | Error::Sidecar(_) => ExitCode::FAILURE,
            }
        }
    }
}

async fn drive(args: &Args, env: Vec<(String, String)>) -> Result<Vec<Record>, Error> {
    let selected = Scenario::parse_list(&args.scenario).map_err(Error::Usage)?;
    if let Some(stub) = &args.nvml_stub
        && !stub.is_file()
    {
        return Err(Error::Usage(format!(
            "--nvml-stub {}: no such file",
            stub.display()
        )));
    }
    let plan = setup::Plan::read(args.config.as_deref(), &env, args.allow_remote)?;
    let logs = args.out.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| Error::io("create", &logs, e))?;
    let exe = std::env::current_exe().map_err(|e| {
        Error::Start(format!(
            "cannot find this executable to run it as the sidecar: {e}"
        ))
    })?;
    let run_id = run_id();
    let work = WorkDir::create(&run_id)?;
    let drill = scenarios::Drill {
        build: Build {
            service_version: env!("CARGO_PKG_VERSION").to_owned(),
            config_hash: plan.config_hash.clone(),
            config_source: plan.config.source.clone(),
        },
        plan,
        env,
        out: args.out.clone(),
        work: work.0.clone(),
        nvml_stub: args.nvml_stub.clone(),
        exe,
        http: http::Http::new(),
        date: humantime::format_rfc3339_seconds(std::time::SystemTime::now())
            .to_string()
            .chars()
            .take(10)
            .collect(),
        run_id,
    };
    let mut records = Vec::new();
    for scenario in selected {
        eprintln!("outrigger drill: {} …", scenario.name());
        let record = scenarios::run(&drill, scenario).await;
        eprintln!(
            "outrigger drill: {} {} in {:.1} s{}",
            scenario.name(),
            record.verdict.as_str(),
            record.duration_s,
            match (&record.skipped_reason, record.violations.first()) {
                (Some(why), _) => format!(" ({why})"),
                (None, Some(v)) => format!(": {v}"),
                (None, None) => String::new(),
            }
        );
        write_record(&args.out, &record)?;
        records.push(record);
    }
    let summary = args.out.join("summary.md");
    std::fs::write(&summary, record::summary(&records))
        .map_err(|e| Error::io("write", &summary, e))?;
    Ok(records)
}

fn write_record(out: &Path, record: &Record) -> Result<(), Error> {
    let json = out.join(format!("{}.json", record.scenario));
    let text = serde_json::to_string_pretty(record)
        .map_err(|e| Error::Sidecar(format!("cannot encode the record: {e}")))?;
    std::fs::write(&json, text + "\n").map_err(|e| Error::io("write", &json, e))?;
    let md = out.join(format!("{}.md", record.scenario));
    std::fs::write(&md, record.markdown()).map_err(|e| Error::io("write", &md, e))
}

/// Six hex digits, different for every run on a machine.
fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .subsec_nanos();
    format!(
        "{:06x}",
        (nanos ^ std::process::id().rotate_left(13)) & 0xff_ffff
    )
}

/// The run's scratch directory (derived configs, journals); removed at the end.
struct WorkDir(PathBuf);

impl WorkDir {
    fn create(run_id: &str) -> Result<Self, Error> {
        let dir = std::env::temp_dir().join(format!("outrigger-drill-{run_id}"));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
        Ok(Self(dir))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
