//! Keys on disk: `data_dir/keys/<blake3(key)>/` holds a [`VersionedDir`] and a
//! `key` file naming the key (keys are longer than file names may be).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kt_sync::SyncError;
use kt_sync::publish::VersionedDir;
use kt_types::api::PutOptions;
use kt_types::{Key, Manifest};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use crate::resume::{Leftover, keep_until};

/// What is stored beside each version: a codec document whose header is
/// [`MetaHeader`] and whose body is the manifest.
#[derive(Debug, Clone)]
pub struct VersionMeta {
    pub key: Key,
    /// Shared with the read leases of this version.
    pub manifest: Arc<Manifest>,
    pub options: PutOptions,
}

#[derive(Debug, Serialize, Deserialize)]
struct MetaHeader {
    key: Key,
    #[serde(default)]
    options: PutOptions,
}

impl VersionMeta {
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = MetaHeader {
            key: self.key.clone(),
            options: self.options.clone(),
        };
        kt_types::codec::encode_document(&header, &self.manifest)
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<(Self, kt_types::Hash), kt_types::codec::CodecError> {
        let (h, encoded): (MetaHeader, &[u8]) = kt_types::codec::split_document(bytes)?;
        let manifest = kt_types::codec::decode(encoded)?;
        let meta = VersionMeta {
            key: h.key,
            manifest: Arc::new(manifest),
            options: h.options,
        };
        Ok((meta, kt_sync::digest_of_encoded(encoded)))
    }
}

/// The published version of a key.
#[derive(Debug, Clone)]
pub struct Published {
    pub version: String,
    pub meta: Arc<VersionMeta>,
    /// `kt_sync::manifest_digest` of the manifest: an unchanged put compares only this.
    pub digest: kt_types::Hash,
}

/// One key's mutable state. Locked for plan, commit, pin and delete.
#[derive(Debug, Default)]
pub struct KeyState {
    pub current: Option<Published>,
    /// Read pins per version.
    pins: HashMap<String, usize>,
    /// Superseded versions waiting for their last reader.
    retired: Vec<String>,
    /// A superseded version no reader holds, kept for the next put to
    /// stage in ([`crate::versions::Spare`]).
    pub spare: Option<crate::versions::Spare>,
}

impl KeyState {
    pub fn pin(&mut self, version: &str) {
        *self.pins.entry(version.to_owned()).or_default() += 1;
    }

    /// Releases a pin; returns versions that may now be deleted.
    pub fn unpin(&mut self, version: &str) -> Vec<String> {
        if let Some(n) = self.pins.get_mut(version) {
            *n -= 1;
            if *n == 0 {
                self.pins.remove(version);
            }
        }
        self.collectable()
    }

    /// Marks `version` superseded; returns versions that may now be deleted.
    pub fn retire(&mut self, version: String) -> Vec<String> {
        self.retired.push(version);
        self.collectable()
    }

    fn collectable(&mut self) -> Vec<String> {
        let (free, busy): (Vec<String>, Vec<String>) = self
            .retired
            .drain(..)
            .partition(|v| !self.pins.contains_key(v));
        self.retired = busy;
        free
    }
}

/// All keys of the store.
#[derive(Debug)]
pub struct Keys {
    root: PathBuf,
    map: std::sync::Mutex<HashMap<Key, Arc<Mutex<KeyState>>>>,
    /// Staging versions of uploads a restart interrupted, kept for resuming
    /// until their time is up ([`crate::put::sweep`] removes them then).
    pub leftovers: std::sync::Mutex<Vec<Leftover>>,
    /// Staging versions (by path) that an upload owns, from the plan that
    /// staged or adopted it, under the key's lock, to the end of its session
    /// (its commit included). See [`Claim`].
    claimed: Arc<std::sync::Mutex<HashSet<PathBuf>>>,
}

/// An upload's hold on its staging version: while it lives, no other plan
/// adopts that version (`resume::find` skips it), so no two sessions ever
/// write one staging version, and none writes into one that another's
/// commit is publishing (or has published). Held by the
/// [`crate::session::PutSession`] (its last reference may be a commit
/// still publishing); dropped, it frees the version.
#[derive(Debug)]
pub struct Claim {
    set: Arc<std::sync::Mutex<HashSet<PathBuf>>>,
    path: PathBuf,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.path);
    }
}

impl Keys {
    /// Claims staging version `id` of `dir` for one upload (the caller holds
    /// the key's lock); None if an upload already holds it.
    pub fn claim(&self, dir: &VersionedDir, id: &str) -> Option<Claim> {
        let path = dir.version_path(id);
        let fresh = self
            .claimed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(path.clone());
        fresh.then(|| Claim {
            set: self.claimed.clone(),
            path,
        })
    }

    /// Whether an upload holds staging version `id` of `dir`.
    pub fn claimed(&self, dir: &VersionedDir, id: &str) -> bool {
        self.claimed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&dir.version_path(id))
    }

    pub fn dir_of(&self, key: &Key) -> VersionedDir {
        VersionedDir::new(
            self.root
                .join(blake3::hash(key.as_str().as_bytes()).to_hex().as_str()),
        )
    }

    pub fn state(&self, key: &Key) -> Arc<Mutex<KeyState>> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(key.clone()).or_default().clone()
    }

    pub fn existing(&self, key: &Key) -> Option<Arc<Mutex<KeyState>>> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .cloned()
    }

    pub fn forget(&self, key: &Key) {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }

    pub fn all(&self) -> Vec<(Key, Arc<Mutex<KeyState>>)> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    /// Opens the store's key directory, removing leftovers of interrupted
    /// puts but those younger than `resume_for` (kept for resuming).
    pub fn open(data_dir: &Path, resume_for: Duration) -> Result<Self, SyncError> {
        let root = data_dir.join("keys");
        std::fs::create_dir_all(&root).map_err(|e| SyncError::io(&root, e))?;
        let mut map = HashMap::new();
        let mut leftovers = Vec::new();
        for dent in std::fs::read_dir(&root).map_err(|e| SyncError::io(&root, e))? {
            let dent = dent.map_err(|e| SyncError::io(&root, e))?;
            let vd = VersionedDir::new(dent.path());
            let published =
                vd.cleanup_keeping(|id| keep_until(&vd.resume_path(id), resume_for).is_some())?;
            for (id, marker) in vd.resumable() {
                if let Some(until) = keep_until(&marker, resume_for) {
                    tracing::info!(dir = %dent.path().display(), version = %id, "kept an interrupted upload for resuming");
                    let key = std::fs::read_to_string(vd.path().join("key"))
                        .ok()
                        .and_then(|k| Key::parse(k.trim()).ok());
                    let marked = std::fs::metadata(&marker).and_then(|m| m.modified()).ok();
                    leftovers.push(Leftover {
                        key,
                        dir: vd.clone(),
                        id,
                        until,
                        marked,
                    });
                }
            }
            if !published {
                continue;
            }
            let Some(version) = vd.current()? else {
                continue;
            };
            let bytes = vd.read_meta(&version)?;
            let (meta, digest) = VersionMeta::from_bytes(&bytes).map_err(|e| {
                SyncError::Stream(format!("{}: version {version}: {e}", dent.path().display()))
            })?;
            tracing::debug!(key = %meta.key, %version, "loaded key");
            let state = KeyState {
                current: Some(Published {
                    version,
                    digest,
                    meta: Arc::new(meta.clone()),
                }),
                ..Default::default()
            };
            map.insert(meta.key.clone(), Arc::new(Mutex::new(state)));
        }
        Ok(Keys {
            root,
            map: std::sync::Mutex::new(map),
            leftovers: std::sync::Mutex::new(leftovers),
            claimed: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_hold_retired_versions() {
        let mut s = KeyState::default();
        s.pin("a");
        s.pin("a");
        assert!(s.retire("a".into()).is_empty());
        assert!(s.unpin("a").is_empty());
        assert_eq!(s.unpin("a"), vec!["a".to_string()]);
        assert_eq!(s.retire("b".into()), vec!["b".to_string()]);
    }
}
