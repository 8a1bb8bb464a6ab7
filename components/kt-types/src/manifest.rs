//! Manifests: the content-addressed description of a tree that both ends of a
//! transfer agree on, and its validation (a receiver never trusts a manifest it
//! has not validated).

use std::collections::HashSet;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A blake3 digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    /// The digest as 64 lowercase hex digits: its form in JSON and in logs.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
    /// Parses exactly 64 hex digits (either case).
    pub fn from_hex(s: &str) -> Result<Self, hex::FromHexError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)?;
        Ok(Hash(out))
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hash({})", self.to_hex())
    }
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for Hash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Hash::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

/// The mode bits kt stores and restores: permissions and the sticky bit.
/// Setuid and setgid never travel: a put does not record them and a get
/// does not set them, so a getter running as root never writes a
/// set-id file with another service's contents.
pub const MODE_BITS: u32 = 0o1777;

/// `mode` as kt stores and restores it ([`MODE_BITS`]).
pub fn safe_mode(mode: u32) -> u32 {
    mode & MODE_BITS
}

/// What an [`Entry`] is. On the wire: `file`, `dir` or `symlink` in JSON;
/// 0, 1 or 2 in the binary encoding ([`crate::codec`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// A regular file: carries a content `hash` and a `size`.
    File,
    /// A directory: no hash, no target, size 0.
    Dir,
    /// A symbolic link: carries a `target`, no hash.
    Symlink,
}

/// Whether the tree's root is a directory or a single file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RootKind {
    /// A directory tree: entries are paths below the root (the default).
    #[default]
    Dir,
    /// A single file: the manifest has exactly one file entry, named after the source file.
    File,
}

/// One file, directory or symlink of a tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Relative, `/`-separated, UTF-8 path.
    pub path: String,
    /// File, directory or symlink.
    pub kind: EntryKind,
    /// Size in bytes of the file's content; 0 (omitted in JSON) for
    /// directories, which validation enforces, and for symlinks.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub size: u64,
    /// Permission bits (at most 0o7777).
    pub mode: u32,
    /// Modification time: seconds since the epoch and nanoseconds.
    pub mtime: i64,
    /// Nanoseconds part of the modification time, below 1 000 000 000
    /// (validation enforces it); omitted in JSON when 0.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub mtime_nsec: u32,
    /// Content hash (files only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<Hash>,
    /// Link target (symlinks only), relative and inside the tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}
fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// A whole tree, entries sorted by path (bytewise) with no duplicates.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Manifest {
    /// Whether the tree is a directory or a single file; `dir` when absent.
    #[serde(default)]
    pub root: RootKind,
    /// Every file, directory and symlink below the root (the root itself is
    /// not listed). The sync protocol names entries by their index in this
    /// list ([`crate::api::PutPlan::needed`], [`crate::frame`] records,
    /// `files/{index}` routes).
    pub entries: Vec<Entry>,
}

/// Bounds a receiver enforces on a manifest.
#[derive(Debug, Clone, Copy)]
pub struct ManifestLimits {
    /// Most entries (default 5 000 000).
    pub max_entries: usize,
    /// Longest entry path, in bytes (default 4096).
    pub max_path_len: usize,
    /// Largest sum of the file sizes, in bytes (default 16 TiB).
    pub max_total_bytes: u64,
}

impl Default for ManifestLimits {
    fn default() -> Self {
        ManifestLimits {
            max_entries: 5_000_000,
            max_path_len: 4096,
            max_total_bytes: 16 << 40,
        }
    }
}

/// Why a manifest is refused. Every variant names the offending path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// More entries than [`ManifestLimits::max_entries`].
    #[error("manifest has {count} entries; the limit is {limit}")]
    TooManyEntries {
        /// Entries in the manifest.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// The file sizes add up to more than [`ManifestLimits::max_total_bytes`].
    #[error("manifest describes {total} bytes; the limit is {limit}")]
    TooLarge {
        /// Sum of the file sizes, in bytes.
        total: u64,
        /// The limit, in bytes.
        limit: u64,
    },
    /// A path fails [`check_rel_path`].
    #[error("path {path:?}: {reason}")]
    BadPath {
        /// The entry's path.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Entries are not sorted bytewise by path, or a path repeats.
    #[error("path {path:?} appears out of order or twice (entries must be sorted and unique)")]
    Unsorted {
        /// The first path out of order.
        path: String,
    },
    /// An entry's parent is not a directory entry listed before it.
    #[error("path {path:?}: its parent directory is not in the manifest")]
    MissingParent {
        /// The entry's path.
        path: String,
    },
    /// An entry's fields do not fit its kind (a file without a hash, a
    /// directory with a size, mode bits beyond `0o7777`, ...).
    #[error("path {path:?}: {reason}")]
    BadEntry {
        /// The entry's path.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A symlink's target leaves the tree, or resolves through another
    /// symlink of the tree.
    #[error("symlink {path:?} -> {target:?} points outside the tree")]
    LinkEscapes {
        /// The symlink's path.
        path: String,
        /// Its target.
        target: String,
    },
    /// A [`RootKind::File`] manifest does not hold exactly one file entry
    /// whose path has no `/`.
    #[error("a single-file manifest must hold exactly one file entry with no directory part")]
    BadFileRoot,
}

/// Checks one relative path: non-empty segments, no `.`/`..`, no NUL, bounded length.
pub fn check_rel_path(path: &str, max_len: usize) -> Result<(), ManifestError> {
    let bad = |reason| ManifestError::BadPath {
        path: path.to_owned(),
        reason,
    };
    if path.is_empty() {
        return Err(bad("empty path"));
    }
    if path.len() > max_len {
        return Err(bad("path too long"));
    }
    if path.starts_with('/') {
        return Err(bad("absolute paths are not allowed"));
    }
    if path.contains('\0') {
        return Err(bad("NUL byte in path"));
    }
    for seg in path.split('/') {
        match seg {
            "" => return Err(bad("empty path segment")),
            "." | ".." => return Err(bad("'.' and '..' segments are not allowed")),
            s if s.len() > 255 => return Err(bad("a path segment is longer than 255 bytes")),
            _ => {}
        }
    }
    Ok(())
}

/// Resolves a symlink `target` lexically from the directory holding `link_path`;
/// true when the result stays inside the tree.
pub fn link_stays_inside(link_path: &str, target: &str) -> bool {
    if target.is_empty() || target.starts_with('/') || target.contains('\0') {
        return false;
    }
    let mut depth: Vec<&str> = link_path.split('/').collect();
    depth.pop(); // the link itself
    for seg in target.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                if depth.pop().is_none() {
                    return false;
                }
            }
            s => depth.push(s),
        }
    }
    true
}

/// True when resolving `target` from `link_path` walks through a component
/// that is itself one of `links` (before its last segment).
fn passes_through_link(link_path: &str, target: &str, links: &HashSet<&str>) -> bool {
    let mut at: Vec<&str> = link_path.split('/').collect();
    at.pop();
    let segments: Vec<&str> = target
        .split('/')
        .filter(|s| !s.is_empty() && *s != ".")
        .collect();
    for (i, seg) in segments.iter().enumerate() {
        if *seg == ".." {
            at.pop();
        } else {
            at.push(seg);
        }
        if i + 1 < segments.len() && !at.is_empty() && links.contains(at.join("/").as_str()) {
            return true;
        }
    }
    false
}

impl Manifest {
    /// Number of file entries (directories and symlinks not counted).
    pub fn file_count(&self) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.kind == EntryKind::File)
            .count() as u64
    }

    /// Sum of the sizes of the file entries, in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.kind == EntryKind::File)
            .map(|e| e.size)
            .sum()
    }

    /// Validates structure and safety. Receivers call this before acting on a manifest.
    pub fn validate(&self, limits: &ManifestLimits) -> Result<(), ManifestError> {
        if self.entries.len() > limits.max_entries {
            return Err(ManifestError::TooManyEntries {
                count: self.entries.len(),
                limit: limits.max_entries,
            });
        }
        if self.root == RootKind::File {
            match self.entries.as_slice() {
                [e] if e.kind == EntryKind::File && !e.path.contains('/') => {}
                _ => return Err(ManifestError::BadFileRoot),
            }
        }
        let mut dirs: HashSet<&str> = HashSet::new();
        let mut total: u64 = 0;
        let mut prev: Option<&str> = None;
        for e in &self.entries {
            check_rel_path(&e.path, limits.max_path_len)?;
            if prev.is_some_and(|p| p.as_bytes() >= e.path.as_bytes()) {
                return Err(ManifestError::Unsorted {
                    path: e.path.clone(),
                });
            }
            prev = Some(&e.path);
            if let Some((parent, _)) = e.path.rsplit_once('/')
                && !dirs.contains(parent)
            {
                return Err(ManifestError::MissingParent {
                    path: e.path.clone(),
                });
            }
            let bad = |reason| ManifestError::BadEntry {
                path: e.path.clone(),
                reason,
            };
            if e.mode > 0o7777 {
                return Err(bad("mode has bits beyond 0o7777"));
            }
            if e.mtime_nsec >= 1_000_000_000 {
                return Err(bad("mtime nanoseconds out of range"));
            }
            match e.kind {
                EntryKind::File => {
                    if e.hash.is_none() {
                        return Err(bad("file without a content hash"));
                    }
                    if e.target.is_some() {
                        return Err(bad("file with a link target"));
                    }
                    total = total.saturating_add(e.size);
                }
                EntryKind::Dir => {
                    if e.hash.is_some() || e.target.is_some() || e.size != 0 {
                        return Err(bad("directory with a hash, target or size"));
                    }
                    dirs.insert(&e.path);
                }
                EntryKind::Symlink => {
                    let Some(target) = &e.target else {
                        return Err(bad("symlink without a target"));
                    };
                    if e.hash.is_some() {
                        return Err(bad("symlink with a content hash"));
                    }
                    if !link_stays_inside(&e.path, target) {
                        return Err(ManifestError::LinkEscapes {
                            path: e.path.clone(),
                            target: target.clone(),
                        });
                    }
                }
            }
        }
        // A link whose target passes *through* another link of the tree could
        // resolve anywhere (`d/a -> ..`, `x -> d/a/..`): textual checks cannot
        // see that, so such targets are refused.
        let links: HashSet<&str> = self
            .entries
            .iter()
            .filter(|e| e.kind == EntryKind::Symlink)
            .map(|e| e.path.as_str())
            .collect();
        if !links.is_empty() {
            for e in self.entries.iter().filter(|e| e.kind == EntryKind::Symlink) {
                let target = e.target.as_deref().unwrap_or_default();
                if passes_through_link(&e.path, target, &links) {
                    return Err(ManifestError::LinkEscapes {
                        path: e.path.clone(),
                        target: target.to_owned(),
                    });
                }
            }
        }
        if total > limits.max_total_bytes {
            return Err(ManifestError::TooLarge {
                total,
                limit: limits.max_total_bytes,
            });
        }
        Ok(())
    }

    /// Sorts entries bytewise by path (the order `validate` requires).
    pub fn sort(&mut self) {
        self.entries
            .sort_unstable_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str) -> Entry {
        Entry {
            path: path.into(),
            kind: EntryKind::File,
            size: 3,
            mode: 0o644,
            mtime: 1,
            mtime_nsec: 0,
            hash: Some(Hash([1; 32])),
            target: None,
        }
    }
    fn dir(path: &str) -> Entry {
        Entry {
            kind: EntryKind::Dir,
            size: 0,
            hash: None,
            mode: 0o755,
            ..file(path)
        }
    }
    fn link(path: &str, target: &str) -> Entry {
        Entry {
            kind: EntryKind::Symlink,
            size: 0,
            hash: None,
            target: Some(target.into()),
            ..file(path)
        }
    }
    fn m(entries: Vec<Entry>) -> Manifest {
        Manifest {
            root: RootKind::Dir,
            entries,
        }
    }
    fn check(entries: Vec<Entry>) -> Result<(), ManifestError> {
        m(entries).validate(&ManifestLimits::default())
    }

    #[test]
    fn accepts_a_good_tree() {
        check(vec![
            dir("a"),
            file("a/x"),
            link("a/y", "x"),
            link("a/z", "../b"),
            file("b"),
        ])
        .unwrap();
    }

    #[test]
    fn rejects_escapes_and_bad_paths() {
        assert!(matches!(
            check(vec![file("../x")]),
            Err(ManifestError::BadPath { .. })
        ));
        assert!(matches!(
            check(vec![file("/etc/passwd")]),
            Err(ManifestError::BadPath { .. })
        ));
        assert!(matches!(
            check(vec![dir("a"), file("a/./b")]),
            Err(ManifestError::BadPath { .. })
        ));
        assert!(matches!(
            check(vec![link("l", "../outside")]),
            Err(ManifestError::LinkEscapes { .. })
        ));
        assert!(matches!(
            check(vec![link("l", "/etc")]),
            Err(ManifestError::LinkEscapes { .. })
        ));
        // Through another link: `d/a -> ..` is fine alone, `x -> d/a/..` escapes.
        assert!(check(vec![dir("d"), link("d/a", "..")]).is_ok());
        assert!(matches!(
            check(vec![dir("d"), link("d/a", ".."), link("x", "d/a/..")]),
            Err(ManifestError::LinkEscapes { .. })
        ));
        // Pointing *at* a link (not through it) is fine.
        assert!(check(vec![dir("d"), link("d/a", ".."), link("x", "d/a")]).is_ok());
        assert!(matches!(
            check(vec![file("a/b")]),
            Err(ManifestError::MissingParent { .. })
        ));
        assert!(matches!(
            check(vec![file("b"), file("a")]),
            Err(ManifestError::Unsorted { .. })
        ));
        assert!(matches!(
            check(vec![file("a"), file("a")]),
            Err(ManifestError::Unsorted { .. })
        ));
        // A file cannot be a parent.
        assert!(matches!(
            check(vec![file("a"), file("a/b")]),
            Err(ManifestError::MissingParent { .. })
        ));
        let mut nohash = file("x");
        nohash.hash = None;
        assert!(matches!(
            check(vec![nohash]),
            Err(ManifestError::BadEntry { .. })
        ));
    }

    #[test]
    fn limits_apply() {
        let limits = ManifestLimits {
            max_entries: 1,
            ..Default::default()
        };
        assert!(matches!(
            m(vec![file("a"), file("b")]).validate(&limits),
            Err(ManifestError::TooManyEntries { .. })
        ));
        let limits = ManifestLimits {
            max_total_bytes: 5,
            ..Default::default()
        };
        assert!(matches!(
            m(vec![file("a"), file("b")]).validate(&limits),
            Err(ManifestError::TooLarge { .. })
        ));
    }

    #[test]
    fn file_root_has_one_file() {
        let mut one = m(vec![file("x")]);
        one.root = RootKind::File;
        one.validate(&ManifestLimits::default()).unwrap();
        let mut two = m(vec![dir("d"), file("d/x")]);
        two.root = RootKind::File;
        assert_eq!(
            two.validate(&ManifestLimits::default()),
            Err(ManifestError::BadFileRoot)
        );
    }

    #[test]
    fn hash_round_trips_as_hex() {
        let h = Hash([0xab; 32]);
        let s = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<Hash>(&s).unwrap(), h);
        assert!(serde_json::from_str::<Hash>("\"zz\"").is_err());
    }
}
