//! `kt._kt`: the native half of kt's Python package. The package's Python
//! half (`python/kt`) checks the caller's arguments and lends memory; every
//! protocol — the metadata server's API, the sync protocol, broadcasts, the
//! node agent's control socket — is kt-client's, called from here.
//!
//! Every call releases the GIL while it waits (other threads run) and looks
//! for signals ten times a second: Ctrl-C aborts the transfer (files land
//! whole or not at all) and raises `KeyboardInterrupt`.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kt_client::broadcast::BroadcastOptions;
use kt_client::tensor::{Borrowed, StateDict, TensorClient, TensorOptions};
use kt_client::{Client, ClientConfig, ClientError, GetOptions, Progress};
use kt_types::api::PutOptions;
use kt_types::tensor::{Device, MemHandle, Packing, TensorMeta};
use kt_types::{Key, KeyPrefix, Lifespan, Locale};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

mod errors;
mod settings;

use errors::{invalid, to_py};
use settings::Settings;

/// The process's connection to kt: a runtime, the HTTP client, and (once
/// tensors move) the control connection to the pod's agent. An agent that
/// cannot see the caller's pid ties registrations to their connection, so
/// a connection is never closed while the process lives: one the agent
/// broke is forgotten, one an interrupted call left is retired.
struct Ctx {
    /// The process that made it: a forked child makes its own (the
    /// runtime's threads and the agent connection are its parent's).
    pid: u32,
    rt: tokio::runtime::Runtime,
    client: Client,
    settings: Settings,
    tensors: tokio::sync::Mutex<Option<TensorClient>>,
    /// Agent connections left by an interrupted tensor call: a reply may
    /// still be on its way, so they take no more requests, but they stay
    /// open so that what this process lent through them stays registered.
    retired: Mutex<Vec<TensorClient>>,
}

static CTX: Mutex<Option<Arc<Ctx>>> = Mutex::new(None);

/// Contexts `configure` replaced that may still lend tensors.
static REPLACED: Mutex<Vec<Arc<Ctx>>> = Mutex::new(Vec::new());

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Ctx {
    fn new(settings: Settings) -> PyResult<Ctx> {
        // As the CLI's: a worker per core.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .thread_name("kt")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("kt: starting its runtime: {e}")))?;
        let mut cfg = ClientConfig::new(&settings.metadata_url, &settings.token);
        cfg.token_file = settings.token_file.clone();
        cfg.agent_socket = settings.agent_socket.clone();
        if let Some(n) = settings.streams {
            cfg.streams = n;
        }
        if let Some(d) = settings.deadline {
            cfg.deadline = d;
        }
        if let Some(d) = settings.stall {
            cfg.stall = d.max(std::time::Duration::from_millis(100));
        }
        let client = Client::new(cfg).map_err(to_py)?;
        Ok(Ctx {
            pid: std::process::id(),
            rt,
            client,
            settings,
            tensors: tokio::sync::Mutex::new(None),
            retired: Mutex::new(Vec::new()),
        })
    }

    /// Whether an agent connection of this context is (or is being) open.
    fn may_lend(&self) -> bool {
        !locked(&self.retired).is_empty()
            || self.tensors.try_lock().map_or(true, |conn| conn.is_some())
    }
}

/// Takes the context out of `slot` for replacing. One a forked child
/// inherited is leaked: its runtime's workers live only in the parent, so
/// dropping it would wait for threads that do not exist here, and its agent
/// connection (and the registrations on it) are the parent's.
fn take_for_replacing(slot: &mut Option<Arc<Ctx>>) -> Option<Arc<Ctx>> {
    let old = slot.take()?;
    if old.pid == std::process::id() {
        Some(old)
    } else {
        std::mem::forget(old);
        None
    }
}

/// The process's context, made from the environment on first use (and
/// afresh in a forked child).
fn ctx() -> PyResult<Arc<Ctx>> {
    let mut slot = locked(&CTX);
    let settings = match slot.as_ref() {
        Some(c) if c.pid == std::process::id() => return Ok(c.clone()),
        // Forked: the parent's settings, afresh.
        Some(c) => c.settings.clone(),
        None => Settings::from_env(Default::default())?,
    };
    take_for_replacing(&mut slot);
    let c = Arc::new(Ctx::new(settings)?);
    *slot = Some(c.clone());
    Ok(c)
}

/// Runs `fut` on kt's runtime without the GIL, looking for signals every
/// 100 ms; a signal's exception (Ctrl-C) aborts the transfer and returns
/// once its tasks have stopped and dropped what they held (a chunk write
/// already under way on a blocking thread finishes, and removes its
/// partial file, just after).
fn run<T: Send + 'static>(
    py: Python<'_>,
    ctx: &Ctx,
    fut: impl Future<Output = Result<T, ClientError>> + Send + 'static,
) -> PyResult<T> {
    let mut task = ctx.rt.spawn(fut);
    loop {
        let waited = py.detach(|| {
            ctx.rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(100), &mut task).await
            })
        });
        match waited {
            Ok(Ok(result)) => return result.map_err(to_py),
            Ok(Err(joined)) => {
                return Err(PyRuntimeError::new_err(format!(
                    "kt: the transfer failed: {joined}"
                )));
            }
            Err(_) => {
                if let Err(e) = py.check_signals() {
                    task.abort();
                    // Aborting takes effect at the task's next await.
                    let _ = py.detach(|| ctx.rt.block_on(&mut task));
                    return Err(e);
                }
            }
        }
    }
}

/// Sets how this process reaches kt; arguments left out come from the same
/// environment variables as the CLI's (`KT_METADATA_URL`, `KT_TOKEN` or
/// `KT_TOKEN_FILE`, `KT_AGENT_SOCKET`, `KT_STREAMS`). A later call
/// replaces the earlier settings (tensors already lent stay registered
/// through the old agent connection while this process lives).
#[pyfunction]
#[pyo3(signature = (metadata_url=None, token=None, token_file=None, agent_socket=None, streams=None))]
fn configure(
    metadata_url: Option<String>,
    token: Option<String>,
    token_file: Option<PathBuf>,
    agent_socket: Option<PathBuf>,
    streams: Option<usize>,
) -> PyResult<()> {
    let given = settings::Given {
        metadata_url,
        token,
        token_file,
        agent_socket,
        streams,
    };
    let c = Arc::new(Ctx::new(Settings::from_env(given)?)?);
    let old = {
        let mut slot = locked(&CTX);
        let old = take_for_replacing(&mut slot);
        *slot = Some(c);
        old
    };
    match old {
        // Its agent connections keep what this process lent registered
        // (an agent that cannot see the process's pid ties registrations
        // to the connection): kept open while the process lives.
        Some(old) if old.may_lend() => locked(&REPLACED).push(old),
        // The old runtime ends off this thread: dropping it here would
        // block on its workers while the caller holds the GIL.
        Some(old) => drop(std::thread::spawn(move || drop(old))),
        None => {}
    }
    Ok(())
}

/// The settings in use: metadata URL, agent socket, streams, shared-memory
/// directory (never the token).
#[pyfunction(name = "settings")]
fn current_settings(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = ctx()?;
    let d = PyDict::new(py);
    d.set_item("metadata_url", &c.settings.metadata_url)?;
    d.set_item(
        "agent_socket",
        c.settings.agent_socket.display().to_string(),
    )?;
    d.set_item("streams", c.client.config().streams)?;
    d.set_item("shm_dir", shm_dir())?;
    Ok(d)
}

fn parse_key(what: &str, key: &str) -> PyResult<Key> {
    Key::parse(key).map_err(|e| invalid(format!("{what}: {e}")))
}

fn put_options(lifespan: &str, ttl: Option<&str>, service: Option<String>) -> PyResult<PutOptions> {
    let lifespan: Lifespan = lifespan
        .parse()
        .map_err(|e| invalid(format!("lifespan: {e}")))?;
    let ttl_secs = ttl
        .map(|t| {
            humantime::parse_duration(t)
                .map(|d| d.as_secs().max(1))
                .map_err(|e| invalid(format!("ttl: {t:?}: {e}")))
        })
        .transpose()?;
    Ok(PutOptions {
        lifespan,
        ttl_secs,
        service,
    })
}

fn transfer_dict<'py>(
    py: Python<'py>,
    key: &str,
    files: u64,
    stats: &kt_types::api::TransferStats,
    seconds: f64,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("key", key)?;
    d.set_item("files", files)?;
    d.set_item("bytes_sent", stats.bytes_sent)?;
    d.set_item("bytes_skipped", stats.bytes_skipped)?;
    d.set_item("files_sent", stats.files_sent)?;
    d.set_item("seconds", seconds)?;
    Ok(d)
}

/// What a get of files did, with where it landed.
fn got_dict<'py>(
    py: Python<'py>,
    key: &str,
    s: &kt_client::GetSummary,
) -> PyResult<Bound<'py, PyDict>> {
    let d = transfer_dict(py, key, s.files, &s.stats, s.duration.as_secs_f64())?;
    d.set_item("dest", s.dest.display().to_string())?;
    Ok(d)
}

/// Puts the file or tree at `src` under `key`.
#[pyfunction]
#[pyo3(signature = (key, src, locale, lifespan, ttl=None, service=None, progress=false))]
#[allow(clippy::too_many_arguments)]
fn put_path<'py>(
    py: Python<'py>,
    key: &str,
    src: PathBuf,
    locale: &str,
    lifespan: &str,
    ttl: Option<&str>,
    service: Option<String>,
    progress: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let locale: Locale = locale
        .parse()
        .map_err(|e| invalid(format!("locale: {e}")))?;
    let options = put_options(lifespan, ttl, service)?;
    let client = c.client.clone();
    let k = key.clone();
    let s = run(py, &c, async move {
        match locale {
            Locale::Store => {
                client
                    .put(&k, &src, options, Progress::terminal_bar(progress))
                    .await
            }
            Locale::Local => client.put_local(&k, &src, options).await,
        }
    })?;
    let d = transfer_dict(
        py,
        key.as_str(),
        s.files,
        &s.stats,
        s.duration.as_secs_f64(),
    )?;
    d.set_item("unchanged", s.unchanged)?;
    d.set_item(
        "locale",
        match locale {
            Locale::Store => "store",
            Locale::Local => "local",
        },
    )?;
    d.set_item("version", s.record.as_ref().map(|r| r.version.clone()))?;
    Ok(d)
}

/// What a filesystem broadcast takes of a window's JSON: no fanout lets the
/// group's shape follow the payload's size (`kt_types::broadcast::auto_fanout`).
#[derive(Debug, serde::Deserialize)]
struct FileWindow {
    group_id: Option<String>,
    timeout_secs: Option<f64>,
    fanout: Option<u32>,
}

/// Gets `key` into `dest`; a `key` ending in `/` gets every key below it,
/// each into `dest/<its path below the prefix>` (a list of results).
/// `broadcast`: the JSON of a window (group_id, timeout, fanout) to join a
/// filesystem broadcast.
#[pyfunction]
#[pyo3(signature = (key, dest, delete=false, broadcast=None, progress=false))]
fn get_path<'py>(
    py: Python<'py>,
    key: &str,
    dest: PathBuf,
    delete: bool,
    broadcast: Option<&str>,
    progress: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let c = ctx()?;
    let client = c.client.clone();
    if key.trim().ends_with('/') && !key.trim().trim_matches('/').is_empty() {
        if broadcast.is_some() {
            return Err(invalid(format!(
                "broadcast: a broadcast gets one key, not every key below {key}"
            )));
        }
        let prefix = KeyPrefix::parse(key).map_err(|e| invalid(format!("key: {e}")))?;
        let got = run(py, &c, async move {
            client
                .get_prefix(&prefix, &dest, &GetOptions { delete })
                .await
        })?;
        let out = PyList::empty(py);
        for (k, s) in &got.gets {
            out.append(got_dict(py, k.as_str(), s)?)?;
        }
        return Ok(out.into_any());
    }
    let key = parse_key("key", key)?;
    let k = key.clone();
    let d = match broadcast {
        None => {
            let s = run(py, &c, async move {
                client
                    .get_with(
                        &k,
                        &dest,
                        &GetOptions { delete },
                        Progress::terminal_bar(progress),
                    )
                    .await
            })?;
            got_dict(py, key.as_str(), &s)?
        }
        Some(json) => {
            let w: FileWindow =
                serde_json::from_str(json).map_err(|e| invalid(format!("broadcast: {e}")))?;
            if w.fanout == Some(0) {
                return Err(invalid("broadcast.fanout: at least 1, not 0".to_owned()));
            }
            let options = BroadcastOptions {
                group: w.group_id.clone(),
                fanout: w.fanout,
                window: w.timeout_secs.map(Duration::from_secs_f64),
                delete,
            };
            let b = run(py, &c, async move {
                client
                    .get_broadcast(&k, &dest, &options, Progress::terminal_bar(progress))
                    .await
            })?;
            let d = got_dict(py, key.as_str(), &b.get)?;
            d.set_item("group", &b.group)?;
            d.set_item("rank", b.rank)?;
            d.set_item("parents", b.parents.clone())?;
            d.set_item("relayed", b.relayed)?;
            d
        }
    };
    Ok(d.into_any())
}

/// The names directly below `prefix`, each a dict (name, key,
/// has_children, and the key's record as JSON when it is a key).
#[pyfunction]
#[pyo3(signature = (prefix=""))]
fn ls<'py>(py: Python<'py>, prefix: &str) -> PyResult<Bound<'py, PyList>> {
    let c = ctx()?;
    let prefix = KeyPrefix::parse(prefix).map_err(|e| invalid(format!("prefix: {e}")))?;
    let client = c.client.clone();
    let list = run(py, &c, async move { client.ls(&prefix).await })?;
    let out = PyList::empty(py);
    for e in list.entries {
        let d = PyDict::new(py);
        d.set_item("name", &e.name)?;
        d.set_item("key", &e.key)?;
        d.set_item("has_children", e.has_children)?;
        let record = e
            .record
            .as_ref()
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        d.set_item("record", record)?;
        out.append(d)?;
    }
    Ok(out)
}

/// Deletes `key` (with `recursive`, everything below it too); the keys
/// deleted.
#[pyfunction]
#[pyo3(signature = (key, recursive=false))]
fn rm(py: Python<'_>, key: &str, recursive: bool) -> PyResult<Vec<String>> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let client = c.client.clone();
    let r = run(py, &c, async move { client.rm(&key, recursive).await })?;
    Ok(r.deleted.iter().map(|k| k.to_string()).collect())
}

/// Tears `service` down: its `resource` keys go and its pods stop being
/// sources. What went: `{"deleted": [...], "evicted": [...]}`.
#[pyfunction]
fn teardown<'py>(py: Python<'py>, service: &str) -> PyResult<Bound<'py, PyDict>> {
    let c = ctx()?;
    if service.trim().is_empty() {
        return Err(invalid("service: empty"));
    }
    let client = c.client.clone();
    let s = service.to_owned();
    let r = run(py, &c, async move { client.teardown(&s).await })?;
    let d = PyDict::new(py);
    d.set_item(
        "deleted",
        r.deleted.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
    )?;
    d.set_item("evicted", r.evicted.clone())?;
    Ok(d)
}

/// One tensor as the Python half describes it: `(name, dtype, shape,
/// device, memory)`, memory being `("shm", path, offset, len)` (a
/// shared-memory file the caller keeps alive) or `("cuda", ptr)` (device
/// memory of this process at `ptr` on the device).
type Described = (String, String, Vec<u64>, String, (String, Vec<String>));

fn borrowed(d: &Described) -> PyResult<(String, Borrowed)> {
    let (name, dtype, shape, device, (kind, args)) = d;
    let what = if name.is_empty() {
        "the tensor".to_owned()
    } else {
        format!("tensor {name:?}")
    };
    let dtype = dtype.parse().map_err(|e| invalid(format!("{what}: {e}")))?;
    let meta = TensorMeta::new(dtype, shape.clone());
    let device: Device = device
        .parse()
        .map_err(|e| invalid(format!("{what}: {e}")))?;
    let num = |i: usize| -> PyResult<u64> {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| invalid(format!("{what}: memory argument {i} of {kind:?}")))
    };
    let b = match (kind.as_str(), device) {
        ("shm", Device::Cpu) => {
            let path = args
                .first()
                .cloned()
                .ok_or_else(|| invalid(format!("{what}: no shared-memory path")))?;
            Borrowed::new(
                meta,
                device,
                MemHandle::Shm {
                    path,
                    offset: num(1)?,
                    len: num(2)?,
                },
            )
        }
        #[cfg(feature = "cuda")]
        ("cuda", Device::Cuda(ordinal)) => Borrowed::cuda(meta, ordinal, num(0)?),
        _ => {
            return Err(invalid(format!(
                "{what}: {kind} memory on {device} is not something kt can lend"
            )));
        }
    }
    .map_err(to_py)?;
    Ok((name.clone(), b))
}

fn tensor_options(
    put: PutOptions,
    broadcast: Option<&str>,
    packed: Option<bool>,
) -> PyResult<TensorOptions> {
    let broadcast = broadcast
        .map(|json| {
            serde_json::from_str::<kt_types::BroadcastWindow>(json)
                .map_err(|e| invalid(format!("broadcast: {e}")))
        })
        .transpose()?;
    Ok(TensorOptions {
        put,
        broadcast,
        packing: packed.map(|pack| Packing {
            pack,
            ..Packing::default()
        }),
        keep_mapped: false,
    })
}

/// The agent connection while a call uses it. Dropped before the call
/// ends (the call was interrupted), the connection may still owe that
/// call's reply, so it is retired before the lock is let go: the next call
/// opens another.
struct InUse<'a> {
    conn: tokio::sync::MutexGuard<'a, Option<TensorClient>>,
    retired: &'a Mutex<Vec<TensorClient>>,
    done: bool,
}

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        if !self.done
            && let Some(conn) = self.conn.take()
        {
            locked(self.retired).push(conn);
        }
    }
}

/// Runs `call` on this process's agent connection, made on first use. A
/// connection the agent broke (it restarted, say) is forgotten, so that the
/// next call connects again.
async fn on_agent<T>(
    ctx: &Ctx,
    call: impl AsyncFnOnce(&mut TensorClient) -> Result<T, ClientError>,
) -> Result<T, ClientError> {
    let mut conn = ctx.tensors.lock().await;
    if conn.is_none() {
        *conn = Some(
            TensorClient::connect(
                &ctx.settings.agent_socket,
                &ctx.settings.metadata_url,
                &ctx.settings.token,
            )
            .await?,
        );
    }
    let mut in_use = InUse {
        conn,
        retired: &ctx.retired,
        done: false,
    };
    let client = in_use
        .conn
        .as_mut()
        .ok_or_else(|| ClientError::Agent("no connection to the node agent".into()))?;
    let r = call(client).await;
    in_use.done = true;
    if matches!(r, Err(ClientError::Agent(_))) {
        *in_use.conn = None;
    }
    r
}

fn stats_dict<'py>(
    py: Python<'py>,
    s: &kt_types::tensor::TensorStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tensors", s.tensors)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("collectives", s.collectives)?;
    d.set_item("seconds", s.seconds)?;
    d.set_item("backend", s.backend.map(|b| b.to_string()))?;
    d.set_item("rank", s.rank)?;
    d.set_item("world", s.world)?;
    Ok(d)
}

/// Lends `tensors` to this pod's agent under `key`: registered while this
/// process lives (with a broadcast: answered when the transfer is over).
#[pyfunction]
#[pyo3(signature = (key, tensors, lifespan, ttl=None, service=None, broadcast=None))]
fn put_tensors<'py>(
    py: Python<'py>,
    key: &str,
    tensors: Vec<Described>,
    lifespan: &str,
    ttl: Option<&str>,
    service: Option<String>,
    broadcast: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let opts = tensor_options(put_options(lifespan, ttl, service)?, broadcast, None)?;
    let lent: Vec<(String, Borrowed)> = tensors.iter().map(borrowed).collect::<PyResult<_>>()?;
    let single = lent.len() == 1 && lent[0].0.is_empty();
    let c2 = c.clone();
    let k = key.clone();
    let put = run(py, &c, async move {
        on_agent(&c2, async |client| {
            if single {
                client.put_tensor(&k, &lent[0].1, &opts).await
            } else {
                let sd: StateDict<Borrowed> = lent.into_iter().collect();
                client.put_state_dict(&k, &sd, &opts).await
            }
        })
        .await
    })?;
    let d = PyDict::new(py);
    d.set_item("key", put.key.as_str())?;
    d.set_item("version", &put.version)?;
    d.set_item("tensors", tensors.len())?;
    if let Some(s) = &put.stats {
        d.set_item("stats", stats_dict(py, s)?)?;
    }
    Ok(d)
}

/// Receives `key` into `tensors` (same names, order, dtypes and shapes),
/// through this pod's agent, in place.
#[pyfunction]
#[pyo3(signature = (key, tensors, broadcast=None, packed=None, keep_mapped=false))]
fn get_tensors<'py>(
    py: Python<'py>,
    key: &str,
    tensors: Vec<Described>,
    broadcast: Option<&str>,
    packed: Option<bool>,
    keep_mapped: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let mut opts = tensor_options(PutOptions::default(), broadcast, packed)?;
    opts.keep_mapped = keep_mapped;
    let lent: Vec<(String, Borrowed)> = tensors.iter().map(borrowed).collect::<PyResult<_>>()?;
    let single = lent.len() == 1 && lent[0].0.is_empty();
    let c2 = c.clone();
    let stats = run(py, &c, async move {
        on_agent(&c2, async |client| {
            if single {
                let mut t = lent
                    .into_iter()
                    .next()
                    .map(|(_, b)| b)
                    .ok_or_else(|| ClientError::Local("no destination".into()))?;
                client.get_tensor(&key, &mut t, &opts).await
            } else {
                let mut sd: StateDict<Borrowed> = lent.into_iter().collect();
                client.get_state_dict(&key, &mut sd, &opts).await
            }
        })
        .await
    })?;
    stats_dict(py, &stats)
}

/// Drops this process's registration of `key` (and the key).
#[pyfunction]
fn drop_tensors(py: Python<'_>, key: &str) -> PyResult<()> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let c2 = c.clone();
    run(py, &c, async move {
        on_agent(&c2, async |client| client.drop_tensors(&key).await).await
    })
}

/// The shared-memory directory the agent maps CPU tensors from
/// (`KT_SHM_DIR`, default `/dev/shm`).
#[pyfunction]
fn shm_dir() -> String {
    kt_tensor::shm::shm_dir().display().to_string()
}

/// The dtypes kt moves, by kt's name, with their sizes in bytes.
#[pyfunction]
fn dtypes() -> BTreeMap<String, u64> {
    kt_types::tensor::DType::ALL
        .into_iter()
        .map(|d| (d.as_str().to_owned(), d.size()))
        .collect()
}

#[pymodule]
fn _kt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(configure, m)?)?;
    m.add_function(wrap_pyfunction!(current_settings, m)?)?;
    m.add_function(wrap_pyfunction!(put_path, m)?)?;
    m.add_function(wrap_pyfunction!(get_path, m)?)?;
    m.add_function(wrap_pyfunction!(ls, m)?)?;
    m.add_function(wrap_pyfunction!(rm, m)?)?;
    m.add_function(wrap_pyfunction!(teardown, m)?)?;
    m.add_function(wrap_pyfunction!(put_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(get_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(drop_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(shm_dir, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add("CONTROL_VERSION", kt_types::agent::CONTROL_VERSION)?;
    Ok(())
}
