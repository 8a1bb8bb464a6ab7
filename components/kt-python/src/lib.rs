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
use kt_types::tensor::{Device, MemHandle, Packing, ReduceOp, TensorMeta};
use kt_types::{Key, KeyPrefix, Lifespan, Locale};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

#[cfg(feature = "kube")]
mod datasets;
mod errors;
mod progress;
mod pylog;
mod settings;
mod stream;

use errors::{invalid, to_py};
use settings::Settings;

/// The process's connection to kt: a runtime, the HTTP client, and (once
/// tensors move) the control connections to the pod's agent: one for what
/// the process lends (puts and drops), one for gets. An agent that cannot
/// see the caller's pid ties registrations to their connection, so the
/// lending one is never closed while the process lives: one the agent
/// broke is forgotten, one an interrupted call left is retired. A get
/// lends nothing that outlives it, so an interrupted get's connection is
/// closed: the agent sees its client gone and withdraws the get's quorum
/// join at once (kept open, the join would hold its round for the whole
/// window: the process's next join of the group refused as one it already
/// made, the round closing with a member no call waits for any more).
struct Ctx {
    /// The process that made it: a forked child makes its own (the
    /// runtime's threads and the agent connection are its parent's).
    pid: u32,
    rt: tokio::runtime::Runtime,
    client: Client,
    settings: Settings,
    /// With `kube`: the port-forwards kt is reached through (they end with
    /// the runtime).
    #[cfg(feature = "kube")]
    _external: Option<kt_client::external::External>,
    /// The agent's shared-memory directory, once asked.
    shm_dir: std::sync::OnceLock<PathBuf>,
    tensors: tokio::sync::Mutex<Option<TensorClient>>,
    /// The agent connection gets go through (see [`Via`]).
    gets: tokio::sync::Mutex<Option<TensorClient>>,
    /// Lending connections left by an interrupted tensor call: a reply may
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
        #[cfg(feature = "kube")]
        let external = settings
            .kube
            .as_ref()
            .map(|k| connect_kube(&rt, k, settings.token.is_empty()))
            .transpose()?;
        #[cfg(not(feature = "kube"))]
        if settings.kube.is_some() {
            return Err(invalid(
                "kube: this kt package was built without the `kube` feature",
            ));
        }
        #[cfg(feature = "kube")]
        let (metadata_url, token) = match &external {
            Some(x) => (
                x.metadata_url.clone(),
                x.token.clone().unwrap_or_else(|| settings.token.clone()),
            ),
            None => (settings.metadata_url.clone(), settings.token.clone()),
        };
        #[cfg(not(feature = "kube"))]
        let (metadata_url, token) = (settings.metadata_url.clone(), settings.token.clone());
        let mut cfg = ClientConfig::new(&metadata_url, token);
        // As `kt --kube`: the token is not read again from its file, and
        // no agent serves copies outside the cluster.
        cfg.token_file = settings
            .token_file
            .clone()
            .filter(|_| settings.kube.is_none());
        cfg.serve_copies = settings.kube.is_none();
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
        if let Some(d) = settings.connect {
            cfg.connect_timeout = d.max(std::time::Duration::from_millis(100));
        }
        let client = Client::new(cfg).map_err(to_py)?;
        #[cfg(feature = "kube")]
        let client = match &external {
            Some(x) => client.with_url_map(x.url_map()),
            None => client,
        };
        Ok(Ctx {
            pid: std::process::id(),
            rt,
            client,
            settings,
            #[cfg(feature = "kube")]
            _external: external,
            shm_dir: std::sync::OnceLock::new(),
            tensors: tokio::sync::Mutex::new(None),
            gets: tokio::sync::Mutex::new(None),
            retired: Mutex::new(Vec::new()),
        })
    }

    /// Whether a lending agent connection of this context is (or is being)
    /// open.
    fn may_lend(&self) -> bool {
        !locked(&self.retired).is_empty()
            || self.tensors.try_lock().map_or(true, |conn| conn.is_some())
    }
}

/// Reaches the cluster of `kube` as `kt --kube` does (kt-client's
/// [`kt_client::external::External`]), without the GIL while it connects.
#[cfg(feature = "kube")]
fn connect_kube(
    rt: &tokio::runtime::Runtime,
    kube: &settings::Kube,
    read_token: bool,
) -> PyResult<kt_client::external::External> {
    let opts = kt_client::external::KubeOptions {
        kubeconfig: kube.kubeconfig.clone(),
        context: kube.context.clone(),
        namespace: kube.namespace.clone(),
    };
    Python::attach(|py| {
        py.detach(|| rt.block_on(kt_client::external::External::connect(&opts, read_token)))
    })
    .map_err(|e| errors::unavailable(format!("kube: {e}")))
}

/// What cannot be done from outside the cluster (`kube=True`), as `kt
/// --kube` refuses it: what a pod's agent serves or moves.
fn refuse_outside(c: &Ctx, what: &str) -> PyResult<()> {
    if c.settings.kube.is_some() {
        return Err(invalid(format!(
            "{what} needs this pod's node agent: run it in a pod, not through kube=True"
        )));
    }
    Ok(())
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
    let settings = match locked(&CTX).as_ref() {
        Some(c) if c.pid == std::process::id() => return Ok(c.clone()),
        // Forked: the parent's settings, afresh.
        Some(c) => c.settings.clone(),
        None => Settings::from_env(Default::default())?,
    };
    // Made without the lock: with `kube` it waits for the cluster without
    // the GIL, which another thread waiting for the lock would hold.
    let made = Arc::new(Ctx::new(settings)?);
    let mut slot = locked(&CTX);
    if let Some(c) = slot.as_ref().filter(|c| c.pid == std::process::id()) {
        // Another thread made one meanwhile: ours ends off this thread.
        let c = c.clone();
        drop(std::thread::spawn(move || drop(made)));
        return Ok(c);
    }
    take_for_replacing(&mut slot);
    *slot = Some(made.clone());
    Ok(made)
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
    run_call(py, ctx, &Call::default(), fut)
}

/// A call of the Python API: its name (for the debug log of its timing),
/// its `timeout=` (kt-client bounds the whole call by it,
/// [`Client::with_timeout`], and says which phase ran out) and its
/// `progress=` callable (one that raises aborts the call as Ctrl-C does,
/// and its exception is raised).
#[derive(Default)]
struct Call {
    name: String,
    timeout: Option<Duration>,
    progress: Option<Arc<progress::Callback>>,
    /// The call's trace: every request it makes carries it.
    trace: kt_client::trace::TraceParent,
}

thread_local! {
    /// `verbose=True` on this thread's next call: it says its trace id.
    static ANNOUNCE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `verbose`: the next call made on this thread (the one the Python
/// function that says this is about to make) prints its trace id on
/// stderr, which the servers' log lines and error answers for it carry.
#[pyfunction]
fn announce_trace(verbose: bool) {
    ANNOUNCE.with(|a| a.set(verbose));
}

impl Call {
    fn new(name: String, timeout: Option<f64>, progress: Option<Py<PyAny>>) -> PyResult<Call> {
        let timeout = timeout
            .map(|t| {
                Duration::try_from_secs_f64(t)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| invalid(format!("timeout: seconds > 0, not {t}")))
            })
            .transpose()?;
        let trace = kt_client::trace::TraceParent::new();
        if ANNOUNCE.with(|a| a.replace(false)) {
            eprintln!("kt: {name}: trace id {}", trace.trace_id());
        }
        Ok(Call {
            name,
            timeout,
            progress: progress.map(progress::Callback::new),
            trace,
        })
    }

    /// The client for this call (the context's, with its timeout and the
    /// call's trace).
    fn client(&self, c: &Ctx) -> Client {
        c.client.with_timeout(self.timeout).traced(self.trace)
    }

    /// The sink for kt-client: the callable, else the terminal bar when
    /// `bar`.
    fn sink(&self, bar: bool) -> Progress {
        match &self.progress {
            Some(cb) => cb.progress(),
            None => Progress::terminal_bar(bar),
        }
    }
}

/// [`run`] for a call of the Python API (see [`Call`]).
fn run_call<T: Send + 'static>(
    py: Python<'_>,
    ctx: &Ctx,
    call: &Call,
    fut: impl Future<Output = Result<T, ClientError>> + Send + 'static,
) -> PyResult<T> {
    pylog::refresh(py);
    let started = std::time::Instant::now();
    let mut task = ctx
        .rt
        .spawn(kt_client::trace::operation(&call.name, call.trace, fut));
    let stop = |task: &mut tokio::task::JoinHandle<Result<T, ClientError>>| {
        task.abort();
        // Aborting takes effect at the task's next await.
        let _ = py.detach(|| ctx.rt.block_on(task));
    };
    loop {
        let waited = py.detach(|| {
            ctx.rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(100), &mut task).await
            })
        });
        if let Some(e) = call.progress.as_ref().and_then(|cb| cb.failure()) {
            if !task.is_finished() {
                stop(&mut task);
            }
            return Err(e);
        }
        match waited {
            Ok(Ok(result)) => {
                tracing::debug!(call = %call.name, seconds = started.elapsed().as_secs_f64(), ok = result.is_ok(), "done");
                return result.map_err(to_py);
            }
            Ok(Err(joined)) => {
                return Err(PyRuntimeError::new_err(format!(
                    "kt: the transfer failed: {joined}"
                )));
            }
            Err(_) => {
                if let Err(e) = py.check_signals() {
                    stop(&mut task);
                    return Err(e);
                }
            }
        }
    }
}

/// Sets how this process reaches kt; arguments left out come from the same
/// environment variables as the CLI's (`KT_METADATA_URL`, `KT_TOKEN` or
/// `KT_TOKEN_FILE`, `KT_AGENT_SOCKET`, `KT_STREAMS`, `KT_DEADLINE`,
/// `KT_KUBE` with `KT_KUBE_CONTEXT` and `KT_NAMESPACE`). `kube`: through the
/// Kubernetes API's port-forward, as `kt --kube`. A later call replaces the
/// earlier settings (tensors already lent stay registered through the old
/// agent connection while this process lives).
#[pyfunction]
#[pyo3(signature = (metadata_url=None, token=None, token_file=None, agent_socket=None, streams=None, deadline=None, kube=None, kubeconfig=None, context=None, namespace=None))]
#[allow(clippy::too_many_arguments)]
fn configure(
    metadata_url: Option<String>,
    token: Option<String>,
    token_file: Option<PathBuf>,
    agent_socket: Option<PathBuf>,
    streams: Option<usize>,
    deadline: Option<f64>,
    kube: Option<bool>,
    kubeconfig: Option<PathBuf>,
    context: Option<String>,
    namespace: Option<String>,
) -> PyResult<()> {
    let deadline = deadline
        .map(|d| {
            Duration::try_from_secs_f64(d)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| invalid(format!("deadline: seconds > 0, not {d}")))
        })
        .transpose()?;
    let given = settings::Given {
        metadata_url,
        token,
        token_file,
        agent_socket,
        streams,
        deadline,
        kube,
        kubeconfig,
        context,
        namespace,
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

/// The settings in use (never the token): `(metadata_url, agent_socket,
/// streams, deadline seconds, kube, shm_dir)`; with `kube`, the metadata
/// URL is the port-forward's.
type SettingsTuple = (String, String, usize, f64, bool, String);

#[pyfunction(name = "settings")]
fn current_settings(py: Python<'_>) -> PyResult<SettingsTuple> {
    let c = ctx()?;
    let shm = shm_dir_of(py, &c)?;
    let cfg = c.client.config();
    Ok((
        cfg.metadata_url.clone(),
        c.settings.agent_socket.display().to_string(),
        cfg.streams,
        cfg.deadline.as_secs_f64(),
        c.settings.kube.is_some(),
        shm,
    ))
}

fn parse_key(what: &str, key: &str) -> PyResult<Key> {
    Key::parse(key).map_err(|e| invalid(format!("{what}: {e}")))
}

/// The put's options; `lifespan` `None`: the metadata server's rule decides.
fn put_options(
    lifespan: Option<&str>,
    ttl: Option<&str>,
    service: Option<String>,
) -> PyResult<PutOptions> {
    let lifespan = lifespan
        .map(|l| l.parse::<Lifespan>())
        .transpose()
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

/// What a put of files did, as `kt.PutResult` takes it: `(key, files,
/// bytes_sent, bytes_skipped, unchanged, locale, version, seconds)`.
type PutTuple = (
    String,
    u64,
    u64,
    u64,
    bool,
    &'static str,
    Option<String>,
    f64,
);

/// What a get of files did, as `kt.GetResult` takes it: `(key, dest, files,
/// bytes_sent, bytes_skipped, seconds, group, rank, parents, relayed)`.
type GetTuple = (
    String,
    String,
    u64,
    u64,
    u64,
    f64,
    Option<String>,
    Option<u32>,
    Vec<u32>,
    Option<u64>,
);

fn got(key: &str, s: &kt_client::GetSummary) -> GetTuple {
    (
        key.to_owned(),
        s.dest.display().to_string(),
        s.files,
        s.stats.bytes_sent,
        s.stats.bytes_skipped,
        s.duration.as_secs_f64(),
        None,
        None,
        Vec::new(),
        None,
    )
}

/// Puts the file or tree at `src` under `key`. `bar`: the terminal progress
/// bar; `progress`: a callable (see `progress.rs`), which wins over it.
#[pyfunction]
#[pyo3(signature = (key, src, locale, lifespan=None, ttl=None, service=None, bar=false, progress=None, timeout=None))]
#[allow(clippy::too_many_arguments)]
fn put_path(
    py: Python<'_>,
    key: &str,
    src: PathBuf,
    locale: &str,
    lifespan: Option<&str>,
    ttl: Option<&str>,
    service: Option<String>,
    bar: bool,
    progress: Option<Py<PyAny>>,
    timeout: Option<f64>,
) -> PyResult<PutTuple> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let locale: Locale = locale
        .parse()
        .map_err(|e| invalid(format!("locale: {e}")))?;
    if locale == Locale::Local {
        refuse_outside(
            &c,
            "a locale=\"local\" put (served by this pod's node agent)",
        )?;
    }
    let options = put_options(lifespan, ttl, service)?;
    let call = Call::new(format!("kt.put({:?})", key.as_str()), timeout, progress)?;
    let sink = call.sink(bar);
    let client = call.client(&c);
    let k = key.clone();
    let s = run_call(py, &c, &call, async move {
        match locale {
            Locale::Store => client.put(&k, &src, options, sink).await,
            Locale::Local => client.put_local(&k, &src, options).await,
        }
    })?;
    Ok((
        key.as_str().to_owned(),
        s.files,
        s.stats.bytes_sent,
        s.stats.bytes_skipped,
        s.unchanged,
        match locale {
            Locale::Store => "store",
            Locale::Local => "local",
        },
        s.record.as_ref().map(|r| r.version.clone()),
        s.duration.as_secs_f64(),
    ))
}

/// Gets `key` into `dest`. `broadcast`: join a filesystem broadcast, its
/// window `group_id`, `window_secs` (how long it accepts joins) and
/// `fanout` (none: the group's shape follows the payload's size,
/// `kt_types::broadcast::auto_fanout`).
#[pyfunction]
#[pyo3(signature = (key, dest, delete=false, bar=false, progress=None, timeout=None, broadcast=false, group_id=None, window_secs=None, fanout=None))]
#[allow(clippy::too_many_arguments)]
fn get_path(
    py: Python<'_>,
    key: &str,
    dest: PathBuf,
    delete: bool,
    bar: bool,
    progress: Option<Py<PyAny>>,
    timeout: Option<f64>,
    broadcast: bool,
    group_id: Option<String>,
    window_secs: Option<f64>,
    fanout: Option<u32>,
) -> PyResult<GetTuple> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let call = Call::new(format!("kt.get({:?})", key.as_str()), timeout, progress)?;
    let sink = call.sink(bar);
    let client = call.client(&c);
    let k = key.clone();
    if !broadcast {
        let s = run_call(py, &c, &call, async move {
            client
                .get_with(&k, &dest, &GetOptions { delete }, sink)
                .await
        })?;
        return Ok(got(key.as_str(), &s));
    }
    refuse_outside(
        &c,
        "a broadcast get (its getters serve each other from their pods)",
    )?;
    if fanout == Some(0) {
        return Err(invalid("broadcast.fanout: at least 1, not 0"));
    }
    let window = window_secs
        .map(|t| {
            Duration::try_from_secs_f64(t)
                .map_err(|_| invalid(format!("broadcast.timeout: seconds > 0, not {t}")))
        })
        .transpose()?;
    let options = BroadcastOptions {
        group: group_id,
        fanout,
        window,
        delete,
    };
    let b = run_call(py, &c, &call, async move {
        client.get_broadcast(&k, &dest, &options, sink).await
    })?;
    let mut t = got(key.as_str(), &b.get);
    (t.6, t.7, t.8, t.9) = (Some(b.group), Some(b.rank), b.parents, Some(b.relayed));
    Ok(t)
}

/// Gets every key below `prefix`, each into `dest/<its path below the
/// prefix>`, a few at once.
#[pyfunction]
#[pyo3(signature = (prefix, dest, delete=false, timeout=None))]
fn get_prefix(
    py: Python<'_>,
    prefix: &str,
    dest: PathBuf,
    delete: bool,
    timeout: Option<f64>,
) -> PyResult<Vec<GetTuple>> {
    let c = ctx()?;
    let prefix = KeyPrefix::parse(prefix).map_err(|e| invalid(format!("key: {e}")))?;
    let call = Call::new(format!("kt.get({:?})", format!("{prefix}/")), timeout, None)?;
    let client = call.client(&c);
    let got_all = run_call(py, &c, &call, async move {
        client
            .get_prefix(&prefix, &dest, &GetOptions { delete })
            .await
    })?;
    Ok(got_all
        .gets
        .iter()
        .map(|(k, s)| got(k.as_str(), s))
        .collect())
}

/// A key's record as `kt.Item` takes it: `(locale, holder, is_dir, size,
/// files, version, lifespan, service, created_ms, updated_ms, expires_ms,
/// tensors)`; `locale` is `store` or the pod holding a zero-copy key, as
/// the reference's `ls` says it ([`kt_types::KeyRecord::locale_label`]).
type RecordTuple = (
    String,
    String,
    bool,
    u64,
    u64,
    String,
    &'static str,
    String,
    u64,
    u64,
    Option<u64>,
    bool,
);

/// A name of a listing: `(name, key, has_children, record)`, the record
/// when the name is a key itself.
type EntryTuple = (String, String, bool, Option<RecordTuple>);

/// The names directly below `prefix`.
#[pyfunction]
#[pyo3(signature = (prefix="", timeout=None))]
fn ls(py: Python<'_>, prefix: &str, timeout: Option<f64>) -> PyResult<Vec<EntryTuple>> {
    let c = ctx()?;
    let call = Call::new(format!("kt.ls({prefix:?})"), timeout, None)?;
    let prefix = KeyPrefix::parse(prefix).map_err(|e| invalid(format!("prefix: {e}")))?;
    let client = call.client(&c);
    let list = run_call(py, &c, &call, async move { client.ls(&prefix).await })?;
    Ok(list
        .entries
        .into_iter()
        .map(|e| {
            let record = e.record.map(|r| {
                (
                    r.locale_label(),
                    r.holder,
                    r.is_dir,
                    r.size,
                    r.files,
                    r.version,
                    match r.lifespan {
                        Lifespan::Cluster => "cluster",
                        Lifespan::Resource => "resource",
                    },
                    r.service,
                    r.created_at_ms,
                    r.updated_at_ms,
                    r.expires_at_ms,
                    r.tensors.is_some(),
                )
            });
            (e.name, e.key, e.has_children, record)
        })
        .collect())
}

/// Deletes `key` (with `recursive`, everything below it too); the keys
/// deleted.
#[pyfunction]
#[pyo3(signature = (key, recursive=false, timeout=None))]
fn rm(py: Python<'_>, key: &str, recursive: bool, timeout: Option<f64>) -> PyResult<Vec<String>> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let call = Call::new(format!("kt.rm({:?})", key.as_str()), timeout, None)?;
    let client = call.client(&c);
    let r = run_call(
        py,
        &c,
        &call,
        async move { client.rm(&key, recursive).await },
    )?;
    Ok(r.deleted.iter().map(|k| k.to_string()).collect())
}

/// Tears `service` down: its `resource` keys go and its pods stop being
/// sources. What went: `(deleted keys, evicted agents)`.
#[pyfunction]
#[pyo3(signature = (service, timeout=None))]
fn teardown(
    py: Python<'_>,
    service: &str,
    timeout: Option<f64>,
) -> PyResult<(Vec<String>, Vec<String>)> {
    let c = ctx()?;
    if service.trim().is_empty() {
        return Err(invalid("service: empty"));
    }
    let call = Call::new(format!("kt.teardown({service:?})"), timeout, None)?;
    let client = call.client(&c);
    let s = service.to_owned();
    let r = run_call(py, &c, &call, async move { client.teardown(&s).await })?;
    Ok((
        r.deleted.iter().map(|k| k.to_string()).collect(),
        r.evicted.clone(),
    ))
}

/// Whether this process reaches kt from outside the cluster (`kube`).
#[pyfunction]
fn outside() -> PyResult<bool> {
    Ok(ctx()?.settings.kube.is_some())
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
        member: None,
    })
}

/// Which of the process's agent connections a call goes through ([`Ctx`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// Puts and drops: what goes through it stays registered while the
    /// process lives, so it is retired, not closed, when a call is
    /// interrupted.
    Lending,
    /// Gets: closed when a call is interrupted, which withdraws its
    /// quorum join.
    Getting,
}

/// The agent connection while a call uses it. Dropped before the call
/// ends (the call was interrupted), the connection may still owe that
/// call's reply, so it leaves the slot before the lock is let go (the next
/// call opens another): retired when `retired` is given, else closed.
struct InUse<'a> {
    conn: tokio::sync::MutexGuard<'a, Option<TensorClient>>,
    retired: Option<&'a Mutex<Vec<TensorClient>>>,
    done: bool,
}

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let conn = self.conn.take();
        if let (Some(conn), Some(retired)) = (conn, self.retired) {
            locked(retired).push(conn);
        }
        // Else it is closed here: the agent sees its client gone.
    }
}

/// Runs `call` on this process's agent connection `via`, made on first
/// use. A connection the agent broke (it restarted, say) is forgotten, so
/// that the next call connects again.
async fn on_agent<T>(
    ctx: &Ctx,
    via: Via,
    call: impl AsyncFnOnce(&mut TensorClient) -> Result<T, ClientError>,
) -> Result<T, ClientError> {
    let (slot, retired) = match via {
        Via::Lending => (&ctx.tensors, Some(&ctx.retired)),
        Via::Getting => (&ctx.gets, None),
    };
    let mut conn = slot.lock().await;
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
        retired,
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
    // Which putter (rank, pod, process) each received set came from.
    let sources = PyList::empty(py);
    for src in &s.sources {
        let e = PyDict::new(py);
        e.set_item("key", src.key.as_str())?;
        e.set_item("rank", src.rank)?;
        e.set_item("agent", &src.agent)?;
        e.set_item("member", &src.member)?;
        sources.append(e)?;
    }
    d.set_item("sources", sources)?;
    Ok(d)
}

/// Lends `tensors` to this pod's agent under `key`: registered while this
/// process lives (with a broadcast: answered when the transfer is over).
#[pyfunction]
#[pyo3(signature = (key, tensors, lifespan=None, ttl=None, service=None, broadcast=None))]
fn put_tensors<'py>(
    py: Python<'py>,
    key: &str,
    tensors: Vec<Described>,
    lifespan: Option<&str>,
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
        on_agent(&c2, Via::Lending, async |client| {
            if single {
                client.put_tensor(&k, &lent[0].1, &opts).await
            } else {
                let sd: StateDict<Borrowed> = lent.into_iter().collect();
                client.put_state_dict(&k, &sd, &opts).await
            }
        })
        .await
    });
    let put = match put {
        Ok(p) => p,
        Err(e) => {
            if broadcast.is_some() {
                withdraw_put(py, &c, &key);
            }
            return Err(e);
        }
    };
    let d = PyDict::new(py);
    d.set_item("key", put.key.as_str())?;
    d.set_item("version", &put.version)?;
    d.set_item("tensors", tensors.len())?;
    if let Some(s) = &put.stats {
        d.set_item("stats", stats_dict(py, s)?)?;
    }
    Ok(d)
}

/// After a broadcast put that failed or was interrupted (Ctrl-C, a
/// `timeout=`): its quorum join may still wait at the agent, because the
/// lending connection stays open for what the process lent (see [`Ctx`]),
/// so the agent is told to withdraw it, on the gets' connection. Best
/// effort, for at most 5 s: an agent that cannot see the caller's pid, or
/// predates `WithdrawPut`, keeps the join for its window.
fn withdraw_put(py: Python<'_>, ctx: &Arc<Ctx>, key: &Key) {
    let (c, k) = (ctx.clone(), key.clone());
    let withdrawn = py.detach(|| {
        // The timeout is made inside the runtime: its timer needs one.
        ctx.rt.block_on(async move {
            let withdraw = on_agent(&c, Via::Getting, async |client| {
                client.withdraw_put(&k).await
            });
            tokio::time::timeout(Duration::from_secs(5), withdraw).await
        })
    });
    match withdrawn {
        Ok(Ok(joins)) => tracing::debug!(%key, joins, "interrupted broadcast put withdrawn"),
        Ok(Err(e)) => {
            tracing::debug!(%key, error = %e, "could not withdraw an interrupted broadcast put")
        }
        Err(_) => tracing::debug!(%key, "the agent did not answer the withdrawal within 5 s"),
    }
}

/// Receives `key` into `tensors` (same names, order, dtypes and shapes),
/// through this pod's agent, in place.
///
/// A key several putters put in a quorum (`broadcast` needed): `reduce`
/// (`"sum"` or `"mean"`) receives their reduction into `tensors`; `many`
/// receives each putter's into its own destination, `tensors` then being
/// `(rank, described)` pairs (`_tensors.lend_many`): `"list"`, one set per
/// putter in putter-rank order (the rank is the list index), or
/// `"by_rank"`, the sets of those putter ranks.
#[pyfunction]
#[pyo3(signature = (key, tensors, broadcast=None, packed=None, keep_mapped=false, reduce=None, many=None))]
#[allow(clippy::too_many_arguments)]
fn get_tensors<'py>(
    py: Python<'py>,
    key: &str,
    tensors: &Bound<'py, PyAny>,
    broadcast: Option<&str>,
    packed: Option<bool>,
    keep_mapped: bool,
    reduce: Option<&str>,
    many: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let mut opts = tensor_options(PutOptions::default(), broadcast, packed)?;
    opts.keep_mapped = keep_mapped;
    let reduce: Option<ReduceOp> = reduce
        .map(|r| {
            r.parse()
                .map_err(|e: String| invalid(format!("reduce: {e}")))
        })
        .transpose()?;
    let dest = match many {
        None => {
            let lent = described_set(&tensors.extract::<Vec<Described>>()?)?;
            match reduce {
                Some(op) => Dest::Reduced(op, lent.into_iter().collect()),
                None => Dest::One(lent),
            }
        }
        Some(m @ ("list" | "by_rank")) => {
            if reduce.is_some() {
                return Err(invalid(
                    "reduce: a reduction goes into one destination, not a list or dict of them",
                ));
            }
            let sets = described_sets(&tensors.extract::<Vec<(u32, Described)>>()?)?;
            if m == "list" {
                Dest::All(sets.into_iter().map(|(_, sd)| sd).collect())
            } else {
                Dest::ByRank(sets)
            }
        }
        Some(other) => {
            return Err(invalid(format!(
                "many: {other:?} is not one of \"list\", \"by_rank\""
            )));
        }
    };
    let c2 = c.clone();
    let stats = run(py, &c, async move {
        on_agent(&c2, Via::Getting, async |client| match dest {
            Dest::One(lent) => {
                if lent.len() == 1 && lent[0].0.is_empty() {
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
            }
            Dest::Reduced(op, mut sd) => client.get_reduced(&key, &mut sd, op, &opts).await,
            Dest::All(mut sets) => client.get_all(&key, &mut sets, &opts).await,
            Dest::ByRank(mut sets) => client.get_by_rank(&key, &mut sets, &opts).await,
        })
        .await
    })?;
    stats_dict(py, &stats)
}

/// Where a get of tensors goes.
enum Dest {
    /// One set from the key's one putter.
    One(Vec<(String, Borrowed)>),
    /// The reduction of every putter's.
    Reduced(ReduceOp, StateDict<Borrowed>),
    /// Every putter's, in putter-rank order.
    All(Vec<StateDict<Borrowed>>),
    /// Those of these putter ranks.
    ByRank(Vec<(u32, StateDict<Borrowed>)>),
}

fn described_set(d: &[Described]) -> PyResult<Vec<(String, Borrowed)>> {
    d.iter().map(borrowed).collect()
}

/// `(rank, described)` entries grouped into one set per rank, in the order
/// the ranks first appear (`_tensors.lend_many` lists each set's entries
/// together).
fn described_sets(d: &[(u32, Described)]) -> PyResult<Vec<(u32, StateDict<Borrowed>)>> {
    let mut sets: Vec<(u32, StateDict<Borrowed>)> = Vec::new();
    for (rank, entry) in d {
        let (name, b) = borrowed(entry)?;
        match sets.last_mut() {
            Some((r, sd)) if r == rank => sd.push(name, b),
            _ => {
                if sets.iter().any(|(r, _)| r == rank) {
                    return Err(invalid(format!(
                        "dest: the entries of rank {rank} are not listed together"
                    )));
                }
                let mut sd = StateDict::new();
                sd.push(name, b);
                sets.push((*rank, sd));
            }
        }
    }
    if sets.is_empty() {
        return Err(invalid("dest: no destination (one per putter)"));
    }
    Ok(sets)
}

/// Drops this process's registration of `key` (and the key).
#[pyfunction]
fn drop_tensors(py: Python<'_>, key: &str) -> PyResult<()> {
    let c = ctx()?;
    let key = parse_key("key", key)?;
    let c2 = c.clone();
    run(py, &c, async move {
        on_agent(&c2, Via::Lending, async |client| {
            client.drop_tensors(&key).await
        })
        .await
    })
}

/// The shared-memory directory the agent maps CPU tensors from: the one
/// its hello names, asked once per settings; where no agent listens (or
/// with `kube`), `KT_SHM_DIR` (default `/dev/shm`), asked again next time.
fn shm_dir_of(py: Python<'_>, c: &Ctx) -> PyResult<String> {
    if let Some(dir) = c.shm_dir.get() {
        return Ok(dir.display().to_string());
    }
    let asked = if c.settings.kube.is_some() {
        None
    } else {
        let socket = c.settings.agent_socket.clone();
        run(py, c, async move {
            kt_client::agent::shared_memory_dir(&socket).await
        })?
    };
    Ok(match asked {
        Some(dir) => c.shm_dir.get_or_init(|| dir).display().to_string(),
        None => kt_tensor::shm::shm_dir().display().to_string(),
    })
}

/// The shared-memory directory the agent maps CPU tensors from (see
/// `shm_dir_of`).
#[pyfunction]
fn shm_dir(py: Python<'_>) -> PyResult<String> {
    let c = ctx()?;
    shm_dir_of(py, &c)
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
    pylog::install();
    m.add_function(wrap_pyfunction!(configure, m)?)?;
    m.add_function(wrap_pyfunction!(announce_trace, m)?)?;
    m.add_function(wrap_pyfunction!(current_settings, m)?)?;
    m.add_function(wrap_pyfunction!(put_path, m)?)?;
    m.add_function(wrap_pyfunction!(get_path, m)?)?;
    m.add_function(wrap_pyfunction!(get_prefix, m)?)?;
    m.add_function(wrap_pyfunction!(outside, m)?)?;
    m.add_function(wrap_pyfunction!(ls, m)?)?;
    m.add_function(wrap_pyfunction!(rm, m)?)?;
    #[cfg(feature = "kube")]
    m.add_function(wrap_pyfunction!(datasets::datasets_call, m)?)?;
    m.add_function(wrap_pyfunction!(teardown, m)?)?;
    m.add_function(wrap_pyfunction!(put_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(get_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(drop_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(shm_dir, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_class::<stream::PyShareStream>()?;
    m.add_function(wrap_pyfunction!(stream::get_share, m)?)?;
    m.add("CONTROL_VERSION", kt_types::agent::CONTROL_VERSION)?;
    Ok(())
}
