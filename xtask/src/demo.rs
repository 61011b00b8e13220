//! `cargo xtask demo [--once]`: the sidecar on its embedded defaults (data plane
//! 127.0.0.1:7070, admin 127.0.0.1:7071, data dir ./outrigger-data), pointed at the
//! mock provider through the same environment variables the provider SDKs read,
//! with demo requests going through it. Without `--once` it then stays up so you
//! can send your own requests; Ctrl-C stops everything.
//!
//! The demo talks only to the sidecar it started: it waits for that process's ready
//! file (another sidecar already on the ports makes this one exit, and the demo
//! fail), checks its children are still running, and fails on any step's
//! unexpected status.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http::Method;

use crate::client::{self, HttpClient};
use crate::procs::{self, Proc};

/// How long the sidecar may take to be ready (it compiles the built-in policies).
const READY_WITHIN: Duration = Duration::from_secs(60);

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let once = args.iter().any(|a| a == "--once");
    if let Some(other) = args.iter().find(|a| *a != "--once") {
        bail!("unknown argument {other:?}; usage: cargo xtask demo [--once]");
    }
    let bins = procs::build_bins("debug", &["outrigger", "outrigger-testing"])?;

    // The mock on a port nobody else uses: the sidecar must not reach another one.
    let mock_addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut mock = Proc::spawn(
        "mock provider",
        std::process::Command::new(bins.join("outrigger-mock")).args([
            "provider",
            "--listen",
            &mock_addr.to_string(),
            "--chunks",
            "12",
            "--delay-ms",
            "60",
        ]),
    )?;
    let ready_file =
        std::env::temp_dir().join(format!("outrigger-demo-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&ready_file);
    let mut sidecar = Proc::spawn(
        "outrigger",
        std::process::Command::new(bins.join("outrigger"))
            .arg("serve")
            .arg("--ready-file")
            .arg(&ready_file)
            .current_dir(procs::root())
            .env("OPENAI_API_KEY", "sk-demo-not-a-real-key")
            .env("OPENAI_BASE_URL", format!("http://{mock_addr}/v1"))
            .env("ANTHROPIC_API_KEY", "sk-ant-demo-not-a-real-key")
            .env("ANTHROPIC_BASE_URL", format!("http://{mock_addr}")),
    )?;

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async {
        let client = client::client();
        client::wait_ready(
            &client,
            &format!("http://{mock_addr}/v1/models"),
            Duration::from_secs(10),
        )
        .await
        .context("the mock provider did not start")?;
        let planes = wait_for_ready_file(&ready_file, &mut sidecar).await?;
        still_running(&mut [&mut mock, &mut sidecar])?;
        demo_requests(&client, &planes).await?;
        still_running(&mut [&mut mock, &mut sidecar])?;
        anyhow::Ok(planes)
    });
    let _ = std::fs::remove_file(&ready_file);
    let result = match result {
        Ok(planes) if !once => {
            print_guide(&planes);
            wait_for_ctrl_c();
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    };
    sidecar.terminate(Duration::from_secs(10));
    mock.terminate(Duration::from_secs(2));
    result
}

/// Where the demo's own sidecar listens.
struct Planes {
    /// `http://…` of the data plane.
    data: String,
    /// `http://…` of the admin plane.
    admin: String,
}

/// Waits for the ready file `outrigger serve --ready-file` writes once it listens,
/// naming this child's pid; fails as soon as the child exits (a port already taken).
async fn wait_for_ready_file(path: &Path, sidecar: &mut Proc) -> anyhow::Result<Planes> {
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        if let Some(status) = sidecar.child.try_wait()? {
            bail!(
                "the sidecar exited ({status}) before it was ready: is another sidecar \
                 already listening on 127.0.0.1:7070 or 7071?"
            );
        }
        if let Some(planes) = read_ready_file(path, sidecar.pid()) {
            return Ok(planes);
        }
        if Instant::now() > deadline {
            bail!("the sidecar was not ready within {READY_WITHIN:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The planes of a ready file written by the process `pid`.
fn read_ready_file(path: &Path, pid: u32) -> Option<Planes> {
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    if doc["pid"].as_u64() != Some(u64::from(pid)) {
        return None;
    }
    let addr = |k: &str| doc[k].as_str()?.parse::<SocketAddr>().ok();
    Some(Planes {
        data: format!("http://{}", addr("data")?),
        admin: format!("http://{}", addr("admin")?),
    })
}

/// Fails if one of the demo's processes has exited.
fn still_running(procs: &mut [&mut Proc]) -> anyhow::Result<()> {
    for p in procs.iter_mut() {
        if let Some(status) = p.child.try_wait()? {
            bail!("the {} exited ({status}) during the demo", p.name);
        }
    }
    Ok(())
}

/// Fails unless a demo step was answered `want`.
fn expect_status(step: &str, got: u16, want: u16) -> anyhow::Result<()> {
    if got != want {
        bail!("demo step {step:?} was answered HTTP {got}, not {want}");
    }
    Ok(())
}

async fn demo_requests(client: &HttpClient, planes: &Planes) -> anyhow::Result<()> {
    let (data, admin) = (planes.data.as_str(), planes.admin.as_str());
    banner(
        "1. A chat completion through the sidecar (the agent's key is dropped, the sidecar's injected)",
    );
    let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello"}]}"#;
    println!(
        "$ curl -s {data}/v1/chat/completions -H 'content-type: application/json' \\\n    -H 'Outrigger-Task-Id: demo-task-1' -d '{body}'"
    );
    let reply = client::send(
        client,
        Method::POST,
        &format!("{data}/v1/chat/completions"),
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
    expect_status("chat completion", reply.status, 200)?;

    banner("2. A streamed completion, relayed event by event as the provider produces it");
    let body = r#"{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"Stream please"}]}"#;
    println!(
        "$ curl -N {data}/v1/chat/completions -H 'content-type: application/json' -d '{body}'"
    );
    let mut events = 0usize;
    let status = client::stream(
        client,
        &format!("{data}/v1/chat/completions"),
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
    expect_status("streamed completion", status, 200)?;
    if events == 0 {
        bail!("demo step \"streamed completion\" returned no event");
    }

    banner("3. The same through the Anthropic dialect");
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"Hi"}]}"#;
    println!("$ curl -s {data}/v1/messages -H 'content-type: application/json' -d '{body}'");
    let reply = client::send(
        client,
        Method::POST,
        &format!("{data}/v1/messages"),
        &[("content-type", "application/json")],
        Bytes::from(body),
    )
    .await?;
    println!("HTTP {}\n{}\n", reply.status, pretty(&reply.body));
    expect_status("Anthropic dialect", reply.status, 200)?;

    banner("4. Bad input gets a problem document that says what to fix");
    println!("$ curl -s {data}/v1/chat/completions -d '{{\"model\": ' ");
    let reply = client::send(
        client,
        Method::POST,
        &format!("{data}/v1/chat/completions"),
        &[("content-type", "application/json")],
        Bytes::from_static(b"{\"model\": "),
    )
    .await?;
    println!("HTTP {}\n{}\n", reply.status, pretty(&reply.body));
    expect_status("bad input", reply.status, 400)?;

    banner("5. The admin plane: readiness and metrics");
    let reply = client::send(
        client,
        Method::GET,
        &format!("{admin}/readyz"),
        &[],
        Bytes::new(),
    )
    .await?;
    println!("$ curl -s {admin}/readyz\n{}\n", reply.text());
    expect_status("readiness", reply.status, 200)?;
    let reply = client::send(
        client,
        Method::GET,
        &format!("{admin}/metrics"),
        &[],
        Bytes::new(),
    )
    .await?;
    println!("$ curl -s {admin}/metrics | grep outrigger_http_requests_total");
    expect_status("metrics", reply.status, 200)?;
    let text = reply.text();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("outrigger_http_requests_total"))
        .collect();
    for line in &lines {
        println!("{line}");
    }
    println!();
    if lines.is_empty() {
        bail!("demo step \"metrics\": /metrics counts no request");
    }
    Ok(())
}

fn print_guide(planes: &Planes) {
    let (data, admin) = (planes.data.as_str(), planes.admin.as_str());
    banner("The sidecar is running. Try it yourself:");
    println!(
        "  curl -s {data}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"gpt-4o-mini\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'\n"
    );
    println!("  Point the OpenAI SDK at it (any key: the sidecar holds the real one):");
    println!("    OPENAI_BASE_URL={data}/v1 OPENAI_API_KEY=unused python3 -c \\");
    println!(
        "      'from openai import OpenAI; print(OpenAI().chat.completions.create(model=\"gpt-4o-mini\", messages=[{{\"role\":\"user\",\"content\":\"hi\"}}]).choices[0].message.content)'"
    );
    println!("  Anthropic SDK: ANTHROPIC_BASE_URL={data} ANTHROPIC_API_KEY=unused");
    println!("  Metrics: curl -s {admin}/metrics     Readiness: curl -s {admin}/readyz\n");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_ready_file_of_our_own_child_counts() {
        let path =
            std::env::temp_dir().join(format!("outrigger-demo-test-{}.json", std::process::id()));
        std::fs::write(
            &path,
            r#"{"data": "127.0.0.1:7070", "admin": "127.0.0.1:7071", "pid": 4242}"#,
        )
        .unwrap();
        let planes = read_ready_file(&path, 4242).expect("ours");
        assert_eq!(planes.data, "http://127.0.0.1:7070");
        assert_eq!(planes.admin, "http://127.0.0.1:7071");
        // Another process's file (a sidecar started before ours) is not ours.
        assert!(read_ready_file(&path, 4243).is_none());
        let _ = std::fs::remove_file(&path);
        assert!(read_ready_file(&path, 4242).is_none());
    }
}
