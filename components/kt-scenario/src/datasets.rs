//! Datasets in the testbed (issue 33): the topology's Kubernetes `nodes`,
//! the `dataset`, `wait_dataset` and `read_dataset` steps, and how a
//! Dataset's status goes into a snapshot (pure; the target's side is
//! `target::nodes`, the runner's `runner::datasets`).
//!
//! ```yaml
//! topology:
//!   nodes: 12                      # or { count: 12, labels: { zone: a }, budget: 4GiB }
//!   pods: [{ name: producer }, { name: trainer }]
//! steps:
//!   - put: { pod: producer, key: "{{scenario}}/ds", data: tree }
//!   - dataset: { apply: { name: ds, source: { key: "{{scenario}}/ds" },
//!                         placement: { replicas: 8 } } }
//!   - wait_dataset: { name: ds, phase: Ready }
//!     record: seeded               # the status, normalised
//!   - read_dataset: { pod: trainer, dataset: ds, verify: [tree] }
//!   - kill: { node: node-3 }       # node lost: agent dies, node NotReady
//!   - dataset: { delete: ds }
//! ```
//!
//! With `nodes`, a target runs an in-memory Kubernetes API server
//! (`kt_kube::apiserver`) with the Dataset CRD, Nodes `node-1`..`node-N`
//! (Ready, labelled `kubernetes.io/hostname`), a node-cache agent per node
//! as a pod of namespace [`SYSTEM_NAMESPACE`] (labelled
//! `app.kubernetes.io/component=node-cache`, its address as podIP) and the
//! `kt-dataset-controller`. Datasets live in [`DATASET_NAMESPACE`] unless a
//! step names another.
//!
//! Invariant: a recorded status has no timestamps, uids, resource versions
//! or generations, and its node lists are sorted, so a snapshot is the
//! same on every run that places the same nodes.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value, json};

/// The namespace of the node-cache pods and the controller.
pub const SYSTEM_NAMESPACE: &str = "kt";

/// Where the steps' Datasets live unless they say otherwise.
pub const DATASET_NAMESPACE: &str = "default";

/// The label of node-cache pods.
pub const NODE_CACHE_COMPONENT: (&str, &str) = ("app.kubernetes.io/component", "node-cache");

/// The install's node-cache DaemonSet (and its ServiceAccount).
pub const NODE_CACHE_DAEMONSET: &str = "kt-node-cache";

/// A node-cache agent's byte budget unless the topology says otherwise:
/// the same on every node, below any disk's free space, so every node
/// reports the same free bytes and placement ties break by node name
/// (runs place the same nodes). Every target sets it: the process targets
/// on each agent, the cluster targets on the install's DaemonSet.
pub const DEFAULT_BUDGET: u64 = 2 << 30;

/// The topology's `nodes`: a count, or a count with labels every node
/// gets and the agents' byte budget.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodesSpec {
    pub count: usize,
    pub labels: BTreeMap<String, String>,
    pub budget: Option<crate::format::Size>,
}

impl NodesSpec {
    /// `node-1` .. `node-N`.
    pub fn names(&self) -> Vec<String> {
        (1..=self.count).map(|i| format!("node-{i}")).collect()
    }
}

impl<'de> Deserialize<'de> for NodesSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            count: usize,
            #[serde(default)]
            labels: BTreeMap<String, String>,
            #[serde(default)]
            budget: Option<crate::format::Size>,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            Count(usize),
            Full(Full),
        }
        Ok(match Form::deserialize(d)? {
            Form::Count(count) => NodesSpec {
                count,
                ..NodesSpec::default()
            },
            Form::Full(f) => NodesSpec {
                count: f.count,
                labels: f.labels,
                budget: f.budget,
            },
        })
    }
}

/// `dataset: { apply: { name, ...spec } }` or `dataset: { delete: NAME }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetStep {
    /// `name` (and optionally `namespace`) beside the Dataset's spec
    /// (`source`, `placement`, `path`, `refresh`, `reclaimPolicy`);
    /// strings may hold `{{ }}` templates.
    #[serde(default)]
    pub apply: Option<Map<String, Value>>,
    #[serde(default)]
    pub delete: Option<String>,
    #[serde(default)]
    pub namespace: Option<String>,
}

/// Waits until a Dataset reports `phase` for its current generation; the
/// step's `record` gets its status ([`normalise_status`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitDatasetStep {
    pub name: String,
    pub phase: String,
    #[serde(default)]
    pub namespace: Option<String>,
    /// Also wait until this many nodes are ready (default: any).
    #[serde(default)]
    pub ready_nodes: Option<u32>,
    /// Also wait for a version other than the one the previous
    /// `wait_dataset` of this dataset saw (for the first: any version), for
    /// every Ready node of the status to be at it, and for a moment between
    /// two refreshes of the source ([`source_settled`]: the condition
    /// SourceReady flips while a refresh lists, so a status recorded then
    /// would differ between runs); the record gets the ingest that brought
    /// the version ([`brought_by`]) and how many nodes hold it.
    #[serde(default)]
    pub new_version: bool,
    /// With `new_version`: the ingest that brought the new version fetched
    /// exactly this many objects (checked when the version appears, not
    /// waited for: a later refresh that moves nothing shows 0).
    #[serde(default)]
    pub ingest_changed: Option<u64>,
}

/// Schedules `pod` onto a Ready node carrying the dataset's label (as the
/// pod's node affinity would) and verifies the files at the dataset's path
/// on that node against `verify`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadDatasetStep {
    pub pod: String,
    pub dataset: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub verify: Vec<String>,
}

/// The spec of an `apply` body: everything but `name` and `namespace`.
pub fn spec_of(body: &Map<String, Value>) -> Result<(String, Value), String> {
    let name = body
        .get("name")
        .and_then(Value::as_str)
        .ok_or("dataset.apply needs a `name`")?
        .to_owned();
    let mut spec = body.clone();
    spec.remove("name");
    spec.remove("namespace");
    if !spec.contains_key("source") {
        return Err("dataset.apply needs a `source`".into());
    }
    Ok((name, Value::Object(spec)))
}

/// Expands every string of `v` with `f`.
pub fn expand_strings(
    v: &Value,
    f: &dyn Fn(&str) -> Result<String, String>,
) -> Result<Value, String> {
    Ok(match v {
        Value::String(s) => Value::String(f(s)?),
        Value::Array(a) => Value::Array(
            a.iter()
                .map(|x| expand_strings(x, f))
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| Ok((k.clone(), expand_strings(x, f)?)))
                .collect::<Result<_, String>>()?,
        ),
        other => other.clone(),
    })
}

/// A Dataset's status as a snapshot records it: phase, reason, sizes,
/// counts, the label, the nodes (name, state, bytes; sorted), the
/// conditions (type, status, reason; sorted); no times, versions or
/// generations (a version is a hash of content and time).
pub fn normalise_status(status: &Value) -> Value {
    let s = |k: &str| status.get(k).cloned().unwrap_or(Value::Null);
    let mut nodes: Vec<Value> = status
        .get("nodes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|n| {
            let mut out = json!({
                "name": n.get("name").cloned().unwrap_or(Value::Null),
                "state": n.get("state").cloned().unwrap_or(Value::Null),
                "bytes": n.get("bytes").cloned().unwrap_or(Value::Null),
            });
            if let Some(m) = n.get("message").filter(|m| !m.is_null()) {
                out["message"] = m.clone();
            }
            out
        })
        .collect();
    nodes.sort_by_key(|n| n["name"].as_str().map(node_order));
    let mut conditions: Vec<Value> = status
        .get("conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|c| {
            json!({
                "type": c.get("type").cloned().unwrap_or(Value::Null),
                "status": c.get("status").cloned().unwrap_or(Value::Null),
                "reason": c.get("reason").cloned().unwrap_or(Value::Null),
            })
        })
        .collect();
    conditions.sort_by_key(|c| c["type"].as_str().map(str::to_owned));
    json!({
        "phase": s("phase"),
        "reason": s("reason"),
        "key": s("key"),
        "bytes": s("bytes"),
        "label": s("label"),
        "desiredNodes": s("desiredNodes"),
        "readyNodes": s("readyNodes"),
        "nodes": nodes,
        "conditions": conditions,
    })
}

/// The ingest that brought a status's version, from the first status that
/// shows that version: the controller writes a finished ingest's counts
/// (`lastListed` set) with the version it put, and they stay until the next
/// refresh starts (a running one shows its progress, without
/// `lastListed`). Err: that status shows no finished ingest, or one whose
/// `changed` is not `want`.
pub fn brought_by(status: &Value, want: Option<u64>) -> Result<Value, String> {
    let ingest = status.get("ingest").filter(|i| !i.is_null());
    let Some(ingest) = ingest.filter(|i| i.get("lastListed").is_some_and(|t| !t.is_null())) else {
        return Err(format!(
            "the status that first shows version {} shows no finished ingest: {}",
            status["version"],
            ingest.cloned().unwrap_or(Value::Null)
        ));
    };
    let out = json!({
        "objects": ingest.get("objects").cloned().unwrap_or(Value::Null),
        "bytes": ingest.get("bytes").cloned().unwrap_or(Value::Null),
        "changed": ingest.get("changed").cloned().unwrap_or(Value::Null),
        "removed": ingest.get("removed").cloned().unwrap_or(Value::Null),
    });
    match want {
        Some(n) if ingest.get("changed").and_then(Value::as_u64) != Some(n) => Err(format!(
            "the ingest that brought version {} fetched {} objects, not {n}: {out}",
            status["version"], out["changed"]
        )),
        _ => Ok(out),
    }
}

/// Whether the status's SourceReady condition is True: no refresh of an
/// S3 or PVC source in flight.
pub fn source_settled(status: &Value) -> bool {
    status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "SourceReady" && c["status"] == "True")
}

/// How many of a status's Ready nodes hold its version.
pub fn nodes_at_version(status: &Value) -> usize {
    let v = &status["version"];
    ready_nodes(status)
        .filter(|n| !v.is_null() && n["version"] == *v)
        .count()
}

/// A status's nodes in state Ready.
pub fn ready_nodes(status: &Value) -> impl Iterator<Item = &Value> {
    status["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["state"] == "Ready")
}

/// `node-10` after `node-9`.
pub fn node_order(name: &str) -> (String, u64) {
    let split = name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, num) = name.split_at(split);
    (stem.to_owned(), num.parse().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_from_a_count_or_a_map() {
        let n: NodesSpec = serde_yaml_ng::from_str("12").unwrap();
        assert_eq!(n.count, 12);
        assert_eq!(n.names()[11], "node-12");
        let n: NodesSpec = serde_yaml_ng::from_str("{ count: 2, labels: { zone: a } }").unwrap();
        assert_eq!((n.count, n.labels["zone"].as_str()), (2, "a"));
        assert!(serde_yaml_ng::from_str::<NodesSpec>("{ cuont: 2 }").is_err());
    }

    #[test]
    fn spec_without_name() {
        let body: Map<String, Value> =
            serde_json::from_value(json!({"name": "ds", "source": {"key": "a/b"}})).unwrap();
        let (name, spec) = spec_of(&body).unwrap();
        assert_eq!(name, "ds");
        assert_eq!(spec, json!({"source": {"key": "a/b"}}));
        let no_source: Map<String, Value> = serde_json::from_value(json!({"name": "x"})).unwrap();
        assert!(spec_of(&no_source).is_err());
    }

    #[test]
    fn status_without_times_sorted() {
        let status = json!({
            "phase": "Ready", "version": "v-123", "observedGeneration": 3, "bytes": 10,
            "nodes": [
                {"name": "node-10", "state": "Ready", "bytes": 10, "version": "v-123"},
                {"name": "node-9", "state": "Ready", "bytes": 10},
            ],
            "conditions": [{"type": "Ready", "status": "True", "reason": "Seeded",
                            "lastTransitionTime": "2026-01-01T00:00:00Z", "message": "x"}],
        });
        let n = normalise_status(&status);
        assert_eq!(n["nodes"][0]["name"], "node-9");
        assert!(n.get("version").is_none() && n.get("observedGeneration").is_none());
        assert!(n["conditions"][0].get("lastTransitionTime").is_none());
    }

    fn errors(src: &str) -> Vec<String> {
        match crate::validate::parse(std::path::Path::new("s.yaml"), src) {
            Ok(_) => Vec::new(),
            Err(d) => d.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn dataset_steps_are_validated() {
        let good = "topology: { nodes: 3, pods: [ { name: a } ] }\ndata: { t: { files: 1 } }\nsteps:\n  - dataset: { apply: { name: d, source: { key: k } } }\n  - wait_dataset: { name: d, phase: Ready }\n    record: st\n  - read_dataset: { pod: a, dataset: d, verify: [t] }\n  - kill: { node: node-3 }\n  - dataset: { delete: d }\n";
        assert!(errors(good).is_empty(), "{:?}", errors(good));
        let no_nodes = "topology: { pods: [ { name: a } ] }\nsteps:\n  - wait_dataset: { name: d, phase: Ready }\n";
        assert!(errors(no_nodes)[0].contains("topology `nodes: N`"));
        let bad = "topology: { nodes: 2, pods: [ { name: a } ] }\nsteps:\n  - kill: { node: node-3 }\n  - wait_dataset: { name: d, phase: Done }\n  - dataset: { apply: { source: { key: k } } }\n  - read_dataset: { pod: b, dataset: d }\n";
        let e = errors(bad);
        assert!(
            e.iter().any(|m| m.contains("no node named `node-3`")),
            "{e:?}"
        );
        assert!(e.iter().any(|m| m.contains("phase is one of")), "{e:?}");
        assert!(e.iter().any(|m| m.contains("needs a `name`")), "{e:?}");
        assert!(e.iter().any(|m| m.contains("no pod named `b`")), "{e:?}");
    }

    #[test]
    fn the_ingest_that_brought_a_version() {
        let done = json!({
            "version": "v2",
            "ingest": {"objects": 3, "bytes": 30, "changed": 1, "removed": 0,
                       "lastListed": "2026-01-01T00:00:00Z"},
            "nodes": [{"name": "node-1", "state": "Ready", "version": "v2"},
                      {"name": "node-2", "state": "Ready", "version": "v1"},
                      {"name": "node-3", "state": "Seeding", "version": "v2"}],
        });
        assert_eq!(
            brought_by(&done, Some(1)).unwrap(),
            json!({"objects": 3, "bytes": 30, "changed": 1, "removed": 0})
        );
        assert!(brought_by(&done, None).is_ok());
        assert!(brought_by(&done, Some(3)).unwrap_err().contains("not 3"));
        let running = json!({"version": "v2", "ingest": {"objects": 0, "changed": 0}});
        assert!(
            brought_by(&running, None)
                .unwrap_err()
                .contains("no finished ingest")
        );
        assert!(brought_by(&json!({"version": "v2"}), None).is_err());
        assert_eq!(nodes_at_version(&done), 1);
        assert_eq!(ready_nodes(&done).count(), 2);
        assert!(!source_settled(&done));
        let refreshing = json!({"conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "SourceReady", "status": "False", "reason": "Ingesting"}]});
        assert!(!source_settled(&refreshing));
        let settled = json!({"conditions": [{"type": "SourceReady", "status": "True"}]});
        assert!(source_settled(&settled));
        assert_eq!(nodes_at_version(&json!({"nodes": [{"name": "n"}]})), 0);
    }

    #[test]
    fn ingest_changed_needs_new_version() {
        let src = "topology: { nodes: 1 }\nsteps:\n  - wait_dataset: { name: d, phase: Ready, ingest_changed: 1 }\n";
        assert!(errors(src).iter().any(|m| m.contains("new_version: true")));
        let ok = "topology: { nodes: 1 }\nsteps:\n  - wait_dataset: { name: d, phase: Ready, new_version: true, ingest_changed: 1 }\n";
        assert!(errors(ok).is_empty(), "{:?}", errors(ok));
    }

    #[test]
    fn strings_expand() {
        let v = json!({"source": {"key": "{{x}}/a"}, "placement": {"replicas": 8}});
        let out = expand_strings(&v, &|s| Ok(s.replace("{{x}}", "scn"))).unwrap();
        assert_eq!(out["source"]["key"], "scn/a");
        assert_eq!(out["placement"]["replicas"], 8);
    }
}
