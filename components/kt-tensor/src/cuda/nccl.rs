//! NCCL, loaded at run time, and the communicator of one transfer.
//!
//! NCCL is opened with `libloading` rather than through `cudarc::nccl`:
//! cudarc looks for `libnccl.so` and `libnccl.so.<CUDA major>` only, while
//! NCCL's runtime packages (the `libnccl2` deb/rpm, the `nvidia-nccl-cu12`
//! wheel, most containers) ship `libnccl.so.2` alone. The entry points are
//! declared here from `nccl.h`, with C `int` for its enums so that a code
//! a newer NCCL adds is a number, not undefined behaviour.
//!
//! Communicators are non-blocking (`ncclConfig_t.blocking = 0`, NCCL 2.14
//! or later): initialisation and every collective are polled
//! (`ncclCommGetAsyncError`, then `cuStreamQuery`) against a deadline, and
//! a communicator that fails or runs out of time is aborted
//! (`ncclCommAbort`), so a dead peer costs one transfer an error and never
//! blocks the agent.

#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::mem::ManuallyDrop;
use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUstream;
use libloading::Library;

use super::chain;
use super::driver::{self, DeviceAlloc, Event, Stream, describe};
use crate::hold::Reaper;
use crate::transport::{Comm, Exchange, Region, TransportError, flow_handshake};
use kt_types::tensor::Device;

/// Path of the NCCL library to load instead of searching `libnccl.so.2`
/// and `libnccl.so` (e.g. a Python wheel's
/// `site-packages/nvidia/nccl/lib/libnccl.so.2`).
pub const NCCL_LIBRARY_ENV: &str = kt_types::env::NCCL_LIBRARY;

/// Oldest NCCL with non-blocking communicators (`ncclConfig_t`).
const MIN_VERSION: c_int = 21400;

// ncclResult_t
const SUCCESS: c_int = 0;
const INVALID_ARGUMENT: c_int = 4;
const INVALID_USAGE: c_int = 5;
const IN_PROGRESS: c_int = 7;
// ncclDataType_t
const UINT8: c_int = 1;

type RawComm = *mut c_void;

/// `ncclUniqueId`: what every rank needs to join a communicator.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    internal: [c_char; UNIQUE_ID_BYTES],
}

/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

impl UniqueId {
    #[allow(clippy::unnecessary_cast)]
    pub(crate) fn from_bytes(b: &[u8; UNIQUE_ID_BYTES]) -> UniqueId {
        UniqueId {
            internal: b.map(|x| x as c_char),
        }
    }

    #[allow(clippy::unnecessary_cast)]
    pub(crate) fn to_bytes(self) -> [u8; UNIQUE_ID_BYTES] {
        self.internal.map(|x| x as u8)
    }
}

/// `ncclConfig_t` as NCCL 2.14 defined it. NCCL reads `size` bytes of the
/// struct a caller passes and takes the fields `version` predates from
/// its defaults (`parseCommConfig`), so this prefix is understood by every
/// release since.
#[repr(C)]
pub(crate) struct ConfigV21400 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
}

impl ConfigV21400 {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
    pub(crate) fn non_blocking() -> ConfigV21400 {
        ConfigV21400 {
            size: std::mem::size_of::<ConfigV21400>(),
            magic: 0xcafe_beef,
            version: MIN_VERSION as c_uint,
            blocking: 0,
        }
    }
}

/// The entry points used, resolved once.
struct Api {
    path: String,
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank_config:
        unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut ConfigV21400) -> c_int,
    comm_get_async_error: unsafe extern "C" fn(RawComm, *mut c_int) -> c_int,
    comm_abort: unsafe extern "C" fn(RawComm) -> c_int,
    comm_finalize: unsafe extern "C" fn(RawComm) -> c_int,
    comm_destroy: unsafe extern "C" fn(RawComm) -> c_int,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        CUstream,
    ) -> c_int,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, CUstream) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, CUstream) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_last_error: unsafe extern "C" fn(RawComm) -> *const c_char,
    /// Keeps the entry points above valid; never unloaded (the `Api` lives
    /// in a static).
    _lib: Library,
}

/// `ncclGetVersion`'s code as `major.minor.patch`.
pub(crate) fn version_string(code: c_int) -> String {
    let (major, minor, patch) = if code >= 10000 {
        (code / 10000, (code % 10000) / 100, code % 100)
    } else {
        // Before 2.9: major * 1000 + minor * 100 + patch.
        (code / 1000, (code % 1000) / 100, code % 100)
    };
    format!("{major}.{minor}.{patch}")
}

/// The library names tried: `KT_NCCL_LIBRARY` alone when set.
fn candidates() -> Vec<String> {
    match std::env::var(NCCL_LIBRARY_ENV) {
        Ok(p) if !p.trim().is_empty() => vec![p.trim().to_owned()],
        _ => vec!["libnccl.so.2".into(), "libnccl.so".into()],
    }
}

fn unloadable(why: impl std::fmt::Display) -> String {
    format!(
        "NCCL (libnccl.so.2) could not be loaded: {why}; install NCCL 2.14 or later (libnccl2), or set {NCCL_LIBRARY_ENV} to its path"
    )
}

/// Resolves `name` as a `T`.
///
/// # Safety
/// `T` must be the C signature `name` has in `nccl.h`.
unsafe fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    // SAFETY: the caller vouches for the type; the symbol stays valid while
    // `lib` is loaded, and the `Api` holding both is never dropped.
    unsafe { lib.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| format!("{name} ({})", chain(&e)))
}

/// An error with its sources (libloading says "dlopen failed" and keeps
/// `dlerror`'s message as the source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        next = cause.source();
    }
    s
}

/// Loads the first of `names` that opens and checks it is an NCCL this
/// module can drive.
#[cfg(test)]
pub(crate) fn load_from(names: &[String]) -> Result<(), String> {
    load_api(names).map(|_| ())
}

fn load_api(names: &[String]) -> Result<Api, String> {
    let mut errors = Vec::new();
    for name in names {
        // SAFETY: opening NCCL runs its initialisers, which (as for any
        // framework that dlopens it) have no requirement on the caller.
        match unsafe { Library::new(name) } {
            Ok(lib) => return resolve(lib, name),
            Err(e) => errors.push(format!("{name}: {}", chain(&e))),
        }
    }
    Err(unloadable(errors.join("; ")))
}

fn resolve(lib: Library, path: &str) -> Result<Api, String> {
    let bad = |e: String| unloadable(format!("{path} is not a usable NCCL: missing {e}"));
    // SAFETY: the signature is `ncclResult_t ncclGetVersion(int*)`.
    let get_version: unsafe extern "C" fn(*mut c_int) -> c_int =
        unsafe { sym(&lib, "ncclGetVersion") }.map_err(bad)?;
    let mut version: c_int = 0;
    // SAFETY: `version` is a valid out-pointer.
    let r = unsafe { get_version(&mut version) };
    if r != SUCCESS {
        return Err(unloadable(format!("{path}: ncclGetVersion failed ({r})")));
    }
    if version < MIN_VERSION {
        return Err(unloadable(format!(
            "{path} is NCCL {}; non-blocking communicators need 2.14 or later",
            version_string(version)
        )));
    }
    // SAFETY (each `sym` below): the type is the entry point's signature in
    // nccl.h, with `int` for the enums `ncclResult_t`/`ncclDataType_t`,
    // `void*` for `ncclComm_t` and `CUstream` for `cudaStream_t` (the same
    // handle).
    unsafe {
        Ok(Api {
            path: path.to_owned(),
            version,
            get_unique_id: sym(&lib, "ncclGetUniqueId").map_err(bad)?,
            comm_init_rank_config: sym(&lib, "ncclCommInitRankConfig").map_err(bad)?,
            comm_get_async_error: sym(&lib, "ncclCommGetAsyncError").map_err(bad)?,
            comm_abort: sym(&lib, "ncclCommAbort").map_err(bad)?,
            comm_finalize: sym(&lib, "ncclCommFinalize").map_err(bad)?,
            comm_destroy: sym(&lib, "ncclCommDestroy").map_err(bad)?,
            broadcast: sym(&lib, "ncclBroadcast").map_err(bad)?,
            send: sym(&lib, "ncclSend").map_err(bad)?,
            recv: sym(&lib, "ncclRecv").map_err(bad)?,
            group_start: sym(&lib, "ncclGroupStart").map_err(bad)?,
            group_end: sym(&lib, "ncclGroupEnd").map_err(bad)?,
            get_error_string: sym(&lib, "ncclGetErrorString").map_err(bad)?,
            get_last_error: sym(&lib, "ncclGetLastError").map_err(bad)?,
            _lib: lib,
        })
    }
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

fn api() -> Result<&'static Api, TransportError> {
    API.get_or_init(|| load_api(&candidates()))
        .as_ref()
        .map_err(|e| TransportError::Unsupported(e.clone()))
}

/// Loads NCCL (once per process): its path and version, or why it cannot
/// be used.
pub fn probe_nccl() -> Result<String, String> {
    api()
        .map(|a| format!("NCCL {} ({})", version_string(a.version), a.path))
        .map_err(|e| e.to_string())
}

fn error_string(api: &Api, code: c_int) -> String {
    // SAFETY: ncclGetErrorString returns a static string for any code.
    let p = unsafe { (api.get_error_string)(code) };
    if p.is_null() {
        return format!("NCCL error {code}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A fresh `ncclUniqueId` (starts NCCL's bootstrap root in this process,
/// which the ranks reach while they connect).
pub(crate) fn unique_id() -> Result<UniqueId, TransportError> {
    let api = api()?;
    let mut id = UniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is a valid out-pointer of the right size.
    let r = unsafe { (api.get_unique_id)(&mut id) };
    if r != SUCCESS {
        return Err(TransportError::Peer(format!(
            "ncclGetUniqueId failed: {}",
            error_string(api, r)
        )));
    }
    Ok(id)
}

/// What one rank does in a broadcast within `group`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Part {
    /// Not a member: nothing.
    Skip,
    /// The group is the whole communicator: `ncclBroadcast`.
    Broadcast,
    /// A member of a subset: point-to-point steps down this chain (the
    /// root, then the other members in rank order; see [`chain`]).
    Chain(Vec<u32>),
}

pub(crate) fn part(me: u32, world: u32, root: u32, group: &[u32]) -> Result<Part, TransportError> {
    if let Some(r) = group.iter().chain([&root]).find(|r| **r >= world) {
        return Err(TransportError::Invalid(format!(
            "a broadcast names rank {r}, outside the {world} ranks of the transfer"
        )));
    }
    if !group.contains(&root) {
        return Err(TransportError::Invalid(format!(
            "a broadcast rooted at rank {root} within {group:?}, which lacks it"
        )));
    }
    if !group.contains(&me) {
        return Ok(Part::Skip);
    }
    let mut members: Vec<u32> = group.to_vec();
    members.sort_unstable();
    members.dedup();
    if members.len() == world as usize {
        Ok(Part::Broadcast)
    } else {
        let mut order = vec![root];
        order.extend(members.into_iter().filter(|m| *m != root));
        Ok(Part::Chain(order))
    }
}

/// How many timeouts a member of a flow waits for the others to be done
/// with earlier flows. Fewer than the host backend's
/// ([`crate::host::IDLE_FACTOR`]): a host rank learns at once that a peer
/// failed (its connection closes), an NCCL rank not always (P2P and NVLink
/// say nothing), so this bounds what a failed peer costs the others.
const FLOW_WAIT_FACTOR: u32 = 5;

/// How long an abort is waited for before it is left to finish on its own
/// thread (`ncclCommAbort` can hang on a wedged peer or device).
const ABORT_WAIT: Duration = Duration::from_secs(10);

/// A communicator handed to the thread that aborts it.
struct Aborting(RawComm);

// SAFETY: the communicator is only used by that thread from then on (the
// `NcclComm` forgot it).
unsafe impl Send for Aborting {}

impl Aborting {
    fn raw(&self) -> RawComm {
        self.0
    }
}

/// The NCCL communicator of one transfer, on one GPU.
pub(crate) struct NcclComm {
    api: &'static Api,
    /// Null once aborted or destroyed.
    raw: RawComm,
    /// Kept (never freed) when an abort did not return: NCCL may still use
    /// them.
    stream: ManuallyDrop<Stream>,
    rank: u32,
    world: u32,
    ordinal: u32,
    timeout: Duration,
    transfer: String,
    /// Why the communicator was aborted.
    failed: Option<String>,
    /// The bytes of flow handshakes ([`Comm::begin_flow`]): one receive
    /// slot per rank, then the byte sent. Kept as `stream` is.
    token: ManuallyDrop<DeviceAlloc>,
    /// An abort that had not returned after [`ABORT_WAIT`].
    abandoned: bool,
    /// Told when the abort returns; then drops the stream, the token and
    /// what the transfer handed over ([`Comm::keep_until_stopped`]).
    reaper: Reaper,
    /// The stream and the token went to `reaper` (after an abandoned
    /// abort): not dropped here.
    handed: bool,
    /// One event per chain step that may be in flight
    /// ([`chain::IN_FLIGHT`]), made on first use.
    steps_done: Vec<Event>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a
// time; `Comm` methods take `&mut self`, so calls never overlap, and every
// call binds the communicator's CUDA context first.
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("transfer", &self.transfer)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.ordinal)
            .field("failed", &self.failed)
            .finish()
    }
}

/// Waits between polls: spins (yielding) for the first milliseconds, as a
/// collective usually ends within them, then sleeps a little longer each
/// time, up to 200 µs.
struct Backoff {
    started: Instant,
    pause: Duration,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff {
            started: Instant::now(),
            pause: Duration::from_micros(10),
        }
    }

    fn wait(&mut self) {
        if self.started.elapsed() < Duration::from_millis(5) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.pause);
            self.pause = (self.pause * 2).min(Duration::from_micros(200));
        }
    }
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world` on `cuda:{ordinal}`;
    /// gives up (and aborts) after `timeout`.
    pub(crate) fn init(
        transfer: &str,
        ordinal: u32,
        world: u32,
        rank: u32,
        id: &UniqueId,
        timeout: Duration,
    ) -> Result<NcclComm, TransportError> {
        let api = api()?;
        let ctx = driver::context(ordinal)?;
        // Binds the context too: NCCL takes the calling thread's device.
        let stream = Stream::new(&ctx)?;
        let token = DeviceAlloc::new(ordinal, u64::from(world) + 1)?;
        let mut config = ConfigV21400::non_blocking();
        let mut raw: RawComm = std::ptr::null_mut();
        let deadline = Instant::now() + timeout;
        // SAFETY: `raw` and `config` are valid for the call (NCCL copies the
        // config before returning); `id` is passed by value; world and rank
        // were checked by the caller (NCCL checks them again).
        let r = unsafe {
            (api.comm_init_rank_config)(&mut raw, world as c_int, *id, rank as c_int, &mut config)
        };
        let mut comm = NcclComm {
            api,
            raw,
            stream: ManuallyDrop::new(stream),
            rank,
            world,
            ordinal,
            timeout,
            transfer: transfer.to_owned(),
            failed: None,
            token: ManuallyDrop::new(token),
            abandoned: false,
            reaper: Reaper::default(),
            handed: false,
            steps_done: Vec::new(),
        };
        let what = format!(
            "joining the NCCL communicator of transfer {transfer} as rank {rank} of {world} on cuda:{ordinal}"
        );
        if r != SUCCESS && r != IN_PROGRESS {
            return Err(comm.fail(&what, r));
        }
        comm.wait(deadline, &what, Until::Posted)
            .map_err(|e| match e {
                TransportError::Timeout(_) => TransportError::Timeout(format!(
                    "{what}: not connected after {timeout:?} (did every rank join?); aborted"
                )),
                e => e,
            })?;
        Ok(comm)
    }

    /// `ncclGetLastError` of the communicator, if it says anything.
    fn last_error(&self) -> Option<String> {
        if self.raw.is_null() {
            return None;
        }
        // SAFETY: `raw` is a live communicator; the string NCCL returns is
        // NUL-terminated and valid until its next call on it.
        let p = unsafe { (self.api.get_last_error)(self.raw) };
        if p.is_null() {
            return None;
        }
        // SAFETY: as above.
        let s = unsafe { CStr::from_ptr(p) }
            .to_string_lossy()
            .trim()
            .to_owned();
        (!s.is_empty()).then_some(s)
    }

    /// Aborts the communicator after an NCCL error `code` in `what`: the
    /// error to return.
    fn fail(&mut self, what: &str, code: c_int) -> TransportError {
        let mut msg = format!("{what}: {}", error_string(self.api, code));
        if let Some(last) = self.last_error() {
            msg.push_str(&format!(" ({last})"));
        }
        self.abort(&msg);
        if code == INVALID_ARGUMENT || code == INVALID_USAGE {
            TransportError::Invalid(msg)
        } else {
            TransportError::Peer(msg)
        }
    }

    /// Aborts the communicator (once): anything it still runs stops, and it
    /// is freed.
    fn abort(&mut self, why: &str) {
        if self.raw.is_null() {
            return;
        }
        tracing::warn!(
            transfer = %self.transfer,
            rank = self.rank,
            "aborting the NCCL communicator: {why}"
        );
        let (api, ctx) = (self.api, self.stream.ctx().clone());
        let comm = Aborting(self.raw);
        self.raw = std::ptr::null_mut();
        self.failed = Some(why.to_owned());
        // On its own thread, waited for a while: an abort that hangs costs
        // a thread, not the agent's transfer thread.
        let (tx, rx) = mpsc::channel();
        let reaper = self.reaper.clone();
        let run = move || {
            let _ = driver::bind(&ctx);
            // SAFETY: a live communicator, aborted once: NCCL sets its abort
            // flag (kernels and proxy threads quit), joins its init thread
            // and frees it; nothing uses it after (the `NcclComm` forgot it).
            let r = unsafe { (api.comm_abort)(comm.raw()) };
            let _ = tx.send(r);
            // What was kept for an abort that took too long goes now.
            reaper.returned();
        };
        if let Err(e) = std::thread::Builder::new()
            .name("kt-nccl-abort".into())
            .spawn(run)
        {
            tracing::warn!("no thread for ncclCommAbort ({e}): the communicator is left as it is");
            self.abandoned = true;
            return;
        }
        match rx.recv_timeout(ABORT_WAIT) {
            Ok(SUCCESS) => {}
            Ok(r) => tracing::warn!("ncclCommAbort: {}", error_string(api, r)),
            Err(_) => {
                tracing::warn!(
                    transfer = %self.transfer,
                    "ncclCommAbort has not returned after {ABORT_WAIT:?}: left to finish on its own thread; the communicator's stream, buffers and GPU hold are kept until it returns"
                );
                self.abandoned = true;
            }
        }
    }

    /// Polls until NCCL has done what was asked (`ncclCommGetAsyncError`
    /// leaves `ncclInProgress`) and the GPU has run what `until` says;
    /// aborts on an error or at `deadline`.
    fn wait(&mut self, deadline: Instant, what: &str, until: Until) -> Result<(), TransportError> {
        let limit = deadline.saturating_duration_since(Instant::now());
        let mut backoff = Backoff::new();
        loop {
            if self.raw.is_null() {
                return Err(self.aborted());
            }
            let mut state: c_int = IN_PROGRESS;
            // SAFETY: `raw` is a live communicator; `state` a valid
            // out-pointer.
            let r = unsafe { (self.api.comm_get_async_error)(self.raw, &mut state) };
            if r != SUCCESS {
                return Err(self.fail(&format!("{what} (ncclCommGetAsyncError)"), r));
            }
            match state {
                SUCCESS if until == Until::Posted => return Ok(()),
                SUCCESS => match match until {
                    Until::Event(i) => self.steps_done[i].done(),
                    _ => self.stream.idle(),
                } {
                    Ok(true) => return Ok(()),
                    Ok(false) => {}
                    Err(e) => {
                        let msg = format!("{what}: the GPU failed: {}", describe(e));
                        self.abort(&msg);
                        return Err(TransportError::Peer(msg));
                    }
                },
                IN_PROGRESS => {}
                code => return Err(self.fail(what, code)),
            }
            if Instant::now() >= deadline {
                let msg = format!("{what}: not done after {limit:.1?}; aborted");
                self.abort(&msg);
                return Err(TransportError::Timeout(msg));
            }
            backoff.wait();
        }
    }

    fn aborted(&self) -> TransportError {
        TransportError::Peer(format!(
            "the NCCL communicator of transfer {} was aborted: {}",
            self.transfer,
            self.failed.as_deref().unwrap_or("closed")
        ))
    }

    /// Checks an entry point's immediate answer.
    fn check(&mut self, what: &str, r: c_int) -> Result<(), TransportError> {
        if r == SUCCESS || r == IN_PROGRESS {
            Ok(())
        } else {
            Err(self.fail(what, r))
        }
    }
}

/// One point-to-point operation: device address, bytes, peer rank.
type P2p = (u64, u64, u32);

/// What [`NcclComm::wait`] waits for, besides NCCL having taken the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Until {
    /// Nothing more (the next call may be made).
    Posted,
    /// The stream has run everything enqueued.
    Ran,
    /// The stream has run up to the last record of `steps_done[i]`.
    Event(usize),
}

impl NcclComm {
    /// `sends` then `recvs` as one NCCL group (the context bound): posted,
    /// not waited for.
    fn p2p(&mut self, what: &str, sends: &[P2p], recvs: &[P2p]) -> Result<(), TransportError> {
        let (comm, stream, api) = (self.raw, self.stream.raw(), self.api);
        // SAFETY: no arguments; opens a group on this thread, closed below
        // whatever happens in between.
        let r = unsafe { (api.group_start)() };
        self.check(what, r)?;
        let mut first = SUCCESS;
        for (i, (ptr, n, peer)) in sends.iter().chain(recvs).enumerate() {
            let (buf, n, peer) = (*ptr as *mut c_void, *n as usize, *peer as c_int);
            let r = if i < sends.len() {
                // SAFETY: callers pass ranges of device memory of this
                // communicator's GPU that they keep alive until the stream
                // has run the group (they wait for it, or abort), and ranks
                // of the communicator (members of checked groups).
                unsafe { (api.send)(buf, n, UINT8, peer, comm, stream) }
            } else {
                // SAFETY: as for the sends.
                unsafe { (api.recv)(buf, n, UINT8, peer, comm, stream) }
            };
            if r != SUCCESS && r != IN_PROGRESS {
                first = r;
                break;
            }
        }
        // SAFETY: closes the group opened above.
        let end = unsafe { (api.group_end)() };
        self.check(what, first)?;
        self.check(what, end)
    }
}

impl Exchange for NcclComm {
    fn exchange(
        &mut self,
        to: &[u32],
        from: &[u32],
        deadline: Instant,
        what: &str,
    ) -> Result<(), TransportError> {
        if self.raw.is_null() {
            return Err(self.aborted());
        }
        driver::bind(self.stream.ctx())?;
        let what = format!(
            "{what} (transfer {}, rank {} of {})",
            self.transfer, self.rank, self.world
        );
        let base = self.token.ptr();
        let sends: Vec<P2p> = to
            .iter()
            .map(|p| (base + u64::from(self.world), 1, *p))
            .collect();
        // Each peer has its own receive slot.
        let recvs: Vec<P2p> = from.iter().map(|p| (base + u64::from(*p), 1, *p)).collect();
        self.p2p(&what, &sends, &recvs)?;
        self.wait(deadline, &what, Until::Ran)
    }
}

impl Comm for NcclComm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    fn wedged(&self) -> bool {
        self.abandoned
    }

    /// What the transfer lent and its GPU hold stay until the abort
    /// returns (after the stream and the token, which NCCL may use too).
    fn keep_until_stopped(&mut self, what: Box<dyn Send>) {
        if !self.abandoned {
            // Nothing of it runs any more.
            drop(what);
            return;
        }
        self.hand_to_reaper();
        self.reaper.after(what);
    }

    fn reusable(&self) -> bool {
        !self.raw.is_null() && self.failed.is_none() && !self.abandoned
    }

    fn rename(&mut self, transfer: &str) {
        transfer.clone_into(&mut self.transfer);
    }

    /// Waits for every member of the flow (see [`flow_handshake`]): a
    /// member busy with earlier flows is waited for up to
    /// [`FLOW_WAIT_FACTOR`] timeouts, and the flow's collectives are
    /// bounded by the timeout from when all are there.
    fn begin_flow(&mut self, root: u32, group: &[u32]) -> Result<(), TransportError> {
        part(self.rank, self.world, root, group)?;
        // With two ranks every flow has both, so neither is ever busy with a
        // flow the other is not in: one timeout is enough, and a peer that
        // never comes (a point-to-point getter that lost the reply naming a
        // kept communicator) costs one timeout, not five.
        let factor = if self.world == 2 { 1 } else { FLOW_WAIT_FACTOR };
        let (me, idle) = (self.rank, self.timeout * factor);
        flow_handshake(self, me, root, group, idle)
    }

    fn broadcast(
        &mut self,
        root: u32,
        group: &[u32],
        buf: &mut dyn Region,
        offset: u64,
        len: u64,
    ) -> Result<(), TransportError> {
        let part = part(self.rank, self.world, root, group)?;
        if part == Part::Skip || len == 0 {
            return Ok(());
        }
        if self.raw.is_null() {
            return Err(self.aborted());
        }
        let Some(base) = buf.device_ptr() else {
            return Err(TransportError::Invalid(format!(
                "NCCL moves GPU memory; the buffer is on {}",
                buf.device()
            )));
        };
        if buf.device() != Device::Cuda(self.ordinal) {
            return Err(TransportError::Invalid(format!(
                "the buffer is on {}, the NCCL communicator on cuda:{} (set {} to the GPU of the tensors)",
                buf.device(),
                self.ordinal,
                kt_types::env::CUDA_DEVICE
            )));
        }
        if offset.checked_add(len).is_none_or(|end| end > buf.len()) {
            return Err(TransportError::Invalid(format!(
                "bytes {offset}..+{len} are outside a buffer of {} bytes",
                buf.len()
            )));
        }
        let ptr = (base + offset) as *mut c_void;
        let n = len as usize;
        let (comm, stream, api) = (self.raw, self.stream.raw(), self.api);
        driver::bind(self.stream.ctx())?;
        let what = format!(
            "NCCL broadcast of {len} bytes from rank {root} within {group:?} (transfer {}, rank {} of {})",
            self.transfer, self.rank, self.world
        );
        let deadline = Instant::now() + self.timeout;
        match &part {
            Part::Skip => return Ok(()),
            Part::Broadcast => {
                // SAFETY: `ptr..ptr + n` lies in the region (checked above),
                // device memory of the communicator's GPU that `buf` keeps
                // alive until this call returns, by which time the stream
                // has run the collective (or the communicator is aborted).
                let r = unsafe { (api.broadcast)(ptr, ptr, n, UINT8, root as c_int, comm, stream) };
                self.check(&what, r)?;
            }
            Part::Chain(order) => {
                let steps = chain::steps(order, self.rank, len, chain::PIECE, chain::CHAIN_MIN);
                self.steps(&steps, base + offset, deadline, &what)?;
            }
        }
        self.wait(deadline, &what, Until::Ran)
    }
}

impl NcclComm {
    /// Posts `steps` ([`chain::steps`]) on the bytes from device address
    /// `at`, one group each, at most [`chain::IN_FLIGHT`] ahead of what the
    /// GPU has run; returns once the last is posted (not run).
    ///
    /// Bounded because NCCL before 2.28 launches a non-blocking group's
    /// kernels inside `ncclGroupEnd`, and some releases wait there for
    /// room in a FIFO without looking at the abort flag: a chain of 1,024
    /// steps (a 4 GiB tensor) posted at once could wedge this thread in
    /// `ncclGroupEnd` when a peer died mid-broadcast, before any deadline
    /// is looked at. Waiting for step `i - IN_FLIGHT` to have run (a CUDA
    /// event per slot, polled with the communicator's error and the
    /// deadline) keeps the queue short and every wait abortable.
    pub(crate) fn steps(
        &mut self,
        steps: &[chain::Step],
        at: u64,
        deadline: Instant,
        what: &str,
    ) -> Result<(), TransportError> {
        let ops = |ops: &[chain::Op]| -> Vec<P2p> {
            ops.iter()
                .map(|(off, n, peer)| (at + off, *n, *peer))
                .collect()
        };
        let bounded = steps.len() > chain::IN_FLIGHT;
        while bounded && self.steps_done.len() < chain::IN_FLIGHT {
            let e = Event::new(self.stream.ctx())?;
            self.steps_done.push(e);
        }
        chain::post_bounded(
            steps.len(),
            chain::IN_FLIGHT,
            self,
            |c, earlier| c.wait(deadline, what, Until::Event(earlier % chain::IN_FLIGHT)),
            |c, i| {
                if i > 0 {
                    // A non-blocking communicator takes no call until the
                    // last one is posted.
                    c.wait(deadline, what, Until::Posted)?;
                }
                let step = &steps[i];
                c.p2p(what, &ops(&step.sends), &ops(&step.recvs))?;
                if bounded {
                    c.wait(deadline, what, Until::Posted)?;
                    c.steps_done[i % chain::IN_FLIGHT].record(&c.stream)?;
                }
                Ok(())
            },
        )
    }

    /// A broadcast down `order` with another piece size and chain
    /// threshold (`u64::MAX`: straight from the root), waited for: the GPU
    /// tests compare the shapes.
    #[cfg(test)]
    pub(crate) fn subset_with(
        &mut self,
        order: &[u32],
        at: u64,
        len: u64,
        piece: u64,
        chain_min: u64,
    ) -> Result<(), TransportError> {
        driver::bind(self.stream.ctx())?;
        let deadline = Instant::now() + self.timeout;
        let what = format!("subset broadcast of {len} bytes down {order:?}");
        let steps = chain::steps(order, self.rank, len, piece, chain_min);
        self.steps(&steps, at, deadline, &what)?;
        self.wait(deadline, &what, Until::Ran)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.close();
        if self.abandoned {
            self.hand_to_reaper();
        } else {
            // SAFETY: dropped once, here, after the communicator that used
            // them is destroyed or aborted (an abort that did not return
            // hands them to the reaper instead: `abandoned`).
            unsafe {
                ManuallyDrop::drop(&mut self.token);
                ManuallyDrop::drop(&mut self.stream);
            }
        }
    }
}

impl NcclComm {
    /// After an abort that did not return in time: the stream and the
    /// token buffer (which NCCL may still use) go to the reaper, dropped
    /// when the abort returns. Once.
    fn hand_to_reaper(&mut self) {
        if self.handed {
            return;
        }
        self.handed = true;
        // SAFETY: taken once (`handed`); the communicator is aborted (`raw`
        // is null), so every method returns before touching them again,
        // and `Drop` does not drop them (`abandoned`). Events go first:
        // recorded on the stream, destroyed before it.
        let kept = unsafe {
            (
                std::mem::take(&mut self.steps_done),
                ManuallyDrop::take(&mut self.token),
                ManuallyDrop::take(&mut self.stream),
            )
        };
        self.reaper.after(Box::new(kept));
    }
}

impl NcclComm {
    /// Finalizes and destroys the communicator (aborts it if that fails).
    fn close(&mut self) {
        if self.raw.is_null() {
            return;
        }
        let _ = driver::bind(self.stream.ctx());
        // Finalize flushes what is in flight (polled, bounded), then destroy
        // frees; abort if either fails.
        // SAFETY: `raw` is a live communicator, finalized once.
        let r = unsafe { (self.api.comm_finalize)(self.raw) };
        let what = format!(
            "closing the NCCL communicator of transfer {}",
            self.transfer
        );
        if r != SUCCESS && r != IN_PROGRESS {
            self.fail(&what, r);
            return;
        }
        let deadline = Instant::now() + self.timeout;
        if self.wait(deadline, &what, Until::Posted).is_err() {
            return; // aborted by `wait`
        }
        // SAFETY: finalized above; destroyed once, not used again.
        let r = unsafe { (self.api.comm_destroy)(self.raw) };
        if r != SUCCESS {
            tracing::warn!("ncclCommDestroy: {}", error_string(self.api, r));
        }
        self.raw = std::ptr::null_mut();
    }
}
