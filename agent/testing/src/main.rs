//! `outrigger-mock`: the test doubles as a standalone program, for the demo and the
//! benchmarks. `outrigger-mock provider --listen 127.0.0.1:7080 --chunks 20`.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use outrigger_testing::provider::{Behaviour, MockProvider};

#[derive(Parser)]
#[command(
    name = "outrigger-mock",
    about = "Loopback stand-ins for model providers and tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// A model provider speaking the OpenAI and Anthropic dialects.
    Provider {
        #[arg(long, default_value = "127.0.0.1:7080")]
        listen: SocketAddr,
        /// Text deltas per response.
        #[arg(long, default_value_t = 8)]
        chunks: usize,
        /// Tool calls per response.
        #[arg(long, default_value_t = 0)]
        tools: usize,
        /// Milliseconds between stream events.
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
    },
    /// An HTTP tool whose calls are side effects (counted per idempotency key).
    Tool {
        #[arg(long, default_value = "127.0.0.1:7090")]
        listen: SocketAddr,
        /// Honour Idempotency-Key (a keyed tool).
        #[arg(long)]
        dedupe: bool,
    },
    /// A minimal HTTP pass-through proxy to one upstream (the benchmark's floor).
    Passthrough {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        upstream: SocketAddr,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Provider {
            listen,
            chunks,
            tools,
            delay_ms,
        } => {
            let behaviour = Behaviour {
                chunks,
                tool_calls: tools,
                chunk_delay: Duration::from_millis(delay_ms),
                ..Behaviour::default()
            };
            let mock = MockProvider::start_unlogged(listen, behaviour)
                .await
                .with_context(|| format!("could not listen on {listen}"))?;
            println!("mock provider listening on http://{}", mock.addr());
            wait_for_signal().await;
        }
        Command::Tool { listen, dedupe } => {
            let tool = outrigger_testing::tool::MockTool::start_unlogged(
                listen,
                outrigger_testing::tool::ToolBehaviour {
                    dedupe,
                    ..Default::default()
                },
            )
            .await
            .with_context(|| format!("could not listen on {listen}"))?;
            println!("mock tool listening on {}", tool.url());
            wait_for_signal().await;
        }
        Command::Passthrough { listen, upstream } => {
            let server = outrigger_testing::passthrough::start(listen, upstream)
                .await
                .with_context(|| format!("could not listen on {listen}"))?;
            println!(
                "pass-through proxy on http://{} -> http://{upstream}",
                server.addr
            );
            wait_for_signal().await;
        }
    }
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
