//! What an agent serves, one export per key, persisted so that a restarted
//! agent serves and announces the same again.
//!
//! State directory layout:
//!
//! ```text
//! <state-dir>/exports/<blake3(key)>.export   one export: a codec document
//!                                            (JSON header, then the manifest)
//! <state-dir>/cache/<blake3(key)>.scan       scan cache of a local export
//! ```
//!
//! Export files are replaced atomically (temporary file, fsync, rename).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kt_service::ApiError;
use kt_service::reads::{Files, OpenVersion, ReadSource};
use kt_types::agent::ExportInfo;
use kt_types::api::{PutOptions, Served};
use kt_types::manifest::ManifestLimits;
use kt_types::{Key, Manifest, RootKind};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// One key the agent serves.
#[derive(Debug, Clone, PartialEq)]
pub struct Export {
    pub key: Key,
    pub version: String,
    /// Canonical path of the tree (or of the single file) being served.
    pub path: PathBuf,
    /// A `locale=local` put: this pod holds the key's origin copy.
    pub origin: bool,
    pub options: PutOptions,
    pub manifest: Arc<Manifest>,
}

impl Export {
    pub fn info(&self) -> ExportInfo {
        ExportInfo {
            key: self.key.clone(),
            version: self.version.clone(),
            path: self.path.display().to_string(),
            origin: self.origin,
            files: self.manifest.file_count(),
            size: self.manifest.total_bytes(),
        }
    }

    /// Where the served files are.
    pub fn files(&self) -> Files {
        match self.manifest.root {
            RootKind::Dir => Files::Under(self.path.clone()),
            RootKind::File => Files::Single(self.path.clone()),
        }
    }
}

/// The header of an export file.
#[derive(Debug, Serialize, Deserialize)]
struct ExportHeader {
    key: Key,
    version: String,
    path: PathBuf,
    origin: bool,
    #[serde(default)]
    options: PutOptions,
}

/// A file the agent keeps (an export's record, the node cache's state)
/// that it could not read or write, or that holds what it did not write.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Damaged { path: PathBuf, message: String },
}

/// [`FileError::Io`] of `path`.
pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.to_owned(),
        source,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error("worker failed: {0}")]
    Worker(String),
}

fn name_of(key: &Key) -> String {
    blake3::hash(key.as_str().as_bytes()).to_hex().to_string()
}

/// The exports of one agent. Also its [`ReadSource`]: a getter can open
/// exactly the exported versions.
#[derive(Debug)]
pub struct Exports {
    dir: PathBuf,
    cache_dir: PathBuf,
    chunk_size: u64,
    map: Mutex<HashMap<Key, Arc<Export>>>,
    /// Serialises changes, so the file on disk and the map agree.
    writer: tokio::sync::Mutex<()>,
    /// Signalled on every change (the heartbeat announces it at once).
    changed: Notify,
}

impl Exports {
    /// Opens (creating) the state directory and loads the exports in it.
    /// A damaged export file is skipped with a warning.
    pub fn open(
        state_dir: &Path,
        chunk_size: u64,
        limits: &ManifestLimits,
    ) -> Result<Self, ExportError> {
        let dir = state_dir.join("exports");
        let cache_dir = state_dir.join("cache");
        for d in [&dir, &cache_dir] {
            use std::os::unix::fs::DirBuilderExt;
            use std::os::unix::fs::PermissionsExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(d)
                .map_err(io(d))?;
            // Made by an older agent with the umask's bits: the agent's alone now.
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).map_err(io(d))?;
        }
        let mut map = HashMap::new();
        for dent in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let path = dent.map_err(io(&dir))?.path();
            if path.extension().is_none_or(|e| e != "export") {
                // A temporary file left by a crash mid-write.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            match load(&path, limits) {
                Ok(e) => {
                    tracing::debug!(key = %e.key, version = %e.version, path = %e.path.display(), "loaded export");
                    map.insert(e.key.clone(), Arc::new(e));
                }
                Err(e) => tracing::warn!(error = %e, "skipping a damaged export record"),
            }
        }
        Ok(Exports {
            dir,
            cache_dir,
            chunk_size,
            map: Mutex::new(map),
            writer: tokio::sync::Mutex::new(()),
            changed: Notify::new(),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Arc<Export>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, key: &Key) -> Option<Arc<Export>> {
        self.table().get(key).cloned()
    }

    /// Every export, sorted by key.
    pub fn all(&self) -> Vec<Arc<Export>> {
        let mut v: Vec<_> = self.table().values().cloned().collect();
        v.sort_by(|a, b| a.key.cmp(&b.key));
        v
    }

    /// What the heartbeat announces, from a snapshot of [`Exports::all`].
    pub fn serves(exports: &[Arc<Export>]) -> Vec<Served> {
        exports
            .iter()
            .map(|e| Served {
                key: e.key.clone(),
                version: e.version.clone(),
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.table().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves when an export was added or removed since the last call.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Where the scan cache of a local export of `key` is kept.
    pub fn scan_cache(&self, key: &Key) -> PathBuf {
        self.cache_dir.join(format!("{}.scan", name_of(key)))
    }

    fn file_of(&self, key: &Key) -> PathBuf {
        self.dir.join(format!("{}.export", name_of(key)))
    }

    /// Persists and serves `export`, replacing the key's previous export,
    /// which is returned.
    pub async fn insert(&self, export: Export) -> Result<Option<Arc<Export>>, ExportError> {
        let _w = self.writer.lock().await;
        let export = Arc::new(export);
        let path = self.file_of(&export.key);
        let e = export.clone();
        kt_sync::task::spawn(move || store(&path, &e))
            .await
            .map_err(|j| ExportError::Worker(j.0))??;
        let old = self.table().insert(export.key.clone(), export);
        self.changed.notify_one();
        Ok(old)
    }

    /// Stops serving `key` if its export is still `only` (that very export,
    /// not just the same version: an identical tree exported again after
    /// the metadata server dropped the first is a new export), or whatever
    /// it is with `None`; returns whether it was removed.
    pub async fn remove(&self, key: &Key, only: Option<&Arc<Export>>) -> Result<bool, ExportError> {
        let _w = self.writer.lock().await;
        let matches = self
            .get(key)
            .is_some_and(|e| only.is_none_or(|o| Arc::ptr_eq(&e, o)));
        if !matches {
            return Ok(false);
        }
        let path = self.file_of(key);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&path)(e).into()),
            _ => {}
        }
        let _ = std::fs::remove_file(self.scan_cache(key));
        self.table().remove(key);
        self.changed.notify_one();
        Ok(true)
    }
}

fn store(path: &Path, e: &Export) -> Result<(), ExportError> {
    let header = ExportHeader {
        key: e.key.clone(),
        version: e.version.clone(),
        path: e.path.clone(),
        origin: e.origin,
        options: e.options.clone(),
    };
    let doc = kt_types::codec::encode_document(&header, &e.manifest);
    let tmp = path.with_extension("tmp");
    let mut f = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io(&tmp))?
    };
    f.write_all(&doc).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    Ok(std::fs::rename(&tmp, path).map_err(io(path))?)
}

fn load(path: &Path, limits: &ManifestLimits) -> Result<Export, ExportError> {
    let damaged = |message: String| FileError::Damaged {
        path: path.to_owned(),
        message,
    };
    let bytes = std::fs::read(path).map_err(io(path))?;
    let (h, encoded): (ExportHeader, &[u8]) =
        kt_types::codec::split_document(&bytes).map_err(|e| damaged(e.to_string()))?;
    let manifest = kt_types::codec::decode(encoded).map_err(|e| damaged(e.to_string()))?;
    manifest
        .validate(limits)
        .map_err(|e| damaged(e.to_string()))?;
    Ok(Export {
        key: h.key,
        version: h.version,
        path: h.path,
        origin: h.origin,
        options: h.options,
        manifest: Arc::new(manifest),
    })
}

impl ReadSource for Exports {
    async fn open(&self, key: &Key) -> Result<OpenVersion, ApiError> {
        let e = self
            .get(key)
            .ok_or_else(|| ApiError::not_found(format!("key {key} is not served by this agent")))?;
        Ok(OpenVersion {
            key: e.key.clone(),
            version: e.version.clone(),
            files: e.files(),
            manifest: e.manifest.clone(),
            chunk_size: self.chunk_size,
            // The user's files: reached through real directories only.
            check_links: true,
            // Not resolved here: counted under the key's first segment.
            owner: None,
        })
    }

    /// Nothing to release: the agent never deletes what it serves, and a
    /// lease keeps its manifest (a replaced export's files are the user's).
    async fn close(&self, _opened: &OpenVersion) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(dir: &Path, key: &str, version: &str) -> Export {
        std::fs::create_dir_all(dir.join("tree")).unwrap();
        std::fs::write(dir.join("tree/f"), key.as_bytes()).unwrap();
        let m = kt_sync::scan(&dir.join("tree"), &mut kt_sync::ScanCache::default()).unwrap();
        Export {
            key: Key::parse(key).unwrap(),
            version: version.into(),
            path: dir.join("tree"),
            origin: true,
            options: PutOptions {
                ttl_secs: Some(60),
                ..Default::default()
            },
            manifest: Arc::new(m),
        }
    }

    #[tokio::test]
    async fn exports_survive_a_reopen_and_removal_is_by_export() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let limits = ManifestLimits::default();
        let ex = Exports::open(&state, 1024, &limits).unwrap();
        assert!(ex.is_empty());
        let a = export(dir.path(), "team/a", "v1");
        assert!(ex.insert(a.clone()).await.unwrap().is_none());
        ex.insert(export(dir.path(), "team/b", "v1")).await.unwrap();
        // A leftover temporary file and a damaged record are skipped.
        std::fs::write(state.join("exports/x.tmp"), b"half").unwrap();
        std::fs::write(state.join("exports/bad.export"), b"nonsense").unwrap();
        let again = Exports::open(&state, 1024, &limits).unwrap();
        assert_eq!(again.len(), 2);
        assert_eq!(*again.get(&a.key).unwrap(), a);
        assert!(!state.join("exports/x.tmp").exists());
        // Only the export named is removed: not the same version exported again.
        let announced = again.get(&a.key).unwrap();
        again.insert(a.clone()).await.unwrap();
        assert!(!again.remove(&a.key, Some(&announced)).await.unwrap());
        assert!(again.get(&a.key).is_some());
        let current = again.get(&a.key).unwrap();
        assert!(again.remove(&a.key, Some(&current)).await.unwrap());
        let third = Exports::open(&state, 1024, &limits).unwrap();
        assert_eq!(
            Exports::serves(&third.all()),
            vec![Served {
                key: Key::parse("team/b").unwrap(),
                version: "v1".into()
            }]
        );
    }

    #[tokio::test]
    async fn reads_open_exports_only() {
        let dir = tempfile::tempdir().unwrap();
        let ex = Exports::open(&dir.path().join("s"), 1024, &ManifestLimits::default()).unwrap();
        let v1 = export(dir.path(), "k", "v1");
        ex.insert(v1.clone()).await.unwrap();
        let opened = ex.open(&v1.key).await.unwrap();
        assert_eq!(opened.version, "v1");
        assert!(opened.check_links);
        assert_eq!(opened.files, Files::Under(dir.path().join("tree")));
        let other = ex.open(&Key::parse("other").unwrap()).await;
        assert_eq!(other.unwrap_err().code, kt_types::ErrorCode::NotFound);
    }
}
