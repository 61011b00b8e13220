//! `cargo xtask soak [--kills N]`: the crash test of the end-to-end suite at length.
//! The sidecar runs as a child process and is killed with SIGKILL at seeded points
//! while tool calls are in flight, N times (1000 by default; CI runs 50); after each
//! restart the agent retries with the same keys. The test fails on any duplicated,
//! lost or unexpected side effect and prints its figures (kills, calls, duplicated,
//! lost, held for an operator, elapsed).

use crate::procs::{self, cargo, run as exec};

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let mut kills: u64 = 1000;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--kills" => {
                kills = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|k| *k > 0)
                    .ok_or_else(|| anyhow::anyhow!("--kills needs a positive number"))?;
            }
            other => {
                anyhow::bail!("unknown argument {other:?}; usage: cargo xtask soak [--kills N]")
            }
        }
    }
    let bins = procs::build_bins("debug", &["outrigger", "outrigger-testing"])?;
    exec(
        cargo()
            .args([
                "test",
                "-p",
                "outrigger-e2e",
                "--test",
                "e2e",
                "crash::",
                "--",
                "--nocapture",
            ])
            .env("OUTRIGGER_BIN", bins.join("outrigger"))
            .env("OUTRIGGER_CRASH_KILLS", kills.to_string()),
    )
}
