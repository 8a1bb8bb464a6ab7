//! How the process reaches kt: what `kt.configure` was given, else the
//! environment variables the CLI reads.

use std::path::PathBuf;

use kt_types::env;
use pyo3::PyResult;

use crate::errors::{invalid, unauthorized};

/// What `kt.configure` was given (None: from the environment).
#[derive(Debug, Default)]
pub struct Given {
    pub metadata_url: Option<String>,
    pub token: Option<String>,
    pub token_file: Option<PathBuf>,
    pub agent_socket: Option<PathBuf>,
    pub streams: Option<usize>,
    pub deadline: Option<std::time::Duration>,
    /// `kube=`: `Some(false)` turns `KT_KUBE` off.
    pub kube: Option<bool>,
    pub kubeconfig: Option<PathBuf>,
    pub context: Option<String>,
    pub namespace: Option<String>,
}

/// How to reach kt from outside the cluster (`kt --kube`): through the
/// Kubernetes API's port-forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kube {
    /// `kubeconfig=` (else `$KUBECONFIG`, then `~/.kube/config`).
    pub kubeconfig: Option<PathBuf>,
    /// `context=`, `KT_KUBE_CONTEXT` (else the kubeconfig's current one).
    pub context: Option<String>,
    /// `namespace=`, `KT_NAMESPACE` (else the context's).
    pub namespace: Option<String>,
}

/// The settings in use.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Unused with `kube` (the port-forward's local URL is used).
    pub metadata_url: String,
    /// Empty with `kube` when none was given: read from the cluster.
    pub token: String,
    /// Where `token` was read from (read again as it rotates).
    pub token_file: Option<PathBuf>,
    pub agent_socket: PathBuf,
    pub streams: Option<usize>,
    /// `deadline=`, `KT_DEADLINE`, as the CLI's `--deadline`.
    pub deadline: Option<std::time::Duration>,
    /// `kube=True`, `KT_KUBE`: reached from outside the cluster.
    pub kube: Option<Kube>,
    /// `KT_STALL_TIMEOUT`, as the CLI's `--stall-timeout`.
    pub stall: Option<std::time::Duration>,
    /// `KT_CONNECT_TIMEOUT`, as the CLI's `--connect-timeout`: how long a
    /// call waits for the metadata server's first answer.
    pub connect: Option<std::time::Duration>,
}

/// A duration variable such as `KT_DEADLINE=5m`.
fn duration_var(name: &str) -> PyResult<Option<std::time::Duration>> {
    var(name)
        .map(|v| {
            humantime::parse_duration(v.trim()).map_err(|e| {
                invalid(format!(
                    "{name}: {v:?} is not a duration such as 30s or 5m: {e}"
                ))
            })
        })
        .transpose()
}

const DEFAULT_METADATA_URL: &str = "http://127.0.0.1:8081";

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// A yes/no variable such as `KT_KUBE=1`, read as the CLI reads it.
fn bool_var(name: &str) -> PyResult<Option<bool>> {
    var(name)
        .map(|v| match v.trim().to_ascii_lowercase().as_str() {
            "1" | "y" | "yes" | "t" | "true" | "on" => Ok(true),
            "0" | "n" | "no" | "f" | "false" | "off" => Ok(false),
            _ => Err(invalid(format!("{name}: {v:?} is not yes or no (1, 0)"))),
        })
        .transpose()
}

impl Settings {
    /// `given`, the rest from `KT_METADATA_URL`, `KT_TOKEN_FILE` (which
    /// wins over `KT_TOKEN`, as in the CLI), `KT_AGENT_SOCKET`, `KT_STREAMS`,
    /// `KT_DEADLINE`, `KT_STALL_TIMEOUT`, `KT_KUBE` (with `KT_KUBE_CONTEXT`,
    /// `KT_NAMESPACE`).
    pub fn from_env(given: Given) -> PyResult<Settings> {
        let kube = match given.kube {
            Some(on) => on,
            None => bool_var(env::KUBE)?.unwrap_or(false),
        }
        .then(|| Kube {
            kubeconfig: given.kubeconfig,
            context: given.context.or_else(|| var(env::KUBE_CONTEXT)),
            namespace: given.namespace.or_else(|| var(env::NAMESPACE)),
        });
        let metadata_url = given
            .metadata_url
            .or_else(|| var(env::METADATA_URL))
            .unwrap_or_else(|| DEFAULT_METADATA_URL.to_owned());
        if !(metadata_url.starts_with("http://") || metadata_url.starts_with("https://")) {
            return Err(invalid(format!(
                "metadata_url: {metadata_url:?} is not an http(s) URL"
            )));
        }
        let token_file = given
            .token_file
            .or_else(|| var(env::TOKEN_FILE).map(PathBuf::from));
        let from_file = given.token.is_none().then(|| token_file.clone()).flatten();
        let token = match (given.token, token_file) {
            (Some(t), _) => t,
            (None, Some(f)) => std::fs::read_to_string(&f)
                .map_err(|e| unauthorized(format!("token file {}: {e}", f.display())))?
                .trim()
                .to_owned(),
            // From outside the cluster, the cluster's own (Secret kt-token).
            (None, None) if kube.is_some() => var(env::TOKEN).unwrap_or_default(),
            (None, None) => var(env::TOKEN).ok_or_else(|| {
                unauthorized(
                    "no token: set KT_TOKEN or KT_TOKEN_FILE, or call kt.configure(token=...)",
                )
            })?,
        };
        let streams = match given.streams {
            Some(n) => Some(n),
            None => var(env::STREAMS)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| invalid(format!("{}: {v:?} is not a number", env::STREAMS)))
                })
                .transpose()?,
        };
        if streams == Some(0) {
            return Err(invalid("streams: at least 1"));
        }
        Ok(Settings {
            metadata_url: metadata_url.trim_end_matches('/').to_owned(),
            token,
            token_file: from_file,
            agent_socket: given
                .agent_socket
                .unwrap_or_else(kt_client::agent::default_socket),
            streams,
            deadline: match given.deadline {
                Some(d) => Some(d),
                None => duration_var(env::DEADLINE)?,
            },
            kube,
            stall: duration_var(env::STALL_TIMEOUT)?,
            connect: duration_var(env::CONNECT_TIMEOUT)?,
        })
    }
}
