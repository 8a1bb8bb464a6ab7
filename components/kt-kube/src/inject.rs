//! Sidecar injection for the admission webhook (kt-metadata's
//! `--webhook-listen`, the kustomize component `sidecar-injector`): what
//! the components agent-sidecar and agent-identity make of a pod template,
//! as RFC 6902 JSON Patch operations on a pod. Pure: no I/O.
//!
//! The [`Template`] is not a second definition of the sidecar: it is
//! kustomize's rendering of those two components over a placeholder
//! workload with one container, `workload` (`testbed/k8s/components.py`
//! writes it to `kustomize/components/sidecar-injector/template.yaml`, and
//! `make manifests-check` fails when it drifts). [`patch`] turns a pod
//! into what the components would have made of its template:
//!
//! - the init container `kt-agent` (a native sidecar: `restartPolicy:
//!   Always`) after the pod's own init containers; an entry of the pod's
//!   named `kt-agent` without an image is a placeholder (as for the
//!   components: an init container of the pod's that uses kt comes after
//!   it) and is replaced where it stands;
//! - the template's volumes (kt-run, kt-data, kt-token, ...);
//! - the env and volumeMounts of `workload` to the pod's first container,
//!   or to the container the annotation
//!   `kubectl.kubernetes.io/default-container` names (where another
//!   injector, Linkerd's for one, put its proxy first);
//! - the template's pod annotations (`kt.dev/identity`);
//! - `shareProcessNamespace: true` and `enableServiceLinks: false`
//!   ([`FORCED`]), as the component forces them.
//!
//! Decided here, unlike the components: what the pod already has of a
//! name is kept (an env var, a volume, a volumeMount of that name or
//! mountPath, an annotation). The components' replacements overwrite such
//! entries; a pod has no later kustomize patch to put its own back, so the
//! pod's entry wins (`kt-data` with a larger sizeLimit, an https://
//! `KT_METADATA_URL`). A pod whose `kt-agent` init container has an image
//! is injected already (by the components, or by an earlier call) and gets
//! no operation at all, so injection is idempotent and kustomize's pods
//! pass unchanged.
//!
//! The patch never removes or reorders what the pod has: every operation
//! is an `add` (a whole array or object where the pod has none, else an
//! append or a new member), or the `replace` of a placeholder agent.

use std::borrow::Cow;
use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The pod label that asks for the agent (the webhook's objectSelector).
/// The components select workloads by the same label on the WORKLOAD; the
/// webhook sees pods, so there it goes on the pod template.
pub const AGENT_LABEL: &str = "kt.dev/agent";
/// [`AGENT_LABEL`]'s value.
pub const AGENT_LABEL_VALUE: &str = "sidecar";
/// The agent's init container.
pub const AGENT: &str = "kt-agent";
/// The template's stand-in for the pod's container.
pub const TEMPLATE_CONTAINER: &str = "workload";
/// The annotation naming a pod's main container (kubectl's, which Linkerd
/// sets when it puts its proxy first).
pub const DEFAULT_CONTAINER: &str = "kubectl.kubernetes.io/default-container";

/// Why a template cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("the injection template is not YAML: {0}")]
    Yaml(String),
    /// It has something the injection would not carry over, or lacks what
    /// it needs: refused, rather than injecting less than the components.
    #[error("the injection template {0}")]
    Invalid(String),
}

/// Why a pod cannot be injected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InjectError {
    #[error("not a pod: {0}")]
    NotAPod(String),
    #[error(
        "the pod has a regular container named {AGENT}: the agent is the init container the \
         injection adds (a native sidecar), and names are unique in a pod"
    )]
    AgentContainer,
}

/// What the webhook adds to a pod (see the module's documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    annotations: Map<String, Value>,
    agent: Map<String, Value>,
    volumes: Vec<Value>,
    env: Vec<Value>,
    mounts: Vec<Value>,
    /// The template's values of the [`FORCED`] fields it sets.
    forced: Vec<(&'static str, bool)>,
}

/// The pod spec's booleans the template sets and the pod gets whatever it
/// had: `shareProcessNamespace` (the agent ties tensor registrations to
/// processes) and `enableServiceLinks` (off: a Service named like a kt
/// variable, `kt-relay` giving `KT_RELAY_PORT=tcp://...`, would set it in
/// the agent and the workload).
pub const FORCED: [&str; 2] = ["shareProcessNamespace", "enableServiceLinks"];

/// One RFC 6902 operation (the only two the injection makes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum PatchOp {
    Add { path: String, value: Value },
    Replace { path: String, value: Value },
}

impl PatchOp {
    pub fn path(&self) -> &str {
        match self {
            PatchOp::Add { path, .. } | PatchOp::Replace { path, .. } => path,
        }
    }
}

/// A JSON Pointer reference token (RFC 6901): `~` as `~0`, `/` as `~1`.
pub fn escape(token: &str) -> Cow<'_, str> {
    if token.contains(['~', '/']) {
        Cow::Owned(token.replace('~', "~0").replace('/', "~1"))
    } else {
        Cow::Borrowed(token)
    }
}

fn invalid<T>(what: impl Into<String>) -> Result<T, TemplateError> {
    Err(TemplateError::Invalid(what.into()))
}

/// `v`'s keys, all of them among `allowed`.
fn only_keys<'a>(
    v: &'a Value,
    what: &str,
    allowed: &[&str],
) -> Result<&'a Map<String, Value>, TemplateError> {
    let Some(map) = v.as_object() else {
        return invalid(format!("{what} is not a map"));
    };
    if let Some(k) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return invalid(format!(
            "has {what}.{k}, which the injection does not carry over (only {})",
            allowed.join(", ")
        ));
    }
    Ok(map)
}

/// The named entries of a list field (`volumes`, `env`, ...): each a map
/// with a string `name`, no name twice.
fn named_list(v: Option<&Value>, what: &str) -> Result<Vec<Value>, TemplateError> {
    let Some(v) = v else {
        return Ok(Vec::new());
    };
    let Some(items) = v.as_array() else {
        return invalid(format!("{what} is not a list"));
    };
    let mut seen = BTreeSet::new();
    for item in items {
        let Some(name) = name_of(item) else {
            return invalid(format!("{what} has an entry without a name"));
        };
        if !seen.insert(name) {
            return invalid(format!("{what} names {name} twice"));
        }
    }
    Ok(items.clone())
}

fn name_of(v: &Value) -> Option<&str> {
    v.get("name").and_then(Value::as_str)
}

impl Template {
    /// The pod template of `template.yaml` (a PodTemplateSpec: `metadata`
    /// with annotations, `spec` with the agent, the volumes, the container
    /// `workload` and the [`FORCED`] booleans; nothing else).
    pub fn from_yaml(text: &str) -> Result<Template, TemplateError> {
        let v: Value =
            serde_yaml_ng::from_str(text).map_err(|e| TemplateError::Yaml(e.to_string()))?;
        Template::from_value(&v)
    }

    /// [`Template::from_yaml`] of a parsed document.
    pub fn from_value(v: &Value) -> Result<Template, TemplateError> {
        let top = only_keys(v, "(the pod template)", &["metadata", "spec"])?;
        let mut annotations = Map::new();
        if let Some(meta) = top.get("metadata") {
            // Pod labels would be the webhook's to add too: not supported
            // until a component adds one.
            let meta = only_keys(meta, "metadata", &["annotations"])?;
            if let Some(a) = meta.get("annotations") {
                let Some(a) = a.as_object() else {
                    return invalid("metadata.annotations is not a map");
                };
                if let Some((k, _)) = a.iter().find(|(_, v)| !v.is_string()) {
                    return invalid(format!("metadata.annotations.{k} is not a string"));
                }
                annotations = a.clone();
            }
        }
        let Some(spec) = top.get("spec") else {
            return invalid("has no spec");
        };
        let spec = only_keys(
            spec,
            "spec",
            &[
                "initContainers",
                "containers",
                "volumes",
                FORCED[0],
                FORCED[1],
            ],
        )?;
        let inits = named_list(spec.get("initContainers"), "spec.initContainers")?;
        let agent = match inits.as_slice() {
            [a] if name_of(a) == Some(AGENT) => a.as_object().cloned().unwrap_or_default(),
            _ => return invalid(format!("has not exactly one init container, {AGENT}")),
        };
        if agent.get("restartPolicy").and_then(Value::as_str) != Some("Always") {
            return invalid(format!(
                "has no restartPolicy Always on {AGENT} (not a native sidecar)"
            ));
        }
        let containers = named_list(spec.get("containers"), "spec.containers")?;
        let workload = match containers.as_slice() {
            [c] if name_of(c) == Some(TEMPLATE_CONTAINER) => c,
            _ => {
                return invalid(format!(
                    "has not exactly one container, {TEMPLATE_CONTAINER} (the pod's container)"
                ));
            }
        };
        let workload = only_keys(
            workload,
            "spec.containers[workload]",
            &["name", "env", "volumeMounts"],
        )?;
        let env = named_list(workload.get("env"), "the container's env")?;
        let mounts = named_list(workload.get("volumeMounts"), "the container's volumeMounts")?;
        if mounts
            .iter()
            .any(|m| m.get("mountPath").and_then(Value::as_str).is_none())
        {
            return invalid("has a volumeMount without a mountPath");
        }
        let volumes = named_list(spec.get("volumes"), "spec.volumes")?;
        let mut forced = Vec::new();
        for key in FORCED {
            match spec.get(key) {
                None => {}
                Some(Value::Bool(b)) => forced.push((key, *b)),
                Some(_) => return invalid(format!("spec.{key} is not a boolean")),
            }
        }
        Ok(Template {
            annotations,
            agent,
            volumes,
            env,
            mounts,
            forced,
        })
    }

    /// The agent's image (`KT_INJECT_AGENT_IMAGE`: the bundle keeps it out
    /// of the template, where kustomize's `images:` could not pin it).
    pub fn with_agent_image(mut self, image: &str) -> Template {
        self.agent
            .insert("image".into(), Value::String(image.to_owned()));
        self
    }

    /// The agent's image, if the template has one.
    pub fn agent_image(&self) -> Option<&str> {
        self.agent
            .get("image")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    }
}

/// A list field of the pod (`None` when it has none).
fn list<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<&'a Vec<Value>>, InjectError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(_) => Err(InjectError::NotAPod(format!("{at}{key} is not a list"))),
    }
}

/// Operations adding `missing` to the list at `path` (`have`: the list the
/// pod has, if any): the whole list where there is none, else appends.
fn add_all(ops: &mut Vec<PatchOp>, path: &str, have: Option<&Vec<Value>>, missing: Vec<Value>) {
    if missing.is_empty() {
        return;
    }
    if have.is_none() {
        ops.push(PatchOp::Add {
            path: path.to_owned(),
            value: Value::Array(missing),
        });
        return;
    }
    for value in missing {
        ops.push(PatchOp::Add {
            path: format!("{path}/-"),
            value,
        });
    }
}

fn names(items: Option<&Vec<Value>>) -> BTreeSet<&str> {
    items.into_iter().flatten().filter_map(name_of).collect()
}

/// The operations that inject `template` into `pod` (a Pod as JSON, as an
/// AdmissionReview carries it); none when its agent is there already.
pub fn patch(pod: &Value, template: &Template) -> Result<Vec<PatchOp>, InjectError> {
    let spec = pod
        .get("spec")
        .and_then(Value::as_object)
        .ok_or_else(|| InjectError::NotAPod("no spec".into()))?;
    let containers = list(spec, "containers", "spec.")?
        .filter(|c| !c.is_empty())
        .ok_or_else(|| InjectError::NotAPod("no containers".into()))?;
    if containers.iter().any(|c| name_of(c) == Some(AGENT)) {
        return Err(InjectError::AgentContainer);
    }
    let mut ops = Vec::new();
    let agent = Value::Object(template.agent.clone());
    let inits = list(spec, "initContainers", "spec.")?;
    match inits.and_then(|i| i.iter().position(|c| name_of(c) == Some(AGENT))) {
        Some(i) => {
            let placeholder = inits
                .and_then(|all| all[i].get("image"))
                .and_then(Value::as_str)
                .is_none_or(str::is_empty);
            if !placeholder {
                return Ok(Vec::new());
            }
            ops.push(PatchOp::Replace {
                path: format!("/spec/initContainers/{i}"),
                value: agent,
            });
        }
        None => add_all(&mut ops, "/spec/initContainers", inits, vec![agent]),
    }

    let volumes = list(spec, "volumes", "spec.")?;
    let have = names(volumes);
    let missing = template
        .volumes
        .iter()
        .filter(|v| name_of(v).is_some_and(|n| !have.contains(n)))
        .cloned()
        .collect();
    add_all(&mut ops, "/spec/volumes", volumes, missing);

    let annotations = pod
        .get("metadata")
        .and_then(|m| m.get("annotations"))
        .and_then(Value::as_object);
    let target = annotations
        .and_then(|a| a.get(DEFAULT_CONTAINER))
        .and_then(Value::as_str)
        .and_then(|want| containers.iter().position(|c| name_of(c) == Some(want)))
        .unwrap_or(0);
    let container = containers[target]
        .as_object()
        .ok_or_else(|| InjectError::NotAPod(format!("spec.containers[{target}] is not a map")))?;
    let at = format!("spec.containers[{target}].");
    let env = list(container, "env", &at)?;
    let have = names(env);
    let missing = template
        .env
        .iter()
        .filter(|e| name_of(e).is_some_and(|n| !have.contains(n)))
        .cloned()
        .collect();
    add_all(
        &mut ops,
        &format!("/spec/containers/{target}/env"),
        env,
        missing,
    );
    let mounts = list(container, "volumeMounts", &at)?;
    let have = names(mounts);
    let paths: BTreeSet<&str> = mounts
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("mountPath").and_then(Value::as_str))
        .collect();
    let missing = template
        .mounts
        .iter()
        .filter(|m| {
            let path = m
                .get("mountPath")
                .and_then(Value::as_str)
                .unwrap_or_default();
            name_of(m).is_some_and(|n| !have.contains(n)) && !paths.contains(path)
        })
        .cloned()
        .collect();
    add_all(
        &mut ops,
        &format!("/spec/containers/{target}/volumeMounts"),
        mounts,
        missing,
    );

    let missing: Map<String, Value> = template
        .annotations
        .iter()
        .filter(|(k, _)| !annotations.is_some_and(|a| a.contains_key(*k)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !missing.is_empty() {
        match (pod.get("metadata"), annotations) {
            (None, _) => ops.push(PatchOp::Add {
                path: "/metadata".into(),
                value: serde_json::json!({ "annotations": missing }),
            }),
            (Some(_), None) => ops.push(PatchOp::Add {
                path: "/metadata/annotations".into(),
                value: Value::Object(missing),
            }),
            (Some(_), Some(_)) => {
                for (k, value) in missing {
                    ops.push(PatchOp::Add {
                        path: format!("/metadata/annotations/{}", escape(&k)),
                        value,
                    });
                }
            }
        }
    }

    for &(key, value) in &template.forced {
        if spec.get(key) != Some(&Value::Bool(value)) {
            ops.push(PatchOp::Add {
                path: format!("/spec/{key}"),
                value: Value::Bool(value),
            });
        }
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use kt_types::env;
    use serde_json::json;

    use super::*;

    /// A small template of the committed one's shape.
    fn template() -> Template {
        Template::from_value(&json!({
            "metadata": {"annotations": {"kt.dev/identity": "serviceaccount"}},
            "spec": {
                "initContainers": [{
                    "name": "kt-agent", "image": "agent:1", "restartPolicy": "Always",
                    "volumeMounts": [{"name": "kt-run", "mountPath": "/run/kt"}]
                }],
                "containers": [{
                    "name": "workload",
                    "env": [{"name": env::AGENT_SOCKET, "value": "/run/kt/agent/agent.sock"},
                            {"name": env::AGENT_AUTOSTART, "value": "0"}],
                    "volumeMounts": [{"name": "kt-run", "mountPath": "/run/kt", "readOnly": true},
                                     {"name": "kt-shm", "mountPath": "/dev/shm"}]
                }],
                "volumes": [{"name": "kt-run", "emptyDir": {"medium": "Memory"}},
                            {"name": "kt-shm", "emptyDir": {"medium": "Memory"}}],
                "shareProcessNamespace": true,
                "enableServiceLinks": false
            }
        }))
        .unwrap()
    }

    fn apply(pod: &Value, ops: &[PatchOp]) -> Value {
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::to_value(ops).unwrap()).unwrap();
        let mut out = pod.clone();
        json_patch::patch(&mut out, &patch).unwrap();
        out
    }

    fn bare() -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "labels": {"kt.dev/agent": "sidecar"}},
            "spec": {"containers": [{"name": "app", "image": "app:1"}]}
        })
    }

    #[test]
    fn a_bare_pod_gets_whole_arrays_and_maps_added() {
        let ops = patch(&bare(), &template()).unwrap();
        let paths: Vec<&str> = ops.iter().map(PatchOp::path).collect();
        assert_eq!(
            paths,
            [
                "/spec/initContainers",
                "/spec/volumes",
                "/spec/containers/0/env",
                "/spec/containers/0/volumeMounts",
                "/metadata/annotations",
                "/spec/shareProcessNamespace",
                "/spec/enableServiceLinks",
            ]
        );
        let pod = apply(&bare(), &ops);
        assert_eq!(pod["spec"]["initContainers"][0]["name"], "kt-agent");
        assert_eq!(pod["spec"]["initContainers"][0]["restartPolicy"], "Always");
        assert_eq!(pod["spec"]["containers"][0]["env"][1]["value"], "0");
        assert_eq!(
            pod["spec"]["containers"][0]["volumeMounts"][0]["readOnly"],
            true
        );
        assert_eq!(pod["spec"]["shareProcessNamespace"], true);
        assert_eq!(pod["spec"]["enableServiceLinks"], false);
        assert_eq!(
            pod["metadata"]["annotations"]["kt.dev/identity"],
            "serviceaccount"
        );
        assert_eq!(pod["metadata"]["labels"]["kt.dev/agent"], "sidecar");
    }

    #[test]
    fn injection_is_idempotent() {
        let once = apply(&bare(), &patch(&bare(), &template()).unwrap());
        assert_eq!(patch(&once, &template()).unwrap(), []);
    }

    #[test]
    fn the_pods_own_init_containers_stay_before_the_agent() {
        let mut pod = bare();
        pod["spec"]["initContainers"] =
            json!([{"name": "setup", "image": "s"}, {"name": "more", "image": "m"}]);
        let ops = patch(&pod, &template()).unwrap();
        assert_eq!(ops[0].path(), "/spec/initContainers/-");
        let out = apply(&pod, &ops);
        let names: Vec<&str> = out["spec"]["initContainers"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(name_of)
            .collect();
        assert_eq!(names, ["setup", "more", "kt-agent"]);
    }

    #[test]
    fn a_placeholder_agent_is_replaced_where_it_stands() {
        let mut pod = bare();
        pod["spec"]["initContainers"] =
            json!([{"name": "kt-agent"}, {"name": "uses-kt", "image": "u"}]);
        let out = apply(&pod, &patch(&pod, &template()).unwrap());
        assert_eq!(out["spec"]["initContainers"][0]["image"], "agent:1");
        assert_eq!(out["spec"]["initContainers"][1]["name"], "uses-kt");
        assert_eq!(out["spec"]["initContainers"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn what_the_pod_has_of_a_name_is_kept() {
        let mut pod = bare();
        pod["spec"]["volumes"] = json!([{"name": "kt-shm", "emptyDir": {"sizeLimit": "1Gi"}}]);
        pod["spec"]["containers"][0]["env"] = json!([{"name": env::AGENT_AUTOSTART, "value": "1"}]);
        // Another volume on /dev/shm: a second mount there would be refused.
        pod["spec"]["containers"][0]["volumeMounts"] =
            json!([{"name": "shm", "mountPath": "/dev/shm"}]);
        pod["spec"]["shareProcessNamespace"] = json!(false);
        pod["spec"]["enableServiceLinks"] = json!(true);
        pod["metadata"]["annotations"] = json!({"kt.dev/identity": "mine"});
        let out = apply(&pod, &patch(&pod, &template()).unwrap());
        assert_eq!(
            out["spec"]["volumes"],
            json!([{"name": "kt-shm", "emptyDir": {"sizeLimit": "1Gi"}},
                   {"name": "kt-run", "emptyDir": {"medium": "Memory"}}])
        );
        assert_eq!(
            out["spec"]["containers"][0]["env"],
            json!([{"name": env::AGENT_AUTOSTART, "value": "1"},
                   {"name": env::AGENT_SOCKET, "value": "/run/kt/agent/agent.sock"}])
        );
        assert_eq!(
            out["spec"]["containers"][0]["volumeMounts"],
            json!([{"name": "shm", "mountPath": "/dev/shm"},
                   {"name": "kt-run", "mountPath": "/run/kt", "readOnly": true}])
        );
        assert_eq!(out["metadata"]["annotations"]["kt.dev/identity"], "mine");
        // Forced, as the component forces them.
        assert_eq!(out["spec"]["shareProcessNamespace"], true);
        assert_eq!(out["spec"]["enableServiceLinks"], false);
    }

    #[test]
    fn annotation_keys_are_escaped_in_paths() {
        assert_eq!(escape("kt.dev/identity"), "kt.dev~1identity");
        assert_eq!(escape("a~b/c~/"), "a~0b~1c~0~1");
        assert!(matches!(escape("plain"), Cow::Borrowed("plain")));
        let t = Template::from_value(&json!({
            "metadata": {"annotations": {"x.io/a~b": "1", "kt.dev/identity": "serviceaccount"}},
            "spec": {
                "initContainers": [{"name": "kt-agent", "image": "a", "restartPolicy": "Always"}],
                "containers": [{"name": "workload"}]
            }
        }))
        .unwrap();
        let mut pod = bare();
        pod["metadata"]["annotations"] = json!({"other": "x"});
        let ops = patch(&pod, &t).unwrap();
        let paths: Vec<&str> = ops.iter().map(PatchOp::path).collect();
        assert_eq!(
            paths,
            [
                "/spec/initContainers",
                "/metadata/annotations/kt.dev~1identity",
                "/metadata/annotations/x.io~1a~0b",
            ]
        );
        let out = apply(&pod, &ops);
        assert_eq!(out["metadata"]["annotations"]["x.io/a~b"], "1");
        assert_eq!(out["metadata"]["annotations"]["other"], "x");
    }

    #[test]
    fn the_default_container_annotation_picks_the_container() {
        let mut pod = bare();
        pod["metadata"]["annotations"] = json!({DEFAULT_CONTAINER: "app"});
        pod["spec"]["containers"] =
            json!([{"name": "proxy", "image": "p"}, {"name": "app", "image": "a"}]);
        let out = apply(&pod, &patch(&pod, &template()).unwrap());
        assert!(out["spec"]["containers"][0].get("env").is_none());
        assert_eq!(
            out["spec"]["containers"][1]["env"][0]["name"],
            env::AGENT_SOCKET
        );
        // A name that is no container's: the first one.
        pod["metadata"]["annotations"] = json!({DEFAULT_CONTAINER: "gone"});
        let out = apply(&pod, &patch(&pod, &template()).unwrap());
        assert_eq!(
            out["spec"]["containers"][0]["env"][0]["name"],
            env::AGENT_SOCKET
        );
    }

    #[test]
    fn what_is_no_pod_is_refused() {
        let t = template();
        assert!(matches!(
            patch(&json!({"kind": "Pod"}), &t),
            Err(InjectError::NotAPod(_))
        ));
        assert!(matches!(
            patch(&json!({"spec": {"containers": []}}), &t),
            Err(InjectError::NotAPod(_))
        ));
        assert!(matches!(
            patch(
                &json!({"spec": {"containers": [{"name": "a"}], "volumes": {}}}),
                &t
            ),
            Err(InjectError::NotAPod(_))
        ));
        assert_eq!(
            patch(&json!({"spec": {"containers": [{"name": "kt-agent"}]}}), &t),
            Err(InjectError::AgentContainer)
        );
    }

    #[test]
    fn templates_with_more_than_the_injection_carries_are_refused() {
        let base = json!({
            "spec": {
                "initContainers": [{"name": "kt-agent", "restartPolicy": "Always"}],
                "containers": [{"name": "workload"}]
            }
        });
        assert!(Template::from_value(&base).is_ok());
        let refused = |edit: &dyn Fn(&mut Value)| {
            let mut v = base.clone();
            edit(&mut v);
            Template::from_value(&v).unwrap_err().to_string()
        };
        assert!(refused(&|v| v["spec"]["tolerations"] = json!([])).contains("tolerations"));
        assert!(refused(&|v| v["metadata"] = json!({"labels": {"a": "b"}})).contains("labels"));
        assert!(
            refused(&|v| v["spec"]["containers"][0]["resources"] = json!({})).contains("resources")
        );
        assert!(
            refused(&|v| v["spec"]["initContainers"][0]["restartPolicy"] = json!("Never"))
                .contains("native sidecar")
        );
        assert!(refused(&|v| v["spec"]["initContainers"] = json!([])).contains("kt-agent"));
        assert!(
            refused(&|v| v["spec"]["volumes"] = json!([{"name": "a"}, {"name": "a"}]))
                .contains("twice")
        );
        assert!(matches!(
            Template::from_yaml("spec: [").unwrap_err(),
            TemplateError::Yaml(_)
        ));
        let t = Template::from_value(&base).unwrap();
        assert_eq!(t.agent_image(), None);
        assert_eq!(
            t.with_agent_image("reg/kt-agent@sha256:1").agent_image(),
            Some("reg/kt-agent@sha256:1")
        );
    }
}
