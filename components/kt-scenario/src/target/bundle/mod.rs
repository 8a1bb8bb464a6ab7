//! The `bundle` target: the production install, as operators apply it,
//! run as pods on this machine's Docker engine.
//!
//! Per scenario it renders, with `kubectl kustomize`, what a user of the
//! production install renders: `kustomize/overlays/production` (kube
//! identities, the access map, TokenReview, the servers' own
//! ServiceAccounts and RBAC), plus the scenario's pods as StatefulSets
//! labelled for the agent sidecar with the agent-sidecar and
//! agent-identity components listed after each other as
//! `kustomize/examples/trainer` does ([`manifests`]), images pinned to the
//! run's tag, and the access map extended by one rule per scenario pod
//! (each runs as a ServiceAccount of its own). Then [`kubelet`] runs every
//! pod of the rendered install as a kubelet would, and [`api`] plays the
//! Kubernetes API its components talk to: TokenReview, pod lookups and the
//! namespace watch, behind the install's own RBAC. Nothing of the bundle is
//! changed for the testbed: a defect of the install (a wrong argument, a
//! missing RBAC rule, a socket the workload's user cannot open, a probe
//! that never passes) fails the scenario here as it would fail a first
//! install.
//!
//! The runner's own token is the operator's (a JWT the scripted API issues,
//! as `kubectl create token kt-operator --audience kt` hands one out);
//! commands in a pod run with the pod's own projected token, unless a step
//! gives another. Servers and agents are reached at their pods' addresses
//! (this host routes to the run's bridge). What is not emulated is listed
//! in [`kubelet`]'s documentation and docs/deployment.md.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};

use super::cluster::in_pod_argv;
use super::cluster::manifests::{self, AGENT_CONTAINER, AGENT_PORT, POD_ROOT, Sources, WORKLOAD};
use super::docker::{self, Images};
use super::{Component, ExecOutput, ExecRequest, Plan, PodProcess, Target, TargetError};
use crate::format::Signal;

pub mod api;
pub mod install;
pub mod kubelet;

use api::ScriptedApi;
use install::{Install, Subject};
use kt_kube::apiserver::{ApiServer, ApiServerConfig, Resource};
use kt_kube::kube::core::ApiResource;
use kubelet::{Kubelet, PodRun};

/// The metadata server's and the store's workloads and ports in the
/// bundle (the deployment contract's names).
const METADATA_OWNER: &str = "Deployment/kt-metadata";
const STORE_OWNER: &str = "StatefulSet/kt-store";
const METADATA_PORT: u16 = 8081;
const STORE_PORT: u16 = 8082;
/// The ServiceAccount the access map makes admin for operators.
const OPERATOR: &str = "kt-operator";
/// Pods started at once.
const PARALLEL: usize = 8;

fn failed(s: impl Into<String>) -> TargetError {
    TargetError::Failed(s.into())
}

#[derive(Debug, Default)]
pub struct Bundle {
    engine: Option<bollard::Docker>,
    kubelet: Option<Arc<Kubelet>>,
    kube: Option<Arc<ScriptedApi>>,
    network: Option<String>,
    run: String,
    /// The scenario's work dir (data sets are generated below it).
    scenario_dir: PathBuf,
    /// Below it, the target's own files.
    work: PathBuf,
    /// The operator's token, issued by the scripted API in `up` (empty
    /// before).
    token: String,
    metadata: Option<Arc<PodRun>>,
    store: Option<Arc<PodRun>>,
    /// Scenario pods by their scenario name (`getter-1`).
    pods: BTreeMap<String, Arc<PodRun>>,
    /// Every pod, for logs.
    all: Vec<Arc<PodRun>>,
    /// The topology's `nodes` (`node-1`..): a DaemonSet runs a pod on
    /// each; empty: the one node of the bundle.
    nodes: Vec<String>,
    /// Nodes, custom resources (Datasets), Events and Secrets, behind the
    /// scripted API (only with `nodes`).
    objects: Option<Arc<ApiServer>>,
    /// The install's namespace.
    namespace: String,
}

/// Can this machine run the bundle target? The docker target's checks
/// (an engine, the run's images), `kubectl` (it renders the install), and
/// root: volumes get the owners and modes a kubelet gives them.
fn probe() -> Option<String> {
    static PROBED: OnceLock<Option<String>> = OnceLock::new();
    PROBED
        .get_or_init(|| {
            if !rustix::process::geteuid().is_root() {
                return Some(
                    "the bundle target runs as root: it gives volumes the owners a kubelet gives them (fsGroup)".into(),
                );
            }
            let kubectl = std::process::Command::new("kubectl")
                .args(["version", "--client"])
                .output();
            if !kubectl.is_ok_and(|o| o.status.success()) {
                return Some("the bundle target renders the install with `kubectl kustomize`: kubectl is not installed".into());
            }
            docker::probe()
        })
        .clone()
}

impl Bundle {
    pub fn new() -> Bundle {
        Bundle::default()
    }

    /// The pods of a DaemonSet on `node` (topology `nodes`).
    fn on_node<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Arc<PodRun>> {
        self.all
            .iter()
            .filter(move |p| p.inst.node.as_deref() == Some(node))
    }

    fn kubelet(&self) -> Result<&Arc<Kubelet>, TargetError> {
        self.kubelet
            .as_ref()
            .ok_or_else(|| failed("the bundle testbed is not up"))
    }

    fn pod(&self, name: &str) -> Result<&Arc<PodRun>, TargetError> {
        self.pods
            .get(name)
            .ok_or_else(|| failed(format!("no pod named {name}")))
    }

    fn component(&self, c: &Component) -> Result<&Arc<PodRun>, TargetError> {
        match c {
            Component::Metadata => self
                .metadata
                .as_ref()
                .ok_or_else(|| failed("no metadata server")),
            Component::Store => self.store.as_ref().ok_or_else(|| failed("no store")),
            Component::Pod(p) => self.pod(p),
        }
    }

    /// Where a step's command runs: the pod's workload container (as its
    /// own user), in the pod's root; refused once a liveness probe failed.
    fn in_workload(&self, req: &ExecRequest) -> Result<docker::InContainer, TargetError> {
        self.healthy()?;
        let c = self
            .pod(&req.pod)?
            .container(WORKLOAD)
            .ok_or_else(|| failed("no workload container"))?;
        let mut at = Kubelet::in_container(c, format!("pod {}", req.pod));
        at.dir = POD_ROOT.into();
        Ok(at)
    }

    /// Fails with the liveness faults recorded so far, if any.
    fn healthy(&self) -> Result<(), TargetError> {
        let faults = self.kubelet()?.faults();
        if faults.is_empty() {
            Ok(())
        } else {
            Err(failed(faults.join("\n")))
        }
    }

    /// Renders the production install with the scenario's pods.
    async fn render(&self, plan: &Plan, repo: &Path, tag: &str) -> Result<String, TargetError> {
        let dir = self.work.join("deploy");
        let kustomize = repo.join("kustomize");
        let ns = manifests::namespace(&plan.run_id, &plan.scenario);
        let mut src = Sources::production(&kustomize);
        if plan.nodes.is_some() {
            // As kustomize/examples/datasets installs them: listed once,
            // in the kustomization over production.
            for c in ["datasets", "node-cache"] {
                src.components
                    .insert(0, kustomize.join("components").join(c));
            }
        }
        manifests::write_deploy(plan, &ns, tag, &dir, &src, &kustomize)?;
        let out = tokio::process::Command::new("kubectl")
            .arg("kustomize")
            .arg(&dir)
            .output()
            .await
            .map_err(TargetError::io("running kubectl kustomize"))?;
        if !out.status.success() {
            return Err(failed(format!(
                "kubectl kustomize {}: {}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let rendered = self.work.join("install.yaml");
        std::fs::write(&rendered, &text).map_err(TargetError::io("writing install.yaml"))?;
        Ok(text)
    }

    async fn up_inner(&mut self, plan: &Plan) -> Result<(), TargetError> {
        let engine = docker::connect().await.map_err(TargetError::Unavailable)?;
        // Kept from here: `down` removes whatever a failed `up` made.
        self.engine = Some(engine.clone());
        let images = Images::of_run().map_err(TargetError::Unavailable)?;
        let tag = images
            .metadata
            .rsplit_once(':')
            .map(|(_, t)| t.to_owned())
            .ok_or_else(|| failed(format!("image {} has no tag", images.metadata)))?;
        self.run = format!("{}-{}", plan.run_id, docker::docker_name(&plan.scenario));
        self.scenario_dir = plan.work_dir.clone();
        self.work = plan.work_dir.join("bundle");
        // Tokens, keys and pods' volumes live below: the runner's alone
        // (the engine bind-mounts them regardless).
        std::fs::create_dir_all(&self.work)
            .and_then(|()| {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&self.work, std::fs::Permissions::from_mode(0o700))
            })
            .map_err(TargetError::io(format!("creating {}", self.work.display())))?;
        let repo = std::env::current_dir().map_err(TargetError::io("the working directory"))?;
        let text = self.render(plan, &repo, &tag).await?;
        self.nodes = plan.nodes.as_ref().map(|n| n.names()).unwrap_or_default();
        self.namespace = manifests::namespace(&plan.run_id, &plan.scenario);
        let install = Arc::new(Install::parse_on(&text, &self.nodes).map_err(|e| failed(e.0))?);
        if let Some(spec) = &plan.nodes {
            self.objects = Some(Arc::new(objects_api(&install, spec).await?));
        }
        for (kind, why) in &install.skipped {
            tracing::info!(kind = %kind, "bundle target: {why}");
        }

        // Hundreds of pods on one bridge outgrow the kernel's neighbour
        // table (as on the docker target): raised for the run's size.
        super::host::raise_limits(install.pods.len());
        let network = format!("kt-{}-net", self.run);
        let labels = std::collections::HashMap::from([
            (docker::RUN_LABEL.to_owned(), self.run.clone()),
            ("kt.dev/testbed".to_owned(), "bundle".to_owned()),
        ]);
        let base = docker::create_network(&engine, &network, labels).await?;
        self.network = Some(network.clone());
        let [a, b, _, _] = base.octets();
        let gateway = Ipv4Addr::new(a, b, 0, 1);
        let kube = Arc::new(
            ScriptedApi::with_objects(
                IpAddr::V4(gateway),
                &self.work.join("kube-api"),
                install.rbac.clone(),
                self.objects.clone(),
            )
            .await
            .map_err(|e| failed(e.to_string()))?,
        );
        self.kube = Some(kube.clone());
        let ns = manifests::namespace(&plan.run_id, &plan.scenario);
        // The runner is the operator, with the token `kubectl create token
        // kt-operator --audience kt` hands out: a JWT (the metadata server
        // refuses anything else before a TokenReview).
        self.token = kube.issue(
            &Subject {
                namespace: ns.clone(),
                name: OPERATOR.into(),
            },
            "kt",
            None,
            Duration::from_secs(24 * 3600),
        );
        for (resource, meta) in &install.workloads {
            kube.set_workload(resource, meta.clone());
        }
        let kubelet = Arc::new(Kubelet::new(
            engine,
            self.run.clone(),
            network,
            self.work.clone(),
            kube.clone(),
            install.clone(),
            images.client.clone(),
        ));
        self.kubelet = Some(kubelet.clone());

        // Servers first, then the scenario's pods, each at an address of
        // its own.
        let mut order: Vec<_> = install.pods.clone();
        order.sort_by_key(|p| match p.owner.as_str() {
            METADATA_OWNER => 0,
            STORE_OWNER => 1,
            _ => 2,
        });
        let addrs: Vec<(String, Ipv4Addr)> = order
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), docker::pod_ip(base, i)))
            .collect();
        kubelet.assign(&addrs);
        for (p, (_, ip)) in order.iter().zip(&addrs) {
            kube.set_pod(pod_object(p, *ip, kubelet.node_of(p), true));
        }
        let creating: Vec<_> = order
            .into_iter()
            .zip(addrs)
            .map(|(p, (_, ip))| {
                let k = kubelet.clone();
                async move { k.create(p, ip).await.map(Arc::new) }
            })
            .collect();
        let made: Vec<Arc<PodRun>> = futures::stream::iter(creating)
            .buffered(PARALLEL)
            .try_collect()
            .await?;
        self.all = made.clone();
        let by_owner = |owner: &str| made.iter().find(|p| p.inst.owner == owner).cloned();
        self.metadata = by_owner(METADATA_OWNER);
        self.store = by_owner(STORE_OWNER);
        if self.metadata.is_none() || self.store.is_none() {
            return Err(failed(format!(
                "the rendered install has no {METADATA_OWNER} or no {STORE_OWNER}"
            )));
        }
        for p in &plan.pods {
            let owner = format!("StatefulSet/{}", p.name);
            let run = by_owner(&owner)
                .ok_or_else(|| failed(format!("the rendered install has no {owner}")))?;
            if run.container(WORKLOAD).is_none() || run.container(AGENT_CONTAINER).is_none() {
                return Err(failed(format!(
                    "pod {} has no {WORKLOAD} container or no {AGENT_CONTAINER} sidecar: is agent-sidecar listed?",
                    run.inst.name
                )));
            }
            self.pods.insert(p.name.clone(), run);
        }
        for server in [&self.metadata, &self.store].into_iter().flatten() {
            kubelet.start(server).await?;
        }
        let rest: Vec<Arc<PodRun>> = made
            .iter()
            .filter(|p| p.inst.owner != METADATA_OWNER && p.inst.owner != STORE_OWNER)
            .cloned()
            .collect();
        let starting: Vec<_> = rest
            .into_iter()
            .map(|p| {
                let k = kubelet.clone();
                async move { k.start(&p).await }
            })
            .collect();
        futures::stream::iter(starting)
            .buffer_unordered(PARALLEL)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }
}

/// The in-memory API server behind the scripted one for a topology with
/// `nodes`: the install's custom resources (the Dataset CRD of the
/// `datasets` component, which must be there), its Secrets, and the Nodes
/// `node-1`.. (Ready, labelled `kubernetes.io/os: linux` as a kubelet labels
/// its node, and with the topology's labels).
async fn objects_api(
    install: &Install,
    spec: &crate::datasets::NodesSpec,
) -> Result<ApiServer, TargetError> {
    use kt_kube::dataset::Dataset;
    let want = ApiResource::erase::<Dataset>(&());
    if !install
        .crds
        .iter()
        .any(|c| c.group == want.group && c.kind == want.kind && c.version == want.version)
    {
        return Err(failed(format!(
            "the rendered install has no CustomResourceDefinition serving {}/{} {}: is the datasets component listed?",
            want.group, want.version, want.kind
        )));
    }
    let api = ApiServer::start(ApiServerConfig::default())
        .await
        .map_err(|e| failed(format!("the testbed's object API: {e}")))?;
    for c in &install.crds {
        let ar = ApiResource {
            group: c.group.clone(),
            version: c.version.clone(),
            api_version: format!("{}/{}", c.group, c.version),
            kind: c.kind.clone(),
            plural: c.plural.clone(),
        };
        let r = if c.namespaced {
            Resource::namespaced(&ar)
        } else {
            Resource::cluster(&ar)
        };
        api.register(if c.status { r.with_status() } else { r });
    }
    let put = |v: &serde_json::Value, what: &str| {
        api.put(v)
            .map(|_| ())
            .map_err(|e| failed(format!("writing {what} into the testbed's API: {e}")))
    };
    for s in install.secrets.values() {
        let v = serde_json::to_value(s).map_err(|e| failed(e.to_string()))?;
        put(&v, "a Secret")?;
    }
    let mut labels = spec.labels.clone();
    labels.insert("kubernetes.io/os".into(), "linux".into());
    for node in spec.names() {
        put(&super::nodes::node_object(&node, &labels), "a Node")?;
    }
    Ok(api)
}

/// The Pod object the scripted API serves for a running pod (Ready or
/// not: what a kubelet reports once its readiness probes pass).
fn pod_object(
    p: &install::PodInstance,
    ip: Ipv4Addr,
    node: &str,
    ready: bool,
) -> serde_json::Value {
    let containers: Vec<serde_json::Value> = p
        .spec
        .containers
        .iter()
        .map(|c| serde_json::json!({ "name": c.name, "image": c.image, "ports": c.ports }))
        .collect();
    // Owned by its workload, as its controller makes it (the Dataset
    // controller takes only the node-cache DaemonSet's pods for agents).
    let (kind, owner) = p.owner.split_once('/').unwrap_or_default();
    let owner_uid = install::uid(
        &p.namespace,
        &format!("{}s/{owner}", kind.to_ascii_lowercase()),
    );
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": p.name,
            "namespace": p.namespace,
            "uid": p.uid,
            "labels": p.labels,
            "annotations": p.annotations,
            "resourceVersion": "1",
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": kind, "name": owner,
                "uid": owner_uid, "controller": true,
            }],
        },
        "spec": {
            "serviceAccountName": p.spec.service_account_name.clone().unwrap_or_else(|| "default".into()),
            "nodeName": node,
            "containers": containers,
        },
        "status": {
            "phase": "Running",
            "podIP": ip.to_string(),
            "podIPs": [{ "ip": ip.to_string() }],
            "conditions": [{ "type": "Ready", "status": if ready { "True" } else { "False" } }],
        },
    })
}

/// Removes the run's engine volumes (tmpfs emptyDirs).
async fn remove_volumes(api: &bollard::Docker, run: &str) -> Result<(), TargetError> {
    let filters = std::collections::HashMap::from([(
        "label".to_owned(),
        vec![format!("{}={run}", docker::RUN_LABEL)],
    )]);
    let volumes = api
        .list_volumes(Some(
            bollard::query_parameters::ListVolumesOptionsBuilder::new()
                .filters(&filters)
                .build(),
        ))
        .await
        .map_err(|e| failed(format!("listing the run's volumes: {e}")))?
        .volumes
        .unwrap_or_default();
    let mut first = None;
    for v in volumes {
        if let Err(e) = api
            .remove_volume(
                &v.name,
                None::<bollard::query_parameters::RemoveVolumeOptions>,
            )
            .await
        {
            first.get_or_insert(failed(format!("removing volume {}: {e}", v.name)));
        }
    }
    first.map_or(Ok(()), Err)
}

/// Copies `from` (a file or a directory tree) to `to` with its modes and
/// modification times (what a manifest records: every pod putting a data
/// set publishes the same digest, as on the targets that share files).
fn copy_tree(from: &Path, to: &Path, owner: (Option<u32>, Option<u32>)) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(from)?;
    if meta.is_dir() {
        std::fs::create_dir_all(to)?;
        for entry in std::fs::read_dir(from)? {
            let entry = entry?;
            copy_tree(&entry.path(), &to.join(entry.file_name()), owner)?;
        }
        std::fs::set_permissions(to, meta.permissions())?;
    } else if meta.file_type().is_symlink() {
        let _ = std::fs::remove_file(to);
        std::os::unix::fs::symlink(std::fs::read_link(from)?, to)?;
        return std::os::unix::fs::lchown(to, owner.0, owner.1);
    } else {
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::copy(from, to)?;
    }
    // The workload's own files, as if it had unpacked them itself.
    std::os::unix::fs::lchown(to, owner.0, owner.1)?;
    filetime::set_file_mtime(to, filetime::FileTime::from_last_modification_time(&meta))
}

#[async_trait]
impl Target for Bundle {
    fn name(&self) -> &'static str {
        "bundle"
    }

    fn unavailable(&self) -> Option<String> {
        probe()
    }

    async fn up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        self.up_inner(plan).await
    }

    fn operator_token(&self) -> Option<String> {
        (!self.token.is_empty()).then(|| self.token.clone())
    }

    fn aliases(&self) -> Vec<(String, String)> {
        let pods: Vec<String> = self.pods.keys().cloned().collect();
        let mut out = manifests::aliases(&pods, &self.namespace);
        if self.objects.is_some() {
            // A Dataset's node label names its namespace, the install's
            // here (the process targets' controller obeys `default`).
            out.push((
                kt_types::dataset::node_label(&self.namespace, ""),
                kt_types::dataset::node_label(crate::datasets::DATASET_NAMESPACE, ""),
            ));
        }
        out
    }

    /// The install's node-cache DaemonSet runs a pod per emulated node
    /// (hostPath below the run's `nodes/<node>/`), the Dataset CRD and the
    /// controller are served by the object API: the dataset scenarios run.
    fn runs_nodes(&self) -> bool {
        true
    }

    fn kube(&self) -> Option<kt_kube::kube::Client> {
        self.objects.as_ref().and_then(|o| o.client().ok())
    }

    fn dataset_namespace(&self) -> Option<String> {
        // The install's Dataset controller obeys its own namespace only.
        self.objects.as_ref().map(|_| self.namespace.clone())
    }

    fn node_root(&self, node: &str) -> Option<PathBuf> {
        let kubelet = self.kubelet.as_ref()?;
        self.on_node(node).find_map(|p| {
            p.inst
                .spec
                .volumes
                .iter()
                .flatten()
                .find_map(|v| v.host_path.as_ref())
                .and_then(|h| kubelet.node_path(node, &h.path).ok())
        })
    }

    fn node_path(&self, node: &str, path: &Path) -> PathBuf {
        let inside = path.display().to_string();
        self.on_node(node)
            .find_map(|p| {
                p.containers
                    .iter()
                    .find_map(|c| p.host_path(&c.name, &inside))
            })
            .unwrap_or_else(|| path.to_owned())
    }

    async fn kill_node(&self, node: &str) -> Result<(), TargetError> {
        let (Some(objects), Some(kube)) = (&self.objects, &self.kube) else {
            return Err(TargetError::Unavailable(
                "this scenario has no Kubernetes nodes (topology `nodes`)".into(),
            ));
        };
        if !self.nodes.iter().any(|n| n == node) {
            return Err(failed(format!("no node named {node}")));
        }
        let kubelet = self.kubelet()?;
        // As the process targets do: marked first (its pods not Ready, the
        // Node's Ready condition Unknown, as the node controller marks a
        // node whose kubelet stopped reporting), then its pods killed.
        for p in self.on_node(node) {
            kube.set_pod(pod_object(&p.inst, p.ip, node, false));
        }
        objects
            .modify("v1", "Node", None, node, |n| {
                n["status"]["conditions"] = serde_json::json!([{
                    "type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                    "message": "Kubelet stopped posting node status.",
                }]);
            })
            .map_err(|e| failed(format!("marking {node} NotReady: {e}")))?;
        for p in self.on_node(node) {
            kubelet.stop(p, Signal::KILL).await?;
        }
        Ok(())
    }

    fn metadata_url(&self) -> String {
        self.metadata
            .as_ref()
            .map(|p| format!("http://{}:{METADATA_PORT}", p.ip))
            .unwrap_or_default()
    }

    fn component_url(&self, c: &Component) -> Option<String> {
        let (pod, port) = match c {
            Component::Metadata => (self.metadata.as_ref()?, METADATA_PORT),
            Component::Store => (self.store.as_ref()?, STORE_PORT),
            Component::Pod(p) => (self.pods.get(p)?, AGENT_PORT),
        };
        Some(format!("http://{}:{port}", pod.ip))
    }

    fn pod_dir(&self, pod: &str) -> PathBuf {
        self.pods
            .get(pod)
            .and_then(|p| p.host_path(WORKLOAD, POD_ROOT))
            .unwrap_or_else(|| self.work.join("pods").join(pod).join("missing-pod-root"))
    }

    fn data_path(&self, pod: &str, host: &Path) -> Result<String, TargetError> {
        let rel = host.strip_prefix(&self.scenario_dir).map_err(|_| {
            failed(format!(
                "{} is not below the scenario's work dir, so pod {pod} cannot see it",
                host.display()
            ))
        })?;
        Ok(Path::new(POD_ROOT).join(rel).display().to_string())
    }

    async fn stage_data(&self, uses: &[(String, PathBuf)]) -> Result<(), TargetError> {
        for (pod, host) in uses {
            let rel = host
                .strip_prefix(&self.scenario_dir)
                .map_err(|_| failed(format!("{} is not below the work dir", host.display())))?;
            let to = self.pod_dir(pod).join(rel);
            let run = self.pod(pod)?;
            let who = run.container(WORKLOAD).map(|c| {
                kubelet::identity(
                    run.inst.spec.security_context.as_ref(),
                    c.spec.security_context.as_ref(),
                )
            });
            let id = |v: Option<i64>| v.and_then(|v| u32::try_from(v).ok());
            let owner = who.map_or((None, None), |w| (id(w.uid), id(w.gid)));
            copy_tree(host, &to, owner).map_err(TargetError::io(format!(
                "copying {} into pod {pod}",
                host.display()
            )))?;
        }
        Ok(())
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecOutput, TargetError> {
        let at = self.in_workload(&req)?;
        let argv = in_pod_argv(&req, Some(&self.token));
        docker::exec_in(&self.kubelet()?.docker, &at, argv).await
    }

    async fn spawn(&self, req: ExecRequest) -> Result<Box<dyn PodProcess>, TargetError> {
        let at = self.in_workload(&req)?;
        let argv = in_pod_argv(&req, Some(&self.token));
        docker::spawn_in(&self.kubelet()?.docker, &at, argv).await
    }

    async fn pod_ip(&self, pod: &str) -> Result<String, TargetError> {
        Ok(self.pod(pod)?.ip.to_string())
    }

    async fn kill_agent(&self, pod: &str, signal: Signal) -> Result<(), TargetError> {
        let pod = self.pod(pod)?;
        self.kubelet()?.stop_one(pod, AGENT_CONTAINER, signal).await
    }

    fn freezes(&self) -> bool {
        true
    }

    async fn kill(&self, c: &Component, signal: Signal) -> Result<(), TargetError> {
        let pod = self.component(c)?;
        self.kubelet()?.stop(pod, signal).await
    }

    async fn start(&self, c: &Component) -> Result<(), TargetError> {
        let pod = self.component(c)?;
        self.kubelet()?.start(pod).await
    }

    async fn collect_logs(&self, dir: &Path) -> Result<(), TargetError> {
        std::fs::create_dir_all(dir)
            .map_err(TargetError::io(format!("creating {}", dir.display())))?;
        let kubelet = self.kubelet()?;
        for pod in &self.all {
            for c in &pod.containers {
                let log = kubelet.log(&c.docker, None).await;
                let path = dir.join(format!("{}-{}.log", pod.inst.name, c.name));
                std::fs::write(&path, log)
                    .map_err(TargetError::io(format!("writing {}", path.display())))?;
            }
        }
        let rendered = self.work.join("install.yaml");
        if rendered.exists() {
            std::fs::copy(&rendered, dir.join("install.yaml"))
                .map_err(TargetError::io("copying install.yaml"))?;
        }
        if let Some(kube) = &self.kube {
            let path = dir.join("kube-api.log");
            std::fs::write(&path, kube.log().join("\n"))
                .map_err(TargetError::io(format!("writing {}", path.display())))?;
        }
        Ok(())
    }

    async fn down(&mut self) -> Result<(), TargetError> {
        let Some(api) = self.engine.take() else {
            return Ok(());
        };
        self.kubelet = None;
        for pod in &self.all {
            pod.stop_monitors();
        }
        // A pod whose creation was cut short by another's failure may
        // still be made after the first sweep, and the engine may hold an
        // endpoint a moment after its container went: sweep until the
        // volumes and the network go.
        let network = self.network.take();
        let mut first = None;
        for attempt in 0..3 {
            let containers = docker::remove_run_containers(&api, &self.run).await;
            let volumes = remove_volumes(&api, &self.run).await;
            let net = match &network {
                None => Ok(()),
                Some(net) => match api.remove_network(net).await {
                    Ok(())
                    | Err(bollard::errors::Error::DockerResponseServerError {
                        status_code: 404,
                        ..
                    }) => Ok(()),
                    Err(e) => Err(failed(format!("removing network {net}: {e}"))),
                },
            };
            first = containers.err().or(volumes.err()).or(net.err());
            if first.is_none() || attempt == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        self.kube = None;
        self.objects = None;
        self.pods.clear();
        self.all.clear();
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DaemonSet's pod says who made it, as the Dataset controller
    /// requires of a node-cache agent: its owner (the workload's uid) and
    /// its ServiceAccount.
    #[test]
    fn a_pod_names_its_owner_and_service_account() {
        let yaml = r#"
apiVersion: apps/v1
kind: DaemonSet
metadata: { name: kt-node-cache, namespace: kt }
spec:
  selector: { matchLabels: { app: nc } }
  template:
    metadata: { labels: { app: nc } }
    spec:
      serviceAccountName: kt-node-cache
      containers: [{ name: nc, image: agent }]
"#;
        let i = Install::parse(yaml).unwrap();
        let p = pod_object(&i.pods[0], Ipv4Addr::new(10, 0, 0, 2), "node-1", true);
        let owner = &p["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "DaemonSet");
        assert_eq!(owner["name"], "kt-node-cache");
        assert_eq!(owner["controller"], true);
        assert_eq!(owner["uid"], i.workloads[0].1["uid"], "the DaemonSet's uid");
        assert_eq!(p["spec"]["serviceAccountName"], "kt-node-cache");
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(p).unwrap();
        assert_eq!(
            pod.metadata.owner_references.unwrap()[0].api_version,
            "apps/v1"
        );
    }
}
