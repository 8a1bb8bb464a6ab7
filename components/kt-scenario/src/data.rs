//! Deterministic data sets (`data:` in a scenario) and the content digests
//! getters are checked against.
//!
//! The same spec and seed give the same bytes on every machine, so snapshots
//! may include file counts and byte counts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::format::{DataSpec, Size, SizeRange};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("data set `{name}`: {message}")]
    Spec { name: String, message: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("scanning {path}: {source}")]
    Scan {
        path: PathBuf,
        #[source]
        source: kt_sync::SyncError,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.to_owned(),
        source,
    }
}

/// xorshift64*: small, fast and the same everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// Log-uniform in `[min, max]`: many small files, a few bigger ones.
    pub fn size_in(&mut self, r: SizeRange) -> u64 {
        let (lo, hi) = (r.min.0.max(1) as f64, r.max.0.max(1) as f64);
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let v = (lo.ln() + u * (hi.ln() - lo.ln())).exp().round() as u64;
        v.clamp(r.min.0, r.max.0)
    }
}

/// Writes `len` pseudo-random bytes from `rng` to `path`.
fn write_random(path: &Path, len: u64, rng: &mut Rng) -> Result<(), DataError> {
    use std::io::Write;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io(parent))?;
    }
    // A fresh inode: `path` may be a hard link into another data set.
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(path)(e)),
        _ => {}
    }
    let f = std::fs::File::create(path).map_err(io(path))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let mut buf = vec![0u8; 1 << 16];
    let mut left = len;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill(&mut buf[..n]);
        w.write_all(&buf[..n]).map_err(io(path))?;
        left -= n as u64;
    }
    w.flush().map_err(io(path))
}

const DEFAULT_SIZES: SizeRange = SizeRange {
    min: Size(1024),
    max: Size(64 * 1024),
};

/// The directory (relative) the `i`th of `files` small files goes into.
fn dir_of(i: usize, dirs: usize) -> String {
    if dirs == 0 {
        return String::new();
    }
    let d = i % dirs;
    // Up to three levels: d/7 groups under a parent, d/49 under a grandparent.
    match d {
        0..7 => format!("d{d}/"),
        7..49 => format!("d{}/d{}/", d / 7, d % 7),
        _ => format!("d{}/d{}/d{}/", d / 49, (d / 7) % 7, d % 7),
    }
}

/// Checks specs and references (`from` chains must end, names must exist).
pub fn check(sets: &BTreeMap<String, DataSpec>) -> Vec<(String, String)> {
    let mut errs = Vec::new();
    for (name, s) in sets {
        let mut err = |m: String| errs.push((name.clone(), m));
        if s.file.is_some() && (s.files > 0 || !s.large.is_empty() || s.from.is_some()) {
            err("`file` makes a single-file data set; it cannot be combined with files, large or from".into());
        }
        if s.from.is_none() && s.file.is_none() && s.files == 0 && s.large.is_empty() {
            err("empty data set: give files, large, file or from".into());
        }
        if s.from.is_none() && (s.change > 0 || s.add > 0 || s.delete > 0) {
            err("change/add/delete need `from`".into());
        }
        if let Some(r) = s.size
            && r.min > r.max
        {
            err(format!(
                "size.min ({}) is above size.max ({})",
                r.min, r.max
            ));
        }
        // Follow `from` to its end, refusing unknown names and cycles.
        let mut seen = vec![name.as_str()];
        let mut cur = s;
        while let Some(base) = &cur.from {
            match sets.get(base) {
                None => {
                    err(format!("`from: {base}` names no data set"));
                    break;
                }
                Some(_) if seen.contains(&base.as_str()) => {
                    err(format!("`from` chain loops back to `{base}`"));
                    break;
                }
                Some(b) if b.file.is_some() => {
                    err(format!(
                        "`from: {base}` is a single file; only trees can be changed"
                    ));
                    break;
                }
                Some(b) => {
                    seen.push(base);
                    cur = b;
                }
            }
        }
    }
    errs
}

/// Generates every data set below `root` (`root/<name>`), bases first.
/// Returns each set's path.
pub fn generate_all(
    sets: &BTreeMap<String, DataSpec>,
    root: &Path,
) -> Result<BTreeMap<String, PathBuf>, DataError> {
    let mut done: BTreeMap<String, PathBuf> = BTreeMap::new();
    while done.len() < sets.len() {
        let before = done.len();
        for (name, spec) in sets {
            if done.contains_key(name) {
                continue;
            }
            if let Some(base) = &spec.from
                && !done.contains_key(base)
            {
                continue;
            }
            let path = root.join(name);
            let base = spec.from.as_ref().and_then(|b| done.get(b)).cloned();
            generate(spec, base.as_deref(), &path)?;
            done.insert(name.clone(), path);
        }
        if done.len() == before {
            return Err(DataError::Spec {
                name: sets
                    .keys()
                    .find(|k| !done.contains_key(*k))
                    .cloned()
                    .unwrap_or_default(),
                message: "unresolvable `from` chain".into(),
            });
        }
    }
    Ok(done)
}

/// Generates one data set at `path` (from `base` when the spec has `from`).
pub fn generate(spec: &DataSpec, base: Option<&Path>, path: &Path) -> Result<(), DataError> {
    let mut rng = Rng::new(spec.seed);
    if let Some(size) = spec.file {
        return write_random(path, size.0, &mut rng);
    }
    std::fs::create_dir_all(path).map_err(io(path))?;
    if let Some(base) = base {
        copy_tree(base, path)?;
    }
    let sizes = spec.size.unwrap_or(DEFAULT_SIZES);
    let dirs = spec.dirs.unwrap_or(0);
    for i in 0..spec.files {
        let size = rng.size_in(sizes);
        write_random(
            &path.join(format!("{}f{i:05}.bin", dir_of(i, dirs))),
            size,
            &mut rng,
        )?;
    }
    for (i, size) in spec.large.iter().enumerate() {
        write_random(&path.join(format!("large-{i}.bin")), size.0, &mut rng)?;
    }
    if spec.change + spec.delete > 0 {
        let mut files = list_files(path)?;
        for _ in 0..spec.change.min(files.len()) {
            let f = files.remove(rng.below(files.len() as u64) as usize);
            let len = std::fs::metadata(&f).map_err(io(&f))?.len().max(1);
            write_random(&f, len, &mut rng)?;
        }
        for _ in 0..spec.delete.min(files.len()) {
            let f = files.remove(rng.below(files.len() as u64) as usize);
            std::fs::remove_file(&f).map_err(io(&f))?;
        }
    }
    for i in 0..spec.add {
        let size = rng.size_in(sizes);
        write_random(&path.join(format!("added-{i:04}.bin")), size, &mut rng)?;
    }
    Ok(())
}

/// Every regular file below `root`, sorted.
fn list_files(root: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).map_err(io(&d))? {
            let e = e.map_err(io(&d))?;
            let t = e.file_type().map_err(io(&d))?;
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Hard-links every file of `from` into `to` (data sets are never written
/// in place, so sharing inodes is safe and costs no copying).
fn copy_tree(from: &Path, to: &Path) -> Result<(), DataError> {
    for f in list_files(from)? {
        let rel = f.strip_prefix(from).unwrap_or(&f);
        let dst = to.join(rel);
        if let Some(p) = dst.parent() {
            std::fs::create_dir_all(p).map_err(io(p))?;
        }
        std::fs::hard_link(&f, &dst)
            .or_else(|_| std::fs::copy(&f, &dst).map(|_| ()))
            .map_err(io(&dst))?;
    }
    Ok(())
}

/// What a tree holds, for comparing a getter's copy with the source: paths,
/// kinds, sizes, modes, link targets and blake3 content hashes (mtimes are
/// left out: they are checked by the sync engine's own tests). A single
/// file's own name is left out too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digest {
    pub hex: String,
    pub files: u64,
    pub bytes: u64,
}

pub fn digest(path: &Path) -> Result<Digest, DataError> {
    let m = kt_sync::scan(path, &mut kt_sync::ScanCache::default()).map_err(|source| {
        DataError::Scan {
            path: path.to_owned(),
            source,
        }
    })?;
    let mut h = blake3::Hasher::new();
    let (mut files, mut bytes) = (0, 0);
    // A single file's entry is named after the file; the name is the
    // caller's choice (`--dest model.bin`), not content.
    let single = m.root == kt_types::RootKind::File;
    for e in &m.entries {
        if !single {
            h.update(e.path.as_bytes());
        }
        h.update(&[0]);
        h.update(format!("{:?}|{}|{:o}|", e.kind, e.size, e.mode).as_bytes());
        if let Some(hash) = &e.hash {
            h.update(hash.to_string().as_bytes());
            files += 1;
            bytes += e.size;
        }
        if let Some(t) = &e.target {
            h.update(t.as_bytes());
        }
        h.update(&[0xff]);
    }
    Ok(Digest {
        hex: h.finalize().to_hex().to_string(),
        files,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(seed: u64, files: usize) -> DataSpec {
        DataSpec {
            seed,
            files,
            size: None,
            dirs: Some(20),
            large: vec![Size(300_000)],
            file: None,
            from: None,
            change: 0,
            add: 0,
            delete: 0,
        }
    }

    #[test]
    fn same_seed_same_bytes_other_seed_other_bytes() {
        let d = tempfile::tempdir().unwrap();
        generate(&spec(1, 40), None, &d.path().join("a")).unwrap();
        generate(&spec(1, 40), None, &d.path().join("b")).unwrap();
        generate(&spec(2, 40), None, &d.path().join("c")).unwrap();
        let (a, b, c) = (
            digest(&d.path().join("a")).unwrap(),
            digest(&d.path().join("b")).unwrap(),
            digest(&d.path().join("c")).unwrap(),
        );
        assert_eq!(a, b);
        assert_ne!(a.hex, c.hex);
        assert_eq!(a.files, 41);
        // Sizes stay in the default range (plus the large file).
        assert!(a.bytes >= 40 * 1024 + 300_000 && a.bytes <= 40 * 65536 + 300_000);
    }

    #[test]
    fn derived_sets_change_add_and_delete_without_touching_the_base() {
        let d = tempfile::tempdir().unwrap();
        let sets = BTreeMap::from([
            ("base".to_owned(), spec(3, 30)),
            (
                "next".to_owned(),
                DataSpec {
                    from: Some("base".into()),
                    change: 4,
                    add: 2,
                    delete: 3,
                    files: 0,
                    large: vec![],
                    ..spec(4, 0)
                },
            ),
        ]);
        assert!(check(&sets).is_empty());
        let paths = generate_all(&sets, d.path()).unwrap();
        let base_before = digest(&paths["base"]).unwrap();
        let next = digest(&paths["next"]).unwrap();
        assert_eq!(next.files, base_before.files + 2 - 3);
        assert_ne!(next.hex, base_before.hex);
        // The base is unchanged after deriving from it.
        generate(&spec(3, 30), None, &d.path().join("again")).unwrap();
        assert_eq!(
            digest(&paths["base"]).unwrap(),
            digest(&d.path().join("again")).unwrap()
        );
    }

    #[test]
    fn bad_specs_are_named() {
        let mut bad = spec(1, 0);
        bad.large.clear();
        let mut looped = spec(1, 1);
        looped.from = Some("looped".into());
        let sets = BTreeMap::from([("empty".to_owned(), bad), ("looped".to_owned(), looped)]);
        let errs = check(&sets);
        assert!(
            errs.iter()
                .any(|(n, m)| n == "empty" && m.contains("empty"))
        );
        assert!(
            errs.iter()
                .any(|(n, m)| n == "looped" && m.contains("loops"))
        );
    }

    #[test]
    fn log_uniform_sizes_stay_in_range() {
        let mut r = Rng::new(9);
        let range = SizeRange {
            min: Size(10),
            max: Size(1000),
        };
        for _ in 0..1000 {
            let v = r.size_in(range);
            assert!((10..=1000).contains(&v));
        }
    }
}
