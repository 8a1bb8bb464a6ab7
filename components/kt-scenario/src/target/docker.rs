//! The `docker` target: every component and pod is a container from kt's
//! images (`make images`) on a user-defined bridge network of its own.
//!
//! A pod is two containers, as in Kubernetes: the workload (`kt-client`
//! image: `kt` and a shell; it owns the pod's network namespace and address,
//! like a pod's sandbox) and its node agent (`kt-agent` image), which joins
//! the workload's network namespace. Steps exec into the workload.
//!
//! The scenario's work directory is bind-mounted at the same path into every
//! container, so data sets, pod directories and server state have the same
//! paths inside and out: what a getter wrote is verified from the host, and
//! a restarted server finds its state. Containers run with a read-only root
//! filesystem, every capability dropped and `no-new-privileges`, as the
//! runner's user (so the bind-mounted files stay the runner's); the images'
//! own user, 65532, is what the Kubernetes targets run.
//!
//! Every component has its own role, as on the process targets
//! ([`super::roles`]): the tokens file lies in the bind-mounted work
//! directory, the metadata server and the store read it, the store and
//! each pod's agent present their own tokens, and every command in a pod
//! the workload's.
//!
//! Every container carries the run's label; [`Target::down`] removes them
//! and the network, and is idempotent.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bollard::Docker as Api;
use bollard::container::LogOutput;
use bollard::exec::StartExecResults;
use bollard::models::{
    ContainerCreateBody, EndpointIpamConfig, EndpointSettings, ExecConfig, HostConfig, Ipam,
    IpamConfig, NetworkCreateRequest, NetworkingConfig,
};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, KillContainerOptionsBuilder, ListContainersOptionsBuilder,
    ListNetworksOptionsBuilder, LogsOptionsBuilder, RemoveContainerOptionsBuilder,
    StopContainerOptionsBuilder,
};
use futures::{StreamExt, TryStreamExt};

use super::local::{
    Programs, READY_TIMEOUT, agent_args, in_pod, make_pod_dirs, pod_env, server_args,
};
use super::roles::Roles;
use super::wrapped::{self, Chunk, Killer};
use super::{Component, ExecOutput, ExecRequest, Plan, PodPlan, PodProcess, Target, TargetError};
use crate::format::Signal;

/// Ports inside the containers (each has an address of its own).
const METADATA_PORT: u16 = 8081;
const STORE_PORT: u16 = 8082;
const AGENT_PORT: u16 = 8090;
/// How long a TERM gets before KILL.
const GRACE: Duration = Duration::from_secs(10);
/// Containers created or started at once.
const PARALLEL: usize = 8;
/// The label every container and network of a run carries.
pub const RUN_LABEL: &str = "kt.dev/testbed-run";
/// Marks a container in another's network namespace (a pod's agent): removed
/// before the namespace's owner, or the engine may keep a stale endpoint that
/// blocks removing the network.
pub const SIDECAR_LABEL: &str = "kt.dev/sidecar";

/// The four images a run uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Images {
    pub metadata: String,
    pub store: String,
    pub agent: String,
    pub client: String,
}

impl Images {
    /// `<repo>/kt-<component>:<tag>`: the names `make images` gives them.
    pub fn new(repo: &str, tag: &str) -> Images {
        let name = |c: &str| format!("{repo}/kt-{c}:{tag}");
        Images {
            metadata: name("metadata"),
            store: name("store"),
            agent: name("agent"),
            client: name("client"),
        }
    }

    /// The images of this run: [`Images::from_env`], worked out once per
    /// process (a snapshot accepted mid-run dirties the tree; the images are
    /// still those built before the run).
    pub fn of_run() -> Result<Images, String> {
        static IMAGES: OnceLock<Result<Images, String>> = OnceLock::new();
        IMAGES.get_or_init(Images::from_env).clone()
    }

    /// From `KT_IMAGE_REPO` (default ghcr.io/kt-dev) and `KT_IMAGE_TAG`
    /// (default: the tag `make images` gives a build of this tree).
    pub fn from_env() -> Result<Images, String> {
        let repo =
            std::env::var(kt_types::env::IMAGE_REPO).unwrap_or_else(|_| "ghcr.io/kt-dev".into());
        let tag = match std::env::var(kt_types::env::IMAGE_TAG) {
            Ok(t) if !t.is_empty() => t,
            _ => git_tag()?,
        };
        Ok(Images::new(&repo, &tag))
    }

    pub fn all(&self) -> [&str; 4] {
        [&self.metadata, &self.store, &self.agent, &self.client]
    }
}

/// The tag `make images` (testbed/images/tag.sh) gives a build of the
/// current tree: the short git revision, `-dirty` when tracked files changed.
pub fn git_tag() -> Result<String, String> {
    let git = |args: &[&str]| -> Result<String, String> {
        let out = std::process::Command::new("git")
            .args(args)
            .output()
            .map_err(|e| format!("running git to find the image tag: {e} (set KT_IMAGE_TAG)"))?;
        if !out.status.success() {
            return Err(format!(
                "git {} failed: {} (set KT_IMAGE_TAG)",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let rev = git(&["rev-parse", "--short=12", "HEAD"])?;
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty();
    Ok(if dirty { format!("{rev}-dirty") } else { rev })
}

/// A pod's two containers and its address.
#[derive(Debug, Clone)]
struct Pod {
    workload: String,
    agent: String,
    ip: Ipv4Addr,
}

#[derive(Debug, Default)]
pub struct Docker {
    api: Option<Api>,
    images: Option<Images>,
    http: reqwest::Client,
    run: String,
    network: Option<String>,
    work: PathBuf,
    user: String,
    metadata: (String, String),
    store: (String, String),
    pods: HashMap<String, Pod>,
    roles: Option<Roles>,
}

/// An environment as a container takes it (`K=V`).
fn env_list(env: Vec<(String, String)>) -> Vec<String> {
    env.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
}

impl Docker {
    pub fn new() -> Docker {
        Docker {
            http: kt_api::client_builder()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap_or_default(),
            ..Docker::default()
        }
    }

    fn api(&self) -> Result<&Api, TargetError> {
        self.api
            .as_ref()
            .ok_or_else(|| TargetError::Failed("the docker testbed is not up".into()))
    }

    fn images(&self) -> Result<&Images, TargetError> {
        self.images
            .as_ref()
            .ok_or_else(|| TargetError::Failed("the docker testbed is not up".into()))
    }

    fn name(&self, what: &str) -> String {
        format!("kt-{}-{what}", self.run)
    }

    fn labels(&self) -> HashMap<String, String> {
        HashMap::from([
            (RUN_LABEL.to_owned(), self.run.clone()),
            ("kt.dev/testbed".to_owned(), "docker".to_owned()),
        ])
    }

    /// What every container of the run shares: the work dir at the same
    /// path, the runner's user, a read-only root and no privileges.
    fn container(
        &self,
        image: &str,
        cmd: Vec<String>,
        env: Vec<String>,
        network: NetworkAt,
    ) -> ContainerCreateBody {
        let work = self.work.display().to_string();
        let (network_mode, networking_config) = match network {
            NetworkAt::Ip(ip, alias) => {
                let net = self.network.clone().unwrap_or_default();
                let endpoint = EndpointSettings {
                    ipam_config: Some(EndpointIpamConfig {
                        ipv4_address: Some(ip.to_string()),
                        ..Default::default()
                    }),
                    aliases: Some(vec![alias]),
                    ..Default::default()
                };
                (
                    Some(net.clone()),
                    Some(NetworkingConfig {
                        endpoints_config: Some(HashMap::from([(net, endpoint)])),
                    }),
                )
            }
            NetworkAt::JoinOf(container) => (Some(format!("container:{container}")), None),
        };
        let mut labels = self.labels();
        // A sidecar also shares its pod's processes (a pod with
        // `shareProcessNamespace`): the agent then ties tensor registrations
        // to the workload's processes rather than to their connections, so
        // they outlive an agent restart and die with their process.
        let mut pid_mode = None;
        if matches!(network_mode.as_deref(), Some(m) if m.starts_with("container:")) {
            labels.insert(SIDECAR_LABEL.to_owned(), "true".to_owned());
            pid_mode.clone_from(&network_mode);
        }
        ContainerCreateBody {
            image: Some(image.to_owned()),
            cmd: Some(cmd),
            env: Some(env),
            user: Some(self.user.clone()),
            working_dir: Some(work.clone()),
            labels: Some(labels),
            host_config: Some(HostConfig {
                binds: Some(vec![format!("{work}:{work}")]),
                network_mode,
                pid_mode,
                readonly_rootfs: Some(true),
                tmpfs: Some(HashMap::from([("/tmp".to_owned(), "mode=1777".to_owned())])),
                cap_drop: Some(vec!["ALL".to_owned()]),
                security_opt: Some(vec!["no-new-privileges".to_owned()]),
                ..Default::default()
            }),
            networking_config,
            ..Default::default()
        }
    }

    async fn create(&self, name: &str, body: ContainerCreateBody) -> Result<(), TargetError> {
        let opts = CreateContainerOptionsBuilder::new().name(name).build();
        self.api()?
            .create_container(Some(opts), body)
            .await
            .map(|_| ())
            .map_err(|e| TargetError::Failed(format!("creating container {name}: {e}")))
    }

    /// Creates the run's network ([`create_network`]).
    async fn create_network(&mut self) -> Result<Ipv4Addr, TargetError> {
        let name = self.name("net");
        let base = create_network(self.api()?, &name, self.labels()).await?;
        self.network = Some(name);
        Ok(base)
    }

    /// Starts a container and waits until `url` answers, or the container
    /// exits (its log tail is the error).
    async fn start_ready(&self, name: &str, url: &str) -> Result<(), TargetError> {
        let api = self.api()?;
        api.start_container(name, None)
            .await
            .map_err(|e| TargetError::Failed(format!("starting {name}: {e}")))?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(r) = self.http.get(format!("{url}/readyz")).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if !self.running(name).await? {
                return Err(TargetError::Failed(format!(
                    "{name} exited before it was ready; log:\n{}",
                    self.log_tail(name, 20).await
                )));
            }
            if Instant::now() >= deadline {
                return Err(TargetError::Failed(format!(
                    "{name} not ready at {url} after {READY_TIMEOUT:?}; log:\n{}",
                    self.log_tail(name, 20).await
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn running(&self, name: &str) -> Result<bool, TargetError> {
        running(self.api()?, name).await
    }

    async fn logs(&self, name: &str, tail: Option<usize>) -> Result<String, TargetError> {
        let mut opts = LogsOptionsBuilder::new().stdout(true).stderr(true);
        if let Some(n) = tail {
            opts = opts.tail(&n.to_string());
        }
        let chunks: Vec<LogOutput> = self
            .api()?
            .logs(name, Some(opts.build()))
            .try_collect()
            .await
            .map_err(|e| TargetError::Failed(format!("reading the log of {name}: {e}")))?;
        Ok(chunks.iter().map(|c| c.to_string()).collect())
    }

    async fn log_tail(&self, name: &str, n: usize) -> String {
        self.logs(name, Some(n))
            .await
            .unwrap_or_else(|e| e.to_string())
    }

    /// Signals a container and waits for it to exit ([`stop_container`]).
    async fn stop(&self, name: &str, signal: Signal) -> Result<(), TargetError> {
        stop_container(self.api()?, name, signal, GRACE).await
    }

    fn component(&self, c: &Component) -> Result<Vec<String>, TargetError> {
        Ok(match c {
            Component::Metadata => vec![self.metadata.0.clone()],
            Component::Store => vec![self.store.0.clone()],
            // The agent first: it lives in the workload's network namespace.
            Component::Pod(p) => {
                let pod = self.pod(p)?;
                vec![pod.agent.clone(), pod.workload.clone()]
            }
        })
    }

    /// Where a pod's command runs: its workload container, as the runner's
    /// user, in the pod's directory, with the pod's environment.
    fn in_workload(&self, req: &ExecRequest) -> Result<InContainer, TargetError> {
        let pod = self.pod(&req.pod)?;
        let (dir, env) = self.exec_env(req, pod);
        Ok(InContainer {
            container: pod.workload.clone(),
            user: Some(self.user.clone()),
            env,
            dir: dir.display().to_string(),
            what: format!("pod {}", req.pod),
        })
    }

    /// Where a pod's command runs and its environment (`K=V`), with the
    /// workload's token in place of the run's.
    fn exec_env(&self, req: &ExecRequest, pod: &Pod) -> (PathBuf, Vec<String>) {
        let dir = self.pod_dir(&req.pod);
        let req = in_pod(self.roles.as_ref(), req);
        let env = env_list(pod_env(&req, &self.metadata.1, &dir, &pod.ip.to_string()));
        (dir, env)
    }

    /// Creates a pod's workload container and its agent sidecar.
    async fn create_pod(
        &self,
        plan: &Plan,
        p: &PodPlan,
        images: &Images,
        roles: &Roles,
    ) -> Result<(), TargetError> {
        let pod = self.pod(&p.name)?;
        let url = format!("http://{}:{AGENT_PORT}", pod.ip);
        let workload = self.container(
            &images.client,
            Vec::new(),
            vec![format!("{}={}", kt_types::env::POD_NAME, p.name)],
            NetworkAt::Ip(pod.ip, p.name.clone()),
        );
        self.create(&pod.workload, workload).await?;
        let mut args = agent_args(
            plan,
            p,
            &format!("0.0.0.0:{AGENT_PORT}"),
            &url,
            &self.metadata.1,
        );
        // The agent's own idea of the pod's address.
        args.extend(["--pod-ip".into(), pod.ip.to_string()]);
        let agent = self.container(
            &images.agent,
            args,
            env_list(roles.agent_env(&p.name)),
            NetworkAt::JoinOf(pod.workload.clone()),
        );
        self.create(&pod.agent, agent).await
    }

    fn pod(&self, name: &str) -> Result<&Pod, TargetError> {
        self.pods
            .get(name)
            .ok_or_else(|| TargetError::Failed(format!("no pod named {name}")))
    }

    fn user() -> String {
        format!(
            "{}:{}",
            rustix::process::getuid().as_raw(),
            rustix::process::getgid().as_raw()
        )
    }
}

/// Where a container is on the network.
enum NetworkAt {
    /// Its own address (and a DNS alias) on the run's network.
    Ip(Ipv4Addr, String),
    /// In the network namespace of another container (a pod's sidecar).
    JoinOf(String),
}

/// Where a command runs in a container, and as whom.
#[derive(Debug, Clone)]
pub struct InContainer {
    pub container: String,
    /// None: the container's own user.
    pub user: Option<String>,
    /// `K=V`.
    pub env: Vec<String>,
    pub dir: String,
    /// What errors call it (`pod getter-1`).
    pub what: String,
}

impl InContainer {
    fn config(&self, cmd: Vec<String>) -> ExecConfig {
        ExecConfig {
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            cmd: Some(cmd),
            env: Some(self.env.clone()),
            user: self.user.clone(),
            working_dir: Some(self.dir.clone()),
            ..Default::default()
        }
    }
}

/// Runs `cmd` in a container and waits for it: its status (128 + 9 when
/// the container died under it), stdout and stderr.
pub async fn exec_in(
    api: &Api,
    at: &InContainer,
    cmd: Vec<String>,
) -> Result<ExecOutput, TargetError> {
    let failed =
        |e: bollard::errors::Error| TargetError::Failed(format!("exec in {}: {e}", at.what));
    let started = Instant::now();
    let exec = api
        .create_exec(&at.container, at.config(cmd))
        .await
        .map_err(failed)?
        .id;
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    match api.start_exec(&exec, None).await.map_err(failed)? {
        StartExecResults::Attached { mut output, .. } => {
            // The container stopping ends the command; its stream may stay
            // open after (a container in another's pid namespace).
            let gone = container_gone(api, &at.container);
            tokio::pin!(gone);
            loop {
                let chunk = tokio::select! {
                    chunk = output.next() => chunk,
                    () = &mut gone => break,
                };
                match chunk {
                    Some(Ok(LogOutput::StdOut { message })) => stdout.extend_from_slice(&message),
                    Some(Ok(LogOutput::StdErr { message })) => stderr.extend_from_slice(&message),
                    Some(Ok(_)) => {}
                    // The pod died under the command: its status says so.
                    Some(Err(_)) | None => break,
                }
            }
        }
        StartExecResults::Detached => {}
    }
    let duration = started.elapsed();
    // The streams may close a moment before docker records the exit.
    let deadline = Instant::now() + Duration::from_secs(2);
    let inspect = loop {
        let inspect = api.inspect_exec(&exec).await.map_err(failed)?;
        if inspect.exit_code.is_some()
            || inspect.running != Some(true)
            || Instant::now() >= deadline
        {
            break inspect;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // A pod killed under the command: docker has no exit code for it.
    let status = match inspect.exit_code {
        Some(code) => i32::try_from(code).unwrap_or(i32::MAX),
        None => 128 + libc::SIGKILL,
    };
    Ok(ExecOutput {
        status,
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        duration,
    })
}

/// Starts `cmd` in a container and returns at once ([`Target::spawn`]).
pub async fn spawn_in(
    api: &Api,
    at: &InContainer,
    cmd: Vec<String>,
) -> Result<Box<dyn PodProcess>, TargetError> {
    let failed = |e: bollard::errors::Error| {
        TargetError::Failed(format!("starting a command in {}: {e}", at.what))
    };
    let exec = api
        .create_exec(&at.container, at.config(wrapped::wrap(cmd, false)))
        .await
        .map_err(failed)?
        .id;
    let output = match api.start_exec(&exec, None).await.map_err(failed)? {
        StartExecResults::Attached { output, .. } => output,
        StartExecResults::Detached => {
            return Err(TargetError::Failed(format!(
                "starting a command in {}: docker detached it",
                at.what
            )));
        }
    };
    // The pod dying under the command ends the stream with an error, or
    // (a container in another's pid namespace) leaves it open: its
    // container stopping ends it too.
    let chunks = output
        .take_until(Box::pin(container_gone(api, &at.container)))
        .take_while(|c| futures::future::ready(c.is_ok()))
        .filter_map(|c| {
            futures::future::ready(match c {
                Ok(LogOutput::StdOut { message }) => Some(Chunk::Stdout(message.to_vec())),
                Ok(LogOutput::StdErr { message }) => Some(Chunk::Stderr(message.to_vec())),
                _ => None,
            })
        })
        .boxed();
    let (api, container, user) = (api.clone(), at.container.clone(), at.user.clone());
    let killer: Killer = std::sync::Arc::new(move |signal, pid| {
        let (api, container, user) = (api.clone(), container.clone(), user.clone());
        Box::pin(async move {
            exec_to_end(
                &api,
                &container,
                user.as_deref(),
                wrapped::kill_argv(signal, pid),
            )
            .await
        })
    });
    Ok(Box::new(wrapped::start(chunks, killer, false)))
}

/// Runs `cmd` in `container` and waits for it (a `kill` for a spawned
/// command); Err unless it exits 0.
pub async fn exec_to_end(
    api: &Api,
    container: &str,
    user: Option<&str>,
    cmd: Vec<String>,
) -> Result<(), TargetError> {
    let failed = |e: bollard::errors::Error| {
        TargetError::Failed(format!("`{}` in {container}: {e}", cmd.join(" ")))
    };
    let exec = api
        .create_exec(
            container,
            ExecConfig {
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                cmd: Some(cmd.clone()),
                user: user.map(str::to_owned),
                ..Default::default()
            },
        )
        .await
        .map_err(failed)?
        .id;
    let mut said = Vec::new();
    if let StartExecResults::Attached { mut output, .. } =
        api.start_exec(&exec, None).await.map_err(failed)?
    {
        while let Some(Ok(chunk)) = output.next().await {
            said.extend_from_slice(&chunk.into_bytes());
        }
    }
    let code = api.inspect_exec(&exec).await.map_err(failed)?.exit_code;
    match code {
        Some(0) => Ok(()),
        other => Err(TargetError::Failed(format!(
            "`{}` in {container} exited with {other:?}: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&said).trim()
        ))),
    }
}

/// Creates a bridge network named `name` on the first free /16 of
/// 10.210-10.249 (gateway .0.1), and returns its base address.
pub async fn create_network(
    api: &Api,
    name: &str,
    labels: HashMap<String, String>,
) -> Result<Ipv4Addr, TargetError> {
    let used: Vec<String> = api
        .list_networks(Some(ListNetworksOptionsBuilder::new().build()))
        .await
        .map_err(|e| TargetError::Failed(format!("listing docker networks: {e}")))?
        .into_iter()
        .flat_map(|n| n.ipam.and_then(|i| i.config).unwrap_or_default())
        .filter_map(|c| c.subnet)
        .collect();
    let mut last = String::new();
    for second in 210..250u8 {
        let base = Ipv4Addr::new(10, second, 0, 0);
        if used.iter().any(|s| overlaps(s, base)) {
            continue;
        }
        let req = NetworkCreateRequest {
            name: name.to_owned(),
            driver: Some("bridge".into()),
            ipam: Some(Ipam {
                config: Some(vec![IpamConfig {
                    subnet: Some(format!("{base}/16")),
                    gateway: Some(Ipv4Addr::new(10, second, 0, 1).to_string()),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            labels: Some(labels.clone()),
            ..Default::default()
        };
        match api.create_network(req).await {
            Ok(_) => return Ok(base),
            // Taken by something docker did not list (a host route, a
            // network created meanwhile): try the next.
            Err(e) => last = e.to_string(),
        }
    }
    Err(TargetError::Failed(format!(
        "no free /16 for the testbed network in 10.210.0.0-10.249.0.0 (last error: {last})"
    )))
}

/// Resolves once a container is no longer running (or cannot be asked).
pub fn container_gone(
    api: &Api,
    name: &str,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let (api, name) = (api.clone(), name.to_owned());
    async move {
        while let Ok(true) = running(&api, &name).await {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// Whether a container is running.
pub async fn running(api: &Api, name: &str) -> Result<bool, TargetError> {
    let state = api
        .inspect_container(name, None)
        .await
        .map_err(|e| TargetError::Failed(format!("inspecting {name}: {e}")))?
        .state;
    Ok(state.and_then(|s| s.running).unwrap_or(false))
}

/// Signals a container and waits for it to exit: TERM gets `grace`, then
/// KILL. STOP and CONT pause and unpause it.
pub async fn stop_container(
    api: &Api,
    name: &str,
    signal: Signal,
    grace: Duration,
) -> Result<(), TargetError> {
    let res = match signal {
        Signal::TERM => {
            let opts = StopContainerOptionsBuilder::new()
                .signal("SIGTERM")
                .t(i32::try_from(grace.as_secs()).unwrap_or(i32::MAX))
                .build();
            api.stop_container(name, Some(opts)).await
        }
        Signal::KILL => {
            let opts = KillContainerOptionsBuilder::new().signal("SIGKILL").build();
            api.kill_container(name, Some(opts)).await
        }
        // Frozen with the cgroup freezer (as SIGSTOP, but for every
        // process of the container), thawed again; nothing exits.
        Signal::STOP => {
            return api
                .pause_container(name)
                .await
                .map_err(|e| TargetError::Failed(format!("pausing {name}: {e}")));
        }
        Signal::CONT => return unpause(api, name).await,
    };
    match res {
        Ok(()) => {}
        // Not running (304, or 409 for kill): already what was asked.
        Err(bollard::errors::Error::DockerResponseServerError { status_code, .. })
            if status_code == 304 || status_code == 409 => {}
        Err(e) => return Err(TargetError::Failed(format!("stopping {name}: {e}"))),
    }
    // A zero grace still gets the engine's time to reap the container.
    let deadline = Instant::now() + grace * 2 + Duration::from_secs(5);
    while running(api, name).await? {
        if Instant::now() >= deadline {
            return Err(TargetError::Failed(format!("{name} did not stop")));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Removes every container of a run (labelled [`RUN_LABEL`] = `run`):
/// those in another's namespaces ([`SIDECAR_LABEL`]) first. Everything is
/// tried; the first failure is reported.
pub async fn remove_run_containers(api: &Api, run: &str) -> Result<(), TargetError> {
    let filters = HashMap::from([("label".to_owned(), vec![format!("{RUN_LABEL}={run}")])]);
    let containers = api
        .list_containers(Some(
            ListContainersOptionsBuilder::new()
                .all(true)
                .filters(&filters)
                .build(),
        ))
        .await
        .map_err(|e| TargetError::Failed(format!("listing the run's containers: {e}")))?;
    let (sidecars, owners): (Vec<_>, Vec<_>) = containers.into_iter().partition(|c| {
        c.labels
            .as_ref()
            .is_some_and(|l| l.contains_key(SIDECAR_LABEL))
    });
    let mut removed = Vec::new();
    for batch in [sidecars, owners] {
        let ids = batch.into_iter().filter_map(|c| c.id);
        let removing: Vec<_> = ids.map(|id| remove_container(api, id)).collect();
        removed.extend(
            futures::stream::iter(removing)
                .buffer_unordered(PARALLEL)
                .collect::<Vec<_>>()
                .await,
        );
    }
    removed
        .into_iter()
        .find_map(Result::err)
        .map_or(Ok(()), Err)
}

/// Removes a container, running or not; one already gone is fine.
pub async fn remove_container(api: &Api, id: String) -> Result<(), TargetError> {
    let opts = RemoveContainerOptionsBuilder::new()
        .force(true)
        .v(true)
        .build();
    match api.remove_container(&id, Some(opts)).await {
        Ok(())
        | Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => Ok(()),
        Err(e) => Err(TargetError::Failed(format!("removing container {id}: {e}"))),
    }
}

/// `s` as a part of a container name: `[a-z0-9-]`.
pub fn docker_name(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// Does the CIDR `subnet` overlap 10.x.0.0/16 at `base`?
fn overlaps(subnet: &str, base: Ipv4Addr) -> bool {
    let Some((addr, len)) = subnet.split_once('/') else {
        return false;
    };
    let (Ok(addr), Ok(len)) = (addr.parse::<Ipv4Addr>(), len.parse::<u32>()) else {
        return false;
    };
    let len = len.min(16);
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    u32::from(addr) & mask == u32::from(base) & mask
}

/// The address of the `i`th pod on the run's /16 at `base`: x.x.1.2, ...
pub fn pod_ip(base: Ipv4Addr, i: usize) -> Ipv4Addr {
    let [a, b, _, _] = base.octets();
    let n = u32::try_from(i).unwrap_or(u32::MAX);
    Ipv4Addr::new(a, b, 1 + (n / 250) as u8, 2 + (n % 250) as u8)
}

/// Can this machine run the docker target? Asked once per process: the
/// engine must answer and the run's images must be there.
pub fn probe() -> Option<String> {
    static PROBED: OnceLock<Option<String>> = OnceLock::new();
    PROBED
        .get_or_init(|| {
            // Its own thread and runtime: `unavailable` is synchronous.
            std::thread::spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                rt.block_on(async {
                    let api = connect().await?;
                    let images = Images::of_run()?;
                    let mut missing = Vec::new();
                    for image in images.all() {
                        if api.inspect_image(image).await.is_err() {
                            missing.push(image.to_owned());
                        }
                    }
                    if missing.is_empty() {
                        Ok(())
                    } else {
                        Err(format!(
                            "image(s) {} not found: build them with `make images` \
                             (or set KT_IMAGE_TAG to a tag that is there)",
                            missing.join(", ")
                        ))
                    }
                })
            })
            .join()
            .unwrap_or_else(|_| Err("the docker probe panicked".into()))
            .err()
        })
        .clone()
}

pub async fn connect() -> Result<Api, String> {
    let api = Api::connect_with_local_defaults()
        .map_err(|e| format!("docker target: cannot connect to the Docker engine: {e}"))?;
    // The engine may speak an older API than bollard's default.
    api.negotiate_version()
        .await
        .map_err(|e| format!("docker target: the Docker engine does not answer: {e}"))
}

#[async_trait]
impl Target for Docker {
    fn name(&self) -> &'static str {
        "docker"
    }

    fn unavailable(&self) -> Option<String> {
        probe()
    }

    async fn up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        self.api = Some(connect().await.map_err(TargetError::Unavailable)?);
        self.images = Some(Images::of_run().map_err(TargetError::Unavailable)?);
        // Names carry the scenario too: a scenario whose teardown failed
        // never blocks the next one's names.
        self.run = format!("{}-{}", plan.run_id, docker_name(&plan.scenario));
        self.work = plan.work_dir.clone();
        self.user = Docker::user();
        make_pod_dirs(plan)?;
        // A network namespace per pod (its agent joins the workload's),
        // the metadata server's and the store's, all on one bridge.
        super::host::raise_limits(plan.pods.len() + 2);
        let base = self.create_network().await?;
        let [a, b, _, _] = base.octets();
        let mip = Ipv4Addr::new(a, b, 0, 2);
        let sip = Ipv4Addr::new(a, b, 0, 3);
        let metadata_url = format!("http://{mip}:{METADATA_PORT}");
        let store_url = format!("http://{sip}:{STORE_PORT}");
        self.metadata = (self.name("metadata"), metadata_url.clone());
        self.store = (self.name("store"), store_url.clone());
        let (margs, sargs) = server_args(
            plan,
            &format!("0.0.0.0:{METADATA_PORT}"),
            &metadata_url,
            &format!("0.0.0.0:{STORE_PORT}"),
            &store_url,
        );
        // Every component with its own role (the tokens file is in the
        // work directory, which every container mounts).
        let roles = Roles::write(plan)?;
        let images = self.images()?.clone();
        self.create(
            &self.metadata.0,
            self.container(
                &images.metadata,
                margs,
                env_list(roles.metadata_env()),
                NetworkAt::Ip(mip, "metadata".into()),
            ),
        )
        .await?;
        self.create(
            &self.store.0,
            self.container(
                &images.store,
                sargs,
                env_list(roles.store_env()),
                NetworkAt::Ip(sip, "store".into()),
            ),
        )
        .await?;
        for (i, p) in plan.pods.iter().enumerate() {
            let pod = Pod {
                workload: self.name(&p.name),
                agent: self.name(&format!("{}-agent", p.name)),
                ip: pod_ip(base, i),
            };
            self.pods.insert(p.name.clone(), pod);
        }
        // Pods are created (and later started) a few at a time.
        let creating: Vec<_> = plan
            .pods
            .iter()
            .map(|p| self.create_pod(plan, p, &images, &roles))
            .collect();
        futures::stream::iter(creating)
            .buffer_unordered(PARALLEL)
            .try_collect::<Vec<()>>()
            .await?;
        self.start_ready(&self.metadata.0, &self.metadata.1).await?;
        self.start_ready(&self.store.0, &self.store.1).await?;
        let pods: Vec<Component> = plan
            .pods
            .iter()
            .map(|p| Component::Pod(p.name.clone()))
            .collect();
        let starting: Vec<_> = pods.iter().map(|c| self.start(c)).collect();
        futures::stream::iter(starting)
            .buffer_unordered(PARALLEL)
            .try_collect::<Vec<()>>()
            .await?;
        self.roles = Some(roles);
        Ok(())
    }

    fn metadata_url(&self) -> String {
        self.metadata.1.clone()
    }

    fn component_url(&self, c: &Component) -> Option<String> {
        match c {
            Component::Metadata => Some(self.metadata.1.clone()),
            Component::Store => Some(self.store.1.clone()),
            Component::Pod(p) => self
                .pods
                .get(p)
                .map(|pod| format!("http://{}:{AGENT_PORT}", pod.ip)),
        }
    }

    fn pod_dir(&self, pod: &str) -> PathBuf {
        self.work.join("pods").join(pod)
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecOutput, TargetError> {
        let at = self.in_workload(&req)?;
        exec_in(self.api()?, &at, Programs::in_image().argv(&req)?).await
    }

    async fn spawn(&self, req: ExecRequest) -> Result<Box<dyn PodProcess>, TargetError> {
        let at = self.in_workload(&req)?;
        spawn_in(self.api()?, &at, Programs::in_image().argv(&req)?).await
    }

    async fn pod_ip(&self, pod: &str) -> Result<String, TargetError> {
        Ok(self.pod(pod)?.ip.to_string())
    }

    async fn kill_agent(&self, pod: &str, signal: Signal) -> Result<(), TargetError> {
        let agent = self.pod(pod)?.agent.clone();
        self.stop(&agent, signal).await
    }

    fn freezes(&self) -> bool {
        true
    }

    async fn kill(&self, c: &Component, signal: Signal) -> Result<(), TargetError> {
        for name in self.component(c)? {
            self.stop(&name, signal).await?;
        }
        Ok(())
    }

    async fn start(&self, c: &Component) -> Result<(), TargetError> {
        let api = self.api()?;
        match c {
            Component::Metadata => self.start_ready(&self.metadata.0, &self.metadata.1).await,
            Component::Store => self.start_ready(&self.store.0, &self.store.1).await,
            Component::Pod(p) => {
                let pod = self.pod(p)?;
                if !self.running(&pod.workload).await? {
                    api.start_container(&pod.workload, None)
                        .await
                        .map_err(|e| TargetError::Failed(format!("starting pod {p}: {e}")))?;
                }
                let url = format!("http://{}:{AGENT_PORT}", pod.ip);
                self.start_ready(&pod.agent, &url).await
            }
        }
    }

    async fn collect_logs(&self, dir: &Path) -> Result<(), TargetError> {
        std::fs::create_dir_all(dir)
            .map_err(TargetError::io(format!("creating {}", dir.display())))?;
        let mut named = vec![
            ("metadata".to_owned(), self.metadata.0.clone()),
            ("store".to_owned(), self.store.0.clone()),
        ];
        for (p, pod) in &self.pods {
            named.push((format!("agent-{p}"), pod.agent.clone()));
        }
        for (file, container) in named {
            let log = self.logs(&container, None).await?;
            let path = dir.join(format!("{file}.log"));
            std::fs::write(&path, log)
                .map_err(TargetError::io(format!("writing {}", path.display())))?;
        }
        Ok(())
    }

    async fn down(&mut self) -> Result<(), TargetError> {
        let Some(api) = self.api.clone() else {
            return Ok(());
        };
        let mut first_error = remove_run_containers(&api, &self.run).await.err();
        if let Some(net) = self.network.take() {
            match api.remove_network(&net).await {
                Ok(())
                | Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 404, ..
                }) => {}
                Err(e) => {
                    first_error
                        .get_or_insert(TargetError::Failed(format!("removing network {net}: {e}")));
                }
            }
        }
        self.pods.clear();
        first_error.map_or(Ok(()), Err)
    }
}

/// Thaws a paused container; one that is not paused is no error (as
/// SIGCONT to a running process).
pub async fn unpause(api: &bollard::Docker, name: &str) -> Result<(), TargetError> {
    match api.unpause_container(name).await {
        Err(bollard::errors::Error::DockerResponseServerError { message, .. })
            if message.contains("is not paused") =>
        {
            Ok(())
        }
        r => r.map_err(|e| TargetError::Failed(format!("unpausing {name}: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnets_that_overlap_are_skipped() {
        let base = Ipv4Addr::new(10, 210, 0, 0);
        assert!(overlaps("10.210.5.0/24", base));
        assert!(overlaps("10.0.0.0/8", base));
        assert!(!overlaps("10.211.0.0/16", base));
        assert!(!overlaps("172.17.0.0/16", base));
        assert!(!overlaps("garbage", base));
    }

    #[test]
    fn pods_get_distinct_addresses_past_the_servers() {
        let base = Ipv4Addr::new(10, 210, 0, 0);
        let ips: std::collections::HashSet<_> = (0..600).map(|i| pod_ip(base, i)).collect();
        assert_eq!(ips.len(), 600);
        assert!(
            ips.iter()
                .all(|ip| ip.octets()[..2] == [10, 210] && ip.octets()[2] >= 1)
        );
    }

    #[test]
    fn scenario_names_become_container_name_parts() {
        assert_eq!(docker_name("broadcast-200"), "broadcast-200");
        assert_eq!(docker_name("Odd name_1"), "odd-name-1");
    }

    #[test]
    fn images_are_named_as_make_images_tags_them() {
        let i = Images::new("ghcr.io/kt-dev", "abc123");
        assert_eq!(i.client, "ghcr.io/kt-dev/kt-client:abc123");
        assert_eq!(i.all().len(), 4);
    }
}
