//! `outrigger policy check|test` and `outrigger gpu`: the operator's one-shot tools.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

#[derive(clap::Subcommand, Debug)]
pub enum PolicyCommand {
    /// Validate a component against the WIT world, list its hooks and run the
    /// conformance suite.
    Check {
        file: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Replay a scripted sequence of failures (a TOML scenario) and print each decision.
    Test {
        file: PathBuf,
        #[arg(long)]
        scenario: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

pub fn policy(cmd: PolicyCommand) -> ExitCode {
    match run_policy(cmd) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outrigger policy: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn read(file: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))
}

fn run_policy(cmd: PolicyCommand) -> anyhow::Result<ExitCode> {
    let kit = outrigger_policy_testkit::Kit::new(outrigger_policy_testkit::KitOptions::default())?;
    match cmd {
        PolicyCommand::Check { file, json } => {
            let report = kit.check(&read(&file)?, Default::default());
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("{}: {report}", file.display());
            }
            Ok(if report.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        PolicyCommand::Test {
            file,
            scenario,
            json,
        } => {
            let text = std::fs::read_to_string(&scenario)
                .with_context(|| format!("cannot read {}", scenario.display()))?;
            let scenario = outrigger_policy_testkit::Scenario::from_toml(&text)
                .with_context(|| format!("{} is not a valid scenario", scenario.display()))?;
            let report = kit.run_scenario(&read(&file)?, &scenario)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("{report}");
            }
            Ok(if report.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct GpuArgs {
    /// Print JSON (the same document as GET /v1/gpu).
    #[arg(long)]
    pub json: bool,
    /// Run the NVML self-test (for a machine with a GPU).
    #[arg(long)]
    pub self_test: bool,
    /// Load this libnvidia-ml instead of the one the loader finds.
    #[arg(long)]
    pub nvml_library: Option<PathBuf>,
}

pub fn gpu(args: GpuArgs) -> ExitCode {
    if args.self_test {
        let report = outrigger_gpu::self_test(args.nvml_library.as_deref());
        if args.json {
            match serde_json::to_string_pretty(&report) {
                Ok(s) => println!("{s}"),
                Err(e) => eprintln!("{e}"),
            }
        } else {
            print!("{}", report.render_text());
        }
        return if report.passed {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    let options = outrigger_gpu::Options {
        library_path: args.nvml_library,
        ..outrigger_gpu::Options::default()
    };
    let snap = outrigger_gpu::probe_once(&options);
    if args.json {
        match serde_json::to_string_pretty(&snap) {
            Ok(s) => println!("{s}"),
            Err(e) => eprintln!("{e}"),
        }
    } else {
        print!("{}", snap.render_text());
    }
    // No GPU is not an error for this command; an unhealthy one is.
    if snap.summary.state == outrigger_types::GpuState::Unhealthy {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
