//! The `Dataset` custom resource (`datasets.kt.dev/v1alpha1`, namespaced):
//! a source, a placement on nodes, and the status the controller writes.
//!
//! ```yaml
//! apiVersion: kt.dev/v1alpha1
//! kind: Dataset
//! metadata: { name: imagenet, namespace: team }
//! spec:
//!   source:
//!     key: team/imagenet            # or s3: {...} or pvc: {...}
//!   placement:
//!     replicas: 8
//!     nodeSelector: { gpu: a100 }
//!   refresh: { interval: 10m }      # follow the latest; version: pins one
//!   reclaimPolicy: Delete
//! ```
//!
//! The CRD manifest is generated from these types (`kt-dataset-controller
//! crd`) and committed at `kustomize/components/datasets/crd.yaml`; a test
//! keeps the two equal. The types live here, not in the controller's crate
//! (kt-dataset, which re-exports them as `kt_dataset::crd`), because the
//! CLI speaks them too and the controller depends on the client.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a Dataset asks for.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kt.dev",
    version = "v1alpha1",
    kind = "Dataset",
    plural = "datasets",
    shortname = "ktds",
    namespaced,
    status = "DatasetStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Version","type":"string","jsonPath":".status.version"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyNodes"}"#,
    printcolumn = r#"{"name":"Wanted","type":"integer","jsonPath":".status.desiredNodes"}"#,
    printcolumn = r#"{"name":"Bytes","type":"integer","jsonPath":".status.bytes"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.reason","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct DatasetSpec {
    /// Where the data comes from.
    pub source: Source,
    /// On which nodes, and how many.
    #[serde(default)]
    pub placement: Placement,
    /// Where on each node the files are (absolute, below the node cache's
    /// root). Default: `/var/lib/kt/datasets/<namespace>/<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 1024))]
    pub path: Option<String>,
    /// Which version, and how often to look for a newer one.
    #[serde(default)]
    pub refresh: Refresh,
    /// What happens to the node copies when the Dataset is deleted or a
    /// node leaves its placement.
    #[serde(default)]
    pub reclaim_policy: ReclaimPolicy,
}

/// Exactly one source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Source {
    /// A kt key (`team/ds/v3`): its latest version, or `refresh.version`.
    Key(#[schemars(length(min = 1, max = 1024))] String),
    /// An S3-compatible object store (GCS and Azure through their S3
    /// interoperability endpoints): every object below `prefix`.
    S3(S3Source),
    /// A directory of a PersistentVolumeClaim, put into the store by a Job
    /// that mounts the claim.
    Pvc(PvcSource),
}

/// An S3-compatible bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct S3Source {
    /// The bucket's name.
    #[schemars(length(min = 1, max = 255))]
    pub bucket: String,
    /// Only objects below this prefix (their names relative to it become the
    /// dataset's paths). Empty: the whole bucket.
    #[serde(default)]
    pub prefix: String,
    /// The endpoint (`https://s3.example.com`); unset: AWS's for `region`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The region (`us-east-1` when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// A Secret in the Dataset's namespace with `AWS_ACCESS_KEY_ID` and
    /// `AWS_SECRET_ACCESS_KEY` (and optionally `AWS_SESSION_TOKEN`); unset:
    /// anonymous requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<String>,
}

/// A directory of a PersistentVolumeClaim in the Dataset's namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PvcSource {
    /// The claim.
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: String,
    /// The directory inside the claim (default: its root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// On which nodes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// How many nodes hold a copy (default 1). With no selector, any nodes;
    /// with one, that many of the nodes it selects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub replicas: Option<u32>,
    /// Only nodes with all these labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Only nodes matching every expression (the node affinity's
    /// `matchExpressions`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<NodeSelectorRequirement>,
}

impl Placement {
    /// The number of copies asked for.
    pub fn replicas(&self) -> u32 {
        self.replicas.unwrap_or(1)
    }
}

/// One node-affinity expression.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeSelectorRequirement {
    /// The label.
    pub key: String,
    /// How the label's value is compared with `values`.
    pub operator: SelectorOperator,
    /// For `In` and `NotIn`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// The operators of a node-affinity expression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SelectorOperator {
    /// The label's value is one of `values`.
    In,
    /// The label is absent or its value is none of `values`.
    NotIn,
    /// The label is present.
    Exists,
    /// The label is absent.
    DoesNotExist,
}

/// Which version, and when to look again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Refresh {
    /// Pin this version of a key source; unset: follow the latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// How often to look for a newer version (a key: its latest version;
    /// S3: a new listing, moving only what changed), e.g. `10m`. Unset: a
    /// key is looked at every minute, an S3 prefix listed once per spec
    /// change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<String>,
}

/// What happens to node copies no longer placed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ReclaimPolicy {
    /// Removed from the node at once.
    #[default]
    Delete,
    /// Kept on the node (unlabelled) until its budget needs the bytes.
    Retain,
}

/// What the controller saw and did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatasetStatus {
    /// Where the Dataset is in its life.
    #[serde(default)]
    pub phase: Phase,
    /// The reason of the phase (a condition's reason), for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The spec generation this status is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The kt key holding the data (the source key, or the key an S3 or
    /// PVC source was ingested into).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The key's version being placed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The version's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// The path on each node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The node label set on nodes holding it (`data.kt.dev/<ns>.<name>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Nodes wanted.
    #[serde(default)]
    pub desired_nodes: u32,
    /// Nodes holding the version, labelled.
    #[serde(default)]
    pub ready_nodes: u32,
    /// Per node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<NodeStatus>,
    /// The last ingest of an S3 or PVC source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingest: Option<IngestStatus>,
    /// `SourceReady`, `Placed`, `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The phases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    /// Nothing done yet, or waiting (no node fits, the key not there yet).
    #[default]
    Pending,
    /// An S3 or PVC source is being put into the store.
    Ingesting,
    /// Node agents are fetching it.
    Seeding,
    /// Every wanted node holds the version and is labelled.
    Ready,
    /// It cannot go on without a change (see `reason`).
    Failed,
}

/// One node's copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// The node.
    pub name: String,
    /// `Seeding`, `Ready`, `Failed`, `Lost`, `Removing`.
    pub state: NodeState,
    /// The version it holds or fetches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Bytes on the node.
    #[serde(default)]
    pub bytes: u64,
    /// The copy's path on the node (the same on every node of an install;
    /// the testbed's nodes each have their own root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Why (a failed or lost node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// A node copy's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum NodeState {
    /// Its agent is fetching it.
    Seeding,
    /// Held and labelled.
    Ready,
    /// The fetch failed; another node is chosen.
    Failed,
    /// The node or its agent went away; another node is chosen.
    Lost,
    /// No longer placed: its copy and label are being removed.
    Removing,
}

/// The last ingest of an S3 or PVC source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IngestStatus {
    /// Objects (files) in the source.
    #[serde(default)]
    pub objects: u64,
    /// Bytes in the source.
    #[serde(default)]
    pub bytes: u64,
    /// Objects fetched by the last ingest (new or changed).
    #[serde(default)]
    pub changed: u64,
    /// Objects removed since the previous ingest.
    #[serde(default)]
    pub removed: u64,
    /// When the source was last listed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_listed: Option<String>,
}

/// A condition, as Kubernetes API conventions shape them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `SourceReady`, `Placed` or `Ready`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// CamelCase, machine-readable.
    pub reason: String,
    /// For people.
    #[serde(default)]
    pub message: String,
    /// When `status` last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// The generation it was set for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A Dataset (or any of its parts) from YAML as Kubernetes writes it.
///
/// Read YAML through this, not `serde_yaml_ng::from_str` directly: that
/// crate reads enums from YAML tags (`!key`), while the API server (JSON)
/// and people write `source: {key: ...}`.
pub fn from_yaml<T: serde::de::DeserializeOwned>(yaml: &str) -> Result<T, String> {
    let value: serde_json::Value = serde_yaml_ng::from_str(yaml).map_err(|e| e.to_string())?;
    serde_json::from_value(value).map_err(|e| e.to_string())
}

/// The CRD manifest, as YAML.
pub fn crd_yaml() -> String {
    use kube::CustomResourceExt;
    let crd = Dataset::crd();
    let body = serde_yaml_ng::to_string(&crd).unwrap_or_else(|e| {
        // The CRD is built from static types: this cannot fail at run time
        // without failing every test first.
        panic!("the Dataset CRD does not serialize: {e}")
    });
    format!(
        "# Generated by `kt-dataset-controller crd` from components/kt-kube/src/dataset.rs.\n\
         # Do not edit: change the types and regenerate.\n{body}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_crd_is_the_generated_one() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../kustomize/components/datasets/crd.yaml"
        );
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        if committed != crd_yaml() {
            if std::env::var_os(kt_types::env::UPDATE_CRD).is_some() {
                std::fs::write(path, crd_yaml()).expect("write the CRD");
            } else {
                panic!(
                    "{path} is not the CRD the types generate: run \
                     `KT_UPDATE_CRD=1 cargo test -p kt-kube crd` and commit it"
                );
            }
        }
    }

    #[test]
    fn a_dataset_reads_as_the_docs_write_it() {
        let yaml = r#"
apiVersion: kt.dev/v1alpha1
kind: Dataset
metadata: { name: imagenet, namespace: team }
spec:
  source: { key: team/imagenet }
  placement: { replicas: 8, nodeSelector: { gpu: a100 } }
  refresh: { interval: 10m }
"#;
        let ds: Dataset = from_yaml(yaml).unwrap();
        assert_eq!(ds.spec.source, Source::Key("team/imagenet".into()));
        assert_eq!(ds.spec.placement.replicas(), 8);
        assert_eq!(ds.spec.reclaim_policy, ReclaimPolicy::Delete);
        let s3: DatasetSpec = from_yaml(
            "source: { s3: { bucket: b, prefix: train/, endpoint: 'http://minio:9000', credentialsSecret: s3 } }",
        )
        .unwrap();
        assert!(matches!(s3.source, Source::S3(ref s) if s.bucket == "b" && s.prefix == "train/"));
        assert_eq!(s3.placement.replicas(), 1);
        let two: Result<DatasetSpec, _> = from_yaml("source: { key: a/b, s3: { bucket: b } }");
        assert!(two.is_err(), "two sources are refused");
    }
}
