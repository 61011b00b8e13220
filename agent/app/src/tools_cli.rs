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
    /// TOML configuration file whose `[gpu]` section applies, with the environment's
    /// overrides (as for `serve`); without it the embedded defaults.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Print JSON (the same document as GET /v1/gpu).
    #[arg(long)]
    pub json: bool,
    /// Run the NVML self-test (for a machine with a GPU).
    #[arg(long)]
    pub self_test: bool,
    /// Load this libnvidia-ml instead of the one the configuration (or the loader) finds.
    #[arg(long)]
    pub nvml_library: Option<PathBuf>,
}

/// The GPU options `serve` would run with on this configuration, `--nvml-library`
/// taking the place of `[gpu] library`.
fn gpu_options(
    args: &GpuArgs,
    env: &[(String, String)],
) -> Result<outrigger_gpu::Options, crate::config::Error> {
    let mut options = crate::config::load(args.config.as_deref(), env)?.gpu;
    if let Some(library) = &args.nvml_library {
        options.library_path = Some(library.clone());
    }
    Ok(options)
}

pub fn gpu(args: GpuArgs, env: &[(String, String)]) -> ExitCode {
    let options = match gpu_options(&args, env) {
        Ok(options) => options,
        Err(e) => {
            eprint!("{e}");
            return ExitCode::from(2);
        }
    };
    if args.self_test {
        let report = outrigger_gpu::self_test(options.library_path.as_deref());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(config: Option<PathBuf>, nvml_library: Option<&str>) -> GpuArgs {
        GpuArgs {
            config,
            json: false,
            self_test: false,
            nvml_library: nvml_library.map(PathBuf::from),
        }
    }

    #[test]
    fn gpu_options_come_from_the_config_file() {
        let dir = std::env::temp_dir().join(format!("outrigger-gpu-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("outrigger.toml");
        std::fs::write(
            &path,
            "[gpu]\nlibrary = \"/opt/nvidia/libnvidia-ml.so.1\"\nfatal_xids = [13]\n\
             watch = [\"GPU-a\"]\nexpected_count = 4\nunknown_is_ready = false\n",
        )
        .unwrap();

        let options = gpu_options(&args(Some(path.clone()), None), &[]).unwrap();
        assert_eq!(
            options.library_path,
            Some(PathBuf::from("/opt/nvidia/libnvidia-ml.so.1"))
        );
        assert_eq!(options.fatal_xids, [13].into_iter().collect());
        assert_eq!(
            options.watch,
            outrigger_gpu::Watch::Uuids(vec!["GPU-a".to_owned()])
        );
        assert_eq!(options.expected_count, Some(4));
        assert!(!options.unknown_is_ready);

        // The flag wins over the file; the environment overrides it as for `serve`.
        let env = [("OUTRIGGER_GPU_EXPECTED_COUNT".to_owned(), "2".to_owned())];
        let options = gpu_options(&args(Some(path), Some("/tmp/stub.so")), &env).unwrap();
        assert_eq!(options.library_path, Some(PathBuf::from("/tmp/stub.so")));
        assert_eq!(options.expected_count, Some(2));
        let _ = std::fs::remove_dir_all(&dir);

        // No file: the embedded defaults.
        let options = gpu_options(&args(None, None), &[]).unwrap();
        assert_eq!(options, outrigger_gpu::Options::default());
    }
}
