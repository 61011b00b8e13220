//! Project automation, run as `cargo xtask <task>`:
//!
//! - `demo`  — the sidecar on its embedded defaults beside the mock provider, with
//!   demo requests going through it; stays up for your own `curl`s until Ctrl-C.
//! - `test`  — everything CI runs: formatting, lints, the whole test suite.
//! - `bench` — the load harness (direct vs nginx vs the sidecar, side by side).
//! - `gpu-check` — the NVML checks to run on a machine with an NVIDIA GPU.
//! - `soak` — the crash test at length (`--kills 1000`).

mod bench;
mod client;
mod demo;
mod gpu;
mod prereq;
mod procs;
mod soak;
mod test;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((task, rest)) = args.split_first() else {
        eprintln!("usage: cargo xtask <demo|test|bench|gpu-check|soak> [args]");
        return ExitCode::from(2);
    };
    // Every task builds the built-in policies, which need the wasm target.
    if let Err(e) = procs::ensure_wasm_target() {
        eprintln!("xtask {task}: {e:#}");
        return ExitCode::FAILURE;
    }
    let result = match task.as_str() {
        "demo" => demo::run(rest),
        "test" => test::run(rest),
        "bench" => bench::run(rest),
        "gpu-check" => gpu::gpu_check(rest),
        "soak" => soak::run(rest),
        other => Err(anyhow::anyhow!(
            "unknown task {other:?}; expected demo, test, bench, gpu-check or soak"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {task}: {e:#}");
            ExitCode::FAILURE
        }
    }
}
