//! Versioned directories with an atomic switch.
//!
//! ```text
//! <dir>/current -> v-<id>        the published version (a symlink, swapped by rename)
//! <dir>/v-<id>/                  a version's tree (a staging area until published)
//! <dir>/v-<id>.meta              its manifest and options (opaque to this module), written before it is published
//! <dir>/v-<id>.put               a staging version that may be resumed: what it is for (opaque here)
//! <dir>/v-<id>.chunks            what arrived of it (opaque here), kept beside it
//! ```
//!
//! Readers resolve `current` once and read that version; a new version is staged
//! beside it and published by renaming a fresh symlink over `current`, so readers
//! see the old tree or the new one, never a mix. A process killed at any point
//! leaves `current` on a complete version; [`VersionedDir::cleanup`] removes the
//! leftovers at the next start.

use std::fs;
use std::io::Write;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, SyncError};

const CURRENT: &str = "current";
const META_SUFFIX: &str = ".meta";
const RESUME_SUFFIX: &str = ".put";
const CHUNKS_SUFFIX: &str = ".chunks";

#[derive(Debug, Clone)]
pub struct VersionedDir {
    dir: PathBuf,
}

impl VersionedDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        VersionedDir { dir: dir.into() }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The published version id, if any.
    pub fn current(&self) -> Result<Option<String>, SyncError> {
        let link = self.dir.join(CURRENT);
        match fs::read_link(&link) {
            Ok(t) => Ok(t
                .to_str()
                .and_then(|s| s.strip_prefix("v-"))
                .map(str::to_owned)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(SyncError::io(link, e)),
        }
    }

    pub fn version_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("v-{id}"))
    }

    fn meta_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("v-{id}{META_SUFFIX}"))
    }

    /// The marker of a staging version that may be resumed after a restart
    /// ([`VersionedDir::cleanup_keeping`] keeps those its caller names).
    pub fn resume_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("v-{id}{RESUME_SUFFIX}"))
    }

    /// A log kept beside a resumable staging version.
    pub fn chunks_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("v-{id}{CHUNKS_SUFFIX}"))
    }

    /// Ids of the staging versions with a resume marker, and the marker's
    /// path.
    pub fn resumable(&self) -> Vec<(String, PathBuf)> {
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|d| {
                let name = d.file_name().to_str()?.to_owned();
                let id = name.strip_prefix("v-")?.strip_suffix(RESUME_SUFFIX)?;
                Some((id.to_owned(), d.path()))
            })
            .filter(|(id, _)| self.version_path(id).is_dir())
            .collect()
    }

    /// Forgets that a version may be resumed (it was published).
    pub fn drop_resume(&self, id: &str) {
        let _ = fs::remove_file(self.resume_path(id));
        let _ = fs::remove_file(self.chunks_path(id));
    }

    /// Creates an empty staging version and returns its id.
    pub fn stage(&self) -> Result<String, SyncError> {
        fs::create_dir_all(&self.dir).at(&self.dir)?;
        let id = format!(
            "{:x}-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or_default(),
            uuid::Uuid::new_v4().simple()
        );
        let p = self.version_path(&id);
        fs::create_dir(&p).at(&p)?;
        Ok(id)
    }

    /// Writes a version's description (its manifest and whatever the caller keeps with it).
    pub fn write_meta(&self, id: &str, bytes: &[u8]) -> Result<(), SyncError> {
        let p = self.meta_path(id);
        let mut f = fs::File::create(&p).at(&p)?;
        f.write_all(bytes).at(&p)?;
        f.sync_all().at(&p)
    }

    pub fn read_meta(&self, id: &str) -> Result<Vec<u8>, SyncError> {
        let p = self.meta_path(id);
        fs::read(&p).at(&p)
    }

    /// Atomically makes `id` the current version. Returns the previous one.
    pub fn publish(&self, id: &str) -> Result<Option<String>, SyncError> {
        let previous = self.current()?;
        let tmp = self.dir.join(format!("{CURRENT}.tmp-{id}"));
        let _ = fs::remove_file(&tmp);
        symlink(format!("v-{id}"), &tmp).at(&tmp)?;
        fs::rename(&tmp, self.dir.join(CURRENT)).at(&self.dir)?;
        // Published from here on: a failing directory sync is reported, not
        // returned (the caller must not treat the version as unpublished).
        if let Err(e) = fs::File::open(&self.dir).and_then(|d| d.sync_all()) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "directory sync after publish failed");
        }
        Ok(previous)
    }

    /// Deletes a version's tree, manifest and resume files.
    pub fn remove_version(&self, id: &str) -> Result<(), SyncError> {
        let _ = fs::remove_file(self.meta_path(id));
        self.drop_resume(id);
        force_remove_dir_all(&self.version_path(id))
    }

    /// Removes the whole directory: every version and the `current` link.
    pub fn remove_all(&self) -> Result<(), SyncError> {
        force_remove_dir_all(&self.dir)
    }

    /// Removes the directory when it holds no version at all (no `current`, no
    /// `v-*` of an upload in progress): what a never-published key leaves behind.
    pub fn remove_if_unused(&self) -> Result<(), SyncError> {
        let rd = match fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(SyncError::io(&self.dir, e)),
        };
        let in_use = rd.flatten().any(|d| {
            let name = d.file_name();
            let name = name.to_string_lossy();
            name == CURRENT || name.starts_with("v-")
        });
        if in_use {
            Ok(())
        } else {
            force_remove_dir_all(&self.dir)
        }
    }

    /// Removes everything but the current version. Returns whether a current
    /// version exists (when none does, the whole directory was removed).
    pub fn cleanup(&self) -> Result<bool, SyncError> {
        self.cleanup_keeping(|_| false)
    }

    /// Removes everything but the current version and the resumable staging
    /// versions `keep` names (with their resume files). Returns whether a
    /// current version exists; the directory goes when nothing is left.
    pub fn cleanup_keeping(&self, keep: impl Fn(&str) -> bool) -> Result<bool, SyncError> {
        let current = self.current()?;
        let kept: Vec<String> = self
            .resumable()
            .into_iter()
            .map(|(id, _)| id)
            .filter(|id| keep(id))
            .collect();
        if current.is_none() && kept.is_empty() {
            force_remove_dir_all(&self.dir)?;
            return Ok(false);
        }
        let mut keep_names: Vec<String> = vec![CURRENT.to_owned()];
        for id in current.iter().chain(&kept) {
            keep_names.push(format!("v-{id}"));
            keep_names.push(format!("v-{id}{META_SUFFIX}"));
        }
        for id in &kept {
            keep_names.push(format!("v-{id}{RESUME_SUFFIX}"));
            keep_names.push(format!("v-{id}{CHUNKS_SUFFIX}"));
        }
        for dent in fs::read_dir(&self.dir).at(&self.dir)? {
            let dent = dent.at(&self.dir)?;
            let name = dent.file_name().to_string_lossy().into_owned();
            if keep_names.contains(&name) {
                continue;
            }
            if !(name.starts_with("v-") || name.starts_with("current.tmp-")) {
                continue;
            }
            let p = dent.path();
            if dent.file_type().at(&p)?.is_dir() {
                force_remove_dir_all(&p)?;
            } else {
                fs::remove_file(&p).at(&p)?;
            }
        }
        Ok(current.is_some())
    }
}

/// `remove_dir_all` that also works when the tree holds read-only directories
/// (a published tree keeps its owners' modes; a non-root server must make
/// them writable before it can empty them). A missing path is not an error.
pub fn force_remove_dir_all(path: &Path) -> Result<(), SyncError> {
    match fs::remove_dir_all(path) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(_) => {}
    }
    make_dirs_writable(path);
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SyncError::io(path, e)),
    }
}

fn make_dirs_writable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(md) = fs::symlink_metadata(path) else {
        return;
    };
    if !md.is_dir() {
        return;
    }
    let _ = fs::set_permissions(
        path,
        fs::Permissions::from_mode(md.permissions().mode() | 0o700),
    );
    if let Ok(rd) = fs::read_dir(path) {
        for d in rd.flatten() {
            make_dirs_writable(&d.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_publish_and_cleanup() {
        let d = tempfile::tempdir().unwrap();
        let v = VersionedDir::new(d.path().join("k"));
        assert_eq!(v.current().unwrap(), None);
        let a = v.stage().unwrap();
        fs::write(v.version_path(&a).join("f"), b"1").unwrap();
        v.write_meta(&a, b"meta").unwrap();
        assert_eq!(v.publish(&a).unwrap(), None);
        assert_eq!(v.current().unwrap().as_deref(), Some(a.as_str()));
        assert_eq!(fs::read(d.path().join("k/current/f")).unwrap(), b"1");

        // A staged but never published version (a killed put) is a leftover.
        let b = v.stage().unwrap();
        fs::write(v.version_path(&b).join("f"), b"2").unwrap();
        assert!(v.cleanup().unwrap());
        assert!(!v.version_path(&b).exists());
        assert_eq!(fs::read(d.path().join("k/current/f")).unwrap(), b"1");
        assert_eq!(v.read_meta(&a).unwrap(), b"meta");

        let c = v.stage().unwrap();
        assert_eq!(v.publish(&c).unwrap().as_deref(), Some(a.as_str()));
        v.remove_version(&a).unwrap();
        assert!(!v.version_path(&a).exists());
    }

    #[test]
    fn resumable_staging_is_kept_when_asked_and_goes_with_its_version() {
        let d = tempfile::tempdir().unwrap();
        let v = VersionedDir::new(d.path().join("k"));
        let (a, b) = (v.stage().unwrap(), v.stage().unwrap());
        for id in [&a, &b] {
            fs::write(v.resume_path(id), b"digest").unwrap();
            fs::write(v.chunks_path(id), b"log").unwrap();
        }
        // Never published, one staging kept: the directory stays.
        assert!(!v.cleanup_keeping(|id| id == a).unwrap());
        let ids: Vec<String> = v.resumable().into_iter().map(|(id, _)| id).collect();
        assert_eq!(ids, std::slice::from_ref(&a));
        assert!(v.chunks_path(&a).exists() && !v.version_path(&b).exists());
        assert!(!v.chunks_path(&b).exists());
        v.remove_version(&a).unwrap();
        assert!(!v.resume_path(&a).exists() && !v.chunks_path(&a).exists());
        assert!(!v.cleanup_keeping(|_| true).unwrap());
        assert!(!d.path().join("k").exists());
    }

    #[test]
    fn never_published_dir_is_removed() {
        let d = tempfile::tempdir().unwrap();
        let v = VersionedDir::new(d.path().join("k"));
        v.stage().unwrap();
        assert!(!v.cleanup().unwrap());
        assert!(!d.path().join("k").exists());
    }
}
