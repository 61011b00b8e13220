//! Policy host benchmark. Run with `--release`:
//!
//! ```sh
//! cargo run --release -p outrigger-policy --example policy_bench [EXTRA.wasm ...]
//! ```
//!
//! Prints, for the built-ins: component sizes, cold load time without and with the
//! compiled-component cache, hot-swap time (reload of a changed file, compiled and
//! from the cache) and warm decision latency p50/p99 through `Registry`. Extra
//! `.wasm` paths (Python, JavaScript policies...) get size, load times and warm
//! latency for every hook they implement. Figures are medians of several rounds;
//! the machine may be shared, so compare within one run.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use outrigger_policy::{
    Binding, BuiltinComponent, Hook, Loaded, OnError, Options, Registry, Runtime, RuntimeOptions,
    Source,
};
use outrigger_types::{
    BudgetRequest, CallContext, CallKind, Candidate, CircuitState, DowngradeOption, Failure,
    FallbackRequest, Limits, Modalities, RetryBudget, Usage,
};

const CALLS: usize = 20_000;
const ROUNDS: usize = 5;

fn main() -> anyhow::Result<()> {
    let extra: Vec<PathBuf> = std::env::args().skip(1).map(PathBuf::from).collect();
    let builtins: Vec<BuiltinComponent> = outrigger_builtins::ALL
        .iter()
        .map(|b| BuiltinComponent {
            name: b.name,
            bytes: b.bytes,
        })
        .collect();
    let scratch = tempfile::tempdir()?;

    println!("== component sizes");
    for b in outrigger_builtins::ALL {
        println!("{:<10} {:>8} bytes", b.name, b.bytes.len());
    }

    println!("\n== cold load (compile or deserialize + pre-instantiate), median of {ROUNDS}");
    for b in outrigger_builtins::ALL {
        let (compile, cached) =
            load_times(b.bytes, &scratch.path().join(format!("cold-{}", b.name)))?;
        println!(
            "{:<10} no cache {:>8.2} ms   from cache {:>6.2} ms",
            b.name,
            ms(compile),
            ms(cached)
        );
    }

    println!(
        "\n== hot swap of the retry built-in (Registry::reload of a changed file), median of {ROUNDS}"
    );
    let (compiled, cached) = swap_times(&builtins, scratch.path())?;
    println!("new bytes (compile)  {:>8.2} ms", ms(compiled));
    println!("known bytes (cache)  {:>8.2} ms", ms(cached));

    println!(
        "\n== warm decision latency through Registry ({CALLS} calls, best of {ROUNDS} rounds' p50)"
    );
    let registry = Registry::new(
        Options {
            cache_dir: Some(scratch.path().join("latency")),
            ..Options::default()
        },
        builtins.clone(),
    )?;
    let (ctx, failure, fallback, budget) = inputs();
    report("retry", || {
        let _ = registry.retry(&ctx, &failure);
    });
    report("fallback", || {
        let _ = registry.fallback(&fallback);
    });
    report("budget", || {
        let _ = registry.budget(&budget);
    });

    for path in extra {
        println!("\n== {}", path.display());
        let bytes = std::fs::read(&path)?;
        println!("size       {:>10} bytes", bytes.len());
        let (compile, cached) = load_times(&bytes, &scratch.path().join("extra"))?;
        println!(
            "load       no cache {:>8.2} ms   from cache {:>6.2} ms",
            ms(compile),
            ms(cached)
        );
        let runtime = Runtime::new(RuntimeOptions {
            cache_dir: Some(scratch.path().join("extra")),
            deadline: Duration::from_millis(200),
            ..RuntimeOptions::default()
        })?;
        let loaded = runtime.load(&bytes, BTreeMap::new(), "bench")?;
        println!("hooks      {:?}", loaded.hooks());
        bench_loaded(&loaded, &ctx, &failure, &fallback, &budget);
    }
    Ok(())
}

fn bench_loaded(
    loaded: &Loaded,
    ctx: &CallContext,
    failure: &Failure,
    fallback: &FallbackRequest,
    budget: &BudgetRequest,
) {
    for hook in loaded.hooks() {
        match hook {
            Hook::Retry => report("retry", || {
                let _ = loaded.retry(ctx, failure);
            }),
            Hook::Fallback => report("fallback", || {
                let _ = loaded.fallback(fallback);
            }),
            Hook::Budget => report("budget", || {
                let _ = loaded.budget(budget);
            }),
        }
    }
}

fn report(name: &str, mut call: impl FnMut()) {
    for _ in 0..1_000 {
        call();
    }
    let mut best: Option<(Duration, Duration)> = None;
    for _ in 0..ROUNDS {
        let mut samples = Vec::with_capacity(CALLS);
        for _ in 0..CALLS {
            let start = Instant::now();
            call();
            samples.push(start.elapsed());
        }
        samples.sort();
        let p50 = samples[CALLS / 2];
        let p99 = samples[CALLS * 99 / 100];
        if best.is_none_or(|(b, _)| p50 < b) {
            best = Some((p50, p99));
        }
    }
    if let Some((p50, p99)) = best {
        println!(
            "{name:<10} p50 {:>7.2} µs   p99 {:>7.2} µs",
            us(p50),
            us(p99)
        );
    }
}

/// Median cold load without a cache, and median load from a warm cache.
fn load_times(bytes: &[u8], cache: &std::path::Path) -> anyhow::Result<(Duration, Duration)> {
    let mut compiled = Vec::new();
    let mut cached = Vec::new();
    for _ in 0..ROUNDS {
        let runtime = Runtime::new(RuntimeOptions::default())?;
        let start = Instant::now();
        runtime.load(bytes, BTreeMap::new(), "bench")?;
        compiled.push(start.elapsed());
    }
    let runtime = Runtime::new(RuntimeOptions {
        cache_dir: Some(cache.to_path_buf()),
        ..RuntimeOptions::default()
    })?;
    runtime.load(bytes, BTreeMap::new(), "bench")?;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        let loaded = runtime.load(bytes, BTreeMap::new(), "bench")?;
        cached.push(start.elapsed());
        anyhow::ensure!(loaded.from_cache(), "expected a cache hit");
    }
    Ok((median(compiled), median(cached)))
}

/// Reload times after the bound file changed: to bytes never seen (compiled), and
/// back and forth between two known variants (from the cache).
fn swap_times(
    builtins: &[BuiltinComponent],
    scratch: &std::path::Path,
) -> anyhow::Result<(Duration, Duration)> {
    let dir = scratch.join("swap");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("retry.wasm");
    std::fs::write(&file, variant(0))?;
    let registry = Registry::new(
        Options {
            cache_dir: Some(scratch.join("swap-cache")),
            bindings: vec![Binding {
                hook: Hook::Retry,
                source: Source::Path(file.clone()),
                params: BTreeMap::new(),
                on_error: OnError::FailOpen,
            }],
            ..Options::default()
        },
        builtins.to_vec(),
    )?;
    let swap = |bytes: Vec<u8>| -> anyhow::Result<Duration> {
        let tmp = dir.join("retry.tmp");
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &file)?;
        let start = Instant::now();
        let report = registry.reload();
        let elapsed = start.elapsed();
        anyhow::ensure!(report.is_ok(), "{report:?}");
        Ok(elapsed)
    };
    let mut compiled = Vec::new();
    for round in 1..=ROUNDS {
        compiled.push(swap(variant(round))?);
    }
    let mut cached = Vec::new();
    for round in 0..ROUNDS {
        cached.push(swap(variant(1 + round % 2))?);
    }
    Ok((median(compiled), median(cached)))
}

/// The retry built-in with a custom section appended: the same policy, new bytes.
fn variant(n: usize) -> Vec<u8> {
    let mut bytes = outrigger_builtins::RETRY.to_vec();
    let name = b"bench-variant";
    let payload = n.to_le_bytes();
    bytes.push(0); // custom section id
    bytes.push(u8::try_from(1 + name.len() + payload.len()).unwrap_or(u8::MAX));
    bytes.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
    bytes.extend_from_slice(name);
    bytes.extend_from_slice(&payload);
    bytes
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn inputs() -> (CallContext, Failure, FallbackRequest, BudgetRequest) {
    let ctx = CallContext {
        task_id: Some("bench-task".into()),
        request_id: "bench-request".into(),
        kind: CallKind::Model,
        target: "openai".into(),
        model: Some("gpt-4o".into()),
        tool_class: None,
        attempt: 2,
        elapsed: Duration::from_millis(350),
        dispatched: true,
        history: Vec::new(),
        retry_budget: RetryBudget::default(),
        fallbacks: vec!["anthropic".into(), "local".into()],
    };
    let candidate = |name: &str| Candidate {
        name: name.into(),
        supports_tools: true,
        supports_streaming: true,
        context_window: 128_000,
        modalities: Modalities::TEXT,
        circuit: CircuitState::Closed,
        local: false,
        gpu: None,
        cost_per_mtok_in: 2_500_000,
        cost_per_mtok_out: 10_000_000,
    };
    let fallback = FallbackRequest {
        task_id: Some("bench-task".into()),
        request_id: "bench-request".into(),
        model: "gpt-4o".into(),
        needs_tools: true,
        streaming: true,
        estimated_tokens: 3_000,
        modalities: Modalities::TEXT,
        candidates: vec![
            candidate("openai"),
            candidate("anthropic"),
            candidate("local"),
        ],
    };
    let budget = BudgetRequest {
        task_id: Some("bench-task".into()),
        request_id: "bench-request".into(),
        model: "gpt-4o".into(),
        estimated_tokens_in: 3_000,
        estimated_tokens_out: 800,
        estimated_cost_micros: 15_500,
        usage: Usage {
            tokens_in: 40_000,
            tokens_out: 9_000,
            cost_micros: 190_000,
            wall_clock_ms: 60_000,
            calls: 12,
            retries: 1,
        },
        limits: Limits {
            cost_micros: Some(1_000_000),
            tokens_total: Some(200_000),
            ..Limits::default()
        },
        downgrades: vec![DowngradeOption {
            model: "gpt-4o-mini".into(),
            cost_per_mtok_in: 150_000,
            cost_per_mtok_out: 600_000,
        }],
    };
    (ctx, Failure::ServerError { status: 503 }, fallback, budget)
}
