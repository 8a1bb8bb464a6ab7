//! Uploads that survive a store restart: what an interrupted upload left in
//! its staging version, so that the same put, planned again, sends only the
//! rest.
//!
//! A staging version may be resumed while its marker (`v-<id>.put`, holding
//! the put's manifest digest) is younger than the session TTL; every chunk
//! of a large file that arrives is appended to `v-<id>.chunks` (file index,
//! chunk number, chaining value). Nothing of it is trusted as it is: a plan
//! that adopts the staging version re-reads and re-hashes what it keeps —
//! a small file whole against its hash, a logged chunk against its logged
//! chaining value (so a chunk torn by a crash is sent again) — except files
//! hard-linked from the base version when the upload was planned.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use blake3::hazmat::ChainingValue;
use kt_sync::SyncError;
use kt_sync::chunk::{ChunkAssembly, chunk_count, chunk_cv, chunk_range};
use kt_sync::publish::VersionedDir;
use kt_types::{EntryKind, Hash, Manifest};

/// Bytes of one chunk-log record: file index (u32), chunk number (u64),
/// chaining value (32 bytes), little-endian.
const RECORD: usize = 4 + 8 + 32;

/// What an interrupted upload left, verified.
#[derive(Debug, Default)]
pub struct Left {
    /// Files still to send, whole or (those in `chunks`) in part.
    pub needed: Vec<u32>,
    /// Large needed files: their chunks already there, verified.
    pub chunks: HashMap<u32, Vec<(u64, ChainingValue)>>,
    /// Bytes kept (whole files and chunks).
    pub kept: u64,
}

/// Appends one chunk's record to a staging version's log.
pub fn log_chunk(log: &mut File, index: u32, n: u64, cv: &ChainingValue) -> std::io::Result<()> {
    let mut rec = [0u8; RECORD];
    rec[..4].copy_from_slice(&index.to_le_bytes());
    rec[4..12].copy_from_slice(&n.to_le_bytes());
    rec[12..].copy_from_slice(cv);
    log.write_all(&rec)
}

/// Rewrites a log to hold exactly the verified chunks of `left` (after a
/// survey: a torn record at its end would misalign what follows).
pub fn rewrite_log(path: &Path, left: &Left) -> std::io::Result<File> {
    let mut log = File::create(path)?;
    for (index, chunks) in &left.chunks {
        for (n, cv) in chunks {
            log_chunk(&mut log, *index, *n, cv)?;
        }
    }
    Ok(log)
}

/// The log's records by file: chunk number → chaining value (the last
/// record of a chunk wins; a torn last record is ignored).
fn read_log(path: &Path) -> BTreeMap<u32, BTreeMap<u64, ChainingValue>> {
    let mut bytes = Vec::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_end(&mut bytes);
    }
    let mut out: BTreeMap<u32, BTreeMap<u64, ChainingValue>> = BTreeMap::new();
    for rec in bytes.chunks_exact(RECORD) {
        let index = u32::from_le_bytes(rec[..4].try_into().unwrap_or_default());
        let n = u64::from_le_bytes(rec[4..12].try_into().unwrap_or_default());
        let mut cv = [0u8; 32];
        cv.copy_from_slice(&rec[12..]);
        out.entry(index).or_default().insert(n, cv);
    }
    out
}

/// Finds what of `m` the staging version at `staging` holds (`log`: its
/// chunk log), re-verifying it. A `deferred` entry (ascending indices: its
/// hash is a placeholder, [`kt_types::api::PutRequest::deferred`]) stays
/// needed with every chunk that still hashes to its logged value, all of
/// them included: the commit checks their root against the client's.
pub fn survey(staging: &Path, log: &Path, m: &Manifest, chunk_size: u64, deferred: &[u32]) -> Left {
    let logged = read_log(log);
    let mut left = Left::default();
    for (i, e) in m.entries.iter().enumerate() {
        if e.kind != EntryKind::File {
            continue;
        }
        let i = i as u32;
        let is_deferred = deferred.binary_search(&i).is_ok();
        let path = staging.join(&e.path);
        let Some(hash) = e.hash else {
            left.needed.push(i);
            continue;
        };
        let md = match std::fs::symlink_metadata(&path) {
            Ok(md) if md.is_file() && md.len() == e.size => md,
            _ => {
                left.needed.push(i);
                continue;
            }
        };
        // Linked from the base version at planning: verified then.
        if md.nlink() > 1 && !is_deferred {
            left.kept += e.size;
            continue;
        }
        if e.size <= chunk_size {
            if kt_sync::scan::hash_file(&path, e.size).is_ok_and(|h| h == hash) {
                left.kept += e.size;
            } else {
                left.needed.push(i);
            }
            continue;
        }
        let mut good = verified_chunks(&path, e.size, chunk_size, logged.get(&i));
        if good.len() as u64 == chunk_count(e.size, chunk_size) && !is_deferred {
            if root_of(e.size, chunk_size, &good) == Some(hash) {
                left.kept += e.size;
                continue;
            }
            // Every chunk as logged, yet not the file: trust none of them.
            good.clear();
        }
        left.kept += good
            .iter()
            .filter_map(|(n, _)| chunk_range(e.size, chunk_size, *n).map(|(_, len)| len))
            .sum::<u64>();
        left.needed.push(i);
        if !good.is_empty() {
            left.chunks.insert(i, good);
        }
    }
    left
}

/// The logged chunks of a file whose data still hashes to the logged value.
fn verified_chunks(
    path: &Path,
    size: u64,
    chunk_size: u64,
    logged: Option<&BTreeMap<u64, ChainingValue>>,
) -> Vec<(u64, ChainingValue)> {
    let (Some(logged), Ok(file)) = (logged, File::open(path)) else {
        return Vec::new();
    };
    let mut buf = Vec::new();
    logged
        .iter()
        .filter(|(n, cv)| {
            let Some((offset, len)) = chunk_range(size, chunk_size, **n) else {
                return false;
            };
            buf.resize(len as usize, 0);
            file.read_exact_at(&mut buf, offset).is_ok() && chunk_cv(&buf, **n, chunk_size) == **cv
        })
        .map(|(n, cv)| (*n, *cv))
        .collect()
}

fn root_of(size: u64, chunk_size: u64, cvs: &[(u64, ChainingValue)]) -> Option<Hash> {
    let mut asm = ChunkAssembly::new(size, chunk_size);
    for (n, cv) in cvs {
        asm.add_cv(*n, *cv);
    }
    asm.root()
}

/// A resumable staging version of a key, adopted by no session yet.
#[derive(Debug, Clone)]
pub struct Leftover {
    /// The key, from its directory's `key` file (None if unreadable).
    pub key: Option<kt_types::Key>,
    pub dir: VersionedDir,
    pub id: String,
    /// When it is removed unless a plan adopted it.
    pub until: Instant,
    /// Its marker's mtime when found: a plan that adopts it marks it again.
    pub marked: Option<SystemTime>,
}

impl Leftover {
    /// Whether a plan adopted it since it was found (it marked it again).
    pub fn adopted(&self) -> bool {
        let now = std::fs::metadata(self.dir.resume_path(&self.id))
            .and_then(|m| m.modified())
            .ok();
        now.is_some() && now != self.marked
    }
}

/// The age of a resume marker.
fn age(marker: &Path) -> Option<Duration> {
    let modified = std::fs::metadata(marker).ok()?.modified().ok()?;
    SystemTime::now().duration_since(modified).ok()
}

/// Whether a resume marker is young enough to keep (`keep_for`), and until when.
pub fn keep_until(marker: &Path, keep_for: Duration) -> Option<Instant> {
    let age = age(marker).unwrap_or_default();
    keep_for.checked_sub(age).map(|left| Instant::now() + left)
}

/// The staging version of `dir` an interrupted upload of the tree with
/// `digest` left, if any, and none that `busy` says an upload holds (a
/// live session, or one whose commit is publishing it:
/// [`crate::keys::Claim`]).
pub fn find(dir: &VersionedDir, digest: &Hash, busy: impl Fn(&str) -> bool) -> Option<String> {
    let want = digest.to_hex();
    let current = dir.current().ok().flatten();
    dir.resumable()
        .into_iter()
        .filter(|(id, _)| !busy(id) && current.as_ref() != Some(id))
        .find(|(_, marker)| std::fs::read_to_string(marker).is_ok_and(|d| d.trim() == want))
        .map(|(id, _)| id)
}

/// Marks a staging version as resumable by uploads of `digest` (and as
/// young again, when it is adopted).
pub fn mark(dir: &VersionedDir, id: &str, digest: &Hash) -> Result<(), SyncError> {
    let p = dir.resume_path(id);
    std::fs::write(&p, digest.to_hex()).map_err(|e| SyncError::io(&p, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_survey_keeps_only_what_still_hashes_right() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        let chunk = 1024u64;
        let big: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(src.join("big"), &big).unwrap();
        std::fs::write(src.join("small"), b"small file").unwrap();
        std::fs::write(src.join("other"), b"other file").unwrap();
        let m = kt_sync::scan(&src, &mut kt_sync::ScanCache::default()).unwrap();
        let idx = |name: &str| m.entries.iter().position(|e| e.path == name).unwrap() as u32;

        // The staging as a killed upload left it: `small` whole, `other`
        // torn, chunks 0, 1 and 3 of `big` written and logged; chunk 3
        // then torn (its data no longer matches its record).
        let staging = d.path().join("staging");
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::write(staging.join("small"), b"small file").unwrap();
        std::fs::write(staging.join("other"), b"other fil!").unwrap();
        let f = std::fs::File::create(staging.join("big")).unwrap();
        f.set_len(big.len() as u64).unwrap();
        let log_path = d.path().join("log");
        let mut log = std::fs::File::create(&log_path).unwrap();
        for n in [0u64, 1, 3] {
            let (off, len) = chunk_range(big.len() as u64, chunk, n).unwrap();
            let data = &big[off as usize..(off + len) as usize];
            f.write_all_at(data, off).unwrap();
            log_chunk(&mut log, idx("big"), n, &chunk_cv(data, n, chunk)).unwrap();
        }
        f.write_all_at(b"torn", 3 * chunk).unwrap();
        // A torn last record is ignored.
        log.write_all(&[1, 2, 3]).unwrap();

        let left = survey(&staging, &log_path, &m, chunk, &[]);
        let mut needed = left.needed.clone();
        needed.sort();
        let mut want = vec![idx("big"), idx("other")];
        want.sort();
        assert_eq!(needed, want);
        let kept: Vec<u64> = left.chunks[&idx("big")].iter().map(|(n, _)| *n).collect();
        assert_eq!(kept, [0, 1]);
        assert_eq!(left.kept, 10 + 2 * chunk);

        // Every chunk there and right: the file is kept whole.
        let mut log = rewrite_log(&log_path, &left).unwrap();
        for n in 2..5 {
            let (off, len) = chunk_range(big.len() as u64, chunk, n).unwrap();
            let data = &big[off as usize..(off + len) as usize];
            f.write_all_at(data, off).unwrap();
            log_chunk(&mut log, idx("big"), n, &chunk_cv(data, n, chunk)).unwrap();
        }
        let left = survey(&staging, &log_path, &m, chunk, &[]);
        assert_eq!(left.needed, [idx("other")]);
        assert!(left.chunks.is_empty());

        // Deferred (its hash a placeholder): every chunk is kept, and the
        // file stays needed for its root to be checked at commit.
        let mut provisional = m.clone();
        provisional.entries[idx("big") as usize].hash = Some(kt_types::api::DEFERRED_HASH);
        let left = survey(&staging, &log_path, &provisional, chunk, &[idx("big")]);
        let mut needed = left.needed.clone();
        needed.sort();
        assert_eq!(needed, want);
        let kept: Vec<u64> = left.chunks[&idx("big")].iter().map(|(n, _)| *n).collect();
        assert_eq!(kept, [0, 1, 2, 3, 4]);
    }
}
