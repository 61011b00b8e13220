//! Host-side test kit for Outrigger policies: load a `.wasm` component the way the
//! sidecar does and check it — which hooks it implements, whether it passes the
//! conformance suite, and what it decides for a scripted scenario.
//!
//! It runs on the same host as the sidecar (`outrigger-policy`), with the same
//! sandbox, deadline, memory cap and decision checks ([`outrigger_policy::validate`]),
//! so "conformant here" means "accepted there". The suite is written for any guest
//! language: it loads a component once (compiled artifacts are cached on disk, since
//! a Python or JavaScript component takes seconds to compile) and runs every input on
//! that one loaded component, so only a handful of instances are ever created (a
//! fresh one only after a trap). The CLI's `outrigger policy check` is [`check`];
//! `outrigger policy test --scenario FILE` is [`Kit::run_scenario`] (format in
//! `sdk/README.md`).

mod conformance;
mod scenario;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use outrigger_policy::{Hook, Loaded, Runtime, RuntimeOptions};
use serde::Serialize;

pub use conformance::{ConformanceReport, Outcome};
pub use scenario::{Scenario, ScenarioReport, StepReport};

/// What went wrong before a policy could be judged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Policy(#[from] outrigger_policy::Error),
    #[error("reading {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("scenario: {0}")]
    Scenario(String),
}

/// How the kit runs policies.
#[derive(Debug, Clone)]
pub struct KitOptions {
    /// Where compiled components are cached; `None` compiles every time.
    pub cache_dir: Option<PathBuf>,
    /// Deadline of one decision.
    pub deadline: Duration,
    pub memory_limit_bytes: usize,
    /// The longest retry delay accepted (the sidecar's `max_retry_delay`).
    pub max_retry_delay: Duration,
    /// Seed of the `random` import.
    pub seed: u64,
}

impl Default for KitOptions {
    fn default() -> Self {
        Self {
            cache_dir: Some(std::env::temp_dir().join("outrigger-policy-testkit-cache")),
            // Generous: the suite checks answers, not speed, and runs on CI machines.
            deadline: Duration::from_millis(250),
            memory_limit_bytes: 64 << 20,
            max_retry_delay: Duration::from_secs(60),
            seed: 0x5eed,
        }
    }
}

/// A policy host for tests. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Kit {
    runtime: Runtime,
    options: KitOptions,
}

impl Kit {
    /// Sets up an engine (and a thread advancing its epoch, which ends when the
    /// last clone of the kit is dropped).
    pub fn new(options: KitOptions) -> Result<Self, Error> {
        let runtime = Runtime::new(RuntimeOptions {
            cache_dir: options.cache_dir.clone(),
            deadline: options.deadline,
            memory_limit_bytes: options.memory_limit_bytes,
            seed: Some(options.seed),
            warm_instances: 1,
            ..RuntimeOptions::default()
        })?;
        Ok(Self { runtime, options })
    }

    pub fn options(&self) -> &KitOptions {
        &self.options
    }

    /// Compiles (or takes from the cache) and pre-instantiates a component.
    pub fn load(&self, bytes: &[u8], params: BTreeMap<String, String>) -> Result<Loaded, Error> {
        Ok(self.runtime.load(bytes, params, "under-test")?)
    }

    /// Validates `bytes` as a policy component and runs the conformance suite on
    /// every hook it implements.
    pub fn check(&self, bytes: &[u8], params: BTreeMap<String, String>) -> CheckReport {
        let mut report = CheckReport {
            valid: false,
            error: None,
            size_bytes: bytes.len(),
            content_hash: None,
            hooks: Vec::new(),
            packages: Vec::new(),
            exports: Vec::new(),
            load_ms: None,
            from_cache: None,
            conformance: None,
        };
        let loaded = match self.load(bytes, params) {
            Ok(loaded) => loaded,
            Err(e) => {
                report.error = Some(e.to_string());
                return report;
            }
        };
        report.content_hash = Some(loaded.content_hash().to_string());
        report.hooks = loaded.hooks().to_vec();
        report.exports = loaded.exports().to_vec();
        report.packages = packages(loaded.exports());
        report.load_ms = Some(loaded.load_time().as_secs_f64() * 1_000.0);
        report.from_cache = Some(loaded.from_cache());
        if loaded.hooks().is_empty() {
            report.error = Some(format!(
                "the component exports none of {}; build it against one of the worlds \
                 retry-policy, fallback-policy, budget-policy or policy",
                Hook::ALL.map(|h| h.export_name()).join(", ")
            ));
            return report;
        }
        report.valid = true;
        report.conformance = Some(self.conformance(&loaded));
        report
    }

    /// Runs the conformance suite on every hook `loaded` implements.
    pub fn conformance(&self, loaded: &Loaded) -> ConformanceReport {
        conformance::run(loaded, self.options.max_retry_delay)
    }

    /// Replays a scenario against `bytes` and returns each decision.
    pub fn run_scenario(&self, bytes: &[u8], scenario: &Scenario) -> Result<ScenarioReport, Error> {
        let loaded = self.load(bytes, scenario.params.clone())?;
        Ok(scenario::run(
            &loaded,
            scenario,
            self.options.max_retry_delay,
        ))
    }
}

/// `outrigger policy check FILE.wasm`: a [`Kit`] with default options checks `bytes`.
pub fn check(bytes: &[u8]) -> CheckReport {
    match Kit::new(KitOptions::default()) {
        Ok(kit) => kit.check(bytes, BTreeMap::new()),
        Err(e) => CheckReport {
            valid: false,
            error: Some(e.to_string()),
            size_bytes: bytes.len(),
            content_hash: None,
            hooks: Vec::new(),
            packages: Vec::new(),
            exports: Vec::new(),
            load_ms: None,
            from_cache: None,
            conformance: None,
        },
    }
}

/// What `check` found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckReport {
    /// A component that links against the host and implements at least one hook.
    pub valid: bool,
    /// Why it is not valid.
    pub error: Option<String>,
    pub size_bytes: usize,
    /// SHA-256 of the component, hex (the sidecar's version is `<hook>@<first 16>`).
    pub content_hash: Option<String>,
    /// The hooks it implements.
    pub hooks: Vec<Hook>,
    /// The WIT packages (with versions) its hooks come from, e.g. `outrigger:policy@0.1.0`.
    pub packages: Vec<String>,
    /// Every export name.
    pub exports: Vec<String>,
    pub load_ms: Option<f64>,
    pub from_cache: Option<bool>,
    /// `None` when the component could not be loaded or implements no hook.
    pub conformance: Option<ConformanceReport>,
}

impl CheckReport {
    /// Valid and conformant.
    pub fn passed(&self) -> bool {
        self.valid
            && self
                .conformance
                .as_ref()
                .is_some_and(ConformanceReport::passed)
    }
}

impl std::fmt::Display for CheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(hash) = &self.content_hash {
            writeln!(f, "component  {} bytes, sha256 {hash}", self.size_bytes)?;
        }
        if !self.packages.is_empty() {
            writeln!(f, "package    {}", self.packages.join(", "))?;
        }
        let hooks: Vec<&str> = self.hooks.iter().map(|h| h.as_str()).collect();
        writeln!(
            f,
            "hooks      {}",
            if hooks.is_empty() {
                "none".into()
            } else {
                hooks.join(", ")
            }
        )?;
        if let Some(error) = &self.error {
            writeln!(f, "error      {error}")?;
        }
        if let Some(conformance) = &self.conformance {
            write!(f, "{conformance}")?;
        }
        write!(f, "{}", if self.passed() { "PASS" } else { "FAIL" })
    }
}

/// `outrigger:policy/retry@0.1.0` → `outrigger:policy@0.1.0`, deduplicated.
fn packages(exports: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for name in exports {
        if let Some((package, rest)) = name.split_once('/')
            && let Some((_, version)) = rest.split_once('@')
        {
            let package = format!("{package}@{version}");
            if !out.contains(&package) {
                out.push(package);
            }
        }
    }
    out
}
