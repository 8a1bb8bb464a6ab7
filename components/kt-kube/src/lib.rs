//! kt's Kubernetes integration (kube-rs).
//!
//! - [`state`]: the metadata server's view of its namespace as a pure state
//!   machine (watch events in, evictions and teardowns out), no kube I/O.
//! - [`watch`]: kube-runtime watchers on pods and workloads labelled
//!   [`SERVICE_LABEL`], with a backoff, feeding [`state`].
//! - [`review`]: who a bearer token is (TokenReview, and the pod it is
//!   bound to), for the metadata server's `--kube-auth`.
//! - [`inject`]: the sidecar injection of the admission webhook, as JSON
//!   Patch operations on a pod, from the template the kustomize components
//!   render (pure); [`admission`]: the AdmissionReview v1 around it (pure;
//!   kt-metadata serves it, `--webhook-listen`).
//! - [`dataset`]: the `Dataset` custom resource (`datasets.kt.dev`): its
//!   types, from which the CRD manifest is generated (the controller is
//!   kt-dataset; `kt dataset` speaks them too).
//! - [`portforward`]: `kt` outside the cluster: kubeconfig, the token Secret,
//!   Ready pods behind a Service, local listeners over the API server's
//!   port-forward.
//!
//! - [`apiserver`] (feature `apiserver`): an in-memory Kubernetes API
//!   server over HTTP for tests and the testbed.
//!
//! Invariant: no kt server or client crate here; the metadata server and the
//! CLI plug these in at their edges.

pub mod admission;
#[cfg(feature = "apiserver")]
pub mod apiserver;
pub mod dataset;
pub mod inject;
#[cfg(feature = "mock")]
pub mod mock;
pub mod portforward;
pub mod review;
pub mod state;
pub mod watch;

pub use kube;

/// The label naming a workload's (and its pods') kt service.
pub const SERVICE_LABEL: &str = "kt.dev/service";

/// The Secret holding the bearer token, and its key.
pub const TOKEN_SECRET: &str = "kt-token";
pub const TOKEN_SECRET_KEY: &str = "token";

/// The ServiceAccount whose tokens `kt --kube` requests where there is no
/// token Secret (an install on Kubernetes identities; admin in the
/// bundle's access map).
pub const OPERATOR_ACCOUNT: &str = "kt-operator";

/// The in-cluster Services and ports of kt's servers.
pub const METADATA_SERVICE_URL: &str = "http://kt-metadata:8081";

/// The metadata server of an install with the tls component.
pub const METADATA_SERVICE_URL_TLS: &str = "https://kt-metadata:8081";

/// Where a pod's service account namespace is mounted.
pub const SERVICE_ACCOUNT_NAMESPACE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The namespace of this pod's service account, if mounted.
pub fn in_cluster_namespace() -> Option<String> {
    std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}
