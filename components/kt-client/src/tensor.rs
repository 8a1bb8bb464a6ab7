//! GPU data from Rust: tensors and state dicts, moved by the pod's node agent.
//!
//! The application keeps its memory and lends it to the agent by handle:
//! a [`HostTensor`] lives in a shared-memory file (the host backend), a CUDA
//! tensor in device memory exported as a CUDA IPC handle (the NCCL backend).
//! Anything that can say where its bytes are implements [`Lend`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), kt_client::ClientError> {
//! use kt_client::tensor::{HostTensor, StateDict, TensorClient, TensorOptions};
//! use kt_types::Key;
//! use kt_types::tensor::DType;
//! let mut kt = TensorClient::connect_default("http://kt-metadata:8081", "token").await?;
//! let mut sd = StateDict::new();
//! sd.push("layer0.weight", HostTensor::zeros(DType::F32, &[1024, 1024])?);
//! let key = Key::parse("team/model/weights")?;
//! kt.put_state_dict(&key, &sd, &TensorOptions::default()).await?;
//! // elsewhere: a destination of the same layout, filled in place
//! let mut dest = StateDict::new();
//! dest.push("layer0.weight", HostTensor::zeros(DType::F32, &[1024, 1024])?);
//! kt.get_state_dict(&key, &mut dest, &TensorOptions::default()).await?;
//! # Ok(()) }
//! ```
//!
//! Registrations belong to the registering process: they stay while it
//! lives, and the agent drops them (and unregisters the key) when it exits.

use std::path::Path;

use kt_tensor::shm::ShmFile;
use kt_types::Key;
use kt_types::agent::{ControlReply, ControlRequest};
use kt_types::api::PutOptions;
use kt_types::model::BroadcastWindow;
use kt_types::tensor::{
    DType, Device, FromPutters, GetTensors, MemHandle, Packing, PutTensors, ReduceOp, TensorEntry,
    TensorGet, TensorMeta, TensorRegistration, TensorStats, TensorsPut,
};

use crate::ClientError;
use crate::agent::AgentConn;

/// Memory that can be lent to the agent.
pub trait Lend {
    fn meta(&self) -> &TensorMeta;
    fn device(&self) -> Device;
    fn handle(&self) -> MemHandle;
}

fn entry(name: &str, t: &impl Lend) -> TensorEntry {
    TensorEntry {
        name: name.to_owned(),
        meta: t.meta().clone(),
        device: t.device(),
        mem: t.handle(),
    }
}

/// Memory someone else owns, described by its handle: what a client in
/// another language (the Python package) lends, keeping the memory alive
/// itself for as long as the agent may use it.
#[derive(Debug, Clone)]
pub struct Borrowed {
    meta: TensorMeta,
    device: Device,
    handle: MemHandle,
}

impl Borrowed {
    /// `handle`'s range must hold `meta`'s bytes exactly.
    pub fn new(meta: TensorMeta, device: Device, handle: MemHandle) -> Result<Self, ClientError> {
        let want = meta.nbytes().map_err(local)?;
        let have = match &handle {
            MemHandle::Shm { len, .. } | MemHandle::CudaIpc { len, .. } => *len,
        };
        if want != have {
            return Err(local(format!(
                "a {} tensor holds {want} bytes, its memory {have}",
                meta
            )));
        }
        Ok(Borrowed {
            meta,
            device,
            handle,
        })
    }

    /// CUDA memory of this process at `device_ptr` on `cuda:{ordinal}`
    /// (PyTorch's allocator, say), lent by the IPC handle of its allocation
    /// (feature `cuda`).
    #[cfg(feature = "cuda")]
    pub fn cuda(meta: TensorMeta, ordinal: u32, device_ptr: u64) -> Result<Self, ClientError> {
        let len = meta.nbytes().map_err(local)?;
        let handle = kt_tensor::cuda::ipc_mem_handle(ordinal, device_ptr, len).map_err(local)?;
        Self::new(meta, Device::Cuda(ordinal), handle)
    }
}

impl Lend for Borrowed {
    fn meta(&self) -> &TensorMeta {
        &self.meta
    }
    fn device(&self) -> Device {
        self.device
    }
    fn handle(&self) -> MemHandle {
        self.handle.clone()
    }
}

/// A CPU tensor in a shared-memory file of the agent's shared-memory
/// directory (as this process's agent named it when connected, else
/// `KT_SHM_DIR`, default `/dev/shm`), removed when dropped.
#[derive(Debug)]
pub struct HostTensor {
    meta: TensorMeta,
    mem: ShmFile,
}

fn local(e: impl std::fmt::Display) -> ClientError {
    ClientError::Local(e.to_string())
}

impl HostTensor {
    /// A zero-filled tensor in the shared-memory directory
    /// ([`kt_tensor::shm::lend_dir`]).
    pub fn zeros(dtype: DType, shape: &[u64]) -> Result<Self, ClientError> {
        Self::zeros_in(&kt_tensor::shm::lend_dir(), dtype, shape)
    }

    pub fn zeros_in(dir: &Path, dtype: DType, shape: &[u64]) -> Result<Self, ClientError> {
        let meta = TensorMeta::new(dtype, shape);
        let len = meta.nbytes().map_err(local)?;
        let mem = ShmFile::create(dir, len).map_err(local)?;
        Ok(HostTensor { meta, mem })
    }

    pub fn bytes(&self) -> &[u8] {
        self.mem.as_slice()
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.mem.as_mut_slice()
    }
}

impl Lend for HostTensor {
    fn meta(&self) -> &TensorMeta {
        &self.meta
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn handle(&self) -> MemHandle {
        self.mem.handle(0, self.mem.len())
    }
}

/// A CUDA tensor in device memory of this process, lent by CUDA IPC handle
/// (feature `cuda`; the driver is loaded at run time, so without one this is
/// an error, not a crash). Memory allocated elsewhere (PyTorch's, say) is
/// lent with [`kt_tensor::cuda::ipc_mem_handle`] through a `Lend` of its own.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct CudaTensor {
    meta: TensorMeta,
    mem: kt_tensor::cuda::CudaTensorMem,
}

#[cfg(feature = "cuda")]
impl CudaTensor {
    /// A tensor on `cuda:{ordinal}`, zero-filled.
    pub fn zeros(ordinal: u32, dtype: DType, shape: &[u64]) -> Result<Self, ClientError> {
        let meta = TensorMeta::new(dtype, shape);
        let len = meta.nbytes().map_err(local)?;
        let mut mem = kt_tensor::cuda::CudaTensorMem::new(ordinal, len.max(1)).map_err(local)?;
        mem.write(0, &vec![0; len.max(1) as usize]).map_err(local)?;
        Ok(CudaTensor { meta, mem })
    }

    /// Copies `bytes` (the tensor's size) from the host into the tensor.
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.mem.write(0, bytes).map_err(local)
    }

    /// The tensor's bytes, copied to the host.
    pub fn to_vec(&self) -> Result<Vec<u8>, ClientError> {
        let n = self.meta.nbytes().map_err(local)?;
        self.mem.read(0, n).map_err(local)
    }
}

#[cfg(feature = "cuda")]
impl Lend for CudaTensor {
    fn meta(&self) -> &TensorMeta {
        &self.meta
    }
    fn device(&self) -> Device {
        self.mem.device()
    }
    fn handle(&self) -> MemHandle {
        match self.mem.mem_handle() {
            // The tensor's own size (an empty tensor holds one byte).
            MemHandle::CudaIpc {
                handle,
                offset,
                device_uuid,
                ..
            } => MemHandle::CudaIpc {
                handle,
                offset,
                len: self.meta.nbytes().unwrap_or(0),
                device_uuid,
            },
            other => other,
        }
    }
}

/// A state dict: named tensors, in order.
#[derive(Debug)]
pub struct StateDict<T> {
    items: Vec<(String, T)>,
}

impl<T> Default for StateDict<T> {
    fn default() -> Self {
        StateDict { items: Vec::new() }
    }
}

impl<T> StateDict<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, name: impl Into<String>, t: T) {
        self.items.push((name.into(), t));
    }

    pub fn get(&self, name: &str) -> Option<&T> {
        self.items.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &T)> {
        self.items.iter().map(|(n, t)| (n.as_str(), t))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut T)> {
        self.items.iter_mut().map(|(n, t)| (n.as_str(), t))
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl<T: Lend> StateDict<T> {
    fn entries(&self) -> Vec<TensorEntry> {
        self.items.iter().map(|(n, t)| entry(n, t)).collect()
    }
}

impl<T, S: Into<String>> FromIterator<(S, T)> for StateDict<T> {
    fn from_iter<I: IntoIterator<Item = (S, T)>>(iter: I) -> Self {
        StateDict {
            items: iter.into_iter().map(|(n, t)| (n.into(), t)).collect(),
        }
    }
}

/// How a put or get moves: lifespan options, broadcast window, packing.
#[derive(Debug, Clone, Default)]
pub struct TensorOptions {
    /// Lifespan, TTL and service of a put.
    pub put: PutOptions,
    /// Join a quorum: putters and getters of the window's group move in one
    /// coordinated transfer (`pack` in the window packs it).
    pub broadcast: Option<BroadcastWindow>,
    /// Point-to-point gets: packing (default packed).
    pub packing: Option<Packing>,
    /// Gets into CUDA memory: the agent keeps the destination's IPC
    /// mappings open after the get (until this process ends), for loops
    /// that get into the same memory again ([`GetTensors::keep_mapped`]).
    pub keep_mapped: bool,
    /// Quorum membership: a label telling this caller apart from other
    /// callers of the same process ([`PutTensors::member`]), for a process
    /// that drives several GPUs from threads, each its own rank. `None`:
    /// the process is one member (a second join of it to an open round is
    /// refused).
    pub member: Option<String>,
}

/// A control connection to the pod's agent for GPU data. Keep it for the
/// life of the process: registrations the agent cannot tie to a pid (the
/// agent in another pid namespace) live as long as this connection.
#[derive(Debug)]
pub struct TensorClient {
    conn: AgentConn,
}

fn unexpected(r: ControlReply) -> ClientError {
    local(format!("unexpected reply from the node agent: {r:?}"))
}

impl TensorClient {
    /// Connects to the agent at `socket`, starting one when none runs.
    pub async fn connect(
        socket: &Path,
        metadata_url: &str,
        token: &str,
    ) -> Result<Self, ClientError> {
        let conn = AgentConn::connect_or_start(socket, metadata_url, token).await?;
        Ok(TensorClient { conn })
    }

    /// [`TensorClient::connect`] at `KT_AGENT_SOCKET` (or the default socket).
    pub async fn connect_default(metadata_url: &str, token: &str) -> Result<Self, ClientError> {
        Self::connect(&crate::agent::default_socket(), metadata_url, token).await
    }

    /// The agent's id (its pod's name).
    pub fn agent(&self) -> &str {
        &self.conn.id
    }

    async fn put(
        &mut self,
        key: &Key,
        tensors: Vec<TensorEntry>,
        opts: &TensorOptions,
    ) -> Result<TensorsPut, ClientError> {
        let req = ControlRequest::PutTensors(PutTensors {
            key: key.clone(),
            tensors,
            options: opts.put.clone(),
            broadcast: opts.broadcast.clone(),
            member: opts.member.clone(),
        });
        match self.conn.request(&req).await? {
            ControlReply::TensorsPut(p) => Ok(p),
            r => Err(unexpected(r)),
        }
    }

    /// Registers one tensor under `key` (an unnamed set of one).
    pub async fn put_tensor(
        &mut self,
        key: &Key,
        t: &impl Lend,
        opts: &TensorOptions,
    ) -> Result<TensorsPut, ClientError> {
        self.put(key, vec![entry("", t)], opts).await
    }

    pub async fn put_state_dict<T: Lend>(
        &mut self,
        key: &Key,
        sd: &StateDict<T>,
        opts: &TensorOptions,
    ) -> Result<TensorsPut, ClientError> {
        self.put(key, sd.entries(), opts).await
    }

    /// Receives `key` into `dest` (whose dtype and shape must match).
    pub async fn get_tensor(
        &mut self,
        key: &Key,
        dest: &mut impl Lend,
        opts: &TensorOptions,
    ) -> Result<TensorStats, ClientError> {
        self.get(vec![(key.clone(), vec![entry("", &*dest)])], opts)
            .await
    }

    /// Receives `key` into `dest`, tensor by tensor (same names, order,
    /// dtypes and shapes).
    pub async fn get_state_dict<T: Lend>(
        &mut self,
        key: &Key,
        dest: &mut StateDict<T>,
        opts: &TensorOptions,
    ) -> Result<TensorStats, ClientError> {
        self.get(vec![(key.clone(), dest.entries())], opts).await
    }

    /// Several keys in one request: one transfer per source (point to
    /// point), or one quorum membership (broadcast).
    pub async fn get_many<T: Lend>(
        &mut self,
        gets: &mut [(Key, &mut StateDict<T>)],
        opts: &TensorOptions,
    ) -> Result<TensorStats, ClientError> {
        let gets = gets
            .iter()
            .map(|(k, sd)| (k.clone(), sd.entries()))
            .collect();
        self.get(gets, opts).await
    }

    /// Every putter's tensors of `key` in a quorum (`opts.broadcast` is
    /// needed) where several putters put it: `dests[i]` receives the
    /// putter of the i-th lowest rank, and the key must have exactly
    /// `dests.len()` putters. [`TensorStats::sources`] says which rank and
    /// pod each came from.
    pub async fn get_all<T: Lend>(
        &mut self,
        key: &Key,
        dests: &mut [StateDict<T>],
        opts: &TensorOptions,
    ) -> Result<TensorStats, ClientError> {
        let count = u32::try_from(dests.len()).unwrap_or(u32::MAX);
        let sets = dests.iter().map(StateDict::entries).collect();
        self.get_from(key, sets, FromPutters::All { count }, opts)
            .await
    }

    /// The tensors of some putters of `key` in a quorum, by their rank in
    /// the plan (putters take the first ranks, ordered by their first key,
    /// then pod, then process): each `(rank, dest)` receives that rank's.
    pub async fn get_by_rank<T: Lend>(
        &mut self,
        key: &Key,
        dests: &mut [(u32, StateDict<T>)],
        opts: &TensorOptions,
    ) -> Result<TensorStats, ClientError> {
        let ranks = dests.iter().map(|(r, _)| *r).collect();
        let sets = dests.iter().map(|(_, sd)| sd.entries()).collect();
        self.get_from(key, sets, FromPutters::ByRank { ranks }, opts)
            .await
    }

    /// The reduction (`op`) of every putter's tensors of `key` in a quorum,
    /// into `dest` ([`ReduceOp`] says which dtypes each takes).
    pub async fn get_reduced<T: Lend>(
        &mut self,
        key: &Key,
        dest: &mut StateDict<T>,
        op: ReduceOp,
        opts: &TensorOptions,
    ) -> Result<TensorStats, ClientError> {
        let sets = vec![dest.entries()];
        self.get_from(key, sets, FromPutters::Reduce { op }, opts)
            .await
    }

    /// A quorum get of `key` from several putters (`from`) into `sets`
    /// (what the other `get_*` of several putters lend): one set per putter
    /// asked for, or one for a reduction.
    pub async fn get_from(
        &mut self,
        key: &Key,
        sets: Vec<Vec<TensorEntry>>,
        from: FromPutters,
        opts: &TensorOptions,
    ) -> Result<TensorStats, ClientError> {
        let mut sets = sets.into_iter();
        let dest = sets
            .next()
            .ok_or_else(|| local(format!("{key}: no destination to receive into")))?;
        let get = TensorGet {
            key: key.clone(),
            dest,
            from: Some(from),
            more: sets.collect(),
        };
        self.request_get(vec![get], opts).await
    }

    async fn get(
        &mut self,
        gets: Vec<(Key, Vec<TensorEntry>)>,
        opts: &TensorOptions,
    ) -> Result<TensorStats, ClientError> {
        let gets = gets
            .into_iter()
            .map(|(key, dest)| TensorGet {
                key,
                dest,
                from: None,
                more: Vec::new(),
            })
            .collect();
        self.request_get(gets, opts).await
    }

    async fn request_get(
        &mut self,
        gets: Vec<TensorGet>,
        opts: &TensorOptions,
    ) -> Result<TensorStats, ClientError> {
        let req = ControlRequest::GetTensors(GetTensors {
            gets,
            broadcast: opts.broadcast.clone(),
            packing: opts.packing,
            keep_mapped: opts.keep_mapped,
            member: opts.member.clone(),
        });
        match self.conn.request(&req).await? {
            ControlReply::TensorsGot { stats } => Ok(stats),
            r => Err(unexpected(r)),
        }
    }

    /// Drops this process's registration of `key` (and the key).
    pub async fn drop_tensors(&mut self, key: &Key) -> Result<(), ClientError> {
        match self
            .conn
            .request(&ControlRequest::DropTensors { key: key.clone() })
            .await?
        {
            ControlReply::TensorsDropped { .. } => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// Withdraws this process's broadcast puts of `key` still waiting for
    /// their quorum (one its caller interrupted, on another connection of
    /// the process); how many were.
    pub async fn withdraw_put(&mut self, key: &Key) -> Result<u32, ClientError> {
        match self
            .conn
            .request(&ControlRequest::WithdrawPut { key: key.clone() })
            .await?
        {
            ControlReply::PutWithdrawn { joins, .. } => Ok(joins),
            r => Err(unexpected(r)),
        }
    }

    /// What the agent holds.
    pub async fn registrations(&mut self) -> Result<Vec<TensorRegistration>, ClientError> {
        match self.conn.request(&ControlRequest::Status).await? {
            ControlReply::Status { tensors, .. } => Ok(tensors),
            r => Err(unexpected(r)),
        }
    }
}

/// Test and scenario data: layouts and deterministic contents.
pub mod layout {
    use kt_types::tensor::{DType, TensorMeta};

    /// Parses `name=dtype[d0,d1];...` (or one unnamed `dtype[d0,...]`),
    /// repeated `repeat` times with names suffixed `.0`, `.1`, ...
    pub fn parse(spec: &str, repeat: u32) -> Result<Vec<(String, TensorMeta)>, String> {
        let mut one = Vec::new();
        for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, t) = match item.split_once('=') {
                Some((n, t)) => (n.trim().to_owned(), t.trim()),
                None => (String::new(), item),
            };
            let (dtype, dims) = t
                .strip_suffix(']')
                .and_then(|t| t.split_once('['))
                .ok_or_else(|| format!("{item:?}: expected dtype[d0,d1,...]"))?;
            let dtype: DType = dtype.trim().parse()?;
            let shape = dims
                .split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .map(|d| {
                    d.parse::<u64>()
                        .map_err(|_| format!("{item:?}: bad dimension {d:?}"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let meta = TensorMeta::new(dtype, shape);
            meta.nbytes().map_err(|e| format!("{item:?}: {e}"))?;
            one.push((name, meta));
        }
        if one.is_empty() {
            return Err("empty layout".into());
        }
        if one.len() > 1 && one.iter().any(|(n, _)| n.is_empty()) {
            return Err("a layout of several tensors names each (name=dtype[...])".into());
        }
        if repeat <= 1 {
            return Ok(one);
        }
        Ok((0..repeat)
            .flat_map(|i| {
                one.iter().map(move |(n, m)| {
                    let name = if n.is_empty() {
                        i.to_string()
                    } else {
                        format!("{n}.{i}")
                    };
                    (name, m.clone())
                })
            })
            .collect())
    }

    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn stream_seed(seed: u64, name: &str) -> u64 {
        name.bytes()
            .fold(mix(seed ^ 0x6b74_7465_6e73_6f72), |h, b| {
                mix(h ^ u64::from(b))
            })
    }

    /// The byte stream of one tensor (splitmix64); written a window at a
    /// time, windows of whole words continuing the same stream.
    struct Stream(u64);

    impl Stream {
        fn new(seed: u64, name: &str) -> Self {
            Stream(stream_seed(seed, name))
        }

        fn write(&mut self, out: &mut [u8]) {
            for c in out.chunks_mut(8) {
                self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let b = mix(self.0).to_le_bytes();
                c.copy_from_slice(&b[..c.len()]);
            }
        }
    }

    /// Deterministic bytes of tensor `name` for `seed`.
    pub fn fill(seed: u64, name: &str, out: &mut [u8]) {
        Stream::new(seed, name).write(out);
    }

    /// The first byte where `got` differs from what [`fill`] writes.
    pub fn first_difference(seed: u64, name: &str, got: &[u8]) -> Option<usize> {
        let mut want = vec![0u8; got.len().min(1 << 20)];
        let mut stream = Stream::new(seed, name);
        let mut at = 0;
        while at < got.len() {
            let n = want.len().min(got.len() - at);
            stream.write(&mut want[..n]);
            if let Some(i) = want[..n]
                .iter()
                .zip(&got[at..at + n])
                .position(|(a, b)| a != b)
            {
                return Some(at + i);
            }
            at += n;
        }
        None
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn layouts_parse_and_repeat() {
            let l = parse("w=f32[256,256]; b=f16[256]", 2).unwrap();
            let names: Vec<&str> = l.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["w.0", "b.0", "w.1", "b.1"]);
            assert_eq!(l[1].1, TensorMeta::new(DType::F16, [256]));
            let one = parse("bf16[3,4]", 1).unwrap();
            assert_eq!(
                one,
                vec![(String::new(), TensorMeta::new(DType::Bf16, [3, 4]))]
            );
            assert!(parse("w=f32[2", 1).is_err());
            assert!(parse("w=c64[2]", 1).is_err());
            assert!(parse("f32[2];f32[3]", 1).is_err());
            assert!(parse("", 1).is_err());
        }

        #[test]
        fn contents_are_deterministic_and_checked_across_windows() {
            let mut a = vec![0u8; (3 << 20) + 5];
            fill(7, "w", &mut a);
            let mut b = vec![0u8; a.len()];
            fill(7, "w", &mut b);
            assert_eq!(a, b);
            assert_eq!(first_difference(7, "w", &a), None);
            a[(2 << 20) + 3] ^= 1;
            assert_eq!(first_difference(7, "w", &a), Some((2 << 20) + 3));
            assert!(first_difference(8, "w", &b).is_some());
            assert!(first_difference(7, "v", &b).is_some());
        }
    }
}
