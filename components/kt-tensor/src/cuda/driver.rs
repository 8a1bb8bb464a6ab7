//! The CUDA driver API through `cudarc`, loaded at run time: primary
//! contexts, streams, device memory and CUDA IPC handles.
//!
//! `cudarc` resolves each driver entry point on first use and panics when
//! the library or the symbol is missing, so [`probe_driver`] checks the
//! library and every symbol this module uses before anything else calls
//! the driver (and catches a panic, should one happen anyway).

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, DriverError, result, sys};

use crate::hold::DeviceHolds;
use kt_types::tensor::{Device, MemHandle};

use crate::transport::{Region, TransportError};

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// Every driver entry point used here, directly or through `cudarc`'s
/// `result` and `safe` layers: checked when the driver is loaded.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDeviceGetUuid_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamQuery",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyAsync",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
];

static DRIVER: OnceLock<Result<(), String>> = OnceLock::new();

/// Loads the CUDA driver (`libcuda.so`) and initialises it, once per
/// process: why it cannot be used otherwise.
pub fn probe_driver() -> Result<(), String> {
    DRIVER.get_or_init(load_driver).clone()
}

pub(crate) fn driver() -> Result<(), TransportError> {
    probe_driver().map_err(TransportError::Unsupported)
}

/// Runs `f`, turning a panic (cudarc's way to report a library or a symbol
/// it could not load) into an error.
fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "cudarc panicked".to_owned())
    })
}

fn load_driver() -> Result<(), String> {
    let unloadable = |why: String| format!("no CUDA driver (libcuda.so) could be loaded: {why}");
    // SAFETY: `is_culib_present` dlopens the candidate names of the driver
    // library (running its initialisers, as any use of CUDA would) and
    // closes them again; it has no other effect.
    let present = catch(|| unsafe { sys::is_culib_present() }).map_err(unloadable)?;
    if !present {
        let mut names: Vec<String> = cudarc::get_lib_name_candidates("cuda")
            .into_iter()
            .filter(|n| !n.contains("cuda64") && !n.contains("cuda32"))
            .collect();
        names.dedup();
        return Err(unloadable(format!(
            "none of {} was found; install the NVIDIA driver, or put the directory of its libcuda.so.1 on LD_LIBRARY_PATH",
            names.join(", ")
        )));
    }
    // SAFETY: the library is present (checked above), so `culib` loads it
    // and keeps it for the life of the process; were it to panic instead,
    // the panic is caught.
    let lib = catch(|| unsafe { sys::culib() }).map_err(unloadable)?;
    let missing: Vec<&str> = SYMBOLS
        .iter()
        .copied()
        // SAFETY: looking a symbol up reads the library's symbol table; the
        // address is not used.
        .filter(|name| unsafe { lib.get::<*const c_void>(*name) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(unloadable(format!(
            "the driver found lacks {} (a driver for CUDA 11.4 or later is needed)",
            missing.join(", ")
        )));
    }
    catch(result::init).map_err(unloadable)?.map_err(|e| {
        format!(
            "the CUDA driver is loaded but cuInit failed: {}",
            describe(e)
        )
    })?;
    let count = result::device::get_count().map_err(|e| {
        format!(
            "the CUDA driver is loaded but counting GPUs failed: {}",
            describe(e)
        )
    })?;
    if count < 1 {
        return Err("the CUDA driver is loaded but sees no GPU".into());
    }
    Ok(())
}

/// A driver error as `CUDA_ERROR_NAME (description)`.
pub(crate) fn describe(e: DriverError) -> String {
    match e.error_string() {
        Ok(s) => format!("{:?} ({})", e.0, s.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    }
}

pub(crate) fn cuda_err(what: impl std::fmt::Display) -> impl FnOnce(DriverError) -> TransportError {
    move |e| TransportError::Peer(format!("{what}: {}", describe(e)))
}

// ---- devices --------------------------------------------------------------

/// GPUs the driver sees.
pub fn device_count() -> Result<u32, TransportError> {
    driver()?;
    let n = result::device::get_count().map_err(cuda_err("counting GPUs"))?;
    Ok(n.max(0) as u32)
}

fn cu_device(ordinal: u32) -> Result<sys::CUdevice, TransportError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(TransportError::Invalid(format!(
            "there is no cuda:{ordinal}: the driver sees {count} GPU(s)"
        )));
    }
    result::device::get(ordinal as i32).map_err(cuda_err(format!("cuda:{ordinal}")))
}

/// `c_char` is `i8` or `u8` depending on the target.
#[allow(clippy::unnecessary_cast)]
fn c_bytes<const N: usize>(raw: &[std::ffi::c_char; N]) -> [u8; N] {
    raw.map(|c| c as u8)
}

#[allow(clippy::unnecessary_cast)]
fn to_c_chars<const N: usize>(bytes: &[u8; N]) -> [std::ffi::c_char; N] {
    bytes.map(|b| b as std::ffi::c_char)
}

/// A GPU's UUID as `nvidia-smi -L` prints it: `GPU-xxxxxxxx-xxxx-…`.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    let h = super::to_hex(bytes);
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The hex digits of a UUID, without its `GPU-`/`MIG-` prefix or dashes,
/// lowercase: what two spellings of one UUID have in common.
pub fn normalize_uuid(uuid: &str) -> String {
    let u = uuid.trim();
    let u = ["GPU-", "MIG-", "gpu-", "mig-"]
        .iter()
        .find_map(|p| u.strip_prefix(p))
        .unwrap_or(u);
    u.chars()
        .filter(|c| *c != '-')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// The UUID of `cuda:{ordinal}` (`GPU-…`).
pub fn device_uuid(ordinal: u32) -> Result<String, TransportError> {
    let dev = cu_device(ordinal)?;
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `uuid` is a valid CUuuid to write, `dev` a device handle the
    // driver returned.
    unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) }
        .result()
        .map_err(cuda_err(format!("UUID of cuda:{ordinal}")))?;
    Ok(format_uuid(&c_bytes(&uuid.bytes)))
}

/// The ordinal (in this process's numbering) of the GPU with this UUID.
pub fn ordinal_of_uuid(uuid: &str) -> Result<u32, TransportError> {
    let want = normalize_uuid(uuid);
    let count = device_count()?;
    let mut seen = Vec::new();
    for i in 0..count {
        let u = device_uuid(i)?;
        if normalize_uuid(&u) == want {
            return Ok(i);
        }
        seen.push(u);
    }
    Err(TransportError::Invalid(format!(
        "no GPU with UUID {uuid} is visible here (this process sees {})",
        if seen.is_empty() {
            "none".to_owned()
        } else {
            seen.join(", ")
        }
    )))
}

/// The primary context of `cuda:{ordinal}`, retained once per process.
pub(crate) fn context(ordinal: u32) -> Result<Arc<CudaContext>, TransportError> {
    static CONTEXTS: OnceLock<Mutex<HashMap<u32, Arc<CudaContext>>>> = OnceLock::new();
    driver()?;
    let mut ctxs = CONTEXTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(c) = ctxs.get(&ordinal) {
        return Ok(c.clone());
    }
    cu_device(ordinal)?;
    let ctx = CudaContext::new(ordinal as usize)
        .map_err(cuda_err(format!("the primary context of cuda:{ordinal}")))?;
    ctxs.insert(ordinal, ctx.clone());
    Ok(ctx)
}

pub(crate) fn bind(ctx: &CudaContext) -> Result<(), TransportError> {
    ctx.bind_to_thread().map_err(cuda_err(format!(
        "binding the context of cuda:{}",
        ctx.ordinal()
    )))
}

/// Binds `ctx` for a drop: a second try when the first only reported an
/// error cudarc had recorded earlier (reporting clears it).
fn bind_for_drop(ctx: &CudaContext) -> bool {
    ctx.bind_to_thread().is_ok() || ctx.bind_to_thread().is_ok()
}

// ---- streams --------------------------------------------------------------

/// A non-blocking stream of a context, destroyed on drop.
pub(crate) struct Stream {
    ctx: Arc<CudaContext>,
    raw: sys::CUstream,
}

// SAFETY: a CUstream is a handle the driver lets any thread use (the
// driver API is thread safe); the context it belongs to is kept alive by
// the Arc and bound by every user before use.
unsafe impl Send for Stream {}
// SAFETY: as above; enqueueing onto or querying one stream from several
// threads is allowed by the driver.
unsafe impl Sync for Stream {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(cuda:{}, {:p})", self.ctx.ordinal(), self.raw)
    }
}

impl Stream {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Stream, TransportError> {
        bind(ctx)?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(
            cuda_err(format!("creating a stream on cuda:{}", ctx.ordinal())),
        )?;
        Ok(Stream {
            ctx: ctx.clone(),
            raw,
        })
    }

    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Whether everything enqueued is done (`cuStreamQuery`).
    pub(crate) fn idle(&self) -> Result<bool, DriverError> {
        // SAFETY: `raw` is a live stream of this object.
        match unsafe { sys::cuStreamQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(DriverError(e)),
        }
    }

    pub(crate) fn synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: `raw` is a live stream of this object.
        unsafe { result::stream::synchronize(self.raw) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if bind_for_drop(&self.ctx) {
            // SAFETY: `raw` was created by `Stream::new` and is destroyed
            // once, here; work still queued on it completes first (the
            // driver defers the release).
            if let Err(e) = unsafe { result::stream::destroy(self.raw) } {
                tracing::debug!("destroying a CUDA stream: {}", describe(e));
            }
        }
    }
}

/// A CUDA event (no timing) recorded on a stream: tells when what was
/// enqueued before it has run, without waiting for what came after.
pub(crate) struct Event {
    ctx: Arc<CudaContext>,
    raw: sys::CUevent,
}

// SAFETY: a CUevent is a handle the driver lets any thread use; the context
// is kept alive by the Arc and bound before each use.
unsafe impl Send for Event {}

impl Event {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Event, TransportError> {
        bind(ctx)?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(
            cuda_err(format!("creating an event on cuda:{}", ctx.ordinal())),
        )?;
        Ok(Event {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// Marks the end of what `stream` has enqueued so far.
    pub(crate) fn record(&self, stream: &Stream) -> Result<(), TransportError> {
        // SAFETY: both are live handles of one context.
        unsafe { result::event::record(self.raw, stream.raw()) }
            .map_err(cuda_err("recording an event".to_owned()))
    }

    /// Whether what was enqueued before the last record has run
    /// (`cuEventQuery`).
    pub(crate) fn done(&self) -> Result<bool, DriverError> {
        // SAFETY: `raw` is a live event of this object.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(DriverError(e)),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if bind_for_drop(&self.ctx) {
            // SAFETY: created by `Event::new`, destroyed once, here.
            if let Err(e) = unsafe { result::event::destroy(self.raw) } {
                tracing::debug!("destroying a CUDA event: {}", describe(e));
            }
        }
    }
}

/// Copies `src` to device memory at `dst` and waits for it.
pub(crate) fn htod(ctx: &Arc<CudaContext>, dst: u64, src: &[u8]) -> Result<(), TransportError> {
    if src.is_empty() {
        return Ok(());
    }
    let s = Stream::new(ctx)?;
    // SAFETY: the caller checked that `dst..dst + src.len()` lies in live
    // device memory of this context; `src` outlives the copy, which is
    // complete when `synchronize` returns.
    unsafe { result::memcpy_htod_async(dst, src, s.raw()) }
        .and_then(|()| s.synchronize())
        .map_err(cuda_err("copying host memory to the GPU"))
}

/// Copies device memory at `src` into `dst` and waits for it.
pub(crate) fn dtoh(ctx: &Arc<CudaContext>, dst: &mut [u8], src: u64) -> Result<(), TransportError> {
    if dst.is_empty() {
        return Ok(());
    }
    let s = Stream::new(ctx)?;
    // SAFETY: the caller checked that `src..src + dst.len()` lies in live
    // device memory of this context; `dst` is borrowed until the copy is
    // complete (`synchronize`).
    unsafe { result::memcpy_dtoh_async(dst, src, s.raw()) }
        .and_then(|()| s.synchronize())
        .map_err(cuda_err("copying GPU memory to the host"))
}

/// Copies `len` bytes between device pointers (any devices: unified
/// addressing) on `stream`, and waits for it.
pub(crate) fn dtod(stream: &Stream, dst: u64, src: u64, len: u64) -> Result<(), TransportError> {
    if len == 0 {
        return Ok(());
    }
    bind(stream.ctx())?;
    // SAFETY: the caller checked both ranges against live regions; the copy
    // is complete when `synchronize` returns.
    unsafe { sys::cuMemcpyAsync(dst, src, len as usize, stream.raw()) }
        .result()
        .and_then(|()| stream.synchronize())
        .map_err(cuda_err(format!("copying {len} bytes on the GPU")))
}

/// The allocation holding `ptr`: its base and size.
fn address_range(ctx: &CudaContext, ptr: u64) -> Result<(u64, u64), TransportError> {
    bind(ctx)?;
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: both out-pointers are valid; the driver only reads `ptr`.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(|e| {
            TransportError::Invalid(format!(
                "{ptr:#x} is not device memory of cuda:{}: {}",
                ctx.ordinal(),
                describe(e)
            ))
        })?;
    Ok((base, size as u64))
}

// ---- memory ---------------------------------------------------------------

/// Device memory allocated here (`cuMemAlloc`), freed on drop.
pub(crate) struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: u64,
    len: u64,
}

impl DeviceAlloc {
    pub(crate) fn new(ordinal: u32, len: u64) -> Result<DeviceAlloc, TransportError> {
        let ctx = context(ordinal)?;
        if len == 0 {
            return Ok(DeviceAlloc { ctx, ptr: 0, len });
        }
        bind(&ctx)?;
        // SAFETY: allocates `len` bytes in the bound context; the pointer is
        // freed once, on drop.
        let ptr = unsafe { result::malloc_sync(len as usize) }.map_err(cuda_err(format!(
            "allocating {len} bytes on cuda:{ordinal}"
        )))?;
        Ok(DeviceAlloc { ctx, ptr, len })
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// The transfers running on each GPU of this process, and what waits for
/// none to run ([`crate::hold`]): freeing device memory and closing IPC
/// mappings synchronise the device.
pub(crate) fn holds() -> &'static Arc<DeviceHolds> {
    static HOLDS: OnceLock<Arc<DeviceHolds>> = OnceLock::new();
    HOLDS.get_or_init(Arc::default)
}

/// A `cuMemFree` to do, when no transfer runs on the device.
struct Free {
    ctx: Arc<CudaContext>,
    ptr: u64,
}

impl Drop for Free {
    fn drop(&mut self) {
        if !bind_for_drop(&self.ctx) {
            return;
        }
        // SAFETY: `ptr` came from `cuMemAlloc` in this context and is freed
        // once (its `DeviceAlloc` made one `Free`); no region uses it any
        // more (they owned the allocation, which is gone).
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!("freeing GPU memory: {}", describe(e));
        }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let free = Free {
            ctx: self.ctx.clone(),
            ptr: self.ptr,
        };
        holds().defer(
            self.ctx.ordinal() as u32,
            "the cuMemFree of a staging buffer",
            Box::new(free),
        );
    }
}

/// Another process's allocation, opened from its IPC handle; closed on
/// drop.
pub(crate) struct IpcMapping {
    ctx: Arc<CudaContext>,
    base: u64,
    size: u64,
}

impl IpcMapping {
    pub(crate) fn open(
        ordinal: u32,
        handle: &[u8; IPC_HANDLE_BYTES],
    ) -> Result<IpcMapping, TransportError> {
        let ctx = context(ordinal)?;
        bind(&ctx)?;
        let raw = sys::CUipcMemHandle {
            reserved: to_c_chars(handle),
        };
        let mut base = 0u64;
        // SAFETY: `base` is a valid out-pointer; the handle is passed by
        // value; the mapping is closed once, on drop.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| {
            TransportError::Invalid(format!(
                "opening a CUDA IPC handle on cuda:{ordinal}: {} (the owning process may have exited or freed the memory, the handle may be of another GPU, or of this very process)",
                describe(e)
            ))
        })?;
        let mut m = IpcMapping { ctx, base, size: 0 };
        m.size = address_range(&m.ctx, base)?.1;
        Ok(m)
    }
}

/// A `cuIpcCloseMemHandle` to do, when no transfer runs on the device.
struct Close {
    ctx: Arc<CudaContext>,
    base: u64,
}

impl Drop for Close {
    fn drop(&mut self) {
        if !bind_for_drop(&self.ctx) {
            return;
        }
        // SAFETY: `base` came from `cuIpcOpenMemHandle` in this context and
        // is closed once (its `IpcMapping` made one `Close`, after every
        // region of it was gone: they hold the mapping).
        if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.base) }.result() {
            tracing::warn!("closing a CUDA IPC mapping: {}", describe(e));
        }
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let close = Close {
            ctx: self.ctx.clone(),
            base: self.base,
        };
        holds().defer(
            self.ctx.ordinal() as u32,
            "the cuIpcCloseMemHandle of a lent tensor's mapping",
            Box::new(close),
        );
    }
}

/// Who keeps a region's memory alive.
enum Owner {
    Alloc(DeviceAlloc),
    Ipc(Arc<IpcMapping>),
}

/// Device memory the NCCL backend moves: a staging buffer it allocated, or
/// (part of) an allocation another process lent by IPC handle.
pub struct CudaRegion {
    owner: Owner,
    ptr: u64,
    len: u64,
}

impl std::fmt::Debug for CudaRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRegion")
            .field("device", &self.device())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field(
                "owner",
                &match self.owner {
                    Owner::Alloc(_) => "staging",
                    Owner::Ipc(_) => "ipc",
                },
            )
            .finish()
    }
}

impl CudaRegion {
    pub(crate) fn alloc(ordinal: u32, len: u64) -> Result<CudaRegion, TransportError> {
        let a = DeviceAlloc::new(ordinal, len)?;
        Ok(CudaRegion {
            ptr: a.ptr,
            len,
            owner: Owner::Alloc(a),
        })
    }

    /// `len` bytes at `offset` of an opened allocation.
    pub(crate) fn of_ipc(
        m: Arc<IpcMapping>,
        offset: u64,
        len: u64,
    ) -> Result<CudaRegion, TransportError> {
        match offset.checked_add(len) {
            Some(end) if end <= m.size => Ok(CudaRegion {
                ptr: m.base + offset,
                len,
                owner: Owner::Ipc(m),
            }),
            _ => Err(TransportError::Invalid(format!(
                "the tensor at offset {offset} ({len} bytes) overruns its CUDA allocation of {} bytes",
                m.size
            ))),
        }
    }

    fn ctx(&self) -> &Arc<CudaContext> {
        match &self.owner {
            Owner::Alloc(a) => &a.ctx,
            Owner::Ipc(m) => &m.ctx,
        }
    }

    pub fn ordinal(&self) -> u32 {
        self.ctx().ordinal() as u32
    }

    fn range(&self, offset: u64, len: u64) -> Result<u64, TransportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.ptr + offset),
            _ => Err(TransportError::Invalid(format!(
                "bytes {offset}..+{len} are outside a region of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies `src` into the region at `offset` (tests, scenarios).
    pub fn write(&mut self, offset: u64, src: &[u8]) -> Result<(), TransportError> {
        let at = self.range(offset, src.len() as u64)?;
        htod(self.ctx(), at, src)
    }

    /// `len` bytes of the region at `offset` (tests, scenarios).
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, TransportError> {
        let at = self.range(offset, len)?;
        let mut out = vec![0; len as usize];
        dtoh(self.ctx(), &mut out, at)?;
        Ok(out)
    }
}

impl Region for CudaRegion {
    fn len(&self) -> u64 {
        self.len
    }
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal())
    }
    fn host(&self) -> Option<&[u8]> {
        None
    }
    fn host_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
    fn device_ptr(&self) -> Option<u64> {
        Some(self.ptr)
    }
}

// ---- the application side -------------------------------------------------

/// The calling thread's current CUDA context, put back on drop: calls made
/// for an application do not change its current device.
pub(crate) struct KeepCurrent(Option<sys::CUcontext>);

impl KeepCurrent {
    pub(crate) fn new() -> KeepCurrent {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer.
        let ok = unsafe { sys::cuCtxGetCurrent(&mut current) }
            .result()
            .is_ok();
        KeepCurrent(ok.then_some(current))
    }

    /// The context current when this was made (null: none).
    #[cfg(test)]
    pub(crate) fn saved(&self) -> Option<sys::CUcontext> {
        self.0
    }

    /// Leaves the calling thread with no current context (tests).
    #[cfg(test)]
    pub(crate) fn unbind() -> Result<(), DriverError> {
        // SAFETY: unbinding takes no pointer; contexts stay retained.
        unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) }.result()
    }
}

impl Drop for KeepCurrent {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            // SAFETY: `c` was this thread's current context (or null) and a
            // retained primary context outlives the process's calls.
            let _ = unsafe { sys::cuCtxSetCurrent(c) };
        }
    }
}

/// The IPC handle of the allocation holding `device_ptr` on
/// `cuda:{ordinal}`, for `len` bytes from `device_ptr` (memory allocated
/// with `cuMemAlloc`/`cudaMalloc`, as PyTorch's caching allocator does;
/// not virtual-memory-management or pool allocations, which have no IPC
/// handle).
pub fn ipc_mem_handle(
    ordinal: u32,
    device_ptr: u64,
    len: u64,
) -> Result<MemHandle, TransportError> {
    let ctx = context(ordinal)?;
    // The application's current device stays what it was.
    let _keep = KeepCurrent::new();
    let (base, size) = address_range(&ctx, device_ptr)?;
    let offset = device_ptr - base;
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(TransportError::Invalid(format!(
            "{len} bytes at {device_ptr:#x} overrun its allocation ({size} bytes at {base:#x})"
        )));
    }
    let mut raw = sys::CUipcMemHandle {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    // SAFETY: `raw` is a valid out-pointer; `base` is the start of a live
    // allocation of the bound context (cuMemGetAddressRange).
    unsafe { sys::cuIpcGetMemHandle(&mut raw, base) }
        .result()
        .map_err(|e| {
            TransportError::Invalid(format!(
                "no CUDA IPC handle for the allocation at {base:#x}: {}",
                describe(e)
            ))
        })?;
    Ok(MemHandle::CudaIpc {
        handle: super::encode_ipc_handle(&c_bytes(&raw.reserved)),
        offset,
        len,
        device_uuid: Some(device_uuid(ordinal)?),
    })
}

/// Device memory an application owns and lends its agent by IPC handle:
/// what the Rust client (and tests, scenarios) allocate GPU tensors in.
pub struct CudaTensorMem {
    alloc: DeviceAlloc,
    handle: MemHandle,
}

impl std::fmt::Debug for CudaTensorMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTensorMem")
            .field("device", &self.device())
            .field("ptr", &format_args!("{:#x}", self.alloc.ptr))
            .field("len", &self.alloc.len)
            .finish()
    }
}

impl CudaTensorMem {
    /// `len` (> 0) bytes of device memory on `cuda:{ordinal}`, not
    /// initialised.
    pub fn new(ordinal: u32, len: u64) -> Result<CudaTensorMem, TransportError> {
        if len == 0 {
            return Err(TransportError::Invalid(
                "CUDA tensor memory needs at least one byte".into(),
            ));
        }
        let alloc = DeviceAlloc::new(ordinal, len)?;
        let handle = ipc_mem_handle(ordinal, alloc.ptr, len)?;
        Ok(CudaTensorMem { alloc, handle })
    }

    pub fn len(&self) -> u64 {
        self.alloc.len
    }

    pub fn is_empty(&self) -> bool {
        self.alloc.len == 0
    }

    pub fn ordinal(&self) -> u32 {
        self.alloc.ctx.ordinal() as u32
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal())
    }

    pub fn device_ptr(&self) -> u64 {
        self.alloc.ptr
    }

    /// The handle of the whole memory (`MemHandle::CudaIpc`, with the GPU's
    /// UUID).
    pub fn mem_handle(&self) -> MemHandle {
        self.handle.clone()
    }

    /// The handle of `len` bytes at `offset` (a tensor inside a larger
    /// allocation).
    pub fn mem_handle_at(&self, offset: u64, len: u64) -> Result<MemHandle, TransportError> {
        self.range(offset, len)?;
        let mut h = self.handle.clone();
        if let MemHandle::CudaIpc {
            offset: at, len: n, ..
        } = &mut h
        {
            *at += offset;
            *n = len;
        }
        Ok(h)
    }

    fn range(&self, offset: u64, len: u64) -> Result<u64, TransportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.alloc.len => Ok(self.alloc.ptr + offset),
            _ => Err(TransportError::Invalid(format!(
                "bytes {offset}..+{len} are outside CUDA tensor memory of {} bytes",
                self.alloc.len
            ))),
        }
    }

    /// Copies `src` into the memory at `offset`; complete when it returns.
    pub fn write(&mut self, offset: u64, src: &[u8]) -> Result<(), TransportError> {
        let at = self.range(offset, src.len() as u64)?;
        htod(&self.alloc.ctx, at, src)
    }

    /// `len` bytes at `offset`.
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, TransportError> {
        let at = self.range(offset, len)?;
        let mut out = vec![0; len as usize];
        dtoh(&self.alloc.ctx, &mut out, at)?;
        Ok(out)
    }

    /// All of it.
    pub fn to_vec(&self) -> Result<Vec<u8>, TransportError> {
        self.read(0, self.len())
    }
}

impl Region for CudaTensorMem {
    fn len(&self) -> u64 {
        self.alloc.len
    }
    fn device(&self) -> Device {
        CudaTensorMem::device(self)
    }
    fn host(&self) -> Option<&[u8]> {
        None
    }
    fn host_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
    fn device_ptr(&self) -> Option<u64> {
        Some(self.alloc.ptr)
    }
}
