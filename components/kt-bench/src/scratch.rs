//! A uniquely named work directory, removed with everything in it on drop.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;

#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Creates `parent/kt-bench-<pid>-<nanos>` (the parent must exist).
    pub fn create(parent: &Path) -> anyhow::Result<Self> {
        anyhow::ensure!(
            parent.is_dir(),
            "{} is not a directory (pass --dir)",
            parent.display()
        );
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let path = parent.join(format!("kt-bench-{}-{nanos:09}", std::process::id()));
        std::fs::create_dir(&path)
            .with_context(|| format!("creating work directory {}", path.display()))?;
        Ok(ScratchDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates (and returns) a subdirectory.
    pub fn subdir(&self, name: &str) -> anyhow::Result<PathBuf> {
        let p = self.path.join(name);
        std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
        Ok(p)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("warning: could not remove {}: {e}", self.path.display());
        }
    }
}

/// Empties `dir` by removing and re-creating it.
pub fn recreate_dir(dir: &Path) -> anyhow::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", dir.display())),
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_on_drop() {
        let parent = std::env::temp_dir();
        let s = ScratchDir::create(&parent).unwrap();
        let p = s.path().to_owned();
        let sub = s.subdir("a/b").unwrap();
        std::fs::write(sub.join("f"), b"x").unwrap();
        recreate_dir(&sub).unwrap();
        assert!(sub.is_dir() && std::fs::read_dir(&sub).unwrap().next().is_none());
        drop(s);
        assert!(!p.exists());
    }
}
