//! What the cluster targets deploy for one scenario: a kustomization over
//! the project's overlay (`kustomize/overlays/{kind,k3d}`) plus one
//! StatefulSet per scenario pod, in a namespace of its own.
//!
//! The names below are the deployment contract's (docs: the kustomize
//! bundle); nothing else of the bundle is assumed.

use std::path::{Component as PathPart, Path, PathBuf};

use kt_types::env;
use serde_json::{Value, json};

use crate::datasets::{DEFAULT_BUDGET, NODE_CACHE_DAEMONSET};
use crate::target::{Plan, PodPlan};

/// The project's images, without tag.
pub const IMAGES: [&str; 5] = [
    "ghcr.io/kt-dev/kt-metadata",
    "ghcr.io/kt-dev/kt-store",
    "ghcr.io/kt-dev/kt-agent",
    "ghcr.io/kt-dev/kt-client",
    "ghcr.io/kt-dev/kt-dataset",
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
/// kube-identity's ClusterRole and ClusterRoleBinding, as an overlay in
/// namespace `kt` names them (`-kt`: the overlay's namespace).
pub const TOKENREVIEW_RBAC: &str = "kt-metadata-tokenreview-kt";

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

/// What the cluster targets call what scenarios name otherwise
/// ([`crate::target::Target::aliases`]): each pod's Kubernetes name, and
/// the servers' Service addresses, short and namespace-qualified (the
/// store advertises `kt-store.<ns>.svc:8082`).
pub fn aliases(plan_pods: &[String], ns: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> =
        plan_pods.iter().map(|p| (pod_name(p), p.clone())).collect();
    for server in [METADATA, STORE] {
        let svc = server.service.trim_start_matches("svc/");
        let port = server.port;
        out.push((format!("{svc}.{ns}.svc:{port}"), "[addr]".to_owned()));
        out.push((format!("{svc}:{port}"), "[addr]".to_owned()));
    }
    out
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

/// Pairs `--flag value` of the metadata server as environment variables
/// ([`kt_types::env::of_flag`]), as the bundle's metadata server reads them.
pub fn metadata_env(flags: &[String]) -> Vec<(String, String)> {
    flags
        .chunks(2)
        .filter_map(|c| match c {
            [f, v] => Some((kt_types::env::of_flag(f), v.clone())),
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
    /// The components the scenario pods list, in order, as a user's
    /// workloads do: agent-sidecar (a component patches only the resources
    /// of the kustomization that lists it, so ours lists it again for the
    /// scenario pods), then agent-identity on the production path.
    pub components: Vec<PathBuf>,
    /// The production path's identities: every scenario pod runs as a
    /// ServiceAccount of its own, and the install's access map (the
    /// ConfigMap kt-access of kube-identity) is replaced by `access.yaml`
    /// beside the kustomization ([`access_map`]), as the component's
    /// README tells users to add their rules.
    pub identities: bool,
}

impl Sources {
    /// The production install under `kustomize` (the bundle's root): the
    /// production overlay, agent-sidecar and agent-identity for the pods.
    pub fn production(kustomize: &Path) -> Sources {
        Sources {
            overlay: kustomize.join("overlays").join("production"),
            components: vec![
                kustomize.join("components").join("agent-sidecar"),
                kustomize.join("components").join("agent-identity"),
            ],
            identities: true,
        }
    }
}

/// Writes the generated files of a scenario's deployment into `dir`:
/// `kustomization.yaml`, `pods.yaml` and (on identities) `access.yaml`,
/// which extends kube-identity's map under `kustomize`.
pub fn write_deploy(
    plan: &Plan,
    ns: &str,
    tag: &str,
    dir: &Path,
    src: &Sources,
    kustomize: &Path,
) -> Result<(), crate::target::TargetError> {
    use crate::target::TargetError;
    std::fs::create_dir_all(dir).map_err(TargetError::io(format!("creating {}", dir.display())))?;
    let mut files = vec![
        ("kustomization.yaml", kustomization(plan, ns, tag, dir, src)),
        ("pods.yaml", pods(plan, src.identities)),
    ];
    if src.identities {
        let base_access = kustomize.join("components/kube-identity/access.yaml");
        let base = std::fs::read_to_string(&base_access).map_err(TargetError::io(format!(
            "reading {}",
            base_access.display()
        )))?;
        files.push((
            "access.yaml",
            access_map(plan, &base).map_err(TargetError::Failed)?,
        ));
    }
    for (name, text) in files {
        std::fs::write(dir.join(name), text).map_err(TargetError::io(format!("writing {name}")))?;
    }
    Ok(())
}

/// The ServiceAccount a scenario pod runs as on the production path.
pub fn service_account(pod: &str) -> String {
    format!("scenario-{pod}")
}

/// The access map for a scenario on the production path: `base`'s rules
/// (kube-identity's access.yaml) with one rule per scenario pod above the
/// catch-all, granting what the process targets' tokens grant
/// ([`crate::target::roles`]): a pod with a service writes it and the
/// scenario's own keys, one without writes every service; every pod reads
/// every service.
pub fn access_map(plan: &Plan, base: &str) -> Result<String, String> {
    let mut doc: Value =
        serde_yaml_ng::from_str(base).map_err(|e| format!("the access map is not YAML: {e}"))?;
    let rules = doc["rules"]
        .as_array_mut()
        .ok_or("the access map has no `rules` list")?;
    let at = rules
        .iter()
        .position(|r| r["serviceAccount"] == "*")
        .unwrap_or(rules.len());
    let ours: Vec<Value> = plan
        .pods
        .iter()
        .map(|p| {
            let mut rule = json!({ "serviceAccount": service_account(&p.name), "role": "pod" });
            if let Some(service) = &p.service {
                let mut services = vec![service.clone()];
                if *service != plan.scenario {
                    services.push(plan.scenario.clone());
                }
                rule["services"] = json!(services);
            }
            rule
        })
        .collect();
    rules.splice(at..at, ours);
    Ok(format!(
        "# Generated by kt-scenario for scenario {}: kube-identity's rules, and\n# one per scenario pod above the catch-all.\n{}",
        plan.scenario,
        yaml(&doc)
    ))
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
            env::CHUNK_SIZE,
            &cs.to_string()
        )]);
        patches.push(json!({
            "target": { "kind": "StatefulSet", "name": "kt-store" },
            "patch": yaml(&ops),
        }));
    }
    if let Some(nodes) = &plan.nodes {
        // The node-cache agents' budget, as an operator sets it (the
        // component's KT_DATASET_BUDGET knob): unset, each would report
        // the free space of the filesystem the emulated nodes share, which
        // moves as the others write, and placement ties would break by
        // whichever reported last instead of by node name.
        let budget = nodes.budget.map_or(DEFAULT_BUDGET, |b| b.0);
        let ops = json!([
            { "op": "test", "path": "/spec/template/spec/containers/0/name", "value": NODE_CACHE_DAEMONSET },
            add_env("/spec/template/spec/containers/0/env/-", env::DATASET_BUDGET, &budget.to_string()),
        ]);
        patches.push(json!({
            "target": { "kind": "DaemonSet", "name": NODE_CACHE_DAEMONSET },
            "patch": yaml(&ops),
        }));
    }
    let requests = PodRequests::for_pods(plan.pods.len());
    for p in &plan.pods {
        // The sidecar's agent is named after the Kubernetes pod
        // (`getter-0-0`); scenarios know it as `getter-0`. With a static
        // token the agent takes the scenario's name; on Kubernetes
        // identities it must keep its pod's (its token is bound to that
        // pod) and the target's aliases map it back for the snapshots. The
        // component makes the agent the pod's first init container, and
        // the test op makes a change of that a render error instead of a
        // wrong patch. Its requests shrink with the scenario's size (see
        // PodRequests).
        let mut ops = vec![
            json!({ "op": "test", "path": "/spec/template/spec/initContainers/0/name", "value": AGENT_CONTAINER }),
            json!({ "op": "replace", "path": "/spec/template/spec/initContainers/0/resources/requests", "value": requests.agent() }),
        ];
        if !src.identities {
            ops.push(add_env(
                "/spec/template/spec/initContainers/0/env/-",
                env::AGENT_ID,
                &p.name,
            ));
        }
        let ops = Value::Array(ops);
        patches.push(json!({
            "target": { "kind": "StatefulSet", "name": p.name },
            "patch": yaml(&ops),
        }));
    }
    let components: Vec<String> = src
        .components
        .iter()
        .map(|c| relative(dir, c).display().to_string())
        .collect();
    let mut k = json!({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": ns,
        "resources": [relative(dir, &src.overlay).display().to_string(), "pods.yaml"],
        "components": components,
        "images": images,
        "patches": patches,
    });
    if src.identities {
        k["configMapGenerator"] = json!([{
            "name": "kt-access",
            "behavior": "replace",
            "files": ["access.yaml"],
        }]);
        // kube-identity's cluster-scoped objects named after this
        // namespace, as the production overlay names them after its own:
        // installs side by side in one cluster must not share a binding.
        let rename = |kind: &str, paths: &[&str]| {
            json!({
                "select": { "kind": kind, "name": TOKENREVIEW_RBAC },
                "fieldPaths": paths,
                "options": { "delimiter": "-", "index": 3 },
            })
        };
        k["replacements"] = json!([{
            "source": { "kind": "Namespace", "fieldPath": "metadata.name" },
            "targets": [
                rename("ClusterRole", &["metadata.name"]),
                rename("ClusterRoleBinding", &["metadata.name", "roleRef.name"]),
            ],
        }]);
    }
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

/// The scenario workloads' user: 10001, as the documented examples run
/// theirs, apart from the agent's 65532. They share the agent's group (its
/// socket's): files, the socket and the shared memory a workload lends
/// tensors in (group-owned 0660 when the socket is open to its group) work
/// across the two uids.
pub const WORKLOAD_UID: u32 = 10001;

/// The workload's idle loop: it ends on TERM at once.
const IDLE: &str = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done";

/// One scenario pod: a StatefulSet of one replica, labelled for the agent
/// sidecar, its workload idling in the client image.
pub fn statefulset(p: &PodPlan, identities: bool) -> Value {
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
        { "name": env::POD_NAME, "value": p.name },
        { "name": env::PROGRESS, "value": "never" },
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
                    "serviceAccountName": if identities { service_account(&p.name) } else { "default".to_owned() },
                    "terminationGracePeriodSeconds": 10,
                    // The workload's user (see WORKLOAD_UID), sharing the
                    // agent's group (the socket's).
                    "securityContext": {
                        "runAsNonRoot": true,
                        "runAsUser": WORKLOAD_UID,
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
/// StatefulSet per scenario pod (with `identities`, a ServiceAccount each).
pub fn pods(plan: &Plan, identities: bool) -> String {
    let svc = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "name": PODS_SERVICE, "labels": { MANAGED_BY.0: MANAGED_BY.1 } },
        "spec": { "clusterIP": "None", "selector": { MANAGED_BY.0: MANAGED_BY.1 } },
    });
    let mut docs = vec![yaml(&svc)];
    if identities {
        docs.extend(plan.pods.iter().map(|p| {
            yaml(&json!({
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": { "name": service_account(&p.name), "labels": { MANAGED_BY.0: MANAGED_BY.1 } },
                // The workload asks the API for nothing; its kt token is
                // agent-identity's projected one.
                "automountServiceAccountToken": false,
            }))
        }));
    }
    docs.extend(plan.pods.iter().map(|p| yaml(&statefulset(p, identities))));
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
    fn server_addresses_are_aliased_short_and_qualified() {
        let got = aliases(&["getter-0".to_owned()], "kt-ab12-roundtrip");
        let addr = |a: &str| got.iter().any(|(k, v)| k == a && v == "[addr]");
        // The store advertises its namespace-qualified name (the bundle's
        // KT_ADVERTISE_URL); snapshots record it as an address.
        assert!(addr("kt-store.kt-ab12-roundtrip.svc:8082"), "{got:?}");
        assert!(addr("kt-store:8082") && addr("kt-metadata:8081"), "{got:?}");
        assert!(got.contains(&("getter-0-0".to_owned(), "getter-0".to_owned())));
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
    fn node_cache_agents_get_the_topologys_budget() {
        let plan = |nodes: Option<crate::datasets::NodesSpec>| Plan {
            run_id: "r".into(),
            scenario: "s".into(),
            work_dir: "/w".into(),
            bin_dir: "/b".into(),
            token: "t".into(),
            chunk_size: None,
            store_link_bps: None,
            metadata_flags: vec![],
            pods: vec![],
            python: None,
            nodes,
            s3: None,
        };
        let src = Sources::production(Path::new("/repo/kustomize"));
        let budget_of = |p: &Plan| -> Option<String> {
            let k: Value =
                serde_yaml_ng::from_str(&kustomization(p, "ns", "t", Path::new("/w/d"), &src))
                    .unwrap();
            let patch = k["patches"].as_array().unwrap().iter().find(|p| {
                p["target"] == json!({ "kind": "DaemonSet", "name": NODE_CACHE_DAEMONSET })
            })?;
            let ops: Value = serde_yaml_ng::from_str(patch["patch"].as_str().unwrap()).unwrap();
            // The patch checks it adds to the agent's container.
            assert_eq!(ops[0]["op"], "test");
            assert_eq!(ops[0]["value"], NODE_CACHE_DAEMONSET);
            assert_eq!(ops[1]["value"]["name"], env::DATASET_BUDGET);
            ops[1]["value"]["value"].as_str().map(str::to_owned)
        };
        assert_eq!(budget_of(&plan(None)), None);
        let nodes = crate::datasets::NodesSpec {
            count: 3,
            ..Default::default()
        };
        assert_eq!(
            budget_of(&plan(Some(nodes.clone()))),
            Some(DEFAULT_BUDGET.to_string())
        );
        let small = crate::datasets::NodesSpec {
            budget: Some(crate::format::Size(5 << 20)),
            ..nodes
        };
        assert_eq!(
            budget_of(&plan(Some(small))),
            Some((5u64 << 20).to_string())
        );
    }

    #[test]
    fn metadata_flags_become_the_servers_environment() {
        let flags = ["--lease-ttl", "2s", "--agent-ttl", "5s"].map(String::from);
        assert_eq!(
            metadata_env(&flags),
            vec![
                (env::LEASE_TTL.to_owned(), "2s".to_owned()),
                (env::AGENT_TTL.to_owned(), "5s".to_owned())
            ]
        );
    }
}
