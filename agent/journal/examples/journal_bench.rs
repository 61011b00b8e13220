//! Measures journaled tool calls (begin + complete: two durable writes each) at
//! concurrency 1, 16 and 64, and prints flushes per record.
//!
//! `cargo run --release -p outrigger-journal --example journal_bench [-- --node]`
//!
//! The baseline, measured in the same run on the same disk, is one 512-byte write +
//! `fdatasync` per operation on a plain file: what a journal without group commit
//! would pay per durable write at best.

use std::error::Error as StdError;
use std::io::Write as _;
use std::time::{Duration, Instant};

use outrigger_journal::{
    Begin, Body, Durability, Headers, Intent, Journal, KeySource, Options, RedactedRequest,
    StoredResponse,
};
use outrigger_types::{Fingerprint, IdempotencyKey, RequestId, ToolClass};

const CALLS_PER_LEVEL: usize = 6_000;

fn intent(n: usize) -> Result<Intent, Box<dyn StdError>> {
    let key = format!("bench-{n}");
    Ok(Intent {
        key: IdempotencyKey::new(key.clone())?,
        fingerprint: Fingerprint([7; 32]),
        tool: "crm".to_owned(),
        class: ToolClass::Keyed,
        method: "POST".to_owned(),
        target: "http://127.0.0.1:9/contacts".to_owned(),
        task_id: None,
        request_id: RequestId::from_generated(format!("req-{n}")),
        downstream_key: key,
        request: RedactedRequest::new(
            Headers::redacted([("content-type".to_owned(), "application/json".to_owned())]),
            Body::from(vec![b'x'; 256]),
        ),
        policy_versions: Vec::new(),
        model_revision: None,
        derived_from: KeySource::Header,
    })
}

async fn call(journal: &Journal, n: usize) -> Result<Duration, Box<dyn StdError + Send + Sync>> {
    let started = Instant::now();
    let intent = intent(n).map_err(|e| e.to_string())?;
    let Begin::Execute { ticket, .. } = journal.begin(intent).await? else {
        return Err("a fresh key must execute".into());
    };
    let response = StoredResponse::new(200, Headers::default(), Body::from(vec![b'y'; 256]));
    journal.complete(&ticket, response).await?;
    Ok(started.elapsed())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn baseline_fdatasync(dir: &std::path::Path, ops: usize) -> Result<f64, Box<dyn StdError>> {
    let mut file = std::fs::File::create(dir.join("baseline"))?;
    let block = [0u8; 512];
    let started = Instant::now();
    for _ in 0..ops {
        file.write_all(&block)?;
        file.sync_data()?;
    }
    Ok(ops as f64 / started.elapsed().as_secs_f64())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn StdError + Send + Sync>> {
    let node = std::env::args().any(|a| a == "--node");
    let dir = tempfile::tempdir()?;
    let baseline = baseline_fdatasync(dir.path(), 500).map_err(|e| e.to_string())?;
    println!("baseline: {baseline:.0} durable 512 B writes/s (write + fdatasync, one at a time)");
    let options = Options {
        durability: if node {
            Durability::Node
        } else {
            Durability::Process
        },
        ..Options::new(dir.path().join("journal"))
    };
    println!("durability: {:?}", options.durability);
    let (journal, writer, _) = Journal::open(options)?;
    let writer = tokio::spawn(writer.run());
    let mut next = 0usize;
    let mut first_rate = None;
    for concurrency in [1usize, 16, 64] {
        let before = journal.stats();
        let started = Instant::now();
        let mut workers = Vec::new();
        for w in 0..concurrency {
            let journal = journal.clone();
            let base = next + w * CALLS_PER_LEVEL;
            let per_worker = CALLS_PER_LEVEL / concurrency;
            workers.push(tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(per_worker);
                for i in 0..per_worker {
                    latencies.push(call(&journal, base + i).await?);
                }
                Ok::<_, Box<dyn StdError + Send + Sync>>(latencies)
            }));
        }
        let mut latencies = Vec::new();
        for w in workers {
            latencies.extend(w.await??);
        }
        next += concurrency * CALLS_PER_LEVEL;
        let elapsed = started.elapsed().as_secs_f64();
        latencies.sort();
        let stats = journal.stats();
        let records = stats.records_written - before.records_written;
        let flushes = stats.flushes - before.flushes;
        let rate = latencies.len() as f64 / elapsed;
        let ratio = rate / *first_rate.get_or_insert(rate);
        println!(
            "concurrency {concurrency:>2}: {rate:>7.0} calls/s ({ratio:.1}x c=1, {:.1}x baseline writes/s), \
             p50 {:?}, p99 {:?}, {:.3} flushes/record ({flushes} flushes, {records} records)",
            2.0 * rate / baseline,
            percentile(&latencies, 0.50),
            percentile(&latencies, 0.99),
            flushes as f64 / records.max(1) as f64,
        );
    }
    println!(
        "journal size on disk: {} KiB",
        journal.stats().size_on_disk / 1024
    );
    drop(journal);
    writer.await?;
    Ok(())
}
