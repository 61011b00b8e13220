//! Stream keys whose start is being decided: one begin per key at a time.
//!
//! A stream the journal has never seen is decided by its caller (attempt 1) without
//! waiting for the writer, so that the upstream request is not held back by a round
//! trip to the writer's thread. That is safe only if no other begin of the same key
//! can be decided in between: each begin holds its key's claim from before it asks
//! the writer's key filter until the writer has logged the batch that holds its
//! start (from then on, every reader sees it). A second begin of the same key waits
//! for the claim.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::stream::StreamKey;

#[derive(Default)]
pub(crate) struct Claims {
    keys: Mutex<HashSet<StreamKey>>,
    released: Notify,
}

/// One key's claim; dropping it releases the key.
pub(crate) struct Claim {
    claims: Arc<Claims>,
    key: StreamKey,
}

impl Claims {
    /// Claims `key`, waiting while another begin holds it.
    pub(crate) async fn claim(self: &Arc<Self>, key: &StreamKey) -> Claim {
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            // Registered before the check, so a release in between is not missed.
            released.as_mut().enable();
            if self.lock().insert(key.clone()) {
                return Claim {
                    claims: Arc::clone(self),
                    key: key.clone(),
                };
            }
            released.await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<StreamKey>> {
        crate::store::lock(&self.keys)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.claims.lock().remove(&self.key);
        self.claims.released.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_second_claim_of_a_key_waits_for_the_first() {
        let claims = Arc::new(Claims::default());
        let key = StreamKey::new("k").unwrap();
        let first = claims.claim(&key).await;
        // Another key is not held up.
        let _other = claims.claim(&StreamKey::new("other").unwrap()).await;
        let waiting = tokio::spawn({
            let claims = Arc::clone(&claims);
            let key = key.clone();
            async move { claims.claim(&key).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "claimed twice at once");
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the release did not wake the waiter")
            .unwrap();
        assert_eq!(second.key, key);
    }
}
