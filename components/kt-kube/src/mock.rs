//! A scripted Kubernetes API for tests (feature `mock`): a `kube::Client`
//! over a `tower_test` mock whose requests are answered from per-route
//! queues of canned replies.
//!
//! A route is the last path segment with `?watch` appended for watches
//! (`pods`, `pods?watch`, `deployments?watch`, `secrets/kt-token`, …).
//! Unscripted lists answer an empty list; unscripted watches and other
//! requests wait until a reply is scripted for them. A route may instead
//! have a responder, which answers every request from its body
//! ([`MockApi::respond`]: TokenReviews by token).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// A canned answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A JSON body with a status.
    Json(StatusCode, Value),
    /// A watch body: one JSON event per line, then the end of the stream.
    Events(Vec<Value>),
}

/// Answers every request to a route from its body.
pub type Responder = Arc<dyn Fn(&[u8]) -> Reply + Send + Sync>;

#[derive(Clone, Default)]
struct Responders(Arc<Mutex<HashMap<String, Responder>>>);

impl std::fmt::Debug for Responders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(lock(&self.0).keys()).finish()
    }
}

/// Scripts and the log of requests seen.
#[derive(Debug, Clone, Default)]
pub struct MockApi {
    scripts: Arc<Mutex<HashMap<String, VecDeque<Reply>>>>,
    responders: Responders,
    seen: Arc<Mutex<Vec<String>>>,
    added: Arc<tokio::sync::Notify>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MockApi {
    /// Queues `reply` for `route`.
    pub fn script(&self, route: &str, reply: Reply) -> &Self {
        lock(&self.scripts)
            .entry(route.to_owned())
            .or_default()
            .push_back(reply);
        self.added.notify_waiters();
        self
    }

    /// Answers every request to `route` with `f` of its body (instead of
    /// the scripted queue).
    pub fn respond(
        &self,
        route: &str,
        f: impl Fn(&[u8]) -> Reply + Send + Sync + 'static,
    ) -> &Self {
        lock(&self.responders.0).insert(route.to_owned(), Arc::new(f));
        self
    }

    /// Every request so far, as `METHOD route path?query`.
    pub fn seen(&self) -> Vec<String> {
        lock(&self.seen).clone()
    }

    /// How many requests went to `route`.
    pub fn count(&self, route: &str) -> usize {
        let prefix = format!("{route} ");
        lock(&self.seen)
            .iter()
            .filter(|s| {
                s.split_once(' ')
                    .is_some_and(|(_, r)| r.starts_with(&prefix))
            })
            .count()
    }

    /// A client in namespace `ns` served by this mock, and the serving task
    /// (abort it, or drop the client, to end it).
    pub fn client(&self, ns: &str) -> (kube::Client, JoinHandle<()>) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let me = self.clone();
        let task = tokio::spawn(async move {
            let mut pending = tokio::task::JoinSet::new();
            while let Some((req, send)) = handle.next_request().await {
                let route = route_of(&req);
                lock(&me.seen).push(format!(
                    "{} {route} {}",
                    req.method(),
                    req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("")
                ));
                let me = me.clone();
                let responder = lock(&me.responders.0).get(&route).cloned();
                pending.spawn(async move {
                    let reply = match responder {
                        Some(f) => {
                            use http_body_util::BodyExt;
                            let body = req.into_body().collect().await;
                            let bytes = body.map(|b| b.to_bytes()).unwrap_or_default();
                            f(&bytes)
                        }
                        None => me.reply_for(&route).await,
                    };
                    send.send_response(response(reply));
                });
            }
        });
        (kube::Client::new(service, ns), task)
    }

    /// The next reply scripted for `route`, waiting for one to be scripted
    /// (lists: an empty list when none is).
    async fn reply_for(&self, route: &str) -> Reply {
        loop {
            let notified = self.added.notified();
            if let Some(r) = lock(&self.scripts)
                .get_mut(route)
                .and_then(VecDeque::pop_front)
            {
                return r;
            }
            if !route.contains('?') && !route.contains('/') {
                return Reply::Json(StatusCode::OK, list(&[], "1"));
            }
            notified.await;
        }
    }
}

fn response(reply: Reply) -> Response<Body> {
    let (status, body) = match reply {
        Reply::Json(status, body) => (status, body.to_string()),
        Reply::Events(events) => {
            let mut text = String::new();
            for e in events {
                text.push_str(&e.to_string());
                text.push('\n');
            }
            (StatusCode::OK, text)
        }
    };
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(body.into_bytes()))
        .expect("a valid response")
}

fn route_of(req: &Request<Body>) -> String {
    let path = req.uri().path();
    let query = req.uri().query().unwrap_or("");
    // `…/namespaces/ns/pods` → `pods`; `…/secrets/kt-token` → `secrets/kt-token`.
    let after_ns = path
        .split_once("/namespaces/")
        .map(|(_, rest)| rest.split_once('/').map(|(_, r)| r).unwrap_or(""))
        .unwrap_or(path.trim_start_matches('/'));
    let watch = query.split('&').any(|kv| kv == "watch=true");
    if watch {
        format!("{after_ns}?watch")
    } else {
        after_ns.to_owned()
    }
}

/// A list body.
pub fn list(items: &[Value], resource_version: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "List",
        "metadata": {"resourceVersion": resource_version},
        "items": items,
    })
}

/// A pod labelled with `service` in `phase`, Ready when Running.
pub fn pod(name: &str, service: &str, phase: &str, rv: &str) -> Value {
    let ready = if phase == "Running" { "True" } else { "False" };
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "kt",
            "resourceVersion": rv,
            "labels": {crate::SERVICE_LABEL: service},
        },
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]},
    })
}

/// A workload's metadata, labelled with `service`.
pub fn workload(kind: &str, name: &str, service: &str, rv: &str) -> Value {
    json!({
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": "kt",
            "resourceVersion": rv,
            "labels": {crate::SERVICE_LABEL: service},
        },
    })
}

/// A watch event.
pub fn event(kind: &str, object: Value) -> Value {
    json!({"type": kind, "object": object})
}

/// The watch error that forces a relist.
pub fn gone() -> Value {
    json!({
        "type": "ERROR",
        "object": {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": "too old resource version",
            "reason": "Expired",
            "code": 410,
        },
    })
}

/// An API error answer.
pub fn status(code: u16, message: &str) -> Reply {
    Reply::Json(
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        json!({
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": "InternalError",
            "code": code,
        }),
    )
}

/// The workspace's root: tests compare against its committed manifests.
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A file of the workspace, by its path from the root (panics if absent:
/// for tests).
pub fn repo_file(rel: &str) -> String {
    std::fs::read_to_string(repo_root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The YAML documents of a workspace file, as JSON values.
pub fn repo_docs(rel: &str) -> Vec<Value> {
    let text = repo_file(rel);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{rel}: {e}")))
        .filter(|v: &Value| !v.is_null())
        .collect()
}
