//! An in-memory Kubernetes API server over HTTP (feature `apiserver`), for
//! tests and the testbed: kube-rs clients, its runtime (watchers,
//! reflectors, `Controller`, finalizers, the events `Recorder`) and
//! separate processes given a kubeconfig talk to it as to a real one.
//!
//! What it serves:
//! - resources registered by the caller ([`Resource`]: group, version, kind,
//!   plural, namespaced or cluster-scoped, with or without a status
//!   subresource); [`Resource::builtins`] has the usual core ones;
//! - discovery (`/api`, `/apis`, `/api/v1`, `/apis/<g>/<v>`, `/version`);
//! - get, list (label selectors `=`, `==`, `!=`, `in`, `notin`, `key`,
//!   `!key`; field selectors `=`, `==`, `!=` on any dotted path such as
//!   `metadata.name` or `spec.nodeName`), watch (`resourceVersion`,
//!   `allowWatchBookmarks`, `timeoutSeconds`, `sendInitialEvents`),
//!   create (`generateName`, uid, creationTimestamp, resourceVersion,
//!   generation), replace (a stale resourceVersion is 409 Conflict),
//!   patch (JSON merge patch; strategic merge patch *treated as a merge
//!   patch*; RFC 6902 JSON patch with `test`; server-side apply *treated as
//!   a merge patch of the applied object*, creating it where missing —
//!   managedFields and field ownership are ignored, so applying an object
//!   without a field does not remove it), delete (finalizers honoured);
//!   all on the main resource and on `/status`;
//! - errors as `Status` objects (NotFound, AlreadyExists, Conflict,
//!   Invalid, BadRequest, Gone, Unauthorized).
//!
//! Invariants:
//! - one resourceVersion counter for every object (as etcd's revision);
//!   every write bumps it, a write that changes nothing is a no-op (no new
//!   resourceVersion, no event), as on a real server;
//! - `metadata.generation` starts at 1 and moves on a change outside
//!   `metadata` (and outside `status` for resources with a status
//!   subresource);
//! - with a status subresource, writes to the main resource keep the stored
//!   status and writes to `/status` change nothing but the status;
//! - an object with finalizers is only marked on delete (deletionTimestamp);
//!   it goes, with a DELETED event, once a write leaves its finalizers empty;
//! - watches see the events of the one ordered log, filtered by resource,
//!   namespace and selectors (an object leaving a selector is DELETED for
//!   that watch, one entering it ADDED). The log keeps the last
//!   [`ApiServerConfig::history`] events; a watch from an older
//!   resourceVersion (or [`ApiServer::compact`]ed away) gets an ERROR event
//!   with a 410 Gone `Status`, as the real one does.
//!
//! `kubectl` works with manifests (`apply -f`, `create -f`, `get`, `label`,
//! `patch`, `delete`, `--server-side`) given `--validate=false` (no OpenAPI
//! document is served); its typed generators (`kubectl create configmap`)
//! send protobuf, which is refused (415), as is every protobuf body.
//!
//! Not here: RBAC (any caller may do anything; with
//! [`ApiServerConfig::token`] set, every request but `/healthz` must carry
//! that bearer token), admission, defaulting and schema validation,
//! garbage collection of owned objects, pagination (`limit` is ignored:
//! a list is one page), deletecollection. Plain HTTP on loopback by
//! default; with [`ApiServerConfig::tls`], HTTPS with a CA generated at
//! start ([`ApiServer::ca_pem`]; the kubeconfig and the client trust it).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use kube::core::ApiResource;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A resource kind the server serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    /// The API group, `""` for core.
    pub group: String,
    pub version: String,
    pub kind: String,
    /// The plural, lower case, as in URLs.
    pub plural: String,
    pub namespaced: bool,
    /// Whether it has a `/status` subresource.
    pub status: bool,
    /// Short names discovery lists (`kubectl get cm`).
    pub short_names: Vec<String>,
}

impl Resource {
    fn new(ar: &ApiResource, namespaced: bool) -> Self {
        Self {
            group: ar.group.clone(),
            version: ar.version.clone(),
            kind: ar.kind.clone(),
            plural: ar.plural.clone(),
            namespaced,
            status: false,
            short_names: Vec::new(),
        }
    }

    /// A namespaced resource (no status subresource).
    pub fn namespaced(ar: &ApiResource) -> Self {
        Self::new(ar, true)
    }

    /// A cluster-scoped resource (no status subresource).
    pub fn cluster(ar: &ApiResource) -> Self {
        Self::new(ar, false)
    }

    /// With a `/status` subresource.
    pub fn with_status(mut self) -> Self {
        self.status = true;
        self
    }

    /// With short names (`cm`, `ktds`).
    pub fn with_short_names(mut self, names: &[&str]) -> Self {
        self.short_names = names.iter().map(|n| (*n).to_owned()).collect();
        self
    }

    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Namespaces, Nodes (status), Pods (status), ConfigMaps, Secrets,
    /// Services, Events (`v1` and `events.k8s.io/v1`), ServiceAccounts,
    /// Leases, Jobs (status), Deployments, DaemonSets and StatefulSets
    /// (status).
    pub fn builtins() -> Vec<Resource> {
        use k8s_openapi::api::{apps, batch, coordination, core, events};
        fn ar<K: kube::Resource<DynamicType = ()>>() -> ApiResource {
            ApiResource::erase::<K>(&())
        }
        vec![
            Resource::cluster(&ar::<core::v1::Namespace>())
                .with_status()
                .with_short_names(&["ns"]),
            Resource::cluster(&ar::<core::v1::Node>())
                .with_status()
                .with_short_names(&["no"]),
            Resource::namespaced(&ar::<core::v1::Pod>())
                .with_status()
                .with_short_names(&["po"]),
            Resource::namespaced(&ar::<core::v1::ConfigMap>()).with_short_names(&["cm"]),
            Resource::namespaced(&ar::<core::v1::Secret>()),
            Resource::namespaced(&ar::<core::v1::Service>())
                .with_status()
                .with_short_names(&["svc"]),
            Resource::namespaced(&ar::<core::v1::ServiceAccount>()).with_short_names(&["sa"]),
            Resource::namespaced(&ar::<core::v1::Event>()).with_short_names(&["ev"]),
            Resource::namespaced(&ar::<events::v1::Event>()).with_short_names(&["ev"]),
            Resource::namespaced(&ar::<coordination::v1::Lease>()),
            Resource::namespaced(&ar::<batch::v1::Job>()).with_status(),
            Resource::namespaced(&ar::<apps::v1::Deployment>())
                .with_status()
                .with_short_names(&["deploy"]),
            Resource::namespaced(&ar::<apps::v1::DaemonSet>())
                .with_status()
                .with_short_names(&["ds"]),
            Resource::namespaced(&ar::<apps::v1::StatefulSet>())
                .with_status()
                .with_short_names(&["sts"]),
        ]
    }
}

/// How to start an [`ApiServer`].
#[derive(Debug, Clone)]
pub struct ApiServerConfig {
    /// The resources served from the start (more with
    /// [`ApiServer::register`]).
    pub resources: Vec<Resource>,
    /// A bearer token every request but `/healthz` must carry; `None`:
    /// no authentication (loopback only).
    pub token: Option<String>,
    /// How many events the watch log keeps (older resourceVersions are 410
    /// Gone).
    pub history: usize,
    /// How often an idle watch that allows bookmarks gets one.
    pub bookmark_interval: Duration,
    /// Serve HTTPS with a certificate for 127.0.0.1 from a CA generated at
    /// start.
    pub tls: bool,
}

impl Default for ApiServerConfig {
    /// The builtins, no token, 10,000 events of history, bookmarks every 5 s.
    fn default() -> Self {
        Self {
            resources: Resource::builtins(),
            token: None,
            history: 10_000,
            bookmark_interval: Duration::from_secs(5),
            tls: false,
        }
    }
}

/// Errors of the Rust API (HTTP clients get `Status` objects).
#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    #[error("bind 127.0.0.1:0: {0}")]
    Bind(#[source] std::io::Error),
    #[error("write kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("kube client: {0}")]
    Client(String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{0}")]
    Api(#[from] StatusError),
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

/// A failure as the API answers it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct StatusError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl StatusError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
        }
    }
    fn not_found(res: &Resource, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", qualified(res)),
        )
    }
    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }
    fn invalid(message: impl Into<String>) -> Self {
        Self::new(422, "Invalid", message)
    }
    fn conflict(res: &Resource, name: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; \
                 please apply your changes to the latest version and try again",
                qualified(res)
            ),
        )
    }
    fn gone(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// The `Status` object.
    pub fn to_status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

impl IntoResponse for StatusError {
    fn into_response(self) -> Response {
        json_response(
            StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            &self.to_status(),
        )
    }
}

fn qualified(res: &Resource) -> String {
    if res.group.is_empty() {
        res.plural.clone()
    } else {
        format!("{}.{}", res.plural, res.group)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

#[derive(Debug)]
struct LogEntry {
    rv: u64,
    res: usize,
    namespace: String,
    kind: EventType,
    object: Value,
    /// The object before a MODIFIED.
    old: Option<Value>,
}

type Key = (usize, String, String);

#[derive(Debug)]
struct Store {
    rv: u64,
    resources: Vec<Resource>,
    objects: BTreeMap<Key, Value>,
    log: VecDeque<LogEntry>,
    /// Every event at or below this resourceVersion is gone from the log.
    compacted: u64,
    history: usize,
}

#[derive(Debug)]
struct Shared {
    store: Mutex<Store>,
    changed: tokio::sync::watch::Sender<u64>,
    token: Option<String>,
    bookmark_interval: Duration,
    addr: SocketAddr,
    stop: CancellationToken,
    /// The CA of the server certificate (PEM), with TLS.
    ca_pem: Option<String>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The server; it stops when dropped (open watches end).
#[derive(Debug)]
pub struct ApiServer {
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.shared.stop.cancel();
        self.task.abort();
    }
}

impl ApiServer {
    /// Listens on 127.0.0.1:0 and serves until dropped.
    pub async fn start(config: ApiServerConfig) -> Result<ApiServer, ApiServerError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(ApiServerError::Bind)?;
        let addr = listener.local_addr().map_err(ApiServerError::Bind)?;
        let pki = if config.tls {
            Some(tls::Pki::generate(addr.ip())?)
        } else {
            None
        };
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                rv: 1,
                resources: Vec::new(),
                objects: BTreeMap::new(),
                log: VecDeque::new(),
                compacted: 0,
                history: config.history.max(1),
            }),
            changed: tokio::sync::watch::Sender::new(1),
            token: config.token,
            bookmark_interval: config.bookmark_interval,
            addr,
            stop: CancellationToken::new(),
            ca_pem: pki.as_ref().map(|p| p.ca_pem.clone()),
        });
        for r in config.resources {
            register(&mut shared.lock(), r);
        }
        let app = Router::new()
            .fallback(handle)
            .layer(DefaultBodyLimit::max(64 << 20))
            .with_state(shared.clone());
        let stop = shared.stop.clone();
        let task = match pki {
            None => tokio::spawn(async move {
                let serve =
                    axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
                if let Err(e) = serve.await {
                    tracing::warn!(error = %e, "apiserver stopped");
                }
            }),
            Some(pki) => {
                let listener =
                    kt_service::tls::TlsListener::with_config(listener, pki.server_config()?)
                        .map_err(|e| ApiServerError::Tls(format!("listener: {e}")))?;
                tokio::spawn(async move {
                    let serve =
                        axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
                    if let Err(e) = serve.await {
                        tracing::warn!(error = %e, "apiserver stopped");
                    }
                })
            }
        };
        Ok(ApiServer { shared, task })
    }

    /// `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.shared.ca_pem.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.shared.addr)
    }

    /// The CA that signed the server's certificate (PEM), with TLS.
    pub fn ca_pem(&self) -> Option<&str> {
        self.shared.ca_pem.as_deref()
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// A kube client for it (default namespace `default`).
    pub fn client(&self) -> Result<kube::Client, ApiServerError> {
        let url = self
            .url()
            .parse()
            .map_err(|e: http::uri::InvalidUri| ApiServerError::Client(e.to_string()))?;
        let mut config = kube::Config::new(url);
        if let Some(token) = &self.shared.token {
            config.auth_info.token = Some(token.clone().into());
        }
        if let Some(pem) = &self.shared.ca_pem {
            config.root_cert = Some(vec![tls::pem_to_der(pem)?]);
        }
        kube::Client::try_from(config).map_err(|e| ApiServerError::Client(e.to_string()))
    }

    /// Writes a kubeconfig (context `kt-testbed`, namespace `default`, the
    /// bearer token if there is one) another process can use.
    pub fn kubeconfig(&self, path: &Path) -> Result<(), ApiServerError> {
        let mut user = Map::new();
        if let Some(token) = &self.shared.token {
            user.insert("token".into(), token.clone().into());
        }
        let mut cluster = json!({"server": self.url()});
        if let Some(pem) = &self.shared.ca_pem {
            use base64::Engine as _;
            cluster["certificate-authority-data"] =
                base64::engine::general_purpose::STANDARD.encode(pem).into();
        }
        let config = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kt-testbed", "cluster": cluster}],
            "users": [{"name": "kt-testbed", "user": user}],
            "contexts": [{"name": "kt-testbed", "context": {
                "cluster": "kt-testbed", "user": "kt-testbed", "namespace": "default"}}],
            "current-context": "kt-testbed",
        });
        let text = serde_yaml_ng::to_string(&config)
            .map_err(|e| ApiServerError::Client(format!("kubeconfig yaml: {e}")))?;
        std::fs::write(path, text).map_err(|source| ApiServerError::Kubeconfig {
            path: path.display().to_string(),
            source,
        })
    }

    /// Serves one more resource (replacing one of the same group, version
    /// and plural).
    pub fn register(&self, resource: Resource) {
        register(&mut self.shared.lock(), resource);
    }

    /// Serves a custom resource by its `ApiResource` (e.g.
    /// `ApiResource::erase::<Dataset>(&())`), with a status subresource
    /// (and, for kt's Dataset, its short name `ktds`).
    pub fn register_crd(&self, ar: &ApiResource, namespaced: bool) {
        let mut r = Resource::new(ar, namespaced).with_status();
        if ar.group == "kt.dev" && ar.kind == "Dataset" {
            r = r.with_short_names(&["ktds"]);
        }
        self.register(r);
    }

    /// Creates or overwrites an object as stored, status included (no
    /// status-subresource rule, no resourceVersion check): what a kubelet
    /// or a node controller would write. Namespaced objects without a
    /// namespace go to `default`. Returns the stored object.
    pub fn put<K: Serialize>(&self, object: &K) -> Result<Value, ApiServerError> {
        let mut value = serde_json::to_value(object)?;
        let mut store = self.shared.lock();
        let res = store.by_kind(&value)?;
        let r = store.resources[res].clone();
        if r.namespaced && namespace_of(&value).is_empty() {
            meta_mut(&mut value).insert("namespace".into(), "default".into());
        }
        let ns = namespace_of(&value).to_owned();
        let name = name_of(&value).to_owned();
        if name.is_empty() {
            return Err(StatusError::invalid("metadata.name: Required value").into());
        }
        let key = (res, if r.namespaced { ns } else { String::new() }, name);
        let out = match store.objects.get(&key).cloned() {
            Some(old) => store.write(key, old, value, Write::Raw)?,
            None => store.insert(key, value)?,
        };
        drop(store);
        self.notify();
        Ok(out)
    }

    /// The stored object, typed.
    pub fn get<K>(&self, namespace: Option<&str>, name: &str) -> Result<Option<K>, ApiServerError>
    where
        K: kube::Resource<DynamicType = ()> + DeserializeOwned,
    {
        let v = self.get_value(&K::api_version(&()), &K::kind(&()), namespace, name)?;
        Ok(v.map(serde_json::from_value).transpose()?)
    }

    /// The stored object by apiVersion and kind.
    pub fn get_value(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Value>, ApiServerError> {
        let store = self.shared.lock();
        let res = store.by_api_kind(api_version, kind)?;
        let ns = store.key_namespace(res, namespace);
        Ok(store.objects.get(&(res, ns, name.to_owned())).cloned())
    }

    /// Every stored object of a kind (in one namespace or all), by
    /// namespace and name.
    pub fn list_values(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
    ) -> Result<Vec<Value>, ApiServerError> {
        let store = self.shared.lock();
        let res = store.by_api_kind(api_version, kind)?;
        Ok(store
            .objects
            .iter()
            .filter(|((r, ns, _), _)| *r == res && namespace.is_none_or(|n| n == ns))
            .map(|(_, v)| v.clone())
            .collect())
    }

    /// Changes a stored object in place (as [`ApiServer::put`]: status
    /// included). NotFound if it is not there.
    pub fn modify(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        f: impl FnOnce(&mut Value),
    ) -> Result<Value, ApiServerError> {
        let mut store = self.shared.lock();
        let res = store.by_api_kind(api_version, kind)?;
        let key = (res, store.key_namespace(res, namespace), name.to_owned());
        let old = store
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| StatusError::not_found(&store.resources[res], name))?;
        let mut new = old.clone();
        f(&mut new);
        let out = store.write(key, old, new, Write::Raw)?;
        drop(store);
        self.notify();
        Ok(out)
    }

    /// Deletes as an API delete does (finalizers honoured). Returns whether
    /// the object is gone (false: marked for deletion).
    pub fn delete(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<bool, ApiServerError> {
        let mut store = self.shared.lock();
        let res = store.by_api_kind(api_version, kind)?;
        let key = (res, store.key_namespace(res, namespace), name.to_owned());
        let out = store.delete(key, &Value::Null)?;
        drop(store);
        self.notify();
        Ok(out.is_none())
    }

    /// Drops the whole watch log: a watch from any resourceVersion before
    /// now gets 410 Gone (as after an etcd compaction).
    pub fn compact(&self) {
        let mut store = self.shared.lock();
        store.compacted = store.rv;
        store.log.clear();
        drop(store);
        self.notify();
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    fn notify(&self) {
        let rv = self.shared.lock().rv;
        self.shared.changed.send_replace(rv);
    }
}

fn register(store: &mut Store, resource: Resource) {
    match store.resources.iter().position(|r| {
        r.group == resource.group && r.version == resource.version && r.plural == resource.plural
    }) {
        Some(i) => store.resources[i] = resource,
        None => store.resources.push(resource),
    }
}

/// How a write treats status and resourceVersion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    /// A write to the main resource.
    Main,
    /// A write to `/status`.
    Status,
    /// The Rust API: as given.
    Raw,
}

fn meta(v: &Value) -> Option<&Map<String, Value>> {
    v.get("metadata").and_then(Value::as_object)
}

fn meta_mut(v: &mut Value) -> &mut Map<String, Value> {
    if !v.is_object() {
        *v = Value::Object(Map::new());
    }
    let obj = v.as_object_mut().expect("an object");
    let m = obj
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !m.is_object() {
        *m = Value::Object(Map::new());
    }
    m.as_object_mut().expect("an object")
}

fn meta_str<'a>(v: &'a Value, field: &str) -> &'a str {
    meta(v)
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn name_of(v: &Value) -> &str {
    meta_str(v, "name")
}

fn namespace_of(v: &Value) -> &str {
    meta_str(v, "namespace")
}

fn has_finalizers(v: &Value) -> bool {
    meta(v)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty())
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// The object without what does not count for `generation`.
fn generation_view(v: &Value, status: bool) -> Value {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("metadata");
        o.remove("apiVersion");
        o.remove("kind");
        if status {
            o.remove("status");
        }
    }
    v
}

/// The object without the fields the server sets on every write.
fn change_view(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove("resourceVersion");
        m.remove("managedFields");
        m.remove("generation");
    }
    v
}

impl Store {
    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn by_api_kind(&self, api_version: &str, kind: &str) -> Result<usize, StatusError> {
        self.resources
            .iter()
            .position(|r| r.api_version() == api_version && r.kind == kind)
            .ok_or_else(|| {
                StatusError::new(
                    404,
                    "NotFound",
                    format!("no resource for {api_version} {kind} is registered"),
                )
            })
    }

    fn by_kind(&self, v: &Value) -> Result<usize, StatusError> {
        let api_version = v.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        let kind = v.get("kind").and_then(Value::as_str).unwrap_or("");
        self.by_api_kind(api_version, kind)
    }

    fn key_namespace(&self, res: usize, namespace: Option<&str>) -> String {
        if self.resources[res].namespaced {
            namespace.unwrap_or("default").to_owned()
        } else {
            String::new()
        }
    }

    fn log(&mut self, entry: LogEntry) {
        self.log.push_back(entry);
        while self.log.len() > self.history {
            if let Some(e) = self.log.pop_front() {
                self.compacted = e.rv;
            }
        }
    }

    /// A new object (metadata assigned here). The name must be set.
    fn insert(&mut self, key: Key, mut value: Value) -> Result<Value, StatusError> {
        let res = key.0;
        let r = self.resources[res].clone();
        if !value.is_object() {
            return Err(StatusError::bad_request("the body is not an object"));
        }
        if self.objects.contains_key(&key) {
            return Err(StatusError::new(
                409,
                "AlreadyExists",
                format!("{} \"{}\" already exists", qualified(&r), key.2),
            ));
        }
        let rv = self.next_rv();
        {
            let o = value.as_object_mut().expect("an object");
            o.insert("apiVersion".into(), r.api_version().into());
            o.insert("kind".into(), r.kind.clone().into());
        }
        let m = meta_mut(&mut value);
        m.insert("name".into(), key.2.clone().into());
        if r.namespaced {
            m.insert("namespace".into(), key.1.clone().into());
        } else {
            m.remove("namespace");
        }
        m.insert("uid".into(), uuid::Uuid::new_v4().to_string().into());
        m.insert("creationTimestamp".into(), now_rfc3339().into());
        m.insert("resourceVersion".into(), rv.to_string().into());
        m.insert("generation".into(), 1.into());
        m.remove("deletionTimestamp");
        m.remove("deletionGracePeriodSeconds");
        m.remove("managedFields");
        self.objects.insert(key.clone(), value.clone());
        self.log(LogEntry {
            rv,
            res,
            namespace: key.1,
            kind: EventType::Added,
            object: value.clone(),
            old: None,
        });
        Ok(value)
    }

    /// An API create.
    fn create(
        &mut self,
        res: usize,
        namespace: Option<&str>,
        mut value: Value,
    ) -> Result<Value, StatusError> {
        let r = self.resources[res].clone();
        if !value.is_object() {
            return Err(StatusError::bad_request("the body is not an object"));
        }
        let body_ns = namespace_of(&value).to_owned();
        let ns = if r.namespaced {
            let ns = namespace.unwrap_or("default");
            if !body_ns.is_empty() && body_ns != ns {
                return Err(StatusError::bad_request(format!(
                    "the namespace of the provided object ({body_ns}) does not match the \
                     namespace sent on the request ({ns})"
                )));
            }
            ns.to_owned()
        } else {
            String::new()
        };
        let mut name = name_of(&value).to_owned();
        if name.is_empty() {
            let prefix = meta_str(&value, "generateName").to_owned();
            if prefix.is_empty() {
                return Err(StatusError::invalid(
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
            loop {
                let suffix = uuid::Uuid::new_v4().simple().to_string();
                name = format!("{prefix}{}", &suffix[..5]);
                if !self.objects.contains_key(&(res, ns.clone(), name.clone())) {
                    break;
                }
            }
        }
        if let Some(problem) = name_problem(&name) {
            return Err(StatusError::invalid(format!(
                "metadata.name: Invalid value: \"{name}\": {problem}"
            )));
        }
        if r.status
            && let Some(o) = value.as_object_mut()
        {
            o.remove("status");
        }
        self.insert((res, ns, name), value)
    }

    /// A write over `old` (stored under `key`); None of the checks is
    /// skipped but the resourceVersion one for [`Write::Raw`].
    fn write(
        &mut self,
        key: Key,
        old: Value,
        new: Value,
        mode: Write,
    ) -> Result<Value, StatusError> {
        let r = self.resources[key.0].clone();
        if !new.is_object() {
            return Err(StatusError::bad_request("the body is not an object"));
        }
        let new_name = name_of(&new);
        if !new_name.is_empty() && new_name != key.2 {
            return Err(StatusError::bad_request(format!(
                "the name of the object ({new_name}) does not match the name on the URL ({})",
                key.2
            )));
        }
        let sent_rv = meta_str(&new, "resourceVersion");
        if mode != Write::Raw && !sent_rv.is_empty() && sent_rv != meta_str(&old, "resourceVersion")
        {
            return Err(StatusError::conflict(&r, &key.2));
        }
        let mut result = match mode {
            Write::Status => {
                let mut result = old.clone();
                let o = result.as_object_mut().expect("an object");
                match new.get("status") {
                    Some(s) => o.insert("status".into(), s.clone()),
                    None => o.remove("status"),
                };
                result
            }
            Write::Main if r.status => {
                let mut result = new;
                let o = result.as_object_mut().expect("an object");
                match old.get("status") {
                    Some(s) => o.insert("status".into(), s.clone()),
                    None => o.remove("status"),
                };
                result
            }
            Write::Main | Write::Raw => new,
        };
        {
            let o = result.as_object_mut().expect("an object");
            o.insert("apiVersion".into(), r.api_version().into());
            o.insert("kind".into(), r.kind.clone().into());
        }
        let old_meta = meta(&old).cloned().unwrap_or_default();
        let m = meta_mut(&mut result);
        m.insert("name".into(), key.2.clone().into());
        if r.namespaced {
            m.insert("namespace".into(), key.1.clone().into());
        }
        for field in [
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ] {
            match old_meta.get(field) {
                Some(v) => m.insert(field.into(), v.clone()),
                None => m.remove(field),
            };
        }
        m.remove("managedFields");
        m.insert(
            "resourceVersion".into(),
            old_meta
                .get("resourceVersion")
                .cloned()
                .unwrap_or(Value::Null),
        );
        if change_view(&result) == change_view(&old) {
            return Ok(old);
        }
        if generation_view(&result, r.status) != generation_view(&old, r.status) {
            let generation = old_meta
                .get("generation")
                .and_then(Value::as_i64)
                .unwrap_or(0)
                + 1;
            meta_mut(&mut result).insert("generation".into(), generation.into());
        }
        let rv = self.next_rv();
        meta_mut(&mut result).insert("resourceVersion".into(), rv.to_string().into());
        self.objects.insert(key.clone(), result.clone());
        self.log(LogEntry {
            rv,
            res: key.0,
            namespace: key.1.clone(),
            kind: EventType::Modified,
            object: result.clone(),
            old: Some(old),
        });
        if meta(&result).is_some_and(|m| m.contains_key("deletionTimestamp"))
            && !has_finalizers(&result)
        {
            self.remove(key);
        }
        Ok(result)
    }

    fn remove(&mut self, key: Key) -> Option<Value> {
        let mut obj = self.objects.remove(&key)?;
        let rv = self.next_rv();
        meta_mut(&mut obj).insert("resourceVersion".into(), rv.to_string().into());
        self.log(LogEntry {
            rv,
            res: key.0,
            namespace: key.1,
            kind: EventType::Deleted,
            object: obj.clone(),
            old: None,
        });
        Some(obj)
    }

    /// Some(object): marked for deletion (finalizers); None: gone.
    fn delete(&mut self, key: Key, options: &Value) -> Result<Option<Value>, StatusError> {
        let r = self.resources[key.0].clone();
        let old = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| StatusError::not_found(&r, &key.2))?;
        let pre = options.get("preconditions");
        for (field, have) in [
            ("resourceVersion", meta_str(&old, "resourceVersion")),
            ("uid", meta_str(&old, "uid")),
        ] {
            if let Some(want) = pre.and_then(|p| p.get(field)).and_then(Value::as_str)
                && want != have
            {
                return Err(StatusError::new(
                    409,
                    "Conflict",
                    format!(
                        "Precondition failed: {field}: expected {want}, found {have} on {} \"{}\"",
                        qualified(&r),
                        key.2
                    ),
                ));
            }
        }
        if !has_finalizers(&old) {
            self.remove(key);
            return Ok(None);
        }
        if meta(&old).is_some_and(|m| m.contains_key("deletionTimestamp")) {
            return Ok(Some(old));
        }
        let mut marked = old.clone();
        let m = meta_mut(&mut marked);
        m.insert("deletionTimestamp".into(), now_rfc3339().into());
        m.insert("deletionGracePeriodSeconds".into(), 0.into());
        let rv = self.next_rv();
        m.insert("resourceVersion".into(), rv.to_string().into());
        self.objects.insert(key.clone(), marked.clone());
        self.log(LogEntry {
            rv,
            res: key.0,
            namespace: key.1,
            kind: EventType::Modified,
            object: marked.clone(),
            old: Some(old),
        });
        Ok(Some(marked))
    }
}

/// Why a name is not a DNS subdomain, if it is not one.
fn name_problem(name: &str) -> Option<&'static str> {
    if name.len() > 253 {
        return Some("must be no more than 253 characters");
    }
    let ok = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    let ends = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_alphanumeric());
    if !ok || !ends(name.as_bytes().first()) || !ends(name.as_bytes().last()) {
        return Some(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
             characters, '-' or '.', and must start and end with an alphanumeric character",
        );
    }
    None
}

// ---- selectors ----

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// Parses a label selector (`a=b,c!=d,e in (f,g),h notin (i),j,!k`).
fn parse_label_selector(s: &str) -> Result<Vec<LabelReq>, StatusError> {
    let bad = || StatusError::bad_request(format!("unable to parse requirement: {s:?}"));
    let mut terms = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&s[start..]);
    let mut reqs = Vec::new();
    for term in terms.into_iter().map(str::trim).filter(|t| !t.is_empty()) {
        let set = |rest: &str| -> Result<Vec<String>, StatusError> {
            let rest = rest.trim();
            let inner = rest
                .strip_prefix('(')
                .and_then(|r| r.strip_suffix(')'))
                .ok_or_else(bad)?;
            Ok(inner
                .split(',')
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
                .collect())
        };
        let req = if let Some(k) = term.strip_prefix('!') {
            LabelReq::NotExists(k.trim().to_owned())
        } else if let Some((k, v)) = term.split_once("!=") {
            LabelReq::Ne(k.trim().to_owned(), v.trim().to_owned())
        } else if let Some((k, v)) = term.split_once("==") {
            LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
        } else if let Some((k, v)) = term.split_once('=') {
            LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
        } else if let Some((k, rest)) = term.split_once(" notin ") {
            LabelReq::NotIn(k.trim().to_owned(), set(rest)?)
        } else if let Some((k, rest)) = term.split_once(" in ") {
            LabelReq::In(k.trim().to_owned(), set(rest)?)
        } else if term.contains([' ', '(', ')']) {
            return Err(bad());
        } else {
            LabelReq::Exists(term.to_owned())
        };
        reqs.push(req);
    }
    Ok(reqs)
}

fn labels_match(reqs: &[LabelReq], v: &Value) -> bool {
    let labels = meta(v)
        .and_then(|m| m.get("labels"))
        .and_then(Value::as_object);
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    reqs.iter().all(|r| match r {
        LabelReq::Eq(k, want) => get(k) == Some(want.as_str()),
        LabelReq::Ne(k, want) => get(k) != Some(want.as_str()),
        LabelReq::In(k, set) => get(k).is_some_and(|v| set.iter().any(|s| s == v)),
        LabelReq::NotIn(k, set) => get(k).is_none_or(|v| !set.iter().any(|s| s == v)),
        LabelReq::Exists(k) => get(k).is_some(),
        LabelReq::NotExists(k) => get(k).is_none(),
    })
}

/// `(path, value, equal)` per term of a field selector.
fn parse_field_selector(s: &str) -> Result<Vec<(String, String, bool)>, StatusError> {
    let mut out = Vec::new();
    for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (k, v, eq) = if let Some((k, v)) = term.split_once("!=") {
            (k, v, false)
        } else if let Some((k, v)) = term.split_once("==") {
            (k, v, true)
        } else if let Some((k, v)) = term.split_once('=') {
            (k, v, true)
        } else {
            return Err(StatusError::bad_request(format!(
                "invalid field selector: {term:?}"
            )));
        };
        out.push((k.trim().to_owned(), v.trim().to_owned(), eq));
    }
    Ok(out)
}

fn field_value(v: &Value, path: &str) -> String {
    let mut cur = v;
    for part in path.split('.') {
        match cur.get(part) {
            Some(next) => cur = next,
            None => return String::new(),
        }
    }
    match cur {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Which objects a list or watch wants.
#[derive(Debug, Clone)]
struct Filter {
    res: usize,
    namespace: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<(String, String, bool)>,
}

impl Filter {
    fn matches(&self, v: &Value) -> bool {
        labels_match(&self.labels, v)
            && self
                .fields
                .iter()
                .all(|(path, want, eq)| (field_value(v, path) == *want) == *eq)
    }
    fn in_scope(&self, res: usize, namespace: &str) -> bool {
        res == self.res && self.namespace.as_deref().is_none_or(|n| n == namespace)
    }
}

// ---- HTTP ----

fn json_response(code: StatusCode, v: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// What a path names.
#[derive(Debug)]
enum Route {
    Healthz,
    Version,
    CoreVersions,
    Groups,
    ResourceList(String, String),
    Object {
        res: usize,
        namespace: Option<String>,
        name: Option<String>,
        status: bool,
    },
}

fn route(store: &Store, path: &str) -> Result<Route, StatusError> {
    let not_found = || {
        StatusError::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    };
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["healthz"] | ["readyz"] | ["livez"] => return Ok(Route::Healthz),
        ["version"] => return Ok(Route::Version),
        ["api"] => return Ok(Route::CoreVersions),
        ["apis"] => return Ok(Route::Groups),
        ["api", v] => return Ok(Route::ResourceList(String::new(), (*v).to_owned())),
        ["apis", g, v] => return Ok(Route::ResourceList((*g).to_owned(), (*v).to_owned())),
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(not_found()),
    };
    let find = |plural: &str| {
        store
            .resources
            .iter()
            .position(|r| r.group == group && r.version == version && r.plural == plural)
            .ok_or_else(not_found)
    };
    let (namespace, plural, tail) = match rest {
        ["namespaces", ns, plural, tail @ ..]
            if find(plural).is_ok_and(|i| store.resources[i].namespaced) =>
        {
            (Some((*ns).to_owned()), *plural, tail)
        }
        [plural, tail @ ..] => (None, *plural, tail),
        [] => return Err(not_found()),
    };
    let res = find(plural)?;
    let (name, status) = match tail {
        [] => (None, false),
        [name] => (Some((*name).to_owned()), false),
        [name, "status"] if store.resources[res].status => (Some((*name).to_owned()), true),
        _ => return Err(not_found()),
    };
    if store.resources[res].namespaced && name.is_some() && namespace.is_none() {
        return Err(not_found());
    }
    Ok(Route::Object {
        res,
        namespace: if store.resources[res].namespaced {
            namespace
        } else {
            None
        },
        name,
        status,
    })
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match serve(&shared, &method, &uri, &query, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn serve(
    shared: &Arc<Shared>,
    method: &Method,
    uri: &Uri,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, StatusError> {
    let route = route(&shared.lock(), uri.path())?;
    if let Some(token) = &shared.token
        && !matches!(route, Route::Healthz)
    {
        let sent = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if sent != Some(token.as_str()) {
            return Err(StatusError::new(401, "Unauthorized", "Unauthorized"));
        }
    }
    let (res, namespace, name, status) = match route {
        Route::Healthz => return Ok((StatusCode::OK, "ok").into_response()),
        Route::Version => {
            return Ok(json_response(
                StatusCode::OK,
                &json!({
                    "major": "1", "minor": "33", "gitVersion": "v1.33.0-kt",
                    "gitCommit": "", "gitTreeState": "clean", "buildDate": "",
                    "goVersion": "", "compiler": "kt", "platform": "linux/amd64",
                }),
            ));
        }
        Route::CoreVersions => {
            return Ok(json_response(
                StatusCode::OK,
                &json!({
                    "kind": "APIVersions", "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": shared.addr.to_string()}],
                }),
            ));
        }
        Route::Groups => return Ok(json_response(StatusCode::OK, &groups(&shared.lock()))),
        Route::ResourceList(g, v) => {
            let store = shared.lock();
            return resource_list(&store, &g, &v).map(|list| json_response(StatusCode::OK, &list));
        }
        Route::Object {
            res,
            namespace,
            name,
            status,
        } => (res, namespace, name, status),
    };
    let parse_body = || -> Result<Value, StatusError> {
        serde_json::from_slice(&body).or_else(|_| {
            serde_yaml_ng::from_slice::<Value>(&body)
                .map_err(|e| StatusError::bad_request(format!("the body is not JSON or YAML: {e}")))
        })
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_owned();
    // JSON and YAML only: a protobuf body is refused the way a server
    // without it would, and client-go then resends JSON.
    if !body.is_empty() && content_type.contains("protobuf") {
        return Err(StatusError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml ({content_type})"
            ),
        ));
    }
    let ns = namespace.clone();
    let mut store = shared.lock();
    let key_ns = store.key_namespace(res, ns.as_deref());
    let r = store.resources[res].clone();
    let result = match (method.clone(), name) {
        (Method::GET, None) => {
            let filter = Filter {
                res,
                namespace: if r.namespaced { namespace } else { None },
                labels: parse_label_selector(query.get("labelSelector").map_or("", |s| s))?,
                fields: parse_field_selector(query.get("fieldSelector").map_or("", |s| s))?,
            };
            if query
                .get("watch")
                .is_some_and(|w| matches!(w.as_str(), "true" | "1"))
            {
                drop(store);
                return watch(shared.clone(), filter, query);
            }
            let items: Vec<Value> = store
                .objects
                .iter()
                .filter(|((r, ns, _), v)| filter.in_scope(*r, ns) && filter.matches(v))
                .map(|(_, v)| v.clone())
                .collect();
            return Ok(json_response(
                StatusCode::OK,
                &json!({
                    "apiVersion": r.api_version(),
                    "kind": format!("{}List", r.kind),
                    "metadata": {"resourceVersion": store.rv.to_string()},
                    "items": items,
                }),
            ));
        }
        (Method::GET, Some(name)) => {
            let v = store
                .objects
                .get(&(res, key_ns, name.clone()))
                .cloned()
                .ok_or_else(|| StatusError::not_found(&r, &name))?;
            return Ok(json_response(StatusCode::OK, &v));
        }
        (Method::POST, None) => {
            let v = store.create(res, ns.as_deref(), parse_body()?)?;
            (StatusCode::CREATED, v)
        }
        (Method::PUT, Some(name)) => {
            let key = (res, key_ns, name.clone());
            let old = store
                .objects
                .get(&key)
                .cloned()
                .ok_or_else(|| StatusError::not_found(&r, &name))?;
            let mode = if status { Write::Status } else { Write::Main };
            (StatusCode::OK, store.write(key, old, parse_body()?, mode)?)
        }
        (Method::PATCH, Some(name)) => {
            let key = (res, key_ns, name.clone());
            let patch = parse_body()?;
            let mode = if status { Write::Status } else { Write::Main };
            match store.objects.get(&key).cloned() {
                None if content_type == "application/apply-patch+yaml" && !status => {
                    let mut v = patch;
                    meta_mut(&mut v).insert("name".into(), name.clone().into());
                    (StatusCode::CREATED, store.create(res, ns.as_deref(), v)?)
                }
                None => return Err(StatusError::not_found(&r, &name)),
                Some(old) => {
                    let mut new = old.clone();
                    match content_type.as_str() {
                        "application/json-patch+json" => {
                            let ops: json_patch::Patch =
                                serde_json::from_value(patch).map_err(|e| {
                                    StatusError::bad_request(format!("json patch: {e}"))
                                })?;
                            json_patch_apply(&mut new, &ops)?;
                        }
                        "application/merge-patch+json"
                        | "application/strategic-merge-patch+json"
                        | "application/apply-patch+yaml" => json_patch::merge(&mut new, &patch),
                        other => {
                            return Err(StatusError::new(
                                415,
                                "UnsupportedMediaType",
                                format!(
                                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml ({other})"
                                ),
                            ));
                        }
                    }
                    (StatusCode::OK, store.write(key, old, new, mode)?)
                }
            }
        }
        (Method::DELETE, Some(name)) => {
            let options = if body.is_empty() {
                Value::Null
            } else {
                parse_body()?
            };
            match store.delete((res, key_ns, name.clone()), &options)? {
                Some(v) => (StatusCode::OK, v),
                None => (
                    StatusCode::OK,
                    json!({
                        "kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Success",
                        "details": {"name": name, "group": r.group, "kind": r.plural},
                    }),
                ),
            }
        }
        _ => {
            return Err(StatusError::new(
                405,
                "MethodNotAllowed",
                format!("{method} is not supported here"),
            ));
        }
    };
    let rv = store.rv;
    drop(store);
    shared.changed.send_replace(rv);
    Ok(json_response(result.0, &result.1))
}

/// RFC 6902 as Kubernetes applies it: a `test` for `null` at a path that
/// is not there passes (kube-runtime's finalizer helper relies on it).
fn json_patch_apply(doc: &mut Value, ops: &json_patch::Patch) -> Result<(), StatusError> {
    for op in &ops.0 {
        if let json_patch::PatchOperation::Test(t) = op
            && t.value.is_null()
            && doc.pointer(t.path.as_str()).is_none()
        {
            continue;
        }
        json_patch::patch(doc, std::slice::from_ref(op))
            .map_err(|e| StatusError::invalid(format!("json patch: {e}")))?;
    }
    Ok(())
}

fn groups(store: &Store) -> Value {
    let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for r in store.resources.iter().filter(|r| !r.group.is_empty()) {
        let versions = groups.entry(&r.group).or_default();
        if !versions.contains(&r.version.as_str()) {
            versions.push(&r.version);
        }
    }
    let groups: Vec<Value> = groups
        .into_iter()
        .map(|(g, vs)| {
            let versions: Vec<Value> = vs
                .iter()
                .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
                .collect();
            json!({"name": g, "versions": versions, "preferredVersion": versions[0]})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

fn resource_list(store: &Store, group: &str, version: &str) -> Result<Value, StatusError> {
    let mut resources = Vec::new();
    for r in store
        .resources
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        let verbs = [
            "create", "delete", "get", "list", "patch", "update", "watch",
        ];
        resources.push(json!({
            "name": r.plural, "singularName": r.kind.to_lowercase(), "namespaced": r.namespaced,
            "kind": r.kind, "verbs": verbs, "shortNames": r.short_names,
        }));
        if r.status {
            resources.push(json!({
                "name": format!("{}/status", r.plural), "singularName": "",
                "namespaced": r.namespaced, "kind": r.kind, "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return Err(StatusError::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({group}/{version})"),
        ));
    }
    let gv = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    Ok(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}),
    )
}

/// A watch line.
fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut s = json!({"type": kind, "object": object}).to_string();
    s.push('\n');
    Bytes::from(s)
}

fn gone_line(rv: u64, compacted: u64) -> Bytes {
    let status = StatusError::gone(format!(
        "too old resource version: {rv} ({})",
        compacted + 1
    ))
    .to_status();
    event_line("ERROR", &status)
}

struct WatchState {
    shared: Arc<Shared>,
    filter: Filter,
    pos: u64,
    pending: VecDeque<Bytes>,
    rx: tokio::sync::watch::Receiver<u64>,
    deadline: tokio::time::Instant,
    bookmarks: bool,
    done: bool,
}

impl WatchState {
    /// Queues the events after `pos`; false once the watch must end (410).
    fn drain(&mut self) -> bool {
        let store = self.shared.lock();
        if self.pos < store.compacted {
            self.pending.push_back(gone_line(self.pos, store.compacted));
            return false;
        }
        let start = store.log.partition_point(|e| e.rv <= self.pos);
        for e in store.log.range(start..) {
            if !self.filter.in_scope(e.res, &e.namespace) {
                continue;
            }
            let now = self.filter.matches(&e.object);
            let before = e.old.as_ref().is_some_and(|o| self.filter.matches(o));
            let kind = match (e.kind, before, now) {
                (EventType::Modified, true, true) => "MODIFIED",
                (EventType::Modified, false, true) => "ADDED",
                (EventType::Modified, true, false) => "DELETED",
                (EventType::Modified, false, false) => continue,
                (k, _, true) => k.as_str(),
                (_, _, false) => continue,
            };
            self.pending.push_back(event_line(kind, &e.object));
        }
        self.pos = store.rv;
        true
    }

    fn bookmark(&self, annotations: Value) -> Bytes {
        let r = &self.shared.lock().resources[self.filter.res];
        event_line(
            "BOOKMARK",
            &json!({
                "apiVersion": r.api_version(), "kind": r.kind,
                "metadata": {"resourceVersion": self.pos.to_string(), "annotations": annotations},
            }),
        )
    }
}

fn watch(
    shared: Arc<Shared>,
    filter: Filter,
    query: &HashMap<String, String>,
) -> Result<Response, StatusError> {
    let flag = |k: &str| {
        query
            .get(k)
            .is_some_and(|v| matches!(v.as_str(), "true" | "1"))
    };
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(1800);
    let initial = flag("sendInitialEvents");
    let rv_param = query.get("resourceVersion").map_or("", String::as_str);
    let rx = shared.changed.subscribe();
    let mut state = WatchState {
        shared: shared.clone(),
        filter,
        pos: 0,
        pending: VecDeque::new(),
        rx,
        deadline: tokio::time::Instant::now() + Duration::from_secs(timeout),
        bookmarks: flag("allowWatchBookmarks"),
        done: false,
    };
    {
        let store = shared.lock();
        if initial || rv_param.is_empty() || rv_param == "0" {
            for ((r, ns, _), v) in &store.objects {
                if state.filter.in_scope(*r, ns) && state.filter.matches(v) {
                    state.pending.push_back(event_line("ADDED", v));
                }
            }
            state.pos = store.rv;
        } else {
            let rv: u64 = rv_param.parse().map_err(|_| {
                StatusError::bad_request(format!("invalid resourceVersion {rv_param:?}"))
            })?;
            state.pos = rv;
            if rv < store.compacted {
                state.pending.push_back(gone_line(rv, store.compacted));
                state.done = true;
            }
        }
    }
    if initial && !state.done {
        let b = state.bookmark(json!({"k8s.io/initial-events-end": "true"}));
        state.pending.push_back(b);
    }
    let stop = shared.stop.clone();
    let stream = futures::stream::unfold(state, move |mut st| {
        let stop = stop.clone();
        async move {
            loop {
                if let Some(line) = st.pending.pop_front() {
                    return Some((Ok::<_, std::convert::Infallible>(line), st));
                }
                if st.done {
                    return None;
                }
                if !st.drain() {
                    st.done = true;
                    continue;
                }
                if !st.pending.is_empty() {
                    continue;
                }
                let interval = st.shared.bookmark_interval;
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    _ = tokio::time::sleep_until(st.deadline) => return None,
                    changed = st.rx.changed() => {
                        if changed.is_err() {
                            return None;
                        }
                    }
                    _ = tokio::time::sleep(interval), if st.bookmarks => {
                        if st.drain() && st.pending.is_empty() {
                            let b = st.bookmark(json!({}));
                            st.pending.push_back(b);
                        }
                    }
                }
            }
        }
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response())
}

/// HTTPS: a CA and a server certificate made at start (served by
/// kt-service's TLS listener).
mod tls {
    use std::net::IpAddr;
    use std::sync::Arc;

    use super::ApiServerError;

    fn err(what: &'static str) -> impl FnOnce(rcgen::Error) -> ApiServerError {
        move |e| ApiServerError::Tls(format!("{what}: {e}"))
    }

    #[derive(Debug)]
    pub struct Pki {
        pub ca_pem: String,
        cert_der: Vec<u8>,
        key_der: Vec<u8>,
    }

    impl Pki {
        /// A CA and a certificate for `ip` and `localhost` signed by it.
        pub fn generate(ip: IpAddr) -> Result<Pki, ApiServerError> {
            let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(err("CA"))?;
            ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            ca.distinguished_name
                .push(rcgen::DnType::CommonName, "kt in-memory apiserver CA");
            let ca_key = rcgen::KeyPair::generate().map_err(err("CA key"))?;
            let ca = ca.self_signed(&ca_key).map_err(err("CA"))?;
            let server = rcgen::CertificateParams::new(vec![ip.to_string(), "localhost".into()])
                .map_err(err("server certificate"))?;
            let key = rcgen::KeyPair::generate().map_err(err("server key"))?;
            let cert = server
                .signed_by(&key, &ca, &ca_key)
                .map_err(err("server certificate"))?;
            Ok(Pki {
                ca_pem: ca.pem(),
                cert_der: cert.der().to_vec(),
                key_der: key.serialize_der(),
            })
        }

        pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, ApiServerError> {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let key = rustls::pki_types::PrivateKeyDer::try_from(self.key_der.clone())
                .map_err(|e| ApiServerError::Tls(format!("server key: {e}")))?;
            let cert = rustls::pki_types::CertificateDer::from(self.cert_der.clone());
            let mut config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| ApiServerError::Tls(e.to_string()))?
                .with_no_client_auth()
                .with_single_cert(vec![cert], key)
                .map_err(|e| ApiServerError::Tls(e.to_string()))?;
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            Ok(Arc::new(config))
        }
    }

    /// The DER of the first certificate of `pem`.
    pub fn pem_to_der(pem: &str) -> Result<Vec<u8>, ApiServerError> {
        use base64::Engine as _;
        let body: String = pem
            .lines()
            .skip_while(|l| !l.starts_with("-----BEGIN CERTIFICATE-----"))
            .skip(1)
            .take_while(|l| !l.starts_with("-----END"))
            .collect();
        base64::engine::general_purpose::STANDARD
            .decode(body.trim())
            .map_err(|e| ApiServerError::Tls(format!("CA PEM: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "labels": labels}, "spec": {"nodeName": "n1"}})
    }

    #[test]
    fn label_selectors() {
        let v = obj(json!({"app": "web", "tier": "front"}));
        let m = |s: &str| labels_match(&parse_label_selector(s).unwrap(), &v);
        assert!(m(""));
        assert!(m("app=web"));
        assert!(m("app==web,tier"));
        assert!(!m("app!=web"));
        assert!(m("app in (web, db)"));
        assert!(!m("app notin (web,db)"));
        assert!(m("missing notin (x)"));
        assert!(m("!missing"));
        assert!(!m("!app"));
        assert!(!m("missing"));
        assert!(m("app in (web),tier in (front,back),!x"));
        assert!(parse_label_selector("app in web").is_err());
    }

    #[test]
    fn field_selectors() {
        let v = obj(json!({}));
        let f = |s: &str| {
            let f = Filter {
                res: 0,
                namespace: None,
                labels: vec![],
                fields: parse_field_selector(s).unwrap(),
            };
            f.matches(&v)
        };
        assert!(f("metadata.name=a"));
        assert!(f("spec.nodeName==n1,metadata.name!=b"));
        assert!(!f("spec.nodeName=n2"));
        assert!(f("status.phase="));
        assert!(parse_field_selector("bogus").is_err());
    }

    #[test]
    fn names() {
        assert!(name_problem("node-1").is_none());
        assert!(name_problem("a.b-c").is_none());
        assert!(name_problem("Bad").is_some());
        assert!(name_problem("-a").is_some());
        assert!(name_problem("").is_some());
    }
}
