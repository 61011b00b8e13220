//! `outrigger serve`: wires the components together, binds the two planes, and
//! supervises them until a signal asks for a drain.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::Context;
use outrigger_proxy::Proxy;
use outrigger_proxy::server::serve_with_limits;
use outrigger_proxy::tasks::{Prices, Tasks, TasksOptions};
use outrigger_telemetry::slo::Slos;
use outrigger_telemetry::{Metrics, MetricsOptions};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::admin::{Admin, Readiness};
use crate::config::{Config, OnCorrupt};

pub struct ServeArgs {
    /// Written (as JSON with the bound addresses) once the sidecar is ready; lets
    /// tests and scripts use port 0.
    pub ready_file: Option<PathBuf>,
}

/// The label values the metrics know up front (others are learned up to a cap).
pub fn metrics_options(config: &Config) -> MetricsOptions {
    let mut models = Vec::new();
    for p in &config.proxy.providers {
        models.extend(
            p.models
                .iter()
                .map(ToString::to_string)
                .filter(|m| !m.contains('*')),
        );
        models.extend(p.caps.default_model.iter().cloned());
    }
    models.sort();
    models.dedup();
    MetricsOptions {
        models,
        tools: config.proxy.tools.iter().map(|t| t.name.clone()).collect(),
        providers: config
            .proxy
            .providers
            .iter()
            .map(|p| p.name.clone())
            .collect(),
        bindings: outrigger_policy::Hook::ALL
            .iter()
            .map(|h| h.as_str().to_owned())
            .collect(),
        ..MetricsOptions::default()
    }
}

pub async fn run(config: Config, metrics: Metrics, args: ServeArgs) -> anyhow::Result<()> {
    let readiness = Arc::new(Readiness::default());

    let data = TcpListener::bind(config.data_addr)
        .await
        .with_context(|| format!("cannot listen on {} (listen.data)", config.data_addr))?;
    let admin = TcpListener::bind(config.admin_addr)
        .await
        .with_context(|| format!("cannot listen on {} (listen.admin)", config.admin_addr))?;
    let data_addr = data.local_addr()?;
    let admin_addr = admin.local_addr()?;

    // The admin plane answers from here on: while the journal opens (or waits for
    // another process's lock on it) and policies compile, `/healthz` is up and
    // `/readyz` says what start-up waits for.
    let plane = Arc::new(crate::admin::Plane::starting(
        readiness.clone(),
        config.admin_token.clone(),
    ));
    let (admin_stop_tx, admin_stop_rx) = watch::channel(false);
    // Probes and operators get the data plane's read limit; a slow reader of the
    // admin plane holds nothing upstream.
    let admin_limits = outrigger_proxy::server::ConnLimits {
        write_stall: None,
        read: Some(config.proxy.limits.client_read_timeout),
    };
    let admin_task = tokio::spawn(serve_with_limits(
        admin,
        {
            let plane = plane.clone();
            move |req, peer| {
                let plane = plane.clone();
                async move { plane.handle(req, peer).await }
            }
        },
        wait_for(admin_stop_rx),
        std::time::Duration::from_secs(1),
        admin_limits,
        None,
        std::future::ready(()),
    ));

    for p in &config.proxy.providers {
        tracing::info!(
            provider = %p.name,
            kind = p.dialect.as_str(),
            host = p.authority().unwrap_or("?"),
            models = %p.models.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
            credential = if p.api_key.is_some() { "set" } else { "none" },
            "provider configured"
        );
    }
    if config.proxy.providers.is_empty() {
        tracing::warn!(
            "no model provider is configured: set OPENAI_API_KEY / ANTHROPIC_API_KEY or add [[providers]]"
        );
    }

    let journal = open_journal(
        &config.journal,
        config.on_corrupt,
        config.journal_lock_wait,
        &readiness,
    )
    .await;

    readiness.set_phase("loading the policies");
    let policy_options = config.policies.clone();
    let registry = tokio::task::spawn_blocking(move || crate::policies::start(policy_options))
        .await
        .context("the policy start-up task failed")??;
    crate::policies::publish_readiness(&registry, &readiness);
    let _watcher = match &config.policies.dir {
        Some(dir) => {
            match crate::policies::watch(dir, registry.clone(), metrics.clone(), readiness.clone())
            {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the policy directory; reload with SIGHUP or the admin API");
                    None
                }
            }
        }
        None => None,
    };
    tokio::spawn(crate::policies::on_sighup(
        registry.clone(),
        metrics.clone(),
        readiness.clone(),
    ));

    readiness.set_phase("restoring tasks and SLO counts, starting the data plane");
    let slos = Arc::new(Slos::new(config.slos.clone(), metrics.clone()));
    if let Some(j) = &journal {
        match slos.restore(j) {
            Ok(n) => tracing::debug!(buckets = n, "SLO counts restored"),
            Err(e) => {
                tracing::warn!(error = %e, "SLO counts could not be restored; they start from zero")
            }
        }
    }
    let tasks = open_tasks(&config, journal.clone(), &metrics, &slos);
    keep_books(
        journal.clone(),
        tasks.clone(),
        slos.clone(),
        config.tasks.idle_timeout,
    );

    let (gpu, _gpu_threads) = outrigger_gpu::Monitor::launch(config.gpu.clone());
    let gpu_rx = gpu.subscribe();

    let faults = Arc::new(outrigger_proxy::faults::Injector::new(metrics.clone()));
    faults.set(config.faults.clone());
    let proxy = Proxy::new(
        config.proxy.clone(),
        outrigger_proxy::Components {
            metrics: metrics.clone(),
            journal: journal.clone(),
            decider: Arc::new(crate::policies::PolicyDecider(registry.clone())),
            tasks: tasks.clone(),
            slos: slos.clone(),
            faults: faults.clone(),
        },
    );
    follow_gpu(gpu_rx.clone(), proxy.clone(), readiness.clone());
    let admin_state = Arc::new(Admin {
        readiness: readiness.clone(),
        metrics: metrics.clone(),
        token: config.admin_token.clone(),
        journal: journal.clone(),
        faults: crate::admin::Faults::new(faults.clone(), config.proxy.clone()),
        policies: registry.clone(),
        policy_faults: crate::policies::FaultCounters::default(),
        gpu: gpu_rx,
        tasks: tasks.clone(),
        slos: slos.clone(),
        read_timeout: config.proxy.limits.client_read_timeout,
    });

    let (drain_tx, drain_rx) = watch::channel(false);

    let conn_limits = outrigger_proxy::server::ConnLimits {
        write_stall: Some(config.proxy.limits.client_stall_timeout),
        read: Some(config.proxy.limits.client_read_timeout),
    };
    let workers =
        outrigger_proxy::workers::Workers::start(outrigger_proxy::workers::count(config.workers))
            .context("cannot start the data plane's worker threads")?;
    tracing::debug!(threads = workers.len(), "data-plane workers started");
    let detached = proxy.detached_calls_settled();
    let data_task = tokio::spawn(serve_with_limits(
        data,
        move |req, peer| {
            let proxy = proxy.clone();
            async move { proxy.handle(req, peer).await }
        },
        wait_for(drain_rx),
        config.drain_deadline,
        conn_limits,
        Some(workers),
        detached,
    ));
    plane.serve(admin_state);
    readiness.started.store(true, Ordering::Release);
    tracing::info!(data = %data_addr, admin = %admin_addr, source = %config.source, "outrigger ready");
    if let Some(path) = &args.ready_file {
        let doc = serde_json::json!({
            "data": data_addr.to_string(),
            "admin": admin_addr.to_string(),
            "pid": std::process::id(),
        });
        std::fs::write(path, doc.to_string())
            .with_context(|| format!("cannot write the ready file {}", path.display()))?;
    }

    let signal = shutdown_signal().await;
    readiness.draining.store(true, Ordering::Release);
    tracing::info!(signal, deadline = ?config.drain_deadline, "draining: readiness is now false");
    let _ = drain_tx.send(true);

    let drained = data_task.await.context("the data plane task failed")?;
    if drained.complete {
        tracing::info!(took = ?drained.took, "drained: every in-flight request finished");
    } else {
        tracing::warn!(took = ?drained.took, "drain deadline passed: remaining requests were cut");
    }
    let _ = admin_stop_tx.send(true);
    let _ = admin_task.await;
    persist_books(journal.as_ref(), tasks.as_ref(), &slos).await;
    tracing::info!("outrigger stopped");
    Ok(())
}

/// Opens the task tracker over the journal (tasks then survive a restart), or in
/// memory when there is no journal.
fn open_tasks(
    config: &Config,
    journal: Option<outrigger_journal::Journal>,
    metrics: &Metrics,
    slos: &Arc<Slos>,
) -> Option<Tasks> {
    let mut prices = Prices::default();
    for p in &config.proxy.providers {
        if p.caps.price_in > 0 || p.caps.price_out > 0 {
            prices.set(&p.name, None, p.caps.price_in, p.caps.price_out);
        }
    }
    let options = TasksOptions {
        prices,
        retention: config.tasks.retention,
        max_tasks: config.tasks.max_tasks,
    };
    match Tasks::open(
        options,
        journal,
        metrics.clone(),
        Some(slos.clone()),
        std::time::SystemTime::now(),
    ) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::error!(error = %e, "the task tracker cannot start: tasks are not tracked");
            None
        }
    }
}

/// Every 10 s: persists what changed in tasks and SLO counts, and ends idle tasks.
fn keep_books(
    journal: Option<outrigger_journal::Journal>,
    tasks: Option<Tasks>,
    slos: Arc<Slos>,
    idle_timeout: std::time::Duration,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let changed = async {
                match &tasks {
                    Some(t) => t.changed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tick.tick() => {}
                () = changed => {
                    // A change is saved at once, so a crash loses little; the pause
                    // after it batches a busy sidecar's changes into one save per
                    // 100 ms.
                    if let Some(t) = &tasks
                        && let Err(e) = t.persist().await
                    {
                        tracing::warn!(error = %e, "tasks could not be persisted");
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            }
            if let Some(t) = &tasks {
                match t.sweep(std::time::SystemTime::now(), idle_timeout).await {
                    Ok(ended) => {
                        for r in ended {
                            tracing::info!(task = %r.task.id, "task ended after {idle_timeout:?} idle");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "task sweep failed"),
                }
            }
            persist_books(journal.as_ref(), tasks.as_ref(), &slos).await;
        }
    });
}

async fn persist_books(
    journal: Option<&outrigger_journal::Journal>,
    tasks: Option<&Tasks>,
    slos: &Slos,
) {
    if let Some(t) = tasks
        && let Err(e) = t.persist().await
    {
        tracing::warn!(error = %e, "tasks could not be persisted");
    }
    let now = std::time::SystemTime::now();
    match journal {
        Some(j) => {
            if let Err(e) = slos.persist(j, now).await {
                tracing::warn!(error = %e, "SLO counts could not be persisted");
            }
        }
        None => slos.forget_old(now).await,
    }
}

/// Feeds each new GPU snapshot to the data plane (fallback input, hardware cause)
/// and to readiness.
fn follow_gpu(
    mut rx: watch::Receiver<Arc<outrigger_gpu::Snapshot>>,
    proxy: Proxy,
    readiness: Arc<Readiness>,
) {
    tokio::spawn(async move {
        let mut last_state = None;
        loop {
            let snap = rx.borrow_and_update().clone();
            proxy.set_gpu(snap.summary.clone());
            if let Ok(mut g) = readiness.gpu.lock() {
                *g = (!snap.ready).then(|| snap.ready_reason.clone());
            }
            if last_state != Some(snap.summary.state) {
                tracing::info!(state = snap.summary.state.as_str(), ready = snap.ready, reason = %snap.ready_reason, "GPU health");
                last_state = Some(snap.summary.state);
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    });
}

const LOCKED_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Calls `attempt` again while it answers `Locked`, for up to `wait` (`[journal]
/// lock_wait`: an `outrigger journal` command holding the lock while it copies the
/// journal, or a previous sidecar still exiting), saying so on `/readyz`.
async fn retry_locked<T, F>(
    wait: std::time::Duration,
    pause: std::time::Duration,
    readiness: &Readiness,
    mut attempt: impl FnMut() -> F,
) -> Result<T, outrigger_journal::Error>
where
    F: std::future::Future<Output = Result<T, outrigger_journal::Error>>,
{
    let started = std::time::Instant::now();
    let mut warned = false;
    loop {
        match attempt().await {
            Err(outrigger_journal::Error::Locked { dir }) if started.elapsed() < wait => {
                if !warned {
                    tracing::warn!(dir = %dir.display(),
                        "the journal is locked by another process (an `outrigger journal` command, \
                         or a sidecar still exiting): trying again for up to {wait:?} \
                         ([journal] lock_wait)");
                    // Worded to stay true once the lock is let go: the attempt that
                    // then opens the journal (a long read for a large one) runs
                    // under this phase too.
                    readiness.set_phase(format!(
                        "opening the journal {}, locked by another process when last tried \
                         (an `outrigger journal` command, or a sidecar still exiting); trying \
                         again every {} for up to {} ([journal] lock_wait)",
                        dir.display(),
                        humantime::format_duration(pause),
                        humantime::format_duration(wait)
                    ));
                    warned = true;
                }
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

/// Runs a journal call that reads or moves files off the async threads, so that the
/// admin plane keeps answering while a large journal opens.
async fn blocking<T: Send + 'static>(
    call: impl FnOnce() -> Result<T, outrigger_journal::Error> + Send + 'static,
) -> Result<T, outrigger_journal::Error> {
    tokio::task::spawn_blocking(call)
        .await
        .unwrap_or_else(|e| Err(outrigger_journal::Error::Storage(e.to_string())))
}

/// Opens the journal and starts its writer and its retention sweeper. A journal that
/// cannot be opened leaves the sidecar running without one: readiness says so, and
/// every side-effecting call is refused (fail closed) rather than run unjournaled.
///
/// A corrupt journal is left as it is (`[journal] on_corrupt = "fail-closed"`): a
/// fresh one would not know the calls it holds, completed ones included, and would
/// execute an agent's retry of one again (durability.md §8.2.5, crash row T13). An
/// operator reviews it and moves it aside (`outrigger journal quarantine`).
async fn open_journal(
    options: &outrigger_journal::Options,
    on_corrupt: OnCorrupt,
    lock_wait: std::time::Duration,
    readiness: &Arc<Readiness>,
) -> Option<outrigger_journal::Journal> {
    use outrigger_journal::{Error, Journal};
    readiness.set_phase(format!("opening the journal {}", options.dir.display()));
    let open = || {
        let options = options.clone();
        blocking(move || Journal::open(options))
    };
    // One wait for the whole start: the open, a quarantine and the open after it.
    let deadline = std::time::Instant::now() + lock_wait;
    let left = || deadline.saturating_duration_since(std::time::Instant::now());
    let opened = match retry_locked(left(), LOCKED_PAUSE, readiness, open).await {
        Err(e @ Error::Corrupt { .. }) if on_corrupt == OnCorrupt::FailClosed => {
            tracing::error!(error = %e,
                "the journal is corrupt: it is left as it is, and side-effecting tool calls are \
                 refused until an operator acts ([journal] on_corrupt = \"fail-closed\")");
            if let Ok(mut problem) = readiness.journal_problem.lock() {
                *problem = Some(format!(
                    "corrupt; side-effecting tool calls are refused. {e}"
                ));
            }
            return None;
        }
        Err(Error::Corrupt { dir, detail, .. }) => {
            tracing::error!(dir = %dir.display(), %detail,
                "the journal is corrupt: moving it aside and starting a fresh one \
                 ([journal] on_corrupt = \"quarantine\"); every call it knew is unknown to \
                 the new journal, so an agent's retry of one executes again");
            let quarantine = || {
                let dir = dir.clone();
                blocking(move || Journal::quarantine(&dir))
            };
            match retry_locked(left(), LOCKED_PAUSE, readiness, quarantine).await {
                Ok(moved) => {
                    tracing::error!(quarantined = %moved.display(),
                        "journal quarantined: review the calls it knew with `outrigger journal \
                         list --journal-dir {0}` and `outrigger journal verify --journal-dir {0}`",
                        moved.display());
                    retry_locked(left(), LOCKED_PAUSE, readiness, open).await
                }
                Err(e) => Err(e),
            }
        }
        other => other,
    };
    readiness.set_phase("starting the journal's writer");
    let (journal, writer, recovery) = match opened {
        Ok(o) => o,
        Err(e @ Error::Locked { .. }) => {
            tracing::error!(error = %e, wait = ?lock_wait,
                "the journal is still locked by another process: going on without it; \
                 side-effecting calls will be refused until the sidecar restarts");
            if let Ok(mut problem) = readiness.journal_problem.lock() {
                *problem = Some(format!(
                    "still locked by another process after {} ([journal] lock_wait); \
                     side-effecting tool calls are refused until the sidecar restarts. {e}",
                    humantime::format_duration(lock_wait)
                ));
            }
            return None;
        }
        Err(e) => {
            tracing::error!(error = %e, "the journal cannot be opened: side-effecting calls will be refused");
            return None;
        }
    };
    tracing::info!(
        dir = %options.dir.display(),
        epoch = recovery.epoch,
        records = recovery.records,
        failed_before_send = recovery.failed_before_send.len(),
        in_doubt = recovery.in_doubt.len(),
        needs_operator = recovery.needs_operator.len(),
        abandoned_streams = recovery.abandoned_streams.len(),
        "journal open"
    );
    for key in &recovery.needs_operator {
        tracing::warn!(%key, "a call to an unsafe tool was in flight when the sidecar stopped: it needs an operator");
    }
    if !recovery.undecodable.is_empty() {
        tracing::error!(
            count = recovery.undecodable.len(),
            "journal records could not be decoded; run `outrigger journal verify`"
        );
    }
    let ready = readiness.clone();
    let stopped = async move {
        writer.run().await;
        ready.journal.store(false, Ordering::Release);
        // It ends by itself once every handle is dropped, which is how a drain ends.
        if ready.draining.load(Ordering::Acquire) {
            tracing::debug!("the journal writer stopped");
        } else {
            tracing::error!("the journal writer stopped");
        }
    };
    // The writer gets a thread and a single-threaded runtime of its own: it blocks
    // for each flush, and a hand-off to it from a data-plane worker then wakes one
    // thread, not a work-stealing pool.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    match runtime {
        Ok(runtime) => {
            let spawned = std::thread::Builder::new()
                .name("outrigger-journal".into())
                .spawn(move || runtime.block_on(stopped));
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start the journal writer's thread: side-effecting calls will be refused");
                return None;
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "cannot start the journal writer's runtime: side-effecting calls will be refused");
            return None;
        }
    }
    readiness.journal.store(true, Ordering::Release);
    // While writes fail, readiness says so; a small write each second lets it flip
    // back once the disk recovers even when no traffic arrives to try.
    let prober = journal.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            tick.tick().await;
            if prober.writes_failing() {
                let now = humantime::format_rfc3339_millis(std::time::SystemTime::now());
                if let Err(e) = prober
                    .kv_put("health", "write-probe", now.to_string().into_bytes())
                    .await
                {
                    tracing::debug!(error = %e, "journal write probe failed");
                }
            }
        }
    });
    let sweeper = journal.clone();
    let period = sweep_period(options);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            // One call handles a bounded batch; keep going while it says more is due
            // so a large backlog drains within one tick instead of one batch a minute.
            for _ in 0..1_000 {
                match sweeper.reap(std::time::SystemTime::now()).await {
                    Ok(report) => {
                        tracing::debug!(?report, "retention sweep");
                        if !report.more {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "retention sweep failed");
                        break;
                    }
                }
            }
        }
    });
    Some(journal)
}

/// How often retention is applied: once a minute, or a quarter of the shortest
/// retention when that is shorter (at least once a second), so that nothing
/// outlives its retention by more than a quarter of it.
fn sweep_period(options: &outrigger_journal::Options) -> std::time::Duration {
    let shortest = options
        .retention
        .min(options.tombstone_retention)
        .min(options.stream_retention);
    (shortest / 4).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(60),
    )
}

async fn wait_for(mut rx: watch::Receiver<bool>) {
    while !*rx.borrow() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut term), Ok(mut int)) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        },
        _ => {
            // Without signal handlers there is no graceful path; wait forever rather
            // than exit at once.
            std::future::pending::<()>().await;
            "none"
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use outrigger_journal::Error;

    use super::{retry_locked, sweep_period};
    use crate::admin::Readiness;

    #[test]
    fn retention_is_applied_within_a_quarter_of_the_shortest_one() {
        let mut options = outrigger_journal::Options::default();
        assert_eq!(sweep_period(&options), Duration::from_secs(60), "defaults");
        options.stream_retention = Duration::from_secs(120);
        assert_eq!(sweep_period(&options), Duration::from_secs(30));
        options.tombstone_retention = Duration::from_secs(20);
        assert_eq!(sweep_period(&options), Duration::from_secs(5));
        options.stream_retention = Duration::from_millis(400);
        assert_eq!(
            sweep_period(&options),
            Duration::from_secs(1),
            "at most once a second"
        );
    }

    fn locked() -> Error {
        Error::Locked {
            dir: PathBuf::from("j"),
        }
    }

    #[tokio::test]
    async fn a_locked_journal_is_tried_again_for_a_bounded_time() {
        let readiness = Readiness::default();
        let mut calls = 0;
        let opened = retry_locked(
            Duration::from_secs(5),
            Duration::from_millis(1),
            &readiness,
            || {
                calls += 1;
                std::future::ready(if calls < 3 { Err(locked()) } else { Ok(calls) })
            },
        )
        .await;
        assert_eq!(opened.ok(), Some(3), "opened once the lock was let go");
        let (ready, reasons) = readiness.check();
        assert!(!ready);
        assert!(
            reasons[0].starts_with("starting: opening the journal j, locked by another process"),
            "{reasons:?}"
        );

        let mut calls = 0;
        let started = std::time::Instant::now();
        let opened: Result<(), Error> = retry_locked(
            Duration::from_millis(50),
            Duration::from_millis(5),
            &readiness,
            || {
                calls += 1;
                std::future::ready(Err(locked()))
            },
        )
        .await;
        assert!(matches!(opened, Err(Error::Locked { .. })));
        assert!(calls > 1, "tried again");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "and then gave up"
        );

        let mut calls = 0;
        let opened: Result<(), Error> = retry_locked(
            Duration::from_secs(5),
            Duration::from_millis(1),
            &readiness,
            || {
                calls += 1;
                std::future::ready(Err(Error::Storage("disk".into())))
            },
        )
        .await;
        assert!(matches!(opened, Err(Error::Storage(_))));
        assert_eq!(calls, 1, "only a lock is waited for");
    }
}
