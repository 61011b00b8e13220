//! `cargo xtask demo [--once]`: the sidecar on its embedded defaults (data plane
//! 127.0.0.1:7070, admin 127.0.0.1:7071, data dir ./outrigger-data), pointed at the
//! mock provider through the same environment variables the provider SDKs read,
//! with demo requests going through it. Without `--once` it then stays up so you
//! can send your own requests; Ctrl-C stops everything.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http::Method;

use crate::client::{self, HttpClient};
use crate::procs::{self, Proc};

const MOCK: &str = "127.0.0.1:7080";
const DATA: &str = "http://127.0.0.1:7070";
const ADMIN: &str = "http://127.0.0.1:7071";

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let once = args.iter().any(|a| a == "--once");
    if let Some(other) = args.iter().find(|a| *a != "--once") {
        bail!("unknown argument {other:?}; usage: cargo xtask demo [--once]");
    }
    let bins = procs::build_bins("debug", &["outrigger", "outrigger-testing"])?;

    let mut mock = Proc::spawn(
        "mock provider",
        std::process::Command::new(bins.join("outrigger-mock")).args([
            "provider",
            "--listen",
            MOCK,
            "--chunks",
            "12",
            "--delay-ms",
            "60",
        ]),
    )?;
    let mut sidecar = Proc::spawn(
        "outrigger",
        std::process::Command::new(bins.join("outrigger"))
            .arg("serve")
            .current_dir(procs::root())
            .env("OPENAI_API_KEY", "sk-demo-not-a-real-key")
            .env("OPENAI_BASE_URL", format!("http://{MOCK}/v1"))
            .env("ANTHROPIC_API_KEY", "sk-ant-demo-not-a-real-key")
            .env("ANTHROPIC_BASE_URL", format!("http://{MOCK}")),
    )?;

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async {
        let client = client::client();
        client::wait_ready(&client, &format!("{ADMIN}/readyz"), Duration::from_secs(60))
            .await
            .context("the sidecar did not become ready (is port 7070 or 7071 taken?)")?;
        demo_requests(&client).await
    });
    if result.is_ok() && !once {
        print_guide();
        wait_for_ctrl_c();
    }
    sidecar.terminate(Duration::from_secs(10));
    mock.terminate(Duration::from_secs(2));
    result
}

async fn demo_requests(client: &HttpClient) -> anyhow::Result<()> {
    banner(
        "1. A chat completion through the sidecar (the agent's key is dropped, the sidecar's injected)",
    );
    let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello"}]}"#;
    println!(
        "$ curl -s {DATA}/v1/chat/completions -H 'content-type: application/json' \\\n    -H 'Outrigger-Task-Id: demo-task-1' -d '{body}'"
    );
    let reply = client::send(
        client,
        Method::POST,
        &format!("{DATA}/v1/chat/completions"),
        &[
            ("content-type", "application/json"),
            ("outrigger-task-id", "demo-task-1"),
        ],
        Bytes::from(body),
    )
    .await?;
    println!(
        "HTTP {}  (Outrigger-Request-Id: {})",
        reply.status,
        header(&reply, "outrigger-request-id")
    );
    println!("{}\n", pretty(&reply.body));
    if reply.status != 200 {
        bail!("the demo request failed with HTTP {}", reply.status);
    }

    banner("2. A streamed completion, relayed event by event as the provider produces it");
    let body = r#"{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"Stream please"}]}"#;
    println!(
        "$ curl -N {DATA}/v1/chat/completions -H 'content-type: application/json' -d '{body}'"
    );
    let mut events = 0usize;
    let status = client::stream(
        client,
        &format!("{DATA}/v1/chat/completions"),
        &[("content-type", "application/json")],
        Bytes::from(body),
        |chunk| {
            events += chunk.windows(2).filter(|w| w == b"\n\n").count();
            print!("{}", String::from_utf8_lossy(chunk));
            let _ = std::io::stdout().flush();
        },
    )
    .await?;
    println!("(HTTP {status}, {events} events)\n");

    banner("3. The same through the Anthropic dialect");
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"Hi"}]}"#;
    println!("$ curl -s {DATA}/v1/messages -H 'content-type: application/json' -d '{body}'");
    let reply = client::send(
        client,
        Method::POST,
        &format!("{DATA}/v1/messages"),
        &[("content-type", "application/json")],
        Bytes::from(body),
    )
    .await?;
    println!("HTTP {}\n{}\n", reply.status, pretty(&reply.body));

    banner("4. Bad input gets a problem document that says what to fix");
    println!("$ curl -s {DATA}/v1/chat/completions -d '{{\"model\": ' ");
    let reply = client::send(
        client,
        Method::POST,
        &format!("{DATA}/v1/chat/completions"),
        &[("content-type", "application/json")],
        Bytes::from_static(b"{\"model\": "),
    )
    .await?;
    println!("HTTP {}\n{}\n", reply.status, pretty(&reply.body));

    banner("5. The admin plane: readiness and metrics");
    let reply = client::send(
        client,
        Method::GET,
        &format!("{ADMIN}/readyz"),
        &[],
        Bytes::new(),
    )
    .await?;
    println!("$ curl -s {ADMIN}/readyz\n{}\n", reply.text());
    let reply = client::send(
        client,
        Method::GET,
        &format!("{ADMIN}/metrics"),
        &[],
        Bytes::new(),
    )
    .await?;
    println!("$ curl -s {ADMIN}/metrics | grep outrigger_http_requests_total");
    for line in reply
        .text()
        .lines()
        .filter(|l| l.starts_with("outrigger_http_requests_total"))
    {
        println!("{line}");
    }
    println!();
    Ok(())
}

fn print_guide() {
    banner("The sidecar is running. Try it yourself:");
    println!(
        "  curl -s {DATA}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"gpt-4o-mini\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'\n"
    );
    println!("  Point the OpenAI SDK at it (any key: the sidecar holds the real one):");
    println!("    OPENAI_BASE_URL={DATA}/v1 OPENAI_API_KEY=unused python3 -c \\");
    println!(
        "      'from openai import OpenAI; print(OpenAI().chat.completions.create(model=\"gpt-4o-mini\", messages=[{{\"role\":\"user\",\"content\":\"hi\"}}]).choices[0].message.content)'"
    );
    println!("  Anthropic SDK: ANTHROPIC_BASE_URL={DATA} ANTHROPIC_API_KEY=unused");
    println!("  Metrics: curl -s {ADMIN}/metrics     Readiness: curl -s {ADMIN}/readyz\n");
    println!("Press Ctrl-C to stop the sidecar and the mock provider.");
}

fn wait_for_ctrl_c() {
    // The default SIGINT disposition would kill xtask before it can stop its
    // children, so catch it with a small runtime.
    if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        let _ = rt.block_on(tokio::signal::ctrl_c());
    }
}

fn banner(s: &str) {
    println!("\x1b[1m== {s}\x1b[0m");
}

fn header<'a>(r: &'a client::Reply, name: &str) -> &'a str {
    r.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
}

fn pretty(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or_else(|_| String::from_utf8_lossy(body).into_owned())
}
