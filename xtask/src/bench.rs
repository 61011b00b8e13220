//! `cargo xtask bench`: the load harness. Every target is measured in the same run
//! against the same mock upstream on loopback, so the figures that matter are ratios:
//!
//! - `direct`: the load generator talks to the mock provider itself;
//! - `nginx`: Debian's nginx as a plain reverse proxy (the floor any HTTP proxy is
//!   held to; installed with apt-get when missing);
//! - `floor`: a minimal hyper pass-through proxy (`outrigger-mock passthrough`);
//! - `sidecar`: `outrigger serve`;
//! - with `--compare BIN`: the same sidecar targets again on another `outrigger`
//!   binary (named `…@base`, typically a build of the previous commit), so a change
//!   is measured against the version before it in the same run.
//!
//! On a 2-core machine the load generator, the upstream and the proxy share the
//! cores, so the proxy's CPU time per request (read from /proc) and its ratio to
//! nginx are the figures to trust; throughput is reported too. Each measurement is
//! repeated (`--rounds`, default 3; the targets of a scenario take turns, round by
//! round) and each figure's median over the rounds is reported.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http::Method;
use serde_json::json;

use crate::client::{self, HttpClient};
use crate::procs::{self, Proc};

struct Options {
    duration: Duration,
    rounds: usize,
    suites: Vec<String>,
    out: Option<PathBuf>,
    /// Another `outrigger` binary measured side by side with this one.
    compare: Option<PathBuf>,
}

fn parse(args: &[String]) -> anyhow::Result<Options> {
    let mut o = Options {
        duration: Duration::from_secs(8),
        rounds: 3,
        suites: ["models", "streams", "ttfb", "resume", "tools"]
            .map(String::from)
            .to_vec(),
        out: None,
        compare: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .with_context(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            "--duration" => o.duration = Duration::from_secs(val()?.parse()?),
            "--rounds" => {
                o.rounds = val()?.parse()?;
                if o.rounds == 0 {
                    bail!("--rounds must be at least 1 (each figure is the median of the rounds)");
                }
            }
            "--suite" => o.suites = val()?.split(',').map(str::to_string).collect(),
            "--out" => o.out = Some(PathBuf::from(val()?)),
            "--compare" => o.compare = Some(PathBuf::from(val()?)),
            other => bail!(
                "unknown argument {other:?}; usage: cargo xtask bench [--duration SECS] [--rounds N] \
                 [--suite models,streams,ttfb,resume,tools,policies] [--out FILE] [--compare OUTRIGGER_BIN]"
            ),
        }
    }
    Ok(o)
}

/// A process (or group of processes) whose CPU time and memory are measured, and
/// the URL prefix that reaches the upstream through it.
#[derive(Clone)]
struct Measured {
    name: String,
    url: String,
    pids: Vec<u32>,
    /// Send a fresh `Idempotency-Key` with every request (journaled tool calls).
    unique_key: bool,
    /// Every answer is served from the journal (`Outrigger-Replayed: true`).
    replayed: bool,
    /// The admin plane of the sidecar behind it (journal statistics).
    admin: Option<String>,
}

/// Everything the scenarios can point at.
struct Targets {
    direct: Measured,
    nginx: Option<Measured>,
    floor: Measured,
    sidecar: Measured,
    /// The `--compare` sidecar.
    base: Option<Measured>,
    tool_direct: Measured,
    tool_nginx: Option<Measured>,
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let mut opts = parse(args)?;
    if opts.suites.iter().any(|s| s == "policies") {
        policies()?;
        opts.suites.retain(|s| s != "policies");
        if opts.suites.is_empty() {
            return Ok(());
        }
    }
    let bins = procs::build_bins("release", &["outrigger", "outrigger-testing"])?;
    let work = tempdir()?;

    let mock_addr = free_port()?;
    let _mock = Proc::spawn(
        "mock",
        Command::new(bins.join("outrigger-mock"))
            .args(["provider", "--listen", &mock_addr.to_string()])
            .stdout(std::process::Stdio::null()),
    )?;

    let tool_addr = free_port()?;
    let _tool = Proc::spawn(
        "mock tool",
        Command::new(bins.join("outrigger-mock"))
            .args(["tool", "--listen", &tool_addr.to_string()])
            .stdout(std::process::Stdio::null()),
    )?;

    let floor_addr = free_port()?;
    let floor = Proc::spawn(
        "floor",
        Command::new(bins.join("outrigger-mock"))
            .args(["passthrough", "--listen", &floor_addr.to_string()])
            .args(["--upstream", &mock_addr.to_string()])
            .stdout(std::process::Stdio::null()),
    )?;

    let nginx = start_nginx(&work, mock_addr, tool_addr)?;

    let (sidecar, sidecar_addr, admin_addr) = start_sidecar(
        &bins.join("outrigger"),
        &work.join("sidecar"),
        mock_addr,
        tool_addr,
    )?;
    let base = match &opts.compare {
        Some(bin) => Some(start_sidecar(
            bin,
            &work.join("base"),
            mock_addr,
            tool_addr,
        )?),
        None => None,
    };
    // One thread: the load shares the machine's cores with what it measures, and a
    // single-threaded client spends the least CPU per request (no cross-thread
    // hand-offs), leaving the most to the targets. Every target gets the same one.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = client::client();
    rt.block_on(async {
        for admin in std::iter::once(admin_addr).chain(base.as_ref().map(|b| b.2)) {
            client::wait_ready(
                &client,
                &format!("http://{admin}/readyz"),
                Duration::from_secs(60),
            )
            .await?;
        }
        client::wait_ready(
            &client,
            &format!("http://{mock_addr}/v1/models"),
            Duration::from_secs(10),
        )
        .await?;
        client::wait_ready(
            &client,
            &format!("http://{floor_addr}/v1/models"),
            Duration::from_secs(10),
        )
        .await?;
        // The mock tool's status route answers 404 for a key it never saw: any
        // answer says it is up.
        client::wait_answering(
            &client,
            &format!("http://{tool_addr}/status/none-ready"),
            Duration::from_secs(10),
        )
        .await?;
        if let Some(n) = &nginx {
            client::wait_ready(
                &client,
                &format!("http://{}/v1/models", n.addr),
                Duration::from_secs(10),
            )
            .await?;
        }
        anyhow::Ok(())
    })?;

    let m = |name: &str, url: String, pids: Vec<u32>| Measured {
        name: name.to_string(),
        url,
        pids,
        unique_key: false,
        replayed: false,
        admin: None,
    };
    let targets = Targets {
        direct: m("direct", format!("http://{mock_addr}"), vec![]),
        nginx: nginx
            .as_ref()
            .map(|n| m("nginx", format!("http://{}", n.addr), n.pids.clone())),
        floor: m("floor", format!("http://{floor_addr}"), vec![floor.pid()]),
        sidecar: Measured {
            admin: Some(format!("http://{admin_addr}")),
            ..m(
                "sidecar",
                format!("http://{sidecar_addr}"),
                vec![sidecar.pid()],
            )
        },
        base: base.as_ref().map(|(proc, data, admin)| Measured {
            admin: Some(format!("http://{admin}")),
            ..m("sidecar@base", format!("http://{data}"), vec![proc.pid()])
        }),
        tool_direct: m("direct", format!("http://{tool_addr}"), vec![]),
        tool_nginx: nginx.as_ref().map(|n| {
            m(
                "nginx",
                format!("http://{}/tools/bench", n.addr),
                n.pids.clone(),
            )
        }),
    };
    let scenarios = scenarios(&opts.suites, &targets)?;
    let machine = machine();
    println!("machine: {machine}");
    let mut report = Vec::new();
    for sc in &scenarios {
        println!(
            "\n== {} ({} rounds of {:?})",
            sc.name, opts.rounds, opts.duration
        );
        // Targets take turns round by round, so a slow spell of the machine hits
        // them alike.
        let stats = |t: &Measured| match (&t.admin, t.unique_key) {
            (Some(admin), true) => journal_stats(&rt, &client, admin),
            _ => None,
        };
        let before: Vec<_> = sc.targets.iter().map(stats).collect();
        let mut rounds: Vec<Vec<Row>> = sc.targets.iter().map(|_| Vec::new()).collect();
        for _ in 0..opts.rounds {
            for (t, r) in sc.targets.iter().zip(&mut rounds) {
                let journaled = t.admin.is_some() && t.unique_key;
                let before = stats(t);
                if journaled && before.is_none() {
                    bail!("{}: the journal's statistics could not be read", t.name);
                }
                let row = rt.block_on(measure(&client, t, sc, opts.duration))?;
                if let Some(before) = before {
                    let after = stats(t).with_context(|| {
                        format!("{}: the journal's statistics could not be read", t.name)
                    })?;
                    check_journaled(
                        sc.journals,
                        sc.events,
                        row.requests + row.warmup_requests,
                        before,
                        after,
                    )
                    .map_err(|e| anyhow::anyhow!("{} in {}: {e}", t.name, sc.name))?;
                }
                if t.replayed {
                    rt.block_on(probe_replayed(&client, t, sc))?;
                }
                r.push(row);
            }
        }
        let mut rows = BTreeMap::new();
        for ((t, rounds), before) in sc.targets.iter().zip(rounds).zip(before) {
            if let (Some(before), Some(after)) = (before, stats(t)) {
                let records = after
                    .records_written
                    .saturating_sub(before.records_written)
                    .max(1);
                let flushes = after.flushes.saturating_sub(before.flushes);
                // The statistics span the warm-ups too: count their calls.
                let calls = rounds
                    .iter()
                    .map(|r| r.requests + r.warmup_requests)
                    .sum::<u64>()
                    .max(1);
                println!(
                    "  {:8} journal: {records} records, {flushes} flushes = {:.3} flushes/record, {:.3} flushes/call",
                    t.name,
                    flushes as f64 / records as f64,
                    flushes as f64 / calls as f64
                );
            }
            let median = Row::median(&rounds);
            println!(
                "  {:8} {:>9.0} {}/s  p50 {:>8.2} ms  p99 {:>8.2} ms  cpu {:>8.1} µs/{}  rss {:>6.1} MiB{}",
                t.name,
                median.throughput,
                sc.unit,
                median.p50_ms,
                median.p99_ms,
                median.cpu_us_per_unit,
                sc.unit,
                median.rss_mib,
                if median.rss_of_round {
                    ""
                } else {
                    " (peak since start)"
                }
            );
            rows.insert(t.name.as_str(), median);
        }
        let ratio = |a: &str, b: &str, f: fn(&Row) -> f64| match (rows.get(a), rows.get(b)) {
            (Some(x), Some(y)) if f(y) > 0.0 => Some(f(x) / f(y)),
            _ => None,
        };
        let added = |a: &str| match (rows.get(a), rows.get("direct")) {
            (Some(x), Some(d)) => Some(x.p50_ms - d.p50_ms),
            _ => None,
        };
        let mut ratios = serde_json::Map::new();
        let measured: Vec<&str> = rows
            .keys()
            .copied()
            .filter(|n| {
                let kind = n.strip_suffix("@base").unwrap_or(n);
                ["sidecar", "journaled", "unjournaled", "replayed"].contains(&kind)
            })
            .collect();
        for &name in &measured {
            let cpu_nginx = ratio(name, "nginx", |r| r.cpu_us_per_unit);
            let cpu_floor = ratio(name, "floor", |r| r.cpu_us_per_unit);
            let tput_nginx = ratio(name, "nginx", |r| r.throughput);
            // Added latency over direct, against nginx's (the TTFB target is a ratio of
            // what each proxy adds).
            let added_vs_nginx = match (added(name), added("nginx")) {
                (Some(a), Some(n)) if n > 0.0 => Some(a / n),
                _ => None,
            };
            println!(
                "  ratios {name}: cpu/nginx {}  cpu/floor {}  throughput/nginx {}  added p50 {} (vs nginx's {})",
                fmt_ratio(cpu_nginx),
                fmt_ratio(cpu_floor),
                fmt_ratio(tput_nginx),
                added(name)
                    .map(|p| format!("{p:.3} ms"))
                    .unwrap_or_else(|| "n/a".into()),
                fmt_ratio(added_vs_nginx),
            );
            ratios.insert(
                name.to_string(),
                json!({"cpu_vs_nginx": cpu_nginx, "cpu_vs_floor": cpu_floor,
                       "throughput_vs_nginx": tput_nginx, "added_p50_ms": added(name),
                       "added_p50_vs_nginx": added_vs_nginx}),
            );
        }
        if let Some(r) = ratio("journaled", "unjournaled", |r| r.throughput) {
            println!("  journaled/unjournaled throughput {}", fmt_ratio(Some(r)));
            ratios.insert("journaled_vs_unjournaled_throughput".into(), json!(r));
        }
        // This binary against the `--compare` one, target by target.
        for &name in measured.iter().filter(|n| !n.ends_with("@base")) {
            let base = format!("{name}@base");
            let cpu = ratio(name, &base, |r| r.cpu_us_per_unit);
            let tput = ratio(name, &base, |r| r.throughput);
            let p50 = ratio(name, &base, |r| r.p50_ms);
            if cpu.is_none() && tput.is_none() {
                continue;
            }
            println!(
                "  {name} vs {base}: cpu {}  throughput {}  p50 {}",
                fmt_ratio(cpu),
                fmt_ratio(tput),
                fmt_ratio(p50)
            );
            ratios.insert(
                format!("{name}_vs_base"),
                json!({"cpu": cpu, "throughput": tput, "p50": p50}),
            );
        }
        report.push(json!({
            "scenario": sc.name, "unit": sc.unit,
            "results": rows.iter().map(|(k, r)| (k.to_string(), r.to_json())).collect::<serde_json::Map<_, _>>(),
            "ratios": ratios,
        }));
    }
    let doc = json!({"duration_s": opts.duration.as_secs(), "rounds": opts.rounds,
                     "machine": machine, "scenarios": report});
    let out = opts
        .out
        .unwrap_or_else(|| procs::root().join("bench-results").join("bench.json"));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&doc)?)?;
    println!("\nwrote {}", out.display());
    drop(nginx);
    Ok(())
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map(|r| format!("{r:.2}x"))
        .unwrap_or_else(|| "n/a".into())
}

struct Scenario {
    name: String,
    targets: Vec<Measured>,
    unit: &'static str,
    concurrency: usize,
    path: &'static str,
    body: Bytes,
    headers: Vec<(&'static str, String)>,
    /// Events per response (streams), for per-event CPU.
    events: u64,
    /// Latency is time to the first body byte rather than to the last.
    ttfb: bool,
    /// What a journaled target of this scenario writes to the journal per call.
    journals: Journals,
}

/// What one journaled call leaves in the journal, checked after every round.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Journals {
    /// A record that ends `completed` (a tool call).
    Record,
    /// Its stream's events, at least `Scenario::events` of them.
    StreamEvents,
}

fn scenarios(suites: &[String], t: &Targets) -> anyhow::Result<Vec<Scenario>> {
    let mut out = suite_scenarios(suites, t)?;
    if let Some(base) = &t.base {
        // Every target served by the sidecar again on the `--compare` one.
        for sc in &mut out {
            let twins: Vec<Measured> = sc
                .targets
                .iter()
                .filter(|m| m.pids == t.sidecar.pids)
                .map(|m| Measured {
                    name: format!("{}@base", m.name),
                    url: m.url.replacen(&t.sidecar.url, &base.url, 1),
                    pids: base.pids.clone(),
                    admin: base.admin.clone(),
                    unique_key: m.unique_key,
                    replayed: m.replayed,
                })
                .collect();
            sc.targets.extend(twins);
        }
    }
    Ok(out)
}

fn suite_scenarios(suites: &[String], t: &Targets) -> anyhow::Result<Vec<Scenario>> {
    let mut out = Vec::new();
    let proxies = || {
        let mut v = vec![t.direct.clone()];
        v.extend(t.nginx.clone());
        v.push(t.floor.clone());
        v.push(t.sidecar.clone());
        v
    };
    for suite in suites {
        match suite.as_str() {
            "models" => {
                // A ~1 KB chat request.
                let filler = "lorem ipsum dolor sit amet ".repeat(34);
                let body =
                    json!({"model": "gpt-mock", "messages": [{"role": "user", "content": filler}]});
                for c in [1, 16, 64] {
                    out.push(Scenario {
                        targets: proxies(),
                        name: format!("chat completion, 1 KB body, concurrency {c}"),
                        unit: "req",
                        concurrency: c,
                        path: "/v1/chat/completions",
                        body: Bytes::from(body.to_string()),
                        headers: vec![],
                        events: 1,
                        ttfb: false,
                        journals: Journals::StreamEvents,
                    });
                }
            }
            "streams" => {
                let body = json!({"model": "gpt-mock", "stream": true,
                                  "messages": [{"role": "user", "content": "stream"}]});
                // 197 text deltas + role + finish + [DONE] = 200 events.
                // The sidecar twice: relaying only, and journaling every event (a fresh
                // Idempotency-Key per request makes each a new journaled generation).
                for (label, delay, c) in [("burst", 0, 8), ("2 ms apart", 2, 32)] {
                    let mut targets = proxies();
                    targets.push(journaled(&t.sidecar));
                    out.push(Scenario {
                        targets,
                        name: format!("stream of 200 events, {label}, concurrency {c}"),
                        unit: "event",
                        concurrency: c,
                        path: "/v1/chat/completions",
                        body: Bytes::from(body.to_string()),
                        headers: vec![("x-mock", format!("chunks=197,delay_ms={delay}"))],
                        events: 200,
                        ttfb: false,
                        journals: Journals::StreamEvents,
                    });
                }
            }
            "ttfb" => {
                // Time to the first byte of a stream, one request at a time.
                let body = json!({"model": "gpt-mock", "stream": true,
                                  "messages": [{"role": "user", "content": "first byte"}]});
                let mut targets = proxies();
                targets.push(journaled(&t.sidecar));
                out.push(Scenario {
                    targets,
                    name: "stream time to first byte, concurrency 1".into(),
                    unit: "req",
                    concurrency: 1,
                    path: "/v1/chat/completions",
                    body: Bytes::from(body.to_string()),
                    headers: vec![("x-mock", "chunks=20".into())],
                    events: 1,
                    ttfb: true,
                    journals: Journals::StreamEvents,
                });
            }
            "resume" => {
                // A 1,000-event stream journaled once (the warm-up's first request),
                // then served from the journal to the last byte, again and again.
                let body = json!({"model": "gpt-mock", "stream": true,
                                  "messages": [{"role": "user", "content": "resume me"}]});
                out.push(Scenario {
                    targets: vec![Measured {
                        name: "replayed".into(),
                        replayed: true,
                        ..t.sidecar.clone()
                    }],
                    name: "replay of a journaled 1,000-event stream, concurrency 1".into(),
                    unit: "event",
                    concurrency: 1,
                    path: "/v1/chat/completions",
                    body: Bytes::from(body.to_string()),
                    headers: vec![
                        ("x-mock", "chunks=997".into()),
                        (
                            "idempotency-key",
                            format!("bench-resume-{}", std::process::id()),
                        ),
                    ],
                    events: 1000,
                    ttfb: false,
                    journals: Journals::StreamEvents,
                });
            }
            "tools" => {
                // The same tool call direct, through nginx, through the sidecar without a
                // key (passed through unjournaled) and with a fresh key (journaled: two
                // durable writes per call).
                let body = json!({"amount": 42, "to": "acct-1", "memo": "lorem ipsum ".repeat(8)});
                for c in [1, 16, 64] {
                    let mut targets = vec![t.tool_direct.clone()];
                    targets.extend(t.tool_nginx.clone());
                    let sidecar_tool = format!("{}/tools/bench", t.sidecar.url);
                    targets.push(Measured {
                        name: "unjournaled".into(),
                        url: sidecar_tool.clone(),
                        ..t.sidecar.clone()
                    });
                    targets.push(Measured {
                        name: "journaled".into(),
                        url: sidecar_tool,
                        unique_key: true,
                        ..t.sidecar.clone()
                    });
                    out.push(Scenario {
                        targets,
                        name: format!("tool call (POST), concurrency {c}"),
                        unit: "call",
                        concurrency: c,
                        path: "/op",
                        body: Bytes::from(body.to_string()),
                        headers: vec![],
                        events: 1,
                        ttfb: false,
                        journals: Journals::Record,
                    });
                }
            }
            other => bail!(
                "unknown suite {other:?}; expected models, streams, ttfb, resume, tools or policies"
            ),
        }
    }
    Ok(out)
}

/// Starts `outrigger serve` from `bin` with its data under `dir`, pointed at the
/// mocks; returns the process and its data and admin addresses.
fn start_sidecar(
    bin: &Path,
    dir: &Path,
    mock_addr: SocketAddr,
    tool_addr: SocketAddr,
) -> anyhow::Result<(Proc, SocketAddr, SocketAddr)> {
    std::fs::create_dir_all(dir)?;
    let data = free_port()?;
    let admin = free_port()?;
    let config = dir.join("outrigger.toml");
    std::fs::write(
        &config,
        format!(
            "[listen]\ndata = \"{data}\"\nadmin = \"{admin}\"\n\
             [journal]\ndir = {:?}\n[log]\nlevel = \"warn\"\n\
             [[providers]]\nname = \"mock\"\nkind = \"openai\"\nbase_url = \"http://{mock_addr}/v1\"\n\
             api_key_env = \"BENCH_KEY\"\nmodels = [\"*\"]\n\
             [[tools]]\nname = \"bench\"\nkind = \"http\"\nbase_url = \"http://{tool_addr}\"\nclass = \"keyed\"\n",
            dir.join("data").display().to_string()
        ),
    )?;
    let proc = Proc::spawn(
        &format!("sidecar ({})", bin.display()),
        Command::new(bin)
            .args(["serve", "--config"])
            .arg(&config)
            .env("BENCH_KEY", "bench-key"),
    )?;
    Ok((proc, data, admin))
}

/// The sidecar target with journaling on (a fresh `Idempotency-Key` per request).
fn journaled(sidecar: &Measured) -> Measured {
    Measured {
        name: "journaled".into(),
        unique_key: true,
        ..sidecar.clone()
    }
}

/// The per-language policy table: builds the example policies and runs the policy
/// host's benchmark on them and on the built-ins.
fn policies() -> anyhow::Result<()> {
    let out = procs::target_dir()?.join("example-policies");
    crate::prereq::ensure()?.build_policies(&out)?;
    procs::run(
        procs::cargo()
            .args([
                "run",
                "--release",
                "-p",
                "outrigger-policy",
                "--example",
                "policy_bench",
                "--",
            ])
            .arg(out.join("budget_py.wasm"))
            .arg(out.join("retry_js.wasm"))
            .arg(out.join("deadline_retry.wasm")),
    )
}

struct Row {
    throughput: f64,
    p50_ms: f64,
    p99_ms: f64,
    cpu_us_per_unit: f64,
    rss_mib: f64,
    /// `rss_mib` is the peak of the measured load (the kernel reset the peak before
    /// it); otherwise the peak of the process's life so far.
    rss_of_round: bool,
    requests: u64,
    /// Requests of the warm-up before the measured run.
    warmup_requests: u64,
    errors: u64,
}

impl Row {
    /// Each figure's median over the rounds, taken figure by figure (the p99 of the
    /// round with the median throughput is not the median p99); requests and errors
    /// are totals.
    fn median(rounds: &[Row]) -> Row {
        let of = |f: fn(&Row) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>());
        Row {
            throughput: of(|r| r.throughput),
            p50_ms: of(|r| r.p50_ms),
            p99_ms: of(|r| r.p99_ms),
            cpu_us_per_unit: of(|r| r.cpu_us_per_unit),
            rss_mib: of(|r| r.rss_mib),
            rss_of_round: rounds.iter().all(|r| r.rss_of_round),
            requests: rounds.iter().map(|r| r.requests).sum(),
            warmup_requests: rounds.iter().map(|r| r.warmup_requests).sum(),
            errors: rounds.iter().map(|r| r.errors).sum(),
        }
    }

    fn to_json(&self) -> serde_json::Value {
        json!({"throughput": self.throughput, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
               "cpu_us_per_unit": self.cpu_us_per_unit, "rss_mib": self.rss_mib,
               "rss_peak_of": if self.rss_of_round { "round" } else { "process lifetime" },
               "requests": self.requests, "errors": self.errors})
    }
}

async fn measure(
    client: &HttpClient,
    t: &Measured,
    sc: &Scenario,
    duration: Duration,
) -> anyhow::Result<Row> {
    // Warm up connections and caches.
    let (warmup, _) = load(client, t, sc, Duration::from_millis(500)).await?;
    // The peak RSS of this round's load, not of the process's life so far (which
    // would carry an earlier scenario's peak into this one's figure).
    let rss_of_round = t.pids.iter().all(|p| reset_peak_rss(*p));
    let cpu_before = cpu_ticks(&t.pids);
    let started = Instant::now();
    let (latencies, errors) = load(client, t, sc, duration).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_after = cpu_ticks(&t.pids);
    let requests = latencies.len() as u64;
    if requests == 0 {
        bail!("{}: no request succeeded in {}", t.name, sc.name);
    }
    if too_many_errors(requests, errors) {
        bail!(
            "{}: {errors} of {} requests failed in {} (more than 0.1 %): the figures would \
             not measure the work asked for",
            t.name,
            requests + errors,
            sc.name
        );
    }
    let mut sorted = latencies;
    sorted.sort_unstable();
    let pct =
        |p: f64| sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)] as f64 / 1000.0;
    let units = requests * sc.events;
    let cpu_s = (cpu_after - cpu_before) as f64 / clk_tck();
    Ok(Row {
        throughput: units as f64 / elapsed,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        cpu_us_per_unit: if t.pids.is_empty() {
            0.0
        } else {
            cpu_s * 1e6 / units as f64
        },
        rss_mib: t.pids.iter().map(|p| peak_rss_kib(*p)).sum::<u64>() as f64 / 1024.0,
        rss_of_round,
        requests,
        warmup_requests: warmup.len() as u64,
        errors,
    })
}

/// The median of `xs`: the middle value, or the mean of the two middle values of an
/// even count (0 for none).
fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Runs `sc.concurrency` loops for `duration`; returns latencies (µs) and errors.
async fn load(
    client: &HttpClient,
    t: &Measured,
    sc: &Scenario,
    duration: Duration,
) -> anyhow::Result<(Vec<u64>, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let url = format!("{}{}", t.url, sc.path);
    let unique = t.unique_key;
    let ttfb = sc.ttfb;
    let mut tasks = Vec::new();
    for worker in 0..sc.concurrency {
        let client = client.clone();
        let stop = stop.clone();
        let url = url.clone();
        let body = sc.body.clone();
        let headers: Vec<(String, String)> = sc
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            let mut h: Vec<(&str, &str)> = vec![("content-type", "application/json")];
            h.extend(headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            let mut n = 0u64;
            let run = std::process::id();
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let key = format!(
                    "bench-{run}-{worker}-{n}-{}",
                    KEY_EPOCH.fetch_add(1, Ordering::Relaxed)
                );
                let mut h = h.clone();
                if unique {
                    h.push(("idempotency-key", key.as_str()));
                }
                let started = Instant::now();
                if ttfb {
                    let mut first = None;
                    let status = client::stream(&client, &url, &h, body.clone(), |_| {
                        first.get_or_insert_with(|| started.elapsed());
                    })
                    .await;
                    match (status, first) {
                        (Ok(200), Some(f)) => lat.push(f.as_micros() as u64),
                        _ => errors += 1,
                    }
                    continue;
                }
                match client::send(&client, Method::POST, &url, &h, body.clone()).await {
                    Ok(r) if r.status == 200 => lat.push(started.elapsed().as_micros() as u64),
                    _ => errors += 1,
                }
            }
            (lat, errors)
        }));
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await?;
        all.extend(l);
        errors += e;
    }
    Ok((all, errors))
}

/// One request of `sc` to a target that serves every answer from the journal: it
/// must come back 200 and marked `Outrigger-Replayed: true`.
async fn probe_replayed(client: &HttpClient, t: &Measured, sc: &Scenario) -> anyhow::Result<()> {
    let url = format!("{}{}", t.url, sc.path);
    let mut h: Vec<(&str, &str)> = vec![("content-type", "application/json")];
    h.extend(sc.headers.iter().map(|(k, v)| (*k, v.as_str())));
    let r = client::send(client, Method::POST, &url, &h, sc.body.clone()).await?;
    let replayed = r
        .headers
        .get("outrigger-replayed")
        .and_then(|v| v.to_str().ok());
    if r.status != 200 || replayed != Some("true") {
        bail!(
            "{} in {}: a probe request was answered {} with Outrigger-Replayed {replayed:?}, \
             not replayed from the journal",
            t.name,
            sc.name,
            r.status
        );
    }
    Ok(())
}

/// Makes keys unique across rounds and warm-ups.
static KEY_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The sidecar's journal statistics (`GET /v1/journal?view=stats`) the harness uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct JournalStats {
    records_written: u64,
    flushes: u64,
    /// Records now in state `completed`.
    completed: u64,
    stream_events: u64,
}

fn journal_stats(
    rt: &tokio::runtime::Runtime,
    client: &HttpClient,
    admin: &str,
) -> Option<JournalStats> {
    let r = rt
        .block_on(client::send(
            client,
            Method::GET,
            &format!("{admin}/v1/journal?view=stats"),
            &[],
            Bytes::new(),
        ))
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
    Some(JournalStats {
        records_written: v["records_written"].as_u64()?,
        flushes: v["flushes"].as_u64()?,
        completed: v["states"]["completed"].as_u64()?,
        stream_events: v["stream_events"].as_u64()?,
    })
}

/// Whether a journaled round's calls (`ok` answered, warm-up included) all reached
/// the journal, from its statistics before and after: an error when they did not.
fn check_journaled(
    journals: Journals,
    events: u64,
    ok: u64,
    before: JournalStats,
    after: JournalStats,
) -> Result<(), String> {
    let (what, wrote, needed) = match journals {
        Journals::Record => (
            "completed records",
            after.completed.saturating_sub(before.completed),
            ok,
        ),
        Journals::StreamEvents => (
            "stream events",
            after.stream_events.saturating_sub(before.stream_events),
            ok * events,
        ),
    };
    if wrote < needed {
        return Err(format!(
            "{ok} journaled call(s) answered, but the journal gained {wrote} {what} (at least \
             {needed} expected): calls were answered without being journaled"
        ));
    }
    Ok(())
}

/// Whether too many requests failed: more than 0.1 % of those sent.
fn too_many_errors(ok: u64, errors: u64) -> bool {
    errors * 1000 > ok + errors
}

/// What the figures were measured on: they depend on it as much as on the code. A
/// virtual machine whose idle CPUs halt at once (`guest_halt_poll_ns` 0) makes every
/// wake-up of an idle CPU an exit to the hypervisor, which is most of what a proxy
/// adds to a first byte at concurrency 1 (see docs/benchmarks.md).
fn machine() -> serde_json::Value {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_owned())
    };
    let cpuinfo = read("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        cpuinfo
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
    };
    json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).ok(),
        "cpu_model": field("model name"),
        "virtual": field("flags").map(|f| f.split_whitespace().any(|x| x == "hypervisor")),
        "kernel": read("/proc/sys/kernel/osrelease"),
        "cpuidle_driver": read("/sys/devices/system/cpu/cpuidle/current_driver"),
        "guest_halt_poll_ns": read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
            .and_then(|v| v.parse::<u64>().ok()),
    })
}

fn cpu_ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .map(|stat| {
            // Fields after the ")" that closes the command name; utime and stime are
            // fields 14 and 15 of the whole line.
            let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
            let f: Vec<&str> = rest.split_whitespace().collect();
            let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            get(11) + get(12)
        })
        .sum()
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS: `5` written to
/// `/proc/<pid>/clear_refs` (Linux 4.0 and later, for a process we may trace).
fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// The process's peak RSS (`VmHWM`) in KiB: since its start, or since the last
/// [`reset_peak_rss`].
fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// The processes whose parent is `pid`, from `/proc/*/stat` (no `pgrep`, which a
/// minimal system lacks).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: Vec<u32> = dir
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|stat| parent_of(&stat))
                == Some(pid)
        })
        .collect();
    children.sort_unstable();
    children
}

/// The parent pid in a `/proc/<pid>/stat` line: the second field after the `)` that
/// closes the command name (which may itself hold spaces and parentheses).
fn parent_of(stat: &str) -> Option<u32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn free_port() -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

/// The run's working directory (configs, journals, nginx's files), removed when
/// the run ends: the journals of one full run take gigabytes.
struct WorkDir(PathBuf);

impl std::ops::Deref for WorkDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            eprintln!("xtask bench: cannot remove {}: {e}", self.0.display());
        }
    }
}

fn tempdir() -> anyhow::Result<WorkDir> {
    let dir = std::env::temp_dir().join(format!("outrigger-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(WorkDir(dir))
}

/// nginx as a plain reverse proxy (keep-alive upstream, no buffering so streams
/// flow), stopped when dropped.
struct Nginx {
    _proc: Proc,
    addr: SocketAddr,
    pids: Vec<u32>,
}

fn start_nginx(
    work: &Path,
    upstream: SocketAddr,
    tool: SocketAddr,
) -> anyhow::Result<Option<Nginx>> {
    let nginx = Path::new("/usr/sbin/nginx");
    if !nginx.exists() {
        eprintln!("nginx is not installed; installing Debian's package");
        let ok = Command::new("apt-get")
            .args(["update", "-qq"])
            .status()
            .is_ok_and(|s| s.success())
            && Command::new("apt-get")
                .args(["install", "-y", "-qq", "nginx"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .is_ok_and(|s| s.success());
        if !ok || !nginx.exists() {
            eprintln!("could not install nginx; the nginx column is left out");
            return Ok(None);
        }
    }
    let addr = free_port()?;
    let conf = work.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "daemon off;\nworker_processes auto;\npid {pid};\nerror_log {err} warn;\n\
             events {{ worker_connections 4096; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {tmp}/body;\n  proxy_temp_path {tmp}/proxy;\n\
               fastcgi_temp_path {tmp}/fcgi;\n  uwsgi_temp_path {tmp}/uwsgi;\n  scgi_temp_path {tmp}/scgi;\n\
               upstream mock {{ server {upstream}; keepalive 256; }}\n\
               upstream tool {{ server {tool}; keepalive 256; }}\n\
               server {{\n    listen {addr};\n\
                 location /tools/bench/ {{\n      proxy_pass http://tool/;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n    }}\n\
                 location / {{\n      proxy_pass http://mock;\n\
                 proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n",
            pid = work.join("nginx.pid").display(),
            err = work.join("nginx-error.log").display(),
            tmp = work.display(),
        ),
    )?;
    let mut proc = Proc::spawn(
        "nginx",
        Command::new(nginx).arg("-c").arg(&conf).arg("-p").arg(work),
    )?;
    std::thread::sleep(Duration::from_millis(500));
    if let Ok(Some(status)) = proc.child.try_wait() {
        bail!(
            "nginx exited at start ({status}); see {}",
            work.join("nginx-error.log").display()
        );
    }
    let master = proc.pid();
    // The workers are the master's children; their CPU counts too.
    let deadline = Instant::now() + Duration::from_secs(5);
    let workers = loop {
        let workers = children_of(master);
        if !workers.is_empty() || Instant::now() > deadline {
            break workers;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if workers.is_empty() {
        bail!(
            "nginx (pid {master}) started no worker process within 5 s, so its CPU time \
             cannot be measured; see {}",
            work.join("nginx-error.log").display()
        );
    }
    let mut pids = vec![master];
    pids.extend(workers);
    Ok(Some(Nginx {
        _proc: proc,
        addr,
        pids,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[10.0, 1.0]), 5.5);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn each_figure_is_its_own_median() {
        let row = |throughput: f64, p99_ms: f64| Row {
            throughput,
            p50_ms: 1.0,
            p99_ms,
            cpu_us_per_unit: throughput / 10.0,
            rss_mib: 20.0,
            rss_of_round: true,
            requests: 100,
            warmup_requests: 5,
            errors: 1,
        };
        // The best round by throughput had the worst p99: neither is reported alone.
        let m = Row::median(&[row(100.0, 2.0), row(300.0, 9.0)]);
        assert_eq!(m.throughput, 200.0);
        assert_eq!(m.p99_ms, 5.5);
        assert_eq!(m.cpu_us_per_unit, 20.0);
        assert_eq!((m.requests, m.errors), (200, 2));
        let m = Row::median(&[row(100.0, 2.0), row(300.0, 9.0), row(200.0, 1.0)]);
        assert_eq!((m.throughput, m.p99_ms), (200.0, 2.0));
    }

    #[test]
    fn a_round_with_errors_above_a_thousandth_fails() {
        assert!(!too_many_errors(10_000, 0));
        assert!(!too_many_errors(9_990, 10));
        assert!(too_many_errors(9_989, 11));
        assert!(too_many_errors(1, 1));
    }

    #[test]
    fn journaled_rounds_must_reach_the_journal() {
        let stats = |completed, stream_events| JournalStats {
            completed,
            stream_events,
            ..JournalStats::default()
        };
        let (before, after) = (stats(10, 1_000), stats(110, 1_000));
        assert_eq!(
            check_journaled(Journals::Record, 1, 100, before, after),
            Ok(())
        );
        let e = check_journaled(Journals::Record, 1, 101, before, after).unwrap_err();
        assert!(e.contains("gained 100 completed records"), "{e}");
        // Streams: every event of every answered stream.
        let (before, after) = (stats(0, 0), stats(0, 2_000));
        assert_eq!(
            check_journaled(Journals::StreamEvents, 200, 10, before, after),
            Ok(())
        );
        assert!(check_journaled(Journals::StreamEvents, 200, 11, before, after).is_err());
    }

    #[test]
    fn the_peak_rss_is_reset_to_the_current_rss() {
        let me = std::process::id();
        // Touch 64 MiB, give it back, and the peak stays until it is reset.
        let big = vec![1u8; 64 << 20];
        std::hint::black_box(&big);
        drop(big);
        let peak = peak_rss_kib(me);
        assert!(peak >= 64 << 10, "peak {peak} KiB");
        assert!(reset_peak_rss(me), "clear_refs refused");
        let after = peak_rss_kib(me);
        assert!(
            after < peak - (32 << 10),
            "peak {peak} KiB, after the reset {after} KiB"
        );
    }

    #[test]
    fn children_are_found_in_proc() {
        assert_eq!(
            parent_of("4242 (nginx: worker (a) b) S 4241 4241 4241 0 -1 4194560"),
            Some(4241)
        );
        assert_eq!(parent_of("garbage"), None);
        let mut child = Command::new("sleep").arg("30").spawn().expect("sleep");
        let found = children_of(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(found.contains(&child.id()), "{found:?}");
    }

    #[test]
    fn zero_rounds_are_refused() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let e = parse(&args(&["--rounds", "0"])).err().expect("refused");
        assert!(e.to_string().contains("at least 1"), "{e}");
        assert_eq!(parse(&args(&["--rounds", "2"])).unwrap().rounds, 2);
    }
}
