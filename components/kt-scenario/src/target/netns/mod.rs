//! The `netns` target: like `local`, but the metadata server, the store and
//! every pod each live in a Linux network namespace of their own, plugged
//! by a veth pair into one bridge per run, so traffic crosses real
//! interfaces and a pod's link (and the store's, with `store.link`) can be
//! shaped with `tc`. Needs root.
//!
//! Layout of a run with short id `<id>` (see [`short_id`]), all in
//! 198.18.0.0/15 (the benchmarking range, never routed on the internet):
//!
//! | what     | namespace            | host-side veth   | address         |
//! |----------|----------------------|------------------|-----------------|
//! | runner   | (the root namespace) | (bridge `ktb<id>`) | 198.18.0.1/15 |
//! | metadata | `kt-<id>-meta`       | `ktv<id>0`       | 198.18.0.2:8081 |
//! | store    | `kt-<id>-store`      | `ktv<id>1`       | 198.18.0.3:8082 |
//! | pod *i*  | `kt-<id>-pod-<name>` | `ktv<id><i+2>` (base 36) | [`pod_ip`] |
//!
//! Inside each namespace the veth end is `eth0`. Pod namespaces carry a
//! `pod-` infix so that pods named `meta` or `store` cannot collide with the
//! servers'.
//!
//! What a run creates is recorded in `/run/kt-scenario/<id>` (the owning
//! pid); [`sweep_stale`] removes the leftovers of runs whose owner died
//! without cleaning up, and [`Target::up`] calls it first.
//!
//! This module is the [`Target`]; `layout` has the network (names,
//! addresses, bridge, veths, `tc` shaping), `sweep` the state file and the
//! removal of a run, `exec` the `ip`/`tc`/`iptables` commands and the
//! commands run inside namespaces.
//!
//! # Tests that need root
//!
//! Three tests create network namespaces, a bridge and qdiscs, so they need
//! root. CI runs as root and must run them; anywhere else they must show as
//! skipped, never as a pass of a test that did not run. Neither libtest nor
//! nextest can skip a test once it runs (a test passes or fails), so the
//! decision is made when the test binary is built: build.rs sets the cfg
//! `kt_unprivileged_build` when the build does not run as root, and each
//! root-only test carries
//!
//! ```text
//! #[cfg_attr(kt_unprivileged_build, ignore = "skipping: needs root")]
//! ```
//!
//! so a non-root `cargo nextest run` counts it as skipped (`cargo test`
//! prints `ignored, skipping: needs root`), and a root build runs it.
//! build.rs runs again when the user changes (`USER`, `LOGNAME`,
//! `SUDO_UID`). A binary built by one user and run by another cannot pass
//! unrun either: built as root and run by another user, `testing::root`
//! fails the test; built by another user and run as root, the test
//! `a_build_that_skips_root_tests_does_not_run_as_root` (only in such a
//! build) fails. `--run-ignored all` runs them anyway, and `testing::root`
//! then fails them when not root.
//!
//! The fallback (fail when not root unless `KT_SKIP_ROOT_TESTS=1`, and then
//! pass) was not needed, and would report a pass for an unrun test.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use tokio::process::Command;

use super::local::{
    Programs, Servers, agent_argv, agent_env, in_pod, make_pod_dirs, pod_command, server_argvs,
};
use super::nodes::{Beside, NodeAddrs, NodeEnv, pod_name};
use super::procs::{PodProcs, Server, free_port};
use super::roles::Roles;
use super::{Component, ExecOutput, ExecRequest, Plan, PodProcess, Target, TargetError};
use crate::datasets::NodesSpec;
use crate::format::Signal;

mod exec;
mod layout;
mod sweep;
#[cfg(test)]
mod testing;

use exec::{Cmd, blocking, in_netns, on_path};
use layout::{AGENT_PORT, METADATA_PORT, STORE_PORT};
pub use layout::{BRIDGE_IP, MAX_PODS, METADATA_IP, Network, Node, STORE_IP, pod_ip, short_id};
use sweep::remove_run;
pub use sweep::sweep_stale;

const NEED_ROOT: &str = "the netns target needs root (it creates network namespaces, a bridge \
                         and tc qdiscs); run as root or use --target local";

#[derive(Debug)]
pub struct Netns {
    http: reqwest::Client,
    work: PathBuf,
    programs: Programs,
    metadata_url: String,
    store_url: String,
    servers: Servers,
    /// Pod name → its agent's URL.
    agent_urls: HashMap<String, String>,
    net: Option<Network>,
    /// Pod name → its namespace and address.
    pods: HashMap<String, (String, Ipv4Addr)>,
    procs: PodProcs,
    /// The run's per-component tokens (set by `up`).
    roles: Option<Roles>,
    /// The topology's Kubernetes nodes (each node agent in a namespace of
    /// its own, the controller and the API server beside the runner) and
    /// S3 server (beside the runner, on loopback), if any.
    beside: Beside,
}

impl Default for Netns {
    fn default() -> Netns {
        Netns {
            // The servers are on a private subnet: never through a proxy.
            http: kt_api::client_builder().build().unwrap_or_default(),
            work: PathBuf::new(),
            programs: Programs::default(),
            metadata_url: String::new(),
            store_url: String::new(),
            servers: Default::default(),
            agent_urls: HashMap::new(),
            net: None,
            pods: HashMap::new(),
            procs: PodProcs::default(),
            roles: None,
            beside: Beside::default(),
        }
    }
}

impl Netns {
    pub fn new() -> Netns {
        Netns::default()
    }

    async fn bring_up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        self.work = plan.work_dir.clone();
        self.programs = Programs::of(plan)?;
        self.metadata_url = format!("http://{METADATA_IP}:{METADATA_PORT}");
        self.store_url = format!("http://{STORE_IP}:{STORE_PORT}");
        let (margv, sargv) = server_argvs(
            plan,
            &format!("{METADATA_IP}:{METADATA_PORT}"),
            &self.metadata_url,
            &format!("{STORE_IP}:{STORE_PORT}"),
            &self.store_url,
        )?;
        make_pod_dirs(plan)?;
        let id = short_id(&plan.run_id, &plan.scenario);
        tracing::info!(
            "netns testbed {id}: run {}, scenario {}",
            plan.run_id,
            plan.scenario
        );
        let mut pods: Vec<_> = plan
            .pods
            .iter()
            .map(|p| (p.name.clone(), p.link_bps))
            .collect();
        // The nodes' agents after the pods, each in a namespace of its own.
        let node_names = plan.nodes.as_ref().map(|n| n.names()).unwrap_or_default();
        pods.extend(node_names.iter().map(|n| (pod_name(n), None)));
        let store_link = plan.store_link_bps;
        let net = blocking(move || {
            for line in sweep_stale() {
                tracing::warn!("{line}");
            }
            Network::create(&id, store_link, &pods)
        })
        .await?;
        self.pods = (plan.pods.iter().zip(net.pods()))
            .map(|(p, n)| (p.name.clone(), (n.netns.clone(), n.ip)))
            .collect();
        // Every component with its own role (see `roles`).
        let roles = Roles::write(plan)?;
        let logs = plan.work_dir.join("logs");
        self.servers.set(
            &Component::Metadata,
            Server::new(
                "metadata",
                in_netns(&net.metadata().netns, margv),
                roles.metadata_env(),
                logs.join("metadata.log"),
            ),
            self.metadata_url.clone(),
        );
        self.servers.set(
            &Component::Store,
            Server::new(
                "store",
                in_netns(&net.store().netns, sargv),
                roles.store_env(),
                logs.join("store.log"),
            ),
            self.store_url.clone(),
        );
        // Every pod's node agent, in the pod's namespace on its address.
        for (p, n) in plan.pods.iter().zip(net.pods()) {
            let url = format!("http://{}:{AGENT_PORT}", n.ip);
            let argv = agent_argv(
                plan,
                p,
                &format!("{}:{AGENT_PORT}", n.ip),
                &url,
                &self.metadata_url,
            )?;
            self.agent_urls.insert(p.name.clone(), url.clone());
            self.servers.set(
                &Component::Pod(p.name.clone()),
                Server::new(
                    &format!("agent-{}", p.name),
                    in_netns(&n.netns, argv),
                    agent_env(plan, p, &roles),
                    logs.join(format!("agent-{}.log", p.name)),
                ),
                url,
            );
        }
        let node_addrs: Vec<_> = (net.pods()[plan.pods.len()..].iter())
            .map(|n| (n.ip, AGENT_PORT, in_netns(&n.netns, Vec::new())))
            .collect();
        self.net = Some(net);
        self.servers.start(&self.http, &Component::Metadata).await?;
        self.servers.start(&self.http, &Component::Store).await?;
        self.servers.start_pods(&self.http).await?;
        let env = NodeEnv {
            bin_dir: plan.bin_dir.clone(),
            work_dir: plan.work_dir.clone(),
            metadata_url: self.metadata_url.clone(),
            env: roles.metadata_env(),
        };
        let addrs = |_: &NodesSpec| {
            let local = std::net::Ipv4Addr::LOCALHOST;
            Ok(NodeAddrs {
                agents: node_addrs,
                controller: (local, free_port(std::net::IpAddr::V4(local))?),
            })
        };
        self.beside = Beside::start(plan, &env, addrs, self.http.clone()).await?;
        self.roles = Some(roles);
        Ok(())
    }
}

impl Netns {
    /// The command of an exec request, in its pod's namespace.
    fn command(&self, req: &ExecRequest) -> Result<Command, TargetError> {
        let (ns, ip) = (self.pods.get(&req.pod))
            .ok_or_else(|| TargetError::Failed(format!("no pod named {}", req.pod)))?;
        let argv = in_netns(ns, self.programs.argv(req)?);
        let req = in_pod(self.roles.as_ref(), req);
        Ok(pod_command(
            &argv,
            &self.pod_dir(&req.pod),
            &req,
            &self.metadata_url,
            &ip.to_string(),
        ))
    }
}

#[async_trait]
impl Target for Netns {
    fn name(&self) -> &'static str {
        "netns"
    }

    fn unavailable(&self) -> Option<String> {
        if !rustix::process::geteuid().is_root() {
            return Some(NEED_ROOT.to_owned());
        }
        let needs = [
            ("ip", "iproute2"),
            ("tc", "iproute2"),
            ("nsenter", "util-linux"),
        ];
        let missing: Vec<String> = (needs.into_iter())
            .filter(|(prog, _)| !on_path(prog))
            .map(|(prog, package)| format!("`{prog}` ({package})"))
            .collect();
        (!missing.is_empty()).then(|| {
            format!(
                "the netns target needs {}, not found on PATH; install it or use --target local",
                missing.join(" and ")
            )
        })
    }

    fn runs_python(&self) -> bool {
        true
    }

    async fn up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        let result = self.bring_up(plan).await;
        if result.is_err()
            && let Err(e) = self.down().await
        {
            tracing::warn!("cleaning up after a failed netns start: {e}");
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
            .map(|(_, ip)| ip.to_string())
            .ok_or_else(|| TargetError::Failed(format!("no pod named {pod}")))
    }

    async fn kill_agent(&self, pod: &str, signal: Signal) -> Result<(), TargetError> {
        self.servers
            .kill(&Component::Pod(pod.to_owned()), signal)
            .await
    }

    fn freezes(&self) -> bool {
        true
    }

    async fn kill(&self, c: &Component, signal: Signal) -> Result<(), TargetError> {
        self.servers.kill_with_pods(&self.procs, c, signal).await
    }

    fn cuts_links(&self) -> bool {
        true
    }

    /// The host side of the node's veth goes down: the bridge no longer
    /// forwards to or from it, and its `eth0` loses carrier (its routes
    /// stay, so its sockets retry rather than fail). Up again, it is a
    /// bridge port as before, with its shaping.
    async fn set_link(&self, c: &Component, up: bool) -> Result<(), TargetError> {
        let net = self
            .net
            .as_ref()
            .ok_or_else(|| TargetError::Failed("the netns network is not up".into()))?;
        let node = match c {
            Component::Metadata => net.metadata(),
            Component::Store => net.store(),
            Component::Pod(p) => {
                let ns = &self
                    .pods
                    .get(p)
                    .ok_or_else(|| TargetError::Failed(format!("no pod named {p}")))?
                    .0;
                net.pods()
                    .iter()
                    .find(|n| n.netns == *ns)
                    .ok_or_else(|| TargetError::Failed(format!("no namespace for pod {p}")))?
            }
        };
        let veth = node.veth.clone();
        let state = if up { "up" } else { "down" };
        blocking(move || {
            Cmd::new(&["ip", "link", "set", &veth, state])
                .run()
                .map(drop)
        })
        .await
    }

    async fn start(&self, c: &Component) -> Result<(), TargetError> {
        self.servers.start(&self.http, c).await
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

    async fn collect_logs(&self, dir: &Path) -> Result<(), TargetError> {
        self.beside.copy_logs(dir).await?;
        self.servers.copy_logs(dir).await
    }

    async fn down(&mut self) -> Result<(), TargetError> {
        self.procs.signal_all(Signal::KILL);
        // Servers first (a namespace lives on while a process is in it), but
        // the network goes even when stopping them failed.
        let beside = self.beside.stop().await;
        let stopped = self.servers.stop_all().await.and(beside);
        if let Some(id) = self.net.as_ref().map(|n| n.id().to_owned()) {
            blocking(move || remove_run(&id)).await?;
            self.net = None;
        }
        stopped
    }
}
