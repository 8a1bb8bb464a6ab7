//! The store's published versions as a [`ReadSource`]: which version of a
//! key a getter reads, pinned until its lease ends (the lease protocol
//! itself is [`kt_service::reads`]), and the removal of versions no reader
//! needs any more.

use std::sync::Arc;

use kt_service::ApiError;
use kt_service::reads::{Files, OpenVersion, ReadSource};
use kt_sync::publish::VersionedDir;
use kt_types::Key;

use crate::keys::{KeyState, Keys, Published};

/// Published versions of the store's keys, as a [`ReadSource`]: a read pins
/// its version, so a newer put retires it without deleting it under the getter.
#[derive(Debug)]
pub struct StoreVersions {
    pub keys: Arc<Keys>,
    pub chunk_size: u64,
}

pub(crate) type Locked = tokio::sync::OwnedMutexGuard<KeyState>;

pub(crate) fn missing(key: &Key) -> ApiError {
    ApiError::not_found(format!("key {key} not found in the store"))
}

/// A published key: its locked state and its current version; or `not_found`.
pub(crate) async fn published(keys: &Keys, key: &Key) -> Result<(Locked, Published), ApiError> {
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
            owner: cur.meta.options.service.clone(),
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

/// Deletes superseded versions off the async threads.
pub async fn remove_versions(dir: &VersionedDir, versions: Vec<String>) {
    if versions.is_empty() {
        return;
    }
    let dir = dir.clone();
    let _ = kt_sync::task::spawn(move || {
        for v in versions {
            if let Err(e) = dir.remove_version(&v) {
                tracing::warn!(version = %v, error = %e, "could not remove a superseded version");
            }
        }
    })
    .await;
}
