//! The engine room: one wasmtime `Engine` and `Linker` per process, the on-disk cache
//! of compiled components, and [`Loaded`] — a compiled, pre-instantiated component
//! with its pool of warm instances.
//!
//! A decision runs on a warm instance taken from the pool (instantiating one when the
//! pool is empty), under an epoch deadline and a per-instance memory cap. An instance
//! goes back to the pool only after a call that returned normally: a trap leaves
//! wasm state undefined, so a trapped instance is dropped; so is one that holds more
//! than [`MAX_POOLED_RESOURCES`] host resources (handles its guest took and never
//! dropped), which would otherwise grow the host's memory call after call.

use std::collections::{BTreeMap, VecDeque};
use std::hash::Hasher;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use rand::{Rng, RngCore, SeedableRng};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, InstancePre, Linker, ResourceTable};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::bindings::{self, budget, fallback, host, retry, types};
use crate::compiler::{ChildOutcome, Compiler, compile_in_child};
use crate::{Error, convert};

/// How often the epoch ticker advances the epoch; a deadline is a whole number of ticks.
pub const TICK: Duration = Duration::from_millis(1);

/// Ticks the epoch keeps advancing after the last guest call returned, before the
/// ticker parks: a steady stream of decisions never waits for it to wake.
const IDLE_TICKS: u32 = 100;

/// How often a parked ticker looks whether its runtime is gone.
const PARKED_RECHECK: Duration = Duration::from_secs(1);

/// The least time each instance of a component made when it is loaded (see
/// [`Loaded::warm_up`]) gets to instantiate: a loaded machine must not refuse a component whose start-up is slower than
/// one decision's deadline (a Python one copies tens of MB of initialised memory).
pub const LOAD_INSTANTIATE_DEADLINE: Duration = Duration::from_secs(1);

/// How much of what a guest writes to stderr is kept (the end of it) to go with a
/// trap: a Rust guest's panic message, for one.
pub const STDERR_TAIL_BYTES: usize = 4 << 10;

/// Host resources (WASI streams, sockets…) an idle instance may hold in its table
/// and still go back to the pool. A guest that takes handles and never drops them
/// grows the host's memory, not its own, so no memory cap would catch it: its
/// instance is retired instead, and a fresh one starts with an empty table.
pub const MAX_POOLED_RESOURCES: usize = 64;

/// Host resources one instance may hold at once; taking more traps.
const MAX_RESOURCES: usize = 4_096;

/// The longest log line a policy may write; the rest is cut.
const MAX_LOG_LINE: usize = 1_000;

/// The most log lines one policy call may write; the rest of the call's are dropped
/// (a guest logging in a loop must not flood the sidecar's log).
pub const MAX_LOG_LINES_PER_CALL: u32 = 16;

/// A policy hook (a WIT interface a component may export).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Hook {
    Retry,
    Fallback,
    Budget,
}

impl Hook {
    pub const ALL: [Hook; 3] = [Hook::Retry, Hook::Fallback, Hook::Budget];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Fallback => "fallback",
            Self::Budget => "budget",
        }
    }

    /// The WIT interface name without its version (`outrigger:policy/retry`).
    pub fn interface(self) -> &'static str {
        match self {
            Self::Retry => "outrigger:policy/retry",
            Self::Fallback => "outrigger:policy/fallback",
            Self::Budget => "outrigger:policy/budget",
        }
    }

    /// The fully qualified export name this host looks for.
    pub fn export_name(self) -> String {
        format!("{}@{}", self.interface(), crate::WIT_PACKAGE_VERSION)
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Self::Retry => 0,
            Self::Fallback => 1,
            Self::Budget => 2,
        }
    }
}

impl std::fmt::Display for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Engine-wide settings.
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// Where compiled components are cached; `None` compiles on every load.
    pub cache_dir: Option<PathBuf>,
    /// Wall-clock budget of one decision (and of an instantiation on a call's path;
    /// those made at load get at least [`LOAD_INSTANTIATE_DEADLINE`]).
    pub deadline: Duration,
    /// Linear memory one instance may use, over all its memories.
    pub memory_limit_bytes: usize,
    /// Seeds the `random` import per call, so one input always gets one decision.
    pub seed: Option<u64>,
    /// Idle instances kept per loaded component.
    pub warm_instances: usize,
    /// Where components missing from the cache are compiled.
    pub compiler: Compiler,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            cache_dir: None,
            deadline: Duration::from_millis(20),
            memory_limit_bytes: 64 << 20,
            seed: None,
            warm_instances: 4,
            compiler: Compiler::InProcess,
        }
    }
}

/// Why a call into a policy did not produce an accepted decision.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Fault {
    #[error("trapped: {0}")]
    Trap(String),
    #[error("ran past its {0:?} deadline")]
    Timeout(Duration),
    #[error("exceeded its memory limit of {0} bytes")]
    MemoryLimit(usize),
    #[error("could not be instantiated: {0}")]
    Instantiate(String),
    /// A new instance, made on a call's path because every warm one was busy, ran
    /// past the call's deadline while it started: the machine's load, not the
    /// policy's fault (it started within [`LOAD_INSTANTIATE_DEADLINE`] at load).
    #[error("ran past its {0:?} deadline while a new instance started (every warm one was busy)")]
    InstantiateTimeout(Duration),
    #[error("does not implement the {0} hook")]
    MissingHook(Hook),
    #[error("returned an invalid decision: {0}")]
    Invalid(String),
}

impl Fault {
    /// Whether the fault says something about the policy version, which then is not
    /// kept to stand in for another: every fault but a new instance that could not
    /// start within a call's deadline because the machine was busy.
    pub fn is_the_policys(&self) -> bool {
        !matches!(self, Self::InstantiateTimeout(_))
    }

    /// A short stable name, for metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Trap(_) => "trap",
            Self::Timeout(_) | Self::InstantiateTimeout(_) => "timeout",
            Self::MemoryLimit(_) => "memory",
            Self::Instantiate(_) => "instantiate",
            Self::MissingHook(_) => "missing_hook",
            Self::Invalid(_) => "invalid",
        }
    }
}

/// One process's policy engine. Cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<RuntimeInner>,
}

struct RuntimeInner {
    engine: Engine,
    linker: Linker<State>,
    options: RuntimeOptions,
    /// Hex digest of the engine's compatibility hash: part of every cache key, so an
    /// artifact compiled by another wasmtime or another configuration is never loaded.
    compat: String,
    origin: Instant,
    pooling: bool,
    clock: Arc<Clock>,
    /// Components compiled (rather than loaded from the cache) so far.
    compilations: AtomicU64,
    /// Of those, the ones compiled on this process's threads.
    compiled_in_process: AtomicU64,
}

/// The epoch clock shared by the ticker and the calls. It advances only while
/// guest code runs (and for [`IDLE_TICKS`] after), so an idle sidecar does not
/// wake a thousand times a second: deadlines are counted in ticks of guest time.
#[derive(Debug, Default)]
struct Clock {
    /// Ticks so far.
    ticks: AtomicU64,
    /// Guest calls in progress.
    running: AtomicUsize,
    /// The ticker parked (or is about to): a call that starts must wake it.
    parked: AtomicBool,
    ticker: Mutex<Option<std::thread::Thread>>,
}

impl Clock {
    /// Marks a guest call in progress until the guard drops, waking the ticker.
    fn enter(&self) -> Running<'_> {
        // SeqCst pairs with the ticker's: either it sees this call before parking,
        // or this call sees it parked and wakes it.
        self.running.fetch_add(1, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst)
            && let Some(ticker) = self
                .ticker
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
        {
            ticker.unpark();
        }
        Running(self)
    }
}

struct Running<'a>(&'a Clock);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("options", &self.inner.options)
            .field("pooling", &self.inner.pooling)
            .finish_non_exhaustive()
    }
}

impl Runtime {
    pub fn new(options: RuntimeOptions) -> Result<Self, Error> {
        if options.deadline.is_zero() {
            return Err(Error::Options("deadline must be above zero".into()));
        }
        let (engine, pooling) = match Engine::new(&config(options.memory_limit_bytes, true)) {
            Ok(engine) => (engine, true),
            Err(pooled) => {
                // The pooling allocator reserves virtual memory up front; where that
                // is refused (a tight `ulimit -v`), allocate on demand instead.
                tracing::warn!(error = %format!("{pooled:#}"), "pooling allocator unavailable; allocating instances on demand");
                let engine = Engine::new(&config(options.memory_limit_bytes, false))
                    .map_err(|e| Error::Engine(format!("{e:#}")))?;
                (engine, false)
            }
        };
        let mut linker = Linker::new(&engine);
        // Guests built with a language's standard library (Rust std, Python, JS)
        // import WASI; they link, but the context grants nothing (see `State::new`).
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(|e| Error::Engine(format!("{e:#}")))?;
        bindings::Policy::add_to_linker::<State, HasSelf<State>>(&mut linker, |state| state)
            .map_err(|e| Error::Engine(format!("{e:#}")))?;
        let compat = {
            let mut hasher = Sha256Hasher(Sha256::new());
            std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut hasher);
            hex(&hasher.0.finalize()[..8])
        };
        if let Some(dir) = &options.cache_dir {
            std::fs::create_dir_all(dir).map_err(|e| Error::Cache {
                path: dir.clone(),
                message: e.to_string(),
            })?;
        }
        let runtime = Self {
            inner: Arc::new(RuntimeInner {
                engine,
                linker,
                options,
                compat,
                origin: Instant::now(),
                pooling,
                clock: Arc::new(Clock::default()),
                compilations: AtomicU64::new(0),
                compiled_in_process: AtomicU64::new(0),
            }),
        };
        // Deadlines are counted in epoch ticks: without the ticker, a guest that
        // never returns would hold its caller forever, the first smoke tests of a
        // registry included. It ends on its own once the runtime is dropped.
        let ticker = Ticker {
            engine: runtime.inner.engine.clone(),
            runtime: Arc::downgrade(&runtime.inner),
            clock: Arc::clone(&runtime.inner.clock),
        };
        std::thread::Builder::new()
            .name("policy-epoch".into())
            .spawn(move || ticker.run())
            .map_err(|e| Error::Engine(format!("cannot start the epoch ticker: {e}")))?;
        Ok(runtime)
    }

    pub fn options(&self) -> &RuntimeOptions {
        &self.inner.options
    }

    /// Whether instances come from the pooling allocator (false where the machine
    /// refused its address-space reservation).
    pub fn pooling(&self) -> bool {
        self.inner.pooling
    }

    /// How many times a [`Ticker`] has advanced the epoch. It advances only while
    /// guest code runs and shortly after.
    pub fn ticks(&self) -> u64 {
        self.inner.clock.ticks.load(Ordering::Relaxed)
    }

    /// Compiles (or loads from the cache) and pre-instantiates a component, and
    /// detects which hooks it exports. Blocking; run it off the async threads.
    /// `label` names it in logs (the policy version, usually).
    pub fn load(
        &self,
        bytes: &[u8],
        params: BTreeMap<String, String>,
        label: &str,
    ) -> Result<Loaded, Error> {
        let started = Instant::now();
        let content_hash = hex(&Sha256::digest(bytes));
        let (component, from_cache) = self.component(bytes, &content_hash)?;
        let engine = &self.inner.engine;
        let exports: Vec<String> = component
            .component_type()
            .exports(engine)
            .map(|(name, _)| name.to_string())
            .collect();
        let pre = self
            .inner
            .linker
            .instantiate_pre(&component)
            .map_err(|e| Error::Link(format!("{e:#}")))?;
        let mut hooks = Vec::new();
        let retry = match pre
            .component()
            .get_export_index(None, Hook::Retry.export_name())
        {
            Some(_) => {
                hooks.push(Hook::Retry);
                Some(retry::GuestIndices::new(&pre).map_err(|e| Error::Link(format!("{e:#}")))?)
            }
            None => None,
        };
        let fallback = match pre
            .component()
            .get_export_index(None, Hook::Fallback.export_name())
        {
            Some(_) => {
                hooks.push(Hook::Fallback);
                Some(fallback::GuestIndices::new(&pre).map_err(|e| Error::Link(format!("{e:#}")))?)
            }
            None => None,
        };
        let budget = match pre
            .component()
            .get_export_index(None, Hook::Budget.export_name())
        {
            Some(_) => {
                hooks.push(Hook::Budget);
                Some(budget::GuestIndices::new(&pre).map_err(|e| Error::Link(format!("{e:#}")))?)
            }
            None => None,
        };
        Ok(Loaded {
            inner: Arc::new(LoadedInner {
                runtime: self.clone(),
                pre,
                indices: Indices {
                    retry,
                    fallback,
                    budget,
                },
                hooks,
                exports,
                content_hash,
                params: Arc::new(params),
                label: Arc::from(label),
                from_cache,
                load_time: started.elapsed(),
                size: bytes.len(),
                warm: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Components compiled so far, here or in a child (cache misses and runtimes
    /// without a cache, failed compilations included).
    pub fn compilations(&self) -> u64 {
        self.inner.compilations.load(Ordering::Relaxed)
    }

    /// Of [`Runtime::compilations`], those compiled on this process's threads (see
    /// [`Compiler`]). Compiling here is what makes the process's memory grow, so a
    /// caller may want to release the compiler's garbage after it.
    pub fn compiled_in_process(&self) -> u64 {
        self.inner.compiled_in_process.load(Ordering::Relaxed)
    }

    /// The compiled component, from the cache when a compatible artifact is there.
    fn component(&self, bytes: &[u8], content_hash: &str) -> Result<(Component, bool), Error> {
        let engine = &self.inner.engine;
        let path = self
            .inner
            .options
            .cache_dir
            .as_ref()
            .map(|dir| dir.join(format!("{content_hash}-{}.cwasm", self.inner.compat)));
        if let Some(path) = path.as_ref().filter(|path| path.is_file()) {
            match deserialize_file(engine, path) {
                Ok(component) => return Ok((component, true)),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cached component unusable; recompiling");
                }
            }
        }
        check_component(bytes)?;
        self.inner.compilations.fetch_add(1, Ordering::Relaxed);
        if let Compiler::Child {
            program,
            args,
            timeout,
        } = &self.inner.options.compiler
        {
            let outcome = compile_in_child(
                program,
                args,
                self.inner.options.memory_limit_bytes,
                self.inner.pooling,
                bytes,
                *timeout,
            );
            match outcome {
                ChildOutcome::Compiled(artifact) => {
                    match self.load_artifact(&artifact, path.as_deref()) {
                        Ok(component) => return Ok((component, false)),
                        Err(e) => {
                            tracing::warn!(error = %e, "the compiler process's artifact was refused; compiling in process")
                        }
                    }
                }
                ChildOutcome::Refused(e) => return Err(e),
                ChildOutcome::Unavailable(why) => {
                    tracing::warn!(%why, "could not compile in a child process; compiling in process");
                }
            }
        }
        self.inner
            .compiled_in_process
            .fetch_add(1, Ordering::Relaxed);
        let component =
            Component::new(engine, bytes).map_err(|e| Error::Compile(format!("{e:#}")))?;
        if let Some(path) = &path {
            match component.serialize() {
                Ok(artifact) => {
                    if let Err(e) = write_atomically(path, &artifact) {
                        tracing::warn!(path = %path.display(), error = %e, "could not cache the compiled component");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "could not serialize the compiled component")
                }
            }
        }
        Ok((component, false))
    }

    /// Loads an artifact a compiler process produced: written to the cache first and
    /// mapped from there (its code then stays in the page cache, not the heap), or
    /// from memory where there is no cache or the write failed.
    fn load_artifact(&self, artifact: &[u8], path: Option<&Path>) -> Result<Component, String> {
        let engine = &self.inner.engine;
        if let Some(path) = path {
            match write_atomically(path, artifact) {
                Ok(()) => {
                    // What this engine refuses must not stay in the cache.
                    return deserialize_file(engine, path).inspect_err(|_| {
                        let _ = std::fs::remove_file(path);
                    });
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "could not cache the compiled component");
                }
            }
        }
        deserialize_bytes(engine, artifact)
    }
}

/// The engine configuration; a compiling child builds its engine from the same two
/// settings, so its artifacts fit this engine.
pub(crate) fn config(memory_limit_bytes: usize, pooling: bool) -> Config {
    let mut config = Config::new();
    config.epoch_interruption(true);
    // Reserve exactly the cap per memory: the pool's slots stay small, and a memory
    // can never outgrow the cap, whatever the limiter says.
    let reservation = u64::try_from(memory_limit_bytes).unwrap_or(u64::MAX);
    config.memory_reservation(reservation);
    config.memory_reservation_for_growth(0);
    if pooling {
        let mut pool = PoolingAllocationConfig::new();
        pool.total_component_instances(256)
            .total_core_instances(1_024)
            .total_memories(256)
            .total_tables(512)
            .total_stacks(256)
            .max_memory_size(memory_limit_bytes)
            // Python and JS components need more than the 1 MiB defaults.
            .max_component_instance_size(4 << 20)
            .max_core_instance_size(4 << 20)
            .max_core_instances_per_component(64)
            .max_memories_per_component(16)
            .max_tables_per_component(32)
            .max_unused_warm_slots(64);
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    }
    config
}

/// Refuses what is not a component before any compiler sees it.
fn check_component(bytes: &[u8]) -> Result<(), Error> {
    if !bytes.starts_with(b"\0asm") {
        return Err(Error::NotWasm);
    }
    if bytes.get(4..8) == Some(&[0x01, 0x00, 0x00, 0x00]) {
        return Err(Error::NotAComponent);
    }
    Ok(())
}

#[expect(
    unsafe_code,
    reason = "deserializing a compiled artifact is unsafe: wasmtime trusts its contents"
)]
fn deserialize_file(engine: &Engine, path: &Path) -> Result<Component, String> {
    // SAFETY: the file is in the sidecar's own cache directory and was written by
    // `Component::serialize` of this process or an earlier one, or comes from the
    // configured compiler (see `deserialize_bytes`), always as temp file + rename,
    // never rewritten in place. Its name carries the engine's compatibility hash,
    // and wasmtime additionally checks version and configuration, returning an
    // error rather than loading a mismatched artifact.
    unsafe { Component::deserialize_file(engine, path) }.map_err(|e| format!("{e:#}"))
}

#[expect(
    unsafe_code,
    reason = "deserializing a compiled artifact is unsafe: wasmtime trusts its contents"
)]
fn deserialize_bytes(engine: &Engine, artifact: &[u8]) -> Result<Component, String> {
    // SAFETY: the bytes are the stdout of the compiler the embedder configured
    // (`Compiler::Child`, whose contract is `compile_child`; the sidecar runs its own
    // binary), read from a pipe only this process holds. wasmtime checks the header,
    // version and configuration and errors on a mismatch.
    unsafe { Component::deserialize(engine, artifact) }.map_err(|e| format!("{e:#}"))
}

/// Writes `bytes` to a temporary file beside `path` and renames it over `path`, so a
/// reader sees the whole old file or the whole new one. On failure the temporary
/// file is removed (a full disk must not be filled further by half-written ones).
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    replace_with(path, |tmp| std::fs::write(tmp, bytes))
}

/// [`write_atomically`] with the writing of the temporary file given.
fn replace_with(
    path: &Path,
    write: impl FnOnce(&Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    write(&tmp)
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// Feeds `Hash` output into SHA-256, so the engine's compatibility hash becomes a
/// stable file-name component (std's `DefaultHasher` may change between releases).
struct Sha256Hasher(Sha256);

impl Hasher for Sha256Hasher {
    fn finish(&self) -> u64 {
        let digest = self.0.clone().finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(first)
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

/// Advances the engine's epoch every [`TICK`] so that deadlines fire, and parks
/// while no guest code runs. Every runtime runs one on a thread of its own.
struct Ticker {
    engine: Engine,
    runtime: Weak<RuntimeInner>,
    clock: Arc<Clock>,
}

impl std::fmt::Debug for Ticker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticker").finish_non_exhaustive()
    }
}

impl Ticker {
    /// Loops until the runtime (every `Registry`/`Runtime` clone) is dropped.
    fn run(self) {
        let clock = &self.clock;
        *clock.ticker.lock().unwrap_or_else(PoisonError::into_inner) = Some(std::thread::current());
        let mut idle = 0u32;
        while self.runtime.strong_count() > 0 {
            if clock.running.load(Ordering::SeqCst) > 0 {
                idle = 0;
            } else if idle >= IDLE_TICKS {
                clock.parked.store(true, Ordering::SeqCst);
                if clock.running.load(Ordering::SeqCst) == 0 {
                    std::thread::park_timeout(PARKED_RECHECK);
                }
                clock.parked.store(false, Ordering::SeqCst);
                // Woken for a call: tick again. Woken only to look whether the
                // runtime is gone: rest again at once.
                if clock.running.load(Ordering::SeqCst) > 0 {
                    idle = 0;
                }
                continue;
            } else {
                idle += 1;
            }
            std::thread::sleep(TICK);
            self.engine.increment_epoch();
            clock.ticks.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A compiled, pre-instantiated component and its warm instances. Cheap to clone;
/// every clone shares the pool.
#[derive(Clone)]
pub struct Loaded {
    inner: Arc<LoadedInner>,
}

struct LoadedInner {
    runtime: Runtime,
    pre: InstancePre<State>,
    indices: Indices,
    hooks: Vec<Hook>,
    exports: Vec<String>,
    content_hash: String,
    params: Arc<BTreeMap<String, String>>,
    label: Arc<str>,
    from_cache: bool,
    load_time: Duration,
    size: usize,
    warm: Mutex<Vec<Warm>>,
}

struct Indices {
    retry: Option<retry::GuestIndices>,
    fallback: Option<fallback::GuestIndices>,
    budget: Option<budget::GuestIndices>,
}

/// The hook handles of one warm instance, lent to a call next to its store.
struct Guests<'a> {
    retry: Option<&'a retry::Guest>,
    fallback: Option<&'a fallback::Guest>,
    budget: Option<&'a budget::Guest>,
}

struct Warm {
    store: Store<State>,
    retry: Option<retry::Guest>,
    fallback: Option<fallback::Guest>,
    budget: Option<budget::Guest>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("label", &self.inner.label)
            .field("hooks", &self.inner.hooks)
            .field("content_hash", &self.inner.content_hash)
            .finish_non_exhaustive()
    }
}

impl Loaded {
    /// The hooks this component exports, in `Hook::ALL` order.
    pub fn hooks(&self) -> &[Hook] {
        &self.inner.hooks
    }

    pub fn implements(&self, hook: Hook) -> bool {
        self.inner.hooks.contains(&hook)
    }

    /// Every export name of the component (for `policy check`).
    pub fn exports(&self) -> &[String] {
        &self.inner.exports
    }

    /// SHA-256 of the component's bytes, hex.
    pub fn content_hash(&self) -> &str {
        &self.inner.content_hash
    }

    pub fn params(&self) -> &BTreeMap<String, String> {
        &self.inner.params
    }

    /// Whether the compiled code came from the on-disk cache.
    pub fn from_cache(&self) -> bool {
        self.inner.from_cache
    }

    /// Time to compile or deserialize and pre-instantiate.
    pub fn load_time(&self) -> Duration {
        self.inner.load_time
    }

    /// Size of the component in bytes.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Instances idle in the pool now.
    pub fn warm_instances(&self) -> usize {
        self.inner
            .warm
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The most host resources any idle instance in the pool holds (see
    /// [`MAX_POOLED_RESOURCES`]). For tests.
    #[doc(hidden)]
    pub fn pooled_resources(&self) -> usize {
        self.inner
            .warm
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter_mut()
            .map(|warm| warm.store.data_mut().resources())
            .max()
            .unwrap_or(0)
    }

    /// Asks the retry hook, unvalidated.
    pub fn retry(
        &self,
        ctx: &outrigger_types::CallContext,
        failure: &outrigger_types::Failure,
    ) -> Result<outrigger_types::RetryDecision, Fault> {
        let ids = (ctx.task_id.as_deref(), ctx.request_id.as_str());
        let lists = convert::CallContextLists::new(ctx);
        let (ctx, failure) = (lists.wit(), convert::failure(failure));
        self.call(Hook::Retry, ids, |store, guests| match guests.retry {
            Some(guest) => Ok(guest.call_decide(store, ctx, failure)),
            None => Err(Fault::MissingHook(Hook::Retry)),
        })
        .map(convert::retry_decision)
    }

    /// Asks the fallback hook, unvalidated: indices into `request.candidates`.
    pub fn fallback(
        &self,
        request: &outrigger_types::FallbackRequest,
    ) -> Result<Vec<usize>, Fault> {
        let ids = (request.task_id.as_deref(), request.request_id.as_str());
        let candidates = convert::candidates(request);
        let request = convert::fallback_request(request, &candidates);
        self.call(Hook::Fallback, ids, |store, guests| match guests.fallback {
            Some(guest) => Ok(guest.call_order(store, request)),
            None => Err(Fault::MissingHook(Hook::Fallback)),
        })
        .map(|order| {
            order
                .into_iter()
                .map(|i| usize::try_from(i).unwrap_or(usize::MAX))
                .collect()
        })
    }

    /// Asks the budget hook, unvalidated.
    pub fn budget(
        &self,
        request: &outrigger_types::BudgetRequest,
    ) -> Result<outrigger_types::BudgetDecision, Fault> {
        let ids = (request.task_id.as_deref(), request.request_id.as_str());
        let lists = convert::BudgetLists::new(request);
        let request = lists.wit();
        self.call(Hook::Budget, ids, |store, guests| match guests.budget {
            Some(guest) => Ok(guest.call_admit(store, request)),
            None => Err(Fault::MissingHook(Hook::Budget)),
        })
        .map(convert::budget_decision)
    }

    /// Runs `f` on a warm instance; `ids` (task id, request id) answer the
    /// guest's `host.task-id` and `host.request-id` during the call.
    fn call<R>(
        &self,
        hook: Hook,
        ids: (Option<&str>, &str),
        f: impl FnOnce(&mut Store<State>, Guests<'_>) -> Result<wasmtime::Result<R>, Fault>,
    ) -> Result<R, Fault> {
        if !self.implements(hook) {
            return Err(Fault::MissingHook(hook));
        }
        let inner = &self.inner;
        let _running = inner.runtime.inner.clock.enter();
        let taken = inner
            .warm
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut warm = match taken {
            Some(warm) => warm,
            None => self
                .instantiate(inner.runtime.inner.options.deadline)
                .map_err(|fault| match fault {
                    Fault::Timeout(deadline) => Fault::InstantiateTimeout(deadline),
                    other => other,
                })?,
        };
        let options = &inner.runtime.inner.options;
        warm.store.data_mut().begin_call(options.seed, ids);
        warm.store
            .set_epoch_deadline(deadline_ticks(options.deadline));
        let result = {
            let Warm {
                store,
                retry,
                fallback,
                budget,
            } = &mut warm;
            let guests = Guests {
                retry: retry.as_ref(),
                fallback: fallback.as_ref(),
                budget: budget.as_ref(),
            };
            f(store, guests)
        };
        match result {
            Ok(Ok(value)) => {
                let resources = warm.store.data_mut().resources();
                if resources > MAX_POOLED_RESOURCES {
                    tracing::debug!(
                        policy = &*inner.label,
                        resources,
                        "an instance holding more than {MAX_POOLED_RESOURCES} host resources is retired"
                    );
                    return Ok(value);
                }
                let mut pool = inner.warm.lock().unwrap_or_else(PoisonError::into_inner);
                if pool.len() < options.warm_instances {
                    pool.push(warm);
                }
                Ok(value)
            }
            Ok(Err(error)) => Err(classify(&warm.store, &error, options, options.deadline)),
            Err(fault) => Err(fault),
        }
    }

    /// Fills the pool to `warm_instances` (one instance at least, as a check, kept
    /// only if the pool takes any), each made under [`LOAD_INSTANTIATE_DEADLINE`] or
    /// the deadline if longer, so that up to `warm_instances` concurrent calls find
    /// one ready. An instance made later, on a call's path (more calls at once than
    /// that), gets the call's deadline: a Python component, whose start-up copies
    /// tens of MB, may not start within it. The cost is paid at load instead of at
    /// the first burst of calls: the time to make them, and each one's memory for
    /// as long as the version is loaded.
    pub fn warm_up(&self) -> Result<(), Fault> {
        let options = &self.inner.runtime.inner.options;
        let deadline = options.deadline.max(LOAD_INSTANTIATE_DEADLINE);
        loop {
            let warm = self.instantiate(deadline).map_err(|fault| match fault {
                Fault::Timeout(deadline) => Fault::Instantiate(format!(
                    "its start-up ran past the {deadline:?} deadline (a start function that never returns?)"
                )),
                other => other,
            })?;
            let mut pool = self
                .inner
                .warm
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if pool.len() < options.warm_instances {
                pool.push(warm);
            }
            if pool.len() >= options.warm_instances {
                return Ok(());
            }
        }
    }

    fn instantiate(&self, deadline: Duration) -> Result<Warm, Fault> {
        let inner = &self.inner;
        let options = &inner.runtime.inner.options;
        // Start functions are guest code: the deadline counts only while the clock
        // runs (the ticker parks otherwise), warm-ups off any call's path included.
        let _running = inner.runtime.inner.clock.enter();
        let mut store = Store::new(
            &inner.runtime.inner.engine,
            State::new(
                Arc::clone(&inner.params),
                Arc::clone(&inner.label),
                inner.runtime.inner.origin,
                options.memory_limit_bytes,
            ),
        );
        store.limiter(|state| &mut state.limiter);
        store.set_epoch_deadline(deadline_ticks(deadline));
        let instance = inner.pre.instantiate(&mut store).map_err(|e| {
            match classify(&store, &e, options, deadline) {
                Fault::Trap(message) => Fault::Instantiate(message),
                other => other,
            }
        })?;
        let load = |e: wasmtime::Error| Fault::Instantiate(format!("{e:#}"));
        let retry = match &inner.indices.retry {
            Some(ix) => Some(ix.load(&mut store, &instance).map_err(load)?),
            None => None,
        };
        let fallback = match &inner.indices.fallback {
            Some(ix) => Some(ix.load(&mut store, &instance).map_err(load)?),
            None => None,
        };
        let budget = match &inner.indices.budget {
            Some(ix) => Some(ix.load(&mut store, &instance).map_err(load)?),
            None => None,
        };
        Ok(Warm {
            store,
            retry,
            fallback,
            budget,
        })
    }
}

fn deadline_ticks(deadline: Duration) -> u64 {
    let tick = TICK.as_nanos().max(1);
    u64::try_from(deadline.as_nanos().div_ceil(tick))
        .unwrap_or(u64::MAX)
        .max(1)
}

fn classify(
    store: &Store<State>,
    error: &wasmtime::Error,
    options: &RuntimeOptions,
    deadline: Duration,
) -> Fault {
    if store.data().limiter.exceeded {
        return Fault::MemoryLimit(options.memory_limit_bytes);
    }
    if error.downcast_ref::<wasmtime::Trap>() == Some(&wasmtime::Trap::Interrupt) {
        return Fault::Timeout(deadline);
    }
    match store.data().stderr.tail() {
        Some(tail) => Fault::Trap(format!("{error:#}; the guest's stderr: {tail}")),
        None => Fault::Trap(format!("{error:#}")),
    }
}

/// The guest's stderr: keeps the last [`STDERR_TAIL_BYTES`] written since the
/// instance started or the current call began, so that a trap can say what the
/// guest said before it (a Rust panic's message, for one). Never refuses a write.
#[derive(Clone, Default)]
struct StderrTail {
    kept: Arc<Mutex<Tail>>,
}

#[derive(Default)]
struct Tail {
    bytes: VecDeque<u8>,
    /// Whether earlier bytes were dropped to keep within the bound.
    cut: bool,
}

impl StderrTail {
    fn push(&self, mut bytes: &[u8]) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if bytes.len() > STDERR_TAIL_BYTES {
            bytes = &bytes[bytes.len() - STDERR_TAIL_BYTES..];
            kept.cut = true;
        }
        let over = (kept.bytes.len() + bytes.len()).saturating_sub(STDERR_TAIL_BYTES);
        if over > 0 {
            kept.bytes.drain(..over);
            kept.cut = true;
        }
        kept.bytes.extend(bytes);
    }

    fn clear(&self) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        kept.bytes.clear();
        kept.cut = false;
    }

    /// What was kept, as text; `None` when nothing (but white space) was written.
    fn tail(&self) -> Option<String> {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let cut = kept.cut;
        let text = String::from_utf8_lossy(kept.bytes.make_contiguous());
        let text = text.trim();
        if text.is_empty() {
            return None;
        }
        Some(if cut {
            format!("…{text}")
        } else {
            text.to_owned()
        })
    }
}

impl wasmtime_wasi::cli::IsTerminal for StderrTail {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdoutStream for StderrTail {
    fn p2_stream(&self) -> Box<dyn wasmtime_wasi::p2::OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl wasmtime_wasi::p2::Pollable for StderrTail {
    async fn ready(&mut self) {}
}

impl wasmtime_wasi::p2::OutputStream for StderrTail {
    fn write(&mut self, bytes: bytes::Bytes) -> wasmtime_wasi::p2::StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> wasmtime_wasi::p2::StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> wasmtime_wasi::p2::StreamResult<usize> {
        // What one write may carry (it is copied into the guest's stream first).
        Ok(64 << 10)
    }
}

impl tokio::io::AsyncWrite for StderrTail {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.push(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// Caps the linear memory of one instance over all its memories (wasmtime's own
/// `StoreLimits` caps each memory separately, and a component may have several)
/// and remembers a refusal, so the fault is reported as a memory blow-up rather
/// than as the trap the guest's allocator turns it into.
struct Limiter {
    cap: usize,
    committed: usize,
    exceeded: bool,
}

impl wasmtime::ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let growth = desired.saturating_sub(current);
        match self.committed.checked_add(growth) {
            Some(total) if total <= self.cap => {
                self.committed = total;
                Ok(true)
            }
            _ => {
                self.exceeded = true;
                Ok(false)
            }
        }
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }

    fn instances(&self) -> usize {
        64
    }

    fn tables(&self) -> usize {
        64
    }

    fn memories(&self) -> usize {
        16
    }
}

/// What one store (one instance) carries: an empty WASI context, the memory
/// limiter, and what the `host` imports answer from.
pub(crate) struct State {
    wasi: WasiCtx,
    table: ResourceTable,
    stderr: StderrTail,
    limiter: Limiter,
    params: Arc<BTreeMap<String, String>>,
    label: Arc<str>,
    origin: Instant,
    seed: Option<u64>,
    rng: Option<rand::rngs::StdRng>,
    /// The call being decided: its task id (when it has one) and request id,
    /// kept in buffers reused from call to call.
    task_id: Option<String>,
    request_id: String,
    /// Log lines the call being decided has written.
    logged: u32,
}

impl State {
    fn new(
        params: Arc<BTreeMap<String, String>>,
        label: Arc<str>,
        origin: Instant,
        memory_cap: usize,
    ) -> Self {
        // No preopened directories, environment, arguments, network or name lookup:
        // guests that import WASI instantiate but can reach nothing.
        // Stderr is kept (its end) for the message of a trap; stdout goes nowhere.
        let stderr = StderrTail::default();
        let wasi = WasiCtx::builder()
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .stderr(stderr.clone())
            .build();
        let mut table = ResourceTable::new();
        table.set_max_capacity(MAX_RESOURCES);
        Self {
            wasi,
            table,
            stderr,
            limiter: Limiter {
                cap: memory_cap,
                committed: 0,
                exceeded: false,
            },
            params,
            label,
            origin,
            seed: None,
            rng: None,
            task_id: None,
            request_id: String::new(),
            logged: 0,
        }
    }

    /// Resets the per-call random source (seeded, the same call draws the same
    /// numbers whatever the instance served before) and records the call's ids.
    fn begin_call(&mut self, seed: Option<u64>, (task_id, request_id): (Option<&str>, &str)) {
        self.seed = seed;
        // A refusal an earlier call took in its stride is not this call's fault,
        // nor is what an earlier call wrote to stderr this call's message.
        self.limiter.exceeded = false;
        self.stderr.clear();
        self.logged = 0;
        self.rng = None;
        match (task_id, &mut self.task_id) {
            (Some(id), Some(kept)) => {
                kept.clear();
                kept.push_str(id);
            }
            (Some(id), kept) => *kept = Some(id.to_owned()),
            (None, kept) => *kept = None,
        }
        self.request_id.clear();
        self.request_id.push_str(request_id);
    }
}

impl State {
    /// Host resources in this instance's table (O(table size), which
    /// [`MAX_POOLED_RESOURCES`] keeps small for a pooled instance).
    fn resources(&mut self) -> usize {
        self.table.iter_mut().count()
    }
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl types::Host for State {}

impl host::Host for State {
    fn log(&mut self, level: host::Level, message: String) {
        self.logged = self.logged.saturating_add(1);
        if self.logged > MAX_LOG_LINES_PER_CALL {
            if self.logged == MAX_LOG_LINES_PER_CALL + 1 {
                tracing::warn!(
                    policy = &*self.label,
                    task_id = self.task_id.as_deref(),
                    request_id = self.request_id.as_str(),
                    "the policy wrote more than {MAX_LOG_LINES_PER_CALL} log lines in one call; the rest of this call's are dropped"
                );
            }
            return;
        }
        let mut line = message;
        if line.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !line.is_char_boundary(cut) {
                cut -= 1;
            }
            line.truncate(cut);
            line.push('…');
        }
        let policy = &*self.label;
        let task_id = self.task_id.as_deref();
        let request_id = self.request_id.as_str();
        match level {
            host::Level::Debug => tracing::debug!(policy, task_id, request_id, "{line}"),
            host::Level::Info => tracing::info!(policy, task_id, request_id, "{line}"),
            host::Level::Warn => tracing::warn!(policy, task_id, request_id, "{line}"),
            host::Level::Error => tracing::error!(policy, task_id, request_id, "{line}"),
        }
    }

    fn monotonic_now(&mut self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn random(&mut self) -> u64 {
        match self.seed {
            Some(seed) => self
                .rng
                .get_or_insert_with(|| rand::rngs::StdRng::seed_from_u64(seed))
                .next_u64(),
            None => rand::rng().random(),
        }
    }

    fn param(&mut self, name: String) -> Option<String> {
        self.params.get(&name).cloned()
    }

    fn task_id(&mut self) -> Option<String> {
        self.task_id.clone()
    }

    fn request_id(&mut self) -> String {
        self.request_id.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{e}"))
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_failed_atomic_write_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("a.cwasm");
        write_atomically(&path, b"artifact").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(std::fs::read(&path).ok().as_deref(), Some(&b"artifact"[..]));
        assert_eq!(names(dir.path()), ["a.cwasm"]);

        // The write fails half-way (a full disk, say).
        let failed = replace_with(&dir.path().join("b.cwasm"), |tmp| {
            std::fs::write(tmp, b"half an arti")?;
            Err(std::io::Error::other("no space left on device"))
        });
        assert!(failed.is_err());
        assert_eq!(
            names(dir.path()),
            ["a.cwasm"],
            "the half-written file was removed"
        );

        // The rename fails: the target is a directory that is not empty.
        let blocked = dir.path().join("c.cwasm");
        std::fs::create_dir_all(blocked.join("inside")).unwrap_or_else(|e| panic!("{e}"));
        assert!(write_atomically(&blocked, b"artifact").is_err());
        assert_eq!(
            names(dir.path()),
            ["a.cwasm", "c.cwasm"],
            "the written file was removed"
        );
    }

    #[test]
    fn the_stderr_tail_keeps_the_end_within_its_bound() {
        let tail = StderrTail::default();
        assert_eq!(tail.tail(), None);
        tail.push(b"  \n");
        assert_eq!(tail.tail(), None, "white space alone is nothing");
        tail.push(b"thread panicked at src/lib.rs:1:1:\nboom\n");
        assert_eq!(
            tail.tail().as_deref(),
            Some("thread panicked at src/lib.rs:1:1:\nboom")
        );
        // Many small writes and one large one: only the end is kept.
        for _ in 0..1_000 {
            tail.push(b"0123456789");
        }
        tail.push(b"the end");
        let kept = tail.tail().unwrap_or_default();
        assert!(kept.starts_with('…'), "{kept}");
        assert!(kept.ends_with("789the end"), "{kept}");
        assert!(kept.len() <= STDERR_TAIL_BYTES + '…'.len_utf8());
        tail.push(&vec![b'x'; 3 * STDERR_TAIL_BYTES]);
        let kept = tail.tail().unwrap_or_default();
        assert_eq!(kept.len(), STDERR_TAIL_BYTES + '…'.len_utf8());
        tail.clear();
        assert_eq!(tail.tail(), None);
    }
}
