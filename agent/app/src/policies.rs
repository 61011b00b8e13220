//! The policy registry in the running sidecar: the adapter that makes it the data
//! plane's decider, and the three ways a reload is triggered (a change in the
//! policy directory, `POST /v1/policies/reload`, SIGHUP). Every trigger runs the one
//! reload path, off the async threads; startup was the first run of it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outrigger_policy::{Compiler, Registry, ReloadOutcome, ReloadReport};
use outrigger_proxy::decider::Decider;
use outrigger_telemetry::{Metrics, PolicyEventKind};
use outrigger_types::{
    BudgetDecision, BudgetRequest, CallContext, Decided, Failure, FallbackRequest, PolicyVersion,
    RetryDecision,
};

use crate::admin::Readiness;

/// The registry as the data plane's [`Decider`].
pub struct PolicyDecider(pub Registry);

impl Decider for PolicyDecider {
    fn retry(&self, ctx: &CallContext, failure: &Failure) -> Decided<RetryDecision> {
        self.0.retry(ctx, failure)
    }

    fn fallback(&self, req: &FallbackRequest) -> Decided<Vec<usize>> {
        self.0.fallback(req)
    }

    fn budget(&self, req: &BudgetRequest) -> Decided<BudgetDecision> {
        self.0.budget(req)
    }

    fn versions(&self) -> Vec<PolicyVersion> {
        self.0.versions()
    }
}

/// The built-in components this binary embeds, as the registry takes them.
fn builtins() -> Vec<outrigger_policy::BuiltinComponent> {
    outrigger_builtins::ALL
        .iter()
        .map(|b| outrigger_policy::BuiltinComponent {
            name: b.name,
            bytes: b.bytes,
        })
        .collect()
}

/// Builds the registry (the first reload: built-ins from the compiled cache when it
/// is warm). Components missing from the cache are compiled in a child process
/// ([`child_compiler`]).
pub fn start(mut options: outrigger_policy::Options) -> anyhow::Result<Registry> {
    options.compiler = child_compiler();
    let registry = Registry::new(options, builtins())?;
    release_if_compiled(&registry, 0);
    for status in registry.status() {
        tracing::info!(
            hook = status.hook.as_str(),
            source = %status.source,
            version = status.version.as_ref().map(|v| v.as_str()).unwrap_or("none"),
            from_cache = ?status.loaded_from_cache,
            load_ms = ?status.load_ms,
            error = status.last_error.as_deref().unwrap_or(""),
            "policy bound"
        );
    }
    Ok(registry)
}

/// The subcommand of this binary that compiles a component for its parent.
const COMPILE_CHILD: &str = "compile-policy-child";

/// Compiling in a child of this same binary keeps the compiler's memory (about
/// 10 MiB after the three built-ins) out of the long-running sidecar, and a
/// component that crashes the compiler crashes only the child. `/proc/self/exe`
/// still names this binary after an upgrade replaced the file; where the child
/// cannot run, the policy host compiles in process.
fn child_compiler() -> Compiler {
    let program = Path::new("/proc/self/exe");
    let program = if program.exists() {
        Some(program.to_path_buf())
    } else {
        std::env::current_exe().ok()
    };
    match program {
        Some(program) => Compiler::child(program, vec![COMPILE_CHILD.into()]),
        None => Compiler::InProcess,
    }
}

/// Hands the compiler's freed memory back when the registry compiled anything in
/// this process since it had `before` such compilations (a load from the cache, or
/// one compiled by the child, leaves no compiler garbage here).
fn release_if_compiled(registry: &Registry, before: u64) {
    if registry.runtime().compiled_in_process() > before {
        crate::memory::release_compiler_memory();
    }
}

/// Folds the host's per-binding fault counters into the metrics (as deltas since the
/// last call): the host counts traps, deadlines and refused decisions itself.
#[derive(Default)]
pub struct FaultCounters {
    seen: Mutex<HashMap<(&'static str, &'static str), u64>>,
}

impl FaultCounters {
    pub fn sync(&self, registry: &Registry, metrics: &Metrics) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        for status in registry.status() {
            let hook = status.hook.as_str();
            for (kind, total) in [
                (PolicyEventKind::Trap, status.traps + status.memory_exceeded),
                (PolicyEventKind::Deadline, status.timeouts),
                (PolicyEventKind::Invalid, status.invalid_decisions),
            ] {
                let last = seen.entry((hook, kind.as_str())).or_insert(0);
                metrics.policy_events(hook, kind, total.saturating_sub(*last));
                *last = total.max(*last);
            }
        }
    }
}

/// Runs a reload off the async threads, logs what changed and counts the swaps.
/// Readiness follows: it is false while a binding has no version serving it.
pub async fn reload(
    registry: &Registry,
    metrics: &Metrics,
    readiness: &Readiness,
    why: &str,
) -> ReloadReport {
    run_reload(registry, metrics, readiness, why, |r| {
        let before = r.runtime().compiled_in_process();
        let report = r.reload();
        release_if_compiled(&r, before);
        report
    })
    .await
}

/// [`reload`] with the work on the blocking thread given: a reload whose work
/// panicked (or never ran) is a failed one, with the panic's message, and a failed
/// swap for every hook; the registry publishes nothing it has not fully loaded, so
/// the policies that served before serve on.
async fn run_reload(
    registry: &Registry,
    metrics: &Metrics,
    readiness: &Readiness,
    why: &str,
    work: impl FnOnce(Registry) -> ReloadReport + Send + 'static,
) -> ReloadReport {
    let r = registry.clone();
    let started = std::time::Instant::now();
    let report = match tokio::task::spawn_blocking(move || work(r)).await {
        Ok(report) => report,
        Err(e) => {
            let error = if e.is_panic() {
                format!(
                    "the policy reload panicked: {}",
                    outrigger_policy::panic_message(e.into_panic().as_ref())
                )
            } else {
                format!("the policy reload did not run: {e}")
            };
            tracing::error!(trigger = why, %error, "policy reload failed; the policies that were serving still serve");
            for hook in outrigger_policy::Hook::ALL {
                metrics.policy_event(hook.as_str(), PolicyEventKind::SwapFailed);
            }
            publish_readiness(registry, readiness);
            return ReloadReport::failed(error, started.elapsed());
        }
    };
    for b in &report.bindings {
        tracing::info!(trigger = why, hook = b.hook.as_str(), outcome = ?b.outcome, "policy reload");
        match b.outcome {
            ReloadOutcome::Loaded { .. } => {
                metrics.policy_event(b.hook.as_str(), PolicyEventKind::Swap)
            }
            ReloadOutcome::Failed { .. } => {
                metrics.policy_event(b.hook.as_str(), PolicyEventKind::SwapFailed);
            }
            ReloadOutcome::Unchanged { .. } => {}
        }
    }
    publish_readiness(registry, readiness);
    report
}

/// Tells readiness whether every binding has a version serving it.
pub fn publish_readiness(registry: &Registry, readiness: &Readiness) {
    // Reading the status and storing it is one step: two reloads finishing together
    // must not store an older reading over a newer one.
    static PUBLISHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = PUBLISHING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let all_loaded = registry.status().iter().all(|b| b.version.is_some());
    readiness.policies.store(all_loaded, Ordering::Release);
}

/// Reloads on SIGHUP, forever.
pub async fn on_sighup(registry: Registry, metrics: Metrics, readiness: Arc<Readiness>) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; reload through the admin API instead");
        return;
    };
    while hup.recv().await.is_some() {
        reload(&registry, &metrics, &readiness, "SIGHUP").await;
    }
}

/// Watches the policy directory and reloads (debounced) when a `.wasm` in it
/// changes. The returned watcher must be kept alive.
pub fn watch(
    dir: &Path,
    registry: Registry,
    metrics: Metrics,
    readiness: Arc<Readiness>,
) -> anyhow::Result<notify::RecommendedWatcher> {
    use notify::{RecursiveMode, Watcher};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(e) = event {
            let relevant = e
                .paths
                .iter()
                .any(|p| p.extension().is_some_and(|x| x == "wasm"));
            if relevant && !matches!(e.kind, notify::EventKind::Access(_)) {
                let _ = tx.send(());
            }
        }
    })?;
    watcher.watch(dir, RecursiveMode::NonRecursive)?;
    let registry = Arc::new(registry);
    tokio::spawn(async move {
        while rx.recv().await.is_some() {
            // Let a copy finish (and coalesce its several events) before reloading.
            tokio::time::sleep(Duration::from_millis(200)).await;
            while rx.try_recv().is_ok() {}
            reload(&registry, &metrics, &readiness, "policy directory changed").await;
        }
    });
    Ok(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reload whose work panics is reported failed, with the panic's message, and
    /// leaves the policies that were serving in place.
    #[test]
    fn a_reload_that_panics_is_a_failed_reload() {
        let registry = Registry::new(outrigger_policy::Options::default(), builtins())
            .unwrap_or_else(|e| panic!("registry: {e}"));
        let before = registry.versions();
        assert_eq!(before.len(), 3, "{before:?}");
        let metrics = Metrics::new();
        let readiness = Readiness::default();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        let report = runtime.block_on(run_reload(&registry, &metrics, &readiness, "test", |_| {
            panic!("the compiler blew up")
        }));
        assert!(!report.is_ok(), "{report:?}");
        let error = report.error.as_deref().unwrap_or_default();
        assert!(error.contains("panicked: the compiler blew up"), "{error}");
        let json = serde_json::to_value(&report).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(json["error"], error, "{json}");
        assert_eq!(registry.versions(), before, "the serving policies stay");
        assert!(
            readiness.policies.load(Ordering::Acquire),
            "every binding still has a version serving it"
        );
        // A later reload runs as usual.
        let report = runtime.block_on(reload(&registry, &metrics, &readiness, "test"));
        assert!(report.is_ok(), "{report:?}");
        assert_eq!(report.error, None);
    }
}
