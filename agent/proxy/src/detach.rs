//! Work that outlives its agent's request: dropped unfinished (the agent went away),
//! it goes on as a task of its own instead of being cancelled, and the drain waits
//! for it. Tool calls and probes use it up to their outcome's journaling; journaled
//! model calls up to their answer.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::watch;

/// How much detached work is still running, for the drain to wait on.
#[derive(Clone)]
pub(crate) struct Detached(Arc<watch::Sender<usize>>);

impl Default for Detached {
    fn default() -> Self {
        Self(Arc::new(watch::Sender::new(0)))
    }
}

/// One piece of work counted until it is dropped.
pub(crate) struct Counted(Arc<watch::Sender<usize>>);

impl Detached {
    pub(crate) fn count(&self) -> Counted {
        self.0.send_modify(|n| *n += 1);
        Counted(self.0.clone())
    }

    /// Resolves once no work is counted.
    pub(crate) async fn settled(self) {
        let _ = self.0.subscribe().wait_for(|n| *n == 0).await;
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

/// What becomes of the outcome of work whose agent went away (a call at the tool, a
/// probe, a model call): it is logged, settled where nobody will act on it, and told to the
/// call's observer.
pub(crate) type Orphaned<T> = Box<dyn FnOnce(T) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Work on a call that must reach the journal whatever the agent does: a call at the
/// tool up to its outcome's journaling, a probe up to what it found, a model call up
/// to its answer (a stream's first events, or a plain answer whole). Dropped before
/// it finished (the agent went away, and its request with it), it is not cancelled:
/// it goes on as a task of its own, journals its outcome and hands it to
/// `orphaned`, so that the agent's retry with the same key replays the answer (or
/// waits for it) rather than finding in doubt a call the tool completed, or a key
/// left in flight. Only that case spawns; attached work costs two boxes (the work,
/// and what becomes of it if orphaned).
pub(crate) struct Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    running: Option<Pin<Box<F>>>,
    /// Keeps a drain waiting for the work, here and then in its own task.
    counted: Option<Counted>,
    orphaned: Option<Orphaned<F::Output>>,
}

impl<F> Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    pub(crate) fn new(running: F, counted: Counted, orphaned: Orphaned<F::Output>) -> Self {
        Self {
            running: Some(Box::pin(running)),
            counted: Some(counted),
            orphaned: Some(orphaned),
        }
    }
}

impl<F> Future for Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // Polled again after it finished: it stays finished.
        let Some(running) = self.running.as_mut() else {
            return Poll::Pending;
        };
        let done = std::task::ready!(running.as_mut().poll(cx));
        self.running = None;
        Poll::Ready(done)
    }
}

impl<F> Drop for Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(running) = self.running.take() else {
            return;
        };
        // Dropped while its own poll panicked: the future is broken, not orphaned
        // (polled again it would only panic again).
        if std::thread::panicking() {
            return;
        }
        // Without a runtime (it is shutting down) the call stays in flight, as after
        // a crash: the restart's recovery makes it in doubt.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let counted = self.counted.take();
        let orphaned = self.orphaned.take();
        runtime.spawn(async move {
            let _counted = counted;
            let done = running.await;
            if let Some(orphaned) = orphaned {
                orphaned(done).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A call dropped at any point before its outcome is journaled (at the tool, or
    /// waiting for the journal) goes on by itself to the end, and a drain waits
    /// for it.
    #[tokio::test]
    async fn a_call_dropped_before_its_end_finishes_on_its_own() {
        let detached = Detached::default();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let (told_tx, told_rx) = tokio::sync::oneshot::channel();
        let call = Detachable::new(
            async move {
                let _ = go_rx.await;
                let _ = done_tx.send(());
                7
            },
            detached.count(),
            Box::new(move |done: u32| {
                Box::pin(async move {
                    let _ = told_tx.send(done);
                })
            }),
        );
        // The agent goes away while the call is pending.
        let pending = tokio::time::timeout(Duration::from_millis(10), call).await;
        assert!(pending.is_err(), "the call was still pending");
        let settled = tokio::spawn(detached.clone().settled());
        tokio::task::yield_now().await;
        assert!(!settled.is_finished(), "the drain waits for the call");
        go_tx.send(()).expect("the call is still there to go on");
        tokio::time::timeout(Duration::from_secs(5), done_rx)
            .await
            .expect("the call finished")
            .expect("the call ran to its end");
        tokio::time::timeout(Duration::from_secs(5), settled)
            .await
            .expect("the drain's wait ended")
            .expect("no panic");
        let told = tokio::time::timeout(Duration::from_secs(5), told_rx).await;
        assert_eq!(
            told.ok().and_then(Result::ok),
            Some(7),
            "its outcome was handed on"
        );
    }
}
