//! Test data from a seeded RNG: a tree of many small files, one large file, and
//! rounds of changes to the small tree.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

/// The seed every generator starts from, so runs are comparable.
pub const SEED: u64 = 0x6b74_2d62_656e_6368;

/// Directories the small files are spread over.
pub const SMALL_DIRS: usize = 100;

/// Size of each small file.
pub const SMALL_FILE_SIZE: usize = 4 << 10;

/// A tree of equally sized small files that can be changed in rounds.
#[derive(Debug)]
pub struct SmallTree {
    root: PathBuf,
    /// Relative paths of the files, in creation order.
    files: Vec<PathBuf>,
    file_size: usize,
    rng: SmallRng,
    rounds: u64,
}

impl SmallTree {
    /// Writes `count` files of `file_size` random bytes into at most `dirs`
    /// directories under `root` (created if missing).
    pub fn generate(
        root: &Path,
        count: usize,
        dirs: usize,
        file_size: usize,
        seed: u64,
    ) -> anyhow::Result<Self> {
        let dirs = dirs.clamp(1, count.max(1));
        let mut rng = SmallRng::seed_from_u64(seed);
        for d in 0..dirs {
            let p = root.join(dir_name(d));
            fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
        }
        let mut buf = vec![0u8; file_size];
        let mut files = Vec::with_capacity(count);
        for i in 0..count {
            let rel = Path::new(&dir_name(i % dirs)).join(format!("f{i:06}.bin"));
            rng.fill_bytes(&mut buf);
            let abs = root.join(&rel);
            fs::write(&abs, &buf).with_context(|| format!("writing {}", abs.display()))?;
            files.push(rel);
        }
        Ok(SmallTree {
            root: root.to_owned(),
            files,
            file_size,
            rng,
            rounds: 0,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    pub fn total_bytes(&self) -> u64 {
        (self.files.len() * self.file_size) as u64
    }

    /// Rewrites `count` distinct, randomly chosen files with new random bytes of
    /// the same size, and gives them an mtime no earlier round used (rsync's
    /// quick check compares whole seconds, so a same-second rewrite of a
    /// same-size file would otherwise look unchanged to it). Returns the
    /// relative paths changed.
    pub fn change(&mut self, count: usize) -> anyhow::Result<Vec<PathBuf>> {
        let count = count.min(self.files.len());
        self.rounds += 1;
        let mtime = UNIX_EPOCH + Duration::from_secs(1_600_000_000 + self.rounds * 60);
        let picked = rand::seq::index::sample(&mut self.rng, self.files.len(), count);
        let mut buf = vec![0u8; self.file_size];
        let mut changed = Vec::with_capacity(count);
        for i in picked {
            let rel = &self.files[i];
            let abs = self.root.join(rel);
            self.rng.fill_bytes(&mut buf);
            rewrite(&abs, &buf, mtime)?;
            changed.push(rel.clone());
        }
        Ok(changed)
    }
}

fn dir_name(d: usize) -> String {
    format!("d{d:03}")
}

fn rewrite(path: &Path, data: &[u8], mtime: SystemTime) -> anyhow::Result<()> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    f.write_all(data)
        .and_then(|()| f.set_modified(mtime))
        .with_context(|| format!("rewriting {}", path.display()))
}

/// Writes a file of `size` random bytes.
pub fn generate_large(path: &Path, size: u64, seed: u64) -> anyhow::Result<()> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut f = fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut buf = vec![0u8; 8 << 20];
    let mut left = size;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill_bytes(&mut buf[..n]);
        f.write_all(&buf[..n])
            .with_context(|| format!("writing {}", path.display()))?;
        left -= n as u64;
    }
    f.sync_all()
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_and_changes_deterministically() {
        let d = std::env::temp_dir().join(format!("kt-bench-data-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        let mut t = SmallTree::generate(&d.join("a"), 50, 10, 64, 7).unwrap();
        let t2 = SmallTree::generate(&d.join("b"), 50, 10, 64, 7).unwrap();
        assert_eq!(t.len(), 50);
        assert_eq!(t.total_bytes(), 50 * 64);
        for rel in &t.files {
            assert_eq!(
                fs::read(d.join("a").join(rel)).unwrap(),
                fs::read(d.join("b").join(rel)).unwrap()
            );
        }
        drop(t2);
        let before = fs::read(d.join("a").join(&t.files[0])).unwrap();
        let changed = t.change(5).unwrap();
        assert_eq!(changed.len(), 5);
        let mut uniq = changed.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), 5);
        for rel in &changed {
            let md = fs::metadata(d.join("a").join(rel)).unwrap();
            assert_eq!(md.len(), 64);
            assert_eq!(
                md.modified().unwrap(),
                UNIX_EPOCH + Duration::from_secs(1_600_000_060)
            );
        }
        if !changed.contains(&t.files[0]) {
            assert_eq!(fs::read(d.join("a").join(&t.files[0])).unwrap(), before);
        }
        generate_large(&d.join("big"), 3 << 20, 1).unwrap();
        assert_eq!(fs::metadata(d.join("big")).unwrap().len(), 3 << 20);
        fs::remove_dir_all(&d).unwrap();
    }
}
