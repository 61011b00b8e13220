//! `outrigger journal list|show|export|verify|timeline`: the offline audit, and
//! `outrigger journal quarantine`.
//!
//! When no process holds the journal it reads it directly, from a private copy, so
//! it never changes the directory (see `outrigger_journal::Audit`). While the
//! sidecar runs, sled's lock keeps the directory to the sidecar, so the command
//! reads through the admin API instead — and says which it used, on stderr, every
//! time. `quarantine` is the one command that changes something: it moves a journal
//! directory aside, so that the sidecar starts a fresh one.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use outrigger_journal::{Audit, Filter, Journal, StreamKey};
use outrigger_types::{IdempotencyKey, TaskId};
use serde_json::Value;

use crate::admin::{MAX_PAGE, filter_from, parse_time};

/// Where the records come from.
enum Source {
    Direct(Audit),
    Admin { base: String, token: Option<String> },
}

/// Which journal directory.
#[derive(clap::Args, Debug, Clone)]
pub struct Location {
    /// The data directory (the config's `[journal] dir`; the journal is in `<dir>/journal`).
    #[arg(long, default_value = "./outrigger-data")]
    pub data_dir: PathBuf,
    /// A journal directory itself, in place of `<data-dir>/journal`: one moved aside
    /// (`<data-dir>/journal.corrupt-<unix seconds>`), or a backup.
    #[arg(long, conflicts_with = "data_dir")]
    pub journal_dir: Option<PathBuf>,
}

impl Location {
    fn journal(&self) -> PathBuf {
        self.journal_dir
            .clone()
            .unwrap_or_else(|| self.data_dir.join("journal"))
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct Common {
    #[command(flatten)]
    pub location: Location,
    /// The admin plane to use when the sidecar holds the journal.
    #[arg(long, default_value = "http://127.0.0.1:7071")]
    pub admin: String,
}

#[derive(clap::Args, Debug, Clone, Default)]
pub struct Filters {
    #[arg(long)]
    pub task: Option<String>,
    #[arg(long)]
    pub tool: Option<String>,
    /// claimed, dispatched, completed, failed_before_send, in_doubt, reconciling, needs_operator, tombstone
    #[arg(long)]
    pub state: Option<String>,
    /// RFC 3339 time, or a duration ago (`2h`).
    #[arg(long)]
    pub since: Option<String>,
    #[arg(long)]
    pub until: Option<String>,
    #[arg(long)]
    pub limit: Option<usize>,
}

impl Filters {
    /// These filters with `--since` and `--until` as RFC 3339 times: a duration ago
    /// (`1h`) is resolved once, here, so that every page asked of the admin API has
    /// the same window (the sidecar would resolve it again for each).
    fn resolved(&self) -> anyhow::Result<Filters> {
        let at = |when: &Option<String>| -> anyhow::Result<Option<String>> {
            when.as_deref()
                .map(|w| {
                    parse_time(w)
                        .map(|t| humantime::format_rfc3339_micros(t).to_string())
                        .map_err(|e| anyhow::anyhow!(e))
                })
                .transpose()
        };
        Ok(Filters {
            since: at(&self.since)?,
            until: at(&self.until)?,
            ..self.clone()
        })
    }

    fn pairs(&self) -> Vec<(String, String)> {
        let mut q = Vec::new();
        let mut add = |k: &str, v: &Option<String>| {
            if let Some(v) = v {
                q.push((k.to_string(), v.clone()));
            }
        };
        add("task", &self.task);
        add("tool", &self.tool);
        add("state", &self.state);
        add("since", &self.since);
        add("until", &self.until);
        add("limit", &self.limit.map(|l| l.to_string()));
        q
    }
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// List records (newest last), filtered.
    List {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        filters: Filters,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one record in full.
    Show {
        key: String,
        #[command(flatten)]
        common: Common,
    },
    /// Show a model stream's record: its attempt, state and how it ended (usage,
    /// and how many times it was continued).
    Stream {
        /// The stream key (`Outrigger-Stream-Key`).
        key: String,
        #[command(flatten)]
        common: Common,
    },
    /// Export records as JSON Lines.
    Export {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        filters: Filters,
        /// Write to a file instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check the hash chain; exits 1 if anything was edited or deleted.
    Verify {
        #[command(flatten)]
        common: Common,
    },
    /// A task's calls in order, with durations and states.
    Timeline {
        #[arg(long)]
        task: String,
        #[command(flatten)]
        common: Common,
    },
    /// Move a journal aside (to `<dir>.corrupt-<unix seconds>`) so that the sidecar
    /// starts a fresh one at its next start; refused while a process holds it.
    Quarantine {
        #[command(flatten)]
        location: Location,
    },
}

pub fn run(cmd: Command) -> ExitCode {
    match dispatch(cmd) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outrigger journal: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn open(common: &Common) -> anyhow::Result<Source> {
    let dir = common.location.journal();
    match Journal::open_for_audit(&dir) {
        Ok(audit) => {
            eprintln!(
                "(reading the journal directly from {}: no sidecar holds it; a copy is read, \
                 the directory is not changed)",
                dir.display()
            );
            if let Some(damage) = audit.damage() {
                eprintln!(
                    "(DAMAGED: {damage}. The sidecar refuses to open this journal; once it \
                     is reviewed, `outrigger journal quarantine --journal-dir {}` moves it \
                     aside)",
                    dir.display()
                );
            }
            Ok(Source::Direct(audit))
        }
        Err(outrigger_journal::Error::Locked { .. }) => {
            eprintln!(
                "(the sidecar holds {}; reading the journal through its admin API at {})",
                dir.display(),
                common.admin
            );
            Ok(Source::Admin {
                base: common.admin.trim_end_matches('/').to_string(),
                // Trimmed as the sidecar trims its own (a token read from a file
                // ends in a newline).
                token: std::env::var("OUTRIGGER_ADMIN_TOKEN")
                    .ok()
                    .map(|t| t.trim().to_owned())
                    .filter(|t| !t.is_empty()),
            })
        }
        Err(outrigger_journal::Error::Corrupt { dir, detail, .. }) => bail!(
            "the journal in {} cannot be read: sled cannot open it ({detail}). The directory \
             was not changed; keep it for analysis. `outrigger journal quarantine \
             --journal-dir {}` moves it aside so that the sidecar starts a fresh journal",
            dir.display(),
            dir.display()
        ),
        Err(e) => Err(e).with_context(|| format!("cannot open the journal in {}", dir.display())),
    }
}

/// `outrigger journal quarantine`.
fn quarantine(location: &Location) -> anyhow::Result<ExitCode> {
    let dir = location.journal();
    let moved = match Journal::quarantine(&dir) {
        Ok(moved) => moved,
        Err(outrigger_journal::Error::Locked { .. }) => bail!(
            "a process holds the journal in {} (is the sidecar running with it?): a journal \
             in use is not moved; stop the sidecar first",
            dir.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("cannot move {} aside", dir.display())),
    };
    println!("moved {} to {}", dir.display(), moved.display());
    eprintln!(
        "The sidecar starts a fresh journal at its next start. Every call the old one knew \
         is unknown to it: an agent's retry of one executes again. Review them with \
         `outrigger journal list --journal-dir {0}` and `outrigger journal verify \
         --journal-dir {0}`.",
        moved.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn dispatch(cmd: Command) -> anyhow::Result<ExitCode> {
    match cmd {
        Command::Quarantine { location } => quarantine(&location),
        Command::List {
            common,
            filters,
            json,
        } => {
            let records = list(&open(&common)?, &filters)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&records)?);
            } else {
                print_table(&records);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Show { key, common } => {
            let key = IdempotencyKey::new(key.as_str()).map_err(|e| anyhow::anyhow!("key: {e}"))?;
            let record = one(
                open(&common)?,
                |a| Ok(a.get(&key)?.map(serde_json::to_value).transpose()?),
                &format!("/v1/journal/{}", encode(key.as_str())),
            )?;
            print_one(record, &format!("no record for key {key}"))
        }
        Command::Stream { key, common } => {
            let key = StreamKey::new(key.as_str()).map_err(|e| anyhow::anyhow!("key: {e}"))?;
            let meta = one(
                open(&common)?,
                |a| Ok(a.stream_meta(&key)?.map(serde_json::to_value).transpose()?),
                &format!("/v1/journal?view=stream&key={}", encode(key.as_str())),
            )?;
            print_one(meta, &format!("no stream with key {key}"))
        }
        Command::Export {
            common,
            filters,
            out,
        } => {
            // Written beside `--out` and renamed over it once whole: an export that
            // fails (a wrong directory, a refused token, a page that broke off)
            // leaves an earlier export at that path as it was.
            let partial = out.as_ref().map(|p| {
                let mut name = p.file_name().unwrap_or_default().to_os_string();
                name.push(".partial");
                p.with_file_name(name)
            });
            let mut sink: Box<dyn Write> = match &partial {
                Some(p) => Box::new(std::io::BufWriter::new(
                    std::fs::File::create(p)
                        .with_context(|| format!("cannot create {}", p.display()))?,
                )),
                None => Box::new(std::io::stdout().lock()),
            };
            let exported = (|| -> anyhow::Result<usize> {
                let n = match open(&common)? {
                    Source::Direct(a) => a.export(&to_filter(&filters)?, &mut sink)?,
                    source @ Source::Admin { .. } => {
                        let mut n = 0;
                        each_page(&source, &filters, |records| {
                            for r in &records {
                                writeln!(sink, "{}", serde_json::to_string(r)?)?;
                            }
                            n += records.len();
                            Ok(())
                        })?;
                        n
                    }
                };
                sink.flush()?;
                Ok(n)
            })();
            drop(sink);
            let n = match (exported, &partial, &out) {
                (Ok(n), Some(partial), Some(out)) => {
                    std::fs::rename(partial, out).with_context(|| {
                        format!("cannot move {} to {}", partial.display(), out.display())
                    })?;
                    n
                }
                (Ok(n), _, _) => n,
                (Err(e), partial, _) => {
                    if let Some(partial) = partial {
                        let _ = std::fs::remove_file(partial);
                    }
                    return Err(e);
                }
            };
            eprintln!(
                "exported {n} record(s){}",
                out.map(|p| format!(" to {}", p.display()))
                    .unwrap_or_default()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify { common } => {
            let report: Value = match open(&common)? {
                Source::Direct(a) => {
                    let r = a.verify()?;
                    let mut problems = serde_json::to_value(&r.problems)?;
                    // What was read stops at the damage, so the chain is checked as far
                    // as it goes; the damage is a finding of its own.
                    if let (Some(damage), Some(list)) = (a.damage(), problems.as_array_mut()) {
                        list.push(damaged_wal(damage));
                    }
                    serde_json::json!({"entries": r.entries, "records": r.records, "problems": problems})
                }
                Source::Admin { base, token } => {
                    admin_json(&base, "/v1/journal?view=verify", token.as_deref())?
                }
            };
            let problems = report["problems"].as_array().cloned().unwrap_or_default();
            println!(
                "{} log entries, {} records: {}",
                report["entries"],
                report["records"],
                if problems.is_empty() {
                    "the hash chain is intact"
                } else {
                    "TAMPERING OR DAMAGE FOUND"
                }
            );
            for p in &problems {
                println!("  - {p}");
            }
            Ok(if problems.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Timeline { task, common } => {
            let task = TaskId::new(task.as_str()).map_err(|e| anyhow::anyhow!("--task: {e}"))?;
            let entries: Vec<Value> = match open(&common)? {
                Source::Direct(a) => a
                    .timeline(&task)?
                    .iter()
                    .map(serde_json::to_value)
                    .collect::<Result<_, _>>()?,
                Source::Admin { base, token } => {
                    let v = admin_json(
                        &base,
                        &format!("/v1/journal?view=timeline&task={}", encode(task.as_str())),
                        token.as_deref(),
                    )?;
                    v["calls"].as_array().cloned().unwrap_or_default()
                }
            };
            print_timeline(&task, &entries);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// One thing read from the journal: directly, or from the admin API at `path`
/// (`None` when it answers 404).
fn one(
    source: Source,
    direct: impl FnOnce(&Audit) -> anyhow::Result<Option<Value>>,
    path: &str,
) -> anyhow::Result<Option<Value>> {
    match source {
        Source::Direct(a) => direct(&a),
        Source::Admin { base, token } => {
            let (status, body) = admin_get(&base, path, token.as_deref())?;
            match status {
                200 => Ok(Some(body)),
                404 => Ok(None),
                s => bail!("the admin API answered {s}: {body}"),
            }
        }
    }
}

/// Prints what [`one`] found as JSON; says `missing` and fails when it found none.
fn print_one(found: Option<Value>, missing: &str) -> anyhow::Result<ExitCode> {
    match found {
        Some(v) => {
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(ExitCode::SUCCESS)
        }
        None => {
            eprintln!("{missing}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// The `verify` finding of a damaged write-ahead log, shaped as the chain's
/// problems are (`"problem"` names it).
fn damaged_wal(damage: &outrigger_journal::WalDamage) -> Value {
    serde_json::json!({
        "problem": "damaged_wal",
        "frame": damage.frame,
        "at": damage.at,
        "bytes_after": damage.bytes_after,
    })
}

fn to_filter(f: &Filters) -> anyhow::Result<Filter> {
    filter_from(&f.pairs()).map_err(|e| anyhow::anyhow!(e))
}

fn list(source: &Source, filters: &Filters) -> anyhow::Result<Vec<Value>> {
    let mut all = Vec::new();
    each_page(source, filters, |records| {
        all.extend(records);
        Ok(())
    })?;
    Ok(all)
}

/// The matching records (at most `--limit`), a page at a time: through the admin
/// API, which answers at most `MAX_PAGE` per request, page after page until one
/// says there is no `next`.
fn each_page(
    source: &Source,
    filters: &Filters,
    mut page: impl FnMut(Vec<Value>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    match source {
        Source::Direct(a) => page(
            a.list(&to_filter(filters)?)?
                .iter()
                .map(serde_json::to_value)
                .collect::<Result<_, _>>()?,
        ),
        Source::Admin { base, token } => {
            // Validate locally first so a typo gets the same message either way.
            to_filter(filters)?;
            let filters = filters.resolved()?;
            let mut left = filters.limit.unwrap_or(usize::MAX);
            let mut after: Option<String> = None;
            while left > 0 {
                let asked = left.min(MAX_PAGE);
                let mut query: Vec<String> = filters
                    .pairs()
                    .iter()
                    .filter(|(k, _)| k != "limit")
                    .map(|(k, v)| format!("{k}={}", encode(v)))
                    .collect();
                query.push(format!("limit={asked}"));
                if let Some(after) = &after {
                    query.push(format!("after={}", encode(after)));
                }
                let v = admin_json(
                    base,
                    &format!("/v1/journal?{}", query.join("&")),
                    token.as_deref(),
                )?;
                let records = v["records"].as_array().cloned().unwrap_or_default();
                let unpaged = unpaged_full_page(&v, asked);
                left = left.saturating_sub(records.len());
                page(records)?;
                if unpaged {
                    eprintln!(
                        "(WARNING: the sidecar answered a full page of {asked} records and no \
                         `next`: it is older than this command and does not page, so there \
                         may be more records than listed. Narrow the listing (--task, \
                         --since, --until), stop the sidecar to read the journal directly, \
                         or upgrade it)"
                    );
                }
                match v["next"].as_str() {
                    Some(next) => after = Some(next.to_owned()),
                    None => break,
                }
            }
            Ok(())
        }
    }
}

/// Whether a page came from a sidecar that does not page (older than `next`): it
/// holds as many records as were asked for, and no `next` at all, where a sidecar
/// that pages answers `"next": null` on its last page.
fn unpaged_full_page(page: &Value, asked: usize) -> bool {
    page.get("next").is_none() && page["records"].as_array().is_some_and(|r| r.len() >= asked)
}

fn print_table(records: &[Value]) {
    println!(
        "{:<27} {:<18} {:<14} {:>3} {:>6}  {:<20} KEY",
        "CREATED", "STATE", "TOOL", "ATT", "STATUS", "TASK"
    );
    for r in records {
        println!(
            "{:<27} {:<18} {:<14} {:>3} {:>6}  {:<20} {}",
            r["created_at"].as_str().unwrap_or("-"),
            r["state"].as_str().unwrap_or("-"),
            r["tool"].as_str().unwrap_or("-"),
            r["attempt"],
            r["final_status"]
                .as_u64()
                .map(|s| s.to_string())
                .unwrap_or_else(|| "-".into()),
            r["task_id"].as_str().unwrap_or("-"),
            r["key"].as_str().unwrap_or("-"),
        );
    }
    println!("{} record(s)", records.len());
}

fn print_timeline(task: &TaskId, entries: &[Value]) {
    println!("task {task}: {} call(s)", entries.len());
    println!(
        "{:<24} {:>10}  {:<18} {:<14} {:>3} {:>6}  KEY",
        "STARTED", "DURATION", "STATE", "TOOL", "ATT", "STATUS"
    );
    for e in entries {
        let us = e["duration_us"].as_u64().unwrap_or(0);
        println!(
            "{:<24} {:>8.1}ms  {:<18} {:<14} {:>3} {:>6}  {}{}",
            e["started_at"].as_str().unwrap_or("-"),
            us as f64 / 1000.0,
            e["state"].as_str().unwrap_or("-"),
            e["tool"].as_str().unwrap_or("-"),
            e["attempts"],
            e["final_status"]
                .as_u64()
                .map(|s| s.to_string())
                .unwrap_or_else(|| "-".into()),
            e["key"].as_str().unwrap_or("-"),
            e["resolved_by"]
                .as_str()
                .map(|a| format!("  (resolved by {a})"))
                .unwrap_or_default(),
        );
    }
}

fn admin_json(base: &str, path: &str, token: Option<&str>) -> anyhow::Result<Value> {
    let (status, body) = admin_get(base, path, token)?;
    if status != 200 {
        bail!("the admin API answered {status}: {body}");
    }
    Ok(body)
}

fn admin_get(base: &str, path: &str, token: Option<&str>) -> anyhow::Result<(u16, Value)> {
    let url = format!("{base}{path}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let mut req = http::Request::get(&url);
        if let Some(t) = token {
            req = req.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let resp = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            client.request(req.body(Full::new(Bytes::new()))?),
        )
        .await
        .with_context(|| format!("{url} did not answer within 30 s"))?
        .with_context(|| format!("cannot reach the admin API at {url}"))?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        Ok((status, body))
    })
}

fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b':') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_ago_is_resolved_once_to_a_time() -> anyhow::Result<()> {
        let filters = Filters {
            since: Some("1h".to_owned()),
            until: Some("2026-11-29T10:00:00Z".to_owned()),
            task: Some("t".to_owned()),
            ..Filters::default()
        };
        let resolved = filters.resolved()?;
        let since = humantime::parse_rfc3339(resolved.since.as_deref().unwrap_or_default())?;
        let ago = std::time::SystemTime::now().duration_since(since)?;
        assert!(
            (3590..=3610).contains(&ago.as_secs()),
            "{:?} is not an hour ago",
            resolved.since
        );
        assert_eq!(
            humantime::parse_rfc3339(resolved.until.as_deref().unwrap_or_default())?,
            humantime::parse_rfc3339("2026-11-29T10:00:00Z")?
        );
        assert_eq!(resolved.task.as_deref(), Some("t"));
        // What is sent is what the admin API reads back.
        assert!(filter_from(&resolved.pairs()).is_ok());
        assert!(Filters::default().resolved()?.since.is_none());
        assert!(
            Filters {
                since: Some("yesterday-ish".to_owned()),
                ..Filters::default()
            }
            .resolved()
            .is_err()
        );
        Ok(())
    }

    #[test]
    fn a_full_page_without_next_is_a_sidecar_that_does_not_page() {
        let records = |n: usize| Value::Array(vec![serde_json::json!({}); n]);
        let old = serde_json::json!({"count": 3, "records": records(3)});
        assert!(unpaged_full_page(&old, 3));
        let old_short = serde_json::json!({"count": 2, "records": records(2)});
        assert!(!unpaged_full_page(&old_short, 3));
        let last = serde_json::json!({"count": 3, "records": records(3), "next": null});
        assert!(!unpaged_full_page(&last, 3));
        let more = serde_json::json!({"count": 3, "records": records(3), "next": "7"});
        assert!(!unpaged_full_page(&more, 3));
    }
}
