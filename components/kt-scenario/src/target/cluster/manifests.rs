//! What the cluster targets deploy for one scenario: a kustomization over
//! the project's overlay (`kustomize/overlays/{kind,k3d}`) plus one
//! StatefulSet per scenario pod, in a namespace of its own.
//!
//! The names below are the deployment contract's (docs: the kustomize
//! bundle); nothing else of the bundle is assumed.

use std::path::{Component as PathPart, Path, PathBuf};

use serde_json::{Value, json};

use crate::target::{Plan, PodPlan};

/// The project's images, without tag.
pub const IMAGES: [&str; 4] = [
    "ghcr.io/kt-dev/kt-metadata",
    "ghcr.io/kt-dev/kt-store",
    "ghcr.io/kt-dev/kt-agent",
    "ghcr.io/kt-dev/kt-client",
];
/// The tag the bundle's manifests reference (overridden per run).
pub const BUNDLE_TAG: &str = "0.1.0";
/// The scenario pod's own container (the agent sidecar is `kt-agent`).
pub const WORKLOAD: &str = "workload";
/// The agent sidecar: the first init container of a scenario pod (a native
/// sidecar; the pods have no init containers of their own).
pub const AGENT_CONTAINER: &str = "kt-agent";
/// The agent's HTTP port in the sidecar (KT_AGENT_LISTEN).
pub const AGENT_PORT: u16 = 8090;
/// The workload's root directory: `Target::pod_dir` inside the pod.
pub const POD_ROOT: &str = "/var/lib/kt/data";
/// The headless Service the scenario StatefulSets name.
pub const PODS_SERVICE: &str = "kt-scenario-pods";
/// The label selecting one scenario pod's StatefulSet.
pub const POD_LABEL: &str = "kt.dev/scenario-pod";
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "kt-scenario");
/// The Secret the bundle mounts (key `token`).
pub const TOKEN_SECRET: &str = "kt-token";

/// A server of the bundle: its workload, Service and pod selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Server {
    /// `deployment/kt-metadata`.
    pub workload: &'static str,
    pub service: &'static str,
    pub port: u16,
    pub selector: &'static str,
}

pub const METADATA: Server = Server {
    workload: "deployment/kt-metadata",
    service: "svc/kt-metadata",
    port: 8081,
    selector: "app.kubernetes.io/name=kt-metadata",
};
pub const STORE: Server = Server {
    workload: "statefulset/kt-store",
    service: "svc/kt-store",
    port: 8082,
    selector: "app.kubernetes.io/name=kt-store",
};

/// The namespace of one scenario of a run: `kt-<run id>-<scenario>`, a
/// valid DNS label (at most 63 characters). Scenarios get their own, since a
/// deleted namespace lingers while it terminates.
pub fn namespace(run_id: &str, scenario: &str) -> String {
    let raw = format!("kt-{run_id}-{scenario}").to_ascii_lowercase();
    let mut s: String = raw
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    s.truncate(63);
    s.trim_end_matches('-').to_owned()
}

/// The pod a scenario pod's StatefulSet runs.
pub fn pod_name(pod: &str) -> String {
    format!("{pod}-0")
}

/// `to` relative to the directory `from` (both absolute): kustomize takes
/// only relative paths to other kustomizations.
pub fn relative(from: &Path, to: &Path) -> PathBuf {
    let norm = |p: &Path| -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for c in p.components() {
            match c {
                PathPart::Normal(s) => out.push(s.to_string_lossy().into_owned()),
                PathPart::ParentDir => {
                    out.pop();
                }
                _ => {}
            }
        }
        out
    };
    let (f, t) = (norm(from), norm(to));
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..f.len() {
        out.push("..");
    }
    for p in &t[common..] {
        out.push(p);
    }
    if out.as_os_str().is_empty() {
        out.push(".");
    }
    out
}

/// The environment variable of a metadata server flag (`--lease-ttl` ->
/// `KT_LEASE_TTL`), as the bundle's metadata server reads it.
fn flag_env(flag: &str) -> String {
    format!(
        "KT_{}",
        flag.trim_start_matches('-')
            .replace('-', "_")
            .to_ascii_uppercase()
    )
}

/// Pairs `--flag value` of the metadata server as environment variables.
pub fn metadata_env(flags: &[String]) -> Vec<(String, String)> {
    flags
        .chunks(2)
        .filter_map(|c| match c {
            [f, v] => Some((flag_env(f), v.clone())),
            _ => None,
        })
        .collect()
}

fn add_env(path: &str, name: &str, value: &str) -> Value {
    json!({ "op": "add", "path": path, "value": { "name": name, "value": value } })
}

fn yaml(v: &Value) -> String {
    serde_yaml_ng::to_string(v).unwrap_or_default()
}

/// Where the generated kustomization points.
#[derive(Debug, Clone)]
pub struct Sources {
    /// `kustomize/overlays/<target>`.
    pub overlay: PathBuf,
    /// The agent-sidecar component (`kustomize/components/agent-sidecar`):
    /// a component patches only the resources of the kustomization that
    /// lists it, so ours lists it again for the scenario pods.
    pub sidecar: PathBuf,
}

/// `kustomization.yaml` for the directory `dir`.
pub fn kustomization(plan: &Plan, ns: &str, tag: &str, dir: &Path, src: &Sources) -> String {
    let images: Vec<Value> = IMAGES
        .iter()
        .map(|i| json!({ "name": i, "newTag": tag }))
        .collect();
    let mut patches = Vec::new();
    let meta_env = metadata_env(&plan.metadata_flags);
    if !meta_env.is_empty() {
        let ops: Vec<Value> = meta_env
            .iter()
            .map(|(k, v)| add_env("/spec/template/spec/containers/0/env/-", k, v))
            .collect();
        patches.push(json!({
            "target": { "kind": "Deployment", "name": "kt-metadata" },
            "patch": yaml(&Value::Array(ops)),
        }));
    }
    if let Some(cs) = plan.chunk_size {
        let ops = json!([add_env(
            "/spec/template/spec/containers/0/env/-",
            "KT_CHUNK_SIZE",
            &cs.to_string()
        )]);
        patches.push(json!({
            "target": { "kind": "StatefulSet", "name": "kt-store" },
            "patch": yaml(&ops),
        }));
    }
    let requests = PodRequests::for_pods(plan.pods.len());
    for p in &plan.pods {
        // The sidecar's agent is named after the Kubernetes pod
        // (`getter-0-0`); scenarios know it as `getter-0`. The component
        // makes the agent the pod's first init container, and the test op
        // makes a change of that a render error instead of a wrong patch.
        // Its requests shrink with the scenario's size (see PodRequests).
        let ops = json!([
            { "op": "test", "path": "/spec/template/spec/initContainers/0/name", "value": AGENT_CONTAINER },
            add_env("/spec/template/spec/initContainers/0/env/-", "KT_AGENT_ID", &p.name),
            { "op": "replace", "path": "/spec/template/spec/initContainers/0/resources/requests", "value": requests.agent() },
        ]);
        patches.push(json!({
            "target": { "kind": "StatefulSet", "name": p.name },
            "patch": yaml(&ops),
        }));
    }
    let k = json!({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": ns,
        "resources": [relative(dir, &src.overlay).display().to_string(), "pods.yaml"],
        "components": [relative(dir, &src.sidecar).display().to_string()],
        "images": images,
        "patches": patches,
    });
    format!(
        "# Generated by kt-scenario for scenario {} (run {}); do not edit.\n{}",
        plan.scenario,
        plan.run_id,
        yaml(&k)
    )
}

/// What each scenario pod asks of the scheduler. A testbed cluster runs on
/// one machine (kind's and k3d's nodes are containers of one Docker
/// engine, 4 CPUs on a CI runner), and the scenario library has up to 201
/// pods: at the bundle's 50m and 64Mi per agent, broadcast-200 alone would
/// ask for 10 CPUs and 13 GiB and most of its pods would never schedule.
/// So a scenario's pods share a budget of one CPU and 2 GiB between their
/// agents (at most the bundle's own requests each, at least 5m and 16Mi);
/// the workloads, idle shells running `kt` now and then, ask for 5m and
/// 8Mi. Limits stay the bundle's: requests decide placement, not speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodRequests {
    /// The agent's CPU request in millicores.
    pub agent_millicpu: u64,
    /// The agent's memory request in MiB.
    pub agent_mib: u64,
}

impl PodRequests {
    const CPU_BUDGET_MILLI: u64 = 1000;
    const MEMORY_BUDGET_MIB: u64 = 2048;

    pub fn for_pods(pods: usize) -> PodRequests {
        let n = pods.max(1) as u64;
        PodRequests {
            agent_millicpu: (Self::CPU_BUDGET_MILLI / n).clamp(5, 50),
            agent_mib: (Self::MEMORY_BUDGET_MIB / n).clamp(16, 64),
        }
    }

    fn agent(&self) -> Value {
        json!({
            "cpu": format!("{}m", self.agent_millicpu),
            "memory": format!("{}Mi", self.agent_mib),
            "ephemeral-storage": "16Mi",
        })
    }
}

/// The workload's idle loop: it ends on TERM at once.
const IDLE: &str = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done";

/// One scenario pod: a StatefulSet of one replica, labelled for the agent
/// sidecar, its workload idling in the client image.
pub fn statefulset(p: &PodPlan) -> Value {
    let service = p.service.clone().unwrap_or_else(|| p.group.clone());
    let mut pod_labels = serde_json::Map::new();
    for (k, v) in &p.labels {
        pod_labels.insert(k.clone(), json!(v));
    }
    pod_labels.insert(POD_LABEL.into(), json!(p.name));
    pod_labels.insert("kt.dev/service".into(), json!(service));
    pod_labels.insert(MANAGED_BY.0.into(), json!(MANAGED_BY.1));
    // KT_POD_IP, KT_AGENT_SOCKET and KT_AGENT_AUTOSTART=0 come from the
    // agent-sidecar component, as in a user's pod.
    let env = json!([
        { "name": "KT_POD_NAME", "value": p.name },
        { "name": "KT_PROGRESS", "value": "never" },
        { "name": "HOME", "value": POD_ROOT },
        { "name": "XDG_CACHE_HOME", "value": format!("{POD_ROOT}/.cache") },
    ]);
    json!({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": p.name,
            "labels": {
                POD_LABEL: p.name,
                "kt.dev/service": service,
                "kt.dev/agent": "sidecar",
                MANAGED_BY.0: MANAGED_BY.1,
            },
        },
        "spec": {
            "replicas": 1,
            "serviceName": PODS_SERVICE,
            "podManagementPolicy": "Parallel",
            "selector": { "matchLabels": { POD_LABEL: p.name } },
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": { "kubectl.kubernetes.io/default-container": WORKLOAD },
                },
                "spec": {
                    "terminationGracePeriodSeconds": 10,
                    "securityContext": {
                        "runAsNonRoot": true,
                        "runAsUser": 65532,
                        "runAsGroup": 65532,
                        "fsGroup": 65532,
                        "seccompProfile": { "type": "RuntimeDefault" },
                    },
                    "containers": [{
                        "name": WORKLOAD,
                        "image": format!("{}:{BUNDLE_TAG}", IMAGES[3]),
                        "command": ["sh", "-c", IDLE],
                        "workingDir": POD_ROOT,
                        "env": env,
                        "resources": {
                            "requests": { "cpu": "5m", "memory": "8Mi", "ephemeral-storage": "16Mi" },
                        },
                        "securityContext": {
                            "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true,
                            "capabilities": { "drop": ["ALL"] },
                        },
                        // The pod root is the agent-sidecar component's
                        // `kt-data` volume (an emptyDir: a killed pod comes
                        // back empty, like a real one), which the agent
                        // mounts too: it serves what `put --locale local`
                        // names and what getters wrote.
                        "volumeMounts": [
                            { "name": "tmp", "mountPath": "/tmp" },
                        ],
                    }],
                    "volumes": [
                        { "name": "tmp", "emptyDir": { "sizeLimit": "256Mi" } },
                    ],
                },
            },
        },
    })
}

/// `pods.yaml`: the headless Service the StatefulSets name, and one
/// StatefulSet per scenario pod.
pub fn pods(plan: &Plan) -> String {
    let svc = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "name": PODS_SERVICE, "labels": { MANAGED_BY.0: MANAGED_BY.1 } },
        "spec": { "clusterIP": "None", "selector": { MANAGED_BY.0: MANAGED_BY.1 } },
    });
    let mut docs = vec![yaml(&svc)];
    docs.extend(plan.pods.iter().map(|p| yaml(&statefulset(p))));
    docs.join("---\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_dns_labels() {
        assert_eq!(namespace("ab12", "roundtrip"), "kt-ab12-roundtrip");
        let long = namespace("ab12", &"x_Y".repeat(40));
        assert!(long.len() <= 63 && !long.ends_with('-'));
        assert!(
            long.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
    }

    #[test]
    fn relative_paths_climb_to_the_common_prefix() {
        assert_eq!(
            relative(
                Path::new("/tmp/kt/x/deploy"),
                Path::new("/repo/kustomize/overlays/kind")
            ),
            PathBuf::from("../../../../repo/kustomize/overlays/kind")
        );
        assert_eq!(
            relative(Path::new("/a/b"), Path::new("/a/c")),
            PathBuf::from("../c")
        );
        assert_eq!(
            relative(Path::new("/a"), Path::new("/a")),
            PathBuf::from(".")
        );
    }

    #[test]
    fn requests_shrink_with_the_scenario_within_bounds() {
        let one = PodRequests::for_pods(1);
        assert_eq!((one.agent_millicpu, one.agent_mib), (50, 64));
        let big = PodRequests::for_pods(201);
        assert_eq!((big.agent_millicpu, big.agent_mib), (5, 16));
        // 201 agents ask for about a CPU in all, not ten.
        assert!(201 * big.agent_millicpu <= 1100);
        assert_eq!(PodRequests::for_pods(0), one);
        let mid = PodRequests::for_pods(40);
        assert_eq!((mid.agent_millicpu, mid.agent_mib), (25, 51));
    }

    #[test]
    fn metadata_flags_become_the_servers_environment() {
        let flags = ["--lease-ttl", "2s", "--agent-ttl", "5s"].map(String::from);
        assert_eq!(
            metadata_env(&flags),
            vec![
                ("KT_LEASE_TTL".to_owned(), "2s".to_owned()),
                ("KT_AGENT_TTL".to_owned(), "5s".to_owned())
            ]
        );
    }
}
