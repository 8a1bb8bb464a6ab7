//! Node-cache mode (`kt-agent --node-cache`): the agent holds datasets for
//! its node and serves the dataset API of [`kt_types::dataset`] (admin
//! callers only) to the `Dataset` controller.
//!
//! Layout below the dataset root (a hostPath, [`DEFAULT_ROOT`]):
//!
//! ```text
//! <root>/.kt/state.json                       what the node holds (atomic rewrite)
//! <root>/.kt/versions/<ns>/<name>/<dir>/      one fetched version of a dataset
//! <root>/.kt/agent/                           the agent's exports (its state dir)
//! <path>  -> ../.kt/versions/<ns>/<name>/<dir>  the dataset's path: a relative symlink
//! ```
//!
//! Invariants:
//!
//! - **Old or new, never half.** A version is fetched into a directory of
//!   its own (a fresh `<dir>` per attempt, never the one the path links
//!   to); only once it is complete, verified by the getter and taken by
//!   the agent's exports is the path switched to it, by renaming a new
//!   symlink over the old one (`rename(2)` is atomic). The previous
//!   version's directory is removed after the switch. A crash mid-fetch
//!   leaves the path on the old version; the restarted agent marks the
//!   seed failed ("interrupted") and removes the partial directory. The
//!   link is relative, so it resolves alike on the host and in a
//!   container that mounts the root (a pod mounting the path itself binds
//!   the version current when it started).
//! - **What is held is on record.** `state.json` names every dataset, its
//!   held version (the link's target), the seed in flight and the last
//!   failure; it is rewritten (temporary file, fsync, rename) before an
//!   answer or a switch is reported. A restarted agent reports and serves
//!   the same datasets; a version directory no record names is removed.
//! - **Served like any copy.** A complete version is exported as a
//!   downloaded copy (the getter hands it to this agent over its own
//!   control socket, where `export_copy` checks it against the disk), so
//!   peers and pods fetch it from this node; a removed or replaced version
//!   is no longer exported.
//! - **The budget holds.** Bytes reserved by placed datasets (held plus
//!   the total of the seed in flight) never exceed the budget; a seed that
//!   does not fit even after evicting unplaced datasets (least recently
//!   placed first) is refused with `insufficient_storage` and evicts
//!   nothing ([`admit`], a pure function).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kt_client::Client;
use kt_client::progress::{Progress, ProgressSink};
use kt_service::{ApiError, ApiJson};
use kt_types::dataset::{
    DEFAULT_ROOT, NodeDataset, NodeDatasetState, NodeReport, SeedBroadcast, SeedRequest,
};
use kt_types::{ErrorCode, Key};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use crate::exports::{Export, Exports, FileError, io};

/// The directory below the root that holds the agent's own files.
pub const INTERNAL: &str = ".kt";
/// Longest version id accepted.
const MAX_VERSION_LEN: usize = 256;
/// Longest broadcast window accepted (an hour).
const MAX_WINDOW_MS: u64 = 3_600_000;

/// How a node-cache agent holds datasets (`--node-cache`).
#[derive(Debug, Clone)]
pub struct NodeCacheConfig {
    /// The node it holds data for (`--node-name`, `KT_NODE_NAME`).
    pub node: String,
    /// Every dataset lies below this (`--dataset-root`).
    pub root: PathBuf,
    /// The most bytes kept below the root (`--dataset-budget`); `None`:
    /// the filesystem's size.
    pub budget: Option<u64>,
    /// The token's file, read again as it is rotated (the seeding client's
    /// credential).
    pub token_file: Option<PathBuf>,
}

impl NodeCacheConfig {
    pub fn new(node: impl Into<String>) -> Self {
        NodeCacheConfig {
            node: node.into(),
            root: PathBuf::from(DEFAULT_ROOT),
            budget: None,
            token_file: None,
        }
    }

    /// `<root>/.kt/agent`: the agent's state directory in node-cache mode
    /// (on the hostPath, so exports survive a restart).
    pub fn state_dir(&self) -> PathBuf {
        self.root.join(INTERNAL).join("agent")
    }

    /// `<root>/.kt/versions`: where fetched versions live (the only place
    /// a node-cache agent exports from).
    pub fn versions_dir(&self) -> PathBuf {
        self.root.join(INTERNAL).join("versions")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeCacheError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{0}")]
    Config(String),
}

// ---------------------------------------------------------------------------
// The budget: a pure function.

/// One dataset's share of the budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    pub id: (String, String),
    pub placed: bool,
    /// Bytes of the version the path links to.
    pub held: u64,
    /// The total of the seed in flight (0: none).
    pub pending_total: u64,
    /// What the seed in flight has written so far.
    pub pending_done: u64,
    /// When it was last placed (larger: later).
    pub placed_seq: u64,
}

/// What a node has to give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub budget: u64,
    /// Free bytes of the filesystem now.
    pub fs_available: u64,
}

/// Whether a seed of `bytes` for dataset `target` fits: `Ok` with the
/// unplaced datasets to evict for it (least recently placed first, as few
/// as needed), or `Err` with what a seed may have at most. The target's
/// own seed in flight is replaced (not counted); its held version counts
/// until the switch.
pub fn admit(
    usages: &[Usage],
    target: &(String, String),
    bytes: u64,
    cap: Capacity,
) -> Result<Vec<(String, String)>, u64> {
    let mut reserved = 0u64;
    let mut outstanding = 0u64;
    let mut unplaced: Vec<&Usage> = Vec::new();
    for u in usages {
        if &u.id == target {
            reserved = reserved.saturating_add(u.held);
            continue;
        }
        outstanding = outstanding.saturating_add(u.pending_total.saturating_sub(u.pending_done));
        if u.placed {
            reserved = reserved.saturating_add(u.held.saturating_add(u.pending_total));
        } else {
            unplaced.push(u);
        }
    }
    unplaced.sort_by_key(|u| u.placed_seq);
    let evictable: u64 = unplaced.iter().map(|u| u.held).sum();
    let budget_room = cap
        .budget
        .saturating_sub(reserved)
        .saturating_sub(evictable);
    let fs_room = cap.fs_available.saturating_sub(outstanding);
    let most = budget_room.min(fs_room).saturating_add(evictable);
    if bytes > most {
        return Err(most);
    }
    let mut evict = Vec::new();
    let mut freed = 0u64;
    for u in unplaced {
        if bytes <= budget_room.saturating_add(freed) && bytes <= fs_room.saturating_add(freed) {
            break;
        }
        freed += u.held;
        evict.push(u.id.clone());
    }
    Ok(evict)
}

/// [`NodeReport::free_bytes`]: the budget less what placed datasets
/// reserve, bounded by the filesystem's free space; unplaced datasets
/// count as free.
pub fn free_bytes(usages: &[Usage], cap: Capacity) -> u64 {
    let reserved: u64 = usages
        .iter()
        .filter(|u| u.placed)
        .map(|u| u.held.saturating_add(u.pending_total))
        .sum();
    let outstanding: u64 = usages
        .iter()
        .map(|u| u.pending_total.saturating_sub(u.pending_done))
        .sum();
    let unplaced: u64 = usages.iter().filter(|u| !u.placed).map(|u| u.held).sum();
    let fs = cap
        .fs_available
        .saturating_sub(outstanding)
        .saturating_add(unplaced);
    cap.budget.saturating_sub(reserved).min(fs)
}

// ---------------------------------------------------------------------------
// Validation.

/// Why `s` is not a Kubernetes DNS-1123 label (a namespace), if it is not.
pub fn label_problem(what: &str, s: &str) -> Option<String> {
    let ok_chars = s
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let ok_ends = s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric());
    if s.is_empty() || s.len() > 63 || !ok_chars || !ok_ends {
        return Some(format!(
            "{what} {s:?} is not a Kubernetes name (1 to 63 of a-z, 0-9 and `-`, starting and ending alphanumeric)"
        ));
    }
    None
}

/// Why `s` is not a Kubernetes object name (a DNS-1123 subdomain), if not.
pub fn name_problem(what: &str, s: &str) -> Option<String> {
    if s.is_empty() || s.len() > 253 || s.split('.').any(|l| label_problem(what, l).is_some()) {
        return Some(format!(
            "{what} {s:?} is not a Kubernetes name (DNS-1123: lowercase alphanumerics, `-` and `.`, at most 253)"
        ));
    }
    None
}

fn version_problem(v: &str) -> Option<String> {
    (v.is_empty() || v.len() > MAX_VERSION_LEN || v.chars().any(char::is_control)).then(|| {
        format!(
            "version {v:?} is empty, longer than {MAX_VERSION_LEN} bytes or has control characters"
        )
    })
}

fn broadcast_problem(b: &SeedBroadcast) -> Option<String> {
    if b.group.is_empty() || b.group.len() > 128 || b.group.chars().any(char::is_control) {
        return Some(format!(
            "broadcast group {:?} is empty, longer than 128 bytes or has control characters",
            b.group
        ));
    }
    if b.fanout == 0 {
        return Some("broadcast fanout must be at least 1".into());
    }
    if b.window_ms > MAX_WINDOW_MS {
        return Some(format!(
            "broadcast window {} ms is longer than {MAX_WINDOW_MS} ms",
            b.window_ms
        ));
    }
    None
}

/// Whether two dataset paths overlap (equal, or one below the other).
fn overlaps(a: &str, b: &str) -> bool {
    let (a, b) = (a.trim_end_matches('/'), b.trim_end_matches('/'));
    let below = |x: &str, y: &str| x.strip_prefix(y).is_some_and(|r| r.starts_with('/'));
    a == b || below(a, b) || below(b, a)
}

/// A version id as a directory name: its safe characters (at most 64),
/// then a fresh suffix.
/// Recreates the tree `from` at `to` (which must not exist yet) with hard
/// links for files, symlinks copied as links, directories made afresh; the
/// number of files linked. Never follows a link.
fn link_tree(from: &Path, to: &Path) -> std::io::Result<u64> {
    let mut linked = 0;
    std::fs::create_dir(to)?;
    let mut stack = vec![(from.to_owned(), to.to_owned())];
    while let Some((src, dst)) = stack.pop() {
        for entry in std::fs::read_dir(&src)? {
            let entry = entry?;
            let (s, d) = (entry.path(), dst.join(entry.file_name()));
            let kind = entry.file_type()?;
            if kind.is_dir() {
                std::fs::create_dir(&d)?;
                stack.push((s, d));
            } else if kind.is_symlink() {
                std::os::unix::fs::symlink(std::fs::read_link(&s)?, &d)?;
            } else if kind.is_file() {
                std::fs::hard_link(&s, &d)?;
                linked += 1;
            }
        }
    }
    Ok(linked)
}

fn version_dir(version: &str) -> String {
    let safe: String = version
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        .take(64)
        .collect();
    let safe = safe.trim_start_matches('.');
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!(
        "{}-{}",
        if safe.is_empty() { "v" } else { safe },
        &suffix[..12]
    )
}

/// The link target of `path` (below `root`) to `target` (below `root`
/// too): relative, so it resolves in any mount of the root.
fn relative_target(root: &Path, path: &Path, target: &Path) -> Option<PathBuf> {
    let rel_path = path.strip_prefix(root).ok()?;
    let rel_target = target.strip_prefix(root).ok()?;
    let depth = rel_path.components().count().checked_sub(1)?;
    let mut t = PathBuf::new();
    for _ in 0..depth {
        t.push("..");
    }
    t.push(rel_target);
    Some(t)
}

/// Points `path` at `target` atomically: a new link renamed over the old
/// (only ever a link: anything else at `path` is refused), then the
/// directory synced.
fn switch_link(path: &Path, target: &Path) -> std::io::Result<()> {
    let parent = path
        .parent()
        .ok_or_else(|| std::io::Error::other("a dataset path has a parent"))?;
    std::fs::create_dir_all(parent)?;
    match std::fs::symlink_metadata(path) {
        Ok(md) if !md.file_type().is_symlink() => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a dataset's link (remove it)",
                    path.display()
                ),
            ));
        }
        _ => {}
    }
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = parent.join(format!(".{name}.kt-{}", uuid::Uuid::new_v4().simple()));
    std::os::unix::fs::symlink(target, &tmp)?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::File::open(parent)?.sync_all()
}

/// Why the directories between `root` and `path` are not plain
/// directories, if one is not: a symbolic link planted there (or one a
/// dataset's files put there) would carry the dataset's link, and what
/// the agent removes, out of the root.
fn parents_problem(root: &Path, path: &Path) -> Option<String> {
    let rel = path.strip_prefix(root).ok()?;
    let parts: Vec<_> = rel.components().collect();
    let mut at = root.to_path_buf();
    for part in &parts[..parts.len().saturating_sub(1)] {
        at.push(part);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                return Some(format!(
                    "{} is a symbolic link: a dataset's path may not lie below one",
                    at.display()
                ));
            }
            Ok(m) if !m.is_dir() => {
                return Some(format!("{} is not a directory", at.display()));
            }
            Ok(_) => {}
            // Not there yet: made as a plain directory.
            Err(_) => break,
        }
    }
    None
}

/// Removes `path` if it is a link (never what it points to).
fn remove_link(path: &Path) {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        let _ = std::fs::remove_file(path);
    }
}

/// Removes a version directory (or a single-file version).
fn remove_tree(path: &Path) {
    let r = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(_) => Ok(()),
    };
    if let Err(e) = r {
        tracing::warn!(path = %path.display(), error = %e, "could not remove a dataset version");
    }
}

/// (total, available) bytes of the filesystem holding `path`.
pub(crate) fn fs_space(path: &Path) -> std::io::Result<(u64, u64)> {
    let s = rustix::fs::statvfs(path).map_err(std::io::Error::from)?;
    Ok((
        s.f_blocks.saturating_mul(s.f_frsize),
        s.f_bavail.saturating_mul(s.f_frsize),
    ))
}

// ---------------------------------------------------------------------------
// The record of what the node holds.

/// A version on disk that a dataset's path links to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Held {
    key: String,
    /// The version fetched (the key's, when the get ran).
    version: String,
    /// The version the seed asked for (a later version may have been
    /// current when it ran).
    requested: String,
    /// Below `<root>/.kt/versions/<ns>/<name>/`.
    dir: String,
    path: String,
    bytes: u64,
}

/// A seed in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Pending {
    key: String,
    version: String,
    dir: String,
    path: String,
    bytes_total: u64,
}

/// The last seed's failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Failure {
    key: String,
    version: String,
    path: String,
    bytes_total: u64,
    error: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    namespace: String,
    name: String,
    placed: bool,
    placed_seq: u64,
    #[serde(default)]
    held: Option<Held>,
    #[serde(default)]
    pending: Option<Pending>,
    #[serde(default)]
    failure: Option<Failure>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    /// The last `placed_seq` given.
    seq: u64,
    datasets: Vec<Record>,
}

type Id = (String, String);

#[derive(Debug)]
struct Seeding {
    generation: u64,
    done: Arc<AtomicU64>,
    task: tokio::task::AbortHandle,
}

#[derive(Debug)]
struct Entry {
    rec: Record,
    seeding: Option<Seeding>,
    /// The export its held version was taken with (since this start): two
    /// datasets of one key share the key's one export, the later seed's;
    /// when that one goes, the other's is served again from this.
    export: Option<Arc<Export>>,
}

#[derive(Debug, Default)]
struct Inner {
    datasets: BTreeMap<Id, Entry>,
    seq: u64,
    generation: u64,
}

/// Counts the bytes a seed has written.
struct Counter(Arc<AtomicU64>);

impl ProgressSink for Counter {
    fn start(&self, _bytes: u64, _files: u64) {}
    fn advance(&self, bytes: u64) {
        self.0.fetch_add(bytes, Ordering::Relaxed);
    }
    fn finish(&self) {}
}

/// Files to remove once the state no longer names them.
#[derive(Debug, Default)]
struct Cleanup {
    trees: Vec<PathBuf>,
    links: Vec<PathBuf>,
    /// Exports to withdraw: the key, if it still serves this directory.
    exports: Vec<(String, PathBuf)>,
}

impl Cleanup {
    fn is_empty(&self) -> bool {
        self.trees.is_empty() && self.links.is_empty() && self.exports.is_empty()
    }
}

/// The datasets of one node-cache agent.
#[derive(Debug)]
pub struct NodeCache {
    node: String,
    root: PathBuf,
    versions: PathBuf,
    state_file: PathBuf,
    budget: Option<u64>,
    client: Client,
    exports: Arc<Exports>,
    inner: Mutex<Inner>,
}

impl NodeCache {
    /// Opens the root (creating `.kt/`), loads the record, and recovers
    /// from a crash: an interrupted seed is marked failed and its partial
    /// directory removed, a missing link is made again, a directory no
    /// record names is removed. `client` fetches (its agent socket must be
    /// this agent's, so the copy is exported here).
    pub fn open(
        cfg: &NodeCacheConfig,
        client: Client,
        exports: Arc<Exports>,
    ) -> Result<Arc<NodeCache>, NodeCacheError> {
        if cfg.node.is_empty() {
            return Err(NodeCacheError::Config(
                "node-cache mode needs the node's name (--node-name, KT_NODE_NAME)".into(),
            ));
        }
        let internal = cfg.root.join(INTERNAL);
        std::fs::create_dir_all(cfg.versions_dir()).map_err(io(&cfg.versions_dir()))?;
        let root = cfg.root.canonicalize().map_err(io(&cfg.root))?;
        let versions = root.join(INTERNAL).join("versions");
        let state_file = internal.join("state.json");
        let state: StateFile = match std::fs::read(&state_file) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| FileError::Damaged {
                path: state_file.clone(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => StateFile::default(),
            Err(e) => return Err(io(&state_file)(e).into()),
        };
        let cache = NodeCache {
            node: cfg.node.clone(),
            root,
            versions,
            state_file,
            budget: cfg.budget,
            client,
            exports,
            inner: Mutex::new(Inner::default()),
        };
        let mut inner = Inner {
            seq: state.seq,
            ..Inner::default()
        };
        for mut rec in state.datasets {
            let id = (rec.namespace.clone(), rec.name.clone());
            if let Some(p) = rec.pending.take() {
                remove_tree(&cache.version_path(&id, &p.dir));
                rec.failure = Some(Failure {
                    key: p.key,
                    version: p.version,
                    path: p.path,
                    bytes_total: p.bytes_total,
                    error: "the seed was interrupted by an agent restart".into(),
                });
            }
            if let Some(h) = rec.held.take() {
                let dir = cache.version_path(&id, &h.dir);
                if dir.exists() {
                    let path = PathBuf::from(&h.path);
                    if path.canonicalize().ok().as_ref() != Some(&dir) {
                        cache.link(&path, &dir).map_err(io(&path))?;
                    }
                    rec.held = Some(h);
                } else {
                    tracing::warn!(namespace = %id.0, name = %id.1, dir = %dir.display(), "a held dataset's files are gone");
                    remove_link(Path::new(&h.path));
                }
            }
            if rec.held.is_none() && rec.failure.is_none() {
                continue;
            }
            inner.datasets.insert(
                id,
                Entry {
                    rec,
                    seeding: None,
                    export: None,
                },
            );
        }
        cache.sweep_orphans(&inner);
        write_state(&cache.state_file, &snapshot(&inner))?;
        tracing::info!(
            node = %cache.node,
            root = %cache.root.display(),
            datasets = inner.datasets.len(),
            "node cache open"
        );
        *cache.inner.try_lock().expect("not shared yet") = inner;
        Ok(Arc::new(cache))
    }

    /// `<root>/.kt/versions/<ns>/<name>/<dir>`.
    fn version_path(&self, id: &Id, dir: &str) -> PathBuf {
        self.versions.join(&id.0).join(&id.1).join(dir)
    }

    fn link(&self, path: &Path, dir: &Path) -> std::io::Result<()> {
        let target = relative_target(&self.root, path, dir)
            .ok_or_else(|| std::io::Error::other("a dataset path lies below the root"))?;
        switch_link(path, &target)
    }

    /// Removes version directories no record names (left by a crash).
    fn sweep_orphans(&self, inner: &Inner) {
        let Ok(namespaces) = std::fs::read_dir(&self.versions) else {
            return;
        };
        for ns in namespaces.flatten() {
            let ns_name = ns.file_name().to_string_lossy().into_owned();
            for ds in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
                let ds_name = ds.file_name().to_string_lossy().into_owned();
                let entry = inner.datasets.get(&(ns_name.clone(), ds_name.clone()));
                for v in std::fs::read_dir(ds.path()).into_iter().flatten().flatten() {
                    let v_name = v.file_name().to_string_lossy().into_owned();
                    let known = entry.is_some_and(|e| {
                        e.rec.held.as_ref().is_some_and(|h| h.dir == v_name)
                            || e.rec.pending.as_ref().is_some_and(|p| p.dir == v_name)
                    });
                    if !known {
                        tracing::info!(path = %v.path().display(), "removing a version no dataset holds");
                        remove_tree(&v.path());
                    }
                }
                let _ = std::fs::remove_dir(ds.path());
            }
            let _ = std::fs::remove_dir(ns.path());
        }
    }

    /// The dataset API's routes (admin callers only).
    pub fn routes(self: &Arc<Self>) -> Router {
        let admin: &'static [kt_types::auth::Role] = &[];
        Router::new()
            .route(
                "/api/v1/datasets",
                kt_service::allow(admin, get(report_route)),
            )
            .route(
                "/api/v1/datasets/{namespace}/{name}",
                kt_service::allow(admin, axum::routing::put(seed_route).delete(delete_route)),
            )
            .with_state(self.clone())
    }

    fn capacity(&self) -> Capacity {
        let (total, available) = fs_space(&self.root).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "statvfs of the dataset root failed");
            (0, 0)
        });
        Capacity {
            budget: self.budget.unwrap_or(total),
            fs_available: available,
        }
    }

    fn view(&self, e: &Entry) -> NodeDataset {
        let r = &e.rec;
        let base = |key: &str, version: &str, path: &str, state, bytes, total| NodeDataset {
            namespace: r.namespace.clone(),
            name: r.name.clone(),
            key: key.to_owned(),
            version: version.to_owned(),
            path: path.to_owned(),
            state,
            bytes,
            bytes_total: total,
            placed: r.placed,
            error: None,
        };
        if let Some(p) = &r.pending {
            let done = e
                .seeding
                .as_ref()
                .map_or(0, |s| s.done.load(Ordering::Relaxed))
                .min(p.bytes_total);
            return base(
                &p.key,
                &p.version,
                &p.path,
                NodeDatasetState::Seeding,
                done,
                p.bytes_total,
            );
        }
        if let Some(f) = &r.failure {
            let mut d = base(
                &f.key,
                &f.version,
                &f.path,
                NodeDatasetState::Failed,
                0,
                f.bytes_total,
            );
            d.error = Some(f.error.clone());
            return d;
        }
        let h = r.held.as_ref().expect("a record holds, seeds or failed");
        base(
            &h.key,
            &h.version,
            &h.path,
            NodeDatasetState::Ready,
            h.bytes,
            h.bytes,
        )
    }

    fn usages(inner: &Inner) -> Vec<Usage> {
        inner
            .datasets
            .iter()
            .map(|(id, e)| Usage {
                id: id.clone(),
                placed: e.rec.placed,
                held: e.rec.held.as_ref().map_or(0, |h| h.bytes),
                pending_total: e.rec.pending.as_ref().map_or(0, |p| p.bytes_total),
                pending_done: e
                    .seeding
                    .as_ref()
                    .map_or(0, |s| s.done.load(Ordering::Relaxed)),
                placed_seq: e.rec.placed_seq,
            })
            .collect()
    }

    /// `GET /api/v1/datasets`.
    pub async fn report(&self) -> NodeReport {
        let inner = self.inner.lock().await;
        let usages = Self::usages(&inner);
        let cap = self.capacity();
        let used = usages
            .iter()
            .map(|u| u.held + u.pending_done.min(u.pending_total))
            .sum();
        NodeReport {
            node: self.node.clone(),
            root: self.root.display().to_string(),
            budget_bytes: cap.budget,
            used_bytes: used,
            free_bytes: free_bytes(&usages, cap),
            datasets: inner.datasets.values().map(|e| self.view(e)).collect(),
        }
    }

    /// Checks a seed request: every problem is a 4xx.
    fn check(&self, id: &Id, req: &SeedRequest) -> Result<(), ApiError> {
        let problem = label_problem("namespace", &id.0)
            .or_else(|| name_problem("dataset name", &id.1))
            .or_else(|| version_problem(&req.version))
            .or_else(|| req.broadcast.as_ref().and_then(broadcast_problem))
            .or_else(|| kt_types::dataset::path_problem(&self.root.to_string_lossy(), &req.path))
            .or_else(|| {
                let internal = self.root.join(INTERNAL);
                overlaps(&req.path, &internal.to_string_lossy()).then(|| {
                    format!(
                        "{:?} lies in the node cache's own directory {}",
                        req.path,
                        internal.display()
                    )
                })
            });
        if let Some(why) = problem {
            return Err(ApiError::bad_request(why));
        }
        Key::parse(&req.key)
            .map_err(|e| ApiError::new(ErrorCode::InvalidKey, format!("key {:?}: {e}", req.key)))?;
        Ok(())
    }

    /// `PUT /api/v1/datasets/{namespace}/{name}`.
    pub async fn seed(
        self: &Arc<Self>,
        namespace: String,
        name: String,
        req: SeedRequest,
    ) -> Result<NodeDataset, ApiError> {
        let id = (namespace, name);
        self.check(&id, &req)?;
        let req = SeedRequest {
            path: req.path.trim_end_matches('/').to_owned(),
            ..req
        };
        let mut inner = self.inner.lock().await;
        inner.seq += 1;
        let seq = inner.seq;
        if let Some(e) = inner.datasets.get_mut(&id) {
            let same_pending = e.rec.pending.as_ref().is_some_and(|p| {
                p.key == req.key && p.version == req.version && p.path == req.path
            });
            let same_held = e.rec.pending.is_none()
                && e.rec.held.as_ref().is_some_and(|h| {
                    h.key == req.key
                        && (h.version == req.version || h.requested == req.version)
                        && h.path == req.path
                });
            if same_pending || same_held {
                e.rec.placed = true;
                e.rec.placed_seq = seq;
                if same_held {
                    e.rec.failure = None;
                }
                let view = self.view(e);
                self.persist(&inner).await?;
                return Ok(view);
            }
        }
        for (other, e) in &inner.datasets {
            let paths = [
                e.rec.held.as_ref().map(|h| &h.path),
                e.rec.pending.as_ref().map(|p| &p.path),
            ];
            if other != &id && paths.iter().flatten().any(|p| overlaps(p, &req.path)) {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!(
                        "{:?} overlaps the path of dataset {}/{}",
                        req.path, other.0, other.1
                    ),
                ));
            }
        }
        let ours = |p: &str| {
            inner
                .datasets
                .get(&id)
                .and_then(|e| e.rec.held.as_ref())
                .is_some_and(|h| h.path == p)
        };
        if let Some(why) = parents_problem(&self.root, Path::new(&req.path)) {
            return Err(ApiError::new(ErrorCode::Conflict, why));
        }
        if !ours(&req.path)
            && std::fs::symlink_metadata(&req.path).is_ok_and(|m| !m.file_type().is_symlink())
        {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("{:?} exists and is not a dataset's link", req.path),
            ));
        }
        let usages = Self::usages(&inner);
        let evict = admit(&usages, &id, req.bytes, self.capacity()).map_err(|most| {
            ApiError::new(
                ErrorCode::InsufficientStorage,
                format!(
                    "dataset {}/{} needs {} bytes; node {} can give at most {most} (budget {} bytes)",
                    id.0,
                    id.1,
                    req.bytes,
                    self.node,
                    self.capacity().budget
                ),
            )
        })?;
        let mut cleanup = Cleanup::default();
        for gone in &evict {
            if let Some(e) = inner.datasets.remove(gone) {
                tracing::info!(namespace = %gone.0, name = %gone.1, "evicting an unplaced dataset for a seed");
                self.forget(gone, e, &mut cleanup);
            }
        }
        inner.generation += 1;
        let generation = inner.generation;
        let pending = Pending {
            key: req.key.clone(),
            version: req.version.clone(),
            dir: version_dir(&req.version),
            path: req.path.clone(),
            bytes_total: req.bytes,
        };
        let entry = inner.datasets.entry(id.clone()).or_insert_with(|| Entry {
            rec: Record {
                namespace: id.0.clone(),
                name: id.1.clone(),
                placed: true,
                placed_seq: seq,
                held: None,
                pending: None,
                failure: None,
            },
            seeding: None,
            export: None,
        });
        if let Some(old) = entry.seeding.take() {
            old.task.abort();
        }
        if let Some(old) = entry.rec.pending.take() {
            cleanup.trees.push(self.version_path(&id, &old.dir));
        }
        entry.rec.placed = true;
        entry.rec.placed_seq = seq;
        entry.rec.failure = None;
        entry.rec.pending = Some(pending.clone());
        // The version held now seeds the new one: only what changed moves.
        let previous = entry
            .rec
            .held
            .as_ref()
            .map(|h| self.version_path(&id, &h.dir));
        let done = Arc::new(AtomicU64::new(0));
        let me = self.clone();
        let (task_id, task_done) = (id.clone(), done.clone());
        let broadcast = req.broadcast.clone();
        // Started only once the record says so (it runs after the lock is
        // released, and checks its generation).
        let task = tokio::spawn(async move {
            me.fetch(task_id, generation, pending, previous, broadcast, task_done)
                .await;
        });
        entry.seeding = Some(Seeding {
            generation,
            done,
            task: task.abort_handle(),
        });
        let view = self.view(entry);
        let persisted = self.persist(&inner).await;
        drop(inner);
        self.clean(cleanup).await;
        persisted?;
        tracing::info!(namespace = %id.0, name = %id.1, key = %req.key, version = %req.version, broadcast = req.broadcast.is_some(), "seeding");
        Ok(view)
    }

    /// `DELETE /api/v1/datasets/{namespace}/{name}[?retain=true]`: `Some`
    /// with the retained dataset, `None` when it is gone (or never was).
    pub async fn delete(
        &self,
        namespace: String,
        name: String,
        retain: bool,
    ) -> Result<Option<NodeDataset>, ApiError> {
        let id = (namespace, name);
        if let Some(why) =
            label_problem("namespace", &id.0).or_else(|| name_problem("dataset name", &id.1))
        {
            return Err(ApiError::bad_request(why));
        }
        let mut inner = self.inner.lock().await;
        let mut cleanup = Cleanup::default();
        let kept = match inner.datasets.remove(&id) {
            None => None,
            Some(mut e) if retain && e.rec.held.is_some() => {
                if let Some(s) = e.seeding.take() {
                    s.task.abort();
                }
                if let Some(p) = e.rec.pending.take() {
                    cleanup.trees.push(self.version_path(&id, &p.dir));
                }
                e.rec.placed = false;
                e.rec.failure = None;
                let view = self.view(&e);
                inner.datasets.insert(id.clone(), e);
                Some(view)
            }
            Some(e) => {
                self.forget(&id, e, &mut cleanup);
                None
            }
        };
        let persisted = self.persist(&inner).await;
        drop(inner);
        self.clean(cleanup).await;
        persisted?;
        tracing::info!(namespace = %id.0, name = %id.1, retain, "dataset unplaced");
        Ok(kept)
    }

    /// What removing entry `e` leaves to clean up.
    fn forget(&self, id: &Id, e: Entry, cleanup: &mut Cleanup) {
        if let Some(s) = e.seeding {
            s.task.abort();
        }
        if let Some(p) = e.rec.pending {
            cleanup.trees.push(self.version_path(id, &p.dir));
        }
        if let Some(h) = e.rec.held {
            let dir = self.version_path(id, &h.dir);
            cleanup.links.push(PathBuf::from(&h.path));
            cleanup.exports.push((h.key, dir.clone()));
            cleanup.trees.push(dir);
        }
    }

    async fn clean(&self, cleanup: Cleanup) {
        if cleanup.is_empty() {
            return;
        }
        // Withdrawn first: no peer is sent to files about to go.
        for (key, dir) in &cleanup.exports {
            let Ok(key) = Key::parse(key) else { continue };
            let Some(x) = self.exports.get(&key).filter(|x| &x.path == dir) else {
                continue;
            };
            match self.exports.remove(&key, Some(&x)).await {
                Err(e) => {
                    tracing::warn!(%key, error = %e, "could not withdraw a dataset's export")
                }
                Ok(false) => {}
                Ok(true) => self.serve_other_holder(&key, dir).await,
            }
        }
        let Cleanup { trees, links, .. } = cleanup;
        let _ = kt_sync::task::spawn(move || {
            for l in &links {
                remove_link(l);
            }
            for t in &trees {
                remove_tree(t);
            }
        })
        .await;
    }

    /// After the export of `key` at `gone` was withdrawn: another dataset
    /// holding the same key (its export replaced by the later seed's) is
    /// served again, so a dataset going does not take a copy another one
    /// still holds off the peers' list.
    async fn serve_other_holder(&self, key: &Key, gone: &Path) {
        let other = {
            let inner = self.inner.lock().await;
            inner
                .datasets
                .values()
                .filter(|e| {
                    e.rec
                        .held
                        .as_ref()
                        .is_some_and(|h| Key::parse(&h.key).is_ok_and(|k| &k == key))
                })
                .filter_map(|e| e.export.clone())
                .find(|x| x.path != gone && x.path.exists())
        };
        let Some(x) = other else { return };
        if self.exports.get(key).is_some() {
            return;
        }
        match self.exports.insert((*x).clone()).await {
            Ok(_) => {
                tracing::info!(%key, path = %x.path.display(), "serving another dataset's copy of the key again")
            }
            Err(e) => tracing::warn!(%key, error = %e, "could not serve another dataset's copy"),
        }
    }

    async fn persist(&self, inner: &Inner) -> Result<(), ApiError> {
        let state = snapshot(inner);
        let path = self.state_file.clone();
        kt_sync::task::spawn(move || write_state(&path, &state))
            .await
            .map_err(|e| ApiError::internal(e.0))?
            .map_err(|e| ApiError::internal(e.to_string()))
    }

    /// One seed: fetch into a fresh directory, then switch the path.
    /// Fetches `pending` into its own directory. With a `previous` version
    /// held, the directory starts as hard links of it and the get is a
    /// mirror get: only files that changed move (and are written under new
    /// inodes: kt-sync replaces files by rename, so the held version, still
    /// served and still the dataset's path until the switch, never
    /// changes), files the new version lacks are removed.
    async fn fetch(
        self: Arc<Self>,
        id: Id,
        generation: u64,
        pending: Pending,
        previous: Option<PathBuf>,
        broadcast: Option<SeedBroadcast>,
        done: Arc<AtomicU64>,
    ) {
        let dest = self.version_path(&id, &pending.dir);
        let progress = Progress::new(Arc::new(Counter(done)));
        let fetched = async {
            let key = Key::parse(&pending.key).map_err(|e| e.to_string())?;
            let parent = dest
                .parent()
                .expect("below the versions directory")
                .to_owned();
            tokio::fs::create_dir_all(&parent)
                .await
                .map_err(|e| format!("{}: {e}", parent.display()))?;
            // Started from the held version or not, the get mirrors the key:
            // links the new version lacks are removed, what is missing fetched.
            let mirror = previous.is_some();
            if let Some(prev) = previous {
                let to = dest.clone();
                let linked = kt_sync::task::spawn(move || link_tree(&prev, &to))
                    .await
                    .map_err(|e| e.0)?;
                match linked {
                    Ok(n) => {
                        tracing::debug!(namespace = %id.0, name = %id.1, files = n, "the new version starts from the held one")
                    }
                    // Not fatal: the get fetches what the links would have given.
                    Err(e) => {
                        tracing::warn!(namespace = %id.0, name = %id.1, error = %e, "could not start the new version from the held one; fetching all of it")
                    }
                }
            }
            let got = match &broadcast {
                Some(b) => {
                    let opts = kt_client::broadcast::BroadcastOptions {
                        group: Some(b.group.clone()),
                        fanout: Some(b.fanout),
                        window: (b.window_ms > 0)
                            .then(|| std::time::Duration::from_millis(b.window_ms)),
                        delete: mirror,
                    };
                    self.client
                        .get_broadcast(&key, &dest, &opts, progress)
                        .await
                        .map(|s| s.get)
                }
                None => {
                    let opts = kt_client::GetOptions { delete: mirror };
                    self.client.get_with(&key, &dest, &opts, progress).await
                }
            };
            got.map_err(|e| e.to_string())?;
            Ok::<_, String>(key)
        }
        .await;
        self.finish(id, generation, pending, dest, fetched).await;
    }

    async fn finish(
        &self,
        id: Id,
        generation: u64,
        pending: Pending,
        dest: PathBuf,
        fetched: Result<Key, String>,
    ) {
        let mut inner = self.inner.lock().await;
        let current = inner
            .datasets
            .get(&id)
            .and_then(|e| e.seeding.as_ref())
            .is_some_and(|s| s.generation == generation);
        if !current {
            drop(inner);
            remove_tree(&dest);
            return;
        }
        let mut cleanup = Cleanup::default();
        // Served, and switched to: or why not.
        let outcome = match fetched {
            Err(e) => Err(e),
            Ok(key) => {
                let canonical = dest.canonicalize().unwrap_or_else(|_| dest.clone());
                match self.exports.get(&key).filter(|x| x.path == canonical) {
                    None => Err(format!(
                        "{key} was fetched into {} but this agent did not take the copy for serving (see its log)",
                        dest.display()
                    )),
                    Some(x) => {
                        let path = PathBuf::from(&pending.path);
                        let (p, d) = (path.clone(), dest.clone());
                        let root = self.root.clone();
                        let switched = kt_sync::task::spawn(move || {
                            // Checked again: the seed's check was a while ago.
                            if let Some(why) = parents_problem(&root, &p) {
                                return Err(std::io::Error::other(why));
                            }
                            let target = relative_target(&root, &p, &d).ok_or_else(|| {
                                std::io::Error::other("a dataset path lies below the root")
                            })?;
                            switch_link(&p, &target)
                        })
                        .await
                        .map_err(|e| std::io::Error::other(e.0))
                        .and_then(|r| r);
                        match switched {
                            Ok(()) => Ok((
                                x.clone(),
                                Held {
                                    key: pending.key.clone(),
                                    version: x.version.clone(),
                                    requested: pending.version.clone(),
                                    dir: pending.dir.clone(),
                                    path: pending.path.clone(),
                                    bytes: x.manifest.total_bytes(),
                                },
                            )),
                            Err(e) => {
                                cleanup.exports.push((pending.key.clone(), canonical));
                                Err(format!(
                                    "switching {} to the new version: {e}",
                                    path.display()
                                ))
                            }
                        }
                    }
                }
            }
        };
        let entry = inner.datasets.get_mut(&id).expect("checked above");
        entry.seeding = None;
        entry.rec.pending = None;
        match outcome {
            Ok((export, held)) => {
                tracing::info!(namespace = %id.0, name = %id.1, version = %held.version, bytes = held.bytes, "dataset ready");
                entry.export = Some(export);
                if let Some(old) = entry.rec.held.replace(held.clone()) {
                    let old_dir = self.version_path(&id, &old.dir);
                    if old.path != held.path {
                        cleanup.links.push(PathBuf::from(&old.path));
                    }
                    if old.key != held.key {
                        cleanup.exports.push((old.key.clone(), old_dir.clone()));
                    }
                    cleanup.trees.push(old_dir);
                }
                entry.rec.failure = None;
            }
            Err(error) => {
                tracing::warn!(namespace = %id.0, name = %id.1, %error, "seed failed");
                cleanup.trees.push(dest);
                entry.rec.failure = Some(Failure {
                    key: pending.key,
                    version: pending.version,
                    path: pending.path,
                    bytes_total: pending.bytes_total,
                    error,
                });
            }
        }
        if let Err(e) = self.persist(&inner).await {
            tracing::warn!(error = %e, "could not record the node cache's state");
        }
        drop(inner);
        self.clean(cleanup).await;
    }

    /// Stops every seed in flight (on shutdown; the record keeps them as
    /// interrupted for the next start).
    pub async fn stop(&self) {
        let inner = self.inner.lock().await;
        for e in inner.datasets.values() {
            if let Some(s) = &e.seeding {
                s.task.abort();
            }
        }
    }
}

fn snapshot(inner: &Inner) -> StateFile {
    StateFile {
        seq: inner.seq,
        datasets: inner.datasets.values().map(|e| e.rec.clone()).collect(),
    }
}

fn write_state(path: &Path, state: &StateFile) -> Result<(), NodeCacheError> {
    use std::io::Write;
    let bytes = serde_json::to_vec_pretty(state).expect("the state serializes");
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(&bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io(path))?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io(dir))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// HTTP.

async fn report_route(State(c): State<Arc<NodeCache>>) -> axum::Json<NodeReport> {
    axum::Json(c.report().await)
}

async fn seed_route(
    State(c): State<Arc<NodeCache>>,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
    ApiJson(req): ApiJson<SeedRequest>,
) -> Result<Response, ApiError> {
    let d = c.seed(namespace, name, req).await?;
    Ok((StatusCode::ACCEPTED, axum::Json(d)).into_response())
}

async fn delete_route(
    State(c): State<Arc<NodeCache>>,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let retain = retain_param(query.as_deref()).map_err(ApiError::bad_request)?;
    Ok(match c.delete(namespace, name, retain).await? {
        Some(d) => axum::Json(d).into_response(),
        None => StatusCode::NO_CONTENT.into_response(),
    })
}

/// `retain=true|false` (also 1/0/yes/no/on/off); nothing else is accepted.
fn retain_param(query: Option<&str>) -> Result<bool, String> {
    let mut retain = false;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, "true"));
        if k != "retain" {
            return Err(format!("unknown query parameter {k:?} (only `retain`)"));
        }
        retain = match v.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => true,
            "0" | "false" | "no" | "off" => false,
            _ => return Err(format!("retain={v:?} is not a boolean")),
        };
    }
    Ok(retain)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(name: &str, placed: bool, held: u64, pending: (u64, u64), seq: u64) -> Usage {
        Usage {
            id: ("ns".into(), name.into()),
            placed,
            held,
            pending_total: pending.0,
            pending_done: pending.1,
            placed_seq: seq,
        }
    }

    fn id(name: &str) -> Id {
        ("ns".into(), name.into())
    }

    const BIG: Capacity = Capacity {
        budget: 100,
        fs_available: 1 << 40,
    };

    #[test]
    fn a_seed_fits_the_budget_less_what_placed_datasets_reserve() {
        let usages = [u("a", true, 30, (0, 0), 1), u("b", true, 10, (20, 5), 2)];
        assert_eq!(admit(&usages, &id("c"), 40, BIG), Ok(vec![]));
        assert_eq!(admit(&usages, &id("c"), 41, BIG), Err(40));
        assert_eq!(free_bytes(&usages, BIG), 40);
        // A new version of `a` is fetched beside the old one.
        assert_eq!(admit(&usages, &id("a"), 40, BIG), Ok(vec![]));
        assert_eq!(admit(&usages, &id("a"), 41, BIG), Err(40));
        // Replacing `b`'s seed in flight frees its reservation.
        assert_eq!(admit(&usages, &id("b"), 60, BIG), Ok(vec![]));
    }

    #[test]
    fn unplaced_datasets_are_evicted_least_recently_placed_first_and_only_as_needed() {
        let usages = [
            u("a", true, 40, (0, 0), 5),
            u("old", false, 20, (0, 0), 1),
            u("older", false, 10, (0, 0), 0),
            u("newer", false, 20, (0, 0), 3),
        ];
        assert_eq!(free_bytes(&usages, BIG), 60);
        // 10 bytes are free without evicting anything.
        assert_eq!(admit(&usages, &id("c"), 10, BIG), Ok(vec![]));
        assert_eq!(admit(&usages, &id("c"), 11, BIG), Ok(vec![id("older")]));
        assert_eq!(
            admit(&usages, &id("c"), 21, BIG),
            Ok(vec![id("older"), id("old")])
        );
        assert_eq!(
            admit(&usages, &id("c"), 60, BIG),
            Ok(vec![id("older"), id("old"), id("newer")])
        );
        // Not even after evicting all: nothing is evicted.
        assert_eq!(admit(&usages, &id("c"), 61, BIG), Err(60));
        // Re-placing an unplaced one with a new version keeps its own
        // held bytes until the switch, and never evicts itself.
        assert_eq!(
            admit(&usages, &id("old"), 30, BIG),
            Ok(vec![id("older"), id("newer")])
        );
    }

    #[test]
    fn the_filesystem_bounds_what_the_budget_allows() {
        let cap = Capacity {
            budget: 1000,
            fs_available: 50,
        };
        let usages = [
            u("a", true, 0, (30, 10), 1),
            u("gone", false, 15, (0, 0), 0),
        ];
        // 50 free, of which 20 are still to be written by `a`; `gone`'s 15 count.
        assert_eq!(free_bytes(&usages, cap), 45);
        assert_eq!(admit(&usages, &id("c"), 30, cap), Ok(vec![]));
        assert_eq!(admit(&usages, &id("c"), 31, cap), Ok(vec![id("gone")]));
        assert_eq!(admit(&usages, &id("c"), 46, cap), Err(45));
    }

    #[test]
    fn names_versions_and_broadcasts_are_checked() {
        assert_eq!(label_problem("namespace", "team-a"), None);
        for bad in ["", "Team", "-a", "a-", "a_b", "a.b", &"a".repeat(64)] {
            assert!(label_problem("namespace", bad).is_some(), "{bad}");
        }
        assert_eq!(name_problem("name", "imagenet.v2"), None);
        for bad in ["", "a..b", ".a", "A", "a/b", &"a".repeat(254)] {
            assert!(name_problem("name", bad).is_some(), "{bad}");
        }
        assert!(version_problem("").is_some());
        assert!(version_problem("v\n1").is_some());
        assert!(version_problem(&"v".repeat(257)).is_some());
        assert_eq!(version_problem("01HZX"), None);
        let b = |group: &str, fanout, window_ms| SeedBroadcast {
            group: group.into(),
            fanout,
            window_ms,
        };
        assert_eq!(broadcast_problem(&b("g", 1, 5000)), None);
        assert!(broadcast_problem(&b("", 1, 5000)).is_some());
        assert!(broadcast_problem(&b("g", 0, 5000)).is_some());
        assert!(broadcast_problem(&b("g", 1, MAX_WINDOW_MS + 1)).is_some());
        assert_eq!(retain_param(None), Ok(false));
        assert_eq!(retain_param(Some("retain=true")), Ok(true));
        assert_eq!(retain_param(Some("retain=0")), Ok(false));
        assert!(retain_param(Some("retain=maybe")).is_err());
        assert!(retain_param(Some("force=1")).is_err());
    }

    #[test]
    fn paths_overlap_by_segment() {
        assert!(overlaps("/r/a", "/r/a/"));
        assert!(overlaps("/r/a", "/r/a/b"));
        assert!(overlaps("/r/a/b", "/r/a"));
        assert!(!overlaps("/r/a", "/r/ab"));
        assert!(!overlaps("/r/a/b", "/r/a/c"));
    }

    #[test]
    fn a_tree_is_linked_not_copied() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(a.join("sub/deeper")).unwrap();
        std::fs::write(a.join("f"), b"one").unwrap();
        std::fs::write(a.join("sub/deeper/g"), b"two").unwrap();
        std::os::unix::fs::symlink("sub/deeper/g", a.join("link")).unwrap();
        assert_eq!(link_tree(&a, &b).unwrap(), 2);
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_eq!(ino(&a.join("f")), ino(&b.join("f")));
        assert_eq!(ino(&a.join("sub/deeper/g")), ino(&b.join("sub/deeper/g")));
        assert_eq!(
            std::fs::read_link(b.join("link")).unwrap(),
            PathBuf::from("sub/deeper/g")
        );
        // The destination must be new: a link tree never merges.
        assert!(link_tree(&a, &b).is_err());
    }

    #[test]
    fn version_directories_are_fresh_and_safe() {
        let a = version_dir("../v1/x");
        let b = version_dir("../v1/x");
        assert_ne!(a, b);
        assert!(!a.contains('/') && !a.starts_with('.'), "{a}");
        assert!(version_dir("...").starts_with("v-"));
    }

    #[test]
    fn links_are_relative_and_switched_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let v1 = root.join(".kt/versions/ns/d/v1");
        let v2 = root.join(".kt/versions/ns/d/v2");
        for (v, body) in [(&v1, "one"), (&v2, "two")] {
            std::fs::create_dir_all(v).unwrap();
            std::fs::write(v.join("f"), body).unwrap();
        }
        let path = root.join("ns/d");
        let t = relative_target(root, &path, &v1).unwrap();
        assert_eq!(t, PathBuf::from("../.kt/versions/ns/d/v1"));
        switch_link(&path, &t).unwrap();
        assert_eq!(std::fs::read_to_string(path.join("f")).unwrap(), "one");
        switch_link(&path, &relative_target(root, &path, &v2).unwrap()).unwrap();
        assert_eq!(std::fs::read_to_string(path.join("f")).unwrap(), "two");
        // Nothing left beside the link.
        let names: Vec<_> = std::fs::read_dir(root.join("ns"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("d")]);
        // A deeper path climbs further; a real directory is never replaced.
        assert_eq!(
            relative_target(root, &root.join("a/b/c"), &v1).unwrap(),
            PathBuf::from("../../.kt/versions/ns/d/v1")
        );
        let real = root.join("ns/real");
        std::fs::create_dir_all(&real).unwrap();
        let e = switch_link(&real, Path::new("x")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        assert!(real.is_dir());
    }

    fn client(dir: &Path) -> Client {
        let mut cfg = kt_client::ClientConfig::new("http://127.0.0.1:9", "t");
        cfg.agent_socket = dir.join("none.sock");
        cfg.cache_dir = None;
        Client::new(cfg).unwrap()
    }

    #[tokio::test]
    async fn a_restart_recovers_held_datasets_and_drops_interrupted_seeds() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let mut cfg = NodeCacheConfig::new("node-1");
        cfg.root = root.clone();
        cfg.budget = Some(1 << 20);
        let exports = Arc::new(
            Exports::open(
                &dir.path().join("state"),
                1 << 20,
                &kt_types::manifest::ManifestLimits::default(),
            )
            .unwrap(),
        );
        let cache = NodeCache::open(&cfg, client(dir.path()), exports.clone()).unwrap();
        assert!(cache.report().await.datasets.is_empty());
        drop(cache);
        // What a crash leaves: a held version whose link is gone, a seed
        // in flight, and a directory no record names.
        let v = root.join(".kt/versions/ns/held");
        std::fs::create_dir_all(v.join("v1-a")).unwrap();
        std::fs::write(v.join("v1-a/f"), b"12345").unwrap();
        std::fs::create_dir_all(v.join("v2-b")).unwrap();
        std::fs::create_dir_all(root.join(".kt/versions/ns/stray/x")).unwrap();
        let held_path = root.canonicalize().unwrap().join("ns/held");
        let state = StateFile {
            seq: 7,
            datasets: vec![Record {
                namespace: "ns".into(),
                name: "held".into(),
                placed: true,
                placed_seq: 7,
                held: Some(Held {
                    key: "k/a".into(),
                    version: "v1".into(),
                    requested: "v1".into(),
                    dir: "v1-a".into(),
                    path: held_path.display().to_string(),
                    bytes: 5,
                }),
                pending: Some(Pending {
                    key: "k/a".into(),
                    version: "v2".into(),
                    dir: "v2-b".into(),
                    path: held_path.display().to_string(),
                    bytes_total: 9,
                }),
                failure: None,
            }],
        };
        write_state(&root.join(".kt/state.json"), &state).unwrap();
        let cache = NodeCache::open(&cfg, client(dir.path()), exports).unwrap();
        let r = cache.report().await;
        assert_eq!(r.node, "node-1");
        assert_eq!(r.budget_bytes, 1 << 20);
        assert_eq!(r.used_bytes, 5);
        let d = r.dataset("ns", "held").unwrap();
        assert_eq!(d.state, NodeDatasetState::Failed);
        assert_eq!(d.version, "v2");
        assert!(d.error.as_deref().unwrap().contains("interrupted"), "{d:?}");
        assert_eq!(std::fs::read(held_path.join("f")).unwrap(), b"12345");
        assert!(!v.join("v2-b").exists());
        assert!(!root.join(".kt/versions/ns/stray").exists());
        // The same version again: ready at once, nothing fetched.
        let again = cache
            .seed(
                "ns".into(),
                "held".into(),
                SeedRequest {
                    key: "k/a".into(),
                    version: "v1".into(),
                    path: held_path.display().to_string(),
                    bytes: 5,
                    broadcast: None,
                },
            )
            .await
            .unwrap();
        assert_eq!(again.state, NodeDatasetState::Ready);
        // Retained, then removed: the files go with it.
        let kept = cache
            .delete("ns".into(), "held".into(), true)
            .await
            .unwrap()
            .unwrap();
        assert!(!kept.placed);
        assert!(held_path.join("f").exists());
        assert_eq!(cache.report().await.free_bytes.min(1 << 20), 1 << 20);
        assert!(
            cache
                .delete("ns".into(), "held".into(), false)
                .await
                .unwrap()
                .is_none()
        );
        assert!(!held_path.exists() && !v.join("v1-a").exists());
        assert!(cache.report().await.datasets.is_empty());
    }

    #[tokio::test]
    async fn bad_requests_are_refused_with_reasons() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = NodeCacheConfig::new("n");
        cfg.root = dir.path().join("root");
        cfg.budget = Some(100);
        let exports = Arc::new(
            Exports::open(
                &dir.path().join("state"),
                1 << 20,
                &kt_types::manifest::ManifestLimits::default(),
            )
            .unwrap(),
        );
        let cache = NodeCache::open(&cfg, client(dir.path()), exports).unwrap();
        let root = cache.root.display().to_string();
        let req = |key: &str, path: String, bytes| SeedRequest {
            key: key.into(),
            version: "v1".into(),
            path,
            bytes,
            broadcast: None,
        };
        use ErrorCode::{InsufficientStorage as Full, InvalidKey, InvalidRequest as Invalid};
        let d = format!("{root}/ns/d");
        let cases = [
            ("NS", "d", req("k", d.clone(), 1), Invalid),
            ("ns", "D", req("k", d.clone(), 1), Invalid),
            ("ns", "d", req("/bad//key", d.clone(), 1), InvalidKey),
            ("ns", "d", req("k", "/etc/d".into(), 1), Invalid),
            ("ns", "d", req("k", format!("{root}/../d"), 1), Invalid),
            ("ns", "d", req("k", format!("{root}/.kt/x"), 1), Invalid),
            ("ns", "d", req("k", d, 101), Full),
        ];
        for (ns, name, r, code) in cases {
            let e = cache
                .seed(ns.into(), name.into(), r.clone())
                .await
                .unwrap_err();
            assert_eq!(e.code, code, "{ns}/{name} {r:?}: {e:?}");
        }
        std::fs::create_dir_all(format!("{root}/ns/real")).unwrap();
        let e = cache
            .seed(
                "ns".into(),
                "real".into(),
                req("k", format!("{root}/ns/real"), 1),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::Conflict, "{e:?}");
        // A symbolic link (or a file) planted between the root and the
        // path: the dataset's link would land outside the root.
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, format!("{root}/planted")).unwrap();
        std::fs::write(format!("{root}/file"), b"x").unwrap();
        for path in [
            format!("{root}/planted/d"),
            format!("{root}/planted/deeper/d"),
            format!("{root}/file/d"),
        ] {
            let e = cache
                .seed("ns".into(), "d".into(), req("k", path.clone(), 1))
                .await
                .unwrap_err();
            assert_eq!(e.code, ErrorCode::Conflict, "{path}: {e:?}");
        }
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        assert!(cache.report().await.datasets.is_empty());
        assert!(parents_problem(Path::new(&root), Path::new(&format!("{root}/new/a/b"))).is_none());
    }
}
