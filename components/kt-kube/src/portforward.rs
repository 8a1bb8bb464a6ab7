//! External access: `kt` outside the cluster reaches kt's servers through the
//! API server's port-forward.
//!
//! [`Forwarder::local_url`] maps a URL as kt knows it in the cluster — a
//! Service (`http://kt-store:8082`, also `kt-store.<ns>.svc…`) or a pod IP
//! (an agent, `http://10.1.2.3:8090`) — to a listener on `127.0.0.1:0`
//! (made on first use, kept for the forwarder's life). Each connection to a
//! listener opens one port-forward (`Api::<Pod>::portforward`) to the target:
//! a Ready pod picked by the Service's selector (the Service port resolved to
//! the container port), or the Running pod with that IP. Targets are resolved
//! at the first connection and cached.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Where the kubeconfig comes from.
#[derive(Debug, Clone, Default)]
pub struct KubeOptions {
    /// A kubeconfig file (else `$KUBECONFIG`, `~/.kube/config`, in-cluster).
    pub kubeconfig: Option<std::path::PathBuf>,
    /// A context of the kubeconfig (else its current context).
    pub context: Option<String>,
    /// The namespace (else the context's, else `default`).
    pub namespace: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("kubeconfig: {0}")]
    Config(String),
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("local listener: {0}")]
    Listen(#[from] std::io::Error),
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ForwardError {
    move |source| ForwardError::Kube {
        what: what.into(),
        source,
    }
}

/// A client for the options' cluster, and the namespace to use.
pub async fn connect(opts: &KubeOptions) -> Result<(Client, String), ForwardError> {
    let config = match (&opts.kubeconfig, &opts.context) {
        (Some(path), _) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| ForwardError::Config(format!("{}: {e}", path.display())))?;
            let o = kube::config::KubeConfigOptions {
                context: opts.context.clone(),
                ..Default::default()
            };
            kube::Config::from_custom_kubeconfig(kc, &o)
                .await
                .map_err(|e| ForwardError::Config(e.to_string()))?
        }
        (None, Some(context)) => {
            let o = kube::config::KubeConfigOptions {
                context: Some(context.clone()),
                ..Default::default()
            };
            kube::Config::from_kubeconfig(&o)
                .await
                .map_err(|e| ForwardError::Config(e.to_string()))?
        }
        (None, None) => kube::Config::infer()
            .await
            .map_err(|e| ForwardError::Config(e.to_string()))?,
    };
    let namespace = opts
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).map_err(kube_err("kubernetes client"))?;
    Ok((client, namespace))
}

/// The bearer token from Secret `name`, key `key`.
pub async fn read_token(
    client: &Client,
    namespace: &str,
    name: &str,
    key: &str,
) -> Result<String, ForwardError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let secret = secrets
        .get(name)
        .await
        .map_err(kube_err(format!("reading Secret {namespace}/{name}")))?;
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .ok_or_else(|| {
            ForwardError::NotFound(format!("Secret {namespace}/{name} has no key {key:?}"))
        })?;
    let token = String::from_utf8(value.0.clone()).map_err(|_| {
        ForwardError::NotFound(format!(
            "Secret {namespace}/{name} key {key:?} is not UTF-8"
        ))
    })?;
    Ok(token.trim().to_owned())
}

/// The token `kt --kube` presents: the static token's Secret (`kt-token`,
/// the dev overlays), or where that does not exist or may not be read (an
/// install on Kubernetes identities), a short-lived token for the
/// ServiceAccount [`crate::OPERATOR_ACCOUNT`] (a TokenRequest, audience
/// kt, one hour).
pub async fn cluster_token(client: &Client, namespace: &str) -> Result<String, ForwardError> {
    let secret = read_token(
        client,
        namespace,
        crate::TOKEN_SECRET,
        crate::TOKEN_SECRET_KEY,
    )
    .await;
    match secret {
        Err(ForwardError::Kube {
            source: kube::Error::Api(e),
            ..
        }) if e.code == 404 || e.code == 403 => {
            request_token(client, namespace, crate::OPERATOR_ACCOUNT).await
        }
        other => other,
    }
}

/// A token for ServiceAccount `account` (audience kt, one hour).
pub async fn request_token(
    client: &Client,
    namespace: &str,
    account: &str,
) -> Result<String, ForwardError> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let ask = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![crate::review::AUDIENCE.to_owned()],
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        },
        ..TokenRequest::default()
    };
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let made = accounts
        .create_token_request(account, &Default::default(), &ask)
        .await
        .map_err(kube_err(format!(
            "no kt-token Secret; requesting a token for ServiceAccount {namespace}/{account}"
        )))?;
    made.status
        .map(|s| s.token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            ForwardError::NotFound(format!(
                "the TokenRequest for {namespace}/{account} answered no token"
            ))
        })
}

/// True for a Running pod, not being deleted, whose Ready condition is True.
pub fn is_ready(p: &Pod) -> bool {
    let status = p.status.as_ref();
    let running = status.and_then(|s| s.phase.as_deref()) == Some("Running");
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    running && ready && p.metadata.deletion_timestamp.is_none()
}

/// The first Ready pod by name (stable between calls).
pub fn pick_ready(pods: &[Pod]) -> Option<&Pod> {
    pods.iter()
        .filter(|p| is_ready(p))
        .min_by_key(|p| p.metadata.name.clone())
}

/// The container port behind `svc`'s `port` on `pod` (a numeric target
/// port, a named one looked up in the pod's containers, or the port itself).
pub fn target_port(svc: &Service, port: u16, pod: &Pod) -> Option<u16> {
    let ports = svc.spec.as_ref()?.ports.as_ref()?;
    let sp = ports.iter().find(|p| p.port == i32::from(port))?;
    match &sp.target_port {
        None => Some(port),
        Some(IntOrString::Int(n)) => u16::try_from(*n).ok(),
        Some(IntOrString::String(name)) => pod
            .spec
            .as_ref()?
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .find(|cp| cp.name.as_deref() == Some(name.as_str()))
            .and_then(|cp| u16::try_from(cp.container_port).ok()),
    }
}

fn selector_string(selector: &BTreeMap<String, String>) -> String {
    selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// A Ready pod behind Service `service` and the container port of its `port`.
pub async fn service_target(
    client: &Client,
    namespace: &str,
    service: &str,
    port: u16,
) -> Result<(String, u16), ForwardError> {
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    let svc = services
        .get(service)
        .await
        .map_err(kube_err(format!("reading Service {namespace}/{service}")))?;
    let selector = svc
        .spec
        .as_ref()
        .and_then(|s| s.selector.as_ref())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| {
            ForwardError::Unsupported(format!(
                "Service {namespace}/{service} has no selector: no pod to forward to"
            ))
        })?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = pods
        .list(&ListParams::default().labels(&selector_string(selector)))
        .await
        .map_err(kube_err(format!(
            "listing the pods of Service {namespace}/{service}"
        )))?;
    let pod = pick_ready(&list.items).ok_or_else(|| {
        ForwardError::NotFound(format!(
            "no Ready pod behind Service {namespace}/{service} ({} pod(s) match its selector)",
            list.items.len()
        ))
    })?;
    let target = target_port(&svc, port, pod).ok_or_else(|| {
        ForwardError::NotFound(format!(
            "Service {namespace}/{service} has no port {port} (or its target port is not on pod {})",
            pod.name_any()
        ))
    })?;
    Ok((pod.name_any(), target))
}

/// The Running pod whose IP is `ip`.
pub async fn pod_by_ip(
    client: &Client,
    namespace: &str,
    ip: IpAddr,
) -> Result<String, ForwardError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = pods
        .list(&ListParams::default().fields(&format!("status.podIP={ip}")))
        .await
        .map_err(kube_err(format!("looking up the pod with IP {ip}")))?;
    list.items
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .map(|p| p.name_any())
        .min()
        .ok_or_else(|| {
            ForwardError::NotFound(format!(
                "no running pod has IP {ip} in namespace {namespace}"
            ))
        })
}

/// What a URL's host names in the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Target {
    /// A Service of the namespace, by name.
    Service(String),
    /// A pod, by IP.
    PodIp(IpAddr),
}

/// Splits `scheme://host:port/rest` into the target, its port and the rest.
/// Hosts `name`, `name.<namespace>` and `name.<namespace>.svc[.…]` are
/// Services of `namespace`; IP literals are pods.
pub fn parse_url(url: &str, namespace: &str) -> Result<(Target, u16, String), ForwardError> {
    let bad =
        || ForwardError::Unsupported(format!("cannot forward {url:?}: not http(s)://host:port/…"));
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(bad)?;
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok((Target::PodIp(ip), port, path.to_owned()));
    }
    let mut parts = host.split('.');
    let name = parts.next().unwrap_or_default();
    match (parts.next(), parts.next()) {
        (None, _) => {}
        (Some(ns), None | Some("svc")) if ns == namespace => {}
        _ => {
            return Err(ForwardError::Unsupported(format!(
                "cannot forward {url:?}: not a Service of namespace {namespace} nor a pod IP"
            )));
        }
    }
    Ok((Target::Service(name.to_owned()), port, path.to_owned()))
}

type Route = (Target, u16);

/// Local listeners forwarding to the cluster; see the module docs.
pub struct Forwarder {
    client: Client,
    namespace: String,
    routes: Mutex<HashMap<Route, SocketAddr>>,
    /// Resolved targets: pod name and container port.
    resolved: Arc<tokio::sync::Mutex<HashMap<Route, (String, u16)>>>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Forwarder {
    pub fn new(client: Client, namespace: impl Into<String>) -> Arc<Self> {
        Arc::new(Forwarder {
            client,
            namespace: namespace.into(),
            routes: Mutex::new(HashMap::new()),
            resolved: Arc::default(),
            shutdown: CancellationToken::new(),
            tasks: TaskTracker::new(),
        })
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// `url` with its host and port replaced by a local listener forwarding
    /// to its target; made on first use. Must be called inside a tokio runtime.
    /// The scheme stays: an `https://` server's certificate must name
    /// `127.0.0.1` (the bundle's do).
    pub fn local_url(self: &Arc<Self>, url: &str) -> Result<String, ForwardError> {
        let (target, port, path) = parse_url(url, &self.namespace)?;
        let scheme = if url.starts_with("https://") {
            "https"
        } else {
            "http"
        };
        let route = (target, port);
        let mut routes = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(addr) = routes.get(&route) {
            return Ok(format!("{scheme}://{addr}{path}"));
        }
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        std_listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(std_listener)?;
        let addr = listener.local_addr()?;
        routes.insert(route.clone(), addr);
        tracing::debug!(%url, local = %addr, "forwarding");
        self.tasks.spawn(self.clone().accept(listener, route));
        Ok(format!("{scheme}://{addr}{path}"))
    }

    /// Stops every listener and forward.
    pub async fn close(&self) {
        self.shutdown.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }

    /// The pod and container port of `route`, resolved once.
    pub async fn resolve(&self, route: &Route) -> Result<(String, u16), ForwardError> {
        let mut resolved = self.resolved.lock().await;
        if let Some(r) = resolved.get(route) {
            return Ok(r.clone());
        }
        let r = match &route.0 {
            Target::Service(name) => {
                service_target(&self.client, &self.namespace, name, route.1).await?
            }
            Target::PodIp(ip) => (
                pod_by_ip(&self.client, &self.namespace, *ip).await?,
                route.1,
            ),
        };
        resolved.insert(route.clone(), r.clone());
        Ok(r)
    }

    async fn accept(self: Arc<Self>, listener: TcpListener, route: Route) {
        loop {
            let conn = tokio::select! {
                _ = self.shutdown.cancelled() => return,
                conn = listener.accept() => conn,
            };
            match conn {
                Ok((conn, _)) => {
                    let me = self.clone();
                    let route = route.clone();
                    self.tasks.spawn(async move {
                        if let Err(e) = me.forward(conn, &route).await {
                            tracing::warn!(target = ?route.0, port = route.1, error = %e, "port-forward failed");
                        }
                    });
                }
                Err(e) => tracing::warn!(error = %e, "accepting a local connection"),
            }
        }
    }

    /// One local connection over one port-forward.
    async fn forward(&self, mut conn: TcpStream, route: &Route) -> Result<(), ForwardError> {
        let (pod, port) = self.resolve(route).await?;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let mut pf = pods
            .portforward(&pod, &[port])
            .await
            .map_err(kube_err(format!("port-forward to pod {pod} port {port}")))?;
        let mut upstream = pf.take_stream(port).ok_or_else(|| {
            ForwardError::NotFound(format!(
                "port-forward to {pod} gave no stream for port {port}"
            ))
        })?;
        tokio::select! {
            _ = self.shutdown.cancelled() => {}
            r = tokio::io::copy_bidirectional(&mut conn, &mut upstream) => {
                if let Err(e) = r {
                    tracing::debug!(%pod, port, error = %e, "forwarded connection ended");
                }
            }
        }
        drop(upstream);
        pf.abort();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cluster_urls() {
        let svc = |n: &str| Target::Service(n.into());
        assert_eq!(
            parse_url("http://kt-store:8082/api/v1/x", "kt").unwrap(),
            (svc("kt-store"), 8082, "/api/v1/x".into())
        );
        assert_eq!(
            parse_url("http://kt-store.kt.svc.cluster.local:8082", "kt").unwrap(),
            (svc("kt-store"), 8082, String::new())
        );
        assert_eq!(
            parse_url("http://10.0.0.7:8090/", "kt").unwrap(),
            (Target::PodIp("10.0.0.7".parse().unwrap()), 8090, "/".into())
        );
        assert_eq!(
            parse_url("http://[fd00::1]:8090", "kt").unwrap().0,
            Target::PodIp("fd00::1".parse().unwrap())
        );
        assert_eq!(
            parse_url("https://kt-store:8082/x", "kt").unwrap(),
            (svc("kt-store"), 8082, "/x".into())
        );
        for bad in [
            "ftp://kt-store:8082",
            "http://kt-store",
            "http://a.other:1",
            "http://x:port",
        ] {
            assert!(parse_url(bad, "kt").is_err(), "{bad}");
        }
    }
}
