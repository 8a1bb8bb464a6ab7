//! Testbed targets: where the components and pods of a scenario run.
//!
//! The runner only talks to [`Target`]; a new target (docker, kind, k3d)
//! implements it and nothing in the runner changes. A target owns every
//! process, namespace or container it creates and removes them in
//! [`Target::down`], which must be idempotent and must also run after a
//! failure or Ctrl-C.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;

pub mod bundle;
pub mod cluster;
pub mod docker;
pub mod host;
pub mod k3d;
pub mod kind;
pub mod local;
pub mod netns;
pub mod nodes;
pub mod process;
pub mod procs;
pub mod roles;
pub mod s3;
pub mod wrapped;

/// What to bring up for one scenario.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Unique per run; targets put it into every name they create.
    pub run_id: String,
    pub scenario: String,
    /// The scenario's own directory on the runner's host: targets keep logs,
    /// state and pod directories below it.
    pub work_dir: PathBuf,
    /// Where `kt`, `kt-metadata` and `kt-store` are.
    pub bin_dir: PathBuf,
    pub token: String,
    pub chunk_size: Option<u64>,
    /// The store's link rate in bits per second (netns shapes it like a
    /// pod's; others ignore it). None: unshaped.
    pub store_link_bps: Option<u64>,
    /// Extra flags of the metadata server (timing knobs).
    pub metadata_flags: Vec<String>,
    pub pods: Vec<PodPlan>,
    /// The Python interpreter with the `kt` package (`make python`) that
    /// `python` steps run, on targets that run the host's programs in their
    /// pods. None: there is none.
    pub python: Option<PathBuf>,
    /// The topology's Kubernetes nodes (an API server, node-cache agents,
    /// the Dataset controller: `target::nodes`); None: none.
    pub nodes: Option<crate::datasets::NodesSpec>,
    /// The topology's S3 server (`target::s3`); None: none.
    pub s3: Option<crate::s3::S3Spec>,
}

/// One pod instance.
#[derive(Debug, Clone)]
pub struct PodPlan {
    /// Instance name (`getter-3`, or the group name for a single replica).
    pub name: String,
    /// The group (`getter`).
    pub group: String,
    pub index: usize,
    pub service: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub gpu: bool,
    /// Link rate in bits per second (netns shapes it; others ignore it).
    pub link_bps: Option<u64>,
    /// The node its agent reports (`KT_NODE_NAME`; process targets).
    pub node: Option<String>,
}

/// A part of the testbed that steps can kill, restart or wait for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Component {
    Metadata,
    Store,
    /// A pod instance.
    Pod(String),
}

impl std::fmt::Display for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Component::Metadata => f.write_str("metadata"),
            Component::Store => f.write_str("store"),
            Component::Pod(p) => write!(f, "pod {p}"),
        }
    }
}

/// Which program an exec runs inside the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    /// The `kt` CLI, with the testbed's metadata URL in its environment.
    Kt,
    /// `sh -c`, for checks a scenario wants to make inside a pod.
    Shell,
    /// The Python interpreter that has the `kt` package ([`Plan::python`]);
    /// only on targets whose pods can run it ([`Target::runs_python`]).
    Python,
}

/// A command to run inside a pod, with its working directory at the pod's
/// root ([`Target::pod_dir`]).
#[derive(Debug, Clone)]
pub struct ExecRequest {
    pub pod: String,
    pub program: Program,
    pub args: Vec<String>,
    /// Extra environment. The target sets `KT_METADATA_URL` and
    /// `KT_PROGRESS=never`; the token is `token`.
    pub env: Vec<(String, String)>,
    /// The bearer token the command gets in `KT_TOKEN` (None: no token).
    pub token: Option<String>,
}

/// How an exec ended.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    /// Exit code, or 128 + signal number when a signal ended it.
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
    /// Wall time of the command itself (spawn to exit).
    pub duration: Duration,
}

/// A command left running in a pod ([`Target::spawn`]), such as a
/// `kt tensor put --hold` whose registrations live as long as it does.
/// Dropping it kills it.
#[async_trait]
pub trait PodProcess: Send + Sync {
    /// The next line of its stdout; None once its stdout closed.
    async fn line(&mut self) -> Option<String>;
    /// Sends it a signal (its whole process group where the target has
    /// them). Nothing happens when it has already ended.
    async fn signal(&mut self, signal: crate::format::Signal) -> Result<(), TargetError>;
    /// Waits for its end: its status, all of its stdout and its stderr.
    async fn wait(&mut self) -> Result<ExecOutput, TargetError>;
}

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("{0}")]
    Unavailable(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Failed(String),
}

impl From<kt_sync::task::WorkerLost> for TargetError {
    fn from(e: kt_sync::task::WorkerLost) -> Self {
        TargetError::Failed(format!("the network setup task failed: {e}"))
    }
}

impl TargetError {
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> TargetError {
        let what = what.into();
        move |source| TargetError::Io { what, source }
    }
}

#[async_trait]
pub trait Target: Send + Sync {
    fn name(&self) -> &'static str;

    /// Why this target cannot run on this machine (checked before each
    /// scenario), e.g. "netns needs root".
    fn unavailable(&self) -> Option<String>;

    /// Starts the metadata server, the store and the pods, and returns once
    /// every server answers `/readyz`.
    async fn up(&mut self, plan: &Plan) -> Result<(), TargetError>;

    /// The token the runner acts with from `up` on, where the target
    /// issued one (a cluster's operator token, from `kubectl create token`:
    /// its install takes Kubernetes identities); None: the plan's. A pod
    /// command given it runs with the pod's own identity instead.
    fn operator_token(&self) -> Option<String> {
        None
    }

    /// Names this target gives what scenarios name otherwise, as
    /// (target's, scenario's) pairs the snapshots record the scenario's
    /// way: on a cluster's identities an agent is named after its pod
    /// (`getter-0-0`, the scenario's `getter-0`), and servers advertise
    /// their Service names (`kt-store:8082`, an address elsewhere).
    fn aliases(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// The metadata server's URL as the runner reaches it.
    fn metadata_url(&self) -> String;

    /// The base URL of a server component as the runner reaches it (for
    /// `/readyz` and `/metrics`); None for components without one.
    fn component_url(&self, c: &Component) -> Option<String>;

    /// The pod's root directory as the runner sees it: what getters wrote is
    /// verified there (a container target bind-mounts it into the pod).
    fn pod_dir(&self, pod: &str) -> PathBuf;

    /// The path under which `pod` sees `host`, a generated data set on the
    /// runner's host (below the plan's work dir). Targets that share the
    /// host's filesystem (local, netns) return it unchanged; a container
    /// target bind-mounts the work dir and maps the path.
    fn data_path(&self, pod: &str, host: &Path) -> Result<String, TargetError> {
        let _ = pod;
        Ok(host.display().to_string())
    }

    /// Copies generated data sets to the pods that use them: `uses` pairs a
    /// pod with a data set's host path (below the plan's work dir). Called
    /// once after `up`. Targets where pods see the host's files (local,
    /// netns, a bind mount) have nothing to do.
    async fn stage_data(&self, uses: &[(String, PathBuf)]) -> Result<(), TargetError> {
        let _ = uses;
        Ok(())
    }

    /// Brings `rel` (a path relative to the pod's root) from inside the pod
    /// into [`Target::pod_dir`], before the runner verifies it there.
    /// Targets where the runner sees the pod's files have nothing to do.
    async fn fetch(&self, pod: &str, rel: &Path) -> Result<(), TargetError> {
        let _ = (pod, rel);
        Ok(())
    }

    /// Runs a command inside a pod and waits for it.
    async fn exec(&self, req: ExecRequest) -> Result<ExecOutput, TargetError>;

    /// Starts a command inside a pod (as [`Target::exec`] would) and returns
    /// at once. `kill` of the pod reaches it too; `down` ends it.
    async fn spawn(&self, req: ExecRequest) -> Result<Box<dyn PodProcess>, TargetError> {
        Err(TargetError::Unavailable(format!(
            "commands left running in pod {} (`tensor_put` with `hold`) are not supported on the {} target yet",
            req.pod,
            self.name()
        )))
    }

    /// The pod's address as other pods see it (what a quorum's `ips` list).
    async fn pod_ip(&self, pod: &str) -> Result<String, TargetError> {
        Err(TargetError::Unavailable(format!(
            "the {} target cannot tell the address of pod {pod} yet",
            self.name()
        )))
    }

    /// Signals a pod's node agent alone and waits for it to exit; the pod's
    /// commands live on. `start` of the pod starts the agent again.
    async fn kill_agent(
        &self,
        pod: &str,
        signal: crate::format::Signal,
    ) -> Result<(), TargetError> {
        let _ = signal;
        Err(TargetError::Unavailable(format!(
            "the {} target cannot stop the agent of pod {pod} alone yet",
            self.name()
        )))
    }

    /// Whether a pod's agent killed alone ([`Target::kill_agent`]) stays
    /// down until [`Target::start`]. Not on a cluster, where the kubelet
    /// restarts a dead sidecar at once: scenarios that kill an agent and
    /// expect it gone are skipped there.
    fn keeps_killed_agents_down(&self) -> bool {
        true
    }

    /// Whether it runs the topology's Kubernetes `nodes` (an API server,
    /// node-cache agents, the Dataset controller: `target::nodes`).
    fn runs_nodes(&self) -> bool {
        false
    }

    /// Whether it runs the topology's `s3` (an S3 server: `target::s3`).
    fn runs_s3(&self) -> bool {
        false
    }

    /// The topology's nodes and S3 server as the process targets run them
    /// (`target::nodes::Beside`); the four methods below read them.
    fn beside(&self) -> Option<&nodes::Beside> {
        None
    }

    /// The testbed's S3 endpoint (`{{s3}}`), reachable from the runner and
    /// the Dataset controller; None: there is none.
    fn s3_endpoint(&self) -> Option<String> {
        self.beside().and_then(nodes::Beside::s3_endpoint)
    }

    /// A client of the testbed's Kubernetes API, on targets that run the
    /// topology's `nodes`; None: there is none.
    fn kube(&self) -> Option<kt_kube::kube::Client> {
        self.beside().and_then(nodes::Beside::kube)
    }

    /// Where the node-cache agent of `node` keeps datasets, as the runner
    /// sees it (topology `nodes`).
    fn node_root(&self, node: &str) -> Option<PathBuf> {
        self.beside().and_then(|b| b.node_root(node))
    }

    /// The path of this machine behind `path` as `node`'s node-cache agent
    /// names it (a Dataset's per-node path): the same path where the agents
    /// run on this machine's file system.
    fn node_path(&self, node: &str, path: &Path) -> PathBuf {
        let _ = node;
        path.to_owned()
    }

    /// The namespace of the steps' Datasets unless a step names one: the
    /// one the testbed's Dataset controller obeys (None:
    /// `datasets::DATASET_NAMESPACE`, the process targets' controller obeys
    /// every namespace).
    fn dataset_namespace(&self) -> Option<String> {
        None
    }

    /// Node lost: the node-cache agent of `node` dies and the API marks
    /// its Pod not Ready and the Node NotReady (topology `nodes`).
    async fn kill_node(&self, node: &str) -> Result<(), TargetError> {
        match self.beside() {
            Some(b) => b.kill_node(node).await,
            None => Err(TargetError::Unavailable(format!(
                "the {} target runs no Kubernetes nodes (topology `nodes`), so it cannot lose {node}",
                self.name()
            ))),
        }
    }

    /// Whether [`Target::set_link`] can cut links (netns: the host side of
    /// a node's veth).
    fn cuts_links(&self) -> bool {
        false
    }

    /// Cuts (`up` false) or restores the network link of a server or pod:
    /// while cut, its packets are dropped (open connections stall).
    async fn set_link(&self, c: &Component, up: bool) -> Result<(), TargetError> {
        let _ = up;
        Err(TargetError::Unavailable(format!(
            "the {} target cannot cut the link of {c}",
            self.name()
        )))
    }

    /// Whether `kill` with STOP and CONT can freeze and thaw its servers
    /// and pods (local and netns: process groups; docker: pause).
    fn freezes(&self) -> bool {
        false
    }

    /// Whether `python` steps can run in its pods: the pods run the host's
    /// programs (local, netns), so the host's interpreter with the `kt`
    /// package ([`Plan::python`]) is theirs too. Not where pods run the
    /// client image: it is distroless and has no Python.
    fn runs_python(&self) -> bool {
        false
    }

    /// Whether a component is ready, for components the runner cannot ask
    /// itself ([`Target::component_url`] is None: a cluster's pods).
    async fn ready(&self, c: &Component) -> Result<bool, TargetError> {
        Err(TargetError::Unavailable(format!(
            "the {} target cannot tell whether {c} is ready",
            self.name()
        )))
    }

    /// The text of a component's `/metrics`, for components the runner
    /// cannot reach itself ([`Target::component_url`] is None).
    async fn metrics(&self, c: &Component) -> Result<String, TargetError> {
        Err(TargetError::Unavailable(format!(
            "the {} target cannot read the metrics of {c}",
            self.name()
        )))
    }

    /// Sends a signal: to a server's process (and waits for it to exit), or
    /// to every process of a pod. Takes `&self` because it runs while other
    /// steps exec in pods: targets keep their servers behind a lock.
    async fn kill(&self, c: &Component, signal: crate::format::Signal) -> Result<(), TargetError>;

    /// Starts a stopped server again with the same state, address and port,
    /// and returns once it is ready.
    async fn start(&self, c: &Component) -> Result<(), TargetError>;

    /// Copies every component log into `dir`.
    async fn collect_logs(&self, dir: &Path) -> Result<(), TargetError>;

    /// Stops everything and removes what `up` created. Idempotent.
    async fn down(&mut self) -> Result<(), TargetError>;
}

/// Parses a link rate such as `100mbit`, `1gbit`, `500kbit` into bits/s.
pub fn parse_link(s: &str) -> Result<u64, String> {
    let s = s.trim().to_ascii_lowercase();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a link rate (e.g. 100mbit, 1gbit)"))?;
    let mult = match unit {
        "bit" => 1,
        "kbit" => 1_000,
        "mbit" => 1_000_000,
        "gbit" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown link rate unit `{other}` (bit, kbit, mbit, gbit)"
            ));
        }
    };
    match n.checked_mul(mult) {
        Some(0) | None => Err(format!("link rate `{s}` is out of range")),
        Some(v) => Ok(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_rates() {
        assert_eq!(parse_link("1gbit"), Ok(1_000_000_000));
        assert_eq!(parse_link("100Mbit"), Ok(100_000_000));
        assert!(parse_link("fast").is_err());
        assert!(parse_link("0mbit").is_err());
        assert!(parse_link("10mb").is_err());
    }
}
