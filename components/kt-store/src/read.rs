//! The store's side of reads: which version of a key a getter reads, pinned
//! until its lease ends (the lease protocol itself is [`kt_service::reads`]);
//! listing and deleting trees.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use kt_service::reads::{Files, OpenVersion, ReadSource};
use kt_service::{ApiError, ApiJson};
use kt_types::Key;
use kt_types::api::{DeleteResponse, TreeDeleteQuery, TreeList};

use crate::keys::{KeyState, Keys, Published};
use crate::put::remove_versions;
use crate::server::{AppState, blocking};

/// Published versions of the store's keys, as a [`ReadSource`]: a read pins
/// its version, so a newer put retires it without deleting it under the getter.
#[derive(Debug)]
pub struct StoreVersions {
    pub keys: Arc<Keys>,
    pub chunk_size: u64,
}

type Locked = tokio::sync::OwnedMutexGuard<KeyState>;

fn missing(key: &Key) -> ApiError {
    ApiError::not_found(format!("key {key} not found in the store"))
}

/// A published key: its locked state and its current version; or `not_found`.
async fn published(keys: &Keys, key: &Key) -> Result<(Locked, Published), ApiError> {
    let state = keys.existing(key).ok_or_else(|| missing(key))?;
    let st = state.lock_owned().await;
    let cur = st.current.clone().ok_or_else(|| missing(key))?;
    Ok((st, cur))
}

impl ReadSource for StoreVersions {
    async fn open(&self, key: &Key) -> Result<OpenVersion, ApiError> {
        let (mut st, cur) = published(&self.keys, key).await?;
        st.pin(&cur.version);
        drop(st);
        Ok(OpenVersion {
            key: key.clone(),
            files: Files::Under(self.keys.dir_of(key).version_path(&cur.version)),
            version: cur.version,
            manifest: cur.meta.manifest.clone(),
            chunk_size: self.chunk_size,
            // Version directories are written by the store alone: no links on the way.
            check_links: false,
        })
    }

    async fn close(&self, opened: &OpenVersion) {
        let Some(state) = self.keys.existing(&opened.key) else {
            return;
        };
        let free = state.lock().await.unpin(&opened.version);
        remove_versions(&self.keys.dir_of(&opened.key), free).await;
    }
}

/// `DELETE /api/v1/trees/{key}`: removes a key and all its versions.
pub async fn delete_tree(
    State(s): State<AppState>,
    Path(key): Path<String>,
    Query(q): Query<TreeDeleteQuery>,
) -> Result<ApiJson<DeleteResponse>, ApiError> {
    let key = Key::parse(&key)?;
    let (mut st, cur) = published(&s.keys, &key).await?;
    if let Some(v) = q.version.filter(|v| *v != cur.version) {
        return Err(ApiError::new(
            kt_types::ErrorCode::Conflict,
            format!("{key} is at version {}, not {v}", cur.version),
        ));
    }
    let dir = s.keys.dir_of(&key);
    blocking(move || dir.remove_all()).await?;
    st.current = None;
    s.keys.forget(&key);
    s.registrar.forget(&key).await;
    tracing::info!(%key, "tree deleted");
    Ok(ApiJson(DeleteResponse { deleted: vec![key] }))
}

/// `GET /api/v1/trees`: every key the store holds.
pub async fn list(State(s): State<AppState>) -> ApiJson<TreeList> {
    let mut keys = Vec::new();
    for (k, st) in s.keys.all() {
        if st.lock().await.current.is_some() {
            keys.push(k);
        }
    }
    keys.sort();
    ApiJson(TreeList { keys })
}
