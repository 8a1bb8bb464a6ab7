//! Writing received entries into a directory.
//!
//! Invariants: content is verified against its hash before it is made visible;
//! nothing is ever written through a symlink (files are opened with
//! `O_NOFOLLOW` or replaced by rename, and directories on the way are checked
//! to be real directories, replacing anything else).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use filetime::FileTime;
use kt_types::{Entry, EntryKind, Hash, Manifest, RootKind};

use crate::error::{IoContext, SyncError};

/// How a file reaches its final path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// Written in place: the destination is a private staging area.
    Direct,
    /// Written to a temporary sibling and renamed over the destination, so a
    /// reader sees the old file or the new one.
    TempRename,
}

fn mtime_of(e: &Entry) -> FileTime {
    FileTime::from_unix_time(e.mtime, e.mtime_nsec)
}

fn temp_sibling(dest: &Path) -> PathBuf {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let short: String = name.chars().take(64).collect();
    dest.with_file_name(format!(
        "{TEMP_PREFIX}{short}.{}",
        uuid::Uuid::new_v4().simple()
    ))
}

/// The process umask, read once from `/proc/self/status` (no syscall changes it
/// for us to read it). `None` where it cannot be read: every mode is then set explicitly.
fn umask() -> Option<u32> {
    static UMASK: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *UMASK.get_or_init(|| {
        let status = fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
        u32::from_str_radix(line.trim(), 8).ok()
    })
}

/// Creates (or truncates) a file for writing, never through a symlink, with the
/// entry's mode as far as the umask allows.
fn open_new(path: &Path, mode: u32) -> Result<File, SyncError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(kt_types::manifest::safe_mode(mode))
        .open(path)
        .at(path)
}

/// Sets the mtime, and the mode unless creation already gave the file exactly it
/// (saves a syscall per file when the umask does not strip the entry's bits).
fn set_meta(file: &File, path: &Path, e: &Entry, created_with_mode: bool) -> Result<(), SyncError> {
    if !created_with_mode || umask().is_none_or(|u| e.mode & u != 0) {
        file.set_permissions(perms(e)).at(path)?;
    }
    filetime::set_file_handle_times(file, None, Some(mtime_of(e))).at(path)
}

/// The permissions `e` is written with: its mode without setuid and setgid
/// ([`kt_types::manifest::safe_mode`]), whatever a source's manifest says.
fn perms(e: &Entry) -> fs::Permissions {
    fs::Permissions::from_mode(kt_types::manifest::safe_mode(e.mode))
}

/// Removes whatever is at `path` (directories recursively); nothing there is fine.
fn remove_any(path: &Path) -> Result<(), SyncError> {
    clear_non_file(path)?;
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(SyncError::io(path, e)),
        _ => Ok(()),
    }
}

/// Removes whatever is at `path` unless it is a plain file (dirs recursively).
fn clear_non_file(path: &Path) -> Result<(), SyncError> {
    match fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => fs::remove_dir_all(path).at(path),
        Ok(md) if md.file_type().is_symlink() => fs::remove_file(path).at(path),
        _ => Ok(()),
    }
}

/// Verifies `data` against `entry` and writes it at `dest` with its mode and mtime.
pub fn write_verified(
    dest: &Path,
    entry: &Entry,
    data: &[u8],
    mode: WriteMode,
) -> Result<(), SyncError> {
    check_size(entry, data)?;
    if entry.hash != Some(Hash(*blake3::hash(data).as_bytes())) {
        return Err(SyncError::HashMismatch {
            path: entry.path.clone(),
        });
    }
    write_checked(dest, entry, data, mode)
}

/// Writes `data` (its size checked) at `dest` with `entry`'s mode and
/// mtime, and returns its hash, unchecked: for an entry whose hash the
/// sender sends later (a put's deferred entry, compared at its commit), so
/// `dest` must be somewhere nothing reads before that comparison.
pub fn write_hashing(
    dest: &Path,
    entry: &Entry,
    data: &[u8],
    mode: WriteMode,
) -> Result<Hash, SyncError> {
    check_size(entry, data)?;
    let hash = Hash(*blake3::hash(data).as_bytes());
    write_checked(dest, entry, data, mode)?;
    Ok(hash)
}

fn check_size(entry: &Entry, data: &[u8]) -> Result<(), SyncError> {
    if data.len() as u64 != entry.size {
        return Err(SyncError::SizeMismatch {
            path: entry.path.clone(),
            expected: entry.size,
            actual: data.len() as u64,
        });
    }
    Ok(())
}

fn write_checked(
    dest: &Path,
    entry: &Entry,
    data: &[u8],
    mode: WriteMode,
) -> Result<(), SyncError> {
    let target = match mode {
        WriteMode::Direct => dest.to_owned(),
        WriteMode::TempRename => temp_sibling(dest),
    };
    let mut f = open_new(&target, entry.mode)?;
    let res = f
        .write_all(data)
        .at(&target)
        .and_then(|_| set_meta(&f, &target, entry, true));
    drop(f);
    if let Err(e) = res {
        let _ = fs::remove_file(&target);
        return Err(e);
    }
    if mode == WriteMode::TempRename {
        clear_non_file(dest)?;
        fs::rename(&target, dest).at(dest)?;
    }
    Ok(())
}

/// A large file being received chunk by chunk.
#[derive(Debug)]
pub struct ChunkedFile {
    file: File,
    path: PathBuf,
    dest: PathBuf,
    mode: WriteMode,
    /// Set once the file is in place; until then dropping it removes a temporary file.
    placed: bool,
}

impl ChunkedFile {
    pub fn create(dest: &Path, size: u64, mode: WriteMode) -> Result<Self, SyncError> {
        let path = match mode {
            WriteMode::Direct => dest.to_owned(),
            WriteMode::TempRename => temp_sibling(dest),
        };
        let file = open_new(&path, 0o600)?;
        if mode == WriteMode::TempRename {
            // Held while it is written: [`remove_abandoned_temps`] leaves a
            // locked temporary file alone, however long it sat idle.
            let _ = file.try_lock();
        }
        file.set_len(size).at(&path)?;
        Ok(ChunkedFile {
            file,
            path,
            dest: dest.to_owned(),
            mode,
            placed: false,
        })
    }

    /// Opens a file an interrupted upload was writing in place (kept in a
    /// private staging area), keeping what it holds.
    pub fn resume(dest: &Path, size: u64) -> Result<Self, SyncError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o600)
            .open(dest)
            .at(dest)?;
        file.set_len(size).at(dest)?;
        Ok(ChunkedFile {
            file,
            path: dest.to_owned(),
            dest: dest.to_owned(),
            mode: WriteMode::Direct,
            placed: false,
        })
    }

    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), SyncError> {
        self.file.write_all_at(data, offset).at(&self.path)
    }

    /// Writes `bufs` one after the other from `offset`, in one system call
    /// where the kernel takes them all (`pwritev`): a piece of several
    /// buffers takes the file's lock once, not once per buffer.
    pub fn write_all_vectored_at(
        &self,
        offset: u64,
        bufs: &[bytes::Bytes],
    ) -> Result<(), SyncError> {
        // No empty slice: one left alone at the end would read as a write of 0.
        let mut slices: Vec<std::io::IoSlice> = bufs
            .iter()
            .filter(|b| !b.is_empty())
            .map(|b| std::io::IoSlice::new(b))
            .collect();
        let mut rest = &mut slices[..];
        let mut at = offset;
        while !rest.is_empty() {
            match rustix::io::pwritev(&self.file, rest, at) {
                Ok(0) => {
                    return Err(std::io::Error::from(std::io::ErrorKind::WriteZero)).at(&self.path);
                }
                Ok(n) => {
                    at += n as u64;
                    std::io::IoSlice::advance_slices(&mut rest, n);
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(std::io::Error::from(e)).at(&self.path),
            }
        }
        Ok(())
    }

    /// A second handle on the file being written, for reading what is
    /// already there (it stays valid once the file is renamed into place).
    pub fn reader(&self) -> Result<File, SyncError> {
        self.file.try_clone().at(&self.path)
    }

    /// Sets metadata and makes the file visible at its destination.
    /// Call only after the assembled hash was verified.
    pub fn finish(mut self, entry: &Entry) -> Result<(), SyncError> {
        set_meta(&self.file, &self.path, entry, false)?;
        if self.mode == WriteMode::TempRename {
            clear_non_file(&self.dest)?;
            fs::rename(&self.path, &self.dest).at(&self.dest)?;
        }
        self.placed = true;
        Ok(())
    }

    /// Drops a file that failed verification.
    pub fn discard(mut self) {
        let _ = fs::remove_file(&self.path);
        self.placed = true;
    }
}

impl Drop for ChunkedFile {
    /// A temporary file abandoned midway (a failed or cancelled download) is removed.
    fn drop(&mut self) {
        if !self.placed && self.mode == WriteMode::TempRename {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Creates every directory of `m` under `root`, replacing non-directories in the way.
pub fn ensure_dirs(root: &Path, m: &Manifest) -> Result<(), SyncError> {
    fs::create_dir_all(root).at(root)?;
    for e in m.entries.iter().filter(|e| e.kind == EntryKind::Dir) {
        let p = root.join(&e.path);
        match fs::symlink_metadata(&p) {
            Ok(md) if md.is_dir() => continue,
            Ok(_) => fs::remove_file(&p).at(&p)?,
            Err(_) => {}
        }
        fs::create_dir(&p).at(&p)?;
    }
    Ok(())
}

/// Creates symlinks, then sets directory modes and mtimes deepest first.
pub fn finish_tree(root: &Path, m: &Manifest) -> Result<(), SyncError> {
    for e in m.entries.iter().filter(|e| e.kind == EntryKind::Symlink) {
        let p = root.join(&e.path);
        let target = e.target.as_deref().unwrap_or_default();
        if fs::read_link(&p).ok().as_deref() != Some(Path::new(target)) {
            remove_any(&p)?;
            symlink(target, &p).at(&p)?;
        }
        filetime::set_symlink_file_times(&p, mtime_of(e), mtime_of(e)).at(&p)?;
    }
    for e in m.entries.iter().rev().filter(|e| e.kind == EntryKind::Dir) {
        let p = root.join(&e.path);
        fs::set_permissions(&p, perms(e)).at(&p)?;
        filetime::set_file_mtime(&p, mtime_of(e)).at(&p)?;
    }
    Ok(())
}

/// Removes everything under `root` that `m` does not name: after a mirror
/// get (`kt get --delete`) the destination is exactly the key's tree.
/// Walks real directories only: a symlink is removed as a link, never
/// followed; a directory the manifest names is walked into, one it does not
/// name goes whole. Returns how many entries went (a directory counts once).
pub fn prune(root: &Path, m: &Manifest) -> Result<u64, SyncError> {
    let keep: std::collections::HashMap<&str, EntryKind> = m
        .entries
        .iter()
        .map(|e| (e.path.as_str(), e.kind))
        .collect();
    let mut removed = 0;
    let mut dirs = vec![(root.to_owned(), String::new())];
    while let Some((dir, rel)) = dirs.pop() {
        for entry in fs::read_dir(&dir).at(&dir)? {
            let entry = entry.at(&dir)?;
            let path = entry.path();
            // A name that is not UTF-8 cannot be in a manifest.
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                remove_any(&path)?;
                removed += 1;
                continue;
            };
            let child = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let is_dir = entry.file_type().at(&path)?.is_dir();
            match keep.get(child.as_str()) {
                Some(EntryKind::Dir) if is_dir => dirs.push((path, child)),
                Some(_) => {}
                None => {
                    remove_any(&path)?;
                    removed += 1;
                }
            }
        }
    }
    Ok(removed)
}

/// Prefix of the temporary siblings files are written to ([`WriteMode::TempRename`]).
const TEMP_PREFIX: &str = ".kt-tmp.";

/// Removes temporary files a killed transfer left in the directories a
/// tree (or, for a single-file root, `root`'s own directory) places files
/// in: regular files named like [`temp_sibling`]'s that nobody wrote to for
/// `idle` and no live writer holds locked (a large file's writer locks it
/// for as long as it writes). Returns how many went.
pub fn remove_abandoned_temps(root: &Path, m: &Manifest, idle: std::time::Duration) -> u64 {
    let dirs: Vec<PathBuf> = match m.root {
        RootKind::Dir => std::iter::once(root.to_owned())
            .chain(
                m.entries
                    .iter()
                    .filter(|e| e.kind == EntryKind::Dir)
                    .map(|e| root.join(&e.path)),
            )
            .collect(),
        RootKind::File => match root.parent() {
            Some(p) if !p.as_os_str().is_empty() => vec![p.to_owned()],
            _ => vec![PathBuf::from(".")],
        },
    };
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    for dir in dirs {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        for entry in rd.flatten() {
            if !entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
                continue;
            }
            // Not followed: a link or a directory of that name is not ours.
            let abandoned = entry.metadata().is_ok_and(|md| {
                md.file_type().is_file()
                    && md
                        .modified()
                        .ok()
                        .and_then(|t| now.duration_since(t).ok())
                        .is_some_and(|age| age >= idle)
            });
            if abandoned && !in_use(&entry.path()) && fs::remove_file(entry.path()).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

/// Whether a get still holds the lock it takes on a temporary file it
/// writes (a large file, written for as long as its source allows).
fn in_use(path: &Path) -> bool {
    let Ok(f) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    else {
        return true;
    };
    f.try_lock().is_err()
}

/// Brings an existing file's mode and mtime in line with `e`.
pub fn fix_metadata(path: &Path, e: &Entry) -> Result<(), SyncError> {
    fs::set_permissions(path, perms(e)).at(path)?;
    filetime::set_file_mtime(path, mtime_of(e)).at(path)
}

/// Hard-links `from` to `to`, copying when linking is not possible.
pub fn link_or_copy(from: &Path, to: &Path) -> Result<(), SyncError> {
    if fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    fs::copy(from, to).at(to).map(|_| ())
}

/// A file of a new version whose content an older version already has.
#[derive(Debug, Clone)]
pub struct Reuse {
    pub from: PathBuf,
    pub to: PathBuf,
    pub entry: Entry,
    /// Same mode and mtime as the old file: a hard link will do.
    pub identical: bool,
}

/// Hard links made per pair of open directories before the work is split
/// again (a tree of one huge directory still links on every thread).
const LINKS_PER_TASK: usize = 256;

/// Materialises reused files in parallel: hard links where the old file is
/// identical, copies with the new metadata otherwise.
///
/// Links are made directory by directory, each named relative to its
/// source and destination directories opened once (`linkat`): a new version
/// of a large tree is mostly links, and a link by two whole paths walked
/// both paths' every component in the kernel again (about a third of the
/// cost on tmpfs).
pub fn reuse_all(jobs: &[Reuse]) -> Result<(), SyncError> {
    use rayon::prelude::*;
    let mut by_dirs: std::collections::HashMap<(&Path, &Path), Vec<&Reuse>> =
        std::collections::HashMap::new();
    let mut one_by_one = Vec::new();
    for j in jobs {
        match (j.identical, j.from.parent(), j.to.parent()) {
            (true, Some(from), Some(to)) => by_dirs.entry((from, to)).or_default().push(j),
            _ => one_by_one.push(j),
        }
    }
    let tasks: Vec<(&Path, &Path, &[&Reuse])> = by_dirs
        .iter()
        .flat_map(|(&(from, to), js)| js.chunks(LINKS_PER_TASK).map(move |c| (from, to, c)))
        .collect();
    tasks
        .par_iter()
        .try_for_each(|&(from, to, js)| link_in(from, to, js))?;
    one_by_one.par_iter().try_for_each(|j| {
        if j.identical {
            link_or_copy(&j.from, &j.to)
        } else {
            fs::copy(&j.from, &j.to).at(&j.to)?;
            fix_metadata(&j.to, &j.entry)
        }
    })
}

/// Hard-links each of `jobs` (all from `from_dir` into `to_dir`) by name
/// relative to the two directories, opened once; whatever cannot be linked
/// so goes by [`link_or_copy`] (which copies where linking is impossible).
fn link_in(from_dir: &Path, to_dir: &Path, jobs: &[&Reuse]) -> Result<(), SyncError> {
    use rustix::fs::{AtFlags, Mode, OFlags};
    let open = |d: &Path| {
        rustix::fs::open(
            d,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    let (Ok(from), Ok(to)) = (open(from_dir), open(to_dir)) else {
        return jobs.iter().try_for_each(|j| link_or_copy(&j.from, &j.to));
    };
    for j in jobs {
        let linked = match (j.from.file_name(), j.to.file_name()) {
            // linkat without AT_SYMLINK_FOLLOW links a symlink itself, as link(2) does.
            (Some(a), Some(b)) => rustix::fs::linkat(&from, a, &to, b, AtFlags::empty()).is_ok(),
            _ => false,
        };
        if !linked {
            link_or_copy(&j.from, &j.to)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn entry(path: &str, mode: u32, mtime: i64) -> Entry {
        Entry {
            path: path.into(),
            kind: EntryKind::File,
            size: 1,
            mode,
            mtime,
            mtime_nsec: 0,
            hash: None,
            target: None,
        }
    }

    /// A piece of several buffers lands where one write of them all would
    /// put it, next to what is already there, and no empty buffer or
    /// unwritten gap shifts it.
    #[test]
    fn vectored_writes_land_in_order_at_their_offset() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("f");
        let f = ChunkedFile::create(&dest, 20, WriteMode::Direct).unwrap();
        f.write_at(0, b"0123").unwrap();
        let bufs = [
            bytes::Bytes::from_static(b"ab"),
            bytes::Bytes::new(),
            bytes::Bytes::from(vec![b'c'; 5]),
            bytes::Bytes::from_static(b"d"),
        ];
        f.write_all_vectored_at(4, &bufs).unwrap();
        f.write_all_vectored_at(16, &[]).unwrap();
        f.write_all_vectored_at(17, &[bytes::Bytes::new()]).unwrap();
        f.write_all_vectored_at(18, &[bytes::Bytes::from_static(b"yz")])
            .unwrap();
        let mut want = b"0123abcccccd".to_vec();
        want.resize(18, 0);
        want.extend_from_slice(b"yz");
        assert_eq!(fs::read(&dest).unwrap(), want);
    }

    /// Identical files become hard links, directory by directory (many
    /// files to one directory, a file to another, a renamed one), and a
    /// file whose metadata differs becomes a copy with the new metadata.
    #[test]
    fn reuse_links_identical_files_and_copies_the_rest() {
        let d = tempfile::tempdir().unwrap();
        let (old, new) = (d.path().join("old"), d.path().join("new"));
        for sub in ["a", "b"] {
            fs::create_dir_all(old.join(sub)).unwrap();
            fs::create_dir_all(new.join(sub)).unwrap();
        }
        let mut jobs = Vec::new();
        for i in 0..(LINKS_PER_TASK + 10) {
            let name = format!("a/f{i}");
            fs::write(old.join(&name), format!("{i}")).unwrap();
            jobs.push(Reuse {
                from: old.join(&name),
                to: new.join(&name),
                entry: entry(&name, 0o644, 0),
                identical: true,
            });
        }
        fs::write(old.join("b/x"), "x").unwrap();
        jobs.push(Reuse {
            from: old.join("b/x"),
            to: new.join("b/renamed"),
            entry: entry("b/renamed", 0o644, 0),
            identical: true,
        });
        jobs.push(Reuse {
            from: old.join("b/x"),
            to: new.join("a/copy"),
            entry: entry("a/copy", 0o600, 1_000_000),
            identical: false,
        });
        reuse_all(&jobs).unwrap();
        let ino = |p: &Path| fs::metadata(p).unwrap().ino();
        for j in &jobs[..jobs.len() - 1] {
            assert_eq!(ino(&j.from), ino(&j.to), "{} is not a link", j.to.display());
        }
        let copy = new.join("a/copy");
        assert_ne!(ino(&copy), ino(&old.join("b/x")));
        assert_eq!(fs::read_to_string(&copy).unwrap(), "x");
        let md = fs::metadata(&copy).unwrap();
        assert_eq!(md.mode() & 0o777, 0o600);
        assert_eq!(md.mtime(), 1_000_000);
    }

    /// A source that is not there fails the reuse, naming the file.
    #[test]
    fn reuse_of_a_missing_file_fails() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("new")).unwrap();
        let jobs = [Reuse {
            from: d.path().join("old/gone"),
            to: d.path().join("new/gone"),
            entry: entry("gone", 0o644, 0),
            identical: true,
        }];
        let err = reuse_all(&jobs).unwrap_err();
        assert!(err.to_string().contains("gone"), "{err}");
    }
}
