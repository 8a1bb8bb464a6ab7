//! The topology's Kubernetes `nodes` on the process targets: an in-memory
//! API server (`kt_kube::apiserver`, HTTPS with a generated CA and a
//! bearer token, both in the kubeconfig the controller gets) holding the Dataset CRD, Nodes
//! `node-1`..`node-N` and one node-cache agent per node, run as a pod of
//! namespace [`SYSTEM_NAMESPACE`] with a loopback address of its own, and
//! the `kt-dataset-controller` given a kubeconfig for that server.
//!
//! What a kubelet and the node controller would do is done here: a node
//! agent that is up and ready has its Pod `Running` and `Ready` with its
//! address as `podIP` and its port named `node-cache`; a node lost
//! ([`NodeCluster::kill_node`]) has its agent killed, its Pod not Ready and
//! its Node `Ready=Unknown`.
//!
//! Invariant: the API server lives as long as the cluster; every process
//! here is a [`Server`] stopped by [`NodeCluster::stop`].

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use kt_kube::apiserver::{ApiServer, ApiServerConfig, Resource};
use kt_kube::dataset::Dataset;
use kt_kube::kube::core::ApiResource;
use serde_json::{Value, json};

use super::local::Servers;
use super::procs::{Server, binary, free_port};
use super::{Component, TargetError};
use crate::datasets::{DEFAULT_BUDGET, NODE_CACHE_COMPONENT, NodesSpec, SYSTEM_NAMESPACE};
use crate::format::Signal;

/// The controller's component name.
pub const CONTROLLER: &str = "dataset-controller";

/// One node: its agent's address and where it keeps datasets.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub ip: Ipv4Addr,
    pub port: u16,
    /// `--dataset-root` of its agent (a hostPath on a real node).
    pub root: PathBuf,
}

/// The node-cache pod of `node`.
pub fn pod_name(node: &str) -> String {
    format!("node-cache-{node}")
}

/// Where a process target runs its nodes' programs.
#[derive(Debug, Clone)]
pub struct NodeAddrs {
    /// Each node agent's address, port and command prefix (netns: `ip
    /// netns exec NS`), in node order.
    pub agents: Vec<(Ipv4Addr, u16, Vec<String>)>,
    /// The controller's listening address (it runs beside the runner and
    /// reaches the API server on 127.0.0.1).
    pub controller: (Ipv4Addr, u16),
}

impl NodeAddrs {
    /// The local target's: loopback addresses `ip_of(0..N)` with free
    /// ports, the controller at `ip_of(N)`.
    pub fn loopback(
        count: usize,
        ip_of: impl Fn(usize) -> Ipv4Addr,
    ) -> Result<NodeAddrs, TargetError> {
        let mut agents = Vec::new();
        for i in 0..count {
            let ip = ip_of(i);
            agents.push((ip, free_port(IpAddr::V4(ip))?, Vec::new()));
        }
        let cip = ip_of(count);
        Ok(NodeAddrs {
            agents,
            controller: (cip, free_port(IpAddr::V4(cip))?),
        })
    }
}

/// How a process target runs its nodes' programs: the binaries, the run's
/// directory, the metadata server and the environment.
#[derive(Debug, Clone)]
pub struct NodeEnv {
    pub bin_dir: PathBuf,
    pub work_dir: PathBuf,
    pub metadata_url: String,
    /// The environment of the node agents and the controller (an admin
    /// token and the run's tokens file).
    pub env: Vec<(String, String)>,
}

#[derive(Debug)]
pub struct NodeCluster {
    api: ApiServer,
    nodes: BTreeMap<String, NodeInfo>,
    servers: Servers,
    http: reqwest::Client,
}

/// A Ready Node named `name` with `labels` (and its hostname label).
pub(crate) fn node_object(name: &str, labels: &BTreeMap<String, String>) -> Value {
    let mut l = labels.clone();
    l.insert("kubernetes.io/hostname".into(), name.into());
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": l},
        "status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            "addresses": [{"type": "Hostname", "address": name}],
        },
    })
}

fn pod_object(node: &str, info: &NodeInfo, ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": pod_name(node), "namespace": SYSTEM_NAMESPACE,
            "labels": {NODE_CACHE_COMPONENT.0: NODE_CACHE_COMPONENT.1},
            // As the DaemonSet's controller makes it: the Dataset
            // controller talks to no other pod.
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                                 "name": "kt-node-cache", "uid": "kt-node-cache",
                                 "controller": true}],
        },
        "spec": {
            "nodeName": node,
            "serviceAccountName": "kt-node-cache",
            "containers": [{"name": "node-cache", "image": "kt",
                            "ports": [{"name": "node-cache", "containerPort": info.port}]}],
        },
        "status": {
            "phase": "Running", "podIP": info.ip.to_string(),
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        },
    })
}

fn failed(what: &str) -> impl FnOnce(kt_kube::apiserver::ApiServerError) -> TargetError {
    let what = what.to_owned();
    move |e| TargetError::Failed(format!("{what}: {e}"))
}

impl NodeCluster {
    /// Starts the API server, creates the nodes, starts their agents and
    /// then the controller at `addrs`, and returns once all are ready and
    /// the agents' Pods say so.
    pub async fn start(
        spec: &NodesSpec,
        env: &NodeEnv,
        addrs: &NodeAddrs,
        http: reqwest::Client,
    ) -> Result<NodeCluster, TargetError> {
        if addrs.agents.len() != spec.count {
            return Err(TargetError::Failed(format!(
                "{} node addresses for {} nodes",
                addrs.agents.len(),
                spec.count
            )));
        }
        // HTTPS and a bearer token, as a cluster's API: the controller
        // gets both through its kubeconfig.
        let api = ApiServer::start(ApiServerConfig {
            tls: true,
            token: Some(format!("kube-{}", uuid::Uuid::new_v4().simple())),
            ..ApiServerConfig::default()
        })
        .await
        .map_err(failed("the testbed's API server"))?;
        api.register(Resource::namespaced(&ApiResource::erase::<Dataset>(&())).with_status());
        let kubeconfig = env.work_dir.join("kubeconfig");
        api.kubeconfig(&kubeconfig)
            .map_err(failed("the testbed's kubeconfig"))?;
        let logs = env.work_dir.join("logs");
        let mut servers = Servers::default();
        let mut nodes = BTreeMap::new();
        for (i, node) in spec.names().into_iter().enumerate() {
            api.put(&node_object(&node, &spec.labels))
                .map_err(failed("creating a Node"))?;
            let (ip, port, prefix) = addrs.agents[i].clone();
            let root = env.work_dir.join("nodes").join(&node);
            let pod_dir = env.work_dir.join("node-pods").join(&node);
            std::fs::create_dir_all(pod_dir.join("shm"))
                .map_err(TargetError::io(format!("creating {}", pod_dir.display())))?;
            std::fs::create_dir_all(&root)
                .map_err(TargetError::io(format!("creating {}", root.display())))?;
            let url = format!("http://{ip}:{port}");
            let mut argv = prefix;
            argv.extend([
                binary(&env.bin_dir, "kt-agent")?,
                "--listen".into(),
                format!("{ip}:{port}"),
                "--advertise-url".into(),
                url.clone(),
                "--id".into(),
                pod_name(&node),
                "--metadata-url".into(),
                env.metadata_url.clone(),
                "--socket".into(),
                pod_dir.join("agent.sock").display().to_string(),
                "--shm-dir".into(),
                pod_dir.join("shm").display().to_string(),
            ]);
            let mut agent_env = env.env.clone();
            agent_env.extend([
                (kt_types::env::NODE_CACHE.to_owned(), "1".to_owned()),
                (kt_types::env::NODE_NAME.to_owned(), node.clone()),
                (
                    kt_types::env::DATASET_ROOT.to_owned(),
                    root.display().to_string(),
                ),
                (
                    kt_types::env::DATASET_BUDGET.to_owned(),
                    spec.budget.map_or(DEFAULT_BUDGET, |b| b.0).to_string(),
                ),
                (kt_types::env::POD_NAME.to_owned(), pod_name(&node)),
                (kt_types::env::POD_IP.to_owned(), ip.to_string()),
            ]);
            let name = format!("agent-{}", pod_name(&node));
            servers.set(
                &Component::Pod(pod_name(&node)),
                Server::new(&name, argv, agent_env, logs.join(format!("{name}.log"))),
                url,
            );
            nodes.insert(node, NodeInfo { ip, port, root });
        }
        let (cip, cport) = addrs.controller;
        let staging = env.work_dir.join("controller").join("staging");
        std::fs::create_dir_all(&staging)
            .map_err(TargetError::io(format!("creating {}", staging.display())))?;
        let argv = vec![
            binary(&env.bin_dir, "kt-dataset-controller")?,
            "--listen".into(),
            format!("{cip}:{cport}"),
            "--metadata-url".into(),
            env.metadata_url.clone(),
            "--namespace".into(),
            SYSTEM_NAMESPACE.into(),
            // A scenario's Datasets may name any namespace (one trusted
            // testbed); a real install obeys its own namespace only.
            "--dataset-namespaces".into(),
            "*".into(),
            "--node-cache-timeout".into(),
            "2s".into(),
            // Each agent listens on a free port of its own, which its Pod names.
            "--node-cache-port-from-pod".into(),
            "--staging-dir".into(),
            staging.display().to_string(),
        ];
        let mut cenv = env.env.clone();
        cenv.push(("KUBECONFIG".to_owned(), kubeconfig.display().to_string()));
        servers.set(
            &Component::Pod(CONTROLLER.to_owned()),
            Server::new(
                CONTROLLER,
                argv,
                cenv,
                logs.join(format!("{CONTROLLER}.log")),
            ),
            format!("http://{cip}:{cport}"),
        );
        let cluster = NodeCluster {
            api,
            nodes,
            servers,
            http,
        };
        // Agents first (their Pods say Ready once they are), then the
        // controller, which finds them at its first reconcile.
        let c = &cluster;
        let agents = c.nodes.keys().map(|n| async move {
            c.servers
                .start(&c.http, &Component::Pod(pod_name(n)))
                .await?;
            c.mark(n, true)
        });
        let started: Result<(), TargetError> = futures::future::join_all(agents)
            .await
            .into_iter()
            .collect();
        started?;
        cluster
            .servers
            .start(&cluster.http, &Component::Pod(CONTROLLER.to_owned()))
            .await?;
        Ok(cluster)
    }

    /// Writes the Pod of `node`'s agent (Ready or not).
    fn mark(&self, node: &str, ready: bool) -> Result<(), TargetError> {
        let info = self
            .nodes
            .get(node)
            .ok_or_else(|| TargetError::Failed(format!("no node named {node}")))?;
        self.api
            .put(&pod_object(node, info, ready))
            .map_err(failed("writing a node-cache Pod"))?;
        Ok(())
    }

    /// Creates or replaces an object in the testbed's API server (what a
    /// scenario's install would hold beside the nodes, e.g. a Secret).
    pub fn put(&self, object: &Value) -> Result<(), TargetError> {
        self.api
            .put(object)
            .map(|_| ())
            .map_err(failed("writing an object into the testbed's API"))
    }

    /// A kube client of the testbed's API server.
    pub fn client(&self) -> Option<kt_kube::kube::Client> {
        self.api.client().ok()
    }

    /// Where `node`'s agent keeps datasets.
    pub fn root(&self, node: &str) -> Option<PathBuf> {
        self.nodes.get(node).map(|n| n.root.clone())
    }

    /// The base URL of a node agent (`node-cache-node-3`) or the
    /// controller.
    pub async fn url(&self, c: &Component) -> Option<String> {
        self.servers.url(c).await
    }

    /// Node lost: its Pod is no longer Ready, the Node's Ready condition
    /// turns Unknown (as the node controller marks a node whose kubelet
    /// stopped reporting) and its agent is killed.
    pub async fn kill_node(&self, node: &str) -> Result<(), TargetError> {
        if !self.nodes.contains_key(node) {
            return Err(TargetError::Failed(format!("no node named {node}")));
        }
        // Marked first, then killed (a real node's order is the other
        // way round, with the node controller's grace between): the
        // controller then always learns of the loss from the API, never
        // from a refused connection first, and the status says the same
        // on every run.
        self.mark(node, false)?;
        self.api
            .modify("v1", "Node", None, node, |n| {
                n["status"]["conditions"] = json!([{
                    "type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                    "message": "Kubelet stopped posting node status.",
                }]);
            })
            .map_err(failed("marking a Node NotReady"))?;
        self.servers
            .kill(&Component::Pod(pod_name(node)), Signal::KILL)
            .await
    }

    /// Stops the controller and the agents.
    pub async fn stop(&self) -> Result<(), TargetError> {
        self.servers.stop_all().await
    }

    /// Copies the controller's and agents' logs into `dir`.
    pub async fn copy_logs(&self, dir: &Path) -> Result<(), TargetError> {
        self.servers.copy_logs(dir).await
    }
}

/// What a process target runs beside its pods for a topology's `nodes`
/// and `s3`: one place for the local and netns targets, which differ only
/// in where the node agents listen.
#[derive(Debug, Default)]
pub struct Beside {
    nodes: Option<NodeCluster>,
    s3: Option<super::s3::S3Server>,
}

impl Beside {
    /// Starts the plan's S3 server and nodes (the agents where `addrs`
    /// says, called only when the plan has nodes) and gives the nodes' API
    /// the S3 server's credentials Secret.
    pub async fn start(
        plan: &super::Plan,
        env: &NodeEnv,
        addrs: impl FnOnce(&NodesSpec) -> Result<NodeAddrs, TargetError>,
        http: reqwest::Client,
    ) -> Result<Beside, TargetError> {
        let mut beside = Beside::default();
        if let Some(spec) = &plan.s3 {
            beside.s3 = Some(super::s3::S3Server::start(spec).await?);
        }
        if let Some(spec) = &plan.nodes {
            let addrs = addrs(spec)?;
            beside.nodes = Some(NodeCluster::start(spec, env, &addrs, http).await?);
        }
        if let (Some(_), Some(nodes)) = (&beside.s3, &beside.nodes) {
            // For a Dataset's credentialsSecret.
            nodes.put(&crate::s3::credentials_secret())?;
        }
        Ok(beside)
    }

    /// [`super::Target::s3_endpoint`].
    pub fn s3_endpoint(&self) -> Option<String> {
        self.s3.as_ref().map(|s| s.endpoint())
    }

    /// [`super::Target::kube`].
    pub fn kube(&self) -> Option<kt_kube::kube::Client> {
        self.nodes.as_ref().and_then(NodeCluster::client)
    }

    /// [`super::Target::node_root`].
    pub fn node_root(&self, node: &str) -> Option<PathBuf> {
        self.nodes.as_ref().and_then(|n| n.root(node))
    }

    /// [`super::Target::kill_node`].
    pub async fn kill_node(&self, node: &str) -> Result<(), TargetError> {
        match &self.nodes {
            Some(n) => n.kill_node(node).await,
            None => Err(TargetError::Unavailable(
                "this scenario has no Kubernetes nodes (topology `nodes`)".to_owned(),
            )),
        }
    }

    /// The nodes' logs into `dir`.
    pub async fn copy_logs(&self, dir: &Path) -> Result<(), TargetError> {
        match &self.nodes {
            Some(n) => n.copy_logs(dir).await,
            None => Ok(()),
        }
    }

    /// Stops the nodes; the S3 server goes with them (killed when
    /// dropped). Idempotent.
    pub async fn stop(&mut self) -> Result<(), TargetError> {
        self.s3 = None;
        match self.nodes.take() {
            Some(n) => n.stop().await,
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_say_what_the_controller_looks_for() {
        let info = NodeInfo {
            ip: Ipv4Addr::new(127, 0, 1, 9),
            port: 4242,
            root: PathBuf::from("/r"),
        };
        let p = pod_object("node-2", &info, true);
        assert_eq!(
            p["metadata"]["labels"][NODE_CACHE_COMPONENT.0],
            "node-cache"
        );
        assert_eq!(p["spec"]["nodeName"], "node-2");
        // The controller takes only the node-cache DaemonSet's pods.
        assert_eq!(p["metadata"]["ownerReferences"][0]["kind"], "DaemonSet");
        assert_eq!(p["metadata"]["ownerReferences"][0]["name"], "kt-node-cache");
        assert_eq!(p["spec"]["serviceAccountName"], "kt-node-cache");
        assert_eq!(
            p["spec"]["containers"][0]["ports"][0]["containerPort"],
            4242
        );
        assert_eq!(p["status"]["podIP"], "127.0.1.9");
        assert_eq!(p["status"]["conditions"][0]["status"], "True");
        let n = node_object("node-2", &BTreeMap::new());
        assert_eq!(n["metadata"]["labels"]["kubernetes.io/hostname"], "node-2");
    }
}
