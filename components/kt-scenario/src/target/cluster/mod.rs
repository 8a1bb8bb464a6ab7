//! What the `kind` and `k3d` targets share: a real Kubernetes cluster, the
//! project's images loaded into it, and per scenario a namespace with the
//! kustomize bundle and one StatefulSet per scenario pod.
//!
//! - A [`Session`] (one per run, shared by every scenario's target) makes
//!   sure the cluster exists (creating `kt-scenario`, or the one `KT_CLUSTER`
//!   names, unless it exists), writes its kubeconfig into a file of its own
//!   (the user's kubeconfig is never changed), loads the four images once,
//!   and at the end deletes the cluster if it created it, unless kept.
//! - A [`Cluster`] target brings one scenario up in `kt-<run>-<scenario>`:
//!   the `kt-token` Secret, a generated kustomization (bundle overlay, the
//!   agent-sidecar component, the scenario's StatefulSets, images pinned to
//!   the run's tag) rendered with `kubectl kustomize` and applied, then a
//!   `kubectl rollout status` of every workload. The runner reaches the
//!   metadata server and the store through `kubectl port-forward`s.
//! - Steps run with `kubectl exec` in the pod's `workload` container (its
//!   working directory `/work` is the pod's root). Killing a component
//!   scales its workload to zero (SIGKILL: and force-deletes its pods at
//!   once; TERM: the pod terminates gracefully) and waits until its pods are
//!   gone, so it stays down like a dead server until `start` scales it back
//!   to one and waits for the rollout and the pod's readiness. A restarted
//!   scenario pod comes back with an empty `/work`, as a real pod would.
//! - A pod's agent alone is signalled from an ephemeral container (`kubectl
//!   debug`, as the agent's uid 65532: a workload of another uid, as the
//!   examples run, may not; the pod shares one pid namespace), and the kubelet
//!   restarts it at once: `kill_agent` waits until its restart count moved
//!   ([`Target::keeps_killed_agents_down`] is false, so scenarios that
//!   expect a killed agent to stay down are skipped). A pod's readiness is
//!   its `Ready` condition (the agent's probes included); its agent's
//!   `/metrics` are read inside the pod (busybox `wget` with the operator's
//!   token), since a port-forward per pod would not scale to hundreds.
//! - Generated data sets are packed on the host and unpacked into the pods
//!   that put them ([`Target::stage_data`]); what a getter wrote is packed in
//!   the pod and unpacked into [`Target::pod_dir`] before it is verified
//!   ([`Target::fetch`]).
//!
//! Every command goes through [`shell::Shell`]: [`dry_run`] records them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kt_types::env;

use super::wrapped::{self, Chunk, Killer};
use super::{Component, ExecOutput, ExecRequest, Plan, PodProcess, Program, Target, TargetError};
use crate::format::Signal;

pub mod manifests;
pub mod shell;

use manifests::{
    AGENT_CONTAINER, AGENT_PORT, METADATA, POD_LABEL, POD_ROOT, STORE, Server, Sources, WORKLOAD,
};
use shell::{Background, Cmd, Shell, check};

/// What differs between kind and k3d: the commands that manage a cluster.
pub trait Flavor: Send + Sync + fmt::Debug {
    /// The target's name (`kind`).
    fn name(&self) -> &'static str;
    /// The program managing clusters (`kind`).
    fn tool(&self) -> &'static str;
    /// Lists clusters ([`Flavor::cluster_names`] reads its output).
    fn list(&self) -> Cmd;
    fn cluster_names(&self, stdout: &str) -> Vec<String>;
    /// Creates a cluster from the config file, leaving the user's
    /// kubeconfig alone where the tool allows it.
    fn create(&self, name: &str, config: &Path, kubeconfig: &Path) -> Cmd;
    /// Prints a cluster's kubeconfig on stdout.
    fn kubeconfig(&self, name: &str) -> Cmd;
    /// Loads images from the local Docker engine into every node.
    fn load_images(&self, name: &str, images: &[String]) -> Cmd;
    fn delete(&self, name: &str) -> Cmd;
}

/// The cluster's default name: stable, so a kept cluster is found again.
pub const DEFAULT_CLUSTER: &str = "kt-scenario";
const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a killed component's pods get to disappear.
const DELETE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a port-forward gets to say where it listens.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the kubelet gets to restart a killed agent.
const AGENT_RESTART_TIMEOUT: Duration = Duration::from_secs(120);
/// Between two looks at a pod's status.
const POLL: Duration = Duration::from_millis(500);

/// Signals every `kt-agent` process the workload container sees (`$1`:
/// the signal's name): the agent sidecar, through the pod's shared pid
/// namespace.
const SIGNAL_AGENT: &str = r#"pids=""
for d in /proc/[0-9]*; do
  [ "$(cat "$d/comm" 2>/dev/null)" = kt-agent ] && pids="$pids ${d#/proc/}"
done
[ -n "$pids" ] || { echo "no kt-agent process is visible here (is shareProcessNamespace on?)" >&2; exit 1; }
kill -s "$1" $pids"#;

/// The ephemeral container that signals a pod's agent runs as the
/// agent's user (`kubectl debug --custom`).
const SIGNALLER: &str = r#"{"securityContext": {"runAsUser": 65532, "runAsGroup": 65532}}"#;

/// Prints the agent's `/metrics` from inside its pod (`$1`: the port),
/// with the operator's token (`$2`): a pod's own may not read metrics.
const AGENT_METRICS: &str =
    r#"wget -q -O - --header "Authorization: Bearer $2" "http://127.0.0.1:$1/metrics""#;
/// The ServiceAccount the install's access map makes admin for operators
/// (`kt --kube` asks a token for it).
const OPERATOR: &str = "kt-operator";
/// How long the run's operator token lives.
const OPERATOR_TOKEN_TTL: &str = "24h";

/// Settings of a run's cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub cluster: String,
    pub keep_cluster: bool,
    /// From `KT_IMAGE_TAG`; None: [`image_tag`] asks git.
    pub image_tag: Option<String>,
    /// The repository (git revision, `testbed/<target>/`).
    pub repo: PathBuf,
    /// The kustomize bundle (`<repo>/kustomize`).
    pub kustomize: PathBuf,
    /// Where the kubeconfig and packed data go.
    pub state_dir: PathBuf,
    pub rollout_timeout: Duration,
}

impl ClusterConfig {
    /// Reads the settings through `var` (the process environment in
    /// `main`, a map in tests). Relative paths are taken from `repo`.
    pub fn from_env(
        var: impl Fn(&str) -> Option<String>,
        repo: &Path,
        state_dir: &Path,
        keep_cluster: bool,
    ) -> ClusterConfig {
        let set = |k: &str| var(k).filter(|v| !v.is_empty());
        ClusterConfig {
            cluster: set(env::CLUSTER).unwrap_or_else(|| DEFAULT_CLUSTER.to_owned()),
            // `--keep-cluster` reads KT_KEEP_CLUSTER (clap, boolish): one
            // reading of it, so `off` and `no` mean what they say.
            keep_cluster,
            image_tag: set(env::IMAGE_TAG),
            repo: repo.to_owned(),
            kustomize: repo.join(set(env::KUSTOMIZE_DIR).unwrap_or_else(|| "kustomize".into())),
            state_dir: state_dir.to_owned(),
            rollout_timeout: set(env::ROLLOUT_TIMEOUT)
                .and_then(|v| humantime::parse_duration(&v).ok())
                .unwrap_or(ROLLOUT_TIMEOUT),
        }
    }

    /// The overlay of `flavor` with the scenario's pods on the production
    /// path's identities: agent-sidecar, then agent-identity.
    fn sources(&self, flavor: &str) -> Sources {
        Sources {
            overlay: self.kustomize.join("overlays").join(flavor),
            ..Sources::production(&self.kustomize)
        }
    }

    /// `testbed/<target>/<file>`.
    pub fn cluster_config(&self, flavor: &dyn Flavor) -> PathBuf {
        let file = match flavor.name() {
            "kind" => "cluster.yaml",
            _ => "config.yaml",
        };
        self.repo.join("testbed").join(flavor.name()).join(file)
    }

    fn kubeconfig(&self) -> PathBuf {
        self.state_dir.join(format!("{}.kubeconfig", self.cluster))
    }
}

/// The command line of an exec request inside a pod's workload container.
/// The pod's environment has what every command needs (KT_METADATA_URL
/// and KT_AGENT_SOCKET from the sidecar component, KT_PROGRESS, HOME).
/// The request's token replaces the pod's own (KT_TOKEN, KT_TOKEN_FILE),
/// except where it is `identity`'s: then the command keeps the pod's own
/// identity (its projected token, on the production path).
pub fn in_pod_argv(req: &ExecRequest, identity: Option<&str>) -> Vec<String> {
    let keep = identity.is_some() && req.token.as_deref() == identity;
    let mut argv: Vec<String> = vec!["env".into(), "-u".into(), env::TOKEN.into()];
    if !keep {
        argv.extend(["-u".into(), env::TOKEN_FILE.into()]);
        if let Some(t) = &req.token {
            argv.push(format!("{}={t}", env::TOKEN));
        }
    }
    argv.extend(req.env.iter().map(|(k, v)| format!("{k}={v}")));
    match req.program {
        Program::Kt => argv.push("kt".into()),
        Program::Shell => argv.extend(["sh".into(), "-c".into()]),
        // The client image has no Python: `runs_python` is false and no
        // scenario with a python step gets here; an image that adds one
        // has it on its PATH.
        Program::Python => argv.push("python3".into()),
    }
    argv.extend(req.args.iter().cloned());
    argv
}

/// The tag of the images to deploy: `KT_IMAGE_TAG`, else the git revision
/// as `make images` tags it (`testbed/images/tag.sh`): 12 hex digits, with
/// `-dirty` when tracked files have uncommitted changes.
pub async fn image_tag(
    shell: &dyn Shell,
    repo: &Path,
    given: Option<&str>,
) -> Result<String, TargetError> {
    if let Some(t) = given {
        return Ok(t.to_owned());
    }
    let git = |args: &[&str]| {
        Cmd::new("git")
            .args(["-C", &repo.display().to_string()])
            .args(args.iter().copied())
            .local()
    };
    let rev = check(shell, &git(&["rev-parse", "--short=12", "HEAD"]))
        .await
        .map_err(|e| {
            TargetError::Failed(format!("finding the image tag (set KT_IMAGE_TAG): {e}"))
        })?;
    let status = check(
        shell,
        &git(&["status", "--porcelain", "--untracked-files=no"]),
    )
    .await?;
    let rev = rev.stdout.trim().to_owned();
    Ok(if status.stdout.trim().is_empty() {
        rev
    } else {
        format!("{rev}-dirty")
    })
}

/// The images of a tag.
pub fn images(tag: &str) -> Vec<String> {
    manifests::IMAGES
        .iter()
        .map(|i| format!("{i}:{tag}"))
        .collect()
}

#[derive(Debug, Default)]
struct SessionState {
    tag: Option<String>,
    /// This run created the cluster.
    created: bool,
}

/// One run's cluster, shared by the targets of its scenarios.
pub struct Session {
    pub flavor: Box<dyn Flavor>,
    pub shell: Arc<dyn Shell>,
    pub cfg: ClusterConfig,
    state: tokio::sync::Mutex<SessionState>,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("flavor", &self.flavor)
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Session {
    pub fn new(flavor: Box<dyn Flavor>, shell: Arc<dyn Shell>, cfg: ClusterConfig) -> Session {
        Session {
            flavor,
            shell,
            cfg,
            state: tokio::sync::Mutex::new(SessionState::default()),
        }
    }

    /// Why this session cannot run here.
    pub fn unavailable(&self) -> Option<String> {
        let name = self.flavor.name();
        let missing: Vec<&str> = [self.flavor.tool(), "kubectl", "docker"]
            .into_iter()
            .filter(|p| !self.shell.has(p))
            .collect();
        if !missing.is_empty() {
            return Some(format!(
                "the {name} target needs {}, kubectl and docker on PATH (missing: {})",
                self.flavor.tool(),
                missing.join(", ")
            ));
        }
        let overlay = self.cfg.sources(name).overlay;
        if !overlay.is_dir() {
            return Some(format!(
                "the {name} target deploys {}, which does not exist (set {})",
                overlay.display(),
                env::KUSTOMIZE_DIR
            ));
        }
        None
    }

    /// Makes sure the cluster is up with the images loaded (once per run);
    /// returns the images' tag.
    pub async fn ensure(&self) -> Result<String, TargetError> {
        let mut st = self.state.lock().await;
        if let Some(t) = &st.tag {
            return Ok(t.clone());
        }
        let sh = self.shell.as_ref();
        let tag = image_tag(sh, &self.cfg.repo, self.cfg.image_tag.as_deref()).await?;
        let imgs = images(&tag);
        // Before creating anything: the images must have been built.
        let inspect = Cmd::new("docker")
            .args(["image", "inspect", "--format", "{{.Id}}"])
            .args(imgs.iter().cloned());
        check(sh, &inspect).await.map_err(|e| {
            TargetError::Failed(format!(
                "the images {} are not in the Docker engine; build them with `make images` \
                 (or set {} to a tag that is): {e}",
                imgs.join(" "),
                env::IMAGE_TAG
            ))
        })?;
        std::fs::create_dir_all(&self.cfg.state_dir).map_err(TargetError::io(format!(
            "creating {}",
            self.cfg.state_dir.display()
        )))?;
        let name = &self.cfg.cluster;
        let listed = check(sh, &self.flavor.list()).await?;
        let kubeconfig = self.cfg.kubeconfig();
        if !self.flavor.cluster_names(&listed.stdout).contains(name) {
            // Marked first: a creation that fails half-way is still removed.
            st.created = true;
            let config = self.cfg.cluster_config(self.flavor.as_ref());
            check(sh, &self.flavor.create(name, &config, &kubeconfig)).await?;
        }
        check(sh, &self.flavor.kubeconfig(name).stdout(&kubeconfig)).await?;
        check(sh, &self.flavor.load_images(name, &imgs)).await?;
        st.tag = Some(tag.clone());
        Ok(tag)
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.cfg.kubeconfig()
    }

    /// The end of the run: deletes the cluster if this run created it and
    /// it is not kept. Idempotent.
    pub async fn finish(&self) -> Result<(), TargetError> {
        let mut st = self.state.lock().await;
        if !std::mem::take(&mut st.created) {
            return Ok(());
        }
        st.tag = None;
        if self.cfg.keep_cluster {
            return Ok(());
        }
        check(self.shell.as_ref(), &self.flavor.delete(&self.cfg.cluster)).await?;
        let _ = std::fs::remove_file(self.cfg.kubeconfig());
        Ok(())
    }

    /// What the run leaves behind, for the user.
    pub async fn kept(&self) -> Option<String> {
        let st = self.state.lock().await;
        (st.created && self.cfg.keep_cluster).then(|| {
            format!(
                "kept the {} cluster {} (kubeconfig {}); `{}` removes it",
                self.flavor.name(),
                self.cfg.cluster,
                self.cfg.kubeconfig().display(),
                self.flavor.delete(&self.cfg.cluster)
            )
        })
    }
}

/// A running `kubectl port-forward` to a server.
struct Forward {
    port: u16,
    proc: Box<dyn Background>,
}

/// Reads the local port from `kubectl port-forward`'s first lines
/// (`Forwarding from 127.0.0.1:40123 -> 8081`).
pub fn forwarded_port(line: &str) -> Option<u16> {
    let rest = line.strip_prefix("Forwarding from 127.0.0.1:")?;
    rest.split_whitespace().next()?.parse().ok()
}

/// The `kind` or `k3d` target for one scenario.
pub struct Cluster {
    session: Arc<Session>,
    shell: Arc<dyn Shell>,
    work: PathBuf,
    ns: Option<String>,
    pods: Vec<String>,
    urls: HashMap<Component, String>,
    forwards: tokio::sync::Mutex<HashMap<Component, Forward>>,
    /// The token the runner acts with: the operator's, from `kubectl create
    /// token` once the install is up.
    operator: Option<String>,
    /// The images' tag.
    tag: String,
    /// Ephemeral containers made so far (each signal needs a new name).
    signals: std::sync::atomic::AtomicUsize,
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster")
            .field("session", &self.session)
            .field("ns", &self.ns)
            .finish_non_exhaustive()
    }
}

/// Drops kubectl's own line about the remote exit code from an exec's stderr.
fn exec_stderr(s: &str) -> String {
    let mut lines: Vec<&str> = s.lines().collect();
    if lines
        .last()
        .is_some_and(|l| l.starts_with("command terminated with exit code"))
    {
        lines.pop();
        let mut out = lines.join("\n");
        if !out.is_empty() {
            out.push('\n');
        }
        out
    } else {
        s.to_owned()
    }
}

impl Cluster {
    pub fn new(session: Arc<Session>) -> Cluster {
        Cluster {
            shell: session.shell.clone(),
            session,
            work: PathBuf::new(),
            ns: None,
            pods: Vec::new(),
            urls: HashMap::new(),
            forwards: tokio::sync::Mutex::new(HashMap::new()),
            operator: None,
            tag: String::new(),
            signals: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// The namespace of the scenario (once `up` has chosen it).
    pub fn namespace(&self) -> Option<&str> {
        self.ns.as_deref()
    }

    fn kubectl(&self) -> Cmd {
        let c = Cmd::new("kubectl").args([
            "--kubeconfig".to_owned(),
            self.session.kubeconfig().display().to_string(),
        ]);
        match &self.ns {
            Some(ns) => c.args(["-n", ns.as_str()]),
            None => c,
        }
    }

    async fn run(&self, cmd: Cmd) -> Result<shell::Output, TargetError> {
        check(self.shell.as_ref(), &cmd).await
    }

    fn deploy_dir(&self) -> PathBuf {
        self.work.join("deploy")
    }

    fn server(c: &Component) -> Option<Server> {
        match c {
            Component::Metadata => Some(METADATA),
            Component::Store => Some(STORE),
            Component::Pod(_) => None,
        }
    }

    /// The workload and pod selector of a component.
    fn workload(&self, c: &Component) -> Result<(String, String), TargetError> {
        match (Cluster::server(c), c) {
            (Some(s), _) => Ok((s.workload.to_owned(), s.selector.to_owned())),
            (None, Component::Pod(p)) if self.pods.contains(p) => {
                Ok((format!("statefulset/{p}"), format!("{POD_LABEL}={p}")))
            }
            _ => Err(TargetError::Failed(format!("no {c} in this testbed"))),
        }
    }

    async fn rollout(&self, workload: &str) -> Result<(), TargetError> {
        let t = self.session.cfg.rollout_timeout;
        self.run(self.kubectl().args([
            "rollout".to_owned(),
            "status".to_owned(),
            workload.to_owned(),
            format!("--timeout={}s", t.as_secs()),
        ]))
        .await
        .map(drop)
        .map_err(|e| TargetError::Failed(format!("{workload} is not ready: {e}")))
    }

    /// `kubectl get pod` of a scenario pod, printing `jsonpath`.
    fn pod_jsonpath(&self, pod: &str, jsonpath: &str) -> Cmd {
        self.kubectl().args([
            "get".to_owned(),
            "pod".to_owned(),
            manifests::pod_name(pod),
            "-o".to_owned(),
            format!("jsonpath={jsonpath}"),
        ])
    }

    /// How often the kubelet restarted the pod's agent.
    async fn agent_restarts(&self, pod: &str) -> Result<u64, TargetError> {
        let out = self
            .run(self.pod_jsonpath(
                pod,
                &format!(
                    "{{.status.initContainerStatuses[?(@.name==\"{AGENT_CONTAINER}\")].restartCount}}"
                ),
            ))
            .await?;
        out.stdout.trim().parse().map_err(|_| {
            TargetError::Failed(format!(
                "pod {pod} reports no restart count for its {AGENT_CONTAINER} container (got {:?})",
                out.stdout.trim()
            ))
        })
    }

    /// Waits for the pod's `Ready` condition (its containers' probes, the
    /// agent sidecar's among them).
    async fn wait_pod_ready(&self, pod: &str) -> Result<(), TargetError> {
        let t = self.session.cfg.rollout_timeout;
        self.run(self.kubectl().args([
            "wait".to_owned(),
            "--for=condition=Ready".to_owned(),
            format!("pod/{}", manifests::pod_name(pod)),
            format!("--timeout={}s", t.as_secs()),
        ]))
        .await
        .map(drop)
        .map_err(|e| TargetError::Failed(format!("pod {pod} is not ready: {e}")))
    }

    /// Starts a port-forward to a server's Service on `port` (0: any) and
    /// returns once it listens.
    async fn forward(&self, c: &Component, port: u16) -> Result<String, TargetError> {
        let Some(s) = Cluster::server(c) else {
            return Err(TargetError::Failed(format!("{c} has no server")));
        };
        let cmd = self.kubectl().args([
            "port-forward".to_owned(),
            "--address=127.0.0.1".to_owned(),
            s.service.to_owned(),
            format!(
                "{}:{}",
                if port == 0 {
                    String::new()
                } else {
                    port.to_string()
                },
                s.port
            ),
        ]);
        let mut proc = self.shell.spawn(&cmd).await?;
        let found = tokio::time::timeout(FORWARD_TIMEOUT, async {
            while let Some(line) = proc.line().await {
                if let Some(p) = forwarded_port(&line) {
                    return Some(p);
                }
            }
            None
        })
        .await;
        let Ok(Some(port)) = found else {
            proc.stop().await;
            return Err(TargetError::Failed(format!(
                "`{cmd}` did not start forwarding within {FORWARD_TIMEOUT:?}"
            )));
        };
        if let Some(mut old) = self
            .forwards
            .lock()
            .await
            .insert(c.clone(), Forward { port, proc })
        {
            old.proc.stop().await;
        }
        Ok(format!("http://127.0.0.1:{port}"))
    }

    async fn stop_forward(&self, c: &Component) -> Option<u16> {
        let mut f = self.forwards.lock().await.remove(c)?;
        f.proc.stop().await;
        Some(f.port)
    }

    /// The generated files of `up`, written into the deploy dir.
    fn write_manifests(&self, plan: &Plan, ns: &str, tag: &str) -> Result<(), TargetError> {
        let cfg = &self.session.cfg;
        let src = cfg.sources(self.session.flavor.name());
        manifests::write_deploy(plan, ns, tag, &self.deploy_dir(), &src, &cfg.kustomize)
    }

    /// `kubectl exec` in a pod's workload container.
    fn exec_cmd(&self, pod: &str, stdin: bool) -> Cmd {
        let mut c = self.kubectl().arg("exec");
        if stdin {
            c = c.arg("-i");
        }
        c.args([
            manifests::pod_name(pod),
            "-c".into(),
            WORKLOAD.into(),
            "--".into(),
        ])
    }

    /// The pod-side path of `rel`, a path relative to the pod's root.
    fn in_pod(rel: &Path) -> Result<String, TargetError> {
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(TargetError::Failed(format!(
                "{} is not a path below the pod's root",
                rel.display()
            )));
        }
        Ok(rel.display().to_string())
    }
}

#[async_trait]
impl Target for Cluster {
    fn name(&self) -> &'static str {
        self.session.flavor.name()
    }

    fn unavailable(&self) -> Option<String> {
        self.session.unavailable()
    }

    async fn up(&mut self, plan: &Plan) -> Result<(), TargetError> {
        self.work = plan.work_dir.clone();
        self.pods = plan.pods.iter().map(|p| p.name.clone()).collect();
        let tag = self.session.ensure().await?;
        self.tag.clone_from(&tag);
        super::local::make_pod_dirs(plan)?;
        let ns = manifests::namespace(&plan.run_id, &plan.scenario);
        self.write_manifests(plan, &ns, &tag)?;
        let dir = self.deploy_dir();
        // Set first: `down` removes even a half-made namespace.
        self.ns = Some(ns.clone());
        let kc = self.session.kubeconfig().display().to_string();
        let global = || Cmd::new("kubectl").args(["--kubeconfig", kc.as_str()]);
        self.run(global().args(["create", "namespace", ns.as_str()]))
            .await?;
        self.run(global().args([
            "label".to_owned(),
            "namespace".to_owned(),
            ns.clone(),
            format!("{}={}", manifests::MANAGED_BY.0, manifests::MANAGED_BY.1),
            format!("kt.dev/run={}", plan.run_id),
        ]))
        .await?;
        let rendered = dir.join("rendered.yaml");
        self.run(
            Cmd::new("kubectl")
                .args(["kustomize".to_owned(), dir.display().to_string()])
                .stdout(&rendered)
                .local(),
        )
        .await
        .map_err(|e| TargetError::Failed(format!("rendering {}: {e}", dir.display())))?;
        self.run(self.kubectl().args([
            "apply".to_owned(),
            "-f".to_owned(),
            rendered.display().to_string(),
        ]))
        .await?;
        let mut workloads = vec![METADATA.workload.to_owned(), STORE.workload.to_owned()];
        workloads.extend(self.pods.iter().map(|p| format!("statefulset/{p}")));
        for w in &workloads {
            self.rollout(w).await?;
        }
        // The runner is an operator: what `kubectl create token kt-operator
        // --audience kt` hands out (`kt --kube` asks the same).
        let token = self
            .run(self.kubectl().args([
                "create",
                "token",
                OPERATOR,
                "--audience",
                "kt",
                "--duration",
                OPERATOR_TOKEN_TTL,
            ]))
            .await
            .map_err(|e| TargetError::Failed(format!("a token for {OPERATOR}: {e}")))?;
        self.operator = Some(token.stdout.trim().to_owned());
        for c in [Component::Metadata, Component::Store] {
            let url = self.forward(&c, 0).await?;
            self.urls.insert(c, url);
        }
        Ok(())
    }

    fn operator_token(&self) -> Option<String> {
        self.operator.clone()
    }

    fn aliases(&self) -> Vec<(String, String)> {
        manifests::aliases(&self.pods, self.ns.as_deref().unwrap_or_default())
    }

    fn metadata_url(&self) -> String {
        self.urls
            .get(&Component::Metadata)
            .cloned()
            .unwrap_or_default()
    }

    /// Pods' agents have none: a port-forward per pod would not scale to
    /// the scenarios' hundreds of pods.
    fn component_url(&self, c: &Component) -> Option<String> {
        self.urls.get(c).cloned()
    }

    fn pod_dir(&self, pod: &str) -> PathBuf {
        self.work.join("pods").join(pod)
    }

    fn data_path(&self, pod: &str, host: &Path) -> Result<String, TargetError> {
        let rel = host.strip_prefix(&self.work).map_err(|_| {
            TargetError::Failed(format!(
                "{} is not below the scenario's work dir, so pod {pod} cannot see it",
                host.display()
            ))
        })?;
        Ok(Path::new(POD_ROOT).join(rel).display().to_string())
    }

    async fn stage_data(&self, uses: &[(String, PathBuf)]) -> Result<(), TargetError> {
        let stage = self.work.join("stage");
        std::fs::create_dir_all(&stage)
            .map_err(TargetError::io(format!("creating {}", stage.display())))?;
        let mut packed: BTreeMap<PathBuf, PathBuf> = BTreeMap::new();
        for (pod, host) in uses {
            let tar = match packed.get(host) {
                Some(t) => t.clone(),
                None => {
                    let rel = host.strip_prefix(&self.work).map_err(|_| {
                        TargetError::Failed(format!("{} is not below the work dir", host.display()))
                    })?;
                    let tar = stage.join(format!("{}.tar", packed.len()));
                    self.run(Cmd::new("tar").args([
                        "-C".to_owned(),
                        self.work.display().to_string(),
                        "-cf".to_owned(),
                        tar.display().to_string(),
                        rel.display().to_string(),
                    ]))
                    .await?;
                    packed.insert(host.clone(), tar.clone());
                    tar
                }
            };
            self.run(
                self.exec_cmd(pod, true)
                    .args(["tar", "-C", POD_ROOT, "-xf", "-"])
                    .stdin(&tar),
            )
            .await
            .map_err(|e| TargetError::Failed(format!("copying data into pod {pod}: {e}")))?;
        }
        Ok(())
    }

    async fn fetch(&self, pod: &str, rel: &Path) -> Result<(), TargetError> {
        let in_pod = Cluster::in_pod(rel)?;
        let dir = self.work.join("fetch");
        std::fs::create_dir_all(&dir)
            .map_err(TargetError::io(format!("creating {}", dir.display())))?;
        let tar = dir.join(format!("{pod}.tar"));
        self.run(
            self.exec_cmd(pod, false)
                .args(["tar", "-C", POD_ROOT, "-cf", "-", in_pod.as_str()])
                .stdout(&tar),
        )
        .await
        .map_err(|e| TargetError::Failed(format!("copying {in_pod} out of pod {pod}: {e}")))?;
        let host = self.pod_dir(pod);
        // What an earlier fetch brought must not mix with this one.
        let target = host.join(rel);
        if target.is_dir() {
            let _ = std::fs::remove_dir_all(&target);
        } else {
            let _ = std::fs::remove_file(&target);
        }
        std::fs::create_dir_all(&host)
            .map_err(TargetError::io(format!("creating {}", host.display())))?;
        self.run(Cmd::new("tar").args([
            "-C".to_owned(),
            host.display().to_string(),
            "-xf".to_owned(),
            tar.display().to_string(),
        ]))
        .await
        .map(drop)
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecOutput, TargetError> {
        if !self.pods.contains(&req.pod) {
            return Err(TargetError::Failed(format!("no pod named {}", req.pod)));
        }
        let cmd = self
            .exec_cmd(&req.pod, false)
            .args(in_pod_argv(&req, self.operator.as_deref()));
        let started = Instant::now();
        let out = self.shell.run(&cmd).await?;
        Ok(ExecOutput {
            status: out.status,
            stdout: out.stdout,
            stderr: exec_stderr(&out.stderr),
            duration: started.elapsed(),
        })
    }

    /// `kubectl exec` drops the remote stderr of a spawned command here,
    /// so the command's stderr comes on its stdout.
    async fn spawn(&self, req: ExecRequest) -> Result<Box<dyn PodProcess>, TargetError> {
        if !self.pods.contains(&req.pod) {
            return Err(TargetError::Failed(format!("no pod named {}", req.pod)));
        }
        let cmd = self.exec_cmd(&req.pod, false).args(wrapped::wrap(
            in_pod_argv(&req, self.operator.as_deref()),
            true,
        ));
        let background = self.shell.spawn(&cmd).await?;
        let chunks = futures::stream::unfold(background, |mut b| async move {
            let line = b.line().await?;
            Some((Chunk::Stdout(format!("{line}\n").into_bytes()), b))
        });
        let (shell, exec) = (self.shell.clone(), self.exec_cmd(&req.pod, false));
        let killer: Killer = Arc::new(move |signal, pid| {
            let (shell, cmd) = (
                shell.clone(),
                exec.clone().args(wrapped::kill_argv(signal, pid)),
            );
            Box::pin(async move { check(shell.as_ref(), &cmd).await.map(drop) })
        });
        Ok(Box::new(wrapped::start(Box::pin(chunks), killer, true)))
    }

    async fn pod_ip(&self, pod: &str) -> Result<String, TargetError> {
        let out = self
            .run(self.kubectl().args([
                "get".to_owned(),
                "pod".to_owned(),
                manifests::pod_name(pod),
                "-o".to_owned(),
                "jsonpath={.status.podIP}".to_owned(),
            ]))
            .await?;
        let ip = out.stdout.trim();
        if ip.is_empty() {
            return Err(TargetError::Failed(format!("pod {pod} has no address yet")));
        }
        Ok(ip.to_owned())
    }

    fn keeps_killed_agents_down(&self) -> bool {
        false
    }

    /// Signals the agent from the workload container and waits until the
    /// kubelet has seen it die (its restart count moved); it is being
    /// started again by then.
    async fn kill_agent(&self, pod: &str, signal: Signal) -> Result<(), TargetError> {
        if !self.pods.contains(&pod.to_owned()) {
            return Err(TargetError::Failed(format!("no pod named {pod}")));
        }
        let before = self.agent_restarts(pod).await?;
        // A workload of its own user may not signal the agent: an
        // ephemeral container as the agent's user does (what an operator
        // would do with `kubectl debug`).
        let custom = self.deploy_dir().join("signal-agent.json");
        std::fs::write(&custom, SIGNALLER)
            .map_err(TargetError::io(format!("writing {}", custom.display())))?;
        let n = self
            .signals
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let image = format!("{}:{}", manifests::IMAGES[3], self.tag);
        self.run(self.kubectl().args([
            "debug".to_owned(),
            manifests::pod_name(pod),
            format!("--image={image}"),
            format!("--target={AGENT_CONTAINER}"),
            "--profile=restricted".to_owned(),
            format!("--custom={}", custom.display()),
            format!("--container=kt-signal-{n}"),
            "--attach=false".to_owned(),
            "--".to_owned(),
            "sh".to_owned(),
            "-c".to_owned(),
            SIGNAL_AGENT.to_owned(),
            "signal-agent".to_owned(),
            signal.name().to_owned(),
        ]))
        .await
        .map_err(|e| TargetError::Failed(format!("signalling the agent of pod {pod}: {e}")))?;
        let deadline = Instant::now() + AGENT_RESTART_TIMEOUT;
        loop {
            if self.agent_restarts(pod).await? > before {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(TargetError::Failed(format!(
                    "the agent of pod {pod} got {}, but the kubelet did not restart it within {AGENT_RESTART_TIMEOUT:?}",
                    signal.name()
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    async fn ready(&self, c: &Component) -> Result<bool, TargetError> {
        let Component::Pod(pod) = c else {
            return Err(TargetError::Failed(format!(
                "{c} is reached through its port-forward"
            )));
        };
        let out = self
            .shell
            .run(&self.pod_jsonpath(pod, r#"{.status.conditions[?(@.type=="Ready")].status}"#))
            .await?;
        if !out.success() {
            // A pod scaled away is not ready; anything else is an error.
            return if out.stderr.contains("NotFound") || out.stderr.contains("not found") {
                Ok(false)
            } else {
                Err(TargetError::Failed(format!(
                    "asking whether pod {pod} is ready: {}",
                    out.stderr.trim()
                )))
            };
        }
        Ok(out.stdout.trim() == "True")
    }

    async fn metrics(&self, c: &Component) -> Result<String, TargetError> {
        let Component::Pod(pod) = c else {
            return Err(TargetError::Failed(format!(
                "{c} is reached through its port-forward"
            )));
        };
        self.run(self.exec_cmd(pod, false).args([
            "sh".to_owned(),
            "-c".to_owned(),
            AGENT_METRICS.to_owned(),
            "agent-metrics".to_owned(),
            AGENT_PORT.to_string(),
            self.operator.clone().unwrap_or_default(),
        ]))
        .await
        .map(|o| o.stdout)
        .map_err(|e| TargetError::Failed(format!("reading the agent metrics of pod {pod}: {e}")))
    }

    async fn kill(&self, c: &Component, signal: Signal) -> Result<(), TargetError> {
        if signal.freezes() {
            return Err(TargetError::Unavailable(format!(
                "the {} target cannot freeze {c} (kill -{})",
                self.name(),
                signal.name()
            )));
        }
        let (workload, selector) = self.workload(c)?;
        self.run(
            self.kubectl()
                .args(["scale", workload.as_str(), "--replicas=0"]),
        )
        .await?;
        if signal == Signal::KILL {
            self.run(self.kubectl().args([
                "delete",
                "pod",
                "-l",
                selector.as_str(),
                "--grace-period=0",
                "--force",
                "--ignore-not-found",
            ]))
            .await?;
        }
        let pods = self
            .run(
                self.kubectl()
                    .args(["get", "pods", "-l", selector.as_str(), "-o", "name"]),
            )
            .await?;
        for p in pods.stdout.split_whitespace() {
            self.run(self.kubectl().args([
                "wait".to_owned(),
                "--for=delete".to_owned(),
                p.to_owned(),
                format!("--timeout={}s", DELETE_TIMEOUT.as_secs()),
            ]))
            .await?;
        }
        // Its forward has nothing to reach; the URL stays, refusing
        // connections, until `start`.
        self.stop_forward(c).await;
        Ok(())
    }

    async fn start(&self, c: &Component) -> Result<(), TargetError> {
        let (workload, _) = self.workload(c)?;
        self.run(
            self.kubectl()
                .args(["scale", workload.as_str(), "--replicas=1"]),
        )
        .await?;
        self.rollout(&workload).await?;
        if let Component::Pod(p) = c {
            // A rollout that saw nothing to do (only the agent restarted)
            // says nothing about the pod: its Ready condition does.
            self.wait_pod_ready(p).await?;
        }
        if Cluster::server(c).is_some() {
            // The same local port: clients hold the URL.
            let port = self
                .urls
                .get(c)
                .and_then(|u| u.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            self.stop_forward(c).await;
            self.forward(c, port).await?;
        }
        Ok(())
    }

    async fn collect_logs(&self, dir: &Path) -> Result<(), TargetError> {
        if self.ns.is_none() {
            return Ok(());
        }
        std::fs::create_dir_all(dir)
            .map_err(TargetError::io(format!("creating {}", dir.display())))?;
        let mut errors = Vec::new();
        let to = |name: &str| dir.join(name);
        for (args, file) in [
            (
                vec![
                    "get",
                    "events",
                    "--sort-by=.metadata.creationTimestamp",
                    "-o",
                    "wide",
                ],
                "events.txt",
            ),
            (
                vec!["get", "all,pvc,networkpolicy", "-o", "wide"],
                "resources.txt",
            ),
            (vec!["describe", "pods"], "pods.txt"),
        ] {
            if let Err(e) = self.run(self.kubectl().args(args).stdout(to(file))).await {
                errors.push(e.to_string());
            }
        }
        let listed = self
            .run(self.kubectl().args(["get", "pods", "-o", "json"]))
            .await?;
        let pods: serde_json::Value = serde_json::from_str(&listed.stdout).unwrap_or_default();
        for pod in pods["items"].as_array().into_iter().flatten() {
            let Some(name) = pod["metadata"]["name"].as_str() else {
                continue;
            };
            let restarts: HashMap<&str, u64> = ["initContainerStatuses", "containerStatuses"]
                .iter()
                .flat_map(|k| pod["status"][k].as_array().into_iter().flatten())
                .filter_map(|s| Some((s["name"].as_str()?, s["restartCount"].as_u64()?)))
                .collect();
            let containers = ["initContainers", "containers"]
                .iter()
                .flat_map(|k| pod["spec"][k].as_array().into_iter().flatten())
                .filter_map(|c| c["name"].as_str());
            for c in containers {
                let mut runs = vec![(false, format!("{name}.{c}.log"))];
                if restarts.get(c).copied().unwrap_or(0) > 0 {
                    runs.push((true, format!("{name}.{c}.previous.log")));
                }
                for (previous, file) in runs {
                    let mut cmd = self.kubectl().args(["logs", name, "-c", c, "--timestamps"]);
                    if previous {
                        cmd = cmd.arg("--previous");
                    }
                    if let Err(e) = self.run(cmd.stdout(to(&file))).await {
                        errors.push(e.to_string());
                    }
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(TargetError::Failed(errors.join("; ")))
        }
    }

    async fn down(&mut self) -> Result<(), TargetError> {
        let comps: Vec<Component> = self.forwards.lock().await.keys().cloned().collect();
        for c in comps {
            self.stop_forward(&c).await;
        }
        let Some(ns) = self.ns.take() else {
            return Ok(());
        };
        // Not waited for: the next scenario has a namespace of its own.
        let kc = self.session.kubeconfig().display().to_string();
        let del = Cmd::new("kubectl").args([
            "--kubeconfig",
            kc.as_str(),
            "delete",
            "namespace",
            ns.as_str(),
            "--ignore-not-found",
            "--wait=false",
        ]);
        if let Err(e) = check(self.shell.as_ref(), &del).await {
            self.ns = Some(ns);
            return Err(e);
        }
        Ok(())
    }
}

/// The pods that put each generated data set, from the scenario's steps.
pub type DataUses = Vec<(String, PathBuf)>;

/// The plan of a scenario on a cluster target, without a cluster: every
/// command `up`, staging, a failure's log collection, `down` and the end
/// of the run would issue, and the generated manifests. `shell` is a
/// [`shell::Recorder`] (executing local commands or not).
pub async fn dry_run(
    session: Arc<Session>,
    recorder: &shell::Recorder,
    plan: &Plan,
    uses: &DataUses,
) -> String {
    let mut t = Cluster::new(session.clone());
    let mut out = String::new();
    let section = |title: &str, r: Result<(), TargetError>, out: &mut String| {
        out.push_str(&format!("## {title}\n"));
        for c in recorder
            .commands
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default()
        {
            out.push_str(&format!("{c}\n"));
        }
        if let Err(e) = r {
            out.push_str(&format!("# failed: {e}\n"));
        }
        out.push('\n');
    };
    let r = t.up(plan).await;
    section("up", r, &mut out);
    let r = t.stage_data(uses).await;
    section("stage data", r, &mut out);
    if let Some(p) = plan.pods.first() {
        let r = t
            .exec(ExecRequest {
                pod: p.name.clone(),
                program: Program::Kt,
                args: vec!["ls".into(), plan.scenario.clone()],
                env: vec![],
                token: Some(plan.token.clone()),
            })
            .await
            .map(drop);
        section("e.g. a step: `kt ls` in the first pod", r, &mut out);
        let r = t.fetch(&p.name, Path::new("get/key")).await;
        section("e.g. before verifying what a getter wrote", r, &mut out);
        let r = t.kill(&Component::Store, Signal::KILL).await;
        section("e.g. kill store (KILL)", r, &mut out);
        let r = t.start(&Component::Store).await;
        section("e.g. start store", r, &mut out);
        let pod = Component::Pod(p.name.clone());
        let r = async {
            t.kill_agent(&p.name, Signal::TERM).await?;
            t.start(&pod).await
        }
        .await;
        section(
            "e.g. restart the first pod's agent (`restart: { agent }`)",
            r,
            &mut out,
        );
        let r = t.ready(&pod).await.map(drop);
        section("e.g. wait for the first pod to be ready", r, &mut out);
        let r = t.metrics(&pod).await.map(drop);
        section("e.g. the metrics of the first pod's agent", r, &mut out);
    }
    let r = t.collect_logs(&plan.work_dir.join("logs")).await;
    section("on failure", r, &mut out);
    let r = t.down().await;
    section("down", r, &mut out);
    let r = session.finish().await;
    section("end of the run", r, &mut out);
    let dir = plan.work_dir.join("deploy");
    for f in [
        "kustomization.yaml",
        "pods.yaml",
        "access.yaml",
        "rendered.yaml",
    ] {
        let text = std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        if !text.is_empty() {
            out.push_str(&format!("## {}\n{text}\n", dir.join(f).display()));
        }
    }
    out
}

/// The settings from the process environment (`kt-scenario`'s `main`):
/// the repository is the current directory, the state goes below the work
/// root.
pub fn config_from_env(work_root: &Path, keep_cluster: bool) -> ClusterConfig {
    let repo = std::env::current_dir().unwrap_or_default();
    ClusterConfig::from_env(|k| std::env::var(k).ok(), &repo, work_root, keep_cluster)
}

/// Where the dry run says the port-forwards listen.
pub const DRY_RUN_PORTS: [(&str, &str); 2] = [
    ("svc/kt-metadata", "Forwarding from 127.0.0.1:43081 -> 8081"),
    ("svc/kt-store", "Forwarding from 127.0.0.1:43082 -> 8082"),
];

/// The plan of scenario `l` on a cluster target (`kt-scenario run --dry-run`):
/// a fresh session (so the cluster's own commands show) over a
/// [`shell::Recorder`], which runs nothing that touches a cluster or the
/// Docker engine; with `execute_local` it runs git (the image tag) and
/// `kubectl kustomize` (the rendered manifests). The generated files are
/// left in the scenario's work dir below `work_root`.
#[allow(clippy::too_many_arguments)]
pub async fn plan_scenario(
    flavor: Box<dyn Flavor>,
    cfg: ClusterConfig,
    execute_local: bool,
    l: &crate::validate::Loaded,
    run_id: &str,
    work_root: &Path,
    bin_dir: &Path,
    token: &str,
) -> String {
    let mut rec = shell::Recorder::new();
    if execute_local {
        rec = rec.executing_local();
    }
    for (svc, line) in DRY_RUN_PORTS {
        rec = rec.prints(svc, &[line]);
    }
    // So that the plan shows the wait for a killed store's pod, and the
    // kubelet restarting a killed agent.
    rec = rec
        .answer(
            &format!("get pods -l {} -o name", STORE.selector),
            shell::Output::ok("pod/kt-store-0\n"),
        )
        .answers(
            ".restartCount}",
            vec![shell::Output::ok("0"), shell::Output::ok("1")],
        )
        .answer("type==\"Ready\"", shell::Output::ok("True"));
    let rec = Arc::new(rec);
    let name = flavor.name();
    let session = Arc::new(Session::new(flavor, rec.clone(), cfg));
    if let Some(why) = crate::runner::unsupported(l, &Cluster::new(session.clone())) {
        return format!(
            "# kt-scenario plan: scenario {} on {name}: skipped: {why}\n",
            l.name
        );
    }
    let work = work_root.join(format!("{}-{run_id}", l.name));
    let plan = crate::runner::scenario_plan(l, run_id, &work, bin_dir, token);
    let data: BTreeMap<String, PathBuf> = l
        .scenario
        .data
        .keys()
        .map(|k| (k.clone(), work.join("data").join(k)))
        .collect();
    let uses = crate::runner::data_uses(l, &plan.pods, &data);
    let mut out = format!(
        "# kt-scenario plan: scenario {} on {name}, namespace {}, {} pod(s); nothing was run\n\n",
        l.name,
        manifests::namespace(run_id, &l.name),
        plan.pods.len()
    );
    out.push_str(&dry_run(session, &rec, &plan, &uses).await);
    out
}
