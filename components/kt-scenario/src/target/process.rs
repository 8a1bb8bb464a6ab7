//! What the process targets (`local`, `netns`) share: the metadata server,
//! the store and every pod's node agent are processes on this machine, a
//! pod is a directory and the process groups of the commands it runs, and
//! the topology's nodes and S3 server run beside them ([`Beside`]). They
//! differ only in where things go ([`Place`]): loopback addresses of their
//! own (`local`), or network namespaces on a bridge (`netns`).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use tokio::process::Command;

use super::local::{
    Programs, Servers, agent_argv, agent_env, in_pod, make_pod_dirs, pod_command, server_argvs,
};
use super::nodes::{Beside, NodeAddrs, NodeEnv};
use super::procs::{PodProcs, Server};
use super::roles::Roles;
use super::{Component, ExecOutput, ExecRequest, Plan, PodProcess, Target, TargetError};
use crate::datasets::NodesSpec;
use crate::format::Signal;

/// Where one server listens: its address and port, and what its command
/// line starts with (netns: `ip netns exec NS`; local: nothing).
#[derive(Debug, Clone)]
pub struct At {
    pub ip: Ipv4Addr,
    pub port: u16,
    pub prefix: Vec<String>,
}

impl At {
    /// `ip:port`, what the server listens on.
    fn listen(&self) -> String {
        format!("{}:{}", self.ip, self.port)
    }

    /// Its URL as the runner and the pods reach it.
    fn url(&self) -> String {
        format!("http://{}", self.listen())
    }

    /// `argv` run there.
    fn argv(&self, argv: Vec<String>) -> Vec<String> {
        self.prefix.iter().cloned().chain(argv).collect()
    }
}

/// Where [`Place::place`] puts the components of a plan.
#[derive(Debug)]
pub struct Placed {
    pub metadata: At,
    pub store: At,
    /// Each pod's agent (and its commands, at the same address and
    /// prefix), in the plan's order.
    pub pods: Vec<At>,
}

/// What a process target does its own way: where its components go.
#[async_trait]
pub trait Place: std::fmt::Debug + Default + Send + Sync + 'static {
    /// The target's name ([`Target::name`]).
    const NAME: &'static str;

    /// The runner's client of the servers (never via a proxy).
    fn http() -> reqwest::Client;

    /// Why the target cannot run on this machine ([`Target::unavailable`]).
    fn unavailable(&self) -> Option<String>;

    /// Where the servers and pods of `plan` go, creating what that takes
    /// (netns: the network). Called once per `up`, before any process
    /// starts; what it creates [`Place::remove`] removes.
    async fn place(&mut self, plan: &Plan) -> Result<Placed, TargetError>;

    /// Where the topology's node agents and the Dataset controller go
    /// (after [`Place::place`]; `pods`: how many pods the plan has).
    fn node_addrs(&self, spec: &NodesSpec, pods: usize) -> Result<NodeAddrs, TargetError>;

    /// [`Target::cuts_links`].
    fn cuts_links(&self) -> bool {
        false
    }

    /// [`Target::set_link`]; `pods` maps a pod's name to where it is.
    async fn set_link(
        &self,
        c: &Component,
        pods: &HashMap<String, At>,
        up: bool,
    ) -> Result<(), TargetError> {
        let _ = (pods, up);
        Err(TargetError::Unavailable(format!(
            "the {} target cannot cut the link of {c}",
            Self::NAME
        )))
    }

    /// Removes what [`Place::place`] created, once every process is gone.
    /// Idempotent.
    async fn remove(&mut self) -> Result<(), TargetError> {
        Ok(())
    }
}

/// A process target: `local` is `Processes<Loopback>`, `netns`
/// `Processes<Namespaces>`.
#[derive(Debug, Default)]
pub struct Processes<P> {
    http: reqwest::Client,
    work: PathBuf,
    programs: Programs,
    metadata_url: String,
    store_url: String,
    /// Pod name → its agent's URL.
    agent_urls: HashMap<String, String>,
    servers: Servers,
    /// Pod name → where its agent and commands run.
    pods: HashMap<String, At>,
    procs: PodProcs,
    /// The run's per-component tokens (set by `up`).
    roles: Option<Roles>,
    /// The topology's Kubernetes nodes (the node agents where
    /// [`Place::node_addrs`] says, the controller and the API server beside
    /// the runner) and S3 server (beside the runner, on loopback), if any.
    beside: Beside,
    place: P,
}

impl<P: Place> Processes<P> {
    pub fn new() -> Processes<P> {
        Processes {
            http: P::http(),
            ..Processes::default()
        }
    }

    async fn bring_up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        self.work = plan.work_dir.clone();
        self.programs = Programs::of(plan)?;
        make_pod_dirs(plan)?;
        let placed = self.place.place(plan).await?;
        self.metadata_url = placed.metadata.url();
        self.store_url = placed.store.url();
        let (margv, sargv) = server_argvs(
            plan,
            &placed.metadata.listen(),
            &self.metadata_url,
            &placed.store.listen(),
            &self.store_url,
        )?;
        // Every component with its own role (see `roles`).
        let roles = Roles::write(plan)?;
        let logs = plan.work_dir.join("logs");
        self.servers.set(
            &Component::Metadata,
            Server::new(
                "metadata",
                placed.metadata.argv(margv),
                roles.metadata_env(),
                logs.join("metadata.log"),
            ),
            self.metadata_url.clone(),
        );
        self.servers.set(
            &Component::Store,
            Server::new(
                "store",
                placed.store.argv(sargv),
                roles.store_env(),
                logs.join("store.log"),
            ),
            self.store_url.clone(),
        );
        // Every pod's node agent, where the pod is.
        for (p, at) in plan.pods.iter().zip(placed.pods) {
            let url = at.url();
            let argv = agent_argv(plan, p, &at.listen(), &url, &self.metadata_url)?;
            self.agent_urls.insert(p.name.clone(), url.clone());
            self.servers.set(
                &Component::Pod(p.name.clone()),
                Server::new(
                    &format!("agent-{}", p.name),
                    at.argv(argv),
                    agent_env(plan, p, &roles),
                    logs.join(format!("agent-{}.log", p.name)),
                ),
                url,
            );
            self.pods.insert(p.name.clone(), at);
        }
        self.servers.start(&self.http, &Component::Metadata).await?;
        self.servers.start(&self.http, &Component::Store).await?;
        self.servers.start_pods(&self.http).await?;
        // Node agents and the controller after the pods' addresses.
        let env = NodeEnv {
            bin_dir: plan.bin_dir.clone(),
            work_dir: plan.work_dir.clone(),
            metadata_url: self.metadata_url.clone(),
            env: roles.metadata_env(),
        };
        let (place, pods) = (&self.place, plan.pods.len());
        let addrs = |spec: &NodesSpec| place.node_addrs(spec, pods);
        self.beside = Beside::start(plan, &env, addrs, self.http.clone()).await?;
        self.roles = Some(roles);
        Ok(())
    }

    /// The command of an exec request, in its pod.
    fn command(&self, req: &ExecRequest) -> Result<Command, TargetError> {
        let at = (self.pods.get(&req.pod))
            .ok_or_else(|| TargetError::Failed(format!("no pod named {}", req.pod)))?;
        let argv = at.argv(self.programs.argv(req)?);
        let req = in_pod(self.roles.as_ref(), req);
        Ok(pod_command(
            &argv,
            &self.pod_dir(&req.pod),
            &req,
            &self.metadata_url,
            &at.ip.to_string(),
        ))
    }
}

#[async_trait]
impl<P: Place> Target for Processes<P> {
    fn name(&self) -> &'static str {
        P::NAME
    }

    fn unavailable(&self) -> Option<String> {
        self.place.unavailable()
    }

    fn runs_python(&self) -> bool {
        true
    }

    /// What a failed start left (processes, the netns network) is removed
    /// at once.
    async fn up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        let result = self.bring_up(plan).await;
        if result.is_err()
            && let Err(e) = self.down().await
        {
            tracing::warn!("cleaning up after a failed {} start: {e}", P::NAME);
        }
        result
    }

    fn metadata_url(&self) -> String {
        self.metadata_url.clone()
    }

    fn component_url(&self, c: &Component) -> Option<String> {
        match c {
            Component::Metadata => Some(self.metadata_url.clone()),
            Component::Store => Some(self.store_url.clone()),
            Component::Pod(p) => self.agent_urls.get(p).cloned(),
        }
    }

    fn pod_dir(&self, pod: &str) -> PathBuf {
        self.work.join("pods").join(pod)
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecOutput, TargetError> {
        let cmd = self.command(&req)?;
        self.procs.run(&req.pod, cmd).await
    }

    async fn spawn(&self, req: ExecRequest) -> Result<Box<dyn PodProcess>, TargetError> {
        let cmd = self.command(&req)?;
        Ok(Box::new(self.procs.spawn(&req.pod, cmd)?))
    }

    async fn pod_ip(&self, pod: &str) -> Result<String, TargetError> {
        self.pods
            .get(pod)
            .map(|at| at.ip.to_string())
            .ok_or_else(|| TargetError::Failed(format!("no pod named {pod}")))
    }

    async fn kill_agent(&self, pod: &str, signal: Signal) -> Result<(), TargetError> {
        self.servers
            .kill(&Component::Pod(pod.to_owned()), signal)
            .await
    }

    fn runs_nodes(&self) -> bool {
        true
    }

    fn runs_s3(&self) -> bool {
        true
    }

    fn beside(&self) -> Option<&Beside> {
        Some(&self.beside)
    }

    fn cuts_links(&self) -> bool {
        self.place.cuts_links()
    }

    async fn set_link(&self, c: &Component, up: bool) -> Result<(), TargetError> {
        self.place.set_link(c, &self.pods, up).await
    }

    fn freezes(&self) -> bool {
        true
    }

    async fn kill(&self, c: &Component, signal: Signal) -> Result<(), TargetError> {
        self.servers.kill_with_pods(&self.procs, c, signal).await
    }

    async fn start(&self, c: &Component) -> Result<(), TargetError> {
        self.servers.start(&self.http, c).await
    }

    async fn collect_logs(&self, dir: &Path) -> Result<(), TargetError> {
        self.beside.copy_logs(dir).await?;
        self.servers.copy_logs(dir).await
    }

    async fn down(&mut self) -> Result<(), TargetError> {
        self.procs.signal_all(Signal::KILL);
        // Servers first (a namespace lives on while a process is in it),
        // but what `place` created goes even when stopping them failed.
        let beside = self.beside.stop().await;
        let stopped = self.servers.stop_all().await.and(beside);
        self.place.remove().await?;
        stopped
    }
}
