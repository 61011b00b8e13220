//! Configuration in two phases: the TOML file (plus `OUTRIGGER_*` environment
//! overrides) is read into a raw, loosely typed [`raw::Config`], which is then
//! validated into typed options for each component. Validation reports every
//! problem at once, each with its key path, so one edit fixes a config.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Uri;
use outrigger_proxy::options::{
    self as popts, Capabilities, Dialect, Limits, ModelPattern, Provider, Secret, Tool, ToolKind,
};
use outrigger_types::{Modalities, ToolClass};

pub mod raw;

/// The smallest `limits.max_event_bytes` accepted.
const MIN_EVENT_BYTES: usize = 4 << 10;
/// The smallest `streams.max_stream_bytes` accepted.
const MIN_STREAM_BYTES: usize = 64 << 10;
/// The most `streams.max_continuations` accepted.
const MAX_CONTINUATIONS: u32 = 5;
/// The longest duration any key accepts.
const MAX_DURATION: Duration = Duration::from_secs(1_000 * 31_557_600);
/// The shortest `resilience.retry_budget_window` accepted.
const MIN_RETRY_BUDGET_WINDOW: Duration = Duration::from_millis(100);

/// The sections whose scalar keys `OUTRIGGER_<SECTION>_<KEY>` may override.
const ENV_SECTIONS: &[&str] = &[
    "listen",
    "admin",
    "journal",
    "limits",
    "drain",
    "log",
    "policies",
    "resilience",
    "budget",
    "gpu",
    "streams",
    "telemetry",
    "tasks",
];

/// Everything `outrigger serve` needs, validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub data_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Data-plane worker threads (`listen.workers`, 0 = one per core).
    pub workers: usize,
    pub admin_token: Option<Secret>,
    pub data_dir: PathBuf,
    pub journal: outrigger_journal::Options,
    /// `[journal] on_corrupt`.
    pub on_corrupt: OnCorrupt,
    /// `[journal] lock_wait`: how long start-up waits for a journal another process
    /// holds locked before it goes on without one.
    pub journal_lock_wait: Duration,
    pub proxy: popts::Options,
    pub policies: outrigger_policy::Options,
    pub gpu: outrigger_gpu::Options,
    pub drain_deadline: Duration,
    pub log: LogOptions,
    pub telemetry: TelemetryConfig,
    pub slos: Vec<outrigger_telemetry::slo::Slo>,
    pub tasks: TasksConfig,
    /// Faults injected from the start (drills only; off by default).
    pub faults: Vec<outrigger_proxy::faults::Fault>,
    /// Where the configuration came from, for the startup log.
    pub source: String,
}

/// What the sidecar does with a journal found corrupt at start-up (`[journal]
/// on_corrupt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnCorrupt {
    /// Leave it as it is and refuse side-effecting tool calls until an operator has
    /// reviewed it and moved it aside (durability.md §8.2.5: no silent re-execution).
    #[default]
    FailClosed,
    /// Move it aside and start a fresh journal: the sidecar stays available, and a
    /// retried call the lost journal knew executes again.
    Quarantine,
}

/// `[telemetry]`, validated.
#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    pub otlp: Option<outrigger_telemetry::OtlpOptions>,
    pub content: bool,
    pub service_name: String,
}

/// `[tasks]`, validated.
#[derive(Debug, Clone)]
pub struct TasksConfig {
    pub idle_timeout: Duration,
    pub retention: Duration,
    pub max_tasks: usize,
}

#[derive(Debug, Clone)]
pub struct LogOptions {
    pub json: bool,
    pub filter: String,
}

/// One thing wrong with the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key path, e.g. `providers[1].base_url`.
    pub path: String,
    /// The environment variable the key's value came from, e.g.
    /// `OUTRIGGER_GPU_SAMPLE_INTERVAL`; `None` for the file (or a default).
    pub from_env: Option<String>,
    pub message: String,
}

/// Every problem found, reported together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub source: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} has {} problem{}:",
            self.source,
            self.problems.len(),
            if self.problems.len() == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            match &p.from_env {
                Some(var) => writeln!(f, "  - {} (from {var}): {}", p.path, p.message)?,
                None => writeln!(f, "  - {}: {}", p.path, p.message)?,
            }
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

/// Collects problems while validating.
#[derive(Default)]
pub(crate) struct Problems {
    list: Vec<Problem>,
    /// Key paths whose value came from the environment, with the variable.
    from_env: Vec<(String, String)>,
}

impl Problems {
    /// A problem with the key at `path`; one whose value came from the environment
    /// names its variable too.
    pub(crate) fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        let path = path.into();
        let from_env = self
            .from_env
            .iter()
            .find(|(key, _)| *key == path)
            .map(|(_, var)| var.clone());
        self.list.push(Problem {
            path,
            from_env,
            message: message.into(),
        });
    }

    /// Records that the value of `path` came from the environment variable `var`.
    pub(crate) fn set_from_env(&mut self, path: impl Into<String>, var: &str) {
        self.from_env.push((path.into(), var.to_owned()));
    }

    fn len(&self) -> usize {
        self.list.len()
    }

    fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

/// Reads and validates the configuration. `env` is the process environment (passed
/// in so tests can supply their own).
pub fn load(path: Option<&Path>, env: &[(String, String)]) -> Result<Config, Error> {
    let source = match path {
        Some(p) => p.display().to_string(),
        None => "the embedded defaults".to_string(),
    };
    let fail = |problems: Vec<Problem>| Error {
        source: source.clone(),
        problems,
    };
    let text = match path {
        Some(p) => std::fs::read_to_string(p).map_err(|e| {
            fail(vec![Problem {
                path: "(file)".into(),
                from_env: None,
                message: format!("cannot read {}: {e}", p.display()),
            }])
        })?,
        None => String::new(),
    };
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        fail(vec![Problem {
            path: "(syntax)".into(),
            from_env: None,
            message: e.to_string().trim().replace('\n', " "),
        }])
    })?;
    let mut problems = Problems::default();
    apply_env_overrides(&mut table, env, &mut problems);

    let mut unknown = Vec::new();
    let raw: raw::Config =
        match serde_ignored::deserialize(toml::Value::Table(table.clone()), |p| {
            unknown.push(p.to_string())
        }) {
            Ok(raw) => raw,
            Err(_) => {
                // Deserializing stops at the first wrong type: go key by key to report
                // every one of them (and every unknown key) with its path.
                type_problems(&table, &mut problems);
                return Err(fail(problems.list));
            }
        };
    for key in unknown {
        problems.add(
            key,
            "unknown key (check the spelling against the README's config reference)",
        );
    }
    let config = validate(raw, env, source.clone(), &mut problems);
    if problems.is_empty() {
        config.ok_or_else(|| fail(Vec::new()))
    } else {
        Err(fail(problems.list))
    }
}

/// Every wrong type and unknown key, each with its path, found by deserializing
/// each key of each section on its own.
fn type_problems(table: &toml::Table, problems: &mut Problems) {
    let check = |section: &str, value: toml::Value, path: String, problems: &mut Problems| {
        let mut doc = toml::Table::new();
        doc.insert(section.to_owned(), value);
        let mut unknown = Vec::new();
        let result: Result<raw::Config, _> =
            serde_ignored::deserialize(toml::Value::Table(doc), |p| unknown.push(p.to_string()));
        match result {
            Ok(_) => {
                for key in unknown {
                    problems.add(
                        key,
                        "unknown key (check the spelling against the README's config reference)",
                    );
                }
            }
            Err(e) => {
                // The path is ours, more exact than the one in the message.
                let text = e.to_string().replace('\n', " ");
                let message = text.split(" in `").next().unwrap_or(&text).trim();
                problems.add(path, message);
            }
        }
    };
    let single = |key: &str, value: &toml::Value| {
        let mut t = toml::Table::new();
        t.insert(key.to_owned(), value.clone());
        toml::Value::Table(t)
    };
    for (section, value) in table {
        match value {
            toml::Value::Table(keys) => {
                for (key, v) in keys {
                    check(
                        section,
                        single(key, v),
                        format!("{section}.{key}"),
                        problems,
                    );
                }
            }
            toml::Value::Array(items) if items.iter().all(toml::Value::is_table) => {
                for (i, item) in items.iter().enumerate() {
                    let Some(keys) = item.as_table() else {
                        continue;
                    };
                    for (key, v) in keys {
                        let element = toml::Value::Array(vec![single(key, v)]);
                        check(section, element, format!("{section}[{i}].{key}"), problems);
                    }
                }
            }
            other => check(section, other.clone(), section.clone(), problems),
        }
    }
    if problems.is_empty() {
        problems.add(
            "(types)",
            "the configuration does not have the expected shape",
        );
    }
}

/// `OUTRIGGER_*` variables the sidecar does not read: no config section of that
/// name (a misspelt section, `OUTRIGGER_LISTN_DATA`), and not one the project's own
/// tools use. Worth a warning: they are ignored.
pub fn unread_env(env: &[(String, String)]) -> Vec<&str> {
    const OTHERS: [&str; 6] = [
        "BIN",
        "URL",
        "CRASH_KILLS",
        "NVML_STUB_SCENARIO",
        "NVML_STUB_PATH",
        "EXAMPLE_POLICIES",
    ];
    env.iter()
        .filter_map(|(name, _)| {
            let rest = name.strip_prefix("OUTRIGGER_")?;
            (env_override(name).is_none()
                && !OTHERS.contains(&rest)
                && !rest.starts_with("REQUIRE_"))
            .then_some(name.as_str())
        })
        .collect()
}

/// `OUTRIGGER_<SECTION>_<KEY>` variables that are set but empty, and so ignored.
pub fn empty_env(env: &[(String, String)]) -> Vec<&str> {
    env.iter()
        .filter(|(name, value)| value.is_empty() && env_override(name).is_some())
        .map(|(name, _)| name.as_str())
        .collect()
}

/// The config section and key an `OUTRIGGER_<SECTION>_<KEY>` variable overrides.
fn env_override(name: &str) -> Option<(&'static str, String)> {
    let rest = name.strip_prefix("OUTRIGGER_")?.to_ascii_lowercase();
    let section = ENV_SECTIONS
        .iter()
        .find(|s| rest.starts_with(&format!("{s}_")))?;
    Some((section, rest[section.len() + 1..].to_owned()))
}

/// Applies `OUTRIGGER_<SECTION>_<KEY>` variables over the file. An empty variable
/// is ignored, as if unset: an empty `OUTRIGGER_ADMIN_TOKEN` (a secret not mounted)
/// must not turn off the file's token.
fn apply_env_overrides(table: &mut toml::Table, env: &[(String, String)], problems: &mut Problems) {
    for (name, value) in env {
        let Some((section, key)) = env_override(name) else {
            continue;
        };
        if value.is_empty() {
            continue;
        }
        let key = key.as_str();
        let parsed = env_value(section, key, value);
        match table
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        {
            toml::Value::Table(t) => {
                t.insert(key.to_string(), parsed);
                problems.set_from_env(format!("{section}.{key}"), name);
            }
            _ => problems.add(
                format!("{section} (from {name})"),
                "cannot override: the config's value is not a table",
            ),
        }
    }
}

/// An environment value as the type its key takes: the first of integer, float,
/// boolean and string that the key accepts (`OUTRIGGER_ADMIN_TOKEN=123456` stays a
/// string, `OUTRIGGER_RESILIENCE_RETRY_BUDGET_RATIO=0.3` becomes a float). A value no
/// type fits is kept as a string, so validation names the key.
fn env_value(section: &str, key: &str, value: &str) -> toml::Value {
    let candidates = [
        value.parse::<i64>().ok().map(toml::Value::Integer),
        value.parse::<f64>().ok().map(toml::Value::Float),
        value.parse::<bool>().ok().map(toml::Value::Boolean),
    ];
    let accepts = |v: &toml::Value| {
        let mut inner = toml::Table::new();
        inner.insert(key.to_owned(), v.clone());
        let mut doc = toml::Table::new();
        doc.insert(section.to_owned(), toml::Value::Table(inner));
        toml::Value::Table(doc).try_into::<raw::Config>().is_ok()
    };
    candidates
        .into_iter()
        .flatten()
        .find(accepts)
        .unwrap_or_else(|| toml::Value::String(value.to_owned()))
}

fn env_var<'a>(env: &'a [(String, String)], name: &str) -> Option<&'a str> {
    env.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
}

/// Whether two listeners would fight over one port: the same port (not 0, which
/// picks a free one) on the same address, or where one is the unspecified address of
/// its family and covers the other (`[::]` covers IPv4 too, as Linux binds it
/// dual-stack by default).
fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    let covers = |any: SocketAddr, other: SocketAddr| {
        any.ip().is_unspecified() && (any.is_ipv6() || other.is_ipv4())
    };
    a.port() == b.port() && a.port() != 0 && (a.ip() == b.ip() || covers(a, b) || covers(b, a))
}

pub(crate) fn duration(
    p: &mut Problems,
    path: &str,
    value: &Option<String>,
    default: Duration,
) -> Duration {
    match value {
        None => default,
        Some(s) => match humantime::parse_duration(s) {
            // Far past any use, and past what a clock can add without overflowing.
            Ok(d) if d > MAX_DURATION => {
                p.add(
                    path,
                    format!("{s:?} is longer than 1000 years, the longest duration accepted"),
                );
                default
            }
            Ok(d) => d,
            Err(e) => {
                p.add(
                    path,
                    format!(
                        "{s:?} is not a duration ({e}); write e.g. \"500ms\", \"30s\", \"24h\""
                    ),
                );
                default
            }
        },
    }
}

/// A duration that must not be zero; `zero` says what a zero would break (or what to
/// set instead).
pub(crate) fn positive_duration(
    p: &mut Problems,
    path: &str,
    value: &Option<String>,
    default: Duration,
    zero: &str,
) -> Duration {
    let before = p.len();
    let parsed = duration(p, path, value, default);
    // A value that is not a duration at all has its problem already.
    if parsed.is_zero() && p.len() == before {
        p.add(path, format!("must be greater than 0: {zero}"));
    }
    parsed
}

fn addr(p: &mut Problems, path: &str, value: &Option<String>, default: &str) -> SocketAddr {
    let s = value.as_deref().unwrap_or(default);
    s.parse().unwrap_or_else(|e| {
        p.add(
            path,
            format!("{s:?} is not a socket address ({e}); write e.g. \"127.0.0.1:7070\""),
        );
        SocketAddr::from(([127, 0, 0, 1], 0))
    })
}

fn url(p: &mut Problems, path: &str, s: &str) -> Option<Uri> {
    match s.parse::<Uri>() {
        Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some() => {
            if u.query().is_some() {
                p.add(
                    path,
                    format!("{s:?} has a query string; give only scheme, host, port and path"),
                );
                return None;
            }
            Some(u)
        }
        Ok(_) => {
            p.add(
                path,
                format!("{s:?} must be an absolute http:// or https:// URL"),
            );
            None
        }
        Err(e) => {
            p.add(path, format!("{s:?} is not a URL ({e})"));
            None
        }
    }
}

fn validate(
    raw: raw::Config,
    env: &[(String, String)],
    source: String,
    p: &mut Problems,
) -> Option<Config> {
    let data_addr = addr(p, "listen.data", &raw.listen.data, "127.0.0.1:7070");
    let admin_addr = addr(p, "listen.admin", &raw.listen.admin, "127.0.0.1:7071");
    if overlap(data_addr, admin_addr) {
        p.add(
            "listen.admin",
            format!(
                "{admin_addr} and listen.data's {data_addr} cannot both be bound: the admin \
                 plane needs a port of its own"
            ),
        );
    }
    let admin_token = admin_token(raw.admin.token.as_deref(), p);
    if !admin_addr.ip().is_loopback() && admin_token.is_none() {
        p.add(
            "admin.token",
            format!(
                "the admin plane binds {admin_addr}, which is not loopback: set a bearer token \
                 (admin.token, or OUTRIGGER_ADMIN_TOKEN) or bind 127.0.0.1"
            ),
        );
    }

    let data_dir = PathBuf::from(
        raw.journal
            .dir
            .clone()
            .unwrap_or_else(|| "./outrigger-data".into()),
    );
    let journal = journal_options(&raw.journal, &data_dir, p);
    let on_corrupt = match raw.journal.on_corrupt.as_deref() {
        None | Some("fail-closed") => OnCorrupt::FailClosed,
        Some("quarantine") => OnCorrupt::Quarantine,
        Some(other) => {
            p.add(
                "journal.on_corrupt",
                format!("{other:?} is not a choice; use \"fail-closed\" or \"quarantine\""),
            );
            OnCorrupt::FailClosed
        }
    };
    let journal_lock_wait = duration(
        p,
        "journal.lock_wait",
        &raw.journal.lock_wait,
        Duration::from_secs(60),
    );

    let limits = Limits {
        max_body_bytes: raw.limits.max_body_bytes.unwrap_or(8 << 20),
        connect_timeout: positive_duration(
            p,
            "limits.connect_timeout",
            &raw.limits.connect_timeout,
            Duration::from_secs(5),
            "every connection to a provider or tool would time out at once",
        ),
        first_byte_timeout: positive_duration(
            p,
            "limits.first_byte_timeout",
            &raw.limits.first_byte_timeout,
            Duration::from_secs(120),
            "every provider answer would time out before its first byte",
        ),
        stream_idle_timeout: positive_duration(
            p,
            "limits.stream_idle_timeout",
            &raw.limits.stream_idle_timeout,
            outrigger_proxy::options::DEFAULT_STREAM_IDLE_TIMEOUT,
            "every stream would be cut after its first chunk",
        ),
        max_event_bytes: raw
            .limits
            .max_event_bytes
            .unwrap_or(outrigger_proxy::sse::DEFAULT_MAX_EVENT_BYTES),
        client_stall_timeout: positive_duration(
            p,
            "limits.client_stall_timeout",
            &raw.limits.client_stall_timeout,
            Duration::from_secs(30),
            "a client would be cut off at its first slow write",
        ),
        client_read_timeout: positive_duration(
            p,
            "limits.client_read_timeout",
            &raw.limits.client_read_timeout,
            outrigger_proxy::server::DEFAULT_CLIENT_READ_TIMEOUT,
            "every request would time out before its head arrived",
        ),
    };
    if limits.max_body_bytes == 0 {
        p.add("limits.max_body_bytes", "must be greater than 0");
    }
    if limits.max_event_bytes < MIN_EVENT_BYTES {
        p.add(
            "limits.max_event_bytes",
            format!(
                "must be at least {MIN_EVENT_BYTES} (4 KiB): a provider's single event (a tool-call \
                 chunk, a usage report) is often hundreds of bytes, and a stream fails at its \
                 first longer one"
            ),
        );
    }

    let providers = providers(&raw, env, p);
    let tools = tools(&raw, p);
    let policies = policies(&raw.policies, &data_dir, p);
    let resilience = resilience(&raw.resilience, p);
    let budget = budget(&raw.budget, &providers, p);
    let gpu = gpu(&raw.gpu, p);
    let sd = outrigger_proxy::streams::Options::default();
    let streams = outrigger_proxy::streams::Options {
        replay_in_task: raw.streams.replay_in_task.unwrap_or(sd.replay_in_task),
        detach_timeout: positive_duration(
            p,
            "streams.detach_timeout",
            &raw.streams.detach_timeout,
            sd.detach_timeout,
            "to stop a generation as soon as its last client leaves, set \
             streams.cancel_on_disconnect = true instead",
        ),
        max_stream_bytes: raw.streams.max_stream_bytes.unwrap_or(sd.max_stream_bytes),
        cancel_on_disconnect: raw
            .streams
            .cancel_on_disconnect
            .unwrap_or(sd.cancel_on_disconnect),
        max_continuations: raw
            .streams
            .max_continuations
            .unwrap_or(sd.max_continuations),
    };
    if streams.max_continuations > MAX_CONTINUATIONS {
        p.add(
            "streams.max_continuations",
            format!(
                "must be at most {MAX_CONTINUATIONS}: a provider that breaks that often will \
                 not finish the answer, and each continuation is billed its whole prompt again"
            ),
        );
    }

    if streams.max_stream_bytes < MIN_STREAM_BYTES {
        p.add(
            "streams.max_stream_bytes",
            format!(
                "must be at least {MIN_STREAM_BYTES} (64 KiB): a journaled stream larger than \
                 this is abandoned"
            ),
        );
    }

    let drain_deadline = positive_duration(
        p,
        "drain.deadline",
        &raw.drain.deadline,
        Duration::from_secs(30),
        "a shutdown would cut every request and tool call in flight at once",
    );
    let log = LogOptions {
        json: match raw.log.format.as_deref() {
            None | Some("text") => false,
            Some("json") => true,
            Some(other) => {
                p.add(
                    "log.format",
                    format!("{other:?} is not a log format; use \"text\" or \"json\""),
                );
                false
            }
        },
        filter: raw.log.level.clone().unwrap_or_else(|| "info".into()),
    };
    if let Err(e) = tracing_subscriber::EnvFilter::try_new(&log.filter) {
        p.add(
            "log.level",
            format!(
                "{:?} is not a log filter ({e}); e.g. \"info\" or \"info,outrigger=debug\"",
                log.filter
            ),
        );
    }
    let telemetry = telemetry(&raw.telemetry, env, p);
    let slos = match outrigger_telemetry::slo::Slo::from_specs(&raw.slos, "slos") {
        Ok(slos) => slos,
        Err(outrigger_telemetry::Error::SloConfig(problems)) => {
            for problem in problems {
                p.add(problem.path, problem.message);
            }
            Vec::new()
        }
        Err(e) => {
            p.add("slos", e.to_string());
            Vec::new()
        }
    };
    let td = outrigger_proxy::tasks::TasksOptions::default();
    let tasks = TasksConfig {
        idle_timeout: positive_duration(
            p,
            "tasks.idle_timeout",
            &raw.tasks.idle_timeout,
            Duration::from_secs(30 * 60),
            "every task would end as idle between two of its calls",
        ),
        retention: positive_duration(
            p,
            "tasks.retention",
            &raw.tasks.retention,
            td.retention,
            "an ended task would be gone before its outcome could be read",
        ),
        max_tasks: raw.tasks.max_tasks.unwrap_or(td.max_tasks),
    };
    if tasks.max_tasks == 0 {
        p.add("tasks.max_tasks", "must be greater than 0");
    }

    let proxy = popts::Options {
        providers,
        tools,
        limits,
        budget,
        resilience,
        streams,
    };
    let faults = match outrigger_proxy::faults::Fault::from_specs(&raw.faults, &proxy, "faults") {
        Ok(f) => f,
        Err(problems) => {
            for problem in problems {
                p.add(problem.path, problem.message);
            }
            Vec::new()
        }
    };

    Some(Config {
        data_addr,
        admin_addr,
        workers: match raw.listen.workers {
            Some(n) if n > MAX_WORKERS => {
                p.add(
                    "listen.workers",
                    format!(
                        "{n} is more than {MAX_WORKERS} worker threads; use 0 for one per core"
                    ),
                );
                0
            }
            n => n.unwrap_or(0),
        },
        admin_token,
        data_dir,
        journal,
        on_corrupt,
        journal_lock_wait,
        proxy,
        policies,
        gpu,
        drain_deadline,
        log,
        telemetry,
        slos,
        tasks,
        faults,
        source,
    })
}

/// The admin token as configured, without the whitespace around it: a token read
/// from a secret file usually ends in a newline, which no client sends (and the
/// admin plane trims what it is sent). An empty value means no token; one that is
/// only whitespace, or holds a control character, is refused.
fn admin_token(token: Option<&str>, p: &mut Problems) -> Option<Secret> {
    let token = token.filter(|t| !t.is_empty())?;
    let trimmed = token.trim();
    if trimmed.is_empty() {
        p.add(
            "admin.token",
            "is only whitespace: set a real token, or leave it empty for none \
             (which requires a loopback listen.admin)",
        );
        return None;
    }
    if trimmed.chars().any(char::is_control) {
        p.add(
            "admin.token",
            "contains a control character, which no client can send in an Authorization \
             header: use printable characters only",
        );
        return None;
    }
    Some(Secret::new(trimmed.to_owned()))
}

fn telemetry(raw: &raw::Telemetry, env: &[(String, String)], p: &mut Problems) -> TelemetryConfig {
    if raw
        .otlp_endpoint
        .as_deref()
        .is_none_or(|e| e.trim().is_empty())
    {
        p.set_from_env("telemetry.otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT");
    }
    let mut otlp = outrigger_telemetry::OtlpOptions::resolve(raw.otlp_endpoint.as_deref(), env);
    if let Some(o) = &mut otlp {
        match o.endpoint.parse::<Uri>() {
            Ok(uri) if matches!(uri.scheme_str(), Some("http" | "https")) => {}
            _ => p.add(
                "telemetry.otlp_endpoint",
                format!(
                    "{:?} is not an http(s) URL (e.g. \"http://127.0.0.1:4318\")",
                    o.endpoint
                ),
            ),
        }
        for (name, value) in &raw.otlp_headers {
            match value.as_str() {
                Some(v) => o.headers.push((name.clone(), v.to_owned())),
                None => p.add(format!("telemetry.otlp_headers.{name}"), "must be a string"),
            }
        }
    }
    TelemetryConfig {
        otlp,
        content: raw.content.unwrap_or(false),
        service_name: raw
            .service_name
            .clone()
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| outrigger_telemetry::names::SERVICE_NAME_DEFAULT.to_owned()),
    }
}

fn journal_options(
    raw: &raw::Journal,
    data_dir: &Path,
    p: &mut Problems,
) -> outrigger_journal::Options {
    let d = outrigger_journal::Options::default();
    let durability = match raw.durability.as_deref() {
        None | Some("process") => outrigger_journal::Durability::Process,
        Some("node") => outrigger_journal::Durability::Node,
        Some(other) => {
            p.add(
                "journal.durability",
                format!("{other:?} is not a durability; use \"process\" or \"node\""),
            );
            outrigger_journal::Durability::Process
        }
    };
    let retention = duration(p, "journal.retention", &raw.retention, d.retention);
    if retention < Duration::from_secs(60 * 60) {
        p.add(
            "journal.retention",
            "must be at least 1h: a retried call must still find its key",
        );
    }
    outrigger_journal::Options {
        dir: data_dir.join("journal"),
        durability,
        retention,
        tombstone_retention: positive_duration(
            p,
            "journal.tombstone_retention",
            &raw.tombstone_retention,
            d.tombstone_retention,
            "a key would be forgotten as soon as its record expires, and a late retry \
             executed again",
        ),
        stream_retention: positive_duration(
            p,
            "journal.stream_retention",
            &raw.stream_retention,
            d.stream_retention,
            "a journaled stream would be dropped before a client could resume it",
        ),
        cache_capacity_bytes: match raw.cache_bytes {
            Some(b) if b < MIN_CACHE_BYTES => {
                p.add(
                    "journal.cache_bytes",
                    format!("{b} is below the journal's minimum of {MIN_CACHE_BYTES} (1 MiB)"),
                );
                d.cache_capacity_bytes
            }
            Some(b) => b,
            None => d.cache_capacity_bytes,
        },
        ..d
    }
}

/// The most data-plane worker threads `listen.workers` may ask for.
const MAX_WORKERS: usize = 1024;

/// The most memory one policy instance may be given (4 GiB: a 32-bit guest's
/// address space).
const MAX_POLICY_MEMORY_MB: usize = 4096;

/// The least `journal.cache_bytes` the journal opens with.
const MIN_CACHE_BYTES: u64 = 1 << 20;

/// A provider's API key as read from the environment: trimmed (a key mounted from a
/// secret file ends in a newline, which no header may carry), and refused when what
/// is left could not be sent in a header (it would silently not be sent).
fn api_key(p: &mut Problems, at: &str, raw: &str) -> Option<Secret> {
    let key = raw.trim();
    if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
        p.add(
            at,
            "the API key is empty or holds characters a header cannot carry (spaces, control or non-ASCII characters inside it)",
        );
        return None;
    }
    Some(Secret::new(key.to_owned()))
}

/// A provider's `continuation`: how an interrupted text-only stream is continued.
fn continuation(
    p: &mut Problems,
    path: &str,
    rp: &raw::Provider,
    dialect: Option<Dialect>,
) -> Option<popts::Continuation> {
    let mode = match rp.continuation.as_deref()? {
        "prefill" => popts::Continuation::Prefill,
        "instruction" => popts::Continuation::Instruction,
        other => {
            p.add(
                path,
                format!(
                    "{other:?} is not a continuation; use \"prefill\" (Claude up to 4.5) or \
                     \"instruction\" (Claude 4.6 and later, and OpenAI), or leave it out"
                ),
            );
            return None;
        }
    };
    if dialect == Some(Dialect::OpenAi) && mode == popts::Continuation::Prefill {
        p.add(
            path,
            "OpenAI's chat completions do not continue an assistant prefill; use \
             continuation = \"instruction\" on kind = \"openai\" providers, or leave it out",
        );
        return None;
    }
    Some(mode)
}

fn providers(raw: &raw::Config, env: &[(String, String)], p: &mut Problems) -> Vec<Provider> {
    let mut out: Vec<Provider> = Vec::new();
    if raw.providers.is_empty() {
        // Zero-config: providers from the environment, as the provider SDKs read it.
        for (name, dialect, key_env, base_env, default_base) in [
            (
                "openai",
                Dialect::OpenAi,
                "OPENAI_API_KEY",
                "OPENAI_BASE_URL",
                "https://api.openai.com/v1",
            ),
            (
                "anthropic",
                Dialect::Anthropic,
                "ANTHROPIC_API_KEY",
                "ANTHROPIC_BASE_URL",
                "https://api.anthropic.com",
            ),
        ] {
            let Some(key) = env_var(env, key_env) else {
                continue;
            };
            let api_key = api_key(p, &format!("({key_env})"), key);
            let base = env_var(env, base_env).unwrap_or(default_base);
            if let Some(base_url) = url(p, &format!("({base_env})"), base) {
                out.push(Provider {
                    name: name.into(),
                    dialect,
                    base_url,
                    api_key,
                    models: vec![ModelPattern::Any],
                    caps: Capabilities::permissive(),
                });
            }
        }
        return out;
    }
    for (i, rp) in raw.providers.iter().enumerate() {
        let at = |k: &str| format!("providers[{i}].{k}");
        if rp.name.is_empty() {
            p.add(at("name"), "must not be empty");
        } else if out.iter().any(|o| o.name == rp.name) {
            p.add(
                at("name"),
                format!("{:?} is already used by another provider", rp.name),
            );
        }
        let dialect = match rp.kind.as_str() {
            "openai" => Some(Dialect::OpenAi),
            "anthropic" => Some(Dialect::Anthropic),
            other => {
                p.add(
                    at("kind"),
                    format!("{other:?} is not a provider kind; use \"openai\" or \"anthropic\""),
                );
                None
            }
        };
        let base_url = url(p, &at("base_url"), &rp.base_url);
        let api_key = match &rp.api_key_env {
            None => None,
            Some(var) => match env_var(env, var) {
                Some(v) => api_key(p, &at("api_key_env"), v),
                None => {
                    p.add(
                        at("api_key_env"),
                        format!("environment variable {var} is not set (or empty)"),
                    );
                    None
                }
            },
        };
        if rp.models.is_empty() {
            p.add(at("models"), "list at least one model, or \"*\" for any");
        }
        let mut modalities = Modalities::EMPTY;
        for (j, name) in rp.modalities.iter().enumerate() {
            match Modalities::parse(name) {
                Ok(m) => modalities |= m,
                Err(e) => p.add(at(&format!("modalities[{j}]")), e),
            }
        }
        let mut price = |k: &str, v: Option<f64>| match v {
            None => 0,
            Some(d) if d.is_finite() && d >= 0.0 => (d * 1_000_000.0).round() as u64,
            Some(d) => {
                p.add(
                    at(k),
                    format!("{d} is not a price; give dollars per million tokens, e.g. 2.5"),
                );
                0
            }
        };
        let caps = Capabilities {
            fallbacks: rp.fallbacks.clone(),
            default_model: rp.default_model.clone(),
            supports_tools: rp.supports_tools.unwrap_or(true),
            supports_streaming: rp.supports_streaming.unwrap_or(true),
            context_window: rp.context_window.unwrap_or(0),
            modalities,
            local: rp.local.unwrap_or(false),
            price_in: price("price_in", rp.price_in),
            price_out: price("price_out", rp.price_out),
            continuation: continuation(p, &at("continuation"), rp, dialect),
        };
        if let (Some(dialect), Some(base_url)) = (dialect, base_url) {
            out.push(Provider {
                name: rp.name.clone(),
                dialect,
                base_url,
                api_key,
                models: rp.models.iter().map(|m| ModelPattern::parse(m)).collect(),
                caps,
            });
        }
    }
    // Fallbacks name providers of the same kind (no translation between dialects).
    for (i, rp) in raw.providers.iter().enumerate() {
        let Some(me) = out.iter().find(|o| o.name == rp.name) else {
            continue;
        };
        for f in &rp.fallbacks {
            match out.iter().find(|o| &o.name == f) {
                None => p.add(
                    format!("providers[{i}].fallbacks"),
                    format!("{f:?} is not a configured provider"),
                ),
                Some(o) if o.dialect != me.dialect => p.add(
                    format!("providers[{i}].fallbacks"),
                    format!(
                        "{f:?} speaks {}, {} speaks {}: fallbacks must share the API kind",
                        o.dialect.as_str(),
                        me.name,
                        me.dialect.as_str()
                    ),
                ),
                Some(o) if o.name == me.name => p.add(
                    format!("providers[{i}].fallbacks"),
                    "a provider cannot fall back to itself",
                ),
                Some(_) => {}
            }
        }
    }
    out
}

fn policies(raw: &raw::Policies, data_dir: &Path, p: &mut Problems) -> outrigger_policy::Options {
    use outrigger_policy::{Binding, Hook, OnError, Source};
    let d = outrigger_policy::Options::default();
    let mut bindings = Vec::new();
    for (i, b) in raw.bindings.iter().enumerate() {
        let at = |k: &str| format!("policies.bindings[{i}].{k}");
        let hook = match b.hook.as_str() {
            "retry" => Some(Hook::Retry),
            "fallback" => Some(Hook::Fallback),
            "budget" => Some(Hook::Budget),
            other => {
                p.add(
                    at("hook"),
                    format!("{other:?} is not a hook; use \"retry\", \"fallback\" or \"budget\""),
                );
                None
            }
        };
        let source = if let Some(name) = b.policy.strip_prefix("builtin:") {
            if outrigger_builtins::by_name(name).is_none() {
                p.add(at("policy"), format!("there is no built-in {name:?}; the built-ins are retry, fallback and budget"));
            }
            Some(Source::Builtin(name.to_string()))
        } else if b.policy.ends_with(".wasm") {
            Some(Source::Path(PathBuf::from(&b.policy)))
        } else if !b.policy.is_empty() && !b.policy.contains('/') {
            if raw.dir.is_none() {
                p.add(
                    at("policy"),
                    format!(
                        "{:?} names a file in [policies] dir, but no dir is set",
                        b.policy
                    ),
                );
            }
            Some(Source::Named(b.policy.clone()))
        } else {
            p.add(at("policy"), "give \"builtin:<name>\", the stem of a .wasm in [policies] dir, or a path ending in .wasm");
            None
        };
        let on_error = match b.on_error.as_deref() {
            None | Some("fail-open") => OnError::FailOpen,
            Some("fail-closed") => OnError::FailClosed,
            Some(other) => {
                p.add(
                    at("on_error"),
                    format!("{other:?} is not \"fail-open\" or \"fail-closed\""),
                );
                OnError::FailOpen
            }
        };
        let params = b
            .params
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    toml::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), v)
            })
            .collect();
        if let (Some(hook), Some(source)) = (hook, source) {
            if bindings.iter().any(|x: &Binding| x.hook == hook) {
                p.add(at("hook"), format!("{} is bound twice", hook.as_str()));
            }
            bindings.push(Binding {
                hook,
                source,
                params,
                on_error,
            });
        }
    }
    outrigger_policy::Options {
        dir: raw.dir.as_ref().map(PathBuf::from),
        cache_dir: Some(
            raw.cache_dir
                .as_ref()
                .map(PathBuf::from)
                .unwrap_or_else(|| data_dir.join("policy-cache")),
        ),
        bindings,
        deadline: positive_duration(
            p,
            "policies.deadline",
            &raw.deadline,
            d.deadline,
            "every policy call would overrun its deadline",
        ),
        memory_limit_bytes: match raw.memory_limit_mb {
            Some(m) if (1..=MAX_POLICY_MEMORY_MB).contains(&m) => m << 20,
            Some(m) => {
                p.add(
                    "policies.memory_limit_mb",
                    format!(
                        "{m} is out of range: 1 to {MAX_POLICY_MEMORY_MB} (a policy instance needs some memory to run at all, the built-ins included)"
                    ),
                );
                d.memory_limit_bytes
            }
            None => d.memory_limit_bytes,
        },
        max_retry_delay: {
            let max = positive_duration(
                p,
                "policies.max_retry_delay",
                &raw.max_retry_delay,
                d.max_retry_delay,
                "every retry decision with a delay would be refused as invalid",
            );
            if max > outrigger_proxy::decider::MAX_RETRY_DELAY {
                p.add(
                    "policies.max_retry_delay",
                    format!(
                        "at most {:?}: the data plane caps every retry delay there",
                        outrigger_proxy::decider::MAX_RETRY_DELAY
                    ),
                );
            }
            max
        },
        seed: raw.seed,
        warm_instances: d.warm_instances,
        compiler: d.compiler,
    }
}

fn resilience(raw: &raw::Resilience, p: &mut Problems) -> popts::Resilience {
    use outrigger_proxy::resilience::{breaker, limiter, retry_budget};
    let rb = retry_budget::Options::default();
    let br = breaker::Options::default();
    let li = limiter::Options::default();
    let ratio = raw.retry_budget_ratio.unwrap_or(rb.ratio);
    if !(0.0..=10.0).contains(&ratio) {
        p.add(
            "resilience.retry_budget_ratio",
            format!("{ratio} must be between 0 and 10 (0.2 = retries up to 20 % of requests)"),
        );
    }
    let min_penalty = positive_duration(
        p,
        "resilience.breaker_min_penalty",
        &raw.breaker_min_penalty,
        br.min_penalty,
        "an open circuit would let the next call through at once",
    );
    let max_penalty = positive_duration(
        p,
        "resilience.breaker_max_penalty",
        &raw.breaker_max_penalty,
        br.max_penalty,
        "an open circuit would let the next call through at once",
    );
    if !max_penalty.is_zero() && min_penalty > max_penalty {
        p.add(
            "resilience.breaker_min_penalty",
            format!(
                "{} is longer than resilience.breaker_max_penalty ({}); the first penalty \
                 cannot exceed the longest",
                humantime::format_duration(min_penalty),
                humantime::format_duration(max_penalty)
            ),
        );
    }
    let max_attempts = raw.max_attempts.unwrap_or(popts::DEFAULT_MAX_ATTEMPTS);
    if !(1..=100).contains(&max_attempts) {
        p.add(
            "resilience.max_attempts",
            format!(
                "{max_attempts} must be between 1 and 100 (attempts per call, retries and \
                 fallbacks included; 1 = never retry)"
            ),
        );
    }
    popts::Resilience {
        max_attempts,
        retry_budget: retry_budget::Options {
            ratio,
            min_retries: raw.retry_budget_min.unwrap_or(rb.min_retries),
            window: {
                let window = positive_duration(
                    p,
                    "resilience.retry_budget_window",
                    &raw.retry_budget_window,
                    rb.window,
                    "the window would never slide, so a spent retry budget would never refill",
                );
                if !window.is_zero() && window < MIN_RETRY_BUDGET_WINDOW {
                    p.add(
                        "resilience.retry_budget_window",
                        "must be at least 100ms: the window slides in tenths, and a shorter one \
                         never slides, so a spent retry budget would never refill",
                    );
                }
                window
            },
        },
        breaker: breaker::Options {
            consecutive_failures: raw
                .breaker_failures
                .unwrap_or(br.consecutive_failures)
                .max(1),
            min_penalty,
            max_penalty,
            jitter: br.jitter,
        },
        limiter: limiter::Options {
            max_concurrency: raw.max_concurrency.unwrap_or(li.max_concurrency).max(1),
            min_concurrency: li.min_concurrency,
            max_queue: raw.max_queue.unwrap_or(li.max_queue),
            queue_timeout: positive_duration(
                p,
                "resilience.queue_timeout",
                &raw.queue_timeout,
                li.queue_timeout,
                "every queued call would be refused at once; to refuse calls instead of \
                 queueing them, set resilience.max_queue = 0",
            ),
        },
    }
}

fn budget(raw: &raw::Budget, providers: &[Provider], p: &mut Problems) -> popts::Budget {
    let cost = raw.cost.and_then(|c| {
        if c.is_finite() && c >= 0.0 {
            Some((c * 1_000_000.0).round() as u64)
        } else {
            p.add("budget.cost", format!("{c} is not an amount of dollars"));
            None
        }
    });
    let wall = raw.wall_clock.as_ref().map(|_| {
        let wall = positive_duration(
            p,
            "budget.wall_clock",
            &raw.wall_clock,
            Duration::ZERO,
            "every task would be over its budget at its first call; leave it unset for no limit",
        );
        // Budgets count whole milliseconds: less would be a limit of 0.
        if !wall.is_zero() && wall < Duration::from_millis(1) {
            p.add(
                "budget.wall_clock",
                format!("{wall:?} is under a millisecond, the unit task budgets count in"),
            );
        }
        u64::try_from(wall.as_millis()).unwrap_or(u64::MAX)
    });
    for (i, m) in raw.downgrade_models.iter().enumerate() {
        if !providers
            .iter()
            .any(|pr| pr.models.iter().any(|pat| pat.matches(m)))
        {
            p.add(
                format!("budget.downgrade_models[{i}]"),
                format!("no provider serves {m:?}"),
            );
        }
    }
    popts::Budget {
        limits: outrigger_types::Limits {
            tokens_in: raw.tokens_in,
            tokens_out: raw.tokens_out,
            tokens_total: raw.tokens_total,
            cost_micros: cost,
            wall_clock_ms: wall,
            calls: raw.calls,
            retries: raw.retries,
        },
        downgrades: raw.downgrade_models.clone(),
    }
}

fn gpu(raw: &raw::Gpu, p: &mut Problems) -> outrigger_gpu::Options {
    let d = outrigger_gpu::Options::default();
    let mut uuids = Vec::new();
    let mut indices = Vec::new();
    for (i, w) in raw.watch.iter().enumerate() {
        match w {
            toml::Value::String(s) if s.starts_with("GPU-") || s.starts_with("MIG-") => {
                uuids.push(s.clone())
            }
            toml::Value::Integer(n) if u32::try_from(*n).is_ok() => {
                indices.push(u32::try_from(*n).unwrap_or_default());
            }
            other => p.add(
                format!("gpu.watch[{i}]"),
                format!(
                    "{other} is neither a GPU UUID (\"GPU-…\"), a MIG device UUID (\"MIG-…\") \
                     nor an index"
                ),
            ),
        }
    }
    let watch = match (uuids.is_empty(), indices.is_empty()) {
        (true, true) => outrigger_gpu::Watch::All,
        (false, true) => outrigger_gpu::Watch::Uuids(uuids),
        (true, false) => outrigger_gpu::Watch::Indices(indices),
        (false, false) => {
            p.add("gpu.watch", "list UUIDs or indices, not both");
            outrigger_gpu::Watch::All
        }
    };
    let options = outrigger_gpu::Options {
        enabled: raw.enabled.unwrap_or(d.enabled),
        library_path: raw.library.as_ref().map(PathBuf::from),
        sample_interval: duration(
            p,
            "gpu.sample_interval",
            &raw.sample_interval,
            d.sample_interval,
        ),
        watch,
        unknown_is_ready: raw.unknown_is_ready.unwrap_or(d.unknown_is_ready),
        degraded_is_ready: raw.degraded_is_ready.unwrap_or(d.degraded_is_ready),
        fatal_xids: raw
            .fatal_xids
            .clone()
            .map(|v| v.into_iter().collect())
            .unwrap_or(d.fatal_xids.clone()),
        expected_count: raw.expected_count.or(d.expected_count),
        ..d
    };
    for (field, problem) in options.problems() {
        p.add(format!("gpu.{field}"), problem);
    }
    options
}

fn tools(raw: &raw::Config, p: &mut Problems) -> Vec<Tool> {
    let mut out: Vec<Tool> = Vec::new();
    for (i, rt) in raw.tools.iter().enumerate() {
        let at = |k: &str| format!("tools[{i}].{k}");
        let valid_name = !rt.name.is_empty()
            && rt.name.len() <= 64
            && rt
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !valid_name {
            p.add(
                at("name"),
                format!(
                    "{:?} must be 1 to 64 letters, digits, - or _ (it is a URL segment and \
                     prefixes the tool's journal keys)",
                    rt.name
                ),
            );
        } else if out.iter().any(|o| o.name == rt.name) {
            p.add(
                at("name"),
                format!("{:?} is already used by another tool", rt.name),
            );
        }
        let kind = match rt.kind.as_str() {
            "http" => Some(ToolKind::Http),
            "mcp" => Some(ToolKind::Mcp),
            other => {
                p.add(
                    at("kind"),
                    format!("{other:?} is not a tool kind; use \"http\" or \"mcp\""),
                );
                None
            }
        };
        let class = match rt.class.as_deref().unwrap_or("unsafe").parse::<ToolClass>() {
            Ok(c) => Some(c),
            Err(e) => {
                p.add(at("class"), e);
                None
            }
        };
        if class == Some(ToolClass::Probe) && kind == Some(ToolKind::Mcp) {
            p.add(
                at("class"),
                "an MCP server cannot be a probe tool (MCP has no way to ask whether a call \
                 happened); use \"keyed\" if it honours the key in _meta, else \"unsafe\"",
            );
        } else if class == Some(ToolClass::Probe) && rt.probe_path.is_none() {
            p.add(
                at("probe_path"),
                "a probe tool needs probe_path (e.g. \"/status/{key}\")",
            );
        }
        // A probe sent to the wrong path reads a 404 as "it never happened" and
        // executes the call again.
        if let Some(path) = &rt.probe_path
            && (!path.starts_with('/') || path.contains(['?', '#']) || !path.contains("{key}"))
        {
            p.add(
                at("probe_path"),
                format!(
                    "{path:?} must be a path that starts with \"/\" and names the key, \"{{key}}\", with no query or fragment (e.g. \"/status/{{key}}\")"
                ),
            );
        }
        let base_url = url(p, &at("base_url"), &rt.base_url);
        let timeout = positive_duration(
            p,
            &at("timeout"),
            &rt.timeout,
            Duration::from_secs(30),
            "every call would time out at once (an unsafe tool's call then stays in doubt)",
        );
        let mut redact = outrigger_proxy::redact::Redactions::default();
        for (j, name) in rt.redact_headers.iter().enumerate() {
            match http::HeaderName::from_bytes(name.trim().as_bytes()) {
                Ok(h) => redact.headers.push(h),
                Err(_) => p.add(
                    format!("tools[{i}].redact_headers[{j}]"),
                    format!("{name:?} is not a header name"),
                ),
            }
        }
        for (j, pointer) in rt.redact_json.iter().enumerate() {
            match outrigger_proxy::redact::pointer_problem(pointer) {
                None => redact.json.push(pointer.clone()),
                Some(problem) => p.add(format!("tools[{i}].redact_json[{j}]"), problem),
            }
        }
        if let (Some(kind), Some(class), Some(base_url)) = (kind, class, base_url) {
            out.push(Tool {
                name: rt.name.clone(),
                kind,
                base_url,
                class,
                key_required: rt.key_required.unwrap_or(false),
                journal_get: rt.journal_get.unwrap_or(false),
                timeout,
                probe_path: rt.probe_path.clone(),
                redact,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests;
