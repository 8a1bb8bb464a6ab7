//! The pure core of an S3 ingest: from a listing of the source and the
//! record of the previous ingest, what to fetch, what to keep and what to
//! remove. No I/O: whether a kept file is really complete in staging is
//! asked through a callback.
//!
//! Invariants:
//! - every name in a [`Plan`] passed [`check_rel_path`] (no `..`, no
//!   absolute path, no empty segment, bounded length): joined under the
//!   staging tree it never leaves it;
//! - names are unique, and no file's name is the directory of another
//!   (an empty object whose name is such a directory, a "folder marker",
//!   is dropped; a non-empty one is a conflict);
//! - an object is kept only when its size, ETag and last-modified time all
//!   equal the record's and staging still holds it complete; everything
//!   else listed is fetched, everything recorded but not listed removed.

use std::collections::{BTreeMap, BTreeSet};

use kt_types::manifest::check_rel_path;
use kt_types::{Entry, EntryKind, Hash, Manifest};
use serde::{Deserialize, Serialize};

/// The longest object name (relative to the prefix) an ingest accepts, in
/// bytes: the manifest's own limit.
pub const MAX_NAME_LEN: usize = 4096;

/// One object of the listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The object's full key in the bucket (for messages).
    pub key: String,
    /// Its name relative to the prefix: the path in the dataset.
    pub name: String,
    pub size: u64,
    pub e_tag: Option<String>,
    /// RFC 3339.
    pub last_modified: String,
    /// The same time as seconds and nanoseconds since the epoch: the
    /// staged file's modification time.
    pub mtime: (i64, u32),
}

/// What the staging directory holds for one object, as of the last ingest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recorded {
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e_tag: Option<String>,
    pub last_modified: String,
    /// blake3 of the content, hex, computed while it was written.
    pub blake3: String,
    /// The staged file's inode, modification and change times once renamed
    /// into place: a file whose stamp differs was touched since, and its
    /// hash is not trusted.
    pub ino: u64,
    pub mtime: i64,
    pub mtime_nsec: i64,
    #[serde(default)]
    pub ctime: i64,
    #[serde(default)]
    pub ctime_nsec: i64,
}

impl Recorded {
    /// Whether `l` is the same object version this record describes.
    pub fn matches(&self, l: &Listed) -> bool {
        self.size == l.size && self.e_tag == l.e_tag && self.last_modified == l.last_modified
    }
}

/// The record of an ingest, kept as JSON in the staging directory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The source it describes (`s3://bucket/prefix`): a record of another
    /// source is ignored.
    pub source: String,
    /// Object name (relative to the prefix) → what staging holds.
    pub objects: BTreeMap<String, Recorded>,
}

/// Why a listing cannot be ingested.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "object {key:?} cannot be ingested: its name {name:?} is not a safe relative path ({reason})"
    )]
    BadName {
        key: String,
        name: String,
        reason: String,
    },
    #[error(
        "objects {file:?} and {inside:?} conflict: the first is a non-empty object, the second needs it to be a directory"
    )]
    Conflict { file: String, inside: String },
    #[error("two objects map to the same path {name:?} (one of them is {key:?})")]
    Duplicate { key: String, name: String },
}

/// What an ingest does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// New or changed objects, in name order.
    pub fetch: Vec<Listed>,
    /// Objects staging already holds complete, in name order.
    pub keep: Vec<Listed>,
    /// Recorded names no longer listed.
    pub remove: Vec<String>,
    /// Empty "folder marker" objects dropped.
    pub markers: u64,
}

impl Plan {
    /// Objects (files) in the dataset.
    pub fn objects(&self) -> u64 {
        (self.fetch.len() + self.keep.len()) as u64
    }

    /// Bytes in the dataset.
    pub fn bytes(&self) -> u64 {
        self.fetch.iter().chain(&self.keep).map(|l| l.size).sum()
    }

    /// Bytes to fetch.
    pub fn fetch_bytes(&self) -> u64 {
        self.fetch.iter().map(|l| l.size).sum()
    }
}

/// Makes the plan. `complete(name, recorded)` says whether staging still
/// holds the recorded file intact (asked only for objects whose listing
/// matches the record).
pub fn plan(
    mut listing: Vec<Listed>,
    record: &Record,
    mut complete: impl FnMut(&str, &Recorded) -> bool,
) -> Result<Plan, PlanError> {
    for l in &listing {
        check_rel_path(&l.name, MAX_NAME_LEN).map_err(|e| PlanError::BadName {
            key: l.key.clone(),
            name: l.name.clone(),
            reason: match e {
                kt_types::ManifestError::BadPath { reason, .. } => reason.to_owned(),
                other => other.to_string(),
            },
        })?;
    }
    listing.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(w) = listing.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(PlanError::Duplicate {
            key: w[1].key.clone(),
            name: w[1].name.clone(),
        });
    }
    // Every directory some object's name needs, with one object needing it.
    let mut dirs: BTreeMap<&str, &str> = BTreeMap::new();
    for l in &listing {
        let mut at = 0;
        while let Some(i) = l.name[at..].find('/') {
            dirs.entry(&l.name[..at + i]).or_insert(&l.name);
            at += i + 1;
        }
    }
    let mut out = Plan::default();
    let mut kept_names = BTreeSet::new();
    let mut chosen = Vec::with_capacity(listing.len());
    for l in &listing {
        match dirs.get(l.name.as_str()) {
            Some(_) if l.size == 0 => out.markers += 1,
            Some(inside) => {
                return Err(PlanError::Conflict {
                    file: l.name.clone(),
                    inside: (*inside).to_owned(),
                });
            }
            None => chosen.push(l.clone()),
        }
    }
    for l in chosen {
        match record.objects.get(&l.name) {
            Some(r) if r.matches(&l) && complete(&l.name, r) => {
                kept_names.insert(l.name.clone());
                out.keep.push(l);
            }
            _ => out.fetch.push(l),
        }
    }
    let listed: BTreeSet<&str> = out
        .fetch
        .iter()
        .chain(&out.keep)
        .map(|l| l.name.as_str())
        .collect();
    out.remove = record
        .objects
        .keys()
        .filter(|n| !listed.contains(n.as_str()))
        .cloned()
        .collect();
    Ok(out)
}

/// Permission bits of a staged file ([`Staged`]) and of a staging directory.
pub const FILE_MODE: u32 = 0o644;
pub const DIR_MODE: u32 = 0o755;

/// One file of the staging tree, as a scan of it will see it once it is in
/// place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    pub name: String,
    pub size: u64,
    pub mode: u32,
    pub mtime: i64,
    pub mtime_nsec: u32,
    /// `None`: not known yet (still to be fetched).
    pub hash: Option<Hash>,
}

/// The manifest of the staging tree once every file is in place: `files`
/// (names as [`plan`] checked them: unique, none the directory of another)
/// and every directory above them, mode [`DIR_MODE`] and as mtime the
/// latest of the files below it (what the ingest sets them to), sorted as
/// a scan sorts (by path, bytewise). Returns it with each file's manifest
/// index, in the order of `files`.
pub fn manifest(files: &[Staged]) -> (Manifest, Vec<u32>) {
    let mut dirs: BTreeMap<&str, (i64, u32)> = BTreeMap::new();
    for f in files {
        let mut at = 0;
        while let Some(i) = f.name[at..].find('/') {
            let t = dirs.entry(&f.name[..at + i]).or_insert((i64::MIN, 0));
            *t = (*t).max((f.mtime, f.mtime_nsec));
            at += i + 1;
        }
    }
    let mut entries: Vec<(Entry, Option<usize>)> = dirs
        .into_iter()
        .map(|(path, (mtime, mtime_nsec))| {
            let e = Entry {
                path: path.to_owned(),
                kind: EntryKind::Dir,
                size: 0,
                mode: DIR_MODE,
                mtime,
                mtime_nsec,
                hash: None,
                target: None,
            };
            (e, None)
        })
        .collect();
    entries.extend(files.iter().enumerate().map(|(n, f)| {
        let e = Entry {
            path: f.name.clone(),
            kind: EntryKind::File,
            size: f.size,
            mode: f.mode,
            mtime: f.mtime,
            mtime_nsec: f.mtime_nsec,
            hash: f.hash,
            target: None,
        };
        (e, Some(n))
    }));
    entries.sort_unstable_by(|a, b| a.0.path.as_bytes().cmp(b.0.path.as_bytes()));
    let mut index = vec![0u32; files.len()];
    for (i, (_, n)) in entries.iter().enumerate() {
        if let Some(n) = n {
            index[*n] = i as u32;
        }
    }
    let m = Manifest {
        root: kt_types::RootKind::Dir,
        entries: entries.into_iter().map(|(e, _)| e).collect(),
    };
    (m, index)
}

/// Whether an S3 ETag is the plain MD5 of the content (a single-part
/// upload, no customer-key encryption): 32 hex digits, quotes aside, no
/// `-` (multipart ETags are `md5-of-md5s-N`). Returns the digest.
pub fn plain_md5(e_tag: &str) -> Option<[u8; 16]> {
    let t = e_tag.trim().trim_start_matches("W/").trim_matches('"');
    if t.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(t.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(name: &str, size: u64, tag: &str) -> Listed {
        Listed {
            key: format!("p/{name}"),
            name: name.to_owned(),
            size,
            e_tag: Some(tag.to_owned()),
            last_modified: "2026-01-01T00:00:00Z".to_owned(),
            mtime: (1_767_225_600, 0),
        }
    }

    fn rec(size: u64, tag: &str) -> Recorded {
        Recorded {
            size,
            e_tag: Some(tag.to_owned()),
            last_modified: "2026-01-01T00:00:00Z".to_owned(),
            blake3: String::new(),
            ino: 1,
            mtime: 0,
            mtime_nsec: 0,
            ctime: 0,
            ctime_nsec: 0,
        }
    }

    fn names(v: &[Listed]) -> Vec<&str> {
        v.iter().map(|l| l.name.as_str()).collect()
    }

    #[test]
    fn first_ingest_fetches_everything() {
        let p = plan(
            vec![l("b", 2, "x"), l("a/c", 3, "y")],
            &Record::default(),
            |_, _| true,
        )
        .unwrap();
        assert_eq!(names(&p.fetch), ["a/c", "b"]);
        assert!(p.keep.is_empty() && p.remove.is_empty());
        assert_eq!((p.objects(), p.bytes(), p.fetch_bytes()), (2, 5, 5));
    }

    #[test]
    fn only_changed_objects_are_fetched_and_gone_ones_removed() {
        let mut r = Record::default();
        r.objects.insert("a".into(), rec(1, "t1"));
        r.objects.insert("b".into(), rec(1, "t1"));
        r.objects.insert("gone".into(), rec(1, "t1"));
        let p = plan(
            vec![l("a", 1, "t1"), l("b", 1, "t2"), l("new", 4, "t")],
            &r,
            |_, _| true,
        )
        .unwrap();
        assert_eq!(names(&p.keep), ["a"]);
        assert_eq!(names(&p.fetch), ["b", "new"]);
        assert_eq!(p.remove, ["gone"]);
    }

    #[test]
    fn a_recorded_file_missing_from_staging_is_fetched_again() {
        let mut r = Record::default();
        r.objects.insert("a".into(), rec(1, "t1"));
        let p = plan(vec![l("a", 1, "t1")], &r, |_, _| false).unwrap();
        assert_eq!(names(&p.fetch), ["a"]);
    }

    #[test]
    fn unsafe_names_fail_with_the_object() {
        for bad in ["../x", "a/../b", "a//b", "/abs", "", "a/./b"] {
            let e = plan(vec![l(bad, 1, "t")], &Record::default(), |_, _| true).unwrap_err();
            assert!(
                matches!(&e, PlanError::BadName { name, .. } if name == bad),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains(&format!("p/{bad}")), "{e}");
        }
        let long = "x".repeat(256);
        assert!(plan(vec![l(&long, 1, "t")], &Record::default(), |_, _| true).is_err());
    }

    #[test]
    fn folder_markers_are_dropped_and_file_dir_conflicts_fail() {
        let p = plan(
            vec![l("d", 0, "e"), l("d/f", 1, "t")],
            &Record::default(),
            |_, _| true,
        )
        .unwrap();
        assert_eq!(names(&p.fetch), ["d/f"]);
        assert_eq!(p.markers, 1);
        let e = plan(
            vec![l("d", 1, "e"), l("d/f", 1, "t")],
            &Record::default(),
            |_, _| true,
        )
        .unwrap_err();
        assert!(matches!(e, PlanError::Conflict { .. }), "{e}");
        let e = plan(
            vec![l("d", 1, "e"), l("d", 1, "t")],
            &Record::default(),
            |_, _| true,
        )
        .unwrap_err();
        assert!(matches!(e, PlanError::Duplicate { .. }), "{e}");
    }

    #[test]
    fn the_manifest_holds_every_directory_with_its_latest_file_time_sorted_as_a_scan() {
        let f = |name: &str, mtime: i64, nsec: u32, hash: Option<Hash>| Staged {
            name: name.to_owned(),
            size: 3,
            mode: FILE_MODE,
            mtime,
            mtime_nsec: nsec,
            hash,
        };
        let files = [
            f("b/c/x", 10, 5, None),
            f("a-z", 7, 0, Some(Hash([1; 32]))),
            f("b/y", 10, 9, None),
            f("a/q", 3, 0, None),
            f("b/c/w", 2, 0, None),
        ];
        let (m, index) = manifest(&files);
        let paths: Vec<&str> = m.entries.iter().map(|e| e.path.as_str()).collect();
        // Bytewise: '-' sorts before '/', and a directory before what it holds.
        assert_eq!(
            paths,
            ["a", "a-z", "a/q", "b", "b/c", "b/c/w", "b/c/x", "b/y"]
        );
        for (n, i) in index.iter().enumerate() {
            assert_eq!(m.entries[*i as usize].path, files[n].name);
        }
        let dir = |p: &str| m.entries.iter().find(|e| e.path == p).unwrap();
        assert_eq!((dir("b").mtime, dir("b").mtime_nsec), (10, 9));
        assert_eq!((dir("b/c").mtime, dir("b/c").mtime_nsec), (10, 5));
        assert_eq!(
            (dir("a").kind, dir("a").mode, dir("a").mtime),
            (EntryKind::Dir, DIR_MODE, 3)
        );
        assert_eq!(dir("a-z").hash, Some(Hash([1; 32])));
        assert!(manifest(&[]).0.entries.is_empty());
    }

    #[test]
    fn plain_md5_etags() {
        assert_eq!(
            plain_md5("\"d41d8cd98f00b204e9800998ecf8427e\"").map(|d| d[0]),
            Some(0xd4)
        );
        assert_eq!(plain_md5("\"d41d8cd98f00b204e9800998ecf8427e-3\""), None);
        assert_eq!(plain_md5("abc"), None);
        assert_eq!(plain_md5("\"zz1d8cd98f00b204e9800998ecf8427e\""), None);
    }
}
