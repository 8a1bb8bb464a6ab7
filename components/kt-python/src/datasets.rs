//! `kt.datasets`: Dataset resources through the Kubernetes API server, with
//! kt-client's [`kt_client::datasets`] (as `kt dataset`). They need no kt
//! token nor metadata server: a kubeconfig (`kubeconfig=`, `KUBECONFIG`,
//! `~/.kube/config`) or the pod's ServiceAccount.
//!
//! One entry point, `_kt.datasets_call(op, ...)`, answers JSON (a Dataset,
//! or a list of them) that `kt/datasets.py` turns into dataclasses.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use kt_client::datasets::{self, DatasetError, Datasets, SpecArgs};
use kt_kube::dataset::Phase;
use kt_kube::portforward::KubeOptions;
use pyo3::prelude::*;

use crate::errors::{dataset as to_py, invalid};

/// A runtime of its own: dataset calls need neither kt's settings nor its
/// agent connection.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("kt-datasets")
        .enable_all()
        .build()
        .map_err(|e| invalid(format!("kt.datasets: a runtime: {e}")))?;
    Ok(RT.get_or_init(|| rt))
}

/// Runs `fut` without the GIL, looking for signals (Ctrl-C) every 100 ms.
fn block<T: Send + 'static>(
    py: Python<'_>,
    fut: impl Future<Output = Result<T, DatasetError>> + Send + 'static,
) -> PyResult<T> {
    let rt = runtime()?;
    let mut task = rt.spawn(fut);
    loop {
        let waited = py.detach(|| {
            rt.block_on(async { tokio::time::timeout(Duration::from_millis(100), &mut task).await })
        });
        match waited {
            Ok(Ok(result)) => return result.map_err(to_py),
            Ok(Err(joined)) => {
                return Err(invalid(format!("kt.datasets: the call failed: {joined}")));
            }
            Err(_) => {
                if let Err(e) = py.check_signals() {
                    task.abort();
                    return Err(e);
                }
            }
        }
    }
}

fn phase(s: &str) -> PyResult<Phase> {
    serde_json::from_value(serde_json::Value::String(s.to_owned())).map_err(|_| {
        invalid(format!(
            "phase {s:?}: one of Pending, Ingesting, Seeding, Ready, Failed"
        ))
    })
}

fn json(v: &impl serde::Serialize) -> PyResult<String> {
    serde_json::to_string(v).map_err(|e| invalid(format!("kt.datasets: {e}")))
}

/// `op`: `apply` (from `spec`, a JSON object of [`SpecArgs`]' fields, or
/// from `manifest`, YAML), `get`, `list`, `delete`, `wait`. `wait`: a phase
/// to wait for (apply, get, wait) — or, for delete, anything to wait until
/// it is gone.
#[pyfunction]
#[pyo3(signature = (op, name=None, spec=None, manifest=None, wait=None, timeout=600.0, kubeconfig=None, context=None, namespace=None))]
#[allow(clippy::too_many_arguments)]
pub fn datasets_call(
    py: Python<'_>,
    op: &str,
    name: Option<String>,
    spec: Option<String>,
    manifest: Option<String>,
    wait: Option<String>,
    timeout: f64,
    kubeconfig: Option<PathBuf>,
    context: Option<String>,
    namespace: Option<String>,
) -> PyResult<String> {
    if !(timeout.is_finite() && timeout > 0.0) {
        return Err(invalid(format!(
            "timeout: {timeout} is not a positive number of seconds"
        )));
    }
    let timeout = Duration::from_secs_f64(timeout);
    let opts = KubeOptions {
        kubeconfig,
        context,
        namespace,
    };
    let need_name = |what: &str| {
        name.clone()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| invalid(format!("kt.datasets.{what}: a name is needed")))
    };
    match op {
        "apply" => {
            let manifests = match (spec, manifest) {
                (Some(spec), None) => {
                    let args: SpecArgs = serde_json::from_str(&spec)
                        .map_err(|e| invalid(format!("kt.datasets.apply: {e}")))?;
                    let spec = args.spec().map_err(to_py)?;
                    vec![datasets::dataset(&need_name("apply")?, spec)]
                }
                (None, Some(yaml)) => datasets::parse_manifests(&yaml).map_err(to_py)?,
                _ => {
                    return Err(invalid(
                        "kt.datasets.apply: give a source (key=, s3=, pvc=) or manifest=",
                    ));
                }
            };
            let want = wait.as_deref().map(phase).transpose()?;
            let out = block(py, async move {
                let api = Datasets::connect(&opts).await?;
                let mut out = Vec::new();
                for ds in &manifests {
                    out.push(api.apply(ds).await?);
                }
                if let Some(want) = want {
                    let mut waited = Vec::new();
                    for ds in &out {
                        let n = ds.metadata.name.clone().unwrap_or_default();
                        waited.push(api.wait(&n, want, timeout).await?);
                    }
                    out = waited;
                }
                Ok(out)
            })?;
            json(&out)
        }
        "get" | "wait" => {
            let n = need_name(op)?;
            let want = match (op, wait.as_deref()) {
                ("wait", None) => Some(Phase::Ready),
                (_, w) => w.map(phase).transpose()?,
            };
            let ds = block(py, async move {
                let api = Datasets::connect(&opts).await?;
                match want {
                    Some(want) => api.wait(&n, want, timeout).await,
                    None => api.get(&n).await,
                }
            })?;
            json(&ds)
        }
        "list" => {
            let all = block(
                py,
                async move { Datasets::connect(&opts).await?.list().await },
            )?;
            json(&all)
        }
        "delete" => {
            let n = need_name("rm")?;
            let until_gone = wait.is_some();
            let existed = block(py, async move {
                let api = Datasets::connect(&opts).await?;
                let existed = api.delete(&n).await?;
                if existed && until_gone {
                    datasets::wait_deleted(&api, &n, timeout).await?;
                }
                Ok(existed)
            })?;
            json(&existed)
        }
        other => Err(invalid(format!("kt.datasets: no operation {other:?}"))),
    }
}
