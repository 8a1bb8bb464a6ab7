//! The rendered install as the bundle's kubelet reads it: pure functions,
//! no I/O. Multi-document YAML in; the pods to run (named as their
//! controllers name them), their environment, the Services that select
//! them and the RBAC the scripted API enforces out.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use serde_json::Value;

/// What of an install the bundle target does not run, by kind; printed
/// once per scenario so nobody mistakes the target for a cluster.
pub const NOT_EMULATED: &[(&str, &str)] = &[
    (
        "NetworkPolicy",
        "not enforced: every container of the run reaches every other",
    ),
    ("PodDisruptionBudget", "nothing is ever evicted"),
    ("Job", "not run (no scenario needs one)"),
    ("CronJob", "not run"),
    ("ServiceMonitor", "no Prometheus Operator"),
];

/// Why an install cannot run on the bundle target.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InstallError(pub String);

fn err(s: impl Into<String>) -> InstallError {
    InstallError(s.into())
}

/// One pod a controller of the install would create.
#[derive(Debug, Clone)]
pub struct PodInstance {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// `StatefulSet/kt-store`.
    pub owner: String,
    pub spec: PodSpec,
    /// A StatefulSet pod's headless Service (`spec.serviceName`): its DNS
    /// name is `<name>.<service>`.
    pub subdomain: Option<String>,
    /// Claims made from a StatefulSet's volumeClaimTemplates: volume name
    /// to claim name (`data` -> `data-kt-store-0`).
    pub claims: BTreeMap<String, String>,
    /// The node a DaemonSet's pod runs on (one per node of the testbed);
    /// None: the testbed's single node.
    pub node: Option<String>,
}

/// An install, read.
#[derive(Debug, Clone, Default)]
pub struct Install {
    pub config_maps: BTreeMap<(String, String), ConfigMap>,
    pub secrets: BTreeMap<(String, String), Secret>,
    pub service_accounts: BTreeMap<(String, String), ServiceAccount>,
    pub services: Vec<Service>,
    pub pods: Vec<PodInstance>,
    pub rbac: Rbac,
    /// Each workload's resource (`statefulsets`) and metadata, for the
    /// scripted API's lists.
    pub workloads: Vec<(String, Value)>,
    /// Kinds present that the target does not emulate, with why.
    pub skipped: BTreeMap<String, &'static str>,
    /// The resources the install's CustomResourceDefinitions define, for
    /// the API to serve.
    pub crds: Vec<CrdResource>,
}

/// What a CustomResourceDefinition makes the API serve: one served
/// version of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrdResource {
    pub group: String,
    pub version: String,
    pub kind: String,
    pub plural: String,
    pub namespaced: bool,
    /// Whether it has the `status` subresource.
    pub status: bool,
}

/// The served versions of a CustomResourceDefinition (as the API server
/// reads `spec.group`, `spec.names`, `spec.scope` and `spec.versions`).
pub fn crd_resources(crd: &Value) -> Result<Vec<CrdResource>, InstallError> {
    let name = crd["metadata"]["name"].as_str().unwrap_or_default();
    let spec = &crd["spec"];
    let text = |v: &Value, what: &str| {
        v.as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| err(format!("CustomResourceDefinition {name} has no {what}")))
    };
    let group = text(&spec["group"], "spec.group")?;
    let kind = text(&spec["names"]["kind"], "spec.names.kind")?;
    let plural = text(&spec["names"]["plural"], "spec.names.plural")?;
    let namespaced = match spec["scope"].as_str() {
        Some("Namespaced") => true,
        Some("Cluster") => false,
        other => {
            return Err(err(format!(
                "CustomResourceDefinition {name}: scope {other:?} is neither Namespaced nor Cluster"
            )));
        }
    };
    let versions = spec["versions"]
        .as_array()
        .filter(|v| !v.is_empty())
        .ok_or_else(|| {
            err(format!(
                "CustomResourceDefinition {name} has no spec.versions"
            ))
        })?;
    versions
        .iter()
        .filter(|v| v["served"].as_bool().unwrap_or(true))
        .map(|v| {
            Ok(CrdResource {
                group: group.clone(),
                version: text(&v["name"], "version name")?,
                kind: kind.clone(),
                plural: plural.clone(),
                namespaced,
                status: v["subresources"]["status"].is_object(),
            })
        })
        .collect()
}

fn key(ns: &Option<String>, name: &Option<String>) -> (String, String) {
    (
        ns.clone().unwrap_or_default(),
        name.clone().unwrap_or_default(),
    )
}

fn parse<T: serde::de::DeserializeOwned>(doc: Value, what: &str) -> Result<T, InstallError> {
    serde_json::from_value(doc).map_err(|e| err(format!("{what}: {e}")))
}

/// A short stable hash of `parts`, as lower-case alphanumerics (the
/// suffixes controllers give pod names).
fn suffix(parts: &[&str], len: usize) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update(&[0]);
    }
    h.finalize()
        .as_bytes()
        .iter()
        .take(len)
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect()
}

pub(crate) fn uid(ns: &str, name: &str) -> String {
    let h = blake3::hash(format!("{ns}/{name}").as_bytes()).to_hex();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

impl Install {
    /// Reads `yaml`, the output of `kubectl kustomize`, on a testbed of
    /// one node: a DaemonSet runs one pod.
    pub fn parse(yaml: &str) -> Result<Install, InstallError> {
        Install::parse_on(yaml, &[])
    }

    /// Reads `yaml` for a testbed of `nodes` (none: one unnamed node): a
    /// DaemonSet runs a pod on each, as its controller does on every node
    /// (node selectors and taints are not emulated: every node matches).
    pub fn parse_on(yaml: &str, nodes: &[String]) -> Result<Install, InstallError> {
        let mut install = Install::default();
        for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
            let v: Value = serde::Deserialize::deserialize(doc)
                .map_err(|e| err(format!("the rendered install is not YAML: {e}")))?;
            if v.is_null() {
                continue;
            }
            let kind = v["kind"].as_str().unwrap_or_default().to_owned();
            let name = v["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let what = format!("{kind} {name}");
            let resource = match kind.as_str() {
                "Deployment" => Some("deployments"),
                "StatefulSet" => Some("statefulsets"),
                "DaemonSet" => Some("daemonsets"),
                _ => None,
            };
            if let Some(r) = resource {
                let mut meta = v["metadata"].clone();
                meta["uid"] = Value::String(uid(
                    meta["namespace"].as_str().unwrap_or_default(),
                    &format!("{r}/{name}"),
                ));
                install.workloads.push((r.to_owned(), meta));
            }
            match kind.as_str() {
                "ConfigMap" => {
                    let c: ConfigMap = parse(v, &what)?;
                    install
                        .config_maps
                        .insert(key(&c.metadata.namespace, &c.metadata.name), c);
                }
                "Secret" => {
                    let s: Secret = parse(v, &what)?;
                    install
                        .secrets
                        .insert(key(&s.metadata.namespace, &s.metadata.name), s);
                }
                "Service" => install.services.push(parse(v, &what)?),
                "Deployment" => {
                    let d: Deployment = parse(v, &what)?;
                    install.pods.extend(deployment_pods(&d)?);
                }
                "StatefulSet" => {
                    let s: StatefulSet = parse(v, &what)?;
                    install.pods.extend(statefulset_pods(&s)?);
                }
                "DaemonSet" => {
                    let d: DaemonSet = parse(v, &what)?;
                    install.pods.extend(daemonset_pods(&d, nodes)?);
                }
                "Role" => install.rbac.roles.push(parse(v, &what)?),
                "ClusterRole" => install.rbac.cluster_roles.push(parse(v, &what)?),
                "RoleBinding" => install.rbac.role_bindings.push(parse(v, &what)?),
                "ClusterRoleBinding" => install.rbac.cluster_role_bindings.push(parse(v, &what)?),
                "ServiceAccount" => {
                    let a: ServiceAccount = parse(v, &what)?;
                    install
                        .service_accounts
                        .insert(key(&a.metadata.namespace, &a.metadata.name), a);
                }
                "CustomResourceDefinition" => install.crds.extend(crd_resources(&v)?),
                "Namespace" | "PersistentVolumeClaim" => {}
                other => {
                    let why = NOT_EMULATED
                        .iter()
                        .find(|(k, _)| *k == other)
                        .map_or("not emulated", |(_, w)| *w);
                    install.skipped.insert(other.to_owned(), why);
                }
            }
        }
        Ok(install)
    }

    pub fn config_map(&self, ns: &str, name: &str) -> Option<&ConfigMap> {
        self.config_maps.get(&(ns.to_owned(), name.to_owned()))
    }

    /// Whether `pod` gets its ServiceAccount's API token: its own setting,
    /// else its account's, else yes. Err: it names an account the install
    /// lacks (every namespace has `default`), which admission refuses.
    pub fn automounts(&self, pod: &PodInstance) -> Result<bool, InstallError> {
        let name = pod
            .spec
            .service_account_name
            .as_deref()
            .unwrap_or("default");
        let account = self
            .service_accounts
            .get(&(pod.namespace.clone(), name.to_owned()));
        if account.is_none() && name != "default" {
            return Err(err(format!(
                "pod {} runs as ServiceAccount {name}, which the install does not create: \
                 the API server would not admit it",
                pod.name
            )));
        }
        Ok(pod
            .spec
            .automount_service_account_token
            .or_else(|| account.and_then(|a| a.automount_service_account_token))
            .unwrap_or(true))
    }

    pub fn secret(&self, ns: &str, name: &str) -> Option<&Secret> {
        self.secrets.get(&(ns.to_owned(), name.to_owned()))
    }

    /// The Services of `pod`'s namespace whose selector matches its labels.
    pub fn services_of<'a>(&'a self, pod: &'a PodInstance) -> impl Iterator<Item = &'a Service> {
        self.services.iter().filter(move |s| {
            s.metadata.namespace.as_deref().unwrap_or_default() == pod.namespace
                && s.spec
                    .as_ref()
                    .and_then(|sp| sp.selector.as_ref())
                    .is_some_and(|sel| {
                        !sel.is_empty() && sel.iter().all(|(k, v)| pod.labels.get(k) == Some(v))
                    })
        })
    }

    /// The DNS names under which `pod` is reached: every Service selecting
    /// it (short, namespaced and cluster-local forms) and, for a
    /// StatefulSet's pod, its own name under the headless Service. A
    /// Service whose port differs from its target port cannot be an alias
    /// of the pod's address: that is an error, not a silent wrong answer.
    pub fn dns_names(&self, pod: &PodInstance) -> Result<Vec<String>, InstallError> {
        let ns = &pod.namespace;
        let mut names = Vec::new();
        let forms = |n: &str| {
            [
                n.to_owned(),
                format!("{n}.{ns}"),
                format!("{n}.{ns}.svc"),
                format!("{n}.{ns}.svc.cluster.local"),
            ]
        };
        for svc in self.services_of(pod) {
            let name = svc.metadata.name.clone().unwrap_or_default();
            for port in svc
                .spec
                .as_ref()
                .and_then(|s| s.ports.as_ref())
                .into_iter()
                .flatten()
            {
                let target = match &port.target_port {
                    None => Some(port.port),
                    Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p)) => {
                        Some(*p)
                    }
                    Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(n)) => {
                        named_port(&pod.spec, n)
                    }
                };
                if target != Some(port.port) {
                    return Err(err(format!(
                        "Service {name} maps port {} to {:?} of pod {}: the bundle target \
                         reaches a Service at its pods' addresses, so it needs equal ports",
                        port.port, port.target_port, pod.name
                    )));
                }
            }
            names.extend(forms(&name));
        }
        if let Some(sub) = &pod.subdomain {
            names.extend(forms(&format!("{}.{sub}", pod.name)));
        }
        Ok(names)
    }
}

/// The number of a port named `name` in any container of the pod.
pub fn named_port(spec: &PodSpec, name: &str) -> Option<i32> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(name))
        .map(|p| p.container_port)
}

/// A workload's name, namespace, pod spec, pod labels and annotations.
struct Template {
    kind: &'static str,
    name: String,
    ns: String,
    spec: PodSpec,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

impl Template {
    /// The pod `pod` its controller makes with `spec`: the template's
    /// labels and annotations, owned by the workload, on the testbed's one
    /// node, with no subdomain or claims (a caller sets those it has).
    fn pod(&self, pod: String, spec: PodSpec) -> PodInstance {
        PodInstance {
            uid: uid(&self.ns, &pod),
            name: pod,
            namespace: self.ns.clone(),
            labels: self.labels.clone(),
            annotations: self.annotations.clone(),
            owner: format!("{}/{}", self.kind, self.name),
            spec,
            subdomain: None,
            claims: BTreeMap::new(),
            node: None,
        }
    }
}

fn template_parts(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    template: &k8s_openapi::api::core::v1::PodTemplateSpec,
    kind: &'static str,
) -> Result<Template, InstallError> {
    let name = meta.name.clone().unwrap_or_default();
    let ns = meta.namespace.clone().unwrap_or_else(|| "default".into());
    let spec = template
        .spec
        .clone()
        .ok_or_else(|| err(format!("{kind} {name} has no pod template spec")))?;
    let tmeta = template.metadata.clone().unwrap_or_default();
    Ok(Template {
        kind,
        name,
        ns,
        spec,
        labels: tmeta.labels.unwrap_or_default(),
        annotations: tmeta.annotations.unwrap_or_default(),
    })
}

fn deployment_pods(d: &Deployment) -> Result<Vec<PodInstance>, InstallError> {
    let spec = d.spec.clone().unwrap_or_default();
    let t = template_parts(&d.metadata, &spec.template, "Deployment")?;
    // `<deployment>-<replica set hash>-<5 characters>`, as the controllers
    // name them.
    let template = serde_json::to_string(&spec.template).unwrap_or_default();
    let rs = suffix(&[&template], 10);
    Ok((0..spec.replicas.unwrap_or(1).max(0))
        .map(|i| {
            let name = &t.name;
            let pod = format!("{name}-{rs}-{}", suffix(&[name, &i.to_string()], 5));
            t.pod(pod, t.spec.clone())
        })
        .collect())
}

fn statefulset_pods(s: &StatefulSet) -> Result<Vec<PodInstance>, InstallError> {
    let spec = s.spec.clone().unwrap_or_default();
    let t = template_parts(&s.metadata, &spec.template, "StatefulSet")?;
    let templates: Vec<String> = spec
        .volume_claim_templates
        .iter()
        .flatten()
        .filter_map(|t| t.metadata.name.clone())
        .collect();
    // The controller adds a volume per claim template, named after it.
    let mut pod_spec = t.spec.clone();
    for t in &templates {
        let volumes = pod_spec.volumes.get_or_insert_with(Vec::new);
        if !volumes.iter().any(|v| v.name == *t) {
            volumes.push(k8s_openapi::api::core::v1::Volume {
                name: t.clone(),
                ..Default::default()
            });
        }
    }
    Ok((0..spec.replicas.unwrap_or(1).max(0))
        .map(|i| {
            let pod = format!("{}-{i}", t.name);
            let mut this = pod_spec.clone();
            for v in this.volumes.iter_mut().flatten() {
                if templates.contains(&v.name) {
                    v.persistent_volume_claim = Some(
                        k8s_openapi::api::core::v1::PersistentVolumeClaimVolumeSource {
                            claim_name: format!("{}-{pod}", v.name),
                            read_only: None,
                        },
                    );
                }
            }
            let mut p = t.pod(pod.clone(), this);
            p.labels
                .insert("statefulset.kubernetes.io/pod-name".into(), pod.clone());
            p.labels
                .insert("apps.kubernetes.io/pod-index".into(), i.to_string());
            p.claims = templates
                .iter()
                .map(|c| (c.clone(), format!("{c}-{pod}")))
                .collect();
            p.subdomain =
                Some(spec.service_name.clone().unwrap_or_default()).filter(|s| !s.is_empty());
            p
        })
        .collect())
}

/// A pod per node (`nodes` empty: the testbed's one node), named
/// `<daemonset>-<5 characters>` as the controller names them.
fn daemonset_pods(d: &DaemonSet, nodes: &[String]) -> Result<Vec<PodInstance>, InstallError> {
    let spec = d.spec.clone().unwrap_or_default();
    let t = template_parts(&d.metadata, &spec.template, "DaemonSet")?;
    let on: Vec<Option<&String>> = if nodes.is_empty() {
        vec![None]
    } else {
        nodes.iter().map(Some).collect()
    };
    Ok(on
        .into_iter()
        .map(|node| {
            let mut parts = vec![t.name.as_str()];
            parts.extend(node.map(String::as_str));
            let pod = format!("{}-{}", t.name, suffix(&parts, 5));
            let mut spec = t.spec.clone();
            if let Some(n) = node {
                spec.node_name = Some(n.clone());
            }
            PodInstance {
                node: node.cloned(),
                ..t.pod(pod, spec)
            }
        })
        .collect())
}

/// What the kubelet knows of a pod when it starts its containers.
#[derive(Debug, Clone)]
pub struct Downward<'a> {
    pub pod: &'a PodInstance,
    pub pod_ip: String,
    pub node: String,
    /// The API server as pods reach it (KUBERNETES_SERVICE_HOST/PORT).
    pub api_host: String,
    pub api_port: u16,
    /// Each Service of the namespace and the address it answers at (a pod
    /// it selects), for the service links of `enableServiceLinks`.
    pub service_addrs: Vec<(&'a Service, String)>,
}

/// `$(VAR)` references in `s` replaced by the values of `env` (earlier
/// variables); `$$` is a literal `$`; an unknown reference stays as
/// written. The kubelet's expansion rules.
pub fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
        {
            let name = &inner[..end];
            match env.iter().rev().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&rest[i..i + 2 + end + 1]),
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn string_data(data: Option<&BTreeMap<String, String>>, key: &str) -> Option<String> {
    data.and_then(|d| d.get(key)).cloned()
}

/// A Secret's entries: `data`, and `stringData` (which the API server
/// merges into it).
pub fn secret_entries(s: &Secret) -> Vec<(String, Vec<u8>)> {
    let mut out: BTreeMap<String, Vec<u8>> = s
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect();
    for (k, v) in s.string_data.iter().flatten() {
        out.insert(k.clone(), v.clone().into_bytes());
    }
    out.into_iter().collect()
}

fn secret_value(s: &Secret, key: &str) -> Option<String> {
    s.data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .or_else(|| string_data(s.string_data.as_ref(), key))
}

/// The value of a downward API field path (`metadata.name`,
/// `metadata.labels['kt.dev/service']`, `status.podIP`, ...).
pub fn field(path: &str, d: &Downward<'_>) -> Result<String, InstallError> {
    let p = d.pod;
    let sa = p
        .spec
        .service_account_name
        .clone()
        .unwrap_or_else(|| "default".into());
    let map_key = |prefix: &str, map: &BTreeMap<String, String>| {
        path.strip_prefix(prefix)
            .and_then(|r| r.strip_suffix("']"))
            .map(|k| map.get(k).cloned().unwrap_or_default())
    };
    Ok(match path {
        "metadata.name" => p.name.clone(),
        "metadata.namespace" => p.namespace.clone(),
        "metadata.uid" => p.uid.clone(),
        "spec.nodeName" => d.node.clone(),
        "spec.serviceAccountName" => sa,
        "status.podIP" | "status.podIPs" => d.pod_ip.clone(),
        "status.hostIP" | "status.hostIPs" => d.api_host.clone(),
        _ => map_key("metadata.labels['", &p.labels)
            .or_else(|| map_key("metadata.annotations['", &p.annotations))
            .ok_or_else(|| err(format!("field path {path} is not one the kubelet knows")))?,
    })
}

/// A container's environment as the kubelet builds it: the API server's
/// variables, service links (unless `enableServiceLinks: false`), then
/// `envFrom` and `env` in order, with `$(VAR)` expansion. A missing
/// ConfigMap, Secret or key that is not `optional` is an error (the
/// kubelet would not start the container).
pub fn environment(
    c: &Container,
    d: &Downward<'_>,
    install: &Install,
) -> Result<Vec<(String, String)>, InstallError> {
    let ns = &d.pod.namespace;
    let who = format!("container {} of pod {}", c.name, d.pod.name);
    let mut env: Vec<(String, String)> = Vec::new();
    let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
        env.retain(|(n, _)| *n != k);
        env.push((k, v));
    };
    set(
        &mut env,
        "KUBERNETES_SERVICE_HOST".into(),
        d.api_host.clone(),
    );
    set(
        &mut env,
        "KUBERNETES_SERVICE_PORT".into(),
        d.api_port.to_string(),
    );
    set(
        &mut env,
        "KUBERNETES_SERVICE_PORT_HTTPS".into(),
        d.api_port.to_string(),
    );
    if d.pod.spec.enable_service_links != Some(false) {
        for (svc, addr) in &d.service_addrs {
            let name = svc.metadata.name.clone().unwrap_or_default();
            let var = name.to_ascii_uppercase().replace('-', "_");
            let ports: Vec<_> = svc
                .spec
                .as_ref()
                .and_then(|s| s.ports.clone())
                .unwrap_or_default();
            let Some(first) = ports.first() else { continue };
            set(&mut env, format!("{var}_SERVICE_HOST"), addr.clone());
            set(
                &mut env,
                format!("{var}_SERVICE_PORT"),
                first.port.to_string(),
            );
            set(
                &mut env,
                format!("{var}_PORT"),
                format!("tcp://{addr}:{}", first.port),
            );
            for p in &ports {
                let proto = p.protocol.clone().unwrap_or_else(|| "TCP".into());
                let base = format!("{var}_PORT_{}_{}", p.port, proto);
                set(
                    &mut env,
                    base.clone(),
                    format!("{}://{addr}:{}", proto.to_ascii_lowercase(), p.port),
                );
                set(
                    &mut env,
                    format!("{base}_PROTO"),
                    proto.to_ascii_lowercase(),
                );
                set(&mut env, format!("{base}_PORT"), p.port.to_string());
                set(&mut env, format!("{base}_ADDR"), addr.clone());
            }
        }
    }
    for from in c.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        if let Some(r) = &from.config_map_ref {
            match install.config_map(ns, &r.name) {
                Some(cm) => {
                    for (k, v) in cm.data.iter().flatten() {
                        set(&mut env, format!("{prefix}{k}"), v.clone());
                    }
                }
                None if r.optional == Some(true) => {}
                None => {
                    return Err(err(format!(
                        "{who}: envFrom ConfigMap {} is not in the install",
                        r.name
                    )));
                }
            }
        }
        if let Some(r) = &from.secret_ref {
            match install.secret(ns, &r.name) {
                Some(s) => {
                    let keys: Vec<String> = s
                        .data
                        .iter()
                        .flat_map(|d| d.keys().cloned())
                        .chain(s.string_data.iter().flat_map(|d| d.keys().cloned()))
                        .collect();
                    for k in keys {
                        let v = secret_value(s, &k).unwrap_or_default();
                        set(&mut env, format!("{prefix}{k}"), v);
                    }
                }
                None if r.optional == Some(true) => {}
                None => {
                    return Err(err(format!(
                        "{who}: envFrom Secret {} is not in the install",
                        r.name
                    )));
                }
            }
        }
    }
    for var in c.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(v), _) => Some(expand(v, &env)),
            (None, None) => Some(String::new()),
            (None, Some(from)) => {
                if let Some(f) = &from.field_ref {
                    Some(
                        field(&f.field_path, d)
                            .map_err(|e| err(format!("{who}: env {}: {e}", var.name)))?,
                    )
                } else if let Some(r) = &from.config_map_key_ref {
                    let v = install
                        .config_map(ns, &r.name)
                        .and_then(|cm| string_data(cm.data.as_ref(), &r.key));
                    match v {
                        Some(v) => Some(v),
                        None if r.optional == Some(true) => None,
                        None => {
                            return Err(err(format!(
                                "{who}: env {}: key {} of ConfigMap {} is not in the install",
                                var.name, r.key, r.name
                            )));
                        }
                    }
                } else if let Some(r) = &from.secret_key_ref {
                    match install
                        .secret(ns, &r.name)
                        .and_then(|s| secret_value(s, &r.key))
                    {
                        Some(v) => Some(v),
                        None if r.optional == Some(true) => None,
                        None => {
                            return Err(err(format!(
                                "{who}: env {}: key {} of Secret {} is not in the install",
                                var.name, r.key, r.name
                            )));
                        }
                    }
                } else {
                    return Err(err(format!(
                        "{who}: env {}: this valueFrom is not emulated by the bundle target",
                        var.name
                    )));
                }
            }
        };
        if let Some(v) = value {
            set(&mut env, var.name.clone(), v);
        }
    }
    Ok(env)
}

/// Who a request is, for RBAC: a ServiceAccount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    pub namespace: String,
    pub name: String,
}

/// What a request asks (the attributes RBAC decides on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub verb: String,
    pub group: String,
    pub resource: String,
    /// None: cluster-scoped.
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// The install's RBAC objects; [`Rbac::allows`] decides as the API
/// server's RBAC authorizer does (no aggregation, no non-resource URLs).
#[derive(Debug, Clone, Default)]
pub struct Rbac {
    pub roles: Vec<Role>,
    pub cluster_roles: Vec<ClusterRole>,
    pub role_bindings: Vec<RoleBinding>,
    pub cluster_role_bindings: Vec<ClusterRoleBinding>,
}

fn matches(list: &[String], want: &str) -> bool {
    list.iter().any(|x| x == "*" || x == want)
}

fn rule_allows(r: &PolicyRule, q: &Request) -> bool {
    matches(&r.verbs, &q.verb)
        && r.api_groups
            .as_deref()
            .is_some_and(|g| matches(g, &q.group))
        && r.resources
            .as_deref()
            .is_some_and(|rs| matches(rs, &q.resource))
        && r.resource_names.as_ref().is_none_or(|n| {
            n.is_empty()
                || q.name
                    .as_deref()
                    .is_some_and(|want| n.iter().any(|x| x == want))
        })
}

fn binds(
    subjects: Option<&Vec<k8s_openapi::api::rbac::v1::Subject>>,
    who: &Subject,
    binding_ns: &str,
) -> bool {
    subjects.into_iter().flatten().any(|s| {
        s.kind == "ServiceAccount"
            && s.name == who.name
            && s.namespace.as_deref().unwrap_or(binding_ns) == who.namespace
    })
}

impl Rbac {
    fn cluster_role(&self, name: &str) -> Option<&ClusterRole> {
        self.cluster_roles
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(name))
    }

    pub fn allows(&self, who: &Subject, q: &Request) -> bool {
        let any = |rules: Option<&Vec<PolicyRule>>| {
            rules.into_iter().flatten().any(|r| rule_allows(r, q))
        };
        let cluster_wide = self.cluster_role_bindings.iter().any(|b| {
            binds(b.subjects.as_ref(), who, "")
                && b.role_ref.kind == "ClusterRole"
                && self
                    .cluster_role(&b.role_ref.name)
                    .is_some_and(|r| any(r.rules.as_ref()))
        });
        if cluster_wide {
            return true;
        }
        let Some(ns) = &q.namespace else { return false };
        self.role_bindings.iter().any(|b| {
            let bns = b.metadata.namespace.clone().unwrap_or_default();
            if bns != *ns || !binds(b.subjects.as_ref(), who, &bns) {
                return false;
            }
            match b.role_ref.kind.as_str() {
                "ClusterRole" => self
                    .cluster_role(&b.role_ref.name)
                    .is_some_and(|r| any(r.rules.as_ref())),
                _ => self.roles.iter().any(|r| {
                    r.metadata.name.as_deref() == Some(b.role_ref.name.as_str())
                        && r.metadata.namespace.as_deref() == Some(bns.as_str())
                        && any(r.rules.as_ref())
                }),
            }
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const INSTALL: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata: { name: cfg, namespace: kt }
data: { KT_LOG: info, KT_CHUNK_SIZE: "8" }
---
apiVersion: v1
kind: Secret
metadata: { name: sec, namespace: kt }
data: { token: c2VjcmV0 }
---
apiVersion: v1
kind: Service
metadata: { name: kt-store, namespace: kt }
spec:
  selector: { app: store }
  ports: [{ port: 8082, targetPort: http }]
---
apiVersion: v1
kind: Service
metadata: { name: kt-store-headless, namespace: kt }
spec:
  clusterIP: None
  selector: { app: store }
  ports: [{ port: 8082 }]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: { name: kt-store, namespace: kt }
spec:
  replicas: 2
  serviceName: kt-store-headless
  selector: { matchLabels: { app: store } }
  template:
    metadata: { labels: { app: store, kt.dev/service: st } }
    spec:
      containers:
        - name: kt-store
          image: store
          ports: [{ name: http, containerPort: 8082 }]
          envFrom: [{ configMapRef: { name: cfg } }]
          env:
            - { name: A, value: "x" }
            - { name: B, value: "$(A)-$(NOPE)-$$(A)" }
            - { name: IP, valueFrom: { fieldRef: { fieldPath: status.podIP } } }
            - { name: SVC, valueFrom: { fieldRef: { fieldPath: "metadata.labels['kt.dev/service']" } } }
            - { name: TOKEN, valueFrom: { secretKeyRef: { name: sec, key: token } } }
            - { name: KT_LOG, value: debug }
  volumeClaimTemplates:
    - metadata: { name: data }
---
apiVersion: apps/v1
kind: Deployment
metadata: { name: kt-metadata, namespace: kt }
spec:
  selector: { matchLabels: { app: metadata } }
  template:
    metadata: { labels: { app: metadata } }
    spec:
      enableServiceLinks: false
      containers: [{ name: m, image: metadata }]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: { name: np, namespace: kt }
spec: {}
"#;

    fn downward<'a>(install: &'a Install, pod: &'a PodInstance) -> Downward<'a> {
        Downward {
            pod,
            pod_ip: "10.1.0.5".into(),
            node: "node".into(),
            api_host: "10.1.0.1".into(),
            api_port: 6443,
            service_addrs: install
                .services
                .iter()
                .map(|s| (s, "10.1.0.5".to_owned()))
                .collect(),
        }
    }

    #[test]
    fn controllers_name_their_pods() {
        let i = Install::parse(INSTALL).unwrap();
        let names: Vec<&str> = i.pods.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(&names[..2], ["kt-store-0", "kt-store-1"]);
        let m = &names[2];
        assert!(
            m.starts_with("kt-metadata-") && m.len() == "kt-metadata-".len() + 16,
            "{m}"
        );
        assert_eq!(i.pods[1].claims["data"], "data-kt-store-1");
        let data = i.pods[1]
            .spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "data")
            .unwrap();
        assert_eq!(
            data.persistent_volume_claim.as_ref().unwrap().claim_name,
            "data-kt-store-1"
        );
        assert_eq!(i.skipped.keys().collect::<Vec<_>>(), ["NetworkPolicy"]);
        // Stable names: the same install names the same pods.
        assert_eq!(Install::parse(INSTALL).unwrap().pods[2].name, *m);
    }

    #[test]
    fn the_environment_is_the_kubelets() {
        let i = Install::parse(INSTALL).unwrap();
        let pod = &i.pods[0];
        let env = environment(&pod.spec.containers[0], &downward(&i, pod), &i).unwrap();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("B"), Some("x-$(NOPE)-$(A)"));
        assert_eq!(get("IP"), Some("10.1.0.5"));
        assert_eq!(get("SVC"), Some("st"));
        assert_eq!(get("TOKEN"), Some("secret"));
        // env after envFrom wins.
        assert_eq!(get(kt_types::env::LOG), Some("debug"));
        assert_eq!(get(kt_types::env::CHUNK_SIZE), Some("8"));
        assert_eq!(get("KUBERNETES_SERVICE_PORT"), Some("6443"));
        // Service links, as a pod without enableServiceLinks: false gets.
        let links = kt_types::env::STORE_SERVICE_LINKS;
        assert_eq!(get(&format!("{links}PORT")), Some("tcp://10.1.0.5:8082"));
        let meta = &i.pods[2];
        let env = environment(&meta.spec.containers[0], &downward(&i, meta), &i).unwrap();
        assert!(env.iter().all(|(k, _)| !k.starts_with(links)), "{env:?}");
    }

    #[test]
    fn missing_references_are_errors() {
        let bad = INSTALL.replace("name: sec, key: token", "name: gone, key: token");
        let i = Install::parse(&bad).unwrap();
        let pod = &i.pods[0];
        let e = environment(&pod.spec.containers[0], &downward(&i, pod), &i).unwrap_err();
        assert!(e.0.contains("Secret gone"), "{e}");
    }

    #[test]
    fn services_become_dns_names() {
        let i = Install::parse(INSTALL).unwrap();
        let names = i.dns_names(&i.pods[1]).unwrap();
        for n in [
            "kt-store",
            "kt-store.kt.svc.cluster.local",
            "kt-store-1.kt-store-headless",
            "kt-store-headless.kt",
        ] {
            assert!(names.iter().any(|x| x == n), "{n} not in {names:?}");
        }
        let moved = INSTALL.replace("targetPort: http", "targetPort: 9999");
        let i = Install::parse(&moved).unwrap();
        assert!(i.dns_names(&i.pods[0]).is_err());
    }

    #[test]
    fn expansion_follows_the_kubelet() {
        let env = vec![("A".to_owned(), "1".to_owned())];
        assert_eq!(expand("$(A)$(A)", &env), "11");
        assert_eq!(expand("$$(A) $ $(", &env), "$(A) $ $(");
        assert_eq!(expand("$(B)", &env), "$(B)");
    }

    /// A Role reading pods and a ClusterRole creating TokenReviews, both
    /// bound to the ServiceAccount `md` of namespace `kt`.
    pub const RBAC: &str = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: { name: r, namespace: kt }
rules: [{ apiGroups: [""], resources: [pods], verbs: [get, list, watch] }]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: { name: r, namespace: kt }
roleRef: { apiGroup: rbac.authorization.k8s.io, kind: Role, name: r }
subjects: [{ kind: ServiceAccount, name: md }]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: { name: tr }
rules: [{ apiGroups: [authentication.k8s.io], resources: [tokenreviews], verbs: [create] }]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: { name: tr }
roleRef: { apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: tr }
subjects: [{ kind: ServiceAccount, name: md, namespace: kt }]
"#;

    #[test]
    fn rbac_decides_as_the_authorizer() {
        let yaml = RBAC;
        let rbac = Install::parse(yaml).unwrap().rbac;
        let md = Subject {
            namespace: "kt".into(),
            name: "md".into(),
        };
        let other = Subject {
            namespace: "kt".into(),
            name: "x".into(),
        };
        let ask = |verb: &str, group: &str, resource: &str, ns: Option<&str>| Request {
            verb: verb.into(),
            group: group.into(),
            resource: resource.into(),
            namespace: ns.map(str::to_owned),
            name: None,
        };
        assert!(rbac.allows(&md, &ask("get", "", "pods", Some("kt"))));
        assert!(!rbac.allows(&md, &ask("get", "", "pods", Some("other"))));
        assert!(!rbac.allows(&md, &ask("delete", "", "pods", Some("kt"))));
        assert!(!rbac.allows(&other, &ask("get", "", "pods", Some("kt"))));
        assert!(rbac.allows(
            &md,
            &ask("create", "authentication.k8s.io", "tokenreviews", None)
        ));
        assert!(!rbac.allows(
            &other,
            &ask("create", "authentication.k8s.io", "tokenreviews", None)
        ));
    }

    const NODE_CACHE: &str = r#"
apiVersion: apps/v1
kind: DaemonSet
metadata: { name: kt-node-cache, namespace: kt }
spec:
  selector: { matchLabels: { app: nc } }
  template:
    metadata: { labels: { app: nc } }
    spec:
      containers:
        - name: nc
          image: agent
          env: [{ name: NODE, valueFrom: { fieldRef: { fieldPath: spec.nodeName } } }]
      volumes: [{ name: datasets, hostPath: { path: /var/lib/kt/datasets, type: DirectoryOrCreate } }]
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: { name: datasets.kt.dev }
spec:
  group: kt.dev
  names: { kind: Dataset, plural: datasets, singular: dataset }
  scope: Namespaced
  versions:
    - { name: v1alpha1, served: true, storage: true, subresources: { status: {} } }
    - { name: v1alpha0, served: false, storage: false }
"#;

    #[test]
    fn a_daemonset_runs_a_pod_on_every_node() {
        let nodes: Vec<String> = ["node-1", "node-2", "node-3"].map(String::from).to_vec();
        let i = Install::parse_on(NODE_CACHE, &nodes).unwrap();
        assert_eq!(i.pods.len(), 3);
        for (p, n) in i.pods.iter().zip(&nodes) {
            assert_eq!(p.node.as_ref(), Some(n));
            assert_eq!(p.spec.node_name.as_ref(), Some(n));
            assert_eq!(p.owner, "DaemonSet/kt-node-cache");
            assert!(p.name.starts_with("kt-node-cache-"), "{}", p.name);
            let mut d = downward(&i, p);
            d.node = n.clone();
            let env = environment(&p.spec.containers[0], &d, &i).unwrap();
            assert!(env.iter().any(|(k, v)| k == "NODE" && v == n), "{env:?}");
        }
        let mut names: Vec<&str> = i.pods.iter().map(|p| p.name.as_str()).collect();
        names.dedup();
        assert_eq!(names.len(), 3, "distinct names: {names:?}");
        // On one unnamed node: one pod, as before.
        let one = Install::parse(NODE_CACHE).unwrap();
        assert_eq!(one.pods.len(), 1);
        assert_eq!(one.pods[0].node, None);
    }

    #[test]
    fn a_crd_is_served_in_its_served_versions() {
        let i = Install::parse(NODE_CACHE).unwrap();
        assert_eq!(
            i.crds,
            [CrdResource {
                group: "kt.dev".into(),
                version: "v1alpha1".into(),
                kind: "Dataset".into(),
                plural: "datasets".into(),
                namespaced: true,
                status: true,
            }]
        );
        assert!(i.skipped.is_empty(), "{:?}", i.skipped);
        let bad = NODE_CACHE.replace("scope: Namespaced", "scope: Galaxy");
        let e = Install::parse(&bad).unwrap_err();
        assert!(e.0.contains("Galaxy"), "{e}");
        let bad = NODE_CACHE.replace("plural: datasets, ", "");
        let e = Install::parse(&bad).unwrap_err();
        assert!(e.0.contains("spec.names.plural"), "{e}");
    }
}
