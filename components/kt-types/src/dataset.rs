//! The node-cache agent's dataset API, spoken by the `Dataset` controller
//! (`kt-dataset-controller`) to the `kt-agent --node-cache` of each node.
//!
//! Routes (on the agent's HTTP listener, admin callers only):
//!
//! - `GET /api/v1/datasets`: a [`NodeReport`] — the node, its dataset root,
//!   its byte budget and what it holds;
//! - `PUT /api/v1/datasets/{namespace}/{name}`: a [`SeedRequest`]: fetch the
//!   key's version into the dataset's path (as a member of the named
//!   broadcast group when one is given). Answers `202` with the dataset's
//!   [`NodeDataset`] at once; the fetch runs in the background. Idempotent:
//!   the same version again answers its current state, another version
//!   replaces the old one once it is complete (readers see old or new,
//!   never half of each);
//! - `DELETE /api/v1/datasets/{namespace}/{name}[?retain=true]`: the
//!   dataset is no longer placed here. Without `retain` its files are
//!   removed now (`204`; also for a dataset the node does not hold); with
//!   it they stay (unlabelled, unplaced) until the budget needs their bytes
//!   for a placed dataset (`200` with its [`NodeDataset`]; a retained
//!   dataset placed again with the version it holds is `ready` at once).
//!
//! A seed that does not fit the budget, even after evicting every unplaced
//! dataset (least recently placed first), is refused with
//! `insufficient_storage` (HTTP 507), and the controller places the dataset
//! elsewhere. Bad input is a 4xx: `invalid_request` (a namespace or name
//! that is not a Kubernetes name, a path not below the root or inside its
//! `.kt/`, an empty version, a broadcast without a group or with fanout 0),
//! `invalid_key`, `conflict` (a path another dataset's path overlaps, or a
//! file or directory that is not a dataset's link).
//!
//! On the node, each version is fetched into a directory of its own below
//! `<root>/.kt/versions/<namespace>/<name>/`, and the dataset's path is a
//! relative symlink to the version held, replaced by `rename(2)` once a new
//! version is complete and served: a reader of the path sees the old
//! version or the new one, never half of each, and a crash mid-fetch leaves
//! the old one (the previous version's directory is removed after the
//! switch; a pod that mounted the path itself keeps the version it bound
//! at its start, until it is removed). `<root>/.kt/state.json` records
//! what the node holds, so a restarted agent reports and serves it again.
//! The version reported is the one fetched: a seed of a version the key has
//! moved past fetches the key's current version (a get has no version
//! pin), and a later `PUT` of either answers the held one.

use serde::{Deserialize, Serialize};

/// Where node-cache agents keep datasets by default (a hostPath).
pub const DEFAULT_ROOT: &str = "/var/lib/kt/datasets";

/// The label a node carries while it holds a Ready dataset:
/// `data.kt.dev/<namespace>.<name>` = the version it holds.
pub const NODE_LABEL_PREFIX: &str = "data.kt.dev/";

/// The node label of dataset `name` in `namespace`.
pub fn node_label(namespace: &str, name: &str) -> String {
    format!("{NODE_LABEL_PREFIX}{namespace}.{name}")
}

/// The default path on the node of dataset `name` in `namespace`, below
/// `root`.
pub fn default_path(root: &str, namespace: &str, name: &str) -> String {
    format!("{}/{namespace}/{name}", root.trim_end_matches('/'))
}

/// How a node agent joins the seeding broadcast.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeedBroadcast {
    /// The group every node of this seeding joins.
    pub group: String,
    /// Children per member (1: a chain, one copy out of the store).
    pub fanout: u32,
    /// How long the group accepts joins, in milliseconds.
    pub window_ms: u64,
}

/// `PUT /api/v1/datasets/{namespace}/{name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeedRequest {
    /// The kt key holding the dataset.
    pub key: String,
    /// The key's version to fetch.
    pub version: String,
    /// Where on the node the files go: absolute, below the agent's root.
    pub path: String,
    /// The version's size, checked against the budget before fetching.
    pub bytes: u64,
    /// Join this broadcast; `None`: an ordinary get (peers first, then the
    /// store).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broadcast: Option<SeedBroadcast>,
}

/// What a node agent is doing with a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeDatasetState {
    /// Being fetched.
    Seeding,
    /// Complete and verified at its path, served to peers.
    Ready,
    /// The fetch failed (see `error`); a new `PUT` retries.
    Failed,
}

/// One dataset on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDataset {
    /// The Dataset's namespace.
    pub namespace: String,
    /// The Dataset's name.
    pub name: String,
    /// The key it was fetched from.
    pub key: String,
    /// The version being fetched (state `seeding`) or held.
    pub version: String,
    /// Its path on the node.
    pub path: String,
    /// See [`NodeDatasetState`].
    pub state: NodeDatasetState,
    /// Bytes on disk (so far, while seeding).
    pub bytes: u64,
    /// The version's size.
    pub bytes_total: u64,
    /// Still placed here (false after a `DELETE ?retain=true`).
    pub placed: bool,
    /// Why the fetch failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `GET /api/v1/datasets`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The node this agent holds data for (`--node-name`).
    pub node: String,
    /// Every dataset's path lies below this.
    pub root: String,
    /// The most bytes the agent keeps below its root.
    pub budget_bytes: u64,
    /// Bytes held (every dataset, placed or not).
    pub used_bytes: u64,
    /// What a new seed may use: the budget less what placed datasets hold,
    /// bounded by the filesystem's free space (unplaced datasets count as
    /// free: they are evicted for it).
    pub free_bytes: u64,
    /// What it holds, by namespace and name.
    pub datasets: Vec<NodeDataset>,
}

impl NodeReport {
    /// The dataset `namespace/name`, if held or being fetched.
    pub fn dataset(&self, namespace: &str, name: &str) -> Option<&NodeDataset> {
        self.datasets
            .iter()
            .find(|d| d.namespace == namespace && d.name == name)
    }
}

/// Whether `path` is an acceptable dataset path below `root`: absolute,
/// normal (no `.`/`..` segments, no empty segment), strictly below it.
pub fn path_problem(root: &str, path: &str) -> Option<String> {
    let root = root.trim_end_matches('/');
    if !path.starts_with('/') {
        return Some(format!("{path:?} is not an absolute path"));
    }
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    if segments
        .iter()
        .any(|s| s.is_empty() || *s == "." || *s == "..")
    {
        return Some(format!("{path:?} has an empty, `.` or `..` segment"));
    }
    let below = path
        .strip_prefix(root)
        .is_some_and(|rest| rest.starts_with('/') && rest.len() > 1);
    if !below {
        return Some(format!(
            "{path:?} is not below the node cache's root {root:?}"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_must_lie_below_the_root() {
        let root = "/var/lib/kt/datasets";
        assert_eq!(path_problem(root, "/var/lib/kt/datasets/ns/a"), None);
        assert_eq!(
            path_problem("/var/lib/kt/datasets/", "/var/lib/kt/datasets/a/"),
            None
        );
        for bad in [
            "var/lib/kt/datasets/a",
            "/var/lib/kt/datasets",
            "/var/lib/kt/datasets/",
            "/var/lib/kt/datasets2/a",
            "/var/lib/kt/datasets/../etc",
            "/var/lib/kt/datasets/a//b",
            "/etc/passwd",
        ] {
            assert!(path_problem(root, bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn labels_and_default_paths() {
        assert_eq!(node_label("team", "imagenet"), "data.kt.dev/team.imagenet");
        assert_eq!(
            default_path("/var/lib/kt/datasets/", "team", "imagenet"),
            "/var/lib/kt/datasets/team/imagenet"
        );
    }

    #[test]
    fn a_seed_request_round_trips() {
        let req = SeedRequest {
            key: "team/ds".into(),
            version: "v1".into(),
            path: "/var/lib/kt/datasets/team/ds".into(),
            bytes: 10,
            broadcast: None,
        };
        let json = serde_json::to_string(&req).unwrap();
        assert!(!json.contains("broadcast"));
        assert_eq!(serde_json::from_str::<SeedRequest>(&json).unwrap(), req);
    }
}
