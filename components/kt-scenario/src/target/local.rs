//! The `local` target: the metadata server and the store are real processes
//! on loopback; every pod is a directory, a loopback address of its own
//! (127.0.x.y) and the process groups of the commands it runs. Needs no
//! root, starts in milliseconds per pod. [`Processes`] is the target; this
//! module has where it puts things ([`Loopback`]) and what the process
//! targets share below it (servers, programs, pod commands).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use tokio::process::Command;

use super::nodes::NodeAddrs;
use super::process::{At, Place, Placed, Processes};
use super::procs::{PodProcs, Server, binary, free_port};
use super::roles::Roles;
use super::{Component, ExecRequest, Plan, PodPlan, Program, TargetError};
use crate::datasets::NodesSpec;
use crate::format::Signal;

/// How long a server gets to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a TERM gets before KILL.
const GRACE: Duration = Duration::from_secs(10);

const METADATA_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const STORE_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);

/// The loopback address of the `i`th pod: 127.0.1.2, 127.0.1.3, ...
pub fn pod_ip(i: usize) -> Ipv4Addr {
    let n = u32::try_from(i).unwrap_or(u32::MAX);
    Ipv4Addr::new(127, 0, 1 + (n / 250) as u8, 2 + (n % 250) as u8)
}

/// The long-running processes of a process-based testbed: the metadata
/// server, the store and every pod's node agent, each with the URL the
/// runner reaches it at. Each behind its own lock: kill and restart run while
/// pods exec, and restarting one never waits on another's start-up (the
/// store's readiness waits for the metadata server).
#[derive(Debug, Default)]
pub struct Servers {
    slots: HashMap<Component, Slot>,
}

type Slot = tokio::sync::Mutex<Option<(Server, String)>>;

impl Servers {
    /// Sets up (does not start) the server of `c`.
    pub fn set(&mut self, c: &Component, server: Server, url: String) {
        self.slots
            .insert(c.clone(), tokio::sync::Mutex::new(Some((server, url))));
    }

    fn slot(&self, c: &Component) -> Result<&Slot, TargetError> {
        self.slots
            .get(c)
            .ok_or_else(|| TargetError::Failed(format!("{c} has no server (is the testbed up?)")))
    }

    /// Signals one server and waits for it to exit.
    pub async fn kill(&self, c: &Component, signal: Signal) -> Result<(), TargetError> {
        match self.slot(c)?.lock().await.as_mut() {
            Some((s, _)) => s.stop(signal, GRACE).await,
            None => Ok(()),
        }
    }

    /// Kills a component; a pod dies whole: its commands and its agent.
    pub async fn kill_with_pods(
        &self,
        procs: &PodProcs,
        c: &Component,
        signal: Signal,
    ) -> Result<(), TargetError> {
        if let Component::Pod(p) = c {
            procs.signal(p, signal);
        }
        self.kill(c, signal).await
    }

    /// Starts one server again and waits until it is ready.
    pub async fn start(&self, http: &reqwest::Client, c: &Component) -> Result<(), TargetError> {
        match self.slot(c)?.lock().await.as_mut() {
            Some((server, url)) => {
                server.start()?;
                server
                    .wait_ready(http, &format!("{url}/readyz"), READY_TIMEOUT)
                    .await
            }
            None => Err(TargetError::Failed(format!("{c} is not set up"))),
        }
    }

    /// Starts every pod's agent at once and waits until all are ready.
    pub async fn start_pods(&self, http: &reqwest::Client) -> Result<(), TargetError> {
        let pods: Vec<&Component> = self
            .slots
            .keys()
            .filter(|c| matches!(c, Component::Pod(_)))
            .collect();
        let started =
            futures::future::join_all(pods.into_iter().map(|c| self.start(http, c))).await;
        started.into_iter().collect()
    }

    /// The URL of a server.
    pub async fn url(&self, c: &Component) -> Option<String> {
        let slot = self.slots.get(c)?;
        slot.lock().await.as_ref().map(|(_, u)| u.clone())
    }

    /// Stops everything: pods' agents, then the store (it talks to the
    /// metadata server while stopping), then the metadata server.
    pub async fn stop_all(&self) -> Result<(), TargetError> {
        let pods = self
            .slots
            .iter()
            .filter(|(c, _)| matches!(c, Component::Pod(_)))
            .map(|(_, slot)| async move {
                match slot.lock().await.as_mut() {
                    Some((s, _)) => s.stop(Signal::TERM, GRACE).await,
                    None => Ok(()),
                }
            });
        let stopped: Result<(), TargetError> =
            futures::future::join_all(pods).await.into_iter().collect();
        for c in [Component::Store, Component::Metadata] {
            if let Some(slot) = self.slots.get(&c)
                && let Some((s, _)) = slot.lock().await.as_mut()
            {
                s.stop(Signal::TERM, GRACE).await?;
            }
        }
        stopped
    }

    /// Copies every server's log into `dir`.
    pub async fn copy_logs(&self, dir: &Path) -> Result<(), TargetError> {
        let mut guards = Vec::new();
        for slot in self.slots.values() {
            guards.push(slot.lock().await);
        }
        copy_logs(guards.iter().filter_map(|g| g.as_ref()).map(|x| &x.0), dir)
    }
}

/// The command line of a pod's node agent (`kt-agent`): listening on the
/// pod's address, its control socket and state in the pod's directory.
pub fn agent_argv(
    plan: &Plan,
    pod: &PodPlan,
    listen: &str,
    url: &str,
    metadata_url: &str,
) -> Result<Vec<String>, TargetError> {
    let mut argv = vec![binary(&plan.bin_dir, "kt-agent")?];
    argv.extend(agent_args(plan, pod, listen, url, metadata_url));
    Ok(argv)
}

/// The arguments of a pod's node agent, without the program.
pub fn agent_args(
    plan: &Plan,
    pod: &PodPlan,
    listen: &str,
    url: &str,
    metadata_url: &str,
) -> Vec<String> {
    let dir = plan.work_dir.join("pods").join(&pod.name);
    let mut args = vec![
        "--listen".into(),
        listen.into(),
        "--advertise-url".into(),
        url.into(),
        "--id".into(),
        pod.name.clone(),
        "--metadata-url".into(),
        metadata_url.into(),
        "--socket".into(),
        agent_socket(&dir).display().to_string(),
        "--state-dir".into(),
        dir.join(".kt-agent").display().to_string(),
        "--shm-dir".into(),
        shm_dir(&dir).display().to_string(),
    ];
    if let Some(s) = &pod.service {
        args.extend(["--service".into(), s.clone()]);
    }
    args
}

/// The environment of a pod's node agent. A GPU pod's agent claims a host
/// of its own to NCCL (`NCCL_HOSTID`): NCCL refuses two ranks of one
/// communicator on one GPU of one host, and the pods of a process-based
/// testbed share the machine's GPUs. A pod placed on a node (topology
/// `node`) has its agent report it (`KT_NODE_NAME`).
pub fn agent_env(plan: &Plan, pod: &PodPlan, roles: &Roles) -> Vec<(String, String)> {
    let mut env = roles.agent_env(&pod.name);
    if let Some(node) = &pod.node {
        env.push((kt_types::env::NODE_NAME.to_owned(), node.clone()));
    }
    if pod.gpu {
        env.push((
            "NCCL_HOSTID".to_owned(),
            format!("kt-{}-{}", plan.run_id, pod.name),
        ));
    }
    env
}

/// The shared-memory directory of a pod's host-backend tensors: its `kt`
/// commands create them there and its agent maps them from there (the
/// agent maps nothing outside it). One per pod, below the run's work dir,
/// so runs and pods never see each other's files and nothing outlives the
/// run.
pub fn shm_dir(pod_dir: &Path) -> PathBuf {
    pod_dir.join("shm")
}

/// Where a pod's agent listens for its `kt` commands.
pub fn agent_socket(pod_dir: &Path) -> PathBuf {
    pod_dir.join("agent.sock")
}

/// Where the local target's components go: loopback addresses of their
/// own (the servers', and one a pod: [`pod_ip`]), on free ports.
#[derive(Debug, Default)]
pub struct Loopback;

/// The `local` target.
pub type Local = Processes<Loopback>;

#[async_trait]
impl Place for Loopback {
    const NAME: &'static str = "local";

    fn http() -> reqwest::Client {
        // Bounded requests: a server that accepts but never answers must
        // not hang a readiness wait past its deadline. Never via a proxy.
        kt_api::client_builder()
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap_or_default()
    }

    fn unavailable(&self) -> Option<String> {
        None
    }

    async fn place(&mut self, plan: &Plan) -> Result<Placed, TargetError> {
        let at = |ip: Ipv4Addr| {
            Ok(At {
                ip,
                port: free_port(IpAddr::V4(ip))?,
                prefix: Vec::new(),
            })
        };
        Ok(Placed {
            metadata: at(METADATA_IP)?,
            store: at(STORE_IP)?,
            pods: (0..plan.pods.len())
                .map(|i| at(pod_ip(i)))
                .collect::<Result<_, TargetError>>()?,
        })
    }

    fn node_addrs(&self, spec: &NodesSpec, pods: usize) -> Result<NodeAddrs, TargetError> {
        NodeAddrs::loopback(spec.count, |i| pod_ip(pods + i))
    }
}

/// Builds the metadata and store server command lines; shared with the
/// netns target, which prefixes them with `ip netns exec`.
pub fn server_argvs(
    plan: &Plan,
    metadata_listen: &str,
    metadata_url: &str,
    store_listen: &str,
    store_url: &str,
) -> Result<(Vec<String>, Vec<String>), TargetError> {
    let (margs, sargs) = server_args(plan, metadata_listen, metadata_url, store_listen, store_url);
    let mut meta = vec![binary(&plan.bin_dir, "kt-metadata")?];
    meta.extend(margs);
    let mut store = vec![binary(&plan.bin_dir, "kt-store")?];
    store.extend(sargs);
    Ok((meta, store))
}

/// The arguments of the metadata server and the store, without the
/// programs (a container target's images have them as entry points).
pub fn server_args(
    plan: &Plan,
    metadata_listen: &str,
    metadata_url: &str,
    store_listen: &str,
    store_url: &str,
) -> (Vec<String>, Vec<String>) {
    let mut meta = vec![
        "--listen".into(),
        metadata_listen.into(),
        "--state-dir".into(),
        plan.work_dir.join("metadata").display().to_string(),
    ];
    meta.extend(plan.metadata_flags.iter().cloned());
    let mut store = vec![
        "--listen".into(),
        store_listen.into(),
        "--data-dir".into(),
        plan.work_dir.join("store").display().to_string(),
        "--metadata-url".into(),
        metadata_url.into(),
        "--advertise-url".into(),
        store_url.into(),
    ];
    if let Some(cs) = plan.chunk_size {
        store.extend(["--chunk-size".into(), cs.to_string()]);
    }
    (meta, store)
}

/// The networks testbeds use (local: loopback; netns: 198.18.0.0/15).
const TESTBED_NETS: &str = "127.0.0.0/8,198.18.0.0/15,localhost";

/// `req` with the workload's token where it carries the run's (the
/// process targets give each component its role).
pub fn in_pod(roles: Option<&Roles>, req: &ExecRequest) -> ExecRequest {
    roles.map_or_else(|| req.clone(), |r| r.in_pod(req))
}

/// `argv` run as a pod's command: in its directory, with its environment.
pub fn pod_command(
    argv: &[String],
    dir: &Path,
    req: &ExecRequest,
    metadata_url: &str,
    pod_ip: &str,
) -> Command {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .current_dir(dir)
        .envs(pod_env(req, metadata_url, dir, pod_ip));
    cmd
}

/// The environment every command in a pod gets.
pub fn pod_env(
    req: &ExecRequest,
    metadata_url: &str,
    pod_dir: &Path,
    pod_ip: &str,
) -> Vec<(String, String)> {
    let mut env = vec![
        (
            kt_types::env::METADATA_URL.to_owned(),
            metadata_url.to_owned(),
        ),
        (kt_types::env::PROGRESS.to_owned(), "never".to_owned()),
        (kt_types::env::POD_NAME.to_owned(), req.pod.clone()),
        (kt_types::env::POD_IP.to_owned(), pod_ip.to_owned()),
        ("HOME".to_owned(), pod_dir.display().to_string()),
        (
            kt_types::env::AGENT_SOCKET.to_owned(),
            agent_socket(pod_dir).display().to_string(),
        ),
        (
            kt_types::env::SHM_DIR.to_owned(),
            shm_dir(pod_dir).display().to_string(),
        ),
        (
            "XDG_CACHE_HOME".to_owned(),
            pod_dir.join(".cache").display().to_string(),
        ),
        // Pods have their agent as a sidecar: kt must never start another.
        (kt_types::env::AGENT_AUTOSTART.to_owned(), "0".to_owned()),
        // Testbed traffic never goes through a proxy the runner's user has set.
        ("NO_PROXY".to_owned(), TESTBED_NETS.to_owned()),
        ("no_proxy".to_owned(), TESTBED_NETS.to_owned()),
    ];
    if let Some(t) = &req.token {
        env.push((kt_types::env::TOKEN.to_owned(), t.clone()));
    }
    env.extend(req.env.iter().cloned());
    env
}

/// The programs a pod's commands run: `kt`, and the Python interpreter
/// with the `kt` package when there is one.
#[derive(Debug, Clone, Default)]
pub struct Programs {
    pub kt: String,
    pub python: Option<String>,
}

impl Programs {
    /// The programs of a process-based target for `plan`.
    pub fn of(plan: &Plan) -> Result<Programs, TargetError> {
        Ok(Programs {
            kt: binary(&plan.bin_dir, "kt")?,
            python: (plan.python.as_ref()).map(|p| p.display().to_string()),
        })
    }

    /// The programs of the client image: `kt` on its PATH, no Python.
    pub fn in_image() -> Programs {
        Programs {
            kt: "kt".to_owned(),
            python: None,
        }
    }

    /// The program and arguments of an exec request.
    pub fn argv(&self, req: &ExecRequest) -> Result<Vec<String>, TargetError> {
        let mut argv = match req.program {
            Program::Kt => vec![self.kt.clone()],
            Program::Shell => vec!["sh".to_owned(), "-c".to_owned()],
            Program::Python => vec![
                self.python
                    .clone()
                    .ok_or_else(|| TargetError::Unavailable(NO_PYTHON.to_owned()))?,
            ],
        };
        argv.extend(req.args.iter().cloned());
        Ok(argv)
    }
}

/// Why a `python` step cannot run: no interpreter with `kt` was found.
pub const NO_PYTHON: &str = "no Python interpreter with the kt package: run `make python` (it builds one at target/python), or pass --python / KT_SCENARIO_PYTHON";

/// Creates the pod directories below the plan's work dir.
pub fn make_pod_dirs(plan: &Plan) -> Result<(), TargetError> {
    for p in &plan.pods {
        let d = plan.work_dir.join("pods").join(&p.name);
        std::fs::create_dir_all(shm_dir(&d))
            .map_err(TargetError::io(format!("creating {}", d.display())))?;
    }
    std::fs::create_dir_all(plan.work_dir.join("logs"))
        .map_err(TargetError::io("creating the log directory"))
}

/// Copies the log of each server into `dir`.
pub fn copy_logs<'a>(
    servers: impl Iterator<Item = &'a Server>,
    dir: &Path,
) -> Result<(), TargetError> {
    std::fs::create_dir_all(dir).map_err(TargetError::io(format!("creating {}", dir.display())))?;
    for s in servers {
        let to = dir.join(format!("{}.log", s.name));
        if s.log_path().exists() {
            std::fs::copy(s.log_path(), &to).map_err(TargetError::io(format!(
                "copying {}",
                s.log_path().display()
            )))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_addresses_are_distinct_loopback_addresses() {
        let ips: std::collections::HashSet<_> = (0..600).map(pod_ip).collect();
        assert_eq!(ips.len(), 600);
        assert!(ips.iter().all(|ip| ip.is_loopback()));
        assert!(!ips.contains(&METADATA_IP) && !ips.contains(&STORE_IP));
    }
}
