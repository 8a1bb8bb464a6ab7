//! Walking a tree into a manifest, with a scan cache keyed by inode, size,
//! mtime and ctime so an unchanged tree is re-scanned without re-hashing.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use kt_types::manifest::link_stays_inside;
use kt_types::{Entry, EntryKind, Hash, Manifest, RootKind};
use rayon::prelude::*;

use crate::error::{IoContext, SyncError};

/// Files at least this large are hashed memory-mapped across threads.
const LARGE_FILE: u64 = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    size: u64,
    mtime: i64,
    mtime_nsec: i64,
    ctime: i64,
    ctime_nsec: i64,
}

impl Stamp {
    fn of(md: &fs::Metadata) -> Self {
        Stamp {
            ino: md.ino(),
            size: md.size(),
            mtime: md.mtime(),
            mtime_nsec: md.mtime_nsec(),
            ctime: md.ctime(),
            ctime_nsec: md.ctime_nsec(),
        }
    }
}

/// Remembers the hash of each file by its stat stamp.
#[derive(Debug, Clone, Default)]
pub struct ScanCache {
    entries: HashMap<String, (Stamp, Hash)>,
    /// Files hashed (cache misses) by the last scan.
    pub hashed: u64,
    /// Whether the last scan changed the cache (saving is pointless otherwise).
    pub dirty: bool,
}

impl ScanCache {
    /// Loads a cache file; a missing, unreadable or damaged cache is an empty one.
    pub fn load(path: &Path) -> Self {
        let entries = fs::read(path)
            .ok()
            .and_then(|b| decode_cache(&b))
            .unwrap_or_default();
        ScanCache {
            entries,
            ..Default::default()
        }
    }

    /// Saves atomically (temp file + rename).
    pub fn save(&self, path: &Path) -> Result<(), SyncError> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).at(dir)?;
        }
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        fs::write(&tmp, encode_cache(&self.entries)).at(&tmp)?;
        fs::rename(&tmp, path).at(path)
    }

    /// Records `hash` as the content hash of the file at manifest path
    /// `rel`, as it is now (`md`: its metadata, read after its last write
    /// and rename). A writer that hashed a file while writing it (an S3
    /// ingest) spares the next scan from reading it again; a later change to
    /// the file changes its stamp, and the scan hashes it afresh.
    pub fn insert(&mut self, rel: &str, md: &fs::Metadata, hash: Hash) {
        self.entries.insert(rel.to_owned(), (Stamp::of(md), hash));
        self.dirty = true;
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

const CACHE_MAGIC: &[u8; 4] = b"KTC1";

/// Cache file: magic, count, then per file `path_len:u32 path ino size mtime
/// mtime_nsec ctime ctime_nsec (8 bytes each) hash:32`, little-endian. Binary
/// because a JSON cache of a large tree costs more to parse than the scan saves.
fn encode_cache(entries: &HashMap<String, (Stamp, Hash)>) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + entries.len() * 100);
    out.extend_from_slice(CACHE_MAGIC);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (path, (st, hash)) in entries {
        out.extend_from_slice(&(path.len() as u32).to_le_bytes());
        out.extend_from_slice(path.as_bytes());
        for v in [st.ino, st.size] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [st.mtime, st.mtime_nsec, st.ctime, st.ctime_nsec] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&hash.0);
    }
    out
}

fn decode_cache(buf: &[u8]) -> Option<HashMap<String, (Stamp, Hash)>> {
    fn take<'a>(buf: &'a [u8], pos: &mut usize, n: usize) -> Option<&'a [u8]> {
        let s = buf.get(*pos..pos.checked_add(n)?)?;
        *pos += n;
        Some(s)
    }
    fn word(buf: &[u8], pos: &mut usize) -> Option<[u8; 8]> {
        take(buf, pos, 8)?.try_into().ok()
    }
    let mut pos = 0;
    if take(buf, &mut pos, 4)? != CACHE_MAGIC {
        return None;
    }
    let count = u32::from_le_bytes(take(buf, &mut pos, 4)?.try_into().ok()?) as usize;
    let mut out = HashMap::with_capacity(count.min(buf.len() / 90 + 1));
    for _ in 0..count {
        let len = u32::from_le_bytes(take(buf, &mut pos, 4)?.try_into().ok()?) as usize;
        let path = std::str::from_utf8(take(buf, &mut pos, len)?)
            .ok()?
            .to_owned();
        let stamp = Stamp {
            ino: u64::from_le_bytes(word(buf, &mut pos)?),
            size: u64::from_le_bytes(word(buf, &mut pos)?),
            mtime: i64::from_le_bytes(word(buf, &mut pos)?),
            mtime_nsec: i64::from_le_bytes(word(buf, &mut pos)?),
            ctime: i64::from_le_bytes(word(buf, &mut pos)?),
            ctime_nsec: i64::from_le_bytes(word(buf, &mut pos)?),
        };
        let hash = Hash(take(buf, &mut pos, 32)?.try_into().ok()?);
        out.insert(path, (stamp, hash));
    }
    (pos == buf.len()).then_some(out)
}

/// Hashes one file's content.
pub fn hash_file(path: &Path, size: u64) -> Result<Hash, SyncError> {
    hash_and_keep(path, size, false).map(|(h, _)| h)
}

/// Hashes one file; with `keep`, also returns the content (small files only).
fn hash_and_keep(path: &Path, size: u64, keep: bool) -> Result<(Hash, Option<Bytes>), SyncError> {
    let mut hasher = blake3::Hasher::new();
    if size >= LARGE_FILE {
        // Large files: memory-mapped and hashed on all cores.
        hasher.update_mmap_rayon(path).at(path)?;
        return Ok((Hash(*hasher.finalize().as_bytes()), None));
    }
    let data = fs::read(path).at(path)?;
    hasher.update(&data);
    let hash = Hash(*hasher.finalize().as_bytes());
    Ok((hash, keep.then(|| Bytes::from(data))))
}

/// Contents of small files read while hashing, by manifest path, so that a
/// transfer right after the scan need not read them again.
pub type Kept = HashMap<String, Bytes>;

fn name_of(path: &Path) -> Result<String, SyncError> {
    path.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_owned)
        .ok_or_else(|| SyncError::NonUtf8 {
            path: path.to_owned(),
        })
}

/// One entry found by the walk; files carry their stat stamp (their path
/// is built from the root only when the cache cannot vouch for them).
struct Found {
    entry: Entry,
    file: Option<Stamp>,
}

/// Scans `root` (a directory or a single file) into a sorted manifest.
///
/// Symlinks are recorded as links and never followed; a link whose target
/// leaves the tree is an error. Sockets, FIFOs and devices are skipped.
/// Subdirectories are walked and files hashed in parallel.
pub fn scan(root: &Path, cache: &mut ScanCache) -> Result<Manifest, SyncError> {
    scan_keeping(root, cache, 0).map(|(m, _)| m)
}

/// [`scan`], also keeping the contents of the files it had to read, up to
/// `keep_budget` bytes in all (files hashed through the cache are not read).
pub fn scan_keeping(
    root: &Path,
    cache: &mut ScanCache,
    keep_budget: u64,
) -> Result<(Manifest, Kept), SyncError> {
    scan_deferring(root, cache, keep_budget, None).map(|(m, kept, _)| (m, kept))
}

/// [`scan_keeping`], leaving unhashed (`hash: None`) the files larger than
/// `defer_above` that the cache has no hash for; their manifest indices
/// come third, ascending. A put hashes them while it sends them, and
/// records their hashes in the cache once the store has them
/// ([`ScanCache::insert`]).
pub fn scan_deferring(
    root: &Path,
    cache: &mut ScanCache,
    keep_budget: u64,
    defer_above: Option<u64>,
) -> Result<(Manifest, Kept, Vec<u32>), SyncError> {
    let md = fs::metadata(root).at(root)?;
    let mut manifest = Manifest::default();
    let mut found = if md.is_file() {
        manifest.root = RootKind::File;
        found(&|| root.to_owned(), name_of(root)?, &md)?
            .into_iter()
            .collect()
    } else {
        walk(root, "")?
    };
    found.sort_unstable_by(|a, b| a.entry.path.as_bytes().cmp(b.entry.path.as_bytes()));
    // The cache is updated in place: an unchanged tree (the common re-put)
    // costs a lookup per file, not a fresh map of every path.
    let mut entries = std::mem::take(&mut cache.entries);
    let mut files = 0usize;
    let mut misses = Vec::new();
    let mut deferred = Vec::new();
    for (index, f) in found.iter_mut().enumerate() {
        let Some(stamp) = f.file.take() else {
            continue;
        };
        files += 1;
        match entries.get(&f.entry.path) {
            Some((cached, hash)) if *cached == stamp => f.entry.hash = Some(*hash),
            _ if defer_above.is_some_and(|d| stamp.size > d) => deferred.push(index as u32),
            _ => misses.push((index, stamp)),
        }
    }
    let mut budget = keep_budget;
    let misses: Vec<(usize, PathBuf, Stamp, bool)> = misses
        .into_iter()
        .map(|(index, stamp)| {
            let keep = stamp.size < LARGE_FILE && stamp.size <= budget;
            if keep {
                budget -= stamp.size;
            }
            let abs = source_path(root, &manifest, &found[index].entry.path);
            (index, abs, stamp, keep)
        })
        .collect();
    let hashed: Vec<(usize, Stamp, Hash, Option<Bytes>)> = misses
        .into_par_iter()
        .map(|(index, abs, stamp, keep)| {
            hash_and_keep(&abs, stamp.size, keep).map(|(h, data)| (index, stamp, h, data))
        })
        .collect::<Result<_, _>>()?;
    cache.hashed = hashed.len() as u64;
    let mut kept = Kept::new();
    for (index, stamp, hash, data) in hashed {
        let e = &mut found[index].entry;
        e.hash = Some(hash);
        entries.insert(e.path.clone(), (stamp, hash));
        if let Some(d) = data.filter(|d| d.len() as u64 == e.size) {
            kept.insert(e.path.clone(), d);
        }
    }
    // Every file found is in the cache now; more entries means some were
    // of files gone since: only those found stay.
    let gone = entries.len() > files;
    if gone {
        let here: std::collections::HashSet<&str> = found
            .iter()
            .filter(|f| f.entry.kind == EntryKind::File)
            .map(|f| f.entry.path.as_str())
            .collect();
        entries.retain(|path, _| here.contains(path.as_str()));
    }
    cache.dirty = cache.hashed > 0 || gone;
    cache.entries = entries;
    manifest.entries = found.into_iter().map(|f| f.entry).collect();
    Ok((manifest, kept, deferred))
}

fn walk(dir: &Path, rel: &str) -> Result<Vec<Found>, SyncError> {
    let mut here = Vec::new();
    let mut subdirs = Vec::new();
    for dent in fs::read_dir(dir).at(dir)? {
        let dent = dent.at(dir)?;
        // Two allocations per entry (its name, its manifest path): the
        // absolute path is made only for what needs it (a directory to
        // walk, a link to read, an error to report). An unchanged tree's
        // re-put is a stat per file, and little else.
        let name = dent
            .file_name()
            .into_string()
            .map_err(|_| SyncError::NonUtf8 { path: dent.path() })?;
        let path = if rel.is_empty() {
            name
        } else {
            let mut p = String::with_capacity(rel.len() + 1 + name.len());
            p.push_str(rel);
            p.push('/');
            p.push_str(&name);
            p
        };
        // Stats relative to the open directory (no path walk per file).
        let md = dent.metadata().map_err(|e| SyncError::io(dent.path(), e))?;
        if let Some(f) = found(&|| dent.path(), path, &md)? {
            if f.entry.kind == EntryKind::Dir {
                subdirs.push((dent.path(), f.entry.path.clone()));
            }
            here.push(f);
        }
    }
    let nested: Vec<Vec<Found>> = subdirs
        .par_iter()
        .map(|(abs, path)| walk(abs, path))
        .collect::<Result<_, _>>()?;
    here.extend(nested.into_iter().flatten());
    Ok(here)
}

/// Describes one entry (`abs` makes its absolute path, when needed);
/// `None` for special files, which are skipped.
fn found(
    abs: &dyn Fn() -> PathBuf,
    path: String,
    md: &fs::Metadata,
) -> Result<Option<Found>, SyncError> {
    let ft = md.file_type();
    let (kind, size, target) = if ft.is_symlink() {
        let abs = abs();
        let t = fs::read_link(&abs).at(&abs)?;
        let t = t
            .to_str()
            .ok_or_else(|| SyncError::NonUtf8 { path: abs.clone() })?;
        if !link_stays_inside(&path, t) {
            return Err(SyncError::LinkEscapes {
                path,
                target: t.to_owned(),
            });
        }
        (EntryKind::Symlink, 0, Some(t.to_owned()))
    } else if ft.is_dir() {
        (EntryKind::Dir, 0, None)
    } else if ft.is_file() {
        (EntryKind::File, md.size(), None)
    } else {
        tracing::warn!(path = %abs().display(), "skipping special file (socket, FIFO or device)");
        return Ok(None);
    };
    let file = (kind == EntryKind::File).then(|| Stamp::of(md));
    Ok(Some(Found {
        entry: Entry {
            path,
            kind,
            size,
            mode: if kind == EntryKind::Symlink {
                0o777
            } else {
                kt_types::manifest::safe_mode(md.permissions().mode())
            },
            mtime: md.mtime(),
            mtime_nsec: md.mtime_nsec().clamp(0, 999_999_999) as u32,
            hash: None,
            target,
        },
        file,
    }))
}

/// Where the content of manifest entry `rel` lives under `root`.
pub fn source_path(root: &Path, manifest: &Manifest, rel: &str) -> PathBuf {
    match manifest.root {
        RootKind::File => root.to_owned(),
        RootKind::Dir => root.join(rel),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kt_types::manifest::ManifestLimits;
    use std::os::unix::fs::symlink;

    #[test]
    fn scans_a_tree_and_caches_hashes() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        fs::create_dir_all(r.join("a/empty")).unwrap();
        fs::write(r.join("a/x"), b"hello").unwrap();
        fs::write(r.join("zero"), b"").unwrap();
        fs::write(r.join("ünï"), b"u").unwrap();
        symlink("a/x", r.join("link")).unwrap();
        let mut cache = ScanCache::default();
        let m = scan(r, &mut cache).unwrap();
        m.validate(&ManifestLimits::default()).unwrap();
        let paths: Vec<_> = m.entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["a", "a/empty", "a/x", "link", "zero", "ünï"]);
        assert_eq!(
            m.entries[2].hash,
            Some(Hash(*blake3::hash(b"hello").as_bytes()))
        );
        assert_eq!(m.entries[3].target.as_deref(), Some("a/x"));
        assert_eq!(cache.hashed, 3);
        let again = scan(r, &mut cache).unwrap();
        assert_eq!(again, m);
        assert_eq!(cache.hashed, 0, "unchanged files must not be re-hashed");
        assert!(!cache.dirty);
        fs::write(r.join("a/x"), b"hellO").unwrap();
        let changed = scan(r, &mut cache).unwrap();
        assert_eq!(cache.hashed, 1);
        assert_ne!(changed.entries[2].hash, m.entries[2].hash);
        assert_eq!(cache.len(), 3);
        // A file gone leaves the cache (which must be saved again); one
        // added joins it.
        fs::remove_file(r.join("zero")).unwrap();
        scan(r, &mut cache).unwrap();
        assert_eq!((cache.hashed, cache.len()), (0, 2));
        assert!(cache.dirty);
        fs::write(r.join("new"), b"n").unwrap();
        scan(r, &mut cache).unwrap();
        assert_eq!((cache.hashed, cache.len()), (1, 3));
        assert!(cache.dirty);
        scan(r, &mut cache).unwrap();
        assert!(!cache.dirty);
    }

    #[test]
    fn an_inserted_hash_is_trusted_until_the_file_changes() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        fs::write(r.join("f"), b"written by an ingest").unwrap();
        let mut cache = ScanCache::default();
        // A hash the scan would never compute: proof that it did not read.
        let seeded = Hash([7; 32]);
        cache.insert("f", &fs::metadata(r.join("f")).unwrap(), seeded);
        let m = scan(r, &mut cache).unwrap();
        assert_eq!(cache.hashed, 0);
        assert_eq!(m.entries[0].hash, Some(seeded));
        fs::write(r.join("f"), b"written by someone else").unwrap();
        let m = scan(r, &mut cache).unwrap();
        assert_eq!(cache.hashed, 1);
        assert_eq!(
            m.entries[0].hash,
            Some(Hash(*blake3::hash(b"written by someone else").as_bytes()))
        );
    }

    #[test]
    fn single_file_root() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("weights.bin");
        fs::write(&f, vec![7u8; 5 << 20]).unwrap();
        let m = scan(&f, &mut ScanCache::default()).unwrap();
        assert_eq!(m.root, RootKind::File);
        assert_eq!(m.entries.len(), 1);
        assert_eq!(m.entries[0].path, "weights.bin");
        assert_eq!(
            m.entries[0].hash,
            Some(Hash(*blake3::hash(&vec![7u8; 5 << 20]).as_bytes()))
        );
    }

    #[test]
    fn rejects_escaping_links() {
        let d = tempfile::tempdir().unwrap();
        symlink("/etc/passwd", d.path().join("bad")).unwrap();
        let e = scan(d.path(), &mut ScanCache::default()).unwrap_err();
        assert!(matches!(e, SyncError::LinkEscapes { .. }), "{e}");
    }

    #[test]
    fn rejects_non_utf8_names() {
        use std::ffi::OsStr;
        use std::os::unix::ffi::OsStrExt;
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join(OsStr::from_bytes(b"bad\xff")), b"x").unwrap();
        let e = scan(d.path(), &mut ScanCache::default()).unwrap_err();
        assert!(matches!(e, SyncError::NonUtf8 { .. }), "{e}");
        assert!(e.to_string().contains("UTF-8"));
    }

    #[test]
    fn cache_survives_save_and_load() {
        let d = tempfile::tempdir().unwrap();
        let tree = d.path().join("t");
        fs::create_dir(&tree).unwrap();
        fs::write(tree.join("f"), b"data").unwrap();
        let mut cache = ScanCache::default();
        scan(&tree, &mut cache).unwrap();
        let file = d.path().join("cache/scan.json");
        cache.save(&file).unwrap();
        let mut loaded = ScanCache::load(&file);
        assert_eq!(loaded.len(), 1);
        // A damaged cache is an empty one, never an error.
        let bytes = fs::read(&file).unwrap();
        fs::write(&file, &bytes[..bytes.len() - 1]).unwrap();
        assert!(ScanCache::load(&file).is_empty());
        scan(&tree, &mut loaded).unwrap();
        assert_eq!(loaded.hashed, 0);
    }
}
