//! The `outrigger` binary: the sidecar (`serve`) and the operator's tools.
//!
//! This crate is the only place that reads the environment, files and arguments,
//! and the only one that spawns long-lived tasks; the libraries it wires receive
//! typed options.

mod admin;
mod audit;
mod config;
mod drill;
mod memory;
mod policies;
mod serve;
mod tools_cli;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc rather than glibc's malloc: the request path allocates many small,
/// short-lived buffers across threads (see docs/benchmarks.md). [`memory`] hands
/// what the policy compiler freed back to the OS.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "outrigger",
    version,
    about = "A sidecar that keeps AI agents upright: journaled tool calls, resumable model streams, WASM policies."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the sidecar (data plane on 127.0.0.1:7070, admin on 127.0.0.1:7071 by default).
    Serve {
        /// TOML configuration file; without it the embedded defaults apply.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Write the bound addresses as JSON to this file once ready.
        #[arg(long, hide = true)]
        ready_file: Option<PathBuf>,
    },
    /// Audit the side-effect journal (works whether the sidecar runs or not).
    Journal {
        #[command(subcommand)]
        command: audit::Command,
    },
    /// Check or exercise a policy component.
    Policy {
        #[command(subcommand)]
        command: tools_cli::PolicyCommand,
    },
    /// Print local GPU health once (says so plainly when there is no NVIDIA driver).
    Gpu(tools_cli::GpuArgs),
    /// Run fault drills against a sidecar started on a derived config, and write a
    /// record of each (exit 0: all passed, 1: one failed, 2: usage or config error).
    Drill(drill::Args),
    /// Validate a configuration file and print what it configures.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// The sidecar's policy compiler: a component on stdin, its compiled artifact on
    /// stdout (see `policies::child_compiler`).
    #[command(name = "compile-policy-child", hide = true)]
    CompilePolicyChild { args: Vec<std::ffi::OsString> },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Check a configuration (with the environment's overrides applied).
    Check {
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let env: Vec<(String, String)> = std::env::vars().collect();
    match cli.command {
        Command::Serve { config, ready_file } => {
            let config = match config::load(config.as_deref(), &env) {
                Ok(c) => c,
                Err(e) => {
                    eprint!("{e}");
                    return ExitCode::from(2);
                }
            };
            let metrics =
                outrigger_telemetry::Metrics::with_options(&serve::metrics_options(&config));
            let _telemetry = match init_telemetry(&config, &env, &metrics) {
                Ok(guard) => guard,
                Err(e) => {
                    eprintln!("outrigger: cannot start telemetry: {e}");
                    return ExitCode::FAILURE;
                }
            };
            for name in config::empty_env(&env) {
                tracing::warn!(
                    variable = name,
                    "ignored: it is empty (the config file's value, or the default, applies)"
                );
            }
            for name in config::unread_env(&env) {
                tracing::warn!(
                    variable = name,
                    "ignored: no config section of that name (OUTRIGGER_<SECTION>_<KEY>; sections are listed in the README)"
                );
            }
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(serve::run(config, metrics, serve::ServeArgs { ready_file })) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("outrigger: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Journal { command } => audit::run(command),
        Command::Policy { command } => tools_cli::policy(command),
        Command::Gpu(args) => tools_cli::gpu(args, &env),
        Command::Drill(args) => drill::run(args),
        Command::CompilePolicyChild { args } => {
            let code = outrigger_policy::compile_child(&args);
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
        Command::Config {
            command: ConfigCommand::Check { config },
        } => match config::load(config.as_deref(), &env) {
            Ok(c) => {
                println!("{} is valid:", c.source);
                println!("  data plane  {}", c.data_addr);
                println!("  admin plane {}", c.admin_addr);
                println!("  data dir    {}", c.data_dir.display());
                for p in &c.proxy.providers {
                    println!(
                        "  provider    {} ({}, {}) models: {}",
                        p.name,
                        p.dialect.as_str(),
                        p.base_url,
                        p.models
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
                for t in &c.proxy.tools {
                    println!(
                        "  tool        {} ({}, class {})",
                        t.name,
                        t.base_url,
                        t.class.as_str()
                    );
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprint!("{e}");
                ExitCode::from(2)
            }
        },
    }
}

/// Installs logging (stderr) and, when an OTLP endpoint is configured, span export.
fn init_telemetry(
    config: &config::Config,
    env: &[(String, String)],
    metrics: &outrigger_telemetry::Metrics,
) -> Result<outrigger_telemetry::TelemetryGuard, outrigger_telemetry::Error> {
    let host = env
        .iter()
        .find(|(k, _)| k == "HOSTNAME")
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
        .unwrap_or("outrigger");
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    let options = outrigger_telemetry::TelemetryOptions {
        service_name: config.telemetry.service_name.clone(),
        instance_id: format!("{host}-{}-{started:x}", std::process::id()),
        log_filter: config.log.filter.clone(),
        log_format: if config.log.json {
            outrigger_telemetry::LogFormat::Json
        } else {
            outrigger_telemetry::LogFormat::Text
        },
        otlp: config.telemetry.otlp.clone(),
        content: config.telemetry.content,
        ..outrigger_telemetry::TelemetryOptions::default()
    };
    let guard = outrigger_telemetry::init(&options, metrics)?;
    if let Some(otlp) = &config.telemetry.otlp {
        tracing::info!(endpoint = %otlp.endpoint, "exporting spans over OTLP/HTTP");
    }
    Ok(guard)
}
