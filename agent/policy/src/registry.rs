//! The registry: which component decides each hook, hot swap, containment and status.
//!
//! Each hook has one slot holding the active version (and the one it replaced) in an
//! `ArcSwap`. A call pins the active version with one atomic load and runs to the
//! end on it, so a swap never disturbs a call in flight and the old version is freed
//! when its last call returns. Reloads are serialized; each binding is read,
//! compiled (or taken from the cache), checked against its hook and smoke-tested
//! before it is published, and a binding that fails any step leaves its slot as it
//! was.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use outrigger_types::{
    BudgetDecision, BudgetRequest, CallContext, CallKind, Candidate, CircuitState, Decided,
    DecisionSource, DowngradeOption, Failure, FallbackRequest, Limits, Modalities, PolicyVersion,
    RetryBudget, RetryDecision, Usage,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::runtime::hex;
use crate::{Compiler, Error, Fault, Hook, Loaded, Runtime, RuntimeOptions, validate};

/// The parameter through which the retry built-in learns the host's longest retry
/// delay ([`Options::max_retry_delay`], in whole milliseconds). The host sets it
/// whenever it loads that built-in, over any value a binding gives, so the
/// built-in treats a longer `Retry-After` as too long to wait for (and falls back)
/// instead of answering a delay the host refuses. Other policies do not get it.
pub const MAX_RETRY_DELAY_PARAM: &str = "max_retry_delay_ms";

/// A built-in component the binary embeds (see the `outrigger-builtins` crate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuiltinComponent {
    /// The hook it implements (`retry`, `fallback`, `budget`); also its name in config.
    pub name: &'static str,
    pub bytes: &'static [u8],
}

/// Where a binding's component comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// An embedded built-in, by name.
    Builtin(String),
    /// `<dir>/<stem>.wasm` in the policy directory.
    Named(String),
    /// A file anywhere.
    Path(PathBuf),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Builtin(name) => write!(f, "builtin:{name}"),
            Self::Named(stem) => write!(f, "dir:{stem}.wasm"),
            Self::Path(path) => write!(f, "file:{}", path.display()),
        }
    }
}

/// What a failing policy's call turns into.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnError {
    /// The previous good version, else the built-in, else a hard-wired default
    /// decides, as if the policy had not been there.
    #[default]
    FailOpen,
    /// The strict decision: retry gives up, budget rejects, fallback keeps the
    /// original order; the reason names the policy failure.
    FailClosed,
}

/// One hook bound to one component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub hook: Hook,
    pub source: Source,
    /// Answers of the `param` import.
    pub params: BTreeMap<String, String>,
    pub on_error: OnError,
}

impl Binding {
    /// The hook bound to its built-in, with default parameters, failing open.
    pub fn builtin(hook: Hook) -> Self {
        Self {
            hook,
            source: Source::Builtin(hook.as_str().to_string()),
            params: BTreeMap::new(),
            on_error: OnError::FailOpen,
        }
    }
}

/// The registry's configuration.
#[derive(Debug, Clone)]
pub struct Options {
    /// The policy directory (`[policies] dir`), for [`Source::Named`] bindings.
    pub dir: Option<PathBuf>,
    /// Where compiled components are cached; `None` compiles on every load.
    pub cache_dir: Option<PathBuf>,
    /// At most one per hook; a hook without one is bound to its built-in.
    pub bindings: Vec<Binding>,
    /// Wall-clock budget of one decision.
    pub deadline: Duration,
    /// Linear memory one instance may use.
    pub memory_limit_bytes: usize,
    /// The longest retry delay the host accepts from a policy.
    pub max_retry_delay: Duration,
    /// Seeds the `random` import per call (tests); `None` draws from entropy.
    pub seed: Option<u64>,
    /// Idle instances kept per loaded version.
    pub warm_instances: usize,
    /// Where components missing from the cache are compiled.
    pub compiler: Compiler,
}

impl Default for Options {
    fn default() -> Self {
        let runtime = RuntimeOptions::default();
        Self {
            dir: None,
            cache_dir: None,
            bindings: Vec::new(),
            deadline: runtime.deadline,
            memory_limit_bytes: runtime.memory_limit_bytes,
            max_retry_delay: Duration::from_secs(60),
            seed: None,
            warm_instances: runtime.warm_instances,
            compiler: runtime.compiler,
        }
    }
}

/// What a reload did, per binding.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReloadReport {
    pub bindings: Vec<BindingReload>,
    /// Wall-clock time of the whole reload, in milliseconds.
    pub elapsed_ms: f64,
    /// Why the reload as a whole failed (it panicked, say), when it did: nothing was
    /// published, and the policies that were serving still serve.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ReloadReport {
    /// A reload that failed as a whole: nothing was published.
    pub fn failed(error: impl Into<String>, elapsed: Duration) -> Self {
        Self {
            bindings: Vec::new(),
            elapsed_ms: millis_f64(elapsed),
            error: Some(error.into()),
        }
    }

    /// Whether the reload ran and every binding loaded or was already current.
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
            && self
                .bindings
                .iter()
                .all(|b| !matches!(b.outcome, ReloadOutcome::Failed { .. }))
    }

    /// The outcome for `hook`.
    pub fn outcome(&self, hook: Hook) -> Option<&ReloadOutcome> {
        self.bindings
            .iter()
            .find(|b| b.hook == hook)
            .map(|b| &b.outcome)
    }
}

/// What a reload did to one binding.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BindingReload {
    pub hook: Hook,
    pub source: String,
    pub outcome: ReloadOutcome,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReloadOutcome {
    /// A new version was published.
    Loaded {
        version: PolicyVersion,
        from_cache: bool,
        load_ms: f64,
    },
    /// The component and its parameters are those already active.
    Unchanged { version: PolicyVersion },
    /// Nothing was published; `serving` is what keeps deciding.
    Failed {
        error: String,
        serving: Option<PolicyVersion>,
    },
}

/// One binding as `GET /v1/policies` shows it. Counters are cumulative over the
/// binding's versions since the registry started.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BindingStatus {
    pub hook: Hook,
    pub source: String,
    pub on_error: OnError,
    /// The active version; `None` while nothing could be loaded for the binding.
    pub version: Option<PolicyVersion>,
    /// SHA-256 of the active component, hex.
    pub content_hash: Option<String>,
    /// Every hook the active component implements.
    pub implements: Vec<Hook>,
    pub params: BTreeMap<String, String>,
    /// The version it replaced, kept to decide if the active one fails.
    pub previous_version: Option<PolicyVersion>,
    /// Whether the active version's compiled code came from the on-disk cache.
    pub loaded_from_cache: Option<bool>,
    /// Time to compile or deserialize and pre-instantiate the active version.
    pub load_ms: Option<f64>,
    pub size_bytes: Option<usize>,
    /// The last reload's error for this binding, cleared by a successful load.
    pub last_error: Option<String>,
    pub load_errors: u64,
    pub calls: u64,
    pub in_flight: u64,
    pub traps: u64,
    pub timeouts: u64,
    pub memory_exceeded: u64,
    pub invalid_decisions: u64,
    /// Calls decided by something other than the active version.
    pub contained: u64,
    /// Calls given the strict decision because a fail-closed policy failed.
    pub failed_closed: u64,
}

/// The policy registry. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("runtime", &self.inner.runtime)
            .finish_non_exhaustive()
    }
}

struct Inner {
    runtime: Runtime,
    dir: Option<PathBuf>,
    max_retry_delay: Duration,
    builtins: Vec<BuiltinComponent>,
    bindings: Mutex<Vec<Binding>>,
    slots: [Slot; 3],
    reload_lock: Mutex<()>,
    /// Makes the next binding's reload panic (tests).
    #[cfg(test)]
    panic_next: AtomicBool,
}

struct Slot {
    hook: Hook,
    active: ArcSwapOption<Active>,
    /// The hook's built-in with default parameters: what decides when the active
    /// version and the one before it both fail (or when nothing could be loaded).
    builtin: ArcSwapOption<Version>,
    counters: Counters,
    meta: Mutex<Meta>,
}

struct Active {
    current: Arc<Version>,
    previous: Option<Arc<Version>>,
    on_error: OnError,
}

struct Version {
    loaded: Loaded,
    version: PolicyVersion,
    /// Whether a call on it failed through a fault of its own
    /// ([`Fault::is_the_policys`]): such a version is never kept to stand in.
    faulted: AtomicBool,
}

impl Version {
    fn same_as(&self, other: &Version) -> bool {
        self.loaded.content_hash() == other.loaded.content_hash()
            && self.loaded.params() == other.loaded.params()
    }
}

#[derive(Default)]
struct Meta {
    source: Option<Source>,
    on_error: OnError,
    last_error: Option<String>,
}

#[derive(Default)]
struct Counters {
    calls: AtomicU64,
    in_flight: AtomicU64,
    traps: AtomicU64,
    timeouts: AtomicU64,
    memory: AtomicU64,
    invalid: AtomicU64,
    contained: AtomicU64,
    failed_closed: AtomicU64,
    load_errors: AtomicU64,
}

impl Counters {
    fn fault(&self, fault: &Fault) {
        let counter = match fault {
            Fault::Timeout(_) | Fault::InstantiateTimeout(_) => &self.timeouts,
            Fault::MemoryLimit(_) => &self.memory,
            Fault::Invalid(_) => &self.invalid,
            Fault::Trap(_) | Fault::Instantiate(_) | Fault::MissingHook(_) => &self.traps,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

struct InFlight<'a>(&'a AtomicU64);

impl<'a> InFlight<'a> {
    fn enter(counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Registry {
    /// Sets up the engine and loads every binding (startup is a reload from the empty
    /// set: a binding that fails to load is reported in [`Registry::status`] and its
    /// hook is decided by the built-in meanwhile). Blocking.
    pub fn new(options: Options, builtins: Vec<BuiltinComponent>) -> Result<Self, Error> {
        if options.max_retry_delay.is_zero() {
            return Err(Error::Options("max_retry_delay must be above zero".into()));
        }
        check_bindings(&options.bindings, options.dir.as_ref(), &builtins)?;
        let runtime = Runtime::new(RuntimeOptions {
            cache_dir: options.cache_dir,
            deadline: options.deadline,
            memory_limit_bytes: options.memory_limit_bytes,
            seed: options.seed,
            warm_instances: options.warm_instances,
            compiler: options.compiler,
        })?;
        let slot = |hook| Slot {
            hook,
            active: ArcSwapOption::empty(),
            builtin: ArcSwapOption::empty(),
            counters: Counters::default(),
            meta: Mutex::new(Meta::default()),
        };
        let registry = Self {
            inner: Arc::new(Inner {
                runtime,
                dir: options.dir,
                max_retry_delay: options.max_retry_delay,
                builtins,
                bindings: Mutex::new(options.bindings),
                slots: [slot(Hook::Retry), slot(Hook::Fallback), slot(Hook::Budget)],
                reload_lock: Mutex::new(()),
                #[cfg(test)]
                panic_next: AtomicBool::new(false),
            }),
        };
        let report = registry.reload();
        if !report.is_ok() {
            tracing::warn!(?report, "some policies failed to load at startup");
        }
        Ok(registry)
    }

    /// The engine underneath (shared with the test kit and the benchmark).
    pub fn runtime(&self) -> &Runtime {
        &self.inner.runtime
    }

    /// Replaces the bindings (after a config change) and reloads.
    pub fn reconfigure(&self, bindings: Vec<Binding>) -> Result<ReloadReport, Error> {
        check_bindings(&bindings, self.inner.dir.as_ref(), &self.inner.builtins)?;
        *lock(&self.inner.bindings) = bindings;
        Ok(self.reload())
    }

    /// Re-reads every binding's component and publishes the ones that changed, after
    /// compiling (or loading from the cache), checking and smoke-testing them.
    /// Blocking (milliseconds from the cache, seconds to compile a large component):
    /// call it off the async threads. Concurrent reloads run one after the other.
    pub fn reload(&self) -> ReloadReport {
        let started = Instant::now();
        let _serialized = lock(&self.inner.reload_lock);
        self.load_builtins();
        let configured = lock(&self.inner.bindings).clone();
        let bindings: Vec<Binding> = Hook::ALL
            .into_iter()
            .map(|hook| {
                configured
                    .iter()
                    .find(|b| b.hook == hook)
                    .cloned()
                    .unwrap_or_else(|| Binding::builtin(hook))
            })
            .collect();
        let reports = bindings.iter().map(|b| self.reload_binding(b)).collect();
        ReloadReport {
            bindings: reports,
            elapsed_ms: millis_f64(started.elapsed()),
            error: None,
        }
    }

    fn load_builtins(&self) {
        for slot in &self.inner.slots {
            if slot.builtin.load().is_some() {
                continue;
            }
            let Some(builtin) = self
                .inner
                .builtins
                .iter()
                .find(|b| b.name == slot.hook.as_str())
            else {
                continue;
            };
            let params = self.params_for(Some(builtin.name), &BTreeMap::new());
            match self.load_version(slot.hook, builtin.bytes, &params) {
                Ok(version) => slot.builtin.store(Some(Arc::new(version))),
                Err(error) => {
                    tracing::error!(hook = %slot.hook, %error, "the built-in policy failed to load");
                }
            }
        }
    }

    fn reload_binding(&self, binding: &Binding) -> BindingReload {
        let slot = &self.inner.slots[binding.hook.index()];
        let source = binding.source.to_string();
        // A panic while loading one binding (in the engine, say) fails that binding
        // like any other load error: its slot is only written once a version passed
        // every check, so what served before keeps serving, and the other bindings
        // are still reloaded.
        let published = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            #[cfg(test)]
            if self.inner.panic_next.swap(false, Ordering::SeqCst) {
                panic!("injected: the reload panicked");
            }
            self.publish(slot, binding)
        }))
        .unwrap_or_else(|panic| {
            Err(Error::Panicked(format!(
                "loading the policy panicked: {}",
                panic_message(panic.as_ref())
            )))
        });
        let outcome = match published {
            Ok(outcome) => {
                let mut meta = lock(&slot.meta);
                meta.last_error = None;
                meta.source = Some(binding.source.clone());
                meta.on_error = binding.on_error;
                outcome
            }
            Err(error) => {
                slot.counters.load_errors.fetch_add(1, Ordering::Relaxed);
                let serving = slot
                    .active
                    .load()
                    .as_ref()
                    .map(|a| a.current.version.clone())
                    .or_else(|| slot.builtin.load().as_ref().map(|b| b.version.clone()));
                tracing::warn!(hook = %binding.hook, %source, %error, ?serving, "policy not loaded; keeping what was serving");
                let mut meta = lock(&slot.meta);
                meta.last_error = Some(error.to_string());
                if slot.active.load().is_none() {
                    meta.source = Some(binding.source.clone());
                    meta.on_error = binding.on_error;
                }
                ReloadOutcome::Failed {
                    error: error.to_string(),
                    serving,
                }
            }
        };
        BindingReload {
            hook: binding.hook,
            source,
            outcome,
        }
    }

    fn publish(&self, slot: &Slot, binding: &Binding) -> Result<ReloadOutcome, Error> {
        let bytes = self.read(&binding.source)?;
        let hash = hex(&Sha256::digest(&bytes));
        let params = match &binding.source {
            Source::Builtin(name) => self.params_for(Some(name), &binding.params),
            Source::Named(_) | Source::Path(_) => self.params_for(None, &binding.params),
        };
        let active = slot.active.load_full();
        if let Some(active) = &active
            && active.current.loaded.content_hash() == hash
            && active.current.loaded.params() == &params
        {
            if active.on_error != binding.on_error {
                slot.active.store(Some(Arc::new(Active {
                    current: Arc::clone(&active.current),
                    previous: active.previous.clone(),
                    on_error: binding.on_error,
                })));
            }
            return Ok(ReloadOutcome::Unchanged {
                version: active.current.version.clone(),
            });
        }
        // The built-in bound with default parameters is the containment instance
        // already loaded; share it rather than compiling it twice.
        let builtin = slot
            .builtin
            .load_full()
            .filter(|b| b.loaded.content_hash() == hash && b.loaded.params() == &params);
        let (version, outcome) = match builtin {
            Some(version) => {
                let outcome = ReloadOutcome::Loaded {
                    version: version.version.clone(),
                    from_cache: version.loaded.from_cache(),
                    load_ms: millis_f64(version.loaded.load_time()),
                };
                (version, outcome)
            }
            None => {
                let version = self.load_version(binding.hook, &bytes, &params)?;
                let outcome = ReloadOutcome::Loaded {
                    version: version.version.clone(),
                    from_cache: version.loaded.from_cache(),
                    load_ms: millis_f64(version.loaded.load_time()),
                };
                (Arc::new(version), outcome)
            }
        };
        // The stand-in is the last good version: not one that failed while it
        // served (after a revert, the version reverted from), nor the new one again.
        let previous = active.and_then(|a| {
            [Some(&a.current), a.previous.as_ref()]
                .into_iter()
                .flatten()
                .find(|v| !v.faulted.load(Ordering::Relaxed) && !v.same_as(&version))
                .cloned()
        });
        slot.active.store(Some(Arc::new(Active {
            current: version,
            previous,
            on_error: binding.on_error,
        })));
        tracing::info!(hook = %binding.hook, source = %binding.source, ?outcome, "policy published");
        Ok(outcome)
    }

    /// The parameters a component is loaded with: the binding's, and for the retry
    /// built-in (`builtin` names the built-in, if it is one) the host's longest
    /// retry delay as well ([`MAX_RETRY_DELAY_PARAM`]).
    fn params_for(
        &self,
        builtin: Option<&str>,
        configured: &BTreeMap<String, String>,
    ) -> BTreeMap<String, String> {
        let mut params = configured.clone();
        if builtin == Some(Hook::Retry.as_str()) {
            params.insert(
                MAX_RETRY_DELAY_PARAM.to_string(),
                self.inner.max_retry_delay.as_millis().to_string(),
            );
        }
        params
    }

    /// Loads, checks the hook and smoke-tests one component.
    fn load_version(
        &self,
        hook: Hook,
        bytes: &[u8],
        params: &BTreeMap<String, String>,
    ) -> Result<Version, Error> {
        let hash = hex(&Sha256::digest(bytes));
        let version = PolicyVersion::new(hook.as_str(), &hash);
        let loaded = self
            .inner
            .runtime
            .load(bytes, params.clone(), version.as_str())?;
        if !loaded.implements(hook) {
            let found = if loaded.hooks().is_empty() {
                "no policy hook".to_string()
            } else {
                let names: Vec<&str> = loaded.hooks().iter().map(|h| h.as_str()).collect();
                names.join(", ")
            };
            return Err(Error::WrongWorld {
                wanted: hook,
                found,
            });
        }
        loaded.warm_up().map_err(Error::SmokeTest)?;
        smoke_test(&loaded, hook, self.inner.max_retry_delay).map_err(Error::SmokeTest)?;
        Ok(Version {
            loaded,
            version,
            faulted: AtomicBool::new(false),
        })
    }

    fn read(&self, source: &Source) -> Result<Vec<u8>, Error> {
        let path = match source {
            Source::Builtin(name) => {
                return self
                    .inner
                    .builtins
                    .iter()
                    .find(|b| b.name == name)
                    .map(|b| b.bytes.to_vec())
                    .ok_or_else(|| Error::Options(format!("no built-in policy named {name:?}")));
            }
            Source::Named(stem) => match &self.inner.dir {
                Some(dir) => dir.join(format!("{stem}.wasm")),
                None => {
                    return Err(Error::Options(format!(
                        "policy {stem:?} is named but no policy directory is configured"
                    )));
                }
            },
            Source::Path(path) => path.clone(),
        };
        std::fs::read(&path).map_err(|e| Error::Read {
            path,
            message: e.to_string(),
        })
    }

    /// Decides what to do after `failure` ended attempt `ctx.attempt`.
    pub fn retry(&self, ctx: &CallContext, failure: &Failure) -> Decided<RetryDecision> {
        let max_delay = self.inner.max_retry_delay;
        self.decide(
            Hook::Retry,
            |loaded| {
                let decision = loaded.retry(ctx, failure)?;
                validate::retry(ctx, failure, &decision, max_delay).map_err(Fault::Invalid)?;
                Ok(decision)
            },
            RetryDecision::GiveUp,
            || RetryDecision::GiveUp("no retry policy could decide".into()),
        )
    }

    /// Orders the candidate targets of a call, as indices into its candidates;
    /// candidates left out are not tried.
    pub fn fallback(&self, request: &FallbackRequest) -> Decided<Vec<usize>> {
        self.decide(
            Hook::Fallback,
            |loaded| {
                let order = loaded.fallback(request)?;
                validate::fallback(request, &order).map_err(Fault::Invalid)?;
                Ok(order)
            },
            |_| configured_order(request),
            || configured_order(request),
        )
    }

    /// Admits, rejects or downgrades a call under its task's budget.
    pub fn budget(&self, request: &BudgetRequest) -> Decided<BudgetDecision> {
        self.decide(
            Hook::Budget,
            |loaded| {
                let decision = loaded.budget(request)?;
                validate::budget(request, &decision).map_err(Fault::Invalid)?;
                Ok(decision)
            },
            BudgetDecision::Reject,
            || hard_limit(request),
        )
    }

    fn decide<T>(
        &self,
        hook: Hook,
        ask: impl Fn(&Loaded) -> Result<T, Fault>,
        strict: impl FnOnce(String) -> T,
        default: impl FnOnce() -> T,
    ) -> Decided<T> {
        let slot = &self.inner.slots[hook.index()];
        slot.counters.calls.fetch_add(1, Ordering::Relaxed);
        let _in_flight = InFlight::enter(&slot.counters.in_flight);
        // Guards, not clones: no reference count moves on the common path. The
        // built-in is looked at only when it must stand in.
        let active = slot.active.load();
        let Some(active) = active.as_deref() else {
            // Nothing could be loaded for this binding. Failing closed, that is the
            // strict decision, as for a policy that fails; else the built-in
            // stands in.
            if lock(&slot.meta).on_error == OnError::FailClosed {
                slot.counters.failed_closed.fetch_add(1, Ordering::Relaxed);
                let reason = format!(
                    "no version of the {hook} policy is loaded (see GET /v1/policies); failing closed"
                );
                return Decided {
                    value: strict(reason),
                    version: PolicyVersion::host_default(hook.as_str()),
                    source: DecisionSource::Contained,
                };
            }
            if let Some(builtin) = slot.builtin.load().as_deref()
                && let Ok(value) = ask(&builtin.loaded)
            {
                slot.counters.contained.fetch_add(1, Ordering::Relaxed);
                return decided(value, &builtin.version, DecisionSource::Contained);
            }
            return Decided {
                value: default(),
                version: PolicyVersion::host_default(hook.as_str()),
                source: DecisionSource::HostDefault,
            };
        };
        let fault = match ask(&active.current.loaded) {
            Ok(value) => return decided(value, &active.current.version, DecisionSource::Policy),
            Err(fault) => fault,
        };
        slot.counters.fault(&fault);
        if fault.is_the_policys() {
            active.current.faulted.store(true, Ordering::Relaxed);
        }
        let failed = &active.current.version;
        tracing::warn!(%hook, version = %failed, kind = fault.kind(), %fault, "policy failed; decision contained");
        if active.on_error == OnError::FailClosed {
            slot.counters.failed_closed.fetch_add(1, Ordering::Relaxed);
            let reason = format!("policy {failed} failed ({fault}); failing closed");
            return decided(strict(reason), failed, DecisionSource::Contained);
        }
        slot.counters.contained.fetch_add(1, Ordering::Relaxed);
        let builtin = slot.builtin.load_full();
        let stand_ins = active.previous.iter().chain(
            builtin
                .iter()
                .filter(|b| b.loaded.content_hash() != active.current.loaded.content_hash()),
        );
        for stand_in in stand_ins {
            match ask(&stand_in.loaded) {
                Ok(value) => return decided(value, &stand_in.version, DecisionSource::Contained),
                Err(fault) => {
                    if fault.is_the_policys() {
                        stand_in.faulted.store(true, Ordering::Relaxed);
                    }
                    tracing::warn!(%hook, version = %stand_in.version, %fault, "stand-in policy failed too");
                }
            }
        }
        Decided {
            value: default(),
            version: PolicyVersion::host_default(hook.as_str()),
            source: DecisionSource::Contained,
        }
    }

    /// The active version of every bound hook, in hook order: what journal records
    /// name as the policies in force. Cheap (no locks), called once per journaled call.
    pub fn versions(&self) -> Vec<PolicyVersion> {
        self.inner
            .slots
            .iter()
            .filter_map(|slot| {
                slot.active
                    .load()
                    .as_ref()
                    .map(|a| a.current.version.clone())
            })
            .collect()
    }

    /// Every binding's version, hooks, load errors and counters.
    pub fn status(&self) -> Vec<BindingStatus> {
        self.inner
            .slots
            .iter()
            .map(|slot| {
                let active = slot.active.load_full();
                let current = active.as_ref().map(|a| &a.current);
                let meta = lock(&slot.meta);
                let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
                let c = &slot.counters;
                BindingStatus {
                    hook: slot.hook,
                    source: meta
                        .source
                        .as_ref()
                        .map_or_else(|| "none".to_string(), ToString::to_string),
                    on_error: active.as_ref().map_or(meta.on_error, |a| a.on_error),
                    version: current.map(|v| v.version.clone()),
                    content_hash: current.map(|v| v.loaded.content_hash().to_string()),
                    implements: current
                        .map(|v| v.loaded.hooks().to_vec())
                        .unwrap_or_default(),
                    params: current
                        .map(|v| v.loaded.params().clone())
                        .unwrap_or_default(),
                    previous_version: active
                        .as_ref()
                        .and_then(|a| a.previous.as_ref())
                        .map(|p| p.version.clone()),
                    loaded_from_cache: current.map(|v| v.loaded.from_cache()),
                    load_ms: current.map(|v| millis_f64(v.loaded.load_time())),
                    size_bytes: current.map(|v| v.loaded.size()),
                    last_error: meta.last_error.clone(),
                    load_errors: count(&c.load_errors),
                    calls: count(&c.calls),
                    in_flight: count(&c.in_flight),
                    traps: count(&c.traps),
                    timeouts: count(&c.timeouts),
                    memory_exceeded: count(&c.memory),
                    invalid_decisions: count(&c.invalid),
                    contained: count(&c.contained),
                    failed_closed: count(&c.failed_closed),
                }
            })
            .collect()
    }

    /// The status of one hook's binding.
    pub fn binding_status(&self, hook: Hook) -> Option<BindingStatus> {
        self.status().into_iter().find(|s| s.hook == hook)
    }
}

/// The message a panic was raised with, if it was raised with one.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

fn decided<T>(value: T, version: &PolicyVersion, source: DecisionSource) -> Decided<T> {
    Decided {
        value,
        version: version.clone(),
        source,
    }
}

fn millis_f64(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

fn check_bindings(
    bindings: &[Binding],
    dir: Option<&PathBuf>,
    builtins: &[BuiltinComponent],
) -> Result<(), Error> {
    let mut problems = Vec::new();
    for hook in Hook::ALL {
        if bindings.iter().filter(|b| b.hook == hook).count() > 1 {
            problems.push(format!("the {hook} hook is bound more than once"));
        }
    }
    for binding in bindings {
        match &binding.source {
            Source::Builtin(name) if !builtins.iter().any(|b| b.name == name) => {
                problems.push(format!(
                    "{}: no built-in policy named {name:?}",
                    binding.hook
                ));
            }
            Source::Named(stem) if dir.is_none() => {
                problems.push(format!(
                    "{}: policy {stem:?} is named but no policy directory is configured",
                    binding.hook
                ));
            }
            Source::Named(stem) if stem.contains(['/', '\\']) || stem.starts_with('.') => {
                problems.push(format!(
                    "{}: policy name {stem:?} must be a file stem inside the policy directory",
                    binding.hook
                ));
            }
            Source::Builtin(_) | Source::Named(_) | Source::Path(_) => {}
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Options(problems.join("; ")))
    }
}

/// The candidates in configured order, each once: the fallback decision when no
/// policy can decide, and the strict one.
fn configured_order(request: &FallbackRequest) -> Vec<usize> {
    let candidates = &request.candidates;
    (0..candidates.len())
        .filter(|&i| !candidates[..i].iter().any(|c| c.name == candidates[i].name))
        .collect()
}

/// The budget decision when no policy can decide: reject only what the limits
/// forbid outright.
fn hard_limit(request: &BudgetRequest) -> BudgetDecision {
    let call = Usage {
        tokens_in: request.estimated_tokens_in,
        tokens_out: request.estimated_tokens_out,
        cost_micros: request.estimated_cost_micros,
        wall_clock_ms: 0,
        calls: 1,
        retries: 0,
    };
    match request.limits.exceeded_by(&request.usage.plus(&call)) {
        Some(limit) => BudgetDecision::Reject(format!("{limit} limit reached")),
        None => BudgetDecision::Admit,
    }
}

/// One call of the smoke test, called again once if it runs past its deadline. On
/// a busy machine a new instance's first call can: its memory is touched for the
/// first time, an interpreter's guest compiles what it runs. A component that
/// overruns twice (one that loops, or is slow on every call) fails the test.
fn smoke_call<T>(call: impl Fn() -> Result<T, Fault>) -> Result<T, Fault> {
    match call() {
        Err(Fault::Timeout(deadline)) => {
            tracing::debug!(
                ?deadline,
                "a smoke-test call ran past its deadline; calling again once"
            );
            call()
        }
        other => other,
    }
}

/// Calls `hook` with canned inputs and checks the answers: a component that traps,
/// loops or answers nonsense on ordinary input is never published.
fn smoke_test(loaded: &Loaded, hook: Hook, max_delay: Duration) -> Result<(), Fault> {
    match hook {
        Hook::Retry => {
            let ctx = CallContext {
                task_id: Some("smoke-test".into()),
                request_id: "smoke-test".into(),
                kind: CallKind::Model,
                target: "smoke-primary".into(),
                model: Some("smoke-model".into()),
                tool_class: None,
                attempt: 1,
                elapsed: Duration::from_millis(5),
                dispatched: true,
                history: Vec::new(),
                retry_budget: RetryBudget::default(),
                fallbacks: vec!["smoke-fallback".into()],
            };
            for failure in [
                Failure::ServerError { status: 503 },
                Failure::RateLimited {
                    retry_after: Some(Duration::from_secs(1)),
                },
            ] {
                let decision = smoke_call(|| loaded.retry(&ctx, &failure))?;
                validate::retry(&ctx, &failure, &decision, max_delay).map_err(Fault::Invalid)?;
            }
        }
        Hook::Fallback => {
            let candidate = |name: &str| Candidate {
                name: name.into(),
                supports_tools: true,
                supports_streaming: true,
                context_window: 128_000,
                modalities: Modalities::TEXT,
                circuit: CircuitState::Closed,
                local: false,
                gpu: None,
                cost_per_mtok_in: 1_000_000,
                cost_per_mtok_out: 2_000_000,
            };
            let request = FallbackRequest {
                task_id: Some("smoke-test".into()),
                request_id: "smoke-test".into(),
                model: "smoke-model".into(),
                needs_tools: false,
                streaming: true,
                estimated_tokens: 1_000,
                modalities: Modalities::TEXT,
                candidates: vec![candidate("smoke-a"), candidate("smoke-b")],
            };
            let order = smoke_call(|| loaded.fallback(&request))?;
            validate::fallback(&request, &order).map_err(Fault::Invalid)?;
        }
        Hook::Budget => {
            let request = BudgetRequest {
                task_id: Some("smoke-test".into()),
                request_id: "smoke-test".into(),
                model: "smoke-model".into(),
                estimated_tokens_in: 1_000,
                estimated_tokens_out: 500,
                estimated_cost_micros: 2_000,
                usage: Usage::default(),
                limits: Limits {
                    cost_micros: Some(1_000_000),
                    ..Limits::default()
                },
                downgrades: vec![DowngradeOption {
                    model: "smoke-small".into(),
                    cost_per_mtok_in: 100_000,
                    cost_per_mtok_out: 200_000,
                }],
            };
            let decision = smoke_call(|| loaded.budget(&request))?;
            validate::budget(&request, &decision).map_err(Fault::Invalid)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtins() -> Vec<BuiltinComponent> {
        outrigger_builtins::ALL
            .iter()
            .map(|b| BuiltinComponent {
                name: b.name,
                bytes: b.bytes,
            })
            .collect()
    }

    /// A smoke-test call that runs past its deadline is called once more: one
    /// overrun passes, two fail, and any other fault fails at once.
    #[test]
    fn a_smoke_test_call_gets_one_more_try_after_an_overrun() {
        let deadline = Duration::from_millis(20);
        let calls = std::cell::Cell::new(0);
        let once = smoke_call(|| {
            calls.set(calls.get() + 1);
            if calls.get() == 1 {
                Err(Fault::Timeout(deadline))
            } else {
                Ok(7)
            }
        });
        assert_eq!((once, calls.get()), (Ok(7), 2));
        calls.set(0);
        let always = smoke_call(|| {
            calls.set(calls.get() + 1);
            Err::<(), _>(Fault::Timeout(deadline))
        });
        assert_eq!((always, calls.get()), (Err(Fault::Timeout(deadline)), 2));
        calls.set(0);
        let trap = smoke_call(|| {
            calls.set(calls.get() + 1);
            Err::<(), _>(Fault::Trap("boom".into()))
        });
        assert_eq!((trap, calls.get()), (Err(Fault::Trap("boom".into())), 1));
    }

    /// A binding whose load panics fails like any other, with the panic's message;
    /// the version serving before keeps serving, the other bindings are reloaded,
    /// and the next reload runs as usual.
    #[test]
    fn a_binding_whose_load_panics_fails_and_the_old_version_serves_on() {
        let registry =
            Registry::new(Options::default(), builtins()).unwrap_or_else(|e| panic!("{e}"));
        let before = registry.versions();
        assert_eq!(before.len(), 3, "{before:?}");
        // Make the retry binding change (new parameters), so a reload would swap it.
        let mut retry = Binding::builtin(Hook::Retry);
        retry.params.insert("max_attempts".into(), "2".into());
        *lock(&registry.inner.bindings) = vec![retry];
        registry.inner.panic_next.store(true, Ordering::SeqCst);
        let report = registry.reload();
        assert!(!report.is_ok(), "{report:?}");
        match report.outcome(Hook::Retry) {
            Some(ReloadOutcome::Failed { error, serving }) => {
                assert!(error.contains("panicked: injected"), "{error}");
                assert_eq!(serving.as_ref(), Some(&before[0]));
            }
            other => panic!("expected the retry binding to fail: {other:?}"),
        }
        for hook in [Hook::Fallback, Hook::Budget] {
            assert!(
                matches!(report.outcome(hook), Some(ReloadOutcome::Unchanged { .. })),
                "{report:?}"
            );
        }
        assert_eq!(registry.versions(), before, "nothing was published");
        let status = registry
            .binding_status(Hook::Retry)
            .unwrap_or_else(|| panic!("status"));
        assert!(
            status
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("panicked")),
            "{status:?}"
        );
        assert_eq!(status.load_errors, 1);
        // Decisions still come from the version that served before.
        let decided = registry.retry(
            &CallContext {
                task_id: None,
                request_id: "r".into(),
                kind: CallKind::Model,
                target: "t".into(),
                model: None,
                tool_class: None,
                attempt: 1,
                elapsed: Duration::from_millis(1),
                dispatched: true,
                history: Vec::new(),
                retry_budget: RetryBudget::default(),
                fallbacks: Vec::new(),
            },
            &Failure::ServerError { status: 503 },
        );
        assert_eq!(decided.version, before[0]);
        assert_eq!(decided.source, DecisionSource::Policy);
        // The next reload publishes the change.
        let report = registry.reload();
        assert!(report.is_ok(), "{report:?}");
        assert!(matches!(
            report.outcome(Hook::Retry),
            Some(ReloadOutcome::Loaded { .. })
        ));
        let status = registry
            .binding_status(Hook::Retry)
            .unwrap_or_else(|| panic!("status"));
        assert_eq!(
            status.params.get("max_attempts").map(String::as_str),
            Some("2")
        );
        assert_eq!(status.last_error, None);
    }
}
