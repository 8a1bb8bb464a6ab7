//! The NCCL backend: CUDA tensors lent by IPC handle, moved by NCCL.
//!
//! Both libraries are loaded at run time, so every binary builds and starts
//! without CUDA: the CUDA driver through `cudarc` (`dynamic-loading`), NCCL
//! (2.14 or later) through `libloading` (`nccl.rs` says why). Without them
//! [`CudaBackend::new`] answers [`TransportError::Unsupported`] with the
//! reason; [`probe`] says the same without building a backend.
//!
//! - [`CudaBackend::map`](crate::Backend::map) opens a `MemHandle::CudaIpc`
//!   once per (GPU, handle) and caches it; [`CudaBackend::forget`] closes a
//!   handle's mappings when its owner goes away. The GPU is found by the
//!   handle's UUID when it has one (the application's container may number
//!   GPUs differently), by the entry's index otherwise.
//! - The communicator of a transfer lives on the GPU of this rank's memory
//!   (the `device` given to `connect`: where its mapped regions are);
//!   `KT_CUDA_DEVICE` ([`CudaBackend::with_comm_device`]: an index or a
//!   `GPU-…` UUID, default 0) is only the fallback when that is not a GPU.
//!   A buffer on another GPU is refused by `broadcast`.
//! - A broadcast within every rank is `ncclBroadcast`; within a subset, it
//!   goes down a pipelined chain of `ncclSend`/`ncclRecv` pieces (`chain`:
//!   each link carries the payload once), or straight from the root when
//!   it is small, and ranks outside it do nothing.
//! - Initialisation and collectives are bounded by the `connect` timeout;
//!   on an error or at the deadline the communicator is aborted (on its own
//!   thread, waited for a while) and the transfer gets the error
//!   (`Timeout`, `Peer`); the agent carries on.
//! - Each flow starts with [`crate::transport::flow_handshake`] over
//!   one-byte sends and receives, so members busy with earlier flows are
//!   waited for (up to 5 timeouts) before the flow's collectives start
//!   their timeout.
//! - The unique id comes from a helper process ([`serve_root_helper`]), so
//!   a transfer that never connects leaves no bootstrap thread in the
//!   agent.
//! - A transfer holds its GPU ([`crate::hold`], `Backend::hold`; holds are
//!   shared): staging buffers are freed and IPC mappings closed only when
//!   no transfer runs on the GPU.
//!
//! - NCCL's environment ([`netenv`]): the agent pins `NCCL_SOCKET_IFNAME`
//!   to the pod's interface at its start, keeps the allow-listed `NCCL_*`
//!   settings only, and the backend refuses `NCCL_COMM_BLOCKING=1`.
//!
//! NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
//! detected") unless they claim different hosts (`NCCL_HOSTID`), which is
//! how the GPU tests run several ranks on a one-GPU machine.

mod chain;
mod driver;
mod nccl;
pub mod netenv;
mod root;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kt_types::tensor::{BackendKind, Device, MemHandle, TransferPlan};

use crate::transport::{Backend, Comm, Endpoint, Region, TransportError};

pub use driver::{
    CudaRegion, CudaTensorMem, IPC_HANDLE_BYTES, device_count, device_uuid, format_uuid,
    ipc_mem_handle, normalize_uuid, ordinal_of_uuid, probe_driver,
};
pub use nccl::{NCCL_LIBRARY_ENV, UNIQUE_ID_BYTES, probe_nccl};
pub use root::{ROOT_HELPER_ENV, serve_root_helper};

use driver::{IpcMapping, Stream};
use nccl::{NcclComm, UniqueId};
use root::RootHelper;

/// How long a unique id's helper process lives at most (see
/// [`serve_root_helper`]): rank 0 ends it sooner, once connected or failed.
pub const ROOT_LIFETIME: Duration = Duration::from_secs(600);

/// Whether this machine can run the NCCL backend: the CUDA driver loads
/// and sees a GPU, and NCCL 2.14+ loads. The reason otherwise.
pub fn probe() -> Result<(), String> {
    probe_driver()?;
    probe_nccl().map(|_| ())
}

// ---- hex ------------------------------------------------------------------

pub(crate) fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

/// Exactly `N` bytes from hex (either case); `what` names the value in
/// errors.
pub(crate) fn from_hex<const N: usize>(s: &str, what: &str) -> Result<[u8; N], TransportError> {
    let s = s.trim();
    if s.len() != 2 * N {
        return Err(TransportError::Invalid(format!(
            "{what}: expected {} hex digits ({N} bytes), got {}",
            2 * N,
            s.len()
        )));
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in s.as_bytes().chunks_exact(2).enumerate() {
        match (digit(pair[0]), digit(pair[1])) {
            (Some(h), Some(l)) => out[i] = (h << 4) | l,
            _ => {
                return Err(TransportError::Invalid(format!(
                    "{what}: {:?} at {} is not hex",
                    String::from_utf8_lossy(pair),
                    2 * i
                )));
            }
        }
    }
    Ok(out)
}

/// A `CUipcMemHandle` as `MemHandle::CudaIpc` carries it (128 hex digits).
pub fn encode_ipc_handle(bytes: &[u8; IPC_HANDLE_BYTES]) -> String {
    to_hex(bytes)
}

pub fn decode_ipc_handle(hex: &str) -> Result<[u8; IPC_HANDLE_BYTES], TransportError> {
    from_hex(hex, "CUDA IPC handle")
}

// ---- the backend ----------------------------------------------------------

/// The parts of a `MemHandle::CudaIpc`: handle bytes, offset, length, GPU
/// UUID.
type IpcParts<'a> = ([u8; IPC_HANDLE_BYTES], u64, u64, Option<&'a str>);

fn ipc_parts(handle: &MemHandle) -> Result<IpcParts<'_>, TransportError> {
    match handle {
        MemHandle::CudaIpc {
            handle,
            offset,
            len,
            device_uuid,
        } => Ok((
            decode_ipc_handle(handle)?,
            *offset,
            *len,
            device_uuid.as_deref(),
        )),
        MemHandle::Shm { path, .. } => Err(TransportError::Invalid(format!(
            "the NCCL backend maps CUDA IPC handles; {path} is a shared-memory file (CPU tensors move over the host backend)"
        ))),
    }
}

fn cuda_index(device: Device, what: &str) -> Result<u32, TransportError> {
    match device {
        Device::Cuda(n) => Ok(n),
        Device::Cpu => Err(TransportError::Invalid(format!(
            "the NCCL backend moves CUDA tensors; {what} is on cpu (CPU tensors move over the host backend)"
        ))),
    }
}

/// `KT_CUDA_DEVICE`'s value as an ordinal: an index, `cuda:N`, or a UUID.
fn parse_comm_device(value: &str) -> Result<u32, TransportError> {
    let v = value.trim();
    let index = v.strip_prefix("cuda:").unwrap_or(v);
    if let Ok(n) = index.parse::<u32>() {
        return Ok(n);
    }
    if v.len() >= 32 {
        return driver::ordinal_of_uuid(v);
    }
    Err(TransportError::Invalid(format!(
        "{}={value:?}: expected a GPU index (0, cuda:1) or UUID (GPU-…)",
        kt_types::env::CUDA_DEVICE
    )))
}

/// CUDA tensors over NCCL (see the module docs).
pub struct CudaBackend {
    /// The GPU communicators live on.
    comm_device: u32,
    /// Opened IPC handles, by (GPU, handle hex).
    ipc: Mutex<HashMap<(u32, String), Arc<IpcMapping>>>,
    /// Idle copy streams, by GPU: each `copy` takes one, so concurrent
    /// copies never wait for each other.
    streams: Mutex<HashMap<u32, Vec<Stream>>>,
    /// The program (and its arguments) that serves NCCL unique ids
    /// ([`serve_root_helper`]); this executable by default.
    root_helper: Option<(PathBuf, Vec<OsString>)>,
    /// Helpers of rendezvous whose rank 0 has not connected yet, by id.
    roots: Mutex<HashMap<String, RootHelper>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("comm_device", &self.comm_device)
            .field("cached_handles", &self.cached_handles())
            .finish()
    }
}

impl CudaBackend {
    /// Loads the CUDA driver and NCCL; `Unsupported` with the reason when
    /// either is missing. Communicators go on `KT_CUDA_DEVICE` (default 0).
    pub fn new() -> Result<CudaBackend, TransportError> {
        netenv::check_comm_blocking(std::env::var(netenv::COMM_BLOCKING).ok().as_deref())
            .map_err(TransportError::Unsupported)?;
        driver::driver()?;
        nccl::probe_nccl().map_err(TransportError::Unsupported)?;
        let comm_device = match std::env::var(kt_types::env::CUDA_DEVICE) {
            Ok(v) if !v.trim().is_empty() => parse_comm_device(&v)?,
            _ => 0,
        };
        let count = driver::device_count()?;
        if comm_device >= count {
            return Err(TransportError::Invalid(format!(
                "{}: there is no cuda:{comm_device}, the driver sees {count} GPU(s)",
                kt_types::env::CUDA_DEVICE
            )));
        }
        Ok(CudaBackend {
            comm_device,
            ipc: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            root_helper: None,
            roots: Mutex::new(HashMap::new()),
        })
    }

    /// Communicators go on `cuda:{ordinal}` instead.
    pub fn with_comm_device(mut self, ordinal: u32) -> CudaBackend {
        self.comm_device = ordinal;
        self
    }

    pub fn comm_device(&self) -> u32 {
        self.comm_device
    }

    /// Unique ids come from `program args…` (which must call
    /// [`serve_root_helper`] first) instead of this executable.
    pub fn with_root_helper(
        mut self,
        program: impl Into<PathBuf>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> CudaBackend {
        self.root_helper = Some((program.into(), args.into_iter().map(Into::into).collect()));
        self
    }

    /// The helper of rendezvous `blob`, out of the map.
    fn take_root(&self, blob: &str) -> Option<RootHelper> {
        self.roots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(blob.trim())
    }

    /// A fresh unique id from a helper process, kept until rank 0 connects.
    fn unique_id(&self) -> Result<String, TransportError> {
        let mut cmd = match &self.root_helper {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args);
                c
            }
            None => Command::new(std::env::current_exe().map_err(|e| {
                TransportError::io("finding this executable (NCCL's unique id helper)", e)
            })?),
        };
        cmd.stderr(std::process::Stdio::inherit());
        let (helper, id) = RootHelper::start(cmd, ROOT_LIFETIME, root::ANSWER_WITHIN)?;
        let mut roots = self.roots.lock().unwrap_or_else(|e| e.into_inner());
        roots.retain(|_, h| h.running());
        roots.insert(id.clone(), helper);
        Ok(id)
    }

    /// The GPU a handle's memory is on: by UUID, else by the entry's index.
    fn resolve(&self, uuid: Option<&str>, device: Device) -> Result<u32, TransportError> {
        let index = cuda_index(device, "a tensor")?;
        match uuid {
            Some(u) if !u.trim().is_empty() => driver::ordinal_of_uuid(u),
            _ => Ok(index),
        }
    }

    /// [`Backend::map`] with its concrete type.
    pub fn map_ipc(
        &self,
        handle: &MemHandle,
        device: Device,
    ) -> Result<CudaRegion, TransportError> {
        let (bytes, offset, len, uuid) = ipc_parts(handle)?;
        let ordinal = self.resolve(uuid, device)?;
        let key = (ordinal, to_hex(&bytes));
        let mapping = {
            let mut cache = self.ipc.lock().unwrap_or_else(|e| e.into_inner());
            match cache.get(&key) {
                Some(m) => m.clone(),
                None => {
                    let m = Arc::new(IpcMapping::open(ordinal, &bytes)?);
                    cache.insert(key, m.clone());
                    m
                }
            }
        };
        CudaRegion::of_ipc(mapping, offset, len)
    }

    /// [`Backend::alloc`] with its concrete type.
    pub fn alloc_device(&self, ordinal: u32, len: u64) -> Result<CudaRegion, TransportError> {
        CudaRegion::alloc(ordinal, len)
    }

    /// Drops the cached mappings of `handle`'s allocation (every GPU): call
    /// it when the owning process is gone. The IPC mapping is closed when
    /// the last region of it is dropped. Returns how many were cached.
    pub fn forget(&self, handle: &MemHandle) -> usize {
        let MemHandle::CudaIpc { handle, .. } = handle else {
            return 0;
        };
        let Ok(bytes) = decode_ipc_handle(handle) else {
            return 0;
        };
        let hex = to_hex(&bytes);
        let mut cache = self.ipc.lock().unwrap_or_else(|e| e.into_inner());
        let before = cache.len();
        // Each is closed once no transfer runs on its GPU (see `crate::hold`).
        cache.retain(|(_, h), _| *h != hex);
        before - cache.len()
    }

    /// Drops every cached mapping.
    pub fn forget_all(&self) {
        self.ipc.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// IPC handles open now.
    pub fn cached_handles(&self) -> usize {
        self.ipc.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn take_stream(&self, ordinal: u32) -> Result<Stream, TransportError> {
        let idle = self
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&ordinal)
            .and_then(Vec::pop);
        match idle {
            Some(s) => Ok(s),
            None => Stream::new(&driver::context(ordinal)?),
        }
    }

    fn give_stream(&self, ordinal: u32, s: Stream) {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(ordinal)
            .or_default()
            .push(s);
    }

    fn check_plan(plan: &TransferPlan) -> Result<(), TransportError> {
        if plan.backend != BackendKind::Nccl {
            return Err(TransportError::Invalid(format!(
                "transfer {} is planned for the {} backend, not NCCL",
                plan.id, plan.backend
            )));
        }
        Ok(())
    }
}

fn device_range(r: &dyn Region, off: u64, len: u64, what: &str) -> Result<u64, TransportError> {
    let ptr = r.device_ptr().ok_or_else(|| {
        TransportError::Invalid(format!(
            "the NCCL backend copies GPU memory; the copy {what} is on {}",
            r.device()
        ))
    })?;
    match off.checked_add(len) {
        Some(end) if end <= r.len() => Ok(ptr + off),
        _ => Err(TransportError::Invalid(format!(
            "copy {what} out of range: bytes {off}..+{len} of {}",
            r.len()
        ))),
    }
}

/// NCCL needs no listener of ours: the endpoint is the pod's address,
/// announced for information.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaEndpoint {
    address: String,
}

impl CudaEndpoint {
    pub fn new(address: impl Into<String>) -> CudaEndpoint {
        CudaEndpoint {
            address: address.into(),
        }
    }
}

impl Endpoint for CudaEndpoint {
    fn address(&self) -> String {
        self.address.clone()
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Nccl
    }

    fn map(&self, handle: &MemHandle, device: Device) -> Result<Box<dyn Region>, TransportError> {
        Ok(Box::new(self.map_ipc(handle, device)?))
    }

    fn release(&self, handle: &MemHandle) {
        self.forget(handle);
    }

    fn hold(
        &self,
        device: Device,
        wait: Duration,
    ) -> Result<Option<Box<dyn Send>>, TransportError> {
        let ordinal = match device {
            Device::Cuda(n) => n,
            Device::Cpu => self.comm_device,
        };
        Ok(Some(Box::new(driver::holds().hold(ordinal, wait)?)))
    }

    fn retire(&self, device: Device, comm: Box<dyn Comm>) {
        // Destroying a communicator frees device memory: not under another
        // transfer's kernels.
        let ordinal = match device {
            Device::Cuda(n) => n,
            Device::Cpu => self.comm_device,
        };
        driver::holds().defer(
            ordinal,
            "the close of a retired NCCL communicator",
            Box::new(comm),
        );
    }

    fn alloc(&self, device: Device, len: u64) -> Result<Box<dyn Region>, TransportError> {
        let ordinal = cuda_index(device, "a staging buffer")?;
        Ok(Box::new(self.alloc_device(ordinal, len)?))
    }

    fn copy(
        &self,
        dst: &mut dyn Region,
        dst_off: u64,
        src: &dyn Region,
        src_off: u64,
        len: u64,
    ) -> Result<(), TransportError> {
        let ordinal = cuda_index(dst.device(), "the copy destination")?;
        let to = device_range(dst, dst_off, len, "destination")?;
        let from = device_range(src, src_off, len, "source")?;
        if len == 0 {
            return Ok(());
        }
        let stream = self.take_stream(ordinal)?;
        let r = driver::dtod(&stream, to, from, len);
        if r.is_ok() {
            self.give_stream(ordinal, stream);
        }
        r
    }

    fn read(&self, src: &dyn Region, off: u64, out: &mut [u8]) -> Result<(), TransportError> {
        let ordinal = cuda_index(src.device(), "a read")?;
        let from = device_range(src, off, out.len() as u64, "source")?;
        let stream = self.take_stream(ordinal)?;
        let r = driver::dtoh(stream.ctx(), out, from);
        if r.is_ok() {
            self.give_stream(ordinal, stream);
        }
        r
    }

    fn write(&self, dst: &mut dyn Region, off: u64, bytes: &[u8]) -> Result<(), TransportError> {
        let ordinal = cuda_index(dst.device(), "a write")?;
        let to = device_range(dst, off, bytes.len() as u64, "destination")?;
        let stream = self.take_stream(ordinal)?;
        let r = driver::htod(stream.ctx(), to, bytes);
        if r.is_ok() {
            self.give_stream(ordinal, stream);
        }
        r
    }

    fn endpoint(&self, _id: &str, ip: &str) -> Result<Box<dyn Endpoint>, TransportError> {
        Ok(Box::new(CudaEndpoint::new(ip)))
    }

    fn rendezvous(&self, plan: &TransferPlan) -> Result<Option<String>, TransportError> {
        Self::check_plan(plan)?;
        self.unique_id().map(Some)
    }

    fn abandon_rendezvous(&self, blob: &str) {
        drop(self.take_root(blob));
    }

    fn connect(
        &self,
        plan: &TransferPlan,
        rank: u32,
        _endpoint: Box<dyn Endpoint>,
        rendezvous: Option<&str>,
        device: Device,
        timeout: Duration,
    ) -> Result<Box<dyn Comm>, TransportError> {
        // Rank 0 takes its rendezvous' helper along: it ends with this call,
        // however that ends (every rank has met the bootstrap root by then,
        // or never will).
        let _helper = match (rank, rendezvous) {
            (0, Some(blob)) => self.take_root(blob),
            _ => None,
        };
        Self::check_plan(plan)?;
        let world = plan.ranks.len() as u32;
        if rank >= world {
            return Err(TransportError::Invalid(format!(
                "rank {rank} of transfer {} with {world} ranks",
                plan.id
            )));
        }
        let blob = rendezvous.ok_or_else(|| {
            TransportError::Invalid(format!(
                "transfer {}: NCCL needs rank 0's unique id (the rendezvous blob)",
                plan.id
            ))
        })?;
        let id = UniqueId::from_bytes(&from_hex(blob, "NCCL unique id")?);
        // The GPU of this rank's memory (found by UUID when mapped); a rank
        // that lends nothing (none does today) uses the configured device.
        let ordinal = match device {
            Device::Cuda(n) => n,
            Device::Cpu => self.comm_device,
        };
        let comm = NcclComm::init(&plan.id, ordinal, world, rank, &id, timeout)?;
        Ok(Box::new(comm))
    }
}
