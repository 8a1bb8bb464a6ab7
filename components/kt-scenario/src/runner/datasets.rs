//! Dataset steps (topology `nodes`): `dataset` applies or deletes a
//! `Dataset` in the testbed's API server, `wait_dataset` waits for its
//! phase and records its status, `read_dataset` schedules a pod onto a
//! node carrying the dataset's label and verifies the files there, and
//! `kill: { node }` loses a node.

use std::path::PathBuf;
use std::time::Duration;

use kt_kube::dataset::{Dataset, DatasetSpec};
use kt_kube::kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kt_kube::kube::core::ApiResource;
use kt_types::dataset::{default_path, node_label};
use serde_json::{Value, json};

use super::{Scn, StepError, StepResult};
use crate::datasets::{
    DATASET_NAMESPACE, DatasetStep, ReadDatasetStep, WaitDatasetStep, brought_by, expand_strings,
    node_order, nodes_at_version, normalise_status, ready_nodes, source_settled, spec_of,
};
use crate::format::Step;

const POLL: Duration = Duration::from_millis(50);

fn kube_err(what: &str) -> impl FnOnce(kt_kube::kube::Error) -> StepError {
    let what = what.to_owned();
    move |e| StepError::Probe(format!("{what}: {e}"))
}

/// Whether a Node's Ready condition is True.
fn node_ready(n: &Value) -> bool {
    n.pointer("/status/conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

impl Scn<'_> {
    fn kube(&self) -> Result<kt_kube::kube::Client, StepError> {
        self.target.kube().ok_or_else(|| {
            StepError::Input(format!(
                "the {} target runs no Kubernetes API for this scenario (topology `nodes`)",
                self.target.name()
            ))
        })
    }

    /// A step's namespace, else the target's for Datasets.
    fn dataset_ns(&self, namespace: Option<&str>) -> String {
        namespace.map_or_else(
            || {
                self.target
                    .dataset_namespace()
                    .unwrap_or_else(|| DATASET_NAMESPACE.to_owned())
            },
            str::to_owned,
        )
    }

    fn datasets(&self, namespace: Option<&str>) -> Result<Api<DynamicObject>, StepError> {
        Ok(Api::namespaced_with(
            self.kube()?,
            &self.dataset_ns(namespace),
            &ApiResource::erase::<Dataset>(&()),
        ))
    }

    /// `dataset`: apply (server-side apply of the spec) or delete.
    pub(super) async fn dataset(&self, step: &Step, d: &DatasetStep) -> Result<(), StepError> {
        let outcome = async {
            let api = self.datasets(d.namespace.as_deref())?;
            if let Some(body) = &d.apply {
                let (name, spec) = spec_of(body).map_err(StepError::Input)?;
                let spec = expand_strings(&spec, &|s| self.expand(s).map_err(|e| e.to_string()))
                    .map_err(StepError::Input)?;
                serde_json::from_value::<DatasetSpec>(spec.clone())
                    .map_err(|e| StepError::Input(format!("dataset {name}: {e}")))?;
                let obj = json!({
                    "apiVersion": "kt.dev/v1alpha1", "kind": "Dataset",
                    "metadata": {"name": name}, "spec": spec,
                });
                api.patch(
                    &name,
                    &PatchParams::apply("kt-scenario").force(),
                    &Patch::Apply(&obj),
                )
                .await
                .map_err(kube_err(&format!("applying dataset {name}")))?;
            }
            if let Some(name) = &d.delete {
                api.delete(name, &DeleteParams::default())
                    .await
                    .map_err(kube_err(&format!("deleting dataset {name}")))?;
            }
            Ok(())
        }
        .await;
        self.expect_plain(step, outcome)
    }

    /// The names of the Ready nodes labelled for a dataset, in order.
    async fn labelled_nodes(&self, namespace: &str, name: &str) -> Result<Vec<String>, StepError> {
        let nodes: Api<DynamicObject> = Api::all_with(
            self.kube()?,
            &ApiResource::erase::<k8s_openapi::api::core::v1::Node>(&()),
        );
        let list = nodes
            .list(&ListParams::default().labels(&node_label(namespace, name)))
            .await
            .map_err(kube_err("listing nodes"))?;
        let mut names: Vec<String> = list
            .items
            .iter()
            .filter(|n| node_ready(&serde_json::to_value(n).unwrap_or_default()))
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        names.sort_by_key(|n| node_order(n));
        Ok(names)
    }

    /// `wait_dataset`: polls until the phase (for the current generation)
    /// and, if asked, the ready nodes hold; records the status and the
    /// labelled nodes. A Dataset that turns Failed while another phase is
    /// awaited fails the step at once, with its reason.
    pub(super) async fn wait_dataset(
        &self,
        step: &Step,
        w: &WaitDatasetStep,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let namespace = &self.dataset_ns(w.namespace.as_deref());
        let id = format!("{namespace}/{}", w.name);
        let previous = (self.dataset_versions.lock().ok()).and_then(|m| m.get(&id).cloned());
        // With `new_version`: the ingest that brought it, from the first
        // status showing it.
        let mut brought: Option<Value> = None;
        let outcome = async {
            let api = self.datasets(Some(namespace))?;
            loop {
                let ds = api
                    .get_opt(&w.name)
                    .await
                    .map_err(kube_err(&format!("reading dataset {}", w.name)))?;
                if let Some(ds) = ds {
                    let status = ds.data.get("status").cloned().unwrap_or(Value::Null);
                    let phase = status["phase"].as_str().unwrap_or("");
                    let current = status["observedGeneration"].as_i64() >= ds.metadata.generation;
                    result.context = format!("last status: {status}");
                    let version = status["version"].as_str().map(str::to_owned);
                    if w.new_version
                        && brought.is_none()
                        && version.is_some()
                        && version != previous
                    {
                        brought =
                            Some(brought_by(&status, w.ingest_changed).map_err(StepError::Check)?);
                    }
                    let versioned = !w.new_version
                        || (brought.is_some()
                            && nodes_at_version(&status) == ready_nodes(&status).count()
                            && source_settled(&status));
                    if current && phase == w.phase && versioned {
                        let ready = status["readyNodes"].as_u64().unwrap_or(0);
                        if w.ready_nodes.is_none_or(|n| u64::from(n) == ready) {
                            let labelled = self.labelled_nodes(namespace, &w.name).await?;
                            let mut record = json!({
                                "status": normalise_status(&status),
                                "labelled": labelled,
                            });
                            if let Some(ingest) = &brought {
                                record["ingest"] = ingest.clone();
                                record["nodes_at_new_version"] = nodes_at_version(&status).into();
                            }
                            result.record = Some(record);
                            if let (Some(v), Ok(mut m)) = (version, self.dataset_versions.lock()) {
                                m.insert(id.clone(), v);
                            }
                            return Ok(());
                        }
                    } else if current && phase == "Failed" && w.phase != "Failed" {
                        return Err(StepError::Check(format!(
                            "dataset {} is Failed: {}",
                            w.name,
                            status["reason"].as_str().unwrap_or("no reason given")
                        )));
                    }
                }
                tokio::time::sleep(POLL).await;
            }
        }
        .await;
        self.expect_plain(step, outcome)
    }

    /// `read_dataset`: the first Ready node with the dataset's label (node
    /// affinity's choice), and the dataset's files at its path there.
    pub(super) async fn read_dataset(
        &self,
        step: &Step,
        r: &ReadDatasetStep,
        result: &mut StepResult,
    ) -> Result<(), StepError> {
        let namespace = &self.dataset_ns(r.namespace.as_deref());
        let outcome = async {
            if self.select(&r.pod).is_empty() {
                return Err(StepError::Input(format!("no pod named {}", r.pod)));
            }
            let api = self.datasets(Some(namespace))?;
            let ds = api
                .get(&r.dataset)
                .await
                .map_err(kube_err(&format!("reading dataset {}", r.dataset)))?;
            let nodes = self.labelled_nodes(namespace, &r.dataset).await?;
            let node = nodes.first().ok_or_else(|| {
                StepError::Check(format!(
                    "pod {} cannot be scheduled: no Ready node carries {}",
                    r.pod,
                    node_label(namespace, &r.dataset)
                ))
            })?;
            let status = ds.data.get("status").cloned().unwrap_or(Value::Null);
            let per_node = status["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|n| n["name"] == node.as_str())
                .and_then(|n| n["path"].as_str())
                .map(|p| self.target.node_path(node, std::path::Path::new(p)));
            let root = self.target.node_root(node).ok_or_else(|| {
                StepError::Input(format!(
                    "the target does not say where {node} keeps datasets"
                ))
            })?;
            let path = per_node.unwrap_or_else(|| {
                PathBuf::from(default_path(
                    &root.display().to_string(),
                    namespace,
                    &r.dataset,
                ))
            });
            let mut want = Vec::new();
            for set in &r.verify {
                want.push((set.clone(), self.digest_of_set(set).await?));
            }
            if !want.is_empty() {
                self.verify_tree(&r.pod, &path, &want).await?;
            }
            result.record = Some(json!({
                "pod": r.pod, "node": node, "verified": r.verify,
            }));
            Ok(())
        }
        .await;
        self.expect_plain(step, outcome)
    }
}
