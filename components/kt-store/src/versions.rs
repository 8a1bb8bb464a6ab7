//! The store's published versions as a [`ReadSource`]: which version of a
//! key a getter reads, pinned until its lease ends (the lease protocol
//! itself is [`kt_service::reads`]), the removal of versions no reader
//! needs any more, and the staging of a put's version: afresh, or in the
//! superseded version no reader holds ([`Spare`]).

use std::path::Path;
use std::sync::Arc;

use kt_service::ApiError;
use kt_service::reads::{Files, OpenVersion, ReadSource};
use kt_sync::SyncError;
use kt_sync::apply;
use kt_sync::publish::VersionedDir;
use kt_types::api::DEFERRED_HASH;
use kt_types::{Entry, EntryKind, Key, Manifest};

use crate::keys::{KeyState, Keys, Published};

/// Published versions of the store's keys, as a [`ReadSource`]: a read pins
/// its version, so a newer put retires it without deleting it under the getter.
#[derive(Debug)]
pub struct StoreVersions {
    pub keys: Arc<Keys>,
    pub chunk_size: u64,
}

pub(crate) type Locked = tokio::sync::OwnedMutexGuard<KeyState>;

pub(crate) fn missing(key: &Key) -> ApiError {
    ApiError::not_found(format!("key {key} not found in the store"))
}

/// A published key: its locked state and its current version; or `not_found`.
pub(crate) async fn published(keys: &Keys, key: &Key) -> Result<(Locked, Published), ApiError> {
    let state = keys.existing(key).ok_or_else(|| missing(key))?;
    let st = state.lock_owned().await;
    let cur = st.current.clone().ok_or_else(|| missing(key))?;
    Ok((st, cur))
}

impl ReadSource for StoreVersions {
    async fn open(&self, key: &Key) -> Result<OpenVersion, ApiError> {
        let (mut st, cur) = published(&self.keys, key).await?;
        st.pin(&cur.version);
        drop(st);
        Ok(OpenVersion {
            key: key.clone(),
            files: Files::Under(self.keys.dir_of(key).version_path(&cur.version)),
            version: cur.version,
            manifest: cur.meta.manifest.clone(),
            chunk_size: self.chunk_size,
            // Version directories are written by the store alone: no links on the way.
            check_links: false,
            owner: cur.meta.options.service.clone(),
        })
    }

    async fn close(&self, opened: &OpenVersion) {
        let Some(state) = self.keys.existing(&opened.key) else {
            return;
        };
        let free = state.lock().await.unpin(&opened.version);
        remove_versions(&self.keys.dir_of(&opened.key), free).await;
    }
}

/// Deletes superseded versions off the async threads.
pub async fn remove_versions(dir: &VersionedDir, versions: Vec<String>) {
    if versions.is_empty() {
        return;
    }
    let dir = dir.clone();
    let _ = kt_sync::task::spawn(move || {
        for v in versions {
            if let Err(e) = dir.remove_version(&v) {
                tracing::warn!(version = %v, error = %e, "could not remove a superseded version");
            }
        }
    })
    .await;
}

/// A superseded version that no reader holds, kept ([`KeyState::spare`])
/// for the key's next put to stage in instead of being deleted: renamed to
/// the new staging version, only the entries that differ are fixed up
/// ([`recycle`]), where a fresh staging version hard-links every unchanged
/// file of the base again (and the superseded version is unlinked file by
/// file). Reads pin only a key's current version and a spare is never
/// current again, so nothing reads it. Kept in memory only: a restart's
/// cleanup removes it with every other superseded version.
#[derive(Debug, Clone)]
pub struct Spare {
    pub version: String,
    pub manifest: Arc<Manifest>,
}

/// The most bytes a spare may hold that its successor does not (the old
/// content of the files the put that superseded it changed): a version
/// holding more is deleted at once rather than kept until the next put.
const SPARE_MAX_BYTES: u64 = 64 << 20;

/// After a publish: keeps `before`, the version it superseded, as the
/// key's spare when no reader holds it (it is among `collectable`) and it
/// is close to `current`, the manifest published (few entries differ, and
/// what it alone holds is small). Only the version just superseded is
/// kept: an older spare goes, whatever becomes of `before` (so a key keeps
/// at most one spare, besides the versions readers hold). Returns the
/// versions to delete: `collectable` less the spare kept, plus the spare
/// it replaces.
pub(crate) fn keep_spare(
    st: &mut KeyState,
    before: Option<&Published>,
    current: &Manifest,
    mut collectable: Vec<String>,
) -> Vec<String> {
    collectable.extend(st.spare.take().map(|s| s.version));
    let Some(before) = before else {
        return collectable;
    };
    let Some(at) = collectable.iter().position(|v| *v == before.version) else {
        return collectable;
    };
    let fx = Fixup::between(&before.meta.manifest, current);
    if fx.work() > file_count(current) / 4 || fx.removed_bytes > SPARE_MAX_BYTES {
        return collectable;
    }
    collectable.swap_remove(at);
    st.spare = Some(Spare {
        version: before.version.clone(),
        manifest: before.meta.manifest.clone(),
    });
    collectable
}

fn file_count(m: &Manifest) -> usize {
    m.entries
        .iter()
        .filter(|e| e.kind == EntryKind::File)
        .count()
}

/// What turns a tree of one manifest (`old`) into a tree of another
/// (`new`) in place, path by path.
#[derive(Debug, Default, PartialEq, Eq)]
struct Fixup {
    /// Entries of `old` to remove, ascending (removed in reverse order:
    /// what a directory holds before the directory).
    remove: Vec<u32>,
    /// Per entry of `new`: a file `old` has at the same path with the same
    /// content, mode and mtime, left where it is.
    kept: Vec<bool>,
    /// Files of `new` not kept: linked from the base, or sent.
    add: usize,
    /// Bytes of the files of `old` removed.
    removed_bytes: u64,
}

impl Fixup {
    /// Walks both manifests (sorted by path, bytewise) side by side.
    fn between(old: &Manifest, new: &Manifest) -> Fixup {
        use std::cmp::Ordering;
        let (o, n) = (&old.entries, &new.entries);
        let mut fx = Fixup {
            kept: vec![false; n.len()],
            ..Fixup::default()
        };
        let (mut i, mut j) = (0, 0);
        loop {
            let order = match (o.get(i), n.get(j)) {
                (Some(a), Some(b)) => a.path.as_bytes().cmp(b.path.as_bytes()),
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (None, None) => break,
            };
            match order {
                Ordering::Less => {
                    fx.drop_old(&o[i], i);
                    i += 1;
                }
                Ordering::Greater => {
                    fx.add += usize::from(n[j].kind == EntryKind::File);
                    j += 1;
                }
                Ordering::Equal => {
                    let (a, b) = (&o[i], &n[j]);
                    match (a.kind, b.kind) {
                        (EntryKind::Dir, EntryKind::Dir) => {}
                        (EntryKind::File, EntryKind::File) if same_file(a, b) => fx.kept[j] = true,
                        // Its times are set again when the version is finished.
                        (EntryKind::Symlink, EntryKind::Symlink) if a.target == b.target => {}
                        _ => {
                            fx.drop_old(a, i);
                            fx.add += usize::from(b.kind == EntryKind::File);
                        }
                    }
                    i += 1;
                    j += 1;
                }
            }
        }
        fx
    }

    fn drop_old(&mut self, e: &Entry, i: usize) {
        self.remove.push(i as u32);
        if e.kind == EntryKind::File {
            self.removed_bytes += e.size;
        }
    }

    /// Entries removed and files added: the work of fixing the tree up,
    /// against a link per unchanged file for a fresh staging version.
    fn work(&self) -> usize {
        self.remove.len() + self.add
    }
}

/// A file as `new` wants it, content, mode and mtime (a deferred entry's
/// placeholder hash is the hash of nothing published).
fn same_file(old: &Entry, new: &Entry) -> bool {
    old.hash.is_some()
        && old.hash == new.hash
        && new.hash != Some(DEFERRED_HASH)
        && (old.size, old.mode, old.mtime, old.mtime_nsec)
            == (new.size, new.mode, new.mtime, new.mtime_nsec)
}

/// A staging version made ([`stage`]): the indices of the files to be
/// sent, and a spare that was not used, to be deleted.
#[derive(Debug)]
pub(crate) struct Staged {
    pub needed: Vec<u32>,
    pub unused: Option<String>,
}

/// Fills staging version `id` of `dir` (empty, just made by
/// [`VersionedDir::stage`]) with what `m` needs of the base version
/// (`base`: its tree and manifest). With a `spare`, in the spare's tree
/// when few enough entries differ ([`recycle`]), else (or should that
/// fail midway) as a fresh staging version: the result is the same tree.
pub(crate) fn stage(
    dir: &VersionedDir,
    id: &str,
    spare: Option<Spare>,
    m: &Manifest,
    base: Option<(&Path, &Manifest)>,
) -> Result<Staged, SyncError> {
    let staging = dir.version_path(id);
    let mut unused = None;
    if let Some(spare) = spare {
        match recycle(dir, id, &spare, m, base) {
            Ok(Some(needed)) => {
                return Ok(Staged {
                    needed,
                    unused: None,
                });
            }
            Ok(None) => unused = Some(spare.version),
            Err(e) => {
                tracing::warn!(dir = %dir.path().display(), spare = %spare.version, error = %e, "could not stage in a superseded version; staging afresh");
                kt_sync::publish::force_remove_dir_all(&staging)?;
                std::fs::create_dir(&staging).map_err(|e| SyncError::io(&staging, e))?;
                if dir.version_path(&spare.version).exists() {
                    unused = Some(spare.version);
                }
            }
        }
    }
    match stage_from_base(&staging, m, base) {
        Ok(needed) => Ok(Staged { needed, unused }),
        Err(e) => {
            // The caller removes the staging version; nothing else holds the spare.
            if let Some(v) = unused {
                let _ = dir.remove_version(&v);
            }
            Err(e)
        }
    }
}

/// Fills a fresh staging version with every file whose content the base
/// version already has; returns the indices that must be sent.
pub(crate) fn stage_from_base(
    staging: &Path,
    m: &Manifest,
    base: Option<(&Path, &Manifest)>,
) -> Result<Vec<u32>, SyncError> {
    apply::ensure_dirs(staging, m)?;
    link_from_base(staging, m, base, &[])
}

/// Makes staging version `id` of `dir` (an empty directory) out of
/// `spare`'s tree ([`fix_up`]); returns the indices of `m` to be sent, or
/// None when too many entries differ for it to pay (the spare is then
/// left as it is).
pub(crate) fn recycle(
    dir: &VersionedDir,
    id: &str,
    spare: &Spare,
    m: &Manifest,
    base: Option<(&Path, &Manifest)>,
) -> Result<Option<Vec<u32>>, SyncError> {
    let fx = Fixup::between(&spare.manifest, m);
    if fx.work() * 2 > file_count(m) {
        return Ok(None);
    }
    fix_up(dir, id, spare, &fx, m, base).map(Some)
}

/// Renames `spare`'s tree over staging version `id` of `dir` (an empty
/// directory), then fixes up only the entries that differ (`fx`): removes
/// what `m` does not have as the spare has it, makes the directories `m`
/// adds, and links from the base (or copies) the files it has the content
/// of. A file is never written: the spare shares its inodes with other
/// versions; only directory entries change. Returns the indices of `m` to
/// be sent.
///
/// A failure or a crash midway leaves a staging version that was never
/// marked for resuming nor published: the caller removes it, or the next
/// start does (the spare was superseded and unheld: nothing is lost).
fn fix_up(
    dir: &VersionedDir,
    id: &str,
    spare: &Spare,
    fx: &Fixup,
    m: &Manifest,
    base: Option<(&Path, &Manifest)>,
) -> Result<Vec<u32>, SyncError> {
    use std::os::unix::fs::PermissionsExt;
    let staging = dir.version_path(id);
    let from = dir.version_path(&spare.version);
    // Over the empty staging directory, atomically.
    std::fs::rename(&from, &staging).map_err(|e| SyncError::io(&from, e))?;
    // What is left under the spare's name: its manifest.
    dir.remove_version(&spare.version)?;
    let old = &spare.manifest;
    // Its directories as the put that made it left them: make those a
    // server that is not root could not change writable (parents first);
    // finishing the version sets every mode again.
    for e in old.entries.iter().filter(|e| e.kind == EntryKind::Dir) {
        let mode = kt_types::manifest::safe_mode(e.mode);
        if mode & 0o700 != 0o700 {
            let p = staging.join(&e.path);
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode | 0o700))
                .map_err(|err| SyncError::io(&p, err))?;
        }
    }
    for &i in fx.remove.iter().rev() {
        let e = &old.entries[i as usize];
        let p = staging.join(&e.path);
        let removed = match e.kind {
            EntryKind::Dir => std::fs::remove_dir(&p),
            EntryKind::File | EntryKind::Symlink => std::fs::remove_file(&p),
        };
        match removed {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                return Err(SyncError::io(&p, err));
            }
            _ => {}
        }
    }
    apply::ensure_dirs(&staging, m)?;
    link_from_base(&staging, m, base, &fx.kept)
}

/// Hard-links into `staging` (or copies, where the metadata differs) every
/// file of `m` whose content the base version has, but those `kept` (per
/// entry; there already, as `m` has them); returns the indices of the
/// other files, which must be sent. Every destination must be free: a
/// link over an existing file would copy into its inode.
fn link_from_base(
    staging: &Path,
    m: &Manifest,
    base: Option<(&Path, &Manifest)>,
    kept: &[bool],
) -> Result<Vec<u32>, SyncError> {
    let is_kept = |i: u32| kept.get(i as usize).copied().unwrap_or(false);
    let plan = kt_sync::diff::against_base(m, base.map(|(_, bm)| bm));
    let reuse: Vec<apply::Reuse> = match base {
        Some((root, _)) => plan
            .reuse
            .iter()
            .filter(|&&(i, _)| !is_kept(i))
            .map(|&(i, old)| {
                let e = &m.entries[i as usize];
                apply::Reuse {
                    from: root.join(&old.path),
                    to: staging.join(&e.path),
                    entry: e.clone(),
                    identical: old.mode == e.mode
                        && old.mtime == e.mtime
                        && old.mtime_nsec == e.mtime_nsec,
                }
            })
            .collect(),
        None => Vec::new(),
    };
    apply::reuse_all(&reuse)?;
    Ok(plan.needed.into_iter().filter(|&i| !is_kept(i)).collect())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use kt_sync::apply::{WriteMode, finish_tree, write_verified};
    use kt_types::{Hash, RootKind};

    use super::*;

    /// xorshift64: reproducible change sets without a dependency.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            (x % n.max(1) as u64) as usize
        }
    }

    /// A tree as a test wants it, by path.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Node {
        Dir {
            mode: u32,
        },
        File {
            data: Vec<u8>,
            mode: u32,
            mtime: i64,
        },
        Link {
            target: String,
            mtime: i64,
        },
    }

    type Tree = BTreeMap<String, Node>;

    fn manifest_of(t: &Tree) -> Manifest {
        let entries = t
            .iter()
            .map(|(path, node)| {
                let (kind, size, mode, mtime, hash, target) = match node {
                    Node::Dir { mode } => (EntryKind::Dir, 0, *mode, 0, None, None),
                    Node::File { data, mode, mtime } => (
                        EntryKind::File,
                        data.len() as u64,
                        *mode,
                        *mtime,
                        Some(Hash(*blake3::hash(data).as_bytes())),
                        None,
                    ),
                    Node::Link { target, mtime } => (
                        EntryKind::Symlink,
                        0,
                        0o777,
                        *mtime,
                        None,
                        Some(target.clone()),
                    ),
                };
                Entry {
                    path: path.clone(),
                    kind,
                    size,
                    mode,
                    mtime,
                    mtime_nsec: 0,
                    hash,
                    target,
                }
            })
            .collect();
        let m = Manifest {
            root: RootKind::Dir,
            entries,
        };
        m.validate(&Default::default()).unwrap();
        m
    }

    /// What is on disk under `root`, as a [`Tree`].
    fn read_tree(root: &Path) -> Tree {
        let mut out = Tree::new();
        let mut dirs = vec![(root.to_owned(), String::new())];
        while let Some((dir, rel)) = dirs.pop() {
            for d in std::fs::read_dir(&dir).unwrap() {
                let d = d.unwrap();
                let name = d.file_name().into_string().unwrap();
                let path = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                let md = std::fs::symlink_metadata(d.path()).unwrap();
                let node = if md.is_dir() {
                    dirs.push((d.path(), path.clone()));
                    Node::Dir {
                        mode: md.permissions().mode() & 0o7777,
                    }
                } else if md.file_type().is_symlink() {
                    Node::Link {
                        target: std::fs::read_link(d.path())
                            .unwrap()
                            .into_os_string()
                            .into_string()
                            .unwrap(),
                        mtime: md.mtime(),
                    }
                } else {
                    Node::File {
                        data: std::fs::read(d.path()).unwrap(),
                        mode: md.permissions().mode() & 0o7777,
                        mtime: md.mtime(),
                    }
                };
                out.insert(path, node);
            }
        }
        out
    }

    /// Makes the files `needed` of `t` in `staging` and finishes it: what
    /// the batch stream and the commit do.
    fn finish(staging: &Path, t: &Tree, m: &Manifest, needed: &[u32]) {
        for &i in needed {
            let e = &m.entries[i as usize];
            let Some(Node::File { data, .. }) = t.get(&e.path) else {
                panic!("{} is not a file", e.path);
            };
            write_verified(&staging.join(&e.path), e, data, WriteMode::Direct).unwrap();
        }
        finish_tree(staging, m).unwrap();
    }

    /// A published version of `t`, staged from `base` as a put does.
    fn put(vd: &VersionedDir, t: &Tree, base: Option<(&str, &Manifest)>) -> (String, Manifest) {
        let m = manifest_of(t);
        let id = vd.stage().unwrap();
        let base_root = base.map(|(v, _)| vd.version_path(v));
        let base = base_root.as_deref().zip(base.map(|(_, bm)| bm));
        let needed = stage_from_base(&vd.version_path(&id), &m, base).unwrap();
        finish(&vd.version_path(&id), t, &m, &needed);
        vd.write_meta(&id, b"meta").unwrap();
        (id, m)
    }

    fn random_data(rng: &mut Rng) -> Vec<u8> {
        (0..1 + rng.below(64))
            .map(|_| rng.below(256) as u8)
            .collect()
    }

    fn random_tree(rng: &mut Rng) -> Tree {
        let mut t = Tree::new();
        for d in ["a", "a/x", "b", "c"] {
            t.insert(d.into(), Node::Dir { mode: 0o755 });
        }
        for n in 0..40 {
            let dir = ["a", "a/x", "b", "c"][rng.below(4)];
            let node = Node::File {
                data: random_data(rng),
                mode: 0o644,
                mtime: 1_700_000_000 + n,
            };
            t.insert(format!("{dir}/f{n}"), node);
        }
        t.insert(
            "b/link".into(),
            Node::Link {
                target: "../a/x".into(),
                mtime: 1_700_000_000,
            },
        );
        t
    }

    /// Removes `path` and everything below it.
    fn remove_subtree(t: &mut Tree, path: &str) {
        let below = format!("{path}/");
        t.retain(|p, _| p != path && !p.starts_with(&below));
    }

    /// `t` with up to `ops` random changes: contents rewritten, taken from
    /// another file (a rename, or back to what was there before), modes or
    /// mtimes alone, files, links and directories added, removed or
    /// turned into one another.
    fn change(rng: &mut Rng, t: &Tree, ops: usize) -> Tree {
        let mut t = t.clone();
        for n in 0..1 + rng.below(ops) {
            let paths: Vec<String> = t.keys().cloned().collect();
            let files: Vec<String> = paths
                .iter()
                .filter(|p| matches!(t[*p], Node::File { .. }))
                .cloned()
                .collect();
            let dirs: Vec<String> = paths
                .iter()
                .filter(|p| matches!(t[*p], Node::Dir { .. }))
                .cloned()
                .collect();
            let fresh = format!("n{}-{n}", rng.below(1000));
            let dir = |rng: &mut Rng| {
                if dirs.is_empty() || rng.below(5) == 0 {
                    String::new()
                } else {
                    format!("{}/", dirs[rng.below(dirs.len())])
                }
            };
            match rng.below(10) {
                0 | 1 if !files.is_empty() => {
                    let p = &files[rng.below(files.len())];
                    if let Some(Node::File { data, mtime, .. }) = t.get_mut(p) {
                        *data = random_data(rng);
                        *mtime += 1;
                    }
                }
                2 if files.len() > 1 => {
                    let from = t[&files[rng.below(files.len())]].clone();
                    t.insert(files[rng.below(files.len())].clone(), from);
                }
                3 if !files.is_empty() => {
                    let p = &files[rng.below(files.len())];
                    if let Some(Node::File { mode, mtime, .. }) = t.get_mut(p) {
                        if rng.below(2) == 0 {
                            *mode ^= 0o111;
                        } else {
                            *mtime += 7;
                        }
                    }
                }
                4 if !files.is_empty() => {
                    t.remove(&files[rng.below(files.len())]);
                }
                5 => {
                    let p = format!("{}{fresh}", dir(rng));
                    let node = if rng.below(4) == 0 {
                        Node::Link {
                            target: "f0".into(),
                            mtime: 1_700_000_000,
                        }
                    } else {
                        Node::File {
                            data: random_data(rng),
                            mode: 0o600,
                            mtime: 1_700_000_500,
                        }
                    };
                    t.insert(p, node);
                }
                6 => {
                    let p = format!("{}{fresh}", dir(rng));
                    t.insert(p.clone(), Node::Dir { mode: 0o700 });
                    t.insert(
                        format!("{p}/in"),
                        Node::File {
                            data: random_data(rng),
                            mode: 0o644,
                            mtime: 1_700_000_900,
                        },
                    );
                }
                7 if !dirs.is_empty() => {
                    // A directory becomes a file, or goes.
                    let p = dirs[rng.below(dirs.len())].clone();
                    remove_subtree(&mut t, &p);
                    if rng.below(2) == 0 {
                        let node = Node::File {
                            data: random_data(rng),
                            mode: 0o644,
                            mtime: 1_700_000_100,
                        };
                        t.insert(p, node);
                    }
                }
                8 if !files.is_empty() => {
                    // A file becomes a directory or a link.
                    let p = files[rng.below(files.len())].clone();
                    if rng.below(2) == 0 {
                        t.insert(p.clone(), Node::Dir { mode: 0o555 });
                        t.insert(
                            format!("{p}/in"),
                            Node::File {
                                data: random_data(rng),
                                mode: 0o644,
                                mtime: 1_700_000_200,
                            },
                        );
                    } else {
                        let node = Node::Link {
                            target: "elsewhere".into(),
                            mtime: 1_700_000_300,
                        };
                        t.insert(p, node);
                    }
                }
                _ => {
                    // A directory's mode, or a link's target.
                    if let Some(Node::Link { target, .. }) = t.get_mut("b/link") {
                        *target = format!("../{fresh}");
                    } else if let Some(d) = dirs.first()
                        && let Some(Node::Dir { mode }) = t.get_mut(d)
                    {
                        *mode ^= 0o020;
                    }
                }
            }
        }
        t
    }

    /// The property: a version staged in a spare (the version two puts
    /// back) and then finished is the tree a fresh staging version makes,
    /// for random change sets, big and small; it sends no more; and the
    /// version it was staged against (sharing inodes with the spare) is
    /// left as it was.
    #[test]
    fn a_version_staged_in_a_spare_is_the_tree_a_fresh_staging_makes() {
        for seed in 1..=40u64 {
            let d = tempfile::tempdir().unwrap();
            let vd = VersionedDir::new(d.path().join("k"));
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let t0 = random_tree(&mut rng);
            // Small change sets and large ones.
            let ops = if seed % 4 == 0 { 40 } else { 6 };
            let t1 = change(&mut rng, &t0, ops);
            let t2 = change(&mut rng, &t1, ops);
            let (v0, m0) = put(&vd, &t0, None);
            let (v1, m1) = put(&vd, &t1, Some((&v0, &m0)));
            let before = read_tree(&vd.version_path(&v1));
            assert_eq!(before, t1, "seed {seed}");
            let m2 = manifest_of(&t2);
            let base_root = vd.version_path(&v1);
            let base = Some((base_root.as_path(), &m1));

            let fresh = vd.stage().unwrap();
            let fresh_needed = stage_from_base(&vd.version_path(&fresh), &m2, base).unwrap();
            finish(&vd.version_path(&fresh), &t2, &m2, &fresh_needed);

            let spare = Spare {
                version: v0.clone(),
                manifest: Arc::new(m0.clone()),
            };
            let id = vd.stage().unwrap();
            let fx = Fixup::between(&m0, &m2);
            let needed = fix_up(&vd, &id, &spare, &fx, &m2, base).unwrap();
            finish(&vd.version_path(&id), &t2, &m2, &needed);

            assert_eq!(read_tree(&vd.version_path(&id)), t2, "seed {seed}");
            assert_eq!(read_tree(&vd.version_path(&fresh)), t2, "seed {seed}");
            assert!(
                needed.iter().all(|i| fresh_needed.contains(i)),
                "seed {seed}: {needed:?} against {fresh_needed:?}"
            );
            assert_eq!(
                read_tree(&base_root),
                before,
                "seed {seed}: the base changed"
            );
            assert!(!vd.version_path(&v0).exists(), "seed {seed}");
            // Its manifest went with its name.
            assert!(vd.read_meta(&v0).is_err(), "seed {seed}");
        }
    }

    #[test]
    fn a_fix_up_touches_only_what_differs() {
        let mut t0 = Tree::new();
        t0.insert("d".into(), Node::Dir { mode: 0o755 });
        for n in 0..8 {
            let node = Node::File {
                data: vec![n],
                mode: 0o644,
                mtime: 1,
            };
            t0.insert(format!("d/f{n}"), node);
        }
        let mut t1 = t0.clone();
        t1.insert(
            "d/f1".into(),
            Node::File {
                data: vec![9],
                mode: 0o644,
                mtime: 2,
            },
        );
        t1.remove("d/f2");
        t1.insert(
            "d/g".into(),
            Node::File {
                data: vec![0],
                mode: 0o644,
                mtime: 1,
            },
        );
        let (m0, m1) = (manifest_of(&t0), manifest_of(&t1));
        let fx = Fixup::between(&m0, &m1);
        // d/f1 (changed) and d/f2 (gone) are removed.
        assert_eq!(fx.remove, [2, 3]);
        assert_eq!(fx.add, 2, "d/f1 and d/g");
        assert_eq!(fx.removed_bytes, 2);
        let kept: Vec<&str> = (0..m1.entries.len())
            .filter(|&i| fx.kept[i])
            .map(|i| m1.entries[i].path.as_str())
            .collect();
        assert_eq!(kept, ["d/f0", "d/f3", "d/f4", "d/f5", "d/f6", "d/f7"]);
        assert_eq!(fx.work(), 4);
        // Identical trees: nothing to do.
        assert_eq!(Fixup::between(&m1, &m1).work(), 0);
    }

    /// A key keeps one spare at most, the version just superseded: when a
    /// reader holds that one, or it is too far from the new tree, an older
    /// spare goes too.
    #[test]
    fn only_the_version_just_superseded_is_kept() {
        let mut t = Tree::new();
        t.insert("d".into(), Node::Dir { mode: 0o755 });
        for n in 0..8 {
            let node = Node::File {
                data: vec![n],
                mode: 0o644,
                mtime: 1,
            };
            t.insert(format!("d/f{n}"), node);
        }
        let m = Arc::new(manifest_of(&t));
        let published = |v: &str, m: &Arc<Manifest>| Published {
            version: v.into(),
            digest: Hash([0; 32]),
            meta: Arc::new(crate::keys::VersionMeta {
                key: Key::parse("t/k").unwrap(),
                manifest: m.clone(),
                options: Default::default(),
            }),
        };
        let spare = |st: &KeyState| st.spare.as_ref().map(|s| s.version.clone());
        let mut st = KeyState::default();
        // Unheld and close to the new tree: kept.
        assert!(keep_spare(&mut st, Some(&published("a", &m)), &m, vec!["a".into()]).is_empty());
        assert_eq!(spare(&st).as_deref(), Some("a"));
        // The next version superseded is read (not collectable): "a" goes.
        assert_eq!(
            keep_spare(&mut st, Some(&published("b", &m)), &m, vec![]),
            ["a"]
        );
        assert_eq!(spare(&st), None);
        // Kept, then replaced by the next one.
        assert!(keep_spare(&mut st, Some(&published("c", &m)), &m, vec!["c".into()]).is_empty());
        assert_eq!(
            keep_spare(&mut st, Some(&published("d", &m)), &m, vec!["d".into()]),
            ["c"]
        );
        assert_eq!(spare(&st).as_deref(), Some("d"));
        // Every file changed: too far to be worth keeping; "d" goes too.
        let mut far = t.clone();
        for node in far.values_mut() {
            if let Node::File { data, .. } = node {
                data.push(0);
            }
        }
        let far = manifest_of(&far);
        let mut gone = keep_spare(&mut st, Some(&published("e", &m)), &far, vec!["e".into()]);
        gone.sort();
        assert_eq!(gone, ["d", "e"]);
        assert_eq!(spare(&st), None);
    }

    /// Staging in a spare that fails midway (here: a file it must remove
    /// is a directory now) leaves a staging version that was never marked
    /// nor published: a restart's cleanup removes it and the current
    /// version is untouched; staged anew ([`stage`]), the same put falls
    /// back to a fresh staging version and makes the right tree.
    #[test]
    fn a_spare_that_fails_midway_leaves_current_and_stages_afresh() {
        let d = tempfile::tempdir().unwrap();
        let vd = VersionedDir::new(d.path().join("k"));
        let mut rng = Rng(7);
        let t0 = random_tree(&mut rng);
        let mut t1 = t0.clone();
        let mut t2 = t0.clone();
        let victim = t0
            .iter()
            .find(|(_, n)| matches!(n, Node::File { .. }))
            .map(|(p, _)| p.clone())
            .unwrap();
        for (t, byte) in [(&mut t1, 1u8), (&mut t2, 2)] {
            if let Some(Node::File { data, .. }) = t.get_mut(&victim) {
                data.push(byte);
            }
        }
        let (m2, base_root) = (manifest_of(&t2), |v: &str| vd.version_path(v));
        let spoil = |v: &str| {
            // The spare's copy of the changed file, made a non-empty directory.
            let p = base_root(v).join(&victim);
            std::fs::remove_file(&p).unwrap();
            std::fs::create_dir(&p).unwrap();
            std::fs::write(p.join("in-the-way"), b"x").unwrap();
        };

        let (v0, m0) = put(&vd, &t0, None);
        let (v1, m1) = put(&vd, &t1, Some((&v0, &m0)));
        vd.publish(&v1).unwrap();
        let published = read_tree(&base_root(&v1));
        spoil(&v0);
        let spare = Spare {
            version: v0.clone(),
            manifest: Arc::new(m0.clone()),
        };
        let id = vd.stage().unwrap();
        let v1_root = base_root(&v1);
        let base = Some((v1_root.as_path(), &m1));
        assert!(recycle(&vd, &id, &spare, &m2, base).is_err());
        // A crash here: the next start's cleanup.
        assert!(vd.cleanup().unwrap());
        assert_eq!(vd.current().unwrap().as_deref(), Some(v1.as_str()));
        let left: Vec<String> = std::fs::read_dir(vd.path())
            .unwrap()
            .map(|d| d.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("v-"))
            .collect();
        assert_eq!(left.len(), 2, "{left:?}: v-{v1} and its manifest only");
        assert_eq!(read_tree(&v1_root), published);

        // Without a crash: the put stages afresh and makes the right tree.
        let (v0, m0) = put(&vd, &t0, None);
        spoil(&v0);
        let spare = Spare {
            version: v0.clone(),
            manifest: Arc::new(m0),
        };
        let id = vd.stage().unwrap();
        let staged = stage(&vd, &id, Some(spare), &m2, base).unwrap();
        finish(&vd.version_path(&id), &t2, &m2, &staged.needed);
        assert_eq!(read_tree(&vd.version_path(&id)), t2);
        assert_eq!(staged.unused, None, "the spare was used up");
        assert!(!vd.version_path(&v0).exists());
        assert_eq!(read_tree(&v1_root), published);
    }
}
