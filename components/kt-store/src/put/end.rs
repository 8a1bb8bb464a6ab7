//! How an upload session ends without a publish: aborted by the client,
//! expired (idle past the session TTL), or cut by a shutdown.
//!
//! Invariants: a discarded session's staging version is removed under
//! its key's lock, and a key never published loses its directory when no
//! other upload stages in it; at shutdown staging versions are kept for a
//! put planned again to resume ([`crate::resume`]); an interrupted upload
//! is removed by the sweep only when no session claimed or adopted it in
//! time.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use kt_service::ApiError;
use kt_types::Key;

use crate::session::PutSession;
use crate::state::{AppState, Shared, blocking};
use crate::versions::remove_versions;

/// Removes a session's staging version; a key that was never published and has
/// no other upload in flight loses its directory too.
pub(super) async fn discard(s: &Shared, sess: Arc<PutSession>) {
    let state = s.keys.state(&sess.key);
    let st = state.lock().await;
    drop_staging(
        &sess.key,
        &sess.dir,
        sess.version.clone(),
        st.current.is_some(),
    )
    .await;
}

/// Removes the staging `version` of `key` (its state locked by the caller);
/// a key never `published` loses its directory too.
pub(super) async fn drop_staging(
    key: &Key,
    dir: &kt_sync::publish::VersionedDir,
    version: String,
    published: bool,
) {
    remove_versions(dir, vec![version]).await;
    if !published {
        // Only when no other upload is staging in it (its `v-*` would remain).
        let dir = dir.clone();
        if let Err(e) = blocking(move || dir.remove_if_unused()).await {
            tracing::warn!(%key, error = %e, "could not remove an unpublished key's directory");
        }
    }
}

/// Ends a session and removes its staging area; false when there was none.
pub(super) async fn abort_session(s: &Shared, id: &str) -> bool {
    let sess = s.puts.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    match sess {
        Some(sess) => {
            discard(s, sess).await;
            true
        }
        None => false,
    }
}

/// `DELETE /api/v1/puts/{session}`: drops an upload and its staging area.
pub async fn abort(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if abort_session(&s, &id).await {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("no upload session {id:?}")))
    }
}

/// Aborts sessions idle for longer than the session TTL.
pub async fn sweep(s: &Shared, now: Instant) {
    let stale: Vec<Arc<PutSession>> = {
        let mut puts = s.puts.lock().unwrap_or_else(|p| p.into_inner());
        let ids: Vec<String> = puts
            .iter()
            .filter(|(_, p)| now.duration_since(p.idle_since()) > s.cfg.session_ttl)
            .map(|(id, _)| id.clone())
            .collect();
        ids.iter().filter_map(|id| puts.remove(id)).collect()
    };
    for sess in stale {
        tracing::info!(session = %sess.id, key = %sess.key, "upload session expired");
        discard(s, sess).await;
    }
    // Uploads a restart interrupted and no put resumed in time.
    let due: Vec<crate::resume::Leftover> = {
        let mut left = s.keys.leftovers.lock().unwrap_or_else(|p| p.into_inner());
        let (due, keep) = left.drain(..).partition(|l| now >= l.until);
        *left = keep;
        due
    };
    for l in due {
        // Under the key's lock, like a discard: a plan may be adopting it
        // (it marks it young again) or staging beside it.
        let state = l.key.as_ref().map(|k| s.keys.state(k));
        let st = match &state {
            Some(state) => Some(state.lock().await),
            None => None,
        };
        let marker = l.dir.resume_path(&l.id);
        let resumed = l.adopted()
            || s.keys.claimed(&l.dir, &l.id)
            || s.puts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .any(|p| p.version == l.id && p.dir.path() == l.dir.path());
        if resumed || !marker.exists() {
            continue;
        }
        tracing::info!(dir = %l.dir.path().display(), version = %l.id, "interrupted upload not resumed in time: removed");
        remove_versions(&l.dir, vec![l.id]).await;
        if st.as_ref().is_some_and(|st| st.current.is_none()) {
            let dir = l.dir.clone();
            let _ = blocking(move || dir.remove_if_unused()).await;
        }
    }
}

/// Ends every session at shutdown, keeping their staging versions: a put
/// planned again after the restart resumes from them ([`crate::resume`]);
/// the next start removes those not resumed within the session TTL.
pub async fn interrupt_all(s: &Shared) {
    let all: Vec<Arc<PutSession>> = s
        .puts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain()
        .map(|(_, v)| v)
        .collect();
    for sess in all {
        tracing::info!(session = %sess.id, key = %sess.key, "upload interrupted by shutdown; kept for resuming");
    }
}
