//! The sweeper: expired leases, silent agents, broadcast groups, expired keys.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::agents::commit_eviction;
use super::broadcasts::sweep_broadcasts;
use super::keys::delete_one;
use super::{AppState, now_ms};

/// Every `every`: drops expired leases, evicts silent agents, sweeps
/// broadcast groups, deletes expired keys.
pub(super) async fn sweep(s: AppState, every: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = now_ms();
        s.leases.lock().await.expire(now);
        {
            let mut registry = s.registry.lock().await;
            registry.forget_deletions(now, 0);
            let eviction = registry.evict_stale(now);
            if let Err(e) = commit_eviction(&s, &eviction, "no heartbeat within the agent TTL") {
                tracing::warn!(error = %e, "could not persist an eviction; it is redone at start");
            }
        }
        sweep_broadcasts(&s, now);
        let expired = s.registry.lock().await.expired(now);
        for r in expired {
            if let Err(e) = delete_one(&s, &r).await {
                tracing::warn!(key = %r.key, error = %e, "could not delete expired key; will retry");
            }
        }
    }
}
