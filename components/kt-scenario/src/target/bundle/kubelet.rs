//! The bundle's kubelet: a pod of the rendered install as containers of
//! the Docker engine, run as a kubelet runs it.
//!
//! - **Sandbox.** A pause-like container (the client image's shell,
//!   idle) owns the pod's network namespace (its address on the run's
//!   network, and a DNS alias for every Service name that reaches it),
//!   its IPC namespace and, with `shareProcessNamespace`, its pid
//!   namespace; every container of the pod joins them.
//! - **Volumes.** emptyDir: a directory of the run (mode 0777, the fsGroup's
//!   with setgid), or with `medium: Memory` a tmpfs volume of the engine
//!   (its `sizeLimit` the tmpfs size); configMap, secret, downwardAPI and
//!   projected volumes (ServiceAccount tokens issued by the scripted API
//!   for the pod, with their audience and expiry): files written with the
//!   volume's modes, owned by root and the pod's fsGroup; PVCs (and a
//!   StatefulSet's claims): a directory per claim that outlives the pod;
//!   the ServiceAccount's API token, CA and namespace at
//!   /var/run/secrets/kubernetes.io/serviceaccount unless
//!   `automountServiceAccountToken: false`; a hostPath (DirectoryOrCreate,
//!   or a Directory already there): a directory of the pod's node below
//!   the run's `nodes/<node>/`, shared by that node's pods.
//! - **Containers.** Image, command/args (with `$(VAR)` expansion), the
//!   environment ([`super::install::environment`]), workingDir, the
//!   effective securityContext (runAsUser/Group, fsGroup and
//!   supplementalGroups, runAsNonRoot checked against the image's user as
//!   the kubelet does, readOnlyRootFilesystem, capabilities,
//!   allowPrivilegeEscalation, privileged, seccomp), and CPU and memory
//!   limits.
//! - **Order and probes.** Init containers run one by one to success; a
//!   native sidecar (an init container with `restartPolicy: Always`)
//!   starts and must pass its startup probe before the next one; then the
//!   containers start, each must pass its startup probe, and the pod is up
//!   when every readiness probe passes. Liveness probes run for as long as
//!   the pod does: a container failing its threshold is recorded as a
//!   fault ([`Kubelet::faults`]), which fails the scenario's next step.
//!
//! Not emulated (docs/deployment.md says so too): scheduling, restarts (a
//! container that exits stays down, so a crash is a failure, not a
//! CrashLoopBackOff), evictions (sizeLimit of a disk emptyDir, ephemeral
//! storage), token rotation (tokens live their full expiry), readiness
//! gating Service endpoints (a Service name always resolves to its pods).

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bollard::Docker as Api;
use bollard::models::{
    ContainerCreateBody, EndpointIpamConfig, EndpointSettings, HostConfig, Mount, MountType,
    NetworkingConfig, VolumeCreateRequest,
};
use bollard::query_parameters::CreateContainerOptionsBuilder;
use k8s_openapi::api::core::v1::{Container, PodSecurityContext, Probe, SecurityContext};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio_util::sync::CancellationToken;

use super::api::{API_AUDIENCE, ScriptedApi};
use super::install::{
    Downward, Install, PodInstance, Subject, environment, expand, field, named_port, secret_entries,
};
use crate::format::Signal;
use crate::target::TargetError;
use crate::target::docker::{self, InContainer, RUN_LABEL, SIDECAR_LABEL};

/// The longest a pod gets to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Where the kubelet mounts the ServiceAccount's API credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Between two readiness probes while waiting for a pod (faster than the
/// probes' own periods: the testbed waits on them).
const READY_POLL: Duration = Duration::from_millis(250);

fn failed(s: impl Into<String>) -> TargetError {
    TargetError::Failed(s.into())
}

/// What a container is to its pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// An init container: runs to success before the next.
    Init,
    /// A native sidecar: an init container with `restartPolicy: Always`.
    Sidecar,
    App,
}

#[derive(Debug, Clone)]
pub struct Ctr {
    pub name: String,
    /// The engine's container name.
    pub docker: String,
    pub role: Role,
    pub spec: Container,
}

/// A pod the kubelet made.
#[derive(Debug)]
pub struct PodRun {
    pub inst: PodInstance,
    pub ip: Ipv4Addr,
    pub sandbox: String,
    /// In start order: init containers and sidecars as listed, then the
    /// containers.
    pub containers: Vec<Ctr>,
    /// Each volume's directory on this host (volumes the engine keeps,
    /// tmpfs ones, have none).
    pub dirs: BTreeMap<String, PathBuf>,
    monitors: Mutex<Option<CancellationToken>>,
}

impl PodRun {
    /// How long its containers get between TERM and KILL.
    pub fn grace(&self) -> Duration {
        let secs = self
            .inst
            .spec
            .termination_grace_period_seconds
            .unwrap_or(30);
        Duration::from_secs(u64::try_from(secs).unwrap_or(0))
    }

    /// Ends its liveness probes (a pod stopped, or the run torn down).
    pub fn stop_monitors(&self) {
        if let Some(m) = lock(&self.monitors).take() {
            m.cancel();
        }
    }

    pub fn container(&self, name: &str) -> Option<&Ctr> {
        self.containers.iter().find(|c| c.name == name)
    }

    /// The host directory behind `path` in container `ctr` (a mount of a
    /// directory volume, and the path below it).
    pub fn host_path(&self, ctr: &str, path: &str) -> Option<PathBuf> {
        let c = self.container(ctr)?;
        c.spec
            .volume_mounts
            .iter()
            .flatten()
            .filter(|m| Path::new(path).starts_with(&m.mount_path))
            .max_by_key(|m| m.mount_path.len())
            .and_then(|m| {
                let rest = Path::new(path).strip_prefix(&m.mount_path).ok()?;
                let base = self.dirs.get(&m.name)?;
                Some(
                    base.join(m.sub_path.as_deref().unwrap_or_default())
                        .join(rest),
                )
            })
    }
}

/// Runs pods on the engine.
#[derive(Debug)]
pub struct Kubelet {
    pub docker: Api,
    /// The run's label value (containers, volumes, the network).
    pub run: String,
    pub network: String,
    /// Where volumes' directories go.
    pub dir: PathBuf,
    pub kube: Arc<ScriptedApi>,
    pub install: Arc<Install>,
    /// The sandbox's image (a shell that idles).
    pub pause_image: String,
    /// The "node" the pods are on.
    pub node: String,
    http: reqwest::Client,
    faults: Arc<Mutex<Vec<String>>>,
    /// Each pod's address, for service links.
    addrs: Mutex<HashMap<String, Ipv4Addr>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A Kubernetes quantity (`512Mi`, `2Gi`, `1`, `500m`) as a number of
/// units (bytes, or CPUs).
pub fn quantity(q: &str) -> Option<f64> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (num, unit) = q.split_at(split);
    let n: f64 = num.parse().ok()?;
    let mult = match unit {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0f64.powi(4),
        _ => return None,
    };
    Some(n * mult)
}

/// The identity a container runs as: uid, gid, extra groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub uid: Option<i64>,
    pub gid: Option<i64>,
    pub groups: Vec<i64>,
    pub non_root: bool,
}

/// The container's effective identity: its own securityContext over the
/// pod's.
pub fn identity(pod: Option<&PodSecurityContext>, c: Option<&SecurityContext>) -> Identity {
    let p = pod.cloned().unwrap_or_default();
    let c = c.cloned().unwrap_or_default();
    let mut groups: Vec<i64> = p.supplemental_groups.clone().unwrap_or_default();
    if let Some(fs) = p.fs_group {
        groups.push(fs);
    }
    Identity {
        uid: c.run_as_user.or(p.run_as_user),
        gid: c.run_as_group.or(p.run_as_group),
        groups,
        non_root: c.run_as_non_root.or(p.run_as_non_root).unwrap_or(false),
    }
}

/// The engine's settings for a container's securityContext (what of it
/// is about privileges), or why it cannot be run.
pub fn security(
    c: Option<&SecurityContext>,
    pod: Option<&PodSecurityContext>,
) -> Result<HostConfig, String> {
    let sc = c.cloned().unwrap_or_default();
    let mut host = HostConfig {
        readonly_rootfs: sc.read_only_root_filesystem,
        privileged: sc.privileged,
        ..Default::default()
    };
    let mut opts = Vec::new();
    if sc.allow_privilege_escalation == Some(false) {
        opts.push("no-new-privileges".to_owned());
    }
    let seccomp = sc
        .seccomp_profile
        .clone()
        .or_else(|| pod.and_then(|p| p.seccomp_profile.clone()));
    match seccomp.as_ref().map(|s| s.type_.as_str()) {
        None | Some("RuntimeDefault") => {}
        Some("Unconfined") => opts.push("seccomp=unconfined".to_owned()),
        Some(other) => return Err(format!("seccompProfile {other} is not emulated")),
    }
    if let Some(caps) = &sc.capabilities {
        host.cap_drop = caps.drop.clone();
        host.cap_add = caps.add.clone();
    }
    if !opts.is_empty() {
        host.security_opt = Some(opts);
    }
    Ok(host)
}

/// The numeric user an image runs as, as the kubelet reads it for
/// `runAsNonRoot`: None for a name it cannot verify.
pub fn image_uid(user: &str) -> Option<i64> {
    let u = user.split(':').next().unwrap_or_default();
    if u.is_empty() {
        return Some(0);
    }
    u.parse().ok()
}

/// `rel` below `dir`, as the API server validates a volume's item paths,
/// keys and subPaths: relative, without `..`. (Here such a path would be
/// one on this host.)
fn below(dir: &Path, rel: &str) -> Result<PathBuf, TargetError> {
    let p = Path::new(rel);
    let escapes = p.is_absolute()
        || p.components()
            .any(|c| matches!(c, std::path::Component::ParentDir));
    if escapes {
        return Err(failed(format!(
            "path {rel:?} leaves its volume: the API server refuses it"
        )));
    }
    Ok(dir.join(p))
}

/// Writes a volume's file as the kubelet does: root's, the fsGroup's with
/// group read (the kubelet's mask for read-only volumes), in `mode`.
fn write_file(path: &Path, data: &[u8], mode: u32, gid: Option<u32>) -> Result<(), TargetError> {
    let mode = if gid.is_some() { mode | 0o440 } else { mode };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(TargetError::io(format!("creating {}", parent.display())))?;
    }
    std::fs::write(path, data).map_err(TargetError::io(format!("writing {}", path.display())))?;
    std::os::unix::fs::chown(path, Some(0), gid)
        .map_err(TargetError::io(format!("chown {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(TargetError::io(format!("chmod {}", path.display())))
}

fn make_dir(path: &Path, mode: u32, gid: Option<u32>) -> Result<(), TargetError> {
    std::fs::create_dir_all(path)
        .map_err(TargetError::io(format!("creating {}", path.display())))?;
    if let Some(g) = gid {
        std::os::unix::fs::chown(path, Some(0), Some(g))
            .map_err(TargetError::io(format!("chown {}", path.display())))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(TargetError::io(format!("chmod {}", path.display())))
}

/// A downward API volume's (or projection's) files: each item's field.
fn write_downward(
    items: &[k8s_openapi::api::core::v1::DownwardAPIVolumeFile],
    dir: &Path,
    mode: u32,
    gid: Option<u32>,
    d: &Downward<'_>,
    who: &str,
) -> Result<(), TargetError> {
    for i in items {
        let f = i
            .field_ref
            .as_ref()
            .ok_or_else(|| failed(format!("{who}: only fieldRef items are emulated")))?;
        let value = field(&f.field_path, d).map_err(|e| failed(format!("{who}: {e}")))?;
        write_file(
            &below(dir, &i.path)?,
            value.as_bytes(),
            mode_of(i.mode, mode),
            gid,
        )?;
    }
    Ok(())
}

fn mode_of(m: Option<i32>, default: u32) -> u32 {
    m.and_then(|m| u32::try_from(m).ok()).unwrap_or(default) & 0o7777
}

impl Kubelet {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        docker: Api,
        run: String,
        network: String,
        dir: PathBuf,
        kube: Arc<ScriptedApi>,
        install: Arc<Install>,
        pause_image: String,
    ) -> Kubelet {
        Kubelet {
            docker,
            run,
            network,
            dir,
            kube,
            install,
            pause_image,
            node: "kt-bundle-node".into(),
            http: kt_api::client_builder()
                .danger_accept_invalid_certs(true)
                .build()
                .unwrap_or_default(),
            faults: Arc::default(),
            addrs: Mutex::default(),
        }
    }

    /// What went wrong while pods ran (liveness probes that failed).
    pub fn faults(&self) -> Vec<String> {
        lock(&self.faults).clone()
    }

    fn labels(&self, pod: &str, sidecar: bool) -> HashMap<String, String> {
        let mut l = HashMap::from([
            (RUN_LABEL.to_owned(), self.run.clone()),
            ("kt.dev/testbed".to_owned(), "bundle".to_owned()),
            ("kt.dev/bundle-pod".to_owned(), pod.to_owned()),
        ]);
        if sidecar {
            l.insert(SIDECAR_LABEL.to_owned(), "true".to_owned());
        }
        l
    }

    fn docker_name(&self, pod: &str, what: &str) -> String {
        format!(
            "kt-{}-{}-{}",
            self.run,
            docker::docker_name(pod),
            docker::docker_name(what)
        )
    }

    /// The node `pod` runs on: its DaemonSet's node, else the testbed's
    /// one.
    pub fn node_of<'a>(&'a self, pod: &'a PodInstance) -> &'a str {
        pod.node.as_deref().unwrap_or(&self.node)
    }

    /// The directory of this machine behind `path` of `node`'s file
    /// system (a hostPath): below the run's `nodes/<node>/`.
    pub fn node_path(&self, node: &str, path: &str) -> Result<PathBuf, TargetError> {
        below(
            &below(&self.dir.join("nodes"), node)?,
            path.trim_start_matches('/'),
        )
    }

    /// Records the pods' addresses (before any is created: service links
    /// name them).
    pub fn assign(&self, pods: &[(String, Ipv4Addr)]) {
        lock(&self.addrs).extend(pods.iter().cloned());
    }

    fn downward<'a>(&'a self, pod: &'a PodInstance, ip: Ipv4Addr) -> Downward<'a> {
        let addrs = lock(&self.addrs).clone();
        let service_addrs = self
            .install
            .services
            .iter()
            .filter(|s| s.metadata.namespace.as_deref() == Some(pod.namespace.as_str()))
            .filter_map(|s| {
                let target = self
                    .install
                    .pods
                    .iter()
                    .find(|p| self.install.services_of(p).any(|x| std::ptr::eq(x, s)))?;
                Some((s, addrs.get(&target.name)?.to_string()))
            })
            .collect();
        Downward {
            pod,
            pod_ip: ip.to_string(),
            node: self.node_of(pod).to_owned(),
            api_host: self.kube.addr().ip().to_string(),
            api_port: self.kube.addr().port(),
            service_addrs,
        }
    }

    /// Makes a pod's volumes and containers (none started).
    pub async fn create(&self, inst: PodInstance, ip: Ipv4Addr) -> Result<PodRun, TargetError> {
        let pod_dir = below(&self.dir.join("pods"), &inst.name)?;
        let spec = &inst.spec;
        let fs_group = spec
            .security_context
            .as_ref()
            .and_then(|s| s.fs_group)
            .and_then(|g| u32::try_from(g).ok());
        let sa = spec
            .service_account_name
            .clone()
            .unwrap_or_else(|| "default".into());
        let subject = Subject {
            namespace: inst.namespace.clone(),
            name: sa,
        };
        let d = self.downward(&inst, ip);
        let mut dirs = BTreeMap::new();
        let mut engine_volumes: BTreeMap<String, String> = BTreeMap::new();
        let mut read_only: BTreeMap<String, bool> = BTreeMap::new();
        let mut volumes = spec.volumes.clone().unwrap_or_default();
        let automount = self.install.automounts(&inst).map_err(|e| failed(e.0))?;
        if automount {
            volumes.push(serde_json::from_value(serde_json::json!({
                "name": "kube-api-access",
                "projected": { "defaultMode": 420, "sources": [
                    { "serviceAccountToken": { "path": "token", "expirationSeconds": 3607 } },
                    { "downwardAPI": { "items": [{ "path": "namespace", "fieldRef": { "fieldPath": "metadata.namespace" } }] } },
                ] },
            })).map_err(|e| failed(e.to_string()))?);
        }
        for v in &volumes {
            let dir = below(&pod_dir.join("volumes"), &v.name)?;
            let who = format!("pod {} volume {}", inst.name, v.name);
            if let Some(e) = &v.empty_dir {
                if e.medium.as_deref() == Some("Memory") {
                    let name = self.docker_name(&inst.name, &format!("vol-{}", v.name));
                    let mut o = "mode=1777".to_owned();
                    if let Some(size) = e.size_limit.as_ref().and_then(|q| quantity(&q.0)) {
                        o.push_str(&format!(",size={}", size as u64));
                    }
                    self.docker
                        .create_volume(VolumeCreateRequest {
                            name: Some(name.clone()),
                            driver: Some("local".into()),
                            driver_opts: Some(HashMap::from([
                                ("type".to_owned(), "tmpfs".to_owned()),
                                ("device".to_owned(), "tmpfs".to_owned()),
                                ("o".to_owned(), o),
                            ])),
                            labels: Some(self.labels(&inst.name, false)),
                            ..Default::default()
                        })
                        .await
                        .map_err(|e| failed(format!("{who}: {e}")))?;
                    engine_volumes.insert(v.name.clone(), name);
                } else {
                    make_dir(
                        &dir,
                        if fs_group.is_some() { 0o2777 } else { 0o777 },
                        fs_group,
                    )?;
                    dirs.insert(v.name.clone(), dir);
                }
                continue;
            }
            if let Some(h) = &v.host_path {
                // A node's directory: the node's own, shared by every pod
                // on it and outliving them. Created root's 0755 as the
                // kubelet creates a DirectoryOrCreate one; any other type
                // wants it there already.
                let at = self.node_path(self.node_of(&inst), &h.path)?;
                match h.type_.as_deref().unwrap_or_default() {
                    "DirectoryOrCreate" if !at.is_dir() => make_dir(&at, 0o755, None)?,
                    "DirectoryOrCreate" => {}
                    "" | "Directory" if at.is_dir() => {}
                    t => {
                        return Err(failed(format!(
                            "{who}: hostPath {} of type {t:?} is not emulated by the bundle target (DirectoryOrCreate is, and an existing Directory)",
                            h.path
                        )));
                    }
                }
                dirs.insert(v.name.clone(), at);
                continue;
            }
            if let Some(pvc) = &v.persistent_volume_claim {
                let claim = below(&self.dir.join("claims"), &pvc.claim_name)?;
                make_dir(
                    &claim,
                    if fs_group.is_some() { 0o2775 } else { 0o777 },
                    fs_group,
                )?;
                dirs.insert(v.name.clone(), claim);
                continue;
            }
            make_dir(&dir, 0o755, None)?;
            read_only.insert(v.name.clone(), true);
            if let Some(cm) = &v.config_map {
                let mode = mode_of(cm.default_mode, 0o644);
                match self.install.config_map(&inst.namespace, &cm.name) {
                    Some(c) => {
                        let data = c.data.clone().unwrap_or_default();
                        let items: Vec<(String, String, u32)> = match &cm.items {
                            Some(items) => items
                                .iter()
                                .map(|i| (i.key.clone(), i.path.clone(), mode_of(i.mode, mode)))
                                .collect(),
                            None => data.keys().map(|k| (k.clone(), k.clone(), mode)).collect(),
                        };
                        for (k, path, m) in items {
                            let value = data.get(&k).ok_or_else(|| {
                                failed(format!("{who}: ConfigMap {} has no key {k}", cm.name))
                            })?;
                            write_file(&below(&dir, &path)?, value.as_bytes(), m, fs_group)?;
                        }
                    }
                    None if cm.optional == Some(true) => {}
                    None => {
                        return Err(failed(format!(
                            "{who}: ConfigMap {} is not in the install: the pod would not start",
                            cm.name
                        )));
                    }
                }
            } else if let Some(s) = &v.secret {
                let mode = mode_of(s.default_mode, 0o644);
                let name = s.secret_name.clone().unwrap_or_default();
                match self.install.secret(&inst.namespace, &name) {
                    Some(secret) => {
                        for (k, b) in secret_entries(secret) {
                            write_file(&below(&dir, &k)?, &b, mode, fs_group)?;
                        }
                    }
                    None if s.optional == Some(true) => {}
                    None => {
                        return Err(failed(format!(
                            "{who}: Secret {name} is not in the install: the pod would not start"
                        )));
                    }
                }
            } else if let Some(p) = &v.projected {
                let mode = mode_of(p.default_mode, 0o644);
                for src in p.sources.iter().flatten() {
                    if let Some(t) = &src.service_account_token {
                        let audience = t.audience.clone().unwrap_or_else(|| API_AUDIENCE.into());
                        let ttl = Duration::from_secs(
                            t.expiration_seconds
                                .and_then(|s| u64::try_from(s).ok())
                                .unwrap_or(3600),
                        );
                        let token = self.kube.issue(
                            &subject,
                            &audience,
                            Some((&inst.name, &inst.uid)),
                            ttl,
                        );
                        write_file(&below(&dir, &t.path)?, token.as_bytes(), mode, fs_group)?;
                        if v.name == "kube-api-access" {
                            let ca = std::fs::read(self.kube.ca_path())
                                .map_err(TargetError::io("reading the API's CA"))?;
                            write_file(&dir.join("ca.crt"), &ca, mode, fs_group)?;
                        }
                    } else if let Some(da) = &src.downward_api {
                        let items = da.items.as_deref().unwrap_or_default();
                        write_downward(items, &dir, mode, fs_group, &d, &who)?;
                    } else if let Some(cm) = &src.config_map {
                        let c = self
                            .install
                            .config_map(&inst.namespace, &cm.name)
                            .ok_or_else(|| {
                                failed(format!(
                                    "{who}: ConfigMap {} is not in the install",
                                    cm.name
                                ))
                            })?;
                        for (k, val) in c.data.clone().unwrap_or_default() {
                            write_file(&below(&dir, &k)?, val.as_bytes(), mode, fs_group)?;
                        }
                    } else if let Some(s) = &src.secret {
                        let sec =
                            self.install
                                .secret(&inst.namespace, &s.name)
                                .ok_or_else(|| {
                                    failed(format!(
                                        "{who}: Secret {} is not in the install",
                                        s.name
                                    ))
                                })?;
                        for (k, b) in secret_entries(sec) {
                            write_file(&below(&dir, &k)?, &b, mode, fs_group)?;
                        }
                    } else {
                        return Err(failed(format!(
                            "{who}: a projected source the bundle target does not emulate"
                        )));
                    }
                }
            } else if let Some(da) = &v.downward_api {
                let mode = mode_of(da.default_mode, 0o644);
                let items = da.items.as_deref().unwrap_or_default();
                write_downward(items, &dir, mode, fs_group, &d, &who)?;
            } else {
                return Err(failed(format!(
                    "{who}: this kind of volume is not emulated by the bundle target "
                )));
            }
            dirs.insert(v.name.clone(), dir);
        }

        // The sandbox.
        let sandbox = self.docker_name(&inst.name, "sandbox");
        let aliases = self.install.dns_names(&inst).map_err(|e| failed(e.0))?;
        let shared_pids = spec.share_process_namespace == Some(true);
        let ns = &inst.namespace;
        let body = ContainerCreateBody {
            image: Some(self.pause_image.clone()),
            entrypoint: Some(vec![
                "sh".into(),
                "-c".into(),
                "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done".into(),
            ]),
            user: Some("65534:65534".into()),
            hostname: Some(inst.name.clone()),
            labels: Some(self.labels(&inst.name, false)),
            host_config: Some(HostConfig {
                network_mode: Some(self.network.clone()),
                ipc_mode: Some("shareable".into()),
                readonly_rootfs: Some(true),
                cap_drop: Some(vec!["ALL".into()]),
                security_opt: Some(vec!["no-new-privileges".into()]),
                dns_search: Some(vec![
                    format!("{ns}.svc.cluster.local"),
                    "svc.cluster.local".into(),
                    "cluster.local".into(),
                ]),
                ..Default::default()
            }),
            networking_config: Some(NetworkingConfig {
                endpoints_config: Some(HashMap::from([(
                    self.network.clone(),
                    EndpointSettings {
                        ipam_config: Some(EndpointIpamConfig {
                            ipv4_address: Some(ip.to_string()),
                            ..Default::default()
                        }),
                        aliases: Some(aliases),
                        ..Default::default()
                    },
                )])),
            }),
            ..Default::default()
        };
        self.create_container(&sandbox, body).await?;

        let mut containers = Vec::new();
        let inits = spec.init_containers.iter().flatten().map(|c| {
            let role = if c.restart_policy.as_deref() == Some("Always") {
                Role::Sidecar
            } else {
                Role::Init
            };
            (c, role)
        });
        let apps = spec.containers.iter().map(|c| (c, Role::App));
        for (c, role) in inits.chain(apps) {
            let name = self.docker_name(&inst.name, &c.name);
            let body = self
                .container_body(
                    &inst,
                    c,
                    &d,
                    &sandbox,
                    shared_pids,
                    &dirs,
                    &engine_volumes,
                    &read_only,
                    automount,
                )
                .await
                .map_err(|e| failed(format!("pod {} container {}: {e}", inst.name, c.name)))?;
            self.create_container(&name, body).await?;
            containers.push(Ctr {
                name: c.name.clone(),
                docker: name,
                role,
                spec: c.clone(),
            });
        }
        Ok(PodRun {
            inst,
            ip,
            sandbox,
            containers,
            dirs,
            monitors: Mutex::default(),
        })
    }

    async fn create_container(
        &self,
        name: &str,
        body: ContainerCreateBody,
    ) -> Result<(), TargetError> {
        let opts = CreateContainerOptionsBuilder::new().name(name).build();
        self.docker
            .create_container(Some(opts), body)
            .await
            .map(|_| ())
            .map_err(|e| failed(format!("creating container {name}: {e}")))
    }

    #[allow(clippy::too_many_arguments)]
    async fn container_body(
        &self,
        inst: &PodInstance,
        c: &Container,
        d: &Downward<'_>,
        sandbox: &str,
        shared_pids: bool,
        dirs: &BTreeMap<String, PathBuf>,
        engine_volumes: &BTreeMap<String, String>,
        read_only: &BTreeMap<String, bool>,
        automount: bool,
    ) -> Result<ContainerCreateBody, String> {
        let image = c.image.clone().ok_or("no image")?;
        let config = self
            .docker
            .inspect_image(&image)
            .await
            .map_err(|e| format!("image {image} is not on this machine ({e}): nothing is pulled here; build it with `make images`"))?
            .config
            .unwrap_or_default();
        let pod_sc = inst.spec.security_context.as_ref();
        let who = identity(pod_sc, c.security_context.as_ref());
        if who.non_root {
            let uid = match who.uid {
                Some(u) => Some(u),
                None => image_uid(config.user.as_deref().unwrap_or_default()),
            };
            match uid {
                Some(0) => return Err("runAsNonRoot, but the container would run as root (uid 0): the kubelet refuses to start it".into()),
                None => return Err(format!("runAsNonRoot, but image {image} has a non-numeric user ({:?}) and no runAsUser: the kubelet cannot verify it is not root", config.user)),
                Some(_) => {}
            }
        }
        let user = match (who.uid, who.gid) {
            (Some(u), Some(g)) => Some(format!("{u}:{g}")),
            (Some(u), None) => Some(u.to_string()),
            (None, Some(g)) => {
                let u = config
                    .user
                    .as_deref()
                    .unwrap_or_default()
                    .split(':')
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                Some(format!("{}:{g}", if u.is_empty() { "0" } else { &u }))
            }
            (None, None) => None,
        };
        let env = environment(c, d, &self.install).map_err(|e| e.0)?;
        let expand_all = |v: &Option<Vec<String>>| {
            v.as_ref()
                .map(|v| v.iter().map(|s| expand(s, &env)).collect::<Vec<_>>())
        };
        let mut host = security(c.security_context.as_ref(), pod_sc)?;
        host.network_mode = Some(format!("container:{sandbox}"));
        host.ipc_mode = Some(format!("container:{sandbox}"));
        if shared_pids {
            host.pid_mode = Some(format!("container:{sandbox}"));
        }
        if !who.groups.is_empty() {
            host.group_add = Some(who.groups.iter().map(i64::to_string).collect());
        }
        if let Some(limits) = c.resources.as_ref().and_then(|r| r.limits.as_ref()) {
            if let Some(m) = limits.get("memory").and_then(|q| quantity(&q.0)) {
                host.memory = Some(m as i64);
            }
            // A limit above the node's CPUs binds nothing in Kubernetes;
            // the engine refuses one.
            if let Some(cpu) = limits.get("cpu").and_then(|q| quantity(&q.0)) {
                let cpus = std::thread::available_parallelism().map_or(1, usize::from) as f64;
                host.nano_cpus = Some((cpu.min(cpus) * 1e9) as i64);
            }
        }
        let mut mounts = Vec::new();
        let mut mounted: Vec<String> = Vec::new();
        for m in c.volume_mounts.iter().flatten() {
            let ro = m.read_only == Some(true) || read_only.get(&m.name).copied().unwrap_or(false);
            let mount = if let Some(dir) = dirs.get(&m.name) {
                let src = below(dir, m.sub_path.as_deref().unwrap_or_default())
                    .map_err(|e| e.to_string())?;
                if m.sub_path.is_some() {
                    std::fs::create_dir_all(&src).map_err(|e| format!("{}: {e}", src.display()))?;
                }
                Mount {
                    target: Some(m.mount_path.clone()),
                    source: Some(src.display().to_string()),
                    typ: Some(MountType::BIND),
                    read_only: Some(ro),
                    ..Default::default()
                }
            } else if let Some(vol) = engine_volumes.get(&m.name) {
                if m.sub_path.is_some() {
                    return Err(format!(
                        "volumeMount {}: subPath of a memory emptyDir is not emulated",
                        m.name
                    ));
                }
                Mount {
                    target: Some(m.mount_path.clone()),
                    source: Some(vol.clone()),
                    typ: Some(MountType::VOLUME),
                    read_only: Some(ro),
                    ..Default::default()
                }
            } else {
                return Err(format!(
                    "volumeMount {} names no volume of the pod: the API server would refuse the pod",
                    m.name
                ));
            };
            mounted.push(m.mount_path.clone());
            mounts.push(mount);
        }
        if automount
            && !mounted.iter().any(|p| p == SERVICE_ACCOUNT_DIR)
            && let Some(dir) = dirs.get("kube-api-access")
        {
            mounts.push(Mount {
                target: Some(SERVICE_ACCOUNT_DIR.into()),
                source: Some(dir.display().to_string()),
                typ: Some(MountType::BIND),
                read_only: Some(true),
                ..Default::default()
            });
        }
        host.mounts = Some(mounts);
        let mut labels = self.labels(&inst.name, true);
        labels.insert("kt.dev/bundle-container".into(), c.name.clone());
        Ok(ContainerCreateBody {
            image: Some(image),
            entrypoint: expand_all(&c.command),
            cmd: expand_all(&c.args),
            env: Some(env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
            user,
            working_dir: c.working_dir.clone(),
            labels: Some(labels),
            stop_timeout: inst.spec.termination_grace_period_seconds,
            host_config: Some(host),
            ..Default::default()
        })
    }

    /// Starts a pod made by [`Kubelet::create`] (or stopped by
    /// [`Kubelet::stop`]) and returns once it is ready.
    pub async fn start(&self, pod: &PodRun) -> Result<(), TargetError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        if !docker::running(&self.docker, &pod.sandbox).await? {
            self.start_container(&pod.sandbox).await?;
        }
        let token = CancellationToken::new();
        if let Some(old) = lock(&pod.monitors).replace(token.clone()) {
            old.cancel();
        }
        // What its probes said before it was stopped is history.
        let mine = format!("pod {} ", pod.inst.name);
        lock(&self.faults).retain(|f| !f.starts_with(&mine));
        for c in &pod.containers {
            if docker::running(&self.docker, &c.docker).await? {
                continue;
            }
            match c.role {
                Role::Init => {
                    // Done once is done: a restarted pod's init containers
                    // ran already (a kubelet restarting containers does not
                    // rerun them either).
                    if self.exited_ok(&c.docker).await? {
                        continue;
                    }
                    self.start_container(&c.docker).await?;
                    self.wait_exit(pod, c, deadline).await?;
                }
                Role::Sidecar => {
                    self.start_container(&c.docker).await?;
                    self.started(pod, c, deadline).await?;
                }
                Role::App => self.start_container(&c.docker).await?,
            }
        }
        for c in pod.containers.iter().filter(|c| c.role == Role::App) {
            self.started(pod, c, deadline).await?;
        }
        self.ready(pod, deadline).await?;
        for c in pod.containers.iter().filter(|c| c.role != Role::Init) {
            if let Some(p) = c.spec.liveness_probe.clone() {
                self.monitor(pod, c, p, token.clone());
            }
        }
        Ok(())
    }

    async fn start_container(&self, name: &str) -> Result<(), TargetError> {
        self.docker
            .start_container(name, None)
            .await
            .map_err(|e| failed(format!("starting {name}: {e}")))
    }

    async fn exited_ok(&self, name: &str) -> Result<bool, TargetError> {
        let state = self
            .docker
            .inspect_container(name, None)
            .await
            .map_err(|e| failed(format!("inspecting {name}: {e}")))?
            .state
            .unwrap_or_default();
        Ok(state.running != Some(true)
            && state.exit_code == Some(0)
            && state
                .finished_at
                .as_deref()
                .is_some_and(|f| !f.starts_with("0001")))
    }

    async fn wait_exit(&self, pod: &PodRun, c: &Ctr, deadline: Instant) -> Result<(), TargetError> {
        loop {
            let state = self
                .docker
                .inspect_container(&c.docker, None)
                .await
                .map_err(|e| failed(format!("inspecting {}: {e}", c.docker)))?
                .state
                .unwrap_or_default();
            if state.running != Some(true) {
                return match state.exit_code {
                    Some(0) => Ok(()),
                    code => Err(self
                        .dead(pod, c, &format!("init container exited with {code:?}"))
                        .await),
                };
            }
            if Instant::now() >= deadline {
                return Err(self.dead(pod, c, "init container did not finish").await);
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// An error naming the container, with its log's tail.
    async fn dead(&self, pod: &PodRun, c: &Ctr, why: &str) -> TargetError {
        let log = self.log(&c.docker, Some(20)).await;
        failed(format!(
            "pod {} container {}: {why}; log:\n{log}",
            pod.inst.name, c.name
        ))
    }

    pub async fn log(&self, name: &str, tail: Option<usize>) -> String {
        use futures::TryStreamExt;
        let mut opts = bollard::query_parameters::LogsOptionsBuilder::new()
            .stdout(true)
            .stderr(true);
        if let Some(n) = tail {
            opts = opts.tail(&n.to_string());
        }
        match self
            .docker
            .logs(name, Some(opts.build()))
            .try_collect::<Vec<_>>()
            .await
        {
            Ok(chunks) => chunks.iter().map(ToString::to_string).collect(),
            Err(e) => format!("(no log: {e})"),
        }
    }

    /// Waits for a container's startup probe (if any) to pass; it must be
    /// running all along.
    async fn started(&self, pod: &PodRun, c: &Ctr, deadline: Instant) -> Result<(), TargetError> {
        let Some(p) = c.spec.startup_probe.clone() else {
            return if docker::running(&self.docker, &c.docker).await? {
                Ok(())
            } else {
                Err(self.dead(pod, c, "exited at once").await)
            };
        };
        let period = Duration::from_secs(p.period_seconds.unwrap_or(10).max(1) as u64);
        let threshold = p.failure_threshold.unwrap_or(3).max(1);
        tokio::time::sleep(Duration::from_secs(
            p.initial_delay_seconds.unwrap_or(0).max(0) as u64,
        ))
        .await;
        // The kubelet gives a startup probe `period × failureThreshold`;
        // the testbed probes more often within that same time.
        let allowed = Instant::now() + period * u32::try_from(threshold).unwrap_or(u32::MAX);
        let mut failures = 0;
        loop {
            if !docker::running(&self.docker, &c.docker).await? {
                return Err(self
                    .dead(pod, c, "exited before its startup probe passed")
                    .await);
            }
            match self.probe(pod, c, &p).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    failures += 1;
                    let now = Instant::now();
                    if now >= allowed || now >= deadline {
                        return Err(self
                            .dead(
                                pod,
                                c,
                                &format!("startup probe failed {failures} times (last: {e})"),
                            )
                            .await);
                    }
                }
            }
            tokio::time::sleep(period.min(Duration::from_secs(1)).max(READY_POLL)).await;
        }
    }

    /// Waits until every readiness probe of the pod passes.
    async fn ready(&self, pod: &PodRun, deadline: Instant) -> Result<(), TargetError> {
        for c in pod.containers.iter().filter(|c| c.role != Role::Init) {
            let Some(p) = c.spec.readiness_probe.clone() else {
                continue;
            };
            loop {
                if !docker::running(&self.docker, &c.docker).await? {
                    return Err(self.dead(pod, c, "exited before it was ready").await);
                }
                match self.probe(pod, c, &p).await {
                    Ok(()) => break,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(self
                            .dead(
                                pod,
                                c,
                                &format!(
                                    "not ready after {READY_TIMEOUT:?} (readiness probe: {e})"
                                ),
                            )
                            .await);
                    }
                    Err(_) => tokio::time::sleep(READY_POLL).await,
                }
            }
        }
        Ok(())
    }

    /// Whether every readiness probe of the pod passes now.
    pub async fn is_ready(&self, pod: &PodRun) -> Result<bool, TargetError> {
        for c in pod.containers.iter().filter(|c| c.role != Role::Init) {
            if !docker::running(&self.docker, &c.docker).await? {
                return Ok(false);
            }
            if let Some(p) = &c.spec.readiness_probe
                && self.probe(pod, c, p).await.is_err()
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn monitor(&self, pod: &PodRun, c: &Ctr, p: Probe, stop: CancellationToken) {
        let period = Duration::from_secs(p.period_seconds.unwrap_or(10).max(1) as u64);
        let threshold = p.failure_threshold.unwrap_or(3).max(1);
        let (faults, http, docker, ip) = (
            self.faults.clone(),
            self.http.clone(),
            self.docker.clone(),
            pod.ip,
        );
        let (pod_name, c) = (pod.inst.name.clone(), c.clone());
        let spec = pod.inst.spec.clone();
        tokio::spawn(async move {
            let mut failures = 0;
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(period) => {}
                }
                match run_probe(&http, &docker, ip, &spec, &c, &p).await {
                    Ok(()) => failures = 0,
                    Err(e) => {
                        failures += 1;
                        if failures >= threshold && !stop.is_cancelled() {
                            lock(&faults).push(format!(
                                "pod {pod_name} container {}: liveness probe failed {failures} times (last: {e}); a kubelet would restart it",
                                c.name
                            ));
                            return;
                        }
                    }
                }
            }
        });
    }

    async fn probe(&self, pod: &PodRun, c: &Ctr, p: &Probe) -> Result<(), String> {
        run_probe(&self.http, &self.docker, pod.ip, &pod.inst.spec, c, p).await
    }

    /// Stops a pod's containers (apps first, then sidecars in reverse
    /// order, as the kubelet terminates a pod); its sandbox, address and
    /// volumes stay. STOP and CONT freeze and thaw them.
    pub async fn stop(&self, pod: &PodRun, signal: Signal) -> Result<(), TargetError> {
        if signal != Signal::CONT {
            pod.stop_monitors();
        }
        let grace = pod.grace();
        for c in pod.containers.iter().rev().filter(|c| c.role != Role::Init) {
            self.stop_container(pod, c, signal, grace).await?;
        }
        Ok(())
    }

    /// Stops a container as the CRI does: in a pod sharing its pid
    /// namespace, every process of the container (commands exec'd into it
    /// too) gets the signal, not only its first one, and whatever is left
    /// when that one is gone is killed. (The engine signals the first
    /// process alone; the rest would live on in the sandbox's namespace.)
    async fn stop_container(
        &self,
        pod: &PodRun,
        c: &Ctr,
        signal: Signal,
        grace: Duration,
    ) -> Result<(), TargetError> {
        let shared = pod.inst.spec.share_process_namespace == Some(true);
        let ends = matches!(signal, Signal::TERM | Signal::KILL);
        let pids = if shared && ends {
            self.pids(&c.docker).await
        } else {
            Vec::new()
        };
        let id = match pids.is_empty() {
            true => None,
            false => self
                .docker
                .inspect_container(&c.docker, None)
                .await
                .ok()
                .and_then(|i| i.id),
        };
        // Only a process in the container's cgroup: the engine's pids are
        // this host's only when the runner shares its pid namespace, and a
        // pid may have been reused. (ESRCH: gone with the container.)
        let theirs = |pid: rustix::process::Pid| {
            let cgroup = std::fs::read_to_string(format!("/proc/{}/cgroup", pid.as_raw_nonzero()))
                .unwrap_or_default();
            id.as_deref().is_some_and(|id| cgroup.contains(id))
        };
        for pid in pids.iter().copied().filter(|p| theirs(*p)) {
            let _ = rustix::process::kill_process(pid, crate::target::procs::sig(signal));
        }
        docker::stop_container(&self.docker, &c.docker, signal, grace).await?;
        for pid in pids.into_iter().filter(|p| theirs(*p)) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
        Ok(())
    }

    /// The host pids of a running container's processes (none when it is
    /// not running).
    async fn pids(&self, name: &str) -> Vec<rustix::process::Pid> {
        let Ok(top) = self.docker.top_processes(name, None).await else {
            return Vec::new();
        };
        let col = top
            .titles
            .as_ref()
            .and_then(|t| t.iter().position(|x| x == "PID"))
            .unwrap_or(1);
        top.processes
            .unwrap_or_default()
            .iter()
            .filter_map(|row| row.get(col)?.parse::<i32>().ok())
            .filter_map(rustix::process::Pid::from_raw)
            .collect()
    }

    /// Stops one container of a pod.
    pub async fn stop_one(
        &self,
        pod: &PodRun,
        name: &str,
        signal: Signal,
    ) -> Result<(), TargetError> {
        let c = pod
            .container(name)
            .ok_or_else(|| failed(format!("pod {} has no container {name}", pod.inst.name)))?;
        // Stopped or frozen on purpose: its probes stop until `start`.
        if signal != Signal::CONT {
            pod.stop_monitors();
        }
        let grace = pod.grace();
        self.stop_container(pod, c, signal, grace).await
    }

    /// Runs a command in a container as the kubelet's `exec` probe does.
    pub fn in_container(c: &Ctr, what: String) -> InContainer {
        InContainer {
            container: c.docker.clone(),
            user: None,
            env: Vec::new(),
            dir: c.spec.working_dir.clone().unwrap_or_else(|| "/".into()),
            what,
        }
    }
}

fn port_of(spec: &k8s_openapi::api::core::v1::PodSpec, port: &IntOrString) -> Result<u16, String> {
    let n = match port {
        IntOrString::Int(n) => Some(*n),
        IntOrString::String(name) => named_port(spec, name),
    };
    n.and_then(|n| u16::try_from(n).ok())
        .ok_or_else(|| format!("port {port:?} names no port of the pod"))
}

/// One probe, as the kubelet runs it: HTTP (2xx-3xx), TCP (a connection),
/// or a command in the container (exit 0), within `timeoutSeconds`.
async fn run_probe(
    http: &reqwest::Client,
    docker: &Api,
    ip: Ipv4Addr,
    spec: &k8s_openapi::api::core::v1::PodSpec,
    c: &Ctr,
    p: &Probe,
) -> Result<(), String> {
    let timeout = Duration::from_secs(p.timeout_seconds.unwrap_or(1).max(1) as u64);
    let work = async {
        if let Some(h) = &p.http_get {
            let port = port_of(spec, &h.port)?;
            let scheme = h
                .scheme
                .clone()
                .unwrap_or_else(|| "HTTP".into())
                .to_ascii_lowercase();
            let host = h.host.clone().unwrap_or_else(|| ip.to_string());
            let url = format!(
                "{scheme}://{host}:{port}{}",
                h.path.clone().unwrap_or_else(|| "/".into())
            );
            let mut req = http.get(&url);
            for hd in h.http_headers.iter().flatten() {
                req = req.header(&hd.name, &hd.value);
            }
            let r = req.send().await.map_err(|e| format!("GET {url}: {e}"))?;
            let s = r.status().as_u16();
            if (200..400).contains(&s) {
                Ok(())
            } else {
                Err(format!("GET {url}: {s}"))
            }
        } else if let Some(t) = &p.tcp_socket {
            let port = port_of(spec, &t.port)?;
            tokio::net::TcpStream::connect((ip, port))
                .await
                .map(|_| ())
                .map_err(|e| format!("connect {ip}:{port}: {e}"))
        } else if let Some(e) = &p.exec {
            let cmd = e.command.clone().unwrap_or_default();
            let out = docker::exec_in(
                docker,
                &Kubelet::in_container(c, format!("probe of {}", c.name)),
                cmd.clone(),
            )
            .await
            .map_err(|e| e.to_string())?;
            if out.status == 0 {
                Ok(())
            } else {
                Err(format!(
                    "`{}` exited with {}: {}",
                    cmd.join(" "),
                    out.status,
                    out.stderr.trim()
                ))
            }
        } else {
            Err("this kind of probe (grpc) is not emulated".into())
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| format!("timed out after {timeout:?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(quantity("512Mi"), Some(512.0 * 1024.0 * 1024.0));
        assert_eq!(quantity("2"), Some(2.0));
        assert_eq!(quantity("500m"), Some(0.5));
        assert_eq!(quantity("1Gi"), Some(1073741824.0));
        assert_eq!(quantity("lots"), None);
    }

    #[test]
    fn the_containers_identity_wins_over_the_pods() {
        let pod: PodSecurityContext = serde_json::from_value(serde_json::json!({
            "runAsUser": 10001, "runAsGroup": 65532, "fsGroup": 65532, "runAsNonRoot": true, "supplementalGroups": [5]
        })).unwrap();
        let c: SecurityContext =
            serde_json::from_value(serde_json::json!({ "runAsUser": 65532 })).unwrap();
        let who = identity(Some(&pod), Some(&c));
        assert_eq!(
            who,
            Identity {
                uid: Some(65532),
                gid: Some(65532),
                groups: vec![5, 65532],
                non_root: true
            }
        );
        assert_eq!(identity(Some(&pod), None).uid, Some(10001));
        assert_eq!(image_uid("65532:65532"), Some(65532));
        assert_eq!(image_uid(""), Some(0));
        assert_eq!(image_uid("nonroot"), None);
    }

    #[test]
    fn security_contexts_become_engine_settings() {
        let c: SecurityContext = serde_json::from_value(serde_json::json!({
            "allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true, "capabilities": { "drop": ["ALL"] }
        })).unwrap();
        let h = security(Some(&c), None).unwrap();
        assert_eq!(h.readonly_rootfs, Some(true));
        assert_eq!(h.cap_drop, Some(vec!["ALL".to_owned()]));
        assert_eq!(h.security_opt, Some(vec!["no-new-privileges".to_owned()]));
        let local: SecurityContext = serde_json::from_value(serde_json::json!({ "seccompProfile": { "type": "Localhost", "localhostProfile": "x" } })).unwrap();
        assert!(security(Some(&local), None).is_err());
    }
}
