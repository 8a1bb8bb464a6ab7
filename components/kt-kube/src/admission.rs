//! The sidecar injector's side of the admission webhook protocol
//! (`admission.k8s.io/v1` AdmissionReview) around [`crate::inject`]. Pure:
//! bytes of a review in, the review to answer out; kt-metadata serves it
//! over HTTPS (`--webhook-listen`, `POST /mutate`).
//!
//! What each review gets:
//! - the CREATE of a Pod: `allowed: true`, the request's `uid`, and, unless
//!   its agent is there already, `patchType: JSONPatch` with the
//!   operations ([`crate::inject::patch`]) as base64;
//! - anything else (another kind, another operation, a subresource; the
//!   webhook's rules send none of them): `allowed: true` without a patch;
//!   this webhook refuses nothing it does not handle;
//! - a body that is no AdmissionReview v1 with a request, or a pod that
//!   cannot be injected: an error ([`ReviewError`]), which the server
//!   answers with HTTP 400. The API server counts that, like a timeout or
//!   a TLS failure, as a failed call, and the webhook configuration's
//!   `failurePolicy` decides: `Fail` (the bundle's default: no labelled pod
//!   is created without its agent) refuses the pod, `Ignore` admits it
//!   as it is. That one setting is what "failing open or closed" means;
//!   the webhook never answers `allowed: false` itself.

use base64::Engine;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::inject::{InjectError, PatchOp, Template};

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

/// Why a review cannot be answered (HTTP 400: the API server applies the
/// webhook's failurePolicy).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    #[error("not an {API_VERSION} {KIND} with a request: {0}")]
    Malformed(String),
    #[error("pod {pod}: {error}")]
    Pod { pod: String, error: InjectError },
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    api_version: String,
    kind: String,
    request: Option<Request>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request {
    uid: String,
    kind: Gvk,
    #[serde(default)]
    sub_resource: Option<String>,
    operation: String,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    object: Option<Value>,
    #[serde(default)]
    dry_run: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct Gvk {
    #[serde(default)]
    group: String,
    version: String,
    kind: String,
}

/// What was decided for one review.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The pod gets these operations.
    Injected(Vec<PatchOp>),
    /// The pod has its agent already.
    Present,
    /// Not the CREATE of a Pod, and why.
    NotHandled(String),
}

/// A review's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Reviewed {
    /// The request's uid, echoed.
    pub uid: String,
    /// The pod, for logs: `namespace/name` (or `namespace/generateName*`).
    pub pod: String,
    /// The request was a dry run (nothing is created; the answer is the
    /// same).
    pub dry_run: bool,
    pub verdict: Verdict,
}

impl Reviewed {
    /// The AdmissionReview to answer with.
    pub fn response(&self) -> Value {
        let mut response = json!({ "uid": self.uid, "allowed": true });
        if let Verdict::Injected(ops) = &self.verdict {
            // Serializing plain values cannot fail.
            let patch = serde_json::to_vec(ops).unwrap_or_default();
            response["patchType"] = json!("JSONPatch");
            response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(patch));
        }
        json!({ "apiVersion": API_VERSION, "kind": KIND, "response": response })
    }
}

fn pod_name(pod: &Value, namespace: Option<&str>) -> String {
    let meta = pod.get("metadata");
    let field = |k| meta.and_then(|m| m.get(k)).and_then(Value::as_str);
    let ns = field("namespace").or(namespace).unwrap_or("");
    match (field("name"), field("generateName")) {
        (Some(n), _) if !n.is_empty() => format!("{ns}/{n}"),
        (_, Some(g)) => format!("{ns}/{g}*"),
        _ => format!("{ns}/(no name)"),
    }
}

/// Answers the AdmissionReview in `body` with `template`.
pub fn review(body: &[u8], template: &Template) -> Result<Reviewed, ReviewError> {
    let r: Review =
        serde_json::from_slice(body).map_err(|e| ReviewError::Malformed(e.to_string()))?;
    if r.api_version != API_VERSION || r.kind != KIND {
        return Err(ReviewError::Malformed(format!(
            "apiVersion {:?}, kind {:?}",
            r.api_version, r.kind
        )));
    }
    let req = r
        .request
        .ok_or_else(|| ReviewError::Malformed("no request".into()))?;
    let namespace = req.namespace.as_deref();
    let pod = req
        .object
        .as_ref()
        .map(|o| pod_name(o, namespace))
        .unwrap_or_default();
    let done = |verdict| Reviewed {
        uid: req.uid.clone(),
        pod: pod.clone(),
        dry_run: req.dry_run.unwrap_or(false),
        verdict,
    };
    let gvk = &req.kind;
    if (gvk.group.as_str(), gvk.version.as_str(), gvk.kind.as_str()) != ("", "v1", "Pod") {
        return Ok(done(Verdict::NotHandled(format!(
            "a {}/{} {}, not a v1 Pod",
            gvk.group, gvk.version, gvk.kind
        ))));
    }
    if req.operation != "CREATE" || req.sub_resource.as_deref().is_some_and(|s| !s.is_empty()) {
        return Ok(done(Verdict::NotHandled(format!(
            "{} {}, not the CREATE of a pod",
            req.operation,
            req.sub_resource.as_deref().unwrap_or("")
        ))));
    }
    let object = req.object.as_ref().ok_or_else(|| ReviewError::Pod {
        pod: pod.clone(),
        error: InjectError::NotAPod("the request has no object".into()),
    })?;
    match crate::inject::patch(object, template) {
        Ok(ops) if ops.is_empty() => Ok(done(Verdict::Present)),
        Ok(ops) => Ok(done(Verdict::Injected(ops))),
        Err(error) => Err(ReviewError::Pod { pod, error }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> Template {
        Template::from_value(&json!({
            "spec": {
                "initContainers": [{"name": "kt-agent", "image": "a", "restartPolicy": "Always"}],
                "containers": [{"name": "workload",
                                "env": [{"name": kt_types::env::AGENT_AUTOSTART, "value": "0"}]}]
            }
        }))
        .unwrap()
    }

    fn review_of(kind: Value, operation: &str, object: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": kind,
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "operation": operation,
                "namespace": "kt",
                "object": object,
                "dryRun": false
            }
        }))
        .unwrap()
    }

    fn pod_kind() -> Value {
        json!({"group": "", "version": "v1", "kind": "Pod"})
    }

    fn pod() -> Value {
        json!({"metadata": {"generateName": "trainer-"}, "spec": {"containers": [{"name": "c"}]}})
    }

    #[test]
    fn a_pod_created_gets_its_patch_as_base64() {
        let r = review(&review_of(pod_kind(), "CREATE", pod()), &template()).unwrap();
        assert_eq!(r.pod, "kt/trainer-*");
        let Verdict::Injected(ops) = &r.verdict else {
            panic!("{r:?}")
        };
        let out = r.response();
        assert_eq!(out["apiVersion"], API_VERSION);
        assert_eq!(out["kind"], KIND);
        assert_eq!(
            out["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(out["response"]["allowed"], true);
        assert_eq!(out["response"]["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(out["response"]["patch"].as_str().unwrap())
            .unwrap();
        let decoded: Vec<PatchOp> = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(&decoded, ops);
        let raw: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(raw[0]["op"], "add");
        assert_eq!(raw[0]["path"], "/spec/initContainers");
    }

    #[test]
    fn a_pod_with_its_agent_is_allowed_without_a_patch() {
        let mut p = pod();
        p["spec"]["initContainers"] = json!([{"name": "kt-agent", "image": "a"}]);
        let r = review(&review_of(pod_kind(), "CREATE", p), &template()).unwrap();
        assert_eq!(r.verdict, Verdict::Present);
        let out = r.response();
        assert_eq!(out["response"], json!({"uid": r.uid, "allowed": true}));
    }

    #[test]
    fn what_it_does_not_handle_is_allowed_as_it_is() {
        let deploy = json!({"group": "apps", "version": "v1", "kind": "Deployment"});
        let r = review(&review_of(deploy, "CREATE", json!({})), &template()).unwrap();
        assert!(matches!(r.verdict, Verdict::NotHandled(_)), "{r:?}");
        assert!(r.response()["response"].get("patch").is_none());
        let r = review(&review_of(pod_kind(), "UPDATE", pod()), &template()).unwrap();
        assert!(matches!(r.verdict, Verdict::NotHandled(_)), "{r:?}");
        assert_eq!(r.response()["response"]["allowed"], true);
    }

    #[test]
    fn malformed_reviews_and_pods_are_errors() {
        let t = template();
        for body in [
            &b"not json"[..],
            br#"{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": null}"#,
            br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}"#,
            br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u"}}"#,
        ] {
            assert!(
                matches!(review(body, &t), Err(ReviewError::Malformed(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let err = review(
            &review_of(pod_kind(), "CREATE", json!({"metadata": {"name": "p"}})),
            &t,
        )
        .unwrap_err();
        assert_eq!(
            err,
            ReviewError::Pod {
                pod: "kt/p".into(),
                error: InjectError::NotAPod("no spec".into())
            }
        );
    }
}
