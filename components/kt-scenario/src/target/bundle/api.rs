//! The bundle target's scripted Kubernetes API: HTTPS with a CA of the
//! run's own (the `ca.crt` every pod's ServiceAccount volume carries), the
//! few calls kt's components make, answered from what the bundle's
//! kubelet runs, behind the install's own RBAC:
//!
//! - `POST /apis/authentication.k8s.io/v1/tokenreviews`: the tokens this
//!   API issued ([`ScriptedApi::issue`]: projected ServiceAccount tokens
//!   with an audience, an expiry and the pod they are bound to), as the
//!   real one reviews them (wrong audience, expired, unknown: not
//!   authenticated);
//! - pods: get, list and watch in a namespace, with label selectors;
//! - Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs and CronJobs:
//!   list and watch, as metadata (what kt's namespace watch asks for).
//!
//! Every caller presents a token for the API server's audience, and every
//! request is authorized by the install's Roles, ClusterRoles and
//! bindings ([`Rbac`]): a Role the install forgot is a 403 here as in a
//! cluster. Watches stay open, without events, until the client's
//! `timeoutSeconds` (the bundle's pods and workloads do not change while a
//! scenario runs). Every request is logged ([`ScriptedApi::log`]).

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use serde_json::{Value, json};

use super::install::{Rbac, Request as Ask, Subject};

/// The audience of tokens for the API server itself (what the kubelet
/// mounts at /var/run/secrets/kubernetes.io/serviceaccount).
pub const API_AUDIENCE: &str = "https://kubernetes.default.svc.cluster.local";
/// The longest a watch is held open.
const WATCH_MAX: Duration = Duration::from_secs(290);

/// A token this API issued.
#[derive(Debug, Clone)]
struct Issued {
    subject: Subject,
    audiences: Vec<String>,
    /// The pod it is bound to: name and uid.
    pod: Option<(String, String)>,
    /// Seconds since the epoch.
    expires: u64,
}

#[derive(Debug, Default)]
struct Objects {
    /// Pods by namespace and name (full objects).
    pods: BTreeMap<(String, String), Value>,
    /// Workloads' metadata by resource (`deployments`), namespace, name.
    workloads: BTreeMap<(String, String, String), Value>,
}

#[derive(Debug)]
struct Shared {
    tokens: Mutex<HashMap<String, Issued>>,
    objects: Mutex<Objects>,
    rbac: Rbac,
    log: Mutex<Vec<String>>,
    /// What the calls above do not cover, when the run has one
    /// ([`ScriptedApi::with_objects`]).
    objects_api: Option<Arc<kt_kube::apiserver::ApiServer>>,
    http: reqwest::Client,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The scripted API, serving until dropped.
#[derive(Debug)]
pub struct ScriptedApi {
    shared: Arc<Shared>,
    addr: SocketAddr,
    ca: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why the API could not start.
#[derive(Debug, thiserror::Error)]
#[error("the scripted Kubernetes API: {0}")]
pub struct ApiError(String);

/// Writes a CA and a server certificate for `ip` (and the names pods use
/// for the API) into `dir`: `ca.crt`, `server.crt`, `server.key`.
fn write_pki(dir: &Path, ip: IpAddr) -> Result<(), ApiError> {
    let e = |what: &str| {
        let what = what.to_owned();
        move |err: rcgen::Error| ApiError(format!("{what}: {err}"))
    };
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(e("CA"))?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "kt bundle testbed CA");
    let ca_key = rcgen::KeyPair::generate().map_err(e("CA key"))?;
    let ca = ca.self_signed(&ca_key).map_err(e("CA"))?;
    let names = vec![
        ip.to_string(),
        "kubernetes".to_owned(),
        "kubernetes.default".to_owned(),
        "kubernetes.default.svc".to_owned(),
        "kubernetes.default.svc.cluster.local".to_owned(),
    ];
    let server = rcgen::CertificateParams::new(names).map_err(e("server certificate"))?;
    let key = rcgen::KeyPair::generate().map_err(e("server key"))?;
    let cert = server
        .signed_by(&key, &ca, &ca_key)
        .map_err(e("server certificate"))?;
    std::fs::create_dir_all(dir).map_err(|err| ApiError(format!("{}: {err}", dir.display())))?;
    for (name, pem, mode) in [
        ("ca.crt", ca.pem(), 0o644),
        ("server.crt", cert.pem(), 0o644),
        ("server.key", key.serialize_pem(), 0o600),
    ] {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&path)
            .and_then(|mut f| f.write_all(pem.as_bytes()))
            .map_err(|err| ApiError(format!("{}: {err}", path.display())))?;
    }
    Ok(())
}

impl ScriptedApi {
    /// Serves on `ip` (a port of the system's choosing), with its
    /// certificates in `dir`, authorizing by `rbac`.
    pub async fn start(ip: IpAddr, dir: &Path, rbac: Rbac) -> Result<ScriptedApi, ApiError> {
        ScriptedApi::with_objects(ip, dir, rbac, None).await
    }

    /// As [`ScriptedApi::start`], with every other authorized request
    /// (Nodes, custom resources, Events, Secrets: what a Dataset
    /// controller asks) passed to `objects`, an in-memory API server on
    /// this machine's loopback.
    pub async fn with_objects(
        ip: IpAddr,
        dir: &Path,
        rbac: Rbac,
        objects: Option<Arc<kt_kube::apiserver::ApiServer>>,
    ) -> Result<ScriptedApi, ApiError> {
        write_pki(dir, ip)?;
        let tls = kt_service::tls::Tls::load(&dir.join("server.crt"), &dir.join("server.key"))
            .map_err(|e| ApiError(e.to_string()))?;
        let tcp = tokio::net::TcpListener::bind((ip, 0))
            .await
            .map_err(|e| ApiError(format!("listening on {ip}: {e}")))?;
        let addr = tcp.local_addr().map_err(|e| ApiError(e.to_string()))?;
        let listener =
            kt_service::tls::TlsListener::new(tcp, &tls).map_err(|e| ApiError(e.to_string()))?;
        let shared = Arc::new(Shared {
            tokens: Mutex::default(),
            objects: Mutex::default(),
            rbac,
            log: Mutex::default(),
            objects_api: objects,
            http: kt_api::client(),
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(ScriptedApi {
            shared,
            addr,
            ca: dir.join("ca.crt"),
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The CA pods trust the API with (PEM).
    pub fn ca_path(&self) -> &Path {
        &self.ca
    }

    /// Issues a ServiceAccount token as the kubelet's projected volume
    /// gets it: a JWT naming the account, the audience, the expiry and the
    /// pod (name, uid) it is bound to.
    pub fn issue(
        &self,
        subject: &Subject,
        audience: &str,
        pod: Option<(&str, &str)>,
        ttl: Duration,
    ) -> String {
        let (iat, exp) = (now(), now() + ttl.as_secs());
        let mut claims = json!({
            "aud": [audience],
            "exp": exp,
            "iat": iat,
            "nbf": iat,
            "iss": API_AUDIENCE,
            "sub": format!("system:serviceaccount:{}:{}", subject.namespace, subject.name),
            "kubernetes.io": {
                "namespace": subject.namespace,
                "serviceaccount": { "name": subject.name },
            },
        });
        if let Some((name, uid)) = pod {
            claims["kubernetes.io"]["pod"] = json!({ "name": name, "uid": uid });
        }
        let header = json!({ "alg": "RS256", "kid": "kt-bundle" });
        let signature = [
            uuid::Uuid::new_v4().into_bytes(),
            uuid::Uuid::new_v4().into_bytes(),
        ]
        .concat();
        let token = format!(
            "{}.{}.{}",
            B64.encode(header.to_string()),
            B64.encode(claims.to_string()),
            B64.encode(signature)
        );
        lock(&self.shared.tokens).insert(
            token.clone(),
            Issued {
                subject: subject.clone(),
                audiences: vec![audience.to_owned()],
                pod: pod.map(|(n, u)| (n.to_owned(), u.to_owned())),
                expires: exp,
            },
        );
        token
    }

    /// Records a pod (a full object; replaces one of the same name).
    pub fn set_pod(&self, pod: Value) {
        let ns = pod["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        lock(&self.shared.objects).pods.insert((ns, name), pod);
    }

    /// Records a workload's metadata under its resource (`statefulsets`).
    pub fn set_workload(&self, resource: &str, meta: Value) {
        let ns = meta["namespace"].as_str().unwrap_or_default().to_owned();
        let name = meta["name"].as_str().unwrap_or_default().to_owned();
        lock(&self.shared.objects)
            .workloads
            .insert((resource.to_owned(), ns, name), meta);
    }

    /// Every request so far, one line each: method, path, who, answer.
    pub fn log(&self) -> Vec<String> {
        lock(&self.shared.log).clone()
    }
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    (code, axum::Json(body)).into_response()
}

/// Who presents `headers`' bearer token to the API server itself.
fn caller(shared: &Shared, headers: &HeaderMap) -> Result<Subject, String> {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or("no bearer token")?;
    let tokens = lock(&shared.tokens);
    let t = tokens.get(token).ok_or("a token this API never issued")?;
    if t.expires <= now() {
        return Err("an expired token".into());
    }
    if !t.audiences.iter().any(|a| a == API_AUDIENCE) {
        return Err(format!(
            "a token for {:?}, not for the API server",
            t.audiences
        ));
    }
    Ok(t.subject.clone())
}

/// The TokenReview of `body` (the request's object), answered.
fn review(shared: &Shared, body: &Value) -> Value {
    let token = body["spec"]["token"].as_str().unwrap_or_default();
    let wanted: Vec<String> = body["spec"]["audiences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_else(|| vec![API_AUDIENCE.to_owned()]);
    let refused = |why: &str| json!({ "authenticated": false, "error": why });
    let status = match lock(&shared.tokens).get(token) {
        None => refused("invalid bearer token"),
        Some(t) if t.expires <= now() => refused("token has expired"),
        Some(t) => {
            let common: Vec<&String> = t.audiences.iter().filter(|a| wanted.contains(a)).collect();
            if common.is_empty() {
                refused(&format!(
                    "token audiences {:?} is invalid for the target audiences {wanted:?}",
                    t.audiences
                ))
            } else {
                let mut extra = serde_json::Map::new();
                if let Some((name, uid)) = &t.pod {
                    extra.insert(
                        "authentication.kubernetes.io/pod-name".into(),
                        json!([name]),
                    );
                    extra.insert("authentication.kubernetes.io/pod-uid".into(), json!([uid]));
                }
                json!({
                    "authenticated": true,
                    "audiences": common,
                    "user": {
                        "username": format!("system:serviceaccount:{}:{}", t.subject.namespace, t.subject.name),
                        "groups": [
                            "system:serviceaccounts",
                            format!("system:serviceaccounts:{}", t.subject.namespace),
                            "system:authenticated",
                        ],
                        "extra": extra,
                    },
                })
            }
        }
    };
    json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "metadata": { "creationTimestamp": null },
        "spec": body["spec"],
        "status": status,
    })
}

/// A label selector's terms: `k`, `!k`, `k=v`, `k==v`, `k!=v`.
fn selects(selector: &str, labels: &Value) -> Result<bool, String> {
    for term in selector.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let label = |k: &str| labels.get(k).and_then(Value::as_str).map(str::to_owned);
        let ok = if let Some((k, v)) = term.split_once("!=") {
            label(k.trim()).as_deref() != Some(v.trim())
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            label(k.trim()).as_deref() == Some(v.trim())
        } else if let Some(k) = term.strip_prefix('!') {
            label(k.trim()).is_none()
        } else if term.contains(' ') || term.contains('(') {
            return Err(format!("label selector term {term:?} is not emulated"));
        } else {
            label(term).is_some()
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What a path names: (group, resource, namespace, name).
fn route(path: &str) -> Option<(String, String, Option<String>, Option<String>)> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let s = |x: &&str| (*x).to_owned();
    match rest {
        ["namespaces", ns, resource] => Some((group.into(), s(resource), Some(s(ns)), None)),
        ["namespaces", ns, resource, name] => {
            Some((group.into(), s(resource), Some(s(ns)), Some(s(name))))
        }
        // A subresource (`datasets/status`), as RBAC names it.
        ["namespaces", ns, resource, name, sub] => Some((
            group.into(),
            format!("{resource}/{sub}"),
            Some(s(ns)),
            Some(s(name)),
        )),
        [resource] => Some((group.into(), s(resource), None, None)),
        [resource, name] => Some((group.into(), s(resource), None, Some(s(name)))),
        [resource, name, sub] => Some((
            group.into(),
            format!("{resource}/{sub}"),
            None,
            Some(s(name)),
        )),
        _ => None,
    }
}

fn query(uri: &axum::http::Uri) -> HashMap<String, String> {
    uri.query()
        .map(|q| {
            url_decode_pairs(q)
                .into_iter()
                .collect::<HashMap<String, String>>()
        })
        .unwrap_or_default()
}

fn url_decode_pairs(q: &str) -> Vec<(String, String)> {
    let decode = |s: &str| {
        let bytes = s.replace('+', " ").into_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%'
                && let Some(h) = bytes.get(i + 1..i + 3)
                && let Ok(b) = u8::from_str_radix(&String::from_utf8_lossy(h), 16)
            {
                out.push(b);
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

const WORKLOADS: [&str; 6] = [
    "deployments",
    "statefulsets",
    "daemonsets",
    "replicasets",
    "jobs",
    "cronjobs",
];

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_owned();
    let q = query(&parts.uri);
    let who = caller(&shared, &parts.headers);
    let asked = format!("{} {}", parts.method, parts.uri);
    let line = |answer: &str| {
        let who = who.as_ref().map_or_else(
            |e| format!("({e})"),
            |s| format!("{}/{}", s.namespace, s.name),
        );
        lock(&shared.log).push(format!("{asked} {who} -> {answer}"));
    };
    let Ok(subject) = &who else {
        line("401");
        return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
    };
    let Some((group, resource, namespace, name)) = route(&path) else {
        line("404");
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{path}: not served by the bundle's scripted API"),
        );
    };
    let watch = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = match (&parts.method, &name, watch) {
        (&Method::POST, None, _) => "create",
        (&Method::GET, Some(_), _) => "get",
        (&Method::GET, None, true) => "watch",
        (&Method::GET, None, false) => "list",
        (&Method::PATCH, Some(_), _) => "patch",
        (&Method::PUT, Some(_), _) => "update",
        (&Method::DELETE, Some(_), _) => "delete",
        _ => {
            line("405");
            return status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "not emulated",
            );
        }
    };
    let ask = Ask {
        verb: verb.into(),
        group: group.clone(),
        resource: resource.clone(),
        namespace: namespace.clone(),
        name: name.clone(),
    };
    if !shared.rbac.allows(subject, &ask) {
        line("403");
        let msg = format!(
            "{resource}{} is forbidden: User \"system:serviceaccount:{}:{}\" cannot {verb} resource \"{resource}\" in API group \"{group}\"{}",
            name.as_deref()
                .map(|n| format!(" \"{n}\""))
                .unwrap_or_default(),
            subject.namespace,
            subject.name,
            namespace
                .as_deref()
                .map(|n| format!(" in the namespace \"{n}\""))
                .unwrap_or_else(|| " at the cluster scope".into()),
        );
        return status(StatusCode::FORBIDDEN, "Forbidden", &msg);
    }
    match (verb, group.as_str(), resource.as_str()) {
        ("create", "authentication.k8s.io", "tokenreviews") => {
            let bytes = match axum::body::to_bytes(body, 1 << 20).await {
                Ok(b) => b,
                Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
            };
            let Ok(ask) = serde_json::from_slice::<Value>(&bytes) else {
                line("400");
                return status(StatusCode::BAD_REQUEST, "BadRequest", "not a TokenReview");
            };
            let answer = review(&shared, &ask);
            line(&format!(
                "201 authenticated={}",
                answer["status"]["authenticated"]
            ));
            (StatusCode::CREATED, axum::Json(answer)).into_response()
        }
        ("get", "", "pods") => {
            let key = (namespace.unwrap_or_default(), name.unwrap_or_default());
            let pod = lock(&shared.objects).pods.get(&key).cloned();
            match pod {
                Some(p) => {
                    line("200");
                    axum::Json(p).into_response()
                }
                None => {
                    line("404");
                    status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("pods \"{}\" not found", key.1),
                    )
                }
            }
        }
        ("list" | "watch", g, r) if (g.is_empty() && r == "pods") || WORKLOADS.contains(&r) => {
            if verb == "watch" {
                line("200 (watch)");
                let secs = q
                    .get("timeoutSeconds")
                    .and_then(|s| s.parse().ok())
                    .map_or(WATCH_MAX, Duration::from_secs)
                    .min(WATCH_MAX);
                let quiet = futures::stream::once(tokio::time::sleep(secs))
                    .filter_map(|()| async { None::<Result<bytes::Bytes, std::io::Error>> });
                return Response::builder()
                    .header("content-type", "application/json")
                    .body(Body::from_stream(quiet))
                    .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
            }
            let selector = q.get("labelSelector").cloned().unwrap_or_default();
            let ns = namespace.unwrap_or_default();
            let objects = lock(&shared.objects);
            let listed: Vec<Value> = if r == "pods" {
                objects
                    .pods
                    .iter()
                    .filter(|((n, _), _)| *n == ns)
                    .map(|(_, p)| p.clone())
                    .collect()
            } else {
                objects
                    .workloads
                    .iter()
                    .filter(|((res, n, _), _)| res == r && *n == ns)
                    .map(|(_, m)| json!({ "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": m }))
                    .collect()
            };
            drop(objects);
            let mut items = Vec::new();
            for item in listed {
                let labels = item["metadata"]["labels"].clone();
                match selects(&selector, &labels) {
                    Ok(true) => items.push(item),
                    Ok(false) => {}
                    Err(e) => {
                        line("400");
                        return status(StatusCode::BAD_REQUEST, "BadRequest", &e);
                    }
                }
            }
            line(&format!("200 ({} items)", items.len()));
            let kind = if r == "pods" {
                "PodList"
            } else {
                "PartialObjectMetadataList"
            };
            let api_version = if r == "pods" { "v1" } else { "meta.k8s.io/v1" };
            axum::Json(json!({
                "apiVersion": api_version,
                "kind": kind,
                "metadata": { "resourceVersion": "1" },
                "items": items,
            }))
            .into_response()
        }
        _ => match &shared.objects_api {
            Some(inner) => forward(inner, &shared.http, parts, body, &line).await,
            None => {
                line("404");
                status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("{verb} {resource} is not served by the bundle's scripted API"),
                )
            }
        },
    }
}

/// A request authorized above, answered by the in-memory API server that
/// holds what the scripted API does not (Nodes, custom resources, Events,
/// Secrets), its answer streamed back (watches included).
async fn forward(
    inner: &kt_kube::apiserver::ApiServer,
    http: &reqwest::Client,
    parts: axum::http::request::Parts,
    body: Body,
    line: &impl Fn(&str),
) -> Response {
    let bytes = match axum::body::to_bytes(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    let pq = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
    let mut ask = http.request(parts.method.clone(), format!("{}{pq}", inner.url()));
    for h in ["content-type", "accept"] {
        if let Some(v) = parts.headers.get(h) {
            ask = ask.header(h, v.clone());
        }
    }
    let answer = match ask.body(bytes).send().await {
        Ok(a) => a,
        Err(e) => {
            line("502");
            return status(StatusCode::BAD_GATEWAY, "InternalError", &e.to_string());
        }
    };
    line(&format!("{} (objects)", answer.status().as_u16()));
    let mut out = Response::builder().status(answer.status().as_u16());
    if let Some(v) = answer.headers().get("content-type") {
        out = out.header("content-type", v.clone());
    }
    out.body(Body::from_stream(answer.bytes_stream()))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

use futures::StreamExt as _;

#[cfg(test)]
mod tests {
    use super::*;

    fn rbac() -> Rbac {
        let yaml = super::super::install::tests::RBAC;
        super::super::install::Install::parse(yaml).unwrap().rbac
    }

    fn client(ca: &Path) -> reqwest::Client {
        let pem = std::fs::read(ca).unwrap();
        kt_api::client_builder()
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
            .build()
            .unwrap()
    }

    fn sa(name: &str) -> Subject {
        Subject {
            namespace: "kt".into(),
            name: name.into(),
        }
    }

    #[tokio::test]
    async fn reviews_tokens_behind_the_installs_rbac() {
        let dir = tempfile::tempdir().unwrap();
        let api = ScriptedApi::start("127.0.0.1".parse().unwrap(), dir.path(), rbac())
            .await
            .unwrap();
        let http = client(api.ca_path());
        let base = format!("https://{}", api.addr());
        let hour = Duration::from_secs(3600);
        let md = api.issue(&sa("md"), API_AUDIENCE, None, hour);
        let other = api.issue(&sa("other"), API_AUDIENCE, None, hour);
        let pod_token = api.issue(&sa("trainer"), "kt", Some(("trainer-0", "u-1")), hour);
        let ask = |token: &str| json!({ "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": { "token": token, "audiences": ["kt"] } });
        let post = |who: &str, body: Value| {
            http.post(format!("{base}/apis/authentication.k8s.io/v1/tokenreviews"))
                .bearer_auth(who)
                .json(&body)
                .send()
        };
        let r: Value = post(&md, ask(&pod_token))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(r["status"]["authenticated"], true, "{r}");
        assert_eq!(
            r["status"]["user"]["username"],
            "system:serviceaccount:kt:trainer"
        );
        assert_eq!(
            r["status"]["user"]["extra"]["authentication.kubernetes.io/pod-name"][0],
            "trainer-0"
        );
        // A token for the API server is not one for kt.
        let r: Value = post(&md, ask(&other)).await.unwrap().json().await.unwrap();
        assert_eq!(r["status"]["authenticated"], false, "{r}");
        let r: Value = post(&md, ask("made-up"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(r["status"]["authenticated"], false);
        // Who has no binding for tokenreviews is forbidden; a kt token is
        // no credential for the API server.
        assert_eq!(post(&other, ask(&pod_token)).await.unwrap().status(), 403);
        assert_eq!(
            post(&pod_token, ask(&pod_token)).await.unwrap().status(),
            401
        );
        // Pods: get and list with a selector, by the Role.
        api.set_pod(json!({ "metadata": { "name": "trainer-0", "namespace": "kt", "uid": "u-1", "labels": { "kt.dev/service": "t" } }, "status": { "podIP": "10.0.0.9" } }));
        api.set_pod(json!({ "metadata": { "name": "plain", "namespace": "kt", "labels": {} } }));
        let get = |p: &str, who: &str| http.get(format!("{base}{p}")).bearer_auth(who).send();
        let pod: Value = get("/api/v1/namespaces/kt/pods/trainer-0", &md)
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(pod["status"]["podIP"], "10.0.0.9");
        assert_eq!(
            get("/api/v1/namespaces/kt/pods/nope", &md)
                .await
                .unwrap()
                .status(),
            404
        );
        assert_eq!(
            get("/api/v1/namespaces/other/pods/trainer-0", &md)
                .await
                .unwrap()
                .status(),
            403
        );
        let list: Value = get(
            "/api/v1/namespaces/kt/pods?labelSelector=kt.dev%2Fservice",
            &md,
        )
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
        assert_eq!(list["items"].as_array().unwrap().len(), 1, "{list}");
        assert!(api.log().iter().any(|l| l.contains("-> 403")));
    }

    #[test]
    fn selectors_and_routes() {
        let labels = json!({ "a": "1", "b": "2" });
        assert_eq!(selects("a", &labels), Ok(true));
        assert_eq!(selects("a=1,b!=3", &labels), Ok(true));
        assert_eq!(selects("!a", &labels), Ok(false));
        assert_eq!(selects("c", &labels), Ok(false));
        assert!(selects("a in (1)", &labels).is_err());
        assert_eq!(
            route("/apis/apps/v1/namespaces/kt/statefulsets"),
            Some((
                "apps".into(),
                "statefulsets".into(),
                Some("kt".into()),
                None
            ))
        );
        assert_eq!(route("/version"), None);
        assert_eq!(
            route("/apis/kt.dev/v1alpha1/namespaces/kt/datasets/train/status"),
            Some((
                "kt.dev".into(),
                "datasets/status".into(),
                Some("kt".into()),
                Some("train".into())
            ))
        );
        assert_eq!(
            route("/api/v1/nodes/node-3"),
            Some(("".into(), "nodes".into(), None, Some("node-3".into())))
        );
        assert_eq!(
            url_decode_pairs("labelSelector=kt.dev%2Fservice&watch=true"),
            vec![
                ("labelSelector".into(), "kt.dev/service".into()),
                ("watch".into(), "true".into())
            ]
        );
    }
}
