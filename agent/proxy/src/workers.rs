//! The data plane's worker threads: one single-threaded runtime per thread, and a
//! connection served on one worker from its first byte to its close.
//!
//! The acceptor hands each new connection to the next worker in turn. Everything a
//! request does — reading it, the upstream exchange on that worker's own connection
//! pool, relaying the answer, a stream's producer — then runs on that one thread, so
//! a request is not passed between threads at every wake-up the way a
//! work-stealing runtime passes it. On the benchmark's two cores this took about a fifth
//! off the CPU time of a model call. The price is that a connection cannot move to
//! an idle thread; connections are spread evenly instead.
//!
//! Work that is not a connection's (the admin plane, policy reloads, GPU polling)
//! stays on the application's main runtime; the journal writer has a thread of its
//! own.

use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// How long a stopping worker waits for blocking work its tasks started.
const SHUTDOWN: Duration = Duration::from_secs(1);

/// How often each worker's anchor timer fires; see [`Workers::start`].
const ANCHOR: Duration = Duration::from_secs(1);

thread_local! {
    /// 0 off the workers; `i + 1` on worker `i`.
    static SLOT: Cell<usize> = const { Cell::new(0) };
}

/// Which worker the calling thread is: 0 for any thread that is not one, `i + 1`
/// for worker `i`. Per-worker state (the upstream connection pools) is indexed by it.
pub fn slot() -> usize {
    SLOT.with(Cell::get)
}

/// A set of worker threads, each running a current-thread runtime until the set is
/// dropped. Dropping it stops the workers and waits for their threads: what still
/// runs on them is cut, and what it drops (a call's guards, which settle its task
/// and budget) has been dropped once the set is gone. From async code, drop it off
/// the runtime's threads (`spawn_blocking`).
pub struct Workers {
    handles: Vec<Handle>,
    stops: Vec<oneshot::Sender<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    next: AtomicUsize,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("threads", &self.handles.len())
            .finish_non_exhaustive()
    }
}

impl Workers {
    /// Starts `threads` workers (at least one), named `outrigger-data-<i>`.
    pub fn start(threads: usize) -> io::Result<Self> {
        let threads = threads.max(1);
        let mut handles = Vec::with_capacity(threads);
        let mut stops = Vec::with_capacity(threads);
        let mut joins = Vec::with_capacity(threads);
        for i in 0..threads {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (stop_tx, stop_rx) = oneshot::channel::<()>();
            handles.push(runtime.handle().clone());
            let thread = std::thread::Builder::new()
                .name(format!("outrigger-data-{i}"))
                .spawn(move || {
                    SLOT.with(|s| s.set(i + 1));
                    // Either a stop or the set dropped ends the worker; its runtime is
                    // shut down here, off any async context, cancelling what is left.
                    //
                    // Until then a timer fires every second. tokio wakes its driver
                    // (an `eventfd` write, and one more turn of the event loop) whenever
                    // a timer is set earlier than every timer already set; with none
                    // set, that is every upstream request's timeout, once per request.
                    // With this one always due within a second, a longer timeout is
                    // filed without the wake.
                    runtime.block_on(async {
                        let mut stop = stop_rx;
                        loop {
                            tokio::select! {
                                _ = &mut stop => break,
                                () = tokio::time::sleep(ANCHOR) => {}
                            }
                        }
                    });
                    // Tasks are dropped at once; blocking work a task started on
                    // this runtime is given a moment, not waited for.
                    runtime.shutdown_timeout(SHUTDOWN);
                })?;
            stops.push(stop_tx);
            joins.push(thread);
        }
        Ok(Self {
            handles,
            stops,
            threads: joins,
            next: AtomicUsize::new(0),
        })
    }

    /// How many workers there are.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Always false: a set has at least one worker.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// The worker the next connection goes to (round robin).
    pub fn next(&self) -> &Handle {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        &self.handles[i]
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for stop in self.stops.drain(..) {
            let _ = stop.send(());
        }
        for thread in self.threads.drain(..) {
            // A worker that panicked has nothing more to cut.
            let _ = thread.join();
        }
    }
}

/// How many workers `configured` asks for: 0 means one per available core.
pub fn count(configured: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_go_round_robin_and_each_worker_knows_its_slot() {
        let workers = Workers::start(3).expect("start");
        assert_eq!(workers.len(), 3);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let slots: Vec<usize> = rt.block_on(async {
            let mut out = Vec::new();
            for _ in 0..6 {
                let task = workers.next().spawn(async { slot() });
                out.push(task.await.expect("task"));
            }
            out
        });
        assert_eq!(slots, [1, 2, 3, 1, 2, 3]);
        assert_eq!(slot(), 0, "this thread is not a worker");
    }

    #[test]
    fn dropping_the_set_stops_its_workers() {
        let workers = Workers::start(1).expect("start");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        workers.next().spawn(async move {
            // Held until the runtime is dropped, which drops this task and `tx`.
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        drop(workers);
        // Not waited for: the drop returns once the worker's thread has ended.
        assert_eq!(
            rx.try_recv(),
            Err(std::sync::mpsc::TryRecvError::Disconnected),
            "the worker's task was dropped with its runtime before the set's drop returned"
        );
    }

    #[test]
    fn zero_means_one_per_core() {
        assert_eq!(count(3), 3);
        assert!(count(0) >= 1);
    }
}
