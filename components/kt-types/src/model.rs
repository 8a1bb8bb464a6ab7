//! The domain vocabulary: locales, lifespans, broadcast windows, key records.

use serde::{Deserialize, Serialize};

use crate::key::Key;

/// Where a key's data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Locale {
    /// Copied into the store pod (the default).
    #[default]
    Store,
    /// Stays on the producer pod; getters fetch peer-to-peer.
    Local,
}

impl std::str::FromStr for Locale {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "store" => Ok(Locale::Store),
            "local" => Ok(Locale::Local),
            other => Err(format!(
                "unknown locale {other:?} (expected store or local)"
            )),
        }
    }
}

/// How long a key lives.
///
/// A put that names none gets one by the rule (the metadata server
/// decides, [`KeyRecord::lifespan_by_rule`]): `resource` for a key under a
/// service's base path (its first segment names a service the metadata
/// server knows) and for a zero-copy (`locale=local`) put; `cluster`
/// otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lifespan {
    /// Kept until deleted (or its TTL passes), whoever is torn down.
    #[default]
    Cluster,
    /// Deleted when its service is torn down; zero-copy data is also
    /// stale (neither listed nor served) while its holder pod is gone.
    Resource,
}

impl std::str::FromStr for Lifespan {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cluster" => Ok(Lifespan::Cluster),
            "resource" => Ok(Lifespan::Resource),
            other => Err(format!(
                "unknown lifespan {other:?} (expected cluster or resource)"
            )),
        }
    }
}

/// Options of a broadcast: who joins, how long the window stays open, tree fanout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BroadcastWindow {
    /// The quorum group to join ([`crate::broadcast::check_group_id`]
    /// grammar); `None`: the agent joins the key's own group. The metadata
    /// server refuses a window naming another group than the one joined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_id: Option<String>,
    /// Close the round once this many members (putters and getters, one per
    /// pod) have joined; at least 2. `None`: no size condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    /// Seconds the window stays open for joins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<f64>,
    /// Close the round once members from every one of these pod IPs have
    /// joined; each must parse as an IP address. Empty: no such condition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<String>,
    /// Children per node of the host backend's broadcast tree (NCCL
    /// arranges its own); at least 1. [`BroadcastWindow::DEFAULT_FANOUT`]
    /// when absent from the JSON.
    #[serde(default = "BroadcastWindow::default_fanout")]
    pub fanout: u32,
    /// GPU data: send all tensors of one dtype as one buffer (in buckets of
    /// `bucket_bytes`, default [`crate::tensor::DEFAULT_BUCKET_BYTES`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pack: bool,
    /// Largest pack bucket in bytes, at least
    /// [`crate::tensor::MIN_BUCKET_BYTES`]; `None`:
    /// [`crate::tensor::DEFAULT_BUCKET_BYTES`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_bytes: Option<u64>,
}

impl BroadcastWindow {
    /// The fanout of a window that names none: the filesystem broadcasts'
    /// default ([`crate::broadcast::DEFAULT_FANOUT`]).
    pub const DEFAULT_FANOUT: u32 = crate::broadcast::DEFAULT_FANOUT;
    fn default_fanout() -> u32 {
        Self::DEFAULT_FANOUT
    }

    /// Parent rank of `rank` in the tree: rank 0 is the source.
    pub fn parent_of(&self, rank: u32) -> Option<u32> {
        crate::broadcast::parent_rank(rank, self.fanout)
    }
}

impl Default for BroadcastWindow {
    fn default() -> Self {
        BroadcastWindow {
            group_id: None,
            world_size: None,
            timeout_secs: None,
            ips: Vec::new(),
            fanout: Self::DEFAULT_FANOUT,
            pack: false,
            bucket_bytes: None,
        }
    }
}

/// The holder name of data kept by the store.
pub const STORE_HOLDER: &str = "store";

/// Why an agent id is refused, when it is: agent ids are pod names, 1 to
/// 253 of `[A-Za-z0-9._-]`, and never [`STORE_HOLDER`].
pub fn agent_id_problem(id: &str) -> Option<String> {
    let valid = !id.is_empty()
        && id.len() <= 253
        && id != STORE_HOLDER
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    (!valid).then(|| {
        format!(
            "agent id {id:?} is not a pod name (1 to 253 letters, digits, '.', '_' or '-'; not {STORE_HOLDER:?})"
        )
    })
}

fn store_holder() -> String {
    STORE_HOLDER.to_owned()
}

/// A place the data of one version can be fetched from: the store, the
/// producer's node agent, or an agent that downloaded it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    /// `store`, or the agent's id (its pod name).
    pub id: String,
    /// Base URL serving the read protocol.
    pub url: String,
    /// The version it holds.
    pub version: String,
}

/// What the metadata server knows about one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The key this record describes.
    pub key: Key,
    /// Where the origin copy lives: the store, or the producer pod.
    pub locale: Locale,
    /// Base URL of the origin: the store, or the producer's node agent.
    pub source: String,
    /// Who holds the origin copy: `store`, or the producer pod's agent id.
    #[serde(default = "store_holder")]
    pub holder: String,
    /// Agents that downloaded the current version and serve it too (every
    /// getter becomes a source). Only live agents are listed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<Source>,
    /// Opaque id of the published version.
    pub version: String,
    /// True when the key holds a directory tree, false for a single file.
    pub is_dir: bool,
    /// Bytes of the version: the sum of its file sizes (of its tensors'
    /// sizes for GPU data).
    pub size: u64,
    /// Files in the version (tensors for GPU data).
    pub files: u64,
    /// Set when the key holds GPU data (a tensor or a state dict), served by
    /// its holder's agent from the producing process's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<crate::tensor::TensorSummary>,
    /// The digest of the version's manifest, as its publisher registered it
    /// ([`crate::api::RegisterKey::digest`]): a getter uses a manifest from
    /// any source only if it hashes to this. Absent for GPU data and for
    /// records written before digests were kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<crate::Hash>,
    /// How long the key lives: as the put said, or by the rule
    /// ([`Lifespan`]) when it said nothing.
    pub lifespan: Lifespan,
    /// True when the put named no lifespan and the rule chose `lifespan`:
    /// tearing down the service whose base path holds the key deletes it
    /// whatever the rule chose. Absent (false) in records written before
    /// the rule, which keep the lifespan they were put with.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lifespan_by_rule: bool,
    /// The owning service: the one whose base path holds the key (its
    /// first segment names a service the metadata server knows), else the
    /// put's service (the putter's own, if it writes one), else the key's
    /// first segment.
    pub service: String,
    /// Unix milliseconds after which the key expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// Unix milliseconds of the key's first registration; later versions
    /// keep it.
    pub created_at_ms: u64,
    /// Unix milliseconds of the last registration: a new version, or the
    /// same one registered again (an unchanged put refreshes its options).
    pub updated_at_ms: u64,
}

impl KeyRecord {
    /// Where the data lives, as the reference's `ls` names it: `store`, or
    /// the pod holding a zero-copy key (its holder's agent id).
    pub fn locale_label(&self) -> String {
        match self.locale {
            Locale::Store => STORE_HOLDER.to_owned(),
            Locale::Local => self.holder.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_locale_label_names_the_pod_of_zero_copy_keys() {
        let record = |locale: &str, holder: &str| -> KeyRecord {
            serde_json::from_value(serde_json::json!({
                "key": "svc/k", "locale": locale, "source": "http://x", "holder": holder,
                "version": "v1", "is_dir": false, "size": 1, "files": 1,
                "lifespan": "cluster", "service": "svc",
                "created_at_ms": 1, "updated_at_ms": 1,
            }))
            .unwrap()
        };
        assert_eq!(record("store", "store").locale_label(), "store");
        assert_eq!(record("local", "trainer-0").locale_label(), "trainer-0");
    }

    #[test]
    fn agent_ids_are_pod_names_but_never_the_store() {
        for ok in ["pod-a", "worker-0.x_1", &"a".repeat(253)] {
            assert_eq!(agent_id_problem(ok), None, "{ok}");
        }
        for bad in ["", "store", "a/b", "pod a", "pöd", &"a".repeat(254)] {
            let why = agent_id_problem(bad).expect(bad);
            assert!(why.contains("is not a pod name"), "{why}");
        }
    }

    #[test]
    fn tree_parents() {
        let w = BroadcastWindow {
            fanout: 2,
            ..Default::default()
        };
        assert_eq!(w.parent_of(0), None);
        assert_eq!(w.parent_of(1), Some(0));
        assert_eq!(w.parent_of(2), Some(0));
        assert_eq!(w.parent_of(3), Some(1));
        assert_eq!(BroadcastWindow::default().parent_of(51), Some(1));
    }

    #[test]
    fn enums_parse() {
        assert_eq!("local".parse::<Locale>().unwrap(), Locale::Local);
        assert!("disk".parse::<Locale>().is_err());
        assert_eq!("resource".parse::<Lifespan>().unwrap(), Lifespan::Resource);
    }

    #[test]
    fn records_without_holder_are_store_records() {
        let json = r#"{"key":"a/b","locale":"store","source":"http://s","version":"v1",
            "is_dir":true,"size":1,"files":1,"lifespan":"cluster","service":"a",
            "created_at_ms":1,"updated_at_ms":1}"#;
        let r: KeyRecord = serde_json::from_str(json).unwrap();
        assert_eq!(r.holder, STORE_HOLDER);
        assert!(r.peers.is_empty());
    }
}
