//! The heartbeat: every `interval`, and at once after any export change,
//! `POST /agents` announces every export and published tensor registration;
//! keys the answer lists in `drop` stop being served, and the capability
//! keys it lists are those getters' capabilities are checked against.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kt_types::Key;
use kt_types::api::AgentHeartbeat;
use tokio_util::sync::CancellationToken;

use crate::exports::{Export, Exports};
use crate::metadata::MetadataClient;
use crate::tensors::Tensors;

/// Heartbeat periods the metadata server may ask for are kept within these.
const MIN_INTERVAL: Duration = Duration::from_millis(50);
const MAX_INTERVAL: Duration = Duration::from_secs(60);

/// Counters of the heartbeat loop (status and tests).
#[derive(Debug, Default)]
pub struct BeatStats {
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub dropped: AtomicU64,
}

/// Who is beating: the parts of the heartbeat that do not change.
#[derive(Debug, Clone)]
pub struct Identity {
    pub id: String,
    pub url: String,
    pub service: Option<String>,
}

/// Heartbeats until `shutdown`: every `interval` (then what the metadata
/// server answers), and at once whenever the exports change. Keys the
/// answer lists in `drop` stop being served (if still at the announced
/// version). A failing metadata server is logged and retried; the agent keeps
/// serving meanwhile.
pub async fn heartbeat_loop(
    client: Arc<MetadataClient>,
    (who, capabilities): (Identity, Arc<kt_service::capability::Verifier>),
    exports: Arc<Exports>,
    tensors: Arc<Tensors>,
    stats: Arc<BeatStats>,
    mut interval: Duration,
    shutdown: CancellationToken,
) {
    let mut failing = false;
    loop {
        // The exports announced: a drop applies to these very exports only.
        let announced = exports.all();
        let mut serves = Exports::serves(&announced);
        serves.extend(tensors.serves());
        let beat = AgentHeartbeat {
            id: who.id.clone(),
            url: who.url.clone(),
            service: who.service.clone(),
            serves,
        };
        let answer = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = client.heartbeat(&beat) => a,
        };
        match answer {
            Ok(reply) => {
                if failing {
                    tracing::info!("metadata server reachable again");
                    failing = false;
                }
                stats.ok.fetch_add(1, Ordering::Relaxed);
                capabilities.set_keys(&reply.capability_keys);
                interval =
                    Duration::from_millis(reply.interval_ms).clamp(MIN_INTERVAL, MAX_INTERVAL);
                drop_keys(&exports, &tensors, &beat, &announced, &reply.drop, &stats).await;
            }
            Err(e) => {
                stats.failed.fetch_add(1, Ordering::Relaxed);
                if failing {
                    tracing::debug!(error = %e, "heartbeat failed");
                } else {
                    tracing::warn!(error = %e, "heartbeat failed; retrying (still serving)");
                    failing = true;
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
            _ = exports.changed() => {}
        }
    }
}

async fn drop_keys(
    exports: &Exports,
    tensors: &Tensors,
    beat: &AgentHeartbeat,
    announced: &[Arc<Export>],
    drop: &[Key],
    stats: &BeatStats,
) {
    for key in drop {
        // Only what this beat announced: a newer export of the key stays,
        // and so does the same version exported again since.
        let Some(sent) = beat.serves.iter().find(|s| s.key == *key) else {
            continue;
        };
        if tensors.drop_version(key, &sent.version) {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let Some(export) = announced.iter().find(|e| e.key == *key) else {
            continue;
        };
        match exports.remove(key, Some(export)).await {
            Ok(true) => {
                stats.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::info!(%key, version = %sent.version, "no longer serving (deleted or superseded)");
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(%key, error = %e, "could not drop an export"),
        }
    }
}
