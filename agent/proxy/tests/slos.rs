//! Calls in the SLOs: each bad call is charged to the cause that failed it, as
//! `docs/telemetry.md` ("One cause per bad event") says. For tool calls, whatever the
//! journal makes of the call: a tool that is down and a tool that says 429 both leave
//! the call "not executed", but one is the network and the other capacity; a tool's
//! 5xx is the tool server's (`upstream_model`), and a journal that cannot record the
//! call is the sidecar's own failure (`release`). A local model call that fails while
//! the GPUs were unhealthy at any time during it is the hardware's.
//!
//! The real data plane serves on loopback against the scripted tool and provider of
//! `outrigger-testing`; requests are written by hand, one connection each.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::Uri;
use outrigger_proxy::options::{Capabilities, Dialect, ModelPattern, Provider, Tool, ToolKind};
use outrigger_proxy::{Components, Options, Proxy, server};
use outrigger_telemetry::Metrics;
use outrigger_telemetry::slo::{Slo, SloReport, SloSpec, Slos};
use outrigger_testing::provider::{Behaviour, MockProvider};
use outrigger_testing::tool::{MockTool, ToolBehaviour};
use outrigger_types::{GpuState, GpuSummary, ToolClass};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn slo(name: &str, metric: &str) -> SloSpec {
    SloSpec {
        name: Some(name.into()),
        object: Some("tool_calls".into()),
        metric: Some(metric.into()),
        threshold: None,
        target: Some(0.99),
        window: Some("1d".into()),
        exclusions: Some(vec!["invalid_client".into()]),
        data_source: Some("prometheus:outrigger_slo_events_total".into()),
    }
}

fn tool(name: &str, base_url: &str) -> Result<Tool, Box<dyn std::error::Error>> {
    Ok(Tool {
        name: name.into(),
        kind: ToolKind::Http,
        base_url: base_url.parse::<Uri>()?,
        class: ToolClass::Keyed,
        key_required: false,
        journal_get: false,
        timeout: Duration::from_secs(2),
        probe_path: None,
        redact: Default::default(),
    })
}

/// A port nothing listens on: bound, then closed.
async fn closed_port() -> Result<SocketAddr, std::io::Error> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    listener.local_addr()
}

/// Serves a data plane on loopback; returns its address.
async fn serve(proxy: Proxy) -> Result<SocketAddr, std::io::Error> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(server::serve(
        listener,
        move |req, peer| {
            let proxy = proxy.clone();
            async move { proxy.handle(req, peer).await }
        },
        std::future::pending(),
        Duration::from_secs(1),
    ));
    Ok(addr)
}

/// One tool call; returns the status line's code.
async fn call(
    addr: SocketAddr,
    path: &str,
    key: &str,
    body: &str,
    mock: &str,
) -> Result<u16, Box<dyn std::error::Error>> {
    let mut conn = TcpStream::connect(addr).await?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: sidecar\r\nconnection: close\r\n\
         content-type: application/json\r\nidempotency-key: {key}\r\nx-mock-tool: {mock}\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer)).await??;
    let answer = String::from_utf8_lossy(&answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line in {answer:?}"))?;
    Ok(status)
}

fn report(slos: &Slos, name: &str) -> Result<SloReport, String> {
    slos.report(SystemTime::now())
        .into_iter()
        .find(|r| r.name == name)
        .ok_or_else(|| format!("no SLO {name}"))
}

fn causes(r: &SloReport) -> Vec<(&'static str, u64)> {
    r.bad_by_cause.iter().map(|(c, n)| (*c, *n)).collect()
}

#[tokio::test]
async fn each_bad_tool_call_is_charged_to_its_own_cause() -> TestResult {
    let mock = MockTool::start(ToolBehaviour::default()).await?;
    let down = closed_port().await?;
    let dir = tempfile::tempdir()?;
    let (journal, writer, _) =
        outrigger_journal::Journal::open(outrigger_journal::Options::new(dir.path().join("j")))?;
    let writer = tokio::spawn(writer.run());

    let metrics = Metrics::new();
    let specs = [
        slo("tools-availability", "availability"),
        slo("tools-success", "tool_success"),
    ];
    let slos = Arc::new(Slos::new(Slo::from_specs(&specs, "slos")?, metrics.clone()));
    let options = Options {
        tools: vec![
            tool("payments", &mock.url())?,
            tool("down", &format!("http://{down}"))?,
            Tool {
                kind: ToolKind::Mcp,
                ..tool("files", &format!("http://{down}/mcp"))?
            },
        ],
        ..Options::default()
    };
    let components = |journal| Components {
        slos: slos.clone(),
        ..Components::new(metrics.clone(), journal)
    };
    let sidecar = serve(Proxy::new(options.clone(), components(Some(journal)))).await?;
    // The same data plane without a journal: journaled calls fail closed.
    let no_journal = serve(Proxy::new(options, components(None))).await?;

    let charge = "/tools/payments/charges";
    assert_eq!(call(sidecar, charge, "ok", "{\"n\":1}", "").await?, 200);
    // The tool says 429: not executed, and capacity.
    assert_eq!(
        call(sidecar, charge, "busy", "{\"n\":2}", "status=429").await?,
        429
    );
    // The tool fails with a 503: in doubt, and the tool server's failure.
    assert_eq!(
        call(sidecar, charge, "broken", "{\"n\":3}", "fail=before").await?,
        503
    );
    // The tool is down: not executed, and the network.
    assert_eq!(
        call(sidecar, "/tools/down/x", "gone", "{\"n\":4}", "").await?,
        502
    );
    // The journal cannot record the call: refused, and the sidecar's own failure.
    assert_eq!(
        call(no_journal, charge, "unjournaled", "{\"n\":5}", "").await?,
        503
    );
    // So for MCP: the server is never asked.
    let tools_call = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read","arguments":{},"_meta":{"outrigger/idempotency-key":"m1"}}}"#;
    assert_eq!(
        call(no_journal, "/mcp/files", "m1", tools_call, "").await?,
        503
    );
    // A key reused for another request: the agent's mistake, excluded.
    assert_eq!(call(sidecar, charge, "ok", "{\"n\":6}", "").await?, 422);

    for name in ["tools-availability", "tools-success"] {
        let r = report(&slos, name)?;
        assert_eq!(
            causes(&r),
            [
                ("capacity", 1),
                ("network", 1),
                ("release", 2),
                ("upstream_model", 1)
            ],
            "{name}: {r:?}"
        );
        assert_eq!((r.good, r.excluded), (1, 1), "{name}: {r:?}");
        assert_eq!(r.excluded_by_reason.get("invalid_client"), Some(&1));
    }
    writer.abort();
    Ok(())
}

/// A local model call whose stream breaks is the hardware's when the GPUs turned
/// unhealthy during it, even though they were healthy when it started and when it
/// ended; the same failure with the GPUs healthy throughout is the network's.
#[tokio::test]
async fn a_local_call_the_gpus_failed_during_is_charged_to_hardware() -> TestResult {
    let mock = MockProvider::start(Behaviour {
        chunks: 40,
        chunk_delay: Duration::from_millis(40),
        cut_after: Some(16),
        ..Behaviour::default()
    })
    .await?;
    let metrics = Metrics::new();
    let spec = SloSpec {
        object: Some("model_calls".into()),
        ..slo("local-availability", "availability")
    };
    let slos = Arc::new(Slos::new(
        Slo::from_specs(&[spec], "slos")?,
        metrics.clone(),
    ));
    let options = Options {
        providers: vec![Provider {
            name: "local".into(),
            dialect: Dialect::OpenAi,
            base_url: mock.openai_base().parse()?,
            api_key: None,
            models: vec![ModelPattern::Any],
            caps: Capabilities {
                local: true,
                ..Capabilities::permissive()
            },
        }],
        ..Options::default()
    };
    let components = Components {
        slos: slos.clone(),
        ..Components::new(metrics, None)
    };
    let proxy = Proxy::new(options, components);
    let gpu = |state| GpuSummary {
        state,
        present: true,
        ..GpuSummary::default()
    };
    proxy.set_gpu(gpu(GpuState::Healthy));
    let sidecar = serve(proxy.clone()).await?;
    let body = r#"{"model":"llama","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

    // The GPUs stay healthy: a broken stream is the network's.
    stream(sidecar, body, None).await?;
    recorded(&slos, 1).await?;
    assert_eq!(
        causes(&report(&slos, "local-availability")?),
        [("network", 1)]
    );

    // They turn unhealthy a moment into the stream and recover before it breaks.
    let (started, streaming) = tokio::sync::oneshot::channel();
    let during = tokio::spawn(async move { stream(sidecar, body, Some(started)).await });
    streaming.await?;
    proxy.set_gpu(gpu(GpuState::Unhealthy));
    tokio::time::sleep(Duration::from_millis(50)).await;
    proxy.set_gpu(gpu(GpuState::Healthy));
    during.await??;
    recorded(&slos, 2).await?;
    assert_eq!(
        causes(&report(&slos, "local-availability")?),
        [("hardware", 1), ("network", 1)]
    );
    Ok(())
}

/// Waits (up to 5 s) until `n` calls are recorded: a call is recorded once its answer
/// is over, a moment after the agent has read it.
async fn recorded(slos: &Slos, n: u64) -> Result<(), String> {
    for _ in 0..500 {
        let r = report(slos, "local-availability")?;
        if r.good + r.bad + r.excluded >= n {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(format!("{n} calls were not recorded within 5 s"))
}

/// Sends a streamed chat request and reads the answer to its end; `started` is told
/// once the first bytes of the answer have arrived.
async fn stream(
    addr: SocketAddr,
    body: &str,
    started: Option<tokio::sync::oneshot::Sender<()>>,
) -> std::io::Result<()> {
    let mut conn = TcpStream::connect(addr).await?;
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: sidecar\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await?;
    let read = async {
        let mut buf = [0u8; 4096];
        let mut started = started;
        while conn.read(&mut buf).await? > 0 {
            if let Some(tx) = started.take() {
                let _ = tx.send(());
            }
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), read).await?
}
